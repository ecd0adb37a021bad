"""Generation-quality metrics for LiDAR sweeps, matching the numbers the field reports.

BEV JSD / MMD follow LiDARGen (Zyrianov et al., ECCV 2022; github.com/vzyrianov/lidargen,
`metrics/histogram/{histogram,hist_utils,jsd,dist_helper}.py`) and R2DM (Nakashima & Kurazume, ICRA 2024;
github.com/kazuto1011/r2dm, `metrics/bev.py`), which re-implements LiDARGen's protocol:

- keep points with 3 m < range < 70 m, range = the xyz norm (both strict);
- histogram x, y into 100 x 100 bins over [-80, 80]^2 m (`np.histogramdd` semantics: half-open bins,
  the last one closed; hist[i, j] counts x-bin i, y-bin j). Edges are float64 as in LiDARGen; R2DM's
  float32 `torch.histogramdd` can put a point lying exactly on an edge into the neighbouring bin;
- JSD: sum each set's histograms, normalise each sum to a pmf, then the Jensen-Shannon *distance* with
  natural logs, i.e. `scipy.spatial.distance.jensenshannon(p, q)` = sqrt(JS divergence), range [0, sqrt(ln 2)];
  both papers report this distance under the name "JSD";
- MMD: normalise each scan's histogram to a pmf, Gaussian kernel k(p, q) = exp(-||p - q||^2 / (2 sigma^2))
  with sigma = 0.5 on the flattened (Euclidean) distance, biased estimate
  mean K(A, A) + mean K(B, B) - 2 mean K(A, B) (diagonals included), reported without a square root,
  exactly as R2DM's `compute_mmd_2d`. LiDARGen's `gaussian` calls `np.linalg.norm(x - y, 2)` on the
  unflattened 100 x 100 arrays, which numpy evaluates as the matrix spectral norm; we follow R2DM's
  Euclidean norm, the quantity the papers describe.

Forecast accuracy against the ground truth of the same pose follows the point-cloud forecasting protocol
of Khurana et al. (CVPR 2023, github.com/tarashakhurana/4d-occ-forecasting, also used by Copilot4D):
`per_ray_errors` (L1 mean/median, AbsRel per ground-truth ray, plus coverage and return-mask IoU) and
`forecast_chamfer` (squared nearest-neighbour distances both ways, halved, inside +-70 m x/y, +-4.5 m z).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from scipy.spatial import cKDTree
from scipy.spatial.distance import cdist
from scipy.special import rel_entr

from lidar.range_image import RangeImage

logger = logging.getLogger(__name__)

#: LiDARGen / R2DM BEV protocol constants (see the module docstring).
BEV_MIN_RANGE = 3.0
BEV_MAX_RANGE = 70.0
BEV_FIELD_SIZE = 160.0
BEV_BINS = 100
MMD_SIGMA = 0.5
#: Point-cloud forecasting crop (Khurana et al. 2023): |x|, |y| <= 70 m and |z| <= 4.5 m in the sensor frame.
FORECAST_CROP_XY = 70.0
FORECAST_CROP_Z = 4.5


def _xyz(points: np.ndarray, what: str) -> np.ndarray:
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"{what} must be an (N, 3+) point array (x, y, z, ...), got shape {pts.shape}")
    return pts[:, :3].astype(np.float64)


def _as_set(items: Sequence[np.ndarray] | np.ndarray, what: str) -> list:
    """A set of scans: a list/tuple of arrays or a stacked (B, ...) array; never empty."""
    if isinstance(items, np.ndarray) and items.ndim < 3:
        raise ValueError(
            f"{what} must be a set of scans (a list, or a stacked (B, ...) array), got one array of shape "
            f"{items.shape}; wrap a single scan in a list"
        )
    out = list(items)
    if not out:
        raise ValueError(f"{what} is empty; expected at least one scan")
    return out


def bev_histogram(
    points: np.ndarray,
    min_range: float = BEV_MIN_RANGE,
    max_range: float = BEV_MAX_RANGE,
    field_size: float = BEV_FIELD_SIZE,
    bins: int = BEV_BINS,
) -> np.ndarray:
    """Bird's-eye-view point counts (bins, bins) float64 of one scan, by the LiDARGen/R2DM protocol.

    The defaults are the published protocol; change them only to study the metric itself.
    """
    xyz = _xyz(points, "points")
    depth = np.linalg.norm(xyz, axis=1)
    keep = (depth > min_range) & (depth < max_range)  # NaN rows fail both tests and drop out
    bound = field_size / 2.0
    hist, _, _ = np.histogram2d(
        xyz[keep, 0], xyz[keep, 1], bins=bins, range=[[-bound, bound], [-bound, bound]]
    )
    return hist


def _normalise_rows(hists: np.ndarray, what: str) -> np.ndarray:
    totals = hists.sum(axis=1, keepdims=True)
    empty = np.flatnonzero(totals[:, 0] <= 0)
    if empty.size:
        raise ValueError(
            f"{what}: scan(s) {empty[:10].tolist()} have no points inside the histogram window, so they have "
            "no distribution; drop them or check the frame/units (metres, sensor at the origin)"
        )
    return hists / totals


def histogram_jsd(hists_a: np.ndarray, hists_b: np.ndarray) -> float:
    """Natural-log Jensen-Shannon distance between the set-summed, normalised histograms of two sets.

    Equals `scipy.spatial.distance.jensenshannon(sum_a / sum_a.sum(), sum_b / sum_b.sum())`; this is the
    distance (sqrt of the divergence) that LiDARGen and R2DM report as "JSD". Inputs are (B, ...) stacks.
    """
    p = np.asarray(hists_a, dtype=np.float64).reshape(len(hists_a), -1).sum(axis=0)
    q = np.asarray(hists_b, dtype=np.float64).reshape(len(hists_b), -1).sum(axis=0)
    if p.shape != q.shape:
        raise ValueError(f"histogram sets have different bin counts: {p.size} vs {q.size}")
    if p.sum() <= 0 or q.sum() <= 0:
        raise ValueError("a histogram set is empty (all bins zero); nothing to compare")
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)
    js = 0.5 * (rel_entr(p, m).sum() + rel_entr(q, m).sum())
    return float(np.sqrt(max(js, 0.0)))


def histogram_mmd(hists_a: np.ndarray, hists_b: np.ndarray, sigma: float = MMD_SIGMA) -> float:
    """Biased squared MMD between two sets of per-scan histograms, Gaussian kernel on their pmfs.

    Each histogram is flattened and normalised to sum 1; the result is not square-rooted (as published).
    """
    a = _normalise_rows(np.asarray(hists_a, dtype=np.float64).reshape(len(hists_a), -1), "set A")
    b = _normalise_rows(np.asarray(hists_b, dtype=np.float64).reshape(len(hists_b), -1), "set B")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"histogram sets have different bin counts: {a.shape[1]} vs {b.shape[1]}")
    gamma = 1.0 / (2.0 * sigma**2)

    def mean_kernel(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.exp(-gamma * cdist(x, y, "sqeuclidean")).mean())

    return mean_kernel(a, a) + mean_kernel(b, b) - 2.0 * mean_kernel(a, b)


def _bev_stack(points_set: Sequence[np.ndarray], what: str) -> np.ndarray:
    hists = np.stack([bev_histogram(p) for p in _as_set(points_set, what)])
    logger.debug("%s: %d BEV histograms, %d points in the window", what, len(hists), int(hists.sum()))
    return hists


def bev_jsd(points_set_a: Sequence[np.ndarray], points_set_b: Sequence[np.ndarray]) -> float:
    """BEV JSD (LiDARGen/R2DM): Jensen-Shannon distance, natural log, of the two sets' summed BEV histograms."""
    return histogram_jsd(_bev_stack(points_set_a, "points_set_a"), _bev_stack(points_set_b, "points_set_b"))


def bev_mmd(points_set_a: Sequence[np.ndarray], points_set_b: Sequence[np.ndarray]) -> float:
    """BEV MMD (LiDARGen/R2DM): biased squared MMD, Gaussian sigma = 0.5, over per-scan BEV pmfs."""
    return histogram_mmd(_bev_stack(points_set_a, "points_set_a"), _bev_stack(points_set_b, "points_set_b"))


def _nearest_distances(a: np.ndarray, b: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Each point's distance to the other cloud's nearest point (a->b, b->a), shared by both Chamfer forms."""
    xa, xb = _xyz(a, "a"), _xyz(b, "b")
    if len(xa) == 0 or len(xb) == 0:
        raise ValueError(f"{what} needs non-empty clouds, got {len(xa)} and {len(xb)} points")
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise ValueError(f"{what} got non-finite coordinates; drop NaN/inf points first")
    d_ab, _ = cKDTree(xb).query(xa, k=1)
    d_ba, _ = cKDTree(xa).query(xb, k=1)
    return d_ab, d_ba


def chamfer_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Symmetric Chamfer distance in metres (NOT squared): mean over both directions of NN distances.

    CD = 0.5 * (mean_{p in a} min_{q in b} |p - q| + mean_{q in b} min_{p in a} |p - q|), on xyz only.
    Plain metres keep it readable as "average surface disagreement" between consecutive or re-simulated
    sweeps; `forecast_chamfer` is the squared, cropped form the forecasting papers report.
    """
    d_ab, d_ba = _nearest_distances(a, b, "chamfer_distance")
    return float(0.5 * (d_ab.mean() + d_ba.mean()))


def in_crop(points: np.ndarray, half_xy: float = FORECAST_CROP_XY, half_z: float = FORECAST_CROP_Z) -> np.ndarray:
    """Mask of the points inside the box |x|, |y| <= half_xy, |z| <= half_z (sensor frame, bounds inclusive)."""
    xyz = _xyz(points, "points")
    return (np.abs(xyz[:, :2]) <= half_xy).all(axis=1) & (np.abs(xyz[:, 2]) <= half_z)


def forecast_chamfer(
    pred: np.ndarray, gt: np.ndarray, half_xy: float = FORECAST_CROP_XY, half_z: float = FORECAST_CROP_Z
) -> float:
    """Point-cloud forecasting Chamfer distance in m^2 (Khurana et al. 2023, `compute_chamfer_distance_inner`).

    Both clouds (sensor frame of the target pose) are cropped to the box of `in_crop`; then
    CD = 0.5 * (mean_{p in pred} min_q |p - q|^2 + mean_{q in gt} min_p |p - q|^2). Squared distances
    punish blur and misplaced surfaces far more than the plain-metre `chamfer_distance`, which is why
    the forecasting literature (4D occupancy forecasting, Copilot4D) reports this form. The reference
    returns 0 when a crop is empty, which would score an empty forecast as perfect; here it is an error.
    """
    p, g = _xyz(pred, "pred"), _xyz(gt, "gt")
    p, g = p[in_crop(p, half_xy, half_z)], g[in_crop(g, half_xy, half_z)]
    if len(p) == 0 or len(g) == 0:
        raise ValueError(
            f"forecast_chamfer: {len(p)} predicted and {len(g)} ground-truth points lie inside the "
            f"+-{half_xy} m x/y, +-{half_z} m z crop; both need at least one (sensor-frame points?)"
        )
    d_pg, d_gp = _nearest_distances(p, g, "forecast_chamfer")
    return float(0.5 * (np.mean(d_pg**2) + np.mean(d_gp**2)))


def _range_array(image: RangeImage | np.ndarray, what: str) -> np.ndarray:
    arr = image.range if isinstance(image, RangeImage) else np.asarray(image)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{what} must be a RangeImage or an (H, W) range array in metres, got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError(f"{what} holds negative or non-finite ranges; 0 means no return")
    return arr.astype(np.float64)


def per_ray_errors(pred: RangeImage | np.ndarray, gt: RangeImage | np.ndarray) -> dict[str, float]:
    """Per-ray depth errors of a forecast against the ground truth on one range-image grid (0 = no return).

    Following the ray-based protocol of Khurana et al. 2023, every ground-truth ray that returns is a
    query. Depth errors (`l1_mean`, `l1_median` in m, `absrel` = mean |pred - gt| / gt) are taken over
    the queries where the prediction also returns, and `coverage` is that share of the queries: a
    missing return is a hole, which `iou` (of the two return masks) and Chamfer measure, not a huge
    depth error. Depth errors are NaN when nothing is covered.
    """
    p, g = _range_array(pred, "pred"), _range_array(gt, "gt")
    if p.shape != g.shape:
        raise ValueError(f"pred is {p.shape} but gt is {g.shape}; project both onto one sensor grid")
    query, hit = g > 0, p > 0
    if not query.any():
        raise ValueError("gt has no returns, so there is no ray to measure")
    both = query & hit
    err = np.abs(p[both] - g[both])
    return {
        "l1_mean": float(err.mean()) if err.size else float("nan"),
        "l1_median": float(np.median(err)) if err.size else float("nan"),
        "absrel": float((err / g[both]).mean()) if err.size else float("nan"),
        "coverage": float(both.sum() / query.sum()),
        "iou": float(both.sum() / (query | hit).sum()),
    }

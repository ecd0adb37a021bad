"""Each point's beam (ring) from the points alone: the scan order where it is kept, elevation clusters otherwise.

Files without a ring field still carry it. Many store a sweep ring by ring (KITTI): one beam's revolution,
then the next, so the azimuth turns once per ring and the ring is the number of turns so far. A sweep is cut
at one azimuth for every beam (KITTI: straight ahead, where the cameras are triggered), not at the +-180 deg
wrap of atan2, so the turns are counted from that cut, which is found as the azimuth where consecutive points
jump between beams. Other files keep no usable order (firing order, a shuffle, a deskewed merge); then each
beam is a peak of the elevation histogram.

An HDL-64E's upper lasers sit about 0.2 m above the optical centre, so a return at 10 m reads 1.2 deg higher
than one at 50 m on the same beam, more than the beams' 0.33 deg spacing. Clustering therefore measures the
elevation from a centre raised by the height that makes the histogram sharpest (0 for sensors without the
offset), finds the beam table there, and gives every point the nearest beam.

Recovered rings are numbered by elevation, 0 the highest beam, the order `lidar.sensors.Sensor` uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lidar.range_image import off_origin, point_ranges
from lidar.rows import take_rows

#: How a scan's ring was obtained (`Scan.ring_source`): the file's own ring field, the pixel order of an
#: organised H x W dump, the order a ring-by-ring sweep is stored in, or clusters of elevation.
RING_FROM_FILE = "file"
RING_FROM_ORGANISED = "organised"
RING_FROM_SCAN_ORDER = "scan order"
RING_FROM_CLUSTERS = "elevation clusters"

#: The most beams any spinning LiDAR has (Ouster and Hesai top out at 128; room for 256-channel designs).
MAX_BEAMS = 256
#: Returns nearer than this are skipped when measuring: the sensor's blind zone and the car's own body.
MIN_RANGE_M = 2.0
#: Columns per revolution a spinning LiDAR can have: a scan-order step outside this is not one firing.
COLUMN_RANGE = (64, 20_000)
#: A sweep is stored ring by ring when this share of consecutive steps go forward by at most
#: `_MAX_STEPS` typical steps (KITTI: 99.5 %; a shuffle steps anywhere).
_MIN_FORWARD = 0.9
_MAX_STEPS = 10.0
#: A step within this of zero (rad, a hundredth of the finest column) is a second return of the same firing: a
#: dual-return sensor's, or one return stored twice (a world model's frame keeps a measurement's duplicates),
#: whose azimuth differs from the first's by rounding only.
_SAME_FIRING_RAD = 0.01 * 2.0 * np.pi / COLUMN_RANGE[1]
#: At least this share of the steps move on to another firing: ring by ring all do but the second returns
#: (half the steps where every firing stores two), firing order one in each column's beams (1/16 to 1/128).
_MIN_MOVING = 0.4
#: A step this far backwards passes over azimuths without returns (KITTI's camera-view files jump back by
#: the crop's 80 deg, each ring covering only the view); a full sweep's near returns step back at most ~7 deg.
_UNSEEN_JUMP = np.radians(20.0)
#: Fewer returns than this past the last full ring are that ring's, scattered across the cut by jitter.
_MIN_RING_POINTS = 5
#: Where the sweep's cut may lie before its first point: a beam may have no return for a few degrees there.
_CUT_SEARCH = np.radians(np.arange(-0.5, 20.0, 0.05))

#: Elevation histogram for clustering (deg): bin width and smoothing, fine enough for 0.167 deg spacing (a
#: Pandar64's middle); 0.125 deg apart the histogram between beams falls only to 0.64 and they are refused.
_BIN_DEG = 0.02
_SMOOTH_DEG = 0.04
#: Two peaks are one beam unless the histogram between them dips below this share of the lower peak.
_MAX_DIP = 0.7
#: A beam needs this many far returns (or this share of them) to count; fewer is noise between beams.
_MIN_BEAM_POINTS = 20
_MIN_BEAM_SHARE = 2e-4
#: Heights (m) of the elevation centre tried: laser offsets above or below the optical centre.
_CENTRE_HEIGHTS = np.linspace(-0.4, 0.4, 17)
#: Far returns used to choose the centre height: enough for a sharp histogram, few enough to be quick.
_CENTRE_SAMPLE = 20_000
#: Clusters are beams when the histogram between neighbours falls at least this far (median over the
#: neighbours): 0-0.36 on every shared scan, 0.6 or more for elevations spread without beams.
_MAX_MEDIAN_DIP = 0.5


@dataclass(frozen=True)
class Rings:
    """Recovered rings: (N,) int64, 0 the highest beam. Every point has one, so a writer can store it; a
    point at the origin (a no-return placeholder) gets its neighbour's in scan order, else the horizon's."""

    ring: np.ndarray
    source: str
    note: str

    @property
    def count(self) -> int:
        return int(self.ring.max()) + 1


def recover_rings(xyz: np.ndarray) -> Rings | None:
    """The rings of a sweep in its sensor frame (N, 3), from its storage order or else its elevations."""
    return unfold_scan_order(xyz) or cluster_elevations(xyz)


def _wrapped(angles: np.ndarray) -> np.ndarray:
    return (angles + np.pi) % (2.0 * np.pi) - np.pi


def ring_elevations(xyz: np.ndarray, ring: np.ndarray, count: int) -> np.ndarray:
    """Median elevation (deg) of each ring 0..count-1: of its farther half of returns beyond `MIN_RANGE_M`
    (a near return reads the laser's offset from the optical centre too), of all its returns when it has none
    there, NaN when it has no returns at all."""
    valid = np.flatnonzero((ring >= 0) & (ring < count))
    order = valid[np.argsort(ring[valid], kind="stable")]
    ordered = take_rows(xyz, order)
    rng = point_ranges(ordered)
    elev = np.degrees(np.arctan2(ordered[:, 2], np.hypot(ordered[:, 0], ordered[:, 1])))
    bounds = np.cumsum(np.bincount(ring[order], minlength=count))
    out = np.full(count, np.nan)
    for k, (start, stop) in enumerate(zip(np.r_[0, bounds[:-1]], bounds, strict=True)):
        if stop == start:
            continue
        r, e = rng[start:stop], elev[start:stop]
        far = r > MIN_RANGE_M
        if far.any():
            r, e = r[far], e[far]
        out[k] = _median(e[r >= _median(r)])
    return out


def _median(values: np.ndarray) -> float:
    """`np.median` of a non-empty finite 1-D array, the same value without its per-call checks: a sweep asks
    for two per ring, and on a KITTI sweep those checks took about 3 ms of its 20 ms detection."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    return float(np.partition(values, (half - 1, half))[half - 1:half + 1].mean())


def _by_elevation(ring: np.ndarray, xyz: np.ndarray) -> np.ndarray:
    """Ring labels renumbered by elevation (`ring_elevations`), highest first."""
    count = int(ring.max()) + 1
    medians = np.nan_to_num(ring_elevations(xyz, ring, count), nan=-np.inf)
    rank = np.empty(count, dtype=np.int64)
    rank[np.argsort(-medians, kind="stable")] = np.arange(count)
    return np.where(ring >= 0, rank[np.maximum(ring, 0)], -1)


def scan_order(points: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """The order that stores (N, 3+) points ring by ring (`ring`, 0 first), each ring in one turn in the range
    images' column direction (`lidar.range_image.azimuth_columns`): the order `unfold_scan_order` reads the
    rings back from, for a file without a ring field. Every ring is cut at the first ring's first return, as a
    sensor cuts a sweep at one azimuth: the reader looks for the cut just before the first point, and a first
    ring silent for its first 60 deg would otherwise read the start of each later ring as the ring before."""
    ring = np.asarray(ring)
    if not len(ring):
        return np.zeros(0, dtype=np.int64)
    turned = np.mod(np.pi - np.arctan2(points[:, 1], points[:, 0]), 2.0 * np.pi)  # 0 straight behind
    start = turned[ring == ring.min()].min()
    return np.argsort(ring * 8.0 + np.mod(turned - start, 2.0 * np.pi))  # a turn spans 2 pi < 8


def unfold_scan_order(xyz: np.ndarray) -> Rings | None:
    """Rings of a sweep stored ring by ring, or None when its order is not that (see the module docstring)."""
    xyz = np.asarray(xyz, dtype=np.float64)
    index = np.flatnonzero(off_origin(xyz))  # a point at the origin has no azimuth
    if len(index) < 4 * COLUMN_RANGE[0]:
        return None
    pts = xyz[index]
    az = np.arctan2(pts[:, 1], pts[:, 0])
    step = _wrapped(np.diff(az))
    moving = np.abs(step) > _SAME_FIRING_RAD
    if np.mean(moving) < _MIN_MOVING:
        return None
    step *= 1.0 if np.median(step[moving]) >= 0 else -1.0  # the spin's direction: forward is positive
    typical = float(np.median(step[moving]))
    if not 2.0 * np.pi / COLUMN_RANGE[1] <= typical <= 2.0 * np.pi / COLUMN_RANGE[0]:
        return None
    if np.mean((step >= -_SAME_FIRING_RAD) & (step <= _MAX_STEPS * typical)) < _MIN_FORWARD:
        return None
    # a step far backwards crosses azimuths without returns (a crop to a camera's view): the head turned on
    back = step < -_UNSEEN_JUMP
    travel = np.concatenate([[0.0], np.cumsum(np.where(back, step + 2.0 * np.pi, step))])
    elev = np.arctan2(pts[:, 2], np.hypot(pts[:, 0], pts[:, 1]))
    cut = _cut_offset(travel, elev)
    ring = np.maximum(np.floor((travel + cut) / (2.0 * np.pi)).astype(np.int64), 0)  # jitter before the cut
    count = int(ring.max()) + 1
    if count > 1 and (ring == count - 1).sum() < _MIN_RING_POINTS:  # jitter past the last beam's end
        count -= 1
        ring = np.minimum(ring, count - 1)
    if not 2 <= count <= MAX_BEAMS:
        return None
    # a placeholder at the origin takes the ring of the point stored before it (or after, at the start)
    full = ring[np.maximum(np.searchsorted(index, np.arange(len(xyz)), side="right") - 1, 0)]
    crop = f"; {int(back.sum())} jumps over azimuths without returns" if back.any() else ""
    note = (
        f"ring recovered from the scan order: the points are stored ring by ring, {count} rings from a cut "
        f"{np.degrees(cut):.1f} deg before the first point ({2.0 * np.pi / typical:,.0f} firings a turn{crop})"
    )
    return Rings(_by_elevation(full, xyz), RING_FROM_SCAN_ORDER, note)


def _cut_offset(travel: np.ndarray, elev: np.ndarray) -> float:
    """How far (rad) before the first point the sweep's cut lies: where consecutive points jump most in
    elevation, summed over every turn, is where one beam's revolution ends and the next begins. Cuts that
    tie (all in a gap without returns) give their middle."""
    turns = int(travel[-1] // (2.0 * np.pi)) + 1
    ahead = np.maximum.accumulate(travel)
    jump = np.abs(np.diff(elev))
    marks = 2.0 * np.pi * np.arange(1, turns + 1)[None, :] - _CUT_SEARCH[:, None]
    at = np.searchsorted(ahead, marks)  # first point at or past each mark, per candidate cut
    inside = (at > 0) & (at < len(travel))
    score = np.where(inside, jump[np.clip(at - 1, 0, len(jump) - 1)], 0.0).sum(axis=1)
    best = np.flatnonzero(score >= score.max() - 1e-12)
    return float(_CUT_SEARCH[best[len(best) // 2]])


def _smoothed(counts: np.ndarray, sigma_bins: float) -> np.ndarray:
    half = int(3 * sigma_bins) + 1
    kernel = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma_bins) ** 2)
    return np.convolve(counts, kernel / kernel.sum(), mode="same")


def _elevations_from(rho: np.ndarray, z: np.ndarray, height: float) -> np.ndarray:
    """Elevation (deg) of each point (horizontal distance `rho`, height `z`) seen from `height` m up."""
    return np.degrees(np.arctan2(z - height, rho))


def _centre_height(rho: np.ndarray, z: np.ndarray) -> float:
    """The height above the origin from which the far returns' elevations cluster most sharply."""
    step = max(1, len(rho) // _CENTRE_SAMPLE)
    rho, z = rho[::step], z[::step]

    def sharpness(height: float) -> float:
        elev = _elevations_from(rho, z, height)
        counts = np.bincount(((elev - elev.min()) / (2 * _BIN_DEG)).astype(np.int64))
        return float(np.dot(counts, counts))

    return float(max(_CENTRE_HEIGHTS, key=sharpness))


def _dips(smooth: np.ndarray, peaks: list[int]) -> list[float]:
    """How far the histogram between each two neighbouring peaks falls, as a share of the lower peak."""
    return [smooth[a : b + 1].min() / min(smooth[a], smooth[b]) for a, b in itertools.pairwise(peaks)]


def _beam_table(elev: np.ndarray) -> tuple[np.ndarray, float]:
    """Ascending beam elevations (deg), the peaks of the smoothed histogram that a deep enough dip separates,
    and the median dip between them (beams: 0-0.36 on the shared scans; elevations without beams: 0.6+)."""
    edges = np.arange(elev.min() - 5 * _BIN_DEG, elev.max() + 6 * _BIN_DEG, _BIN_DEG)
    counts = np.histogram(elev, bins=edges)[0].astype(np.float64)
    smooth = _smoothed(counts, _SMOOTH_DEG / _BIN_DEG)
    peaks = list(np.flatnonzero((smooth[1:-1] > smooth[:-2]) & (smooth[1:-1] >= smooth[2:])) + 1)
    while len(peaks) > 1:
        dips = _dips(smooth, peaks)
        worst = int(np.argmax(dips))
        if dips[worst] <= _MAX_DIP:
            break
        a, b = peaks[worst], peaks[worst + 1]
        peaks.pop(worst + 1 if smooth[a] >= smooth[b] else worst)
    cuts = np.array([edges[a + int(np.argmin(smooth[a : b + 1]))] + _BIN_DEG for a, b in itertools.pairwise(peaks)])
    label = np.searchsorted(cuts, elev)
    sizes = np.bincount(label, minlength=len(peaks))
    kept = np.flatnonzero(sizes >= max(_MIN_BEAM_POINTS, _MIN_BEAM_SHARE * len(elev)))
    order = np.argsort(label, kind="stable")
    groups = np.split(elev[order], np.cumsum(sizes)[:-1])
    dips = _dips(smooth, [peaks[k] for k in kept])
    return np.array([np.median(groups[k]) for k in kept]), float(np.median(dips)) if dips else 1.0


def _nearest(elev: np.ndarray, beams: np.ndarray) -> np.ndarray:
    """Index of the nearest of the ascending `beams` for each elevation."""
    return np.searchsorted(0.5 * (beams[1:] + beams[:-1]), elev)


def cluster_elevations(xyz: np.ndarray) -> Rings | None:
    """Rings from the peaks of the elevation histogram, or None when the elevations show no beams."""
    xyz = np.asarray(xyz, dtype=np.float64)
    rho, z = np.hypot(xyz[:, 0], xyz[:, 1]), xyz[:, 2]
    far = np.hypot(rho, z) > MIN_RANGE_M
    if far.sum() < 100:
        return None
    height = _centre_height(rho[far], z[far])
    elev = _elevations_from(rho, z, height)
    beams, dip = _beam_table(elev[far])
    if not 2 <= len(beams) <= MAX_BEAMS or dip > _MAX_MEDIAN_DIP:
        return None
    nearest = _nearest(elev, beams)
    note = (
        f"ring recovered from elevation clusters: {len(beams)} beams, "
        f"elevations measured from {height:+.2f} m above the origin"
    )
    return Rings((len(beams) - 1 - nearest).astype(np.int64), RING_FROM_CLUSTERS, note)

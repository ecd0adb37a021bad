"""The rays of a sweep on one fine spherical grid that belongs to no method.

Per-ray forecast errors need rays that every method is measured along. A model's own range-image grid
would favour the model (and thin a 64-beam truth to its beams), so the rays here are cells of a fixed
elevation x azimuth grid in the target's sensor frame, as fine as the densest sensor scored: each truth
point is a ray (its cell); a method returns on that ray if it has a point in the cell, and its range there
is the nearest of its points in the cell (the z-buffer a sensor applies: it sees the first surface).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lidar.range_image import nearest_per_pixel, point_elevations, point_ranges

#: Cell size (deg, elevation and azimuth): the angular resolution of a 64-beam HDL-64E at 10 Hz.
CELL_DEG = 0.2
#: Grid rows (elevation -90 deg at the bottom to +90 deg) and columns (a full turn of azimuth).
ROWS = round(180.0 / CELL_DEG)
COLUMNS = round(360.0 / CELL_DEG)


def cell_rows(elevation: np.ndarray) -> np.ndarray:
    """Grid row of each elevation (rad), row 0 the highest (+90 deg) as in a range image."""
    rows = np.floor((90.0 - np.rad2deg(elevation)) / CELL_DEG).astype(np.int64)
    return np.clip(rows, 0, ROWS - 1)


def ray_cells(points: np.ndarray) -> np.ndarray:
    """Flat cell index (row * COLUMNS + column) of each (N, 3+) sensor-frame point.

    Columns follow the range images' convention (`lidar.range_image.azimuth_columns`): azimuth +180 deg
    (straight behind) at column 0, straight ahead in the middle, the left half of the sweep on the left.
    """
    pts = np.asarray(points)
    azimuth = np.rad2deg(np.arctan2(pts[:, 1], pts[:, 0]))
    cols = np.mod(np.floor((180.0 - azimuth) / CELL_DEG).astype(np.int64), COLUMNS)
    return cell_rows(point_elevations(pts)) * COLUMNS + cols


def field_of_view(span: tuple[float, float]) -> tuple[float, float]:
    """The vertical field of view (rad, low to high) of a sweep whose elevations span `span`
    (`lidar.range_image.elevation_span`, in its sensor frame), widened by one ray cell: the percentile span
    (robust to stray returns) lies just inside its outermost beams, which a sensor of that fan returns on as
    well. Seen from another pose, a point outside it is on no ray that sensor has."""
    return span[0] - np.deg2rad(CELL_DEG), span[1] + np.deg2rad(CELL_DEG)


def in_field_of_view(points: np.ndarray, span: tuple[float, float]) -> np.ndarray:
    """(N,) bool: the sensor-frame points within a vertical field of view (`span`, rad, low to high).

    A model's beams may reach +10.7 deg where KITTI's stop at +2 deg: what it draws above has no ground truth
    to be scored against, and a moved KITTI sweep has nothing there either.
    """
    elevations = point_elevations(np.asarray(points))
    return (elevations >= span[0]) & (elevations <= span[1])


@dataclass(frozen=True)
class Rays:
    """A cloud's nearest point per cell: the cells it returns on (increasing), its range there, and which of
    its points won each cell."""

    cells: np.ndarray
    ranges: np.ndarray
    winners: np.ndarray

    def __len__(self) -> int:
        return len(self.cells)

    def range_at(self, cells: np.ndarray) -> np.ndarray:
        """This cloud's range on each of `cells`, 0 where it has no point."""
        if not len(self.cells):
            return np.zeros(len(cells))
        at = np.minimum(np.searchsorted(self.cells, cells), len(self.cells) - 1)
        return np.where(self.cells[at] == cells, self.ranges[at], 0.0)


def nearest_per_ray(points: np.ndarray) -> Rays:
    """The z-buffer of a sensor-frame cloud on the grid; points at the origin or not finite return nothing."""
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array, got shape {pts.shape}")
    rng = point_ranges(pts)
    keep = np.flatnonzero(np.isfinite(rng) & (rng > 0))
    winners, cells = nearest_per_pixel(ray_cells(pts[keep]), rng[keep], ROWS * COLUMNS)
    return Rays(cells, rng[keep][winners], keep[winners])


def z_buffer(points: np.ndarray) -> np.ndarray:
    """The points a sensor at the origin sees of a cloud: the nearest per cell, left where they are."""
    return np.asarray(points)[nearest_per_ray(points).winners]


def ray_errors(truth: Rays, methods: dict[str, Rays]) -> tuple[dict[str, dict[str, float]], float]:
    """Per method: the share of the truth's rays it returns on (`coverage`) and, on the rays the truth and
    every method return on (the same rays for all, so the errors compare), the median and mean L1 range
    error (m) and the mean AbsRel (|error| / truth's range); errors are NaN where no ray is common. Then the
    share of the truth's rays that are common."""
    if not len(truth):
        raise ValueError("the truth returns on no ray; there is nothing to measure along")
    ranges = {m: rays.range_at(truth.cells) for m, rays in methods.items()}
    common = np.logical_and.reduce([r > 0 for r in ranges.values()])
    out = {}
    for method, rng in ranges.items():
        err = np.abs(rng[common] - truth.ranges[common])
        some = bool(err.size)
        out[method] = {
            "coverage": float((rng > 0).mean()),
            "l1_median": float(np.median(err)) if some else float("nan"),
            "l1_mean": float(err.mean()) if some else float("nan"),
            "absrel": float((err / truth.ranges[common]).mean()) if some else float("nan"),
        }
    return out, float(common.mean())


def span_rows(span: tuple[float, float]) -> slice:
    """The grid rows an elevation span (rad, low to high) covers, top row first."""
    top, bottom = cell_rows(np.array([span[1], span[0]]))
    return slice(int(top), int(bottom) + 1)


def ray_image(rays: Rays, rows: slice) -> np.ndarray:
    """(rows, COLUMNS) float32 range image of a cloud's rays on the grid, 0 where it returns nothing."""
    image = np.zeros(ROWS * COLUMNS, dtype=np.float32)
    image[rays.cells] = rays.ranges
    return image.reshape(ROWS, COLUMNS)[rows]

"""The ground a sensor stands on but cannot see: its blind disc.

A roof LiDAR's lowest beam meets the ground a few metres out (a KITTI HDL-64E at -24.9 deg and 1.73 m: 3.7
m; a VLP-16 at -15 deg: 6.7 m), so every sweep has a disc of silence around the car. Seen from a pose a
second later, the discs of the sweeps before it are holes in the road behind the car, and a network that
draws little where nothing was measured leaves them empty. The ground under a disc is no guess: the car
stood on it. `unseen_ground` puts points on the plane of the ground the sweep saw around the disc, out to
where it saw that ground begin.
"""

from __future__ import annotations

import numpy as np

from lidar.rows import finite_rows, take_rows

#: Every this many-th return is read: a plane and a disc's edge need thousands of ground returns, not a
#: whole sweep's (a quarter of a KITTI sweep's 124 k gives the same disc to a few cm).
SAMPLE_STRIDE = 4
#: Returns within this horizontal distance (m) of the sensor tell where its ground is: near enough that a
#: plane holds a cambered or sloping road.
GROUND_REACH_M = 10.0
#: The ground is this percentile of the near returns' heights (the low tail: kerbs and cars stand above it).
GROUND_PERCENTILE = 5.0
#: Near returns this far below and above (m) that height are the ground's candidates (a road's camber
#: lifts its crown above the low tail).
GROUND_BAND_M = (0.25, 0.5)
#: After a first plane fit, candidates farther than this (m) from the plane are not ground.
PLANE_TOLERANCE_M = 0.1
#: Least-squares fits of the plane, each without the candidates the one before put off it.
PLANE_FITS = 3
#: Fewer ground returns than this and the sweep does not show its ground.
MIN_GROUND_POINTS = 50
#: The disc's edge is measured in this many azimuth sectors.
SECTORS = 36
#: A sector's edge is this percentile of its ground returns' horizontal distances (robust to a stray return).
EDGE_PERCENTILE = 2.0
#: Bin width (m) of the histogram the sectors' edges are read from.
EDGE_BIN_M = 0.05
#: A sector with fewer ground returns than this shows no ground to stop at (something stands beside the car,
#: or the sweep is cropped to a camera's view): nothing is put there.
MIN_SECTOR_POINTS = 5
#: A sector whose ground starts farther than this (m) is shadowed by something, not the sensor's blind disc.
MAX_DISC_M = 12.0
#: On flat ground a disc's edge is the same all round; a sector whose ground starts more than this times the
#: sectors' median out is shadowed beyond the disc (a car parked alongside), and stops at the median.
EDGE_SPREAD = 1.5
#: Spacing (m) of the points put on the disc: half the cache's voxel, so every voxel gets one.
SPACING_M = 0.1


def unseen_ground(points: np.ndarray) -> np.ndarray:
    """(M, 4) float32 x, y, z, intensity in the sweep's sensor frame: points on the ground plane the sweep
    (N, 3+ points in its sensor frame) saw around it, covering its blind disc up to where, sector by sector,
    that ground begins; none where the sweep shows no ground to go by. Intensity is the ground's median."""
    empty = np.zeros((0, 4), dtype=np.float32)
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"unseen_ground: expected (N, 3+) sensor-frame points, got shape {pts.shape}")
    # 1. the ground around the sensor
    sample = pts[::SAMPLE_STRIDE]
    near = take_rows(sample, sample[:, 0] ** 2 + sample[:, 1] ** 2 < GROUND_REACH_M**2).astype(np.float64)
    near = near[finite_rows(near[:, :3])]
    if len(near) < MIN_GROUND_POINTS:
        return empty
    height = np.percentile(near[:, 2], GROUND_PERCENTILE)
    ground = near[(near[:, 2] >= height - GROUND_BAND_M[0]) & (near[:, 2] <= height + GROUND_BAND_M[1])]
    plane = _plane(ground[:, :3])
    if plane is None:
        return empty
    ground = ground[np.abs(_height(plane, ground) - ground[:, 2]) <= PLANE_TOLERANCE_M]
    if len(ground) < MIN_GROUND_POINTS:
        return empty
    # 2. where that ground begins, sector by sector
    edge = _edges(ground)
    if not np.isfinite(edge).any():
        return empty
    # 3. points on the plane inside the edge
    reach = int(np.ceil(np.nanmax(edge) / SPACING_M))
    axis = np.arange(-reach, reach + 1) * SPACING_M
    x, y = (v.ravel() for v in np.meshgrid(axis, axis))
    inside = np.hypot(x, y) < np.nan_to_num(edge[_sector(x, y)], nan=0.0)
    x, y = x[inside], y[inside]
    intensity = float(np.median(ground[:, 3])) if ground.shape[1] > 3 else 0.0
    return np.c_[x, y, _height(plane, np.c_[x, y]), np.full(len(x), intensity)].astype(np.float32)


def _plane(xyz: np.ndarray) -> np.ndarray | None:
    """(a, b, c) of the least-squares plane z = a x + b y + c through the points, refit without those farther
    than `PLANE_TOLERANCE_M` from the fit before; None with too few points or no plane through them."""
    for _ in range(PLANE_FITS):
        if len(xyz) < MIN_GROUND_POINTS:
            return None
        design = np.c_[xyz[:, 0], xyz[:, 1], np.ones(len(xyz))]
        try:
            plane = np.linalg.solve(design.T @ design, design.T @ xyz[:, 2])  # the normal equations: 3 x 3
        except np.linalg.LinAlgError:
            return None  # every point on one line: no plane
        xyz = xyz[np.abs(design @ plane - xyz[:, 2]) <= PLANE_TOLERANCE_M]
    return plane


def _height(plane: np.ndarray, xy: np.ndarray) -> np.ndarray:
    return plane[0] * xy[:, 0] + plane[1] * xy[:, 1] + plane[2]


def _sector(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return ((np.arctan2(y, x) + np.pi) * (SECTORS / (2 * np.pi))).astype(np.int64) % SECTORS


def _edges(ground: np.ndarray) -> np.ndarray:
    """(SECTORS,) horizontal distance (m) at which each sector's ground (N, 3+) begins, its `EDGE_PERCENTILE`
    read off a histogram of `EDGE_BIN_M` bins, at most `EDGE_SPREAD` times the median; NaN where a sector
    shows too little ground or it begins beyond `MAX_DISC_M`."""
    bins = int(np.ceil(GROUND_REACH_M / EDGE_BIN_M))
    distance = np.minimum(np.hypot(ground[:, 0], ground[:, 1]) / EDGE_BIN_M, bins - 1).astype(np.int64)
    counts = np.bincount(_sector(ground[:, 0], ground[:, 1]) * bins + distance, minlength=SECTORS * bins)
    cumulative = np.cumsum(counts.reshape(SECTORS, bins), axis=1)
    total = cumulative[:, -1]
    first = np.argmax(cumulative >= np.maximum(total * EDGE_PERCENTILE / 100.0, 1)[:, None], axis=1)
    edge = np.where(total >= MIN_SECTOR_POINTS, first * EDGE_BIN_M, np.nan)
    edge[edge > MAX_DISC_M] = np.nan
    if np.isfinite(edge).any():
        median = np.nanmedian(edge)
        edge[edge > EDGE_SPREAD * median] = median
    return edge

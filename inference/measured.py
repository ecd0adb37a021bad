"""What was measured, seen from a new pose: the rays a forecast or a re-simulation keeps as the sensor gave them.

The network sees the observation through the cache (one point per 0.2 m voxel, each spread over a voxel's
width along its row) and corrects a prior built from it; on real recordings, which come without a map, that
rewrote the measured ranges by about 4 % each, so a forecast lost to the observed sweeps merely moved to the
new pose on every ray they both saw (issue 19). The rollout therefore finishes every frame by writing the
measurement back: on each ray where a measured point is the nearest return of all observed sweeps moved to
the pose, the frame takes that point, where it was measured, with its range and intensity. The network's work
is what the observation lacks: holes, disoccluded and far ground, rows outside the observing sensor's field
of view.

One exception, where the measurement is the worse estimate: where the HD map confirms the surface (the
measured range lies within `SNAP_TOLERANCE` of the map's ground or building range), the map's exact range,
which the prior already holds, is better than a measured point re-projected off its own ray (by up to a
beam spacing on the ground).

What the sensor measured as empty is kept too. A ray with no measured return between measured returns of
its own row (within `MISS_REACH` columns) is a miss the sensor saw: glass, dark paint, a surface beyond
range, all still there from a nearby pose (within `MISS_BASELINE_M`). There the frame returns nothing,
unless the map puts a surface under the ray. The network, trained on a simulator whose drops are random per
ray, filled such rays: on KITTI 00 at 0.1 s those fills made the forecast's squared Chamfer 1.14-1.24x the
moved sweep's, 1.02-1.03x without them. The observing sensor's own shadow (`sensor_shadow`: steep rays on
which no observed sweep ever returned, the car's body seen from its roof) moves with the sensor and hides
everything behind it: there the frame returns nothing at all.

Measured on the shared KITTI 00 frames and left out: hiding measured points that show through the gaps of a
nearer measured surface (a wall's points spread apart from the new pose) made the per-ray error worse, since
real fences, foliage and windows let the truth see through them too; the newest sweep alone lost to a
z-buffer of all observed sweeps on the common rays from 0.3 s on.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.conditioning import GAP_REACH, SNAP_TOLERANCE
from inference.network import RETURN
from lidar.range_image import RangeImage, elevation_span, encode_range, grid_winners, point_ranges, project
from lidar.sensors import Sensor
from lidar.vocabulary import MapView, transform_points

#: Rays below this elevation (deg) meet the ground within about 10 m of a car's roof: silent ones are the
#: car's body (`sensor_shadow`).
SHADOW_ELEVATION_DEG = -10.0
#: Radians a float32 point's elevation may sit above its beam's.
ELEVATION_ROUNDING = 1e-4
#: Farthest (m) a pose may lie from an observing sensor for a silent ray between measured returns to count as
#: a miss there: the moved sweeps thin out with the distance, and on KITTI 00 at 8.6 m (1.0 s) most such rays
#: were only gaps between their re-projected points (the truth returned on them), at 4.3 m (0.5 s) few were.
MISS_BASELINE_M = 5.0
#: Columns either side of a ray within which a measured return of its row makes the ray's own silence a
#: measured miss: the gap-fill reach, along rows only.
MISS_REACH = GAP_REACH[0]


def measured_points(scans: list[np.ndarray], poses: np.ndarray) -> np.ndarray:
    """(N, 4) world-frame points of observed sensor-frame scans (N, 3+) at their poses; no intensity reads 0
    (unknown)."""
    out = []
    for points, pose in zip(scans, np.asarray(poses, dtype=np.float64), strict=True):
        pts = np.asarray(points, dtype=np.float32)
        if pts.shape[1] == 3:
            pts = np.concatenate([pts, np.zeros((len(pts), 1), np.float32)], axis=1)
        out.append(transform_points(pts[:, :4], pose))
    return np.concatenate(out) if out else np.zeros((0, 4), np.float32)


@dataclass
class MeasuredView:
    """The measurement kept on the rays of one pose: its ranges as a range image (0 where nothing is kept) and
    each kept ray's measured point where it was measured (sensor frame), not moved onto the ray's centre."""

    image: RangeImage
    #: (H * W, 4) x, y, z, intensity of each pixel's kept point; rows of unkept pixels are zero.
    points: np.ndarray
    #: (H, W) rays measured empty: no measured return, one within `MISS_REACH` columns of the same row seen
    #: from within `MISS_BASELINE_M` of an observing sensor, and no map surface under them; or the observing
    #: sensor's own shadow, which hides even what was measured and what the map holds.
    misses: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        return self.image.mask


def sensor_shadow(scans: list[np.ndarray], sensor: Sensor) -> np.ndarray:
    """(H, W) rays steeper than `SHADOW_ELEVATION_DEG`, inside the observing sensor's field of view, on which
    no observed sweep (N, 3+ points in its own sensor frame) returned, nor on its row within `MISS_REACH`
    columns: what the car's own body hides from a roof sensor, which travels with the sensor to every pose.

    Such rays meet the ground within about 10 m, where a sensor always returns; an isolated silent ray there is
    a dropped return, so a shadow must be wider than a row miss.
    """
    seen = np.zeros(sensor.shape, dtype=bool)
    lowest = np.inf
    for points in scans:
        seen |= project(np.asarray(points), sensor).mask
        lowest = min(lowest, elevation_span(points)[0])
    rows = (sensor.elevations < np.radians(SHADOW_ELEVATION_DEG)) & (sensor.elevations >= lowest - ELEVATION_ROUNDING)
    return rows[:, None] & ~seen & ~row_misses(np.flatnonzero(seen), sensor)


@dataclass
class Observation:
    """What observed sweeps measured, for the frames a forecast or a re-simulation renders from them."""

    #: (N, 4) world-frame points of every observed sweep (`measured_points`).
    points: np.ndarray
    #: (K, 3) world positions of the sensor at each sweep.
    positions: np.ndarray
    #: (H, W) the observing sensor's own shadow (`sensor_shadow`).
    shadow: np.ndarray


def observation(scans: list[np.ndarray], poses: np.ndarray, sensor: Sensor) -> Observation:
    """The `Observation` of sensor-frame scans (N, 3+) at their world_from_sensor poses."""
    poses = np.asarray(poses, dtype=np.float64)
    return Observation(measured_points(scans, poses), poses[:, :3, 3].copy(), sensor_shadow(scans, sensor))


def measured_view(observed: Observation, pose: np.ndarray, sensor: Sensor,
                  map_view: MapView | None = None) -> MeasuredView:
    """What a sensor at `pose` keeps of the observation, every observed sweep together: the nearest measured
    point per ray, as in a z-buffer of the sweeps moved to the pose; and the rays measured empty."""
    local = transform_points(np.asarray(observed.points, dtype=np.float32), np.linalg.inv(pose))
    index, pixels = grid_winners(local, sensor)
    baseline = float(np.linalg.norm(observed.positions - pose[:3, 3], axis=1).min())
    misses = row_misses(pixels, sensor) if baseline <= MISS_BASELINE_M else np.zeros(sensor.shape, dtype=bool)
    misses.reshape(-1)[pixels] = False
    visible = ~observed.shadow.reshape(-1)[pixels]  # the sensor's own body hides whatever lies behind it
    index, pixels = index[visible], pixels[visible]
    ranges = point_ranges(local[index])
    if map_view is not None:
        misses &= (map_view.ground <= 0) & (map_view.building <= 0)
        # where the map confirms the surface, its exact range (in the prior) is better
        encoded = encode_range(ranges, sensor.max_range)
        on_map = np.zeros(len(pixels), dtype=bool)
        for surface in (map_view.ground, map_view.building):
            mapped = encode_range(surface.reshape(-1)[pixels], sensor.max_range)
            on_map |= (mapped > -1.0) & (np.abs(encoded - mapped) < SNAP_TOLERANCE)
        index, pixels, ranges = index[~on_map], pixels[~on_map], ranges[~on_map]
    misses |= observed.shadow
    size = sensor.height * sensor.width
    points = np.zeros((size, 4), dtype=np.float32)
    points[pixels] = local[index]
    range_ = np.zeros(size, dtype=np.float32)
    range_[pixels] = ranges
    intensity = np.clip(points[:, 3], 0.0, 1.0)
    return MeasuredView(RangeImage(range_.reshape(sensor.shape), intensity.reshape(sensor.shape)), points, misses)


def row_misses(pixels: np.ndarray, sensor: Sensor) -> np.ndarray:
    """(H, W) pixels without a measured return that have one within `MISS_REACH` columns of their row."""
    seen = np.zeros(sensor.height * sensor.width, dtype=bool)
    seen[pixels] = True
    seen = seen.reshape(sensor.shape)
    near = np.zeros_like(seen)
    for d in range(1, MISS_REACH + 1):
        near |= np.roll(seen, d, axis=1) | np.roll(seen, -d, axis=1)  # azimuth wraps
    return near & ~seen


def measured_points_of(image: RangeImage, points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """The frame's points (`unproject(image)`, one per returning pixel in row-major order) with every kept
    ray's point put back where it was measured."""
    pixels = np.flatnonzero(image.mask)
    kept = measured.mask.reshape(-1)[pixels]
    out = points.copy()
    out[kept] = measured.points[pixels[kept]]
    return out


def keep_measured(x: torch.Tensor, measured: MeasuredView, sensor: Sensor) -> torch.Tensor:
    """A sampled (B, 3, H, W) flow image (range, intensity, return) with every kept ray set to the measurement
    and every measured miss to no return."""
    keep = torch.from_numpy(measured.mask).to(x.device)
    values = torch.from_numpy(np.stack([
        encode_range(measured.image.range, sensor.max_range),
        measured.image.intensity * 2.0 - 1.0,
        np.ones(sensor.shape, dtype=np.float32),
    ])).to(device=x.device, dtype=x.dtype)
    out = torch.where(keep, values, x)
    misses = torch.from_numpy(measured.misses).to(x.device)
    out[:, RETURN] = torch.where(misses, torch.full_like(out[:, RETURN], -1.0), out[:, RETURN])
    return out

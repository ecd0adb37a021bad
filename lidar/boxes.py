"""Rays against yawed 3-D boxes: how an actor layout (or an extruded footprint) shows in a range view.

A box row is (cx, cy, cz, length, width, height, yaw) in the world frame, the layout `lidar.sim` writes
(`World.boxes`) and detection datasets use. The slab test runs in each box's own frame, so it is exact for
any yaw, and rays are tested against only the boxes within reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lidar.range_image import nearest_per_pixel
from lidar.rows import take_rows
from lidar.sensors import Sensor

#: Box rows are (cx, cy, cz, length, width, height, yaw).
BOX_COLUMNS = 7


def check_boxes(boxes: np.ndarray, name: str = "boxes") -> np.ndarray:
    """(B, 7) float64 finite boxes with positive sizes, or a ValueError naming what was wrong."""
    arr = np.asarray(boxes, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != BOX_COLUMNS:
        raise ValueError(f"{name} must be (B, 7) rows of cx, cy, cz, length, width, height, yaw; got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds NaN or inf")
    if len(arr) and (arr[:, 3:6] <= 0).any():
        raise ValueError(f"{name}: length, width and height must be > 0")
    return arr


def _slab_entry(o: np.ndarray, d: np.ndarray, boxes: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """Entry distance of ray i (origin o, unit direction d[i]) into box owners[i] of `boxes`; inf if it misses.

    A ray starting inside its box gets inf too: a sensor inside a box sees out of it, as the simulator's
    ego clearance does. What depends on the box alone (its rotation, the origin in its frame, the slab
    bounds) is computed once per box, the rest per ray, axis by axis on flat arrays: reductions over a
    length-3 axis cost more than the arithmetic.
    """
    c, s = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    rx, ry = o[0] - boxes[:, 0], o[1] - boxes[:, 1]
    origin = (c * rx + s * ry, -s * rx + c * ry, o[2] - boxes[:, 2])
    c, s = c[owners], s[owners]
    direction = (c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1], d[:, 2])
    t_near, t_far = np.full(len(owners), -np.inf), np.full(len(owners), np.inf)
    inside = np.ones(len(boxes), dtype=bool)
    for axis in range(3):
        lo_o, lo_d, half = origin[axis], direction[axis], boxes[:, 3 + axis] / 2
        within = np.abs(lo_o) <= half
        with np.errstate(divide="ignore", invalid="ignore"):
            t1 = (-half - lo_o)[owners] / lo_d
            t2 = (half - lo_o)[owners] / lo_d
        near, far = np.minimum(t1, t2), np.maximum(t1, t2)
        # a ray parallel to a slab is inside it for all t (origin within the slab) or never
        parallel = np.flatnonzero(lo_d == 0)
        near[parallel] = -np.inf
        far[parallel] = np.where(within[owners[parallel]], np.inf, -np.inf)
        np.maximum(t_near, near, out=t_near)
        np.minimum(t_far, far, out=t_far)
        inside &= within
    return np.where((t_near <= t_far) & (t_near > 0) & ~inside[owners], t_near, np.inf)


def _pixel_windows(local_boxes: np.ndarray, sensor: Sensor) -> tuple[np.ndarray, np.ndarray]:
    """(pixel, box) pairs each box (in the sensor frame) can cover: a conservative azimuth x elevation window.

    Testing only these pixels makes a map of a thousand footprints cost about as much as the pixels they
    cover, not pixels x boxes; the pairs are built for all boxes at once (no per-box Python loop).
    """
    height, width = sensor.shape
    dist = np.hypot(local_boxes[:, 0], local_boxes[:, 1])
    radius = 0.5 * np.hypot(local_boxes[:, 3], local_boxes[:, 4])
    near = np.maximum(dist - radius, 0.05)
    top = local_boxes[:, 2] + local_boxes[:, 5] / 2
    bottom = local_boxes[:, 2] - local_boxes[:, 5] / 2
    el_hi = np.arctan2(top, np.where(top >= 0, near, dist + radius))
    el_lo = np.arctan2(bottom, np.where(bottom >= 0, dist + radius, near))
    # rows: the beams between el_lo and el_hi (row 0 is the highest beam)
    ascending = sensor.elevations[::-1]
    first_up = np.searchsorted(ascending, el_lo - 1e-9, side="left")
    past_up = np.searchsorted(ascending, el_hi + 1e-9, side="right")
    row0, n_rows = height - past_up, np.maximum(past_up - first_up, 0)
    # columns: the azimuth span of the box's circumscribed circle, all of them when the sensor is inside it
    centre_col = 0.5 * (1.0 - np.arctan2(local_boxes[:, 1], local_boxes[:, 0]) / np.pi) * width
    half_cols = np.arcsin(np.clip(radius / np.maximum(dist, 1e-9), 0, 1)) / np.pi * 0.5 * width + 1
    whole = (dist <= radius) | (half_cols >= width / 2)
    col0 = np.where(whole, 0, np.floor(centre_col - half_cols)).astype(np.int64)
    n_cols = np.where(whole, width, np.ceil(centre_col + half_cols).astype(np.int64) - col0 + 1)
    # every pair, box by box, row-major in a box's window: its rows, then each row's run of columns
    box_of_row = np.repeat(np.arange(len(local_boxes)), n_rows)
    rows = row0[box_of_row] + np.arange(len(box_of_row)) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
    run = n_cols[box_of_row]
    cols = np.arange(int(run.sum())) - np.repeat(np.cumsum(run) - run - col0[box_of_row], run)
    return np.repeat(rows * width, run) + cols % width, np.repeat(box_of_row, run)


@dataclass
class BoxView:
    """What a set of boxes shows in a sensor's range view: range (m, 0 = no box) and the box per pixel."""

    range: np.ndarray  # (H, W) float32
    index: np.ndarray  # (H, W) int64, -1 = no box


def box_range_view(boxes: np.ndarray, pose: np.ndarray, sensor: Sensor) -> BoxView:
    """Ray-cast world-frame `boxes` from the sensor at `pose` (world_from_sensor) into its range view.

    Exact per pixel (slab test along the pixel's ray) for boxes within the sensor's max range; the nearest
    box wins a pixel.
    """
    pose = np.asarray(pose, dtype=np.float64)
    if pose.shape != (4, 4):
        raise ValueError(f"pose must be a 4x4 world_from_sensor matrix, got shape {pose.shape}")
    boxes = check_boxes(boxes)
    height, width = sensor.shape
    rng = np.full(height * width, np.inf)
    index = np.full(height * width, -1, dtype=np.int64)
    # 1. boxes into the level frame at the sensor (its heading only: boxes stand upright, the sensor may pitch
    #    and roll with the terrain), where each box is still an upright yawed box and the slab test is exact
    heading = np.arctan2(pose[1, 0], pose[0, 0])
    c, s = np.cos(heading), np.sin(heading)
    level_from_world = np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])
    level = boxes.copy()
    level[:, :3] = (boxes[:, :3] - pose[:3, 3]) @ level_from_world.T
    level[:, 6] = boxes[:, 6] - heading
    level_from_sensor = level_from_world @ pose[:3, :3]
    reach = np.hypot(level[:, 0], level[:, 1]) - 0.5 * np.hypot(level[:, 3], level[:, 4])
    keep = np.flatnonzero(reach < sensor.max_range)
    # 2. pixel windows in the sensor frame, each box grown to hold itself tilted by the sensor's pitch and roll
    inv = np.linalg.inv(pose)
    local = boxes[keep].copy()
    local[:, :3] = boxes[keep, :3] @ inv[:3, :3].T + inv[:3, 3]
    sin_tilt = float(np.hypot(level_from_sensor[2, 0], level_from_sensor[2, 1]))
    if sin_tilt > 0:
        radius = 0.5 * np.hypot(local[:, 3], local[:, 4])
        local[:, 3:5] *= ((radius + 0.5 * local[:, 5] * sin_tilt) / radius)[:, None]
        local[:, 5] += 2.0 * radius * sin_tilt
    # 3. every (pixel, box) pair a box can cover, then one vectorised slab test along the rays in the level frame
    pixels, owners = _pixel_windows(local, sensor)
    if len(pixels):
        owners = keep[owners]
        dirs = take_rows(sensor.ray_table().reshape(-1, 3), pixels) @ level_from_sensor.T
        t = _slab_entry(np.zeros(3), dirs, level, owners)
        ok = np.isfinite(t) & (t >= sensor.min_range) & (t <= sensor.max_range)
        pixels, owners, t = pixels[ok], owners[ok], t[ok]
        # 4. the nearest box per pixel
        sel, hit = nearest_per_pixel(pixels, t, height * width)
        rng[hit] = t[sel]
        index[hit] = owners[sel]
    rng = np.where(np.isfinite(rng), rng, 0.0).astype(np.float32)
    return BoxView(rng.reshape(sensor.shape), index.reshape(sensor.shape))

"""The rolling spatial cache: everything generated or observed so far, in the world frame.

It is the world model's memory. Each new sweep is conditioned on the cache seen from the new pose, so the
cache must stay small enough to re-project every frame: one point per voxel (the newest wins, so a place
revisited shows what was generated last), only points within `radius` of the latest pose, and at most
`max_points` (the farthest go first; they matter least for the next sweep).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Voxel indices are packed into one int64 key with this many bits per axis (±2^20 voxels per axis).
_KEY_BITS = 21
_KEY_OFFSET = 1 << (_KEY_BITS - 1)


def transform_points(points: np.ndarray, transform: np.ndarray) -> np.ndarray:
    """Apply a 4x4 rigid transform to the xyz of (N, 3+) points; extra columns (intensity) ride along."""
    pts = np.asarray(points)
    transform = np.asarray(transform, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array, got shape {pts.shape}")
    if transform.shape != (4, 4):
        raise ValueError(f"transform must be a 4x4 matrix, got shape {transform.shape}")
    out = pts.astype(np.float32, copy=True)
    out[:, :3] = pts[:, :3].astype(np.float64) @ transform[:3, :3].T + transform[:3, 3]
    return out


class SpatialCache:
    """World-frame points (N, 4) float32, voxel-deduplicated and bounded around the latest pose."""

    def __init__(self, radius: float = 80.0, voxel_size: float = 0.2, max_points: int = 150_000) -> None:
        if not radius > 0:
            raise ValueError(f"SpatialCache radius must be > 0 metres, got {radius}")
        if not voxel_size > 0:
            raise ValueError(f"SpatialCache voxel_size must be > 0 metres, got {voxel_size}")
        if int(max_points) < 1:
            raise ValueError(f"SpatialCache max_points must be >= 1, got {max_points}")
        self.radius = float(radius)
        self.voxel_size = float(voxel_size)
        self.max_points = int(max_points)
        #: Newest first, so deduplication can keep the first point of each voxel.
        self._points = np.zeros((0, 4), dtype=np.float32)
        #: Centre (x, y, z) of the radius bound: the position of the latest pose given to `add`.
        self._center: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._points)

    def points(self) -> np.ndarray:
        """A copy of the cached world-frame points (N, 4), newest first."""
        return self._points.copy()

    def points_in_frame(self, pose: np.ndarray) -> np.ndarray:
        """The cache seen from `pose` (world_from_sensor): points in that sensor's frame."""
        return transform_points(self._points, np.linalg.inv(np.asarray(pose, dtype=np.float64)))

    def clear(self) -> None:
        self._points = np.zeros((0, 4), dtype=np.float32)
        self._center = None

    def add(self, points_world: np.ndarray, pose: np.ndarray | None = None) -> None:
        """Merge new world-frame points (N, 4); `pose` (4x4, the sensor that saw them) moves the radius centre."""
        new = np.asarray(points_world, dtype=np.float32)
        if new.ndim != 2 or new.shape[1] != 4:
            raise ValueError(
                f"SpatialCache.add expects world-frame points (N, 4) x,y,z,intensity, got {new.shape}"
            )
        new = new[np.isfinite(new).all(axis=1)]
        if pose is not None:
            pose = np.asarray(pose, dtype=np.float64)
            if pose.shape != (4, 4):
                raise ValueError(
                    f"SpatialCache.add pose must be a 4x4 world_from_sensor matrix, got {pose.shape}"
                )
            self._center = pose[:3, 3].copy()
        pts = np.concatenate([new, self._points])
        # 1. one point per voxel, the newest (first) one
        _, first = np.unique(self._voxel_keys(pts[:, :3]), return_index=True)
        pts = pts[np.sort(first)]
        # 2. radius bound around the latest pose (horizontal distance: the world is a ground plane)
        if self._center is not None:
            dist = np.hypot(pts[:, 0] - self._center[0], pts[:, 1] - self._center[1])
            keep = dist <= self.radius
            pts, dist = pts[keep], dist[keep]
            # 3. point budget: drop the farthest
            if len(pts) > self.max_points:
                pts = pts[np.sort(np.argpartition(dist, self.max_points - 1)[: self.max_points])]
        elif len(pts) > self.max_points:
            pts = pts[: self.max_points]  # no pose yet: keep the newest
        self._points = np.ascontiguousarray(pts)
        logger.debug("cache: +%d points -> %d", len(new), len(self._points))

    def _voxel_keys(self, xyz: np.ndarray) -> np.ndarray:
        idx = np.floor(xyz.astype(np.float64) / self.voxel_size).astype(np.int64)
        if len(idx) and np.abs(idx).max() >= _KEY_OFFSET:
            raise ValueError(
                f"SpatialCache: a point lies farther than {_KEY_OFFSET * self.voxel_size:.0f} m from the world "
                "origin; expected world coordinates near the origin"
            )
        idx += _KEY_OFFSET
        return (idx[:, 0] << (2 * _KEY_BITS)) | (idx[:, 1] << _KEY_BITS) | idx[:, 2]

    def state_dict(self) -> dict[str, Any]:
        return {
            "radius": self.radius,
            "voxel_size": self.voxel_size,
            "max_points": self.max_points,
            "points": self._points.copy(),
            "center": None if self._center is None else self._center.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        points = np.asarray(state["points"], dtype=np.float32)
        if points.ndim != 2 or points.shape[1] != 4:
            raise ValueError(f"SpatialCache state 'points' must be (N, 4), got {points.shape}")
        self.radius = float(state["radius"])
        self.voxel_size = float(state["voxel_size"])
        self.max_points = int(state["max_points"])
        self._points = points.copy()
        self._center = (
            None if state["center"] is None else np.asarray(state["center"], dtype=np.float64).copy()
        )

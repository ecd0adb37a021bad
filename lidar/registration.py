"""Register an ordered list of LiDAR sweeps into one world frame with KISS-ICP, and say when it failed.

Forecasting and re-simulation from real recordings need every observed sweep's `world_from_sensor` pose.
KISS-ICP (Vizzo et al., RA-L 2023; PyPI `kiss-icp`) does the registration: a constant-velocity guess,
point-to-point ICP against its voxel-hash local map, with a robust kernel and a correspondence threshold
that adapt to the observed motion. Nothing of ICP is re-implemented here.

KISS-ICP reports no quality figure, and it always returns a pose, even for a sweep of another street.
So each sweep is also scored against the map built from the sweeps before it (the map as it was before
the sweep was added): `fitness` is the fraction of the sweep's registration points (KISS-ICP's own
downsampled keypoints, moved by the new pose) with a map point within `inlier_distance`, and `rmse` the
root-mean-square distance of those inliers. On the shared KITTI sweeps 0.2 s apart the fitness is
0.77-0.85; a sweep from another place (an Ouster, nuScenes, PandaSet or KITTI object-set scan) scores 0.10-0.31,
because only stray ground and wall points land near the map. `min_fitness` = 0.5 sits between the two.

Sweeps are not deskewed: files carry no per-point timestamps, and KISS-ICP leaves a sweep as it is without them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kiss_icp.config import KISSConfig
from kiss_icp.config.config import AdaptiveThresholdConfig, DataConfig, MappingConfig
from kiss_icp.config.config import RegistrationConfig as KissRegistrationConfig
from kiss_icp.kiss_icp import KissICP
from scipy.spatial import cKDTree

from lidar.cancel import checkpoint
from lidar.errors import InputError
from lidar.formats import Scan
from lidar.vocabulary import check_poses

logger = logging.getLogger(__name__)

#: A sweep with fewer registration keypoints than this cannot be scored (nor registered) reliably.
MIN_KEYPOINTS = 100
#: A sweep with more keypoints than this is refused before ICP runs. Real sweeps have a few thousand (KITTI
#: 2.4 k, an Ouster OS-1-128 3.1 k, PandaSet 6.8 k): their points lie on surfaces, so voxels thin them. A
#: cloud of random points fills space and keeps one keypoint a point, and ICP's time grows with them (two
#: sweeps of 50 k random points: 9.5 s; of 150 k: 25 s, holding the GIL).
MAX_KEYPOINTS = 20_000


class RegistrationError(InputError):
    """Sweeps that do not register into one world: the message names the sweep, its fitness and the bar."""


@dataclass(frozen=True)
class RegisterConfig:
    """How sweeps are registered and when a registration counts as failed."""

    #: KISS-ICP local-map voxel edge (m); its keypoints are downsampled at 1.5x this. KISS-ICP's default is
    #: max_range / 100, i.e. 1 m for a 100 m sensor.
    voxel_size: float = 1.0
    #: Points farther than this (m) from the sensor are ignored (KISS-ICP `data.max_range`).
    max_range: float = 100.0
    #: Points nearer than this (m) are ignored: the ego vehicle's own returns.
    min_range: float = 1.0
    #: A keypoint with a map point within this distance (m) counts as an inlier for `fitness` and `rmse`.
    inlier_distance: float = 0.5
    #: Below this fitness a sweep is refused as not overlapping the sweeps before it.
    min_fitness: float = 0.5
    #: CPU threads KISS-ICP may use (0 = all; 1 by default because the box is shared with training).
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("voxel_size", "max_range", "inlier_distance"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"RegisterConfig.{name} must be a positive number of metres, got {value!r}")
        if not (isinstance(self.min_range, int | float) and 0 <= self.min_range < self.max_range):
            raise ValueError(
                f"RegisterConfig.min_range must be in [0, max_range={self.max_range}), got {self.min_range!r}"
            )
        if not (isinstance(self.min_fitness, int | float) and 0 <= self.min_fitness <= 1):
            raise ValueError(f"RegisterConfig.min_fitness must be in [0, 1], got {self.min_fitness!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"RegisterConfig.threads must be an integer >= 0 (0 = all), got {self.threads!r}")

    def kiss_config(self) -> KISSConfig:
        """The KISS-ICP configuration; its adaptive threshold keeps KISS-ICP's defaults."""
        return KISSConfig(
            data=DataConfig(max_range=self.max_range, min_range=self.min_range, deskew=False),
            mapping=MappingConfig(voxel_size=self.voxel_size),
            registration=KissRegistrationConfig(max_num_threads=self.threads),
            adaptive_threshold=AdaptiveThresholdConfig(),
        )


@dataclass
class Registration:
    """Poses of registered sweeps and how well each one fitted the sweeps before it."""

    #: (N, 4, 4) float64 world_from_sensor; the first is `initial_pose` (identity by default).
    poses: np.ndarray
    #: (N,) fraction of each sweep's keypoints within `inlier_distance` of the earlier sweeps' map; the
    #: first sweep defines the map, so its fitness is 1.
    fitness: np.ndarray
    #: (N,) RMS distance (m) of those inliers to the map (0 for the first sweep).
    rmse: np.ndarray
    #: (N,) KISS-ICP's adaptive correspondence threshold (sigma, m) used for each sweep.
    sigma: np.ndarray
    #: (N,) seconds spent registering each sweep (KISS-ICP plus scoring).
    seconds: np.ndarray

    def summary(self) -> list[dict[str, float | list[float]]]:
        """One row per sweep for logs and poses.json: position (m), yaw (deg), fitness, rmse."""
        return [
            {
                "xyz": [round(float(v), 4) for v in pose[:3, 3]],
                "yaw_deg": round(math.degrees(math.atan2(pose[1, 0], pose[0, 0])), 3),
                "fitness": round(float(fit), 4),
                "rmse": round(float(err), 4),
            }
            for pose, fit, err in zip(self.poses, self.fitness, self.rmse, strict=True)
        ]


def register_sweeps(
    sweeps: Sequence[np.ndarray | Scan],
    *,
    initial_pose: np.ndarray | None = None,
    config: RegisterConfig | None = None,
    names: Sequence[str] | None = None,
) -> Registration:
    """Register sweeps given in recording order; raise `RegistrationError` when one does not fit.

    `sweeps` are (N, 3+) sensor-frame points (x, y, z first) or `Scan`s; `names` (file names) make the
    error messages point at the offending file.
    """
    config = config or RegisterConfig()
    sweeps = _check_sweeps(sweeps)
    icp = KissICP(config.kiss_config())
    if initial_pose is not None:
        icp.last_pose = check_poses(np.asarray(initial_pose)[None], "initial_pose")[0]
    n = len(sweeps)
    poses, fitness, rmse = np.empty((n, 4, 4)), np.ones(n), np.zeros(n)
    sigma, seconds = np.empty(n), np.empty(n)
    for i in range(n):  # one sweep at a time: a lazy `lidar.sequence.Recording` never holds the drive in memory
        checkpoint()  # a cancelled request stops between sweeps
        start = time.perf_counter()
        cloud = _xyz(sweeps[i], _name(names, i))
        previous_map = icp.local_map.point_cloud()
        sigma[i] = icp.adaptive_threshold.get_threshold()
        _check_keypoints(icp, cloud, _name(names, i), config)
        _, keypoints = icp.register_frame(cloud, np.empty(0))
        poses[i] = icp.last_pose
        if len(keypoints) < MIN_KEYPOINTS:
            raise RegistrationError(
                f"{_name(names, i)} has only {len(keypoints)} points left for registration between "
                f"{config.min_range} and {config.max_range} m (voxel {config.voxel_size} m); expected a LiDAR "
                f"sweep with at least {MIN_KEYPOINTS}"
            )
        if i > 0:
            fitness[i], rmse[i] = _score(keypoints, poses[i], previous_map, config.inlier_distance)
        seconds[i] = time.perf_counter() - start
        logger.info(
            "registered %s in %.3f s: xyz %s, fitness %.3f, rmse %.3f m",
            _name(names, i), seconds[i], np.round(poses[i, :3, 3], 3), fitness[i], rmse[i],
        )
        if fitness[i] < config.min_fitness:
            raise RegistrationError(
                f"{_name(names, i)} does not register onto the sweeps before it: fitness {fitness[i]:.2f} "
                f"(the fraction of its points within {config.inlier_distance} m of theirs) is below "
                f"{config.min_fitness}; expected consecutive sweeps of one drive, in recording order"
            )
    return Registration(poses=poses, fitness=fitness, rmse=rmse, sigma=sigma, seconds=seconds)


def _check_keypoints(icp: KissICP, cloud: np.ndarray, name: str, config: RegisterConfig) -> None:
    """Refuse a sweep whose keypoints (KISS-ICP's own range filter and voxels, a few ms) pass `MAX_KEYPOINTS`."""
    keypoints, _ = icp.voxelize(icp.preprocessor.preprocess(cloud, np.empty(0), icp.last_delta))
    if len(keypoints) > MAX_KEYPOINTS:
        raise RegistrationError(
            f"{name} has {len(keypoints):,} registration points after {1.5 * config.voxel_size:g} m voxels; a LiDAR "
            f"sweep has a few thousand and at most {MAX_KEYPOINTS:,} are registered (random points, or a merged map?)"
        )


def _score(keypoints: np.ndarray, pose: np.ndarray, world_map: np.ndarray, inlier: float) -> tuple[float, float]:
    """Fitness and inlier RMSE of sensor-frame keypoints moved by `pose` against world-frame map points."""
    world = keypoints @ pose[:3, :3].T + pose[:3, 3]
    dist, _ = cKDTree(world_map).query(world, distance_upper_bound=inlier)
    inliers = dist[np.isfinite(dist)]
    if not len(inliers):
        return 0.0, 0.0
    return len(inliers) / len(world), float(np.sqrt(np.mean(inliers**2)))


def _check_sweeps(sweeps: Sequence[np.ndarray | Scan]) -> Sequence[np.ndarray | Scan]:
    if isinstance(sweeps, np.ndarray | Scan) or not isinstance(sweeps, Sequence) or not sweeps:
        raise InputError("sweeps must be a non-empty list of (N, 3+) point arrays or lidar.formats.Scan")
    return sweeps


def _xyz(sweep: np.ndarray | Scan, name: str) -> np.ndarray:
    """Finite x, y, z as float64, the layout KISS-ICP takes."""
    points = np.asarray(sweep.points if isinstance(sweep, Scan) else sweep)
    if points.ndim != 2 or points.shape[1] < 3 or not np.issubdtype(points.dtype, np.number):
        raise InputError(f"{name} must be (N, 3+) points x, y, z[, ...], got shape {points.shape}")
    xyz = points[:, :3].astype(np.float64)
    return xyz[np.isfinite(xyz).all(axis=1)]


def _name(names: Sequence[str] | None, i: int) -> str:
    return f"sweep {i} ({names[i]})" if names is not None and i < len(names) else f"sweep {i}"

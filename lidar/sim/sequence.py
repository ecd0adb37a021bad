"""A simulated drive: sweeps along poses, with the map view and the actor boxes of every frame."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from lidar.sensors import Sensor
from lidar.sim.hdmap import HDMap
from lidar.sim.sensor_model import LidarSimulator, SensorModelConfig, SimScan
from lidar.sim.world import World
from lidar.vocabulary import FRAME_RATE_HZ

logger = logging.getLogger(__name__)


@dataclass
class SimSequence:
    """Frames and everything aligned with them. Boxes are in world coordinates (see World.boxes)."""

    frames: list[SimScan]
    poses: np.ndarray  # (T, 4, 4) float64 world_from_sensor
    times: np.ndarray  # (T,) seconds
    map_classes: np.ndarray  # (T, H, W) uint8, HDMap.range_view_classes per frame
    boxes: list[dict[str, np.ndarray]]  # per frame: boxes (K, 7), box_class (K,), box_id (K,)
    hdmap: HDMap
    sensor: Sensor

    def __len__(self) -> int:
        return len(self.frames)


def simulate_sequence(
    world: World,
    poses: np.ndarray,
    sensor: Sensor,
    seed: int = 0,
    times: np.ndarray | None = None,
    config: SensorModelConfig | None = None,
    box_range: float | None = None,
) -> SimSequence:
    """Scan `world` from each pose (times default to 10 Hz from 0). Any pose list works, not only plan_drive's.

    Boxes are kept for actors within `box_range` (default: the sensor's max range) of each pose.
    """
    poses = np.asarray(poses, dtype=np.float64)
    if poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) == 0:
        raise ValueError(
            f"poses must be a non-empty (T, 4, 4) array of world_from_sensor matrices, got {poses.shape}"
        )
    times = np.arange(len(poses)) / FRAME_RATE_HZ if times is None else np.asarray(times, dtype=np.float64)
    if times.shape != (len(poses),):
        raise ValueError(f"times must have one entry per pose ({len(poses)}), got shape {times.shape}")
    sim = LidarSimulator(sensor, seed=seed, config=config)
    limit = sensor.max_range if box_range is None else float(box_range)
    frames, classes, boxes = [], [], []
    t0 = time.perf_counter()
    for pose, t in zip(poses, times, strict=True):
        frames.append(sim.scan(world, pose, float(t)))
        classes.append(world.hdmap.range_view_classes(pose, sensor))
        b = world.boxes(float(t), ego_pose=pose)  # the actors this sweep has
        near = np.hypot(b["boxes"][:, 0] - pose[0, 3], b["boxes"][:, 1] - pose[1, 3]) <= limit
        boxes.append({k: v[near] for k, v in b.items()})
    logger.info("simulated %d frames of %s in %.2f s", len(poses), sensor.name, time.perf_counter() - t0)
    return SimSequence(
        frames=frames,
        poses=poses,
        times=times,
        map_classes=np.stack(classes),
        boxes=boxes,
        hdmap=world.hdmap,
        sensor=sensor,
    )

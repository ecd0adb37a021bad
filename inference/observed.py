"""Observed scenes: recorded sweeps with world poses, ready to forecast from or to re-simulate.

The command line and the app share these steps, so a scene behaves the same wherever it comes from:
1. read the sweeps (`lidar.sequence.read_sequence`: files, a folder or a zip, in frame order);
2. pose them: from a poses file (KITTI poses.txt or our poses.json), else by registering them with KISS-ICP
   (`lidar.registration`) when there are several, else the one sweep sits at the identity;
   both in a worker process with bounded memory, CPU and time (`lidar.sandbox`), since the files may be
   anyone's;
3. for re-simulation, build the shifted / rotated path and refuse one that leaves the observed area.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.spatial.transform import Rotation, Slerp

from inference.pipeline import POSES_NAME
from lidar import sandbox
from lidar.errors import InputError
from lidar.formats import Scan
from lidar.registration import Registration
from lidar.sensors import Sensor
from lidar.sequence import frame_numbers
from lidar.vocabulary import FRAME_RATE_HZ, transform_points

logger = logging.getLogger(__name__)

#: A re-simulated pose may lie at most this far (m, horizontally) from the nearest observed sensor position.
#: Past it the observation no longer describes the view: returns thin out with range squared, the ground
#: near the new pose was never seen, and the model would be inventing rather than re-rendering the scene.
MAX_OFFSET_M = 10.0


@dataclass
class ObservedScene:
    """Sweeps in recording order with their world_from_sensor poses and where the poses came from."""

    scans: list[Scan]
    names: list[str]
    #: (N, 4, 4) world_from_sensor.
    poses: np.ndarray
    #: "file" (a poses file), "registered" (KISS-ICP) or "single" (one sweep at the identity).
    pose_source: str
    #: The registration, when the poses came from one.
    registration: Registration | None = None
    #: Seconds of each sweep from the first, when a recording container stamped them.
    recorded_times: np.ndarray | None = None

    @property
    def times(self) -> np.ndarray | None:
        """Seconds of each sweep: as a container recorded them, else from the frame numbers in their names at
        10 Hz (KITTI's 000000, 000002, 000004 are 0.2 s apart), or None when a name has no number."""
        if self.recorded_times is not None:
            return self.recorded_times
        numbers = frame_numbers(self.names)
        return None if numbers is None else np.asarray(numbers, dtype=np.float64) / FRAME_RATE_HZ

    def world_points(self) -> np.ndarray:
        """(M, 4) float32 x, y, z, intensity of every sweep in the world frame: what was observed."""
        return np.concatenate(
            [transform_points(scan.points, pose) for scan, pose in zip(self.scans, self.poses, strict=True)]
        )

    def prefix_records(self) -> list[dict[str, Any]]:
        """The `prefix` list of poses.json: each observed sweep's file and pose (and fit when registered)."""
        records: list[dict[str, Any]] = [
            {"file": name, "pose": pose.tolist()} for name, pose in zip(self.names, self.poses, strict=True)
        ]
        if self.registration is not None:
            for record, fit, err in zip(records, self.registration.fitness, self.registration.rmse, strict=True):
                record.update(fitness=round(float(fit), 4), rmse=round(float(err), 4))
        return records


def observe(
    sources: str | Path | Sequence[str | Path],
    *,
    poses: str | Path | None = None,
    register: bool | None = None,
    sensor: Sensor | None = None,
    topic: str | None = None,
) -> ObservedScene:
    """Read and pose a scene; `register=None` registers several sweeps that came without poses. `topic` picks
    what a recording container holding several streams is read for (a bag's PointCloud2 topic).

    `poses` and `register=True` exclude each other. Raises an `InputError` (a `PointCloudError` for files, a
    `RegistrationError` for sweeps that do not belong together, `lidar.sandbox.OverLimits` for files past the
    worker's limits) naming what was wrong.
    """
    if poses is not None and register:
        raise InputError("give either a poses file or ask for registration, not both")
    # 1. read, in frame order (a folder or zip may bring its own poses file), and 2. register if need be
    seq, registration = sandbox.read_sequence(sources, sensor=sensor, poses=poses, register=register or None,
                                             topic=topic)
    if registration is None:
        if seq.poses is not None:
            return ObservedScene(seq.scans, seq.names, seq.poses, "file", recorded_times=seq.times)
        return ObservedScene(seq.scans, seq.names, np.eye(4)[None], "single", recorded_times=seq.times)
    logger.info("registered %d sweeps in %.2f s", len(seq.scans), registration.seconds.sum())
    return ObservedScene(seq.scans, seq.names, registration.poses, "registered", registration, seq.times)


def shifted_path(
    poses: np.ndarray, shift: tuple[float, float] = (0.0, 0.0), yaw_deg: float = 0.0, frames: int | None = None
) -> np.ndarray:
    """(frames, 4, 4) poses along the observed path, each moved by `shift` (forward, left; m) and turned by
    `yaw_deg` about its own vertical axis.

    With `frames` = the number of observed poses (the default) the path goes through each of them; otherwise
    it is resampled evenly between the first and the last (positions linearly, rotations by slerp).
    """
    poses = np.asarray(poses, dtype=np.float64)
    frames = len(poses) if frames is None else frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise InputError(f"frames must be an integer >= 1, got {frames!r}")
    if not all(math.isfinite(v) for v in (*shift, yaw_deg)):
        raise InputError(f"shift and yaw must be finite numbers, got shift={shift}, yaw={yaw_deg}")
    path = _resample_path(poses, frames)
    local = np.eye(4)
    local[:3, :3] = Rotation.from_euler("z", yaw_deg, degrees=True).as_matrix()
    local[:2, 3] = shift
    return path @ local


def check_inside(targets: np.ndarray, observed: np.ndarray, max_offset: float = MAX_OFFSET_M) -> None:
    """Refuse target poses farther than `max_offset` (horizontally) from every observed sensor position."""
    gap = np.linalg.norm(targets[:, None, :2, 3] - observed[None, :, :2, 3], axis=-1).min(axis=1)
    worst = int(np.argmax(gap))
    if gap[worst] > max_offset:
        raise InputError(
            f"target pose {worst} lies {gap[worst]:.1f} m from the nearest observed sweep, outside the observed area "
            f"(at most {max_offset:.0f} m); expected a smaller shift"
        )


def record_prefix(folder: str | Path, scene: ObservedScene) -> dict[str, Any]:
    """Add the scene's `prefix` list to the poses.json `write_rollout` left in `folder`; returns the content.

    Written next to `frames`, so one file tells where the observed sweeps were and where the model went.
    """
    path = Path(folder) / POSES_NAME
    meta = json.loads(path.read_text())
    meta = {"prefix": scene.prefix_records(), **meta}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(path)
    return meta


def _resample_path(poses: np.ndarray, frames: int) -> np.ndarray:
    if frames == len(poses):
        return poses.copy()
    if len(poses) == 1:
        return np.repeat(poses, frames, axis=0)
    knots = np.linspace(0.0, 1.0, len(poses))
    at = np.linspace(0.0, 1.0, frames)
    out = np.tile(np.eye(4), (frames, 1, 1))
    out[:, :3, :3] = Slerp(knots, Rotation.from_matrix(poses[:, :3, :3]))(at).as_matrix()
    for axis in range(3):
        out[:, axis, 3] = np.interp(at, knots, poses[:, axis, 3])
    return out

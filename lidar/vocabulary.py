"""What the world model, the simulator and real data share: classes, the map and layout protocols, the frame
rate, the ego's actions and the pose convention.

The model conditions on an HD map and an actor layout whatever made them (`lidar.sim` procedurally, a real
map or a detector), so the names it needs live here and not in the simulator: importing the model never
imports the procedural generator.

Conventions (docs/design.md): metres and seconds; a sensor frame is x forward, y left, z up; a pose is a (4, 4)
float64 world_from_sensor matrix; points are (N, 3+) rows x, y, z (then intensity in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lidar.errors import InputError
from lidar.sensors import Sensor

# ---------------------------------------------------------------------------------------------- classes

#: Ground layers of an HD map. Index 0 means the ray meets no ground within range (sky / beyond max range).
#: Training data and released models depend on this order: extend it only by appending.
MAP_CLASSES: tuple[str, ...] = (
    "none",
    "road",
    "lane_marking",
    "crosswalk",
    "intersection",
    "parking",
    "sidewalk",
    "curb",
    "terrain",
    "vegetation",
    "building",
)
MAP_CLASS_INDEX: dict[str, int] = {name: i for i, name in enumerate(MAP_CLASSES)}

#: Object classes of solids. A point label is len(MAP_CLASSES) + index here (ground hits use the map class).
#: Training data depends on this order: extend it only by appending.
OBJECT_CLASSES: tuple[str, ...] = (
    "car",
    "van",
    "truck",
    "pedestrian",
    "cyclist",
    "pole",
    "sign",
    "tree",
    "bush",
    "wall",
    "fence",
    "facade",
)
OBJECT_CLASS_INDEX: dict[str, int] = {name: i for i, name in enumerate(OBJECT_CLASSES)}
#: Classes that get a 3-D box (the detection targets, and the actor layout the model conditions on).
BOXED_CLASSES: tuple[str, ...] = ("car", "van", "truck", "pedestrian", "cyclist")
#: Point/pixel labels of a labelled sweep: 0 = no return, ground hits use their MAP_CLASSES index, solids
#: len(MAP_CLASSES) + their OBJECT_CLASSES index.
POINT_CLASSES: tuple[str, ...] = MAP_CLASSES + OBJECT_CLASSES

# ------------------------------------------------------------------------------------ map and layout views


@dataclass
class MapView:
    """The HD map seen from one pose, per range-view pixel; ranges in metres, 0 where the layer is not hit."""

    classes: np.ndarray  # (H, W) uint8 MAP_CLASSES of the ground under the ray
    ground: np.ndarray  # (H, W) float32 range to the ground surface
    building: np.ndarray  # (H, W) float32 range into an extruded building or barrier (wall, fence) footprint
    vegetation: np.ndarray  # (H, W) float32 range into an extruded green area or plant (tree crown, hedge)


class MapSource(Protocol):
    """An HD map that can be ray-cast from any pose (`lidar.sim.HDMap` is one; a real map can be another).

    A rollout queries it from a second thread, one frame ahead of the network (`inference.rollout`), and for
    its first frame, which nothing runs beside, from that thread and the caller's at once, each for half the
    beams (a sensor whose `elevations_deg` are a slice of the frame's); a map that only reads its own data
    serves as it is."""

    def range_view(self, pose: np.ndarray, sensor: Sensor) -> MapView: ...


#: Something that gives the actor layout at a time (s) for a sensor at a pose (world_from_sensor): a dict with
#: "boxes" (K, 7) world cx, cy, cz, l, w, h, yaw and "box_class" (K,) `OBJECT_CLASSES` indices, as
#: `lidar.sim.World.boxes` gives (it leaves out the actors that sensor's sweep would not have); a real layout
#: may ignore the pose. A rollout calls it for its first frame in the caller's thread, before it starts its
#: second thread, and for the others from that thread, one frame ahead, as it does a `MapSource`.
LayoutSource = Callable[[float, np.ndarray], dict[str, np.ndarray]]

# ---------------------------------------------------------------------------------------- time and motion

#: Sweeps per second: frame i of a drive, a rollout or a recording without timestamps is at i / FRAME_RATE_HZ s.
FRAME_RATE_HZ = 10.0

#: What the ego can be asked to do.
ACTIONS: tuple[str, ...] = ("straight", "turn_left", "turn_right")
#: The yaw rule of the actions: the sign of the heading change each one makes, +1 to the left
#: (counter-clockwise seen from above, z up). How far a turn goes is the caller's: a right angle at a
#: junction for the planner (`lidar.sim.plan_drive`), an arc of a set radius for a dead-reckoned forecast
#: (`inference.pipeline.action_poses`).
ACTION_YAW_SIGN: dict[str, float] = {"straight": 0.0, "turn_left": 1.0, "turn_right": -1.0}
#: How a user interface names each action.
ACTION_LABELS: dict[str, str] = {"straight": "Straight", "turn_left": "Turn left", "turn_right": "Turn right"}

# ------------------------------------------------------------------------------------------------- poses

#: Farthest a pose may lie from the world origin (m): a recorded or generated drive stays well inside it.
MAX_POSE_TRANSLATION_M = 100_000.0


def transform_points(points: np.ndarray, transform: np.ndarray) -> np.ndarray:
    """Apply a 4x4 rigid transform to the xyz of (N, 3+) points; extra columns (intensity) ride along.

    The product is taken in float64, so a pose far from the origin adds no float32 rounding of its own.
    """
    pts = np.asarray(points)
    transform = np.asarray(transform, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array, got shape {pts.shape}")
    if transform.shape != (4, 4):
        raise ValueError(f"transform must be a 4x4 matrix, got shape {transform.shape}")
    out = pts.astype(np.float32, copy=True)
    out[:, :3] = pts[:, :3].astype(np.float64) @ transform[:3, :3].T + transform[:3, 3]
    return out


def check_poses(poses: np.ndarray, name: str) -> np.ndarray:
    """(N, 4, 4) finite rigid transforms within `MAX_POSE_TRANSLATION_M` of the origin, as float64, or an
    `InputError` naming the first bad one."""
    try:
        arr = np.asarray(poses, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{name}: poses must be numbers; expected (N, 4, 4) world_from_sensor matrices") from None
    if arr.ndim != 3 or arr.shape[1:] != (4, 4):
        raise InputError(f"{name}: poses of shape {arr.shape}; expected (N, 4, 4) world_from_sensor")
    far = np.flatnonzero(~(np.abs(arr[:, :3, 3]) <= MAX_POSE_TRANSLATION_M).all(axis=1) & np.isfinite(arr).all(axis=(1, 2)))
    if len(far):
        raise InputError(
            f"{name}: pose {int(far[0])} lies {np.abs(arr[far[0], :3, 3]).max():.3g} m from the origin; expected "
            f"poses within {MAX_POSE_TRANSLATION_M / 1000:.0f} km (metres, world_from_sensor)"
        )
    rot = arr[:, :3, :3]
    ok = np.isfinite(arr).all(axis=(1, 2))
    with np.errstate(invalid="ignore"):
        ok &= np.abs(rot @ rot.transpose(0, 2, 1) - np.eye(3)).max(axis=(1, 2)) < 1e-4
        ok &= np.abs(np.linalg.det(np.where(np.isfinite(rot), rot, 0.0)) - 1.0) < 1e-4
        ok &= np.abs(arr[:, 3] - [0.0, 0.0, 0.0, 1.0]).max(axis=1) < 1e-9
    if not ok.all():
        raise InputError(
            f"{name}: pose {int(np.flatnonzero(~ok)[0])} is not a finite rigid transform (rotation with det 1, "
            "last row 0 0 0 1); expected world_from_sensor poses"
        )
    return arr

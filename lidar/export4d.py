"""Sweeps in time as the field's 4D viewers open them: a Rerun recording (`.rrd`) and a ROS bag of
`sensor_msgs/PointCloud2` plus `/tf` (ROS 2 `.mcap` or `.db3`, or a ROS 1 `.bag`) for Foxglove and RViz.

Both writers take arrays only: each `Track` (the observed sweeps, the generated ones) is an iterable of
`Sweep`s in time order, each with its points in its own sensor frame, its stamp (ns) and, when known, its
world pose, ring ids and actor boxes. Tracks are merged in time, so a long conversion streams sweep by sweep.

In the `.rrd` every sweep is logged at its stamp on the `time` timeline under `world/<track>/lidar/points`,
coloured by range (or intensity), below a `world/<track>/lidar` transform that moves it to its pose; the
sensor's path is `world/<track>/path` and the boxes `world/<track>/boxes`. In a bag each track is a topic
(`/<track>/points` by default) in the frame `<track>_lidar`, and each posed sweep adds a `/tf` transform from
`world_frame` to that frame at the sweep's stamp, so `lidar.recordings` reads the poses back. Ring ids go in
a uint16 `ring` field, intensity (0-1) in a float32 `intensity` field.
"""

from __future__ import annotations

import heapq
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lidar.errors import InputError

#: Ranges are coloured over [0, this] metres.
COLOUR_RANGE_M = 80.0
POINT_RADIUS_M = 0.03
WORLD_FRAME = "map"
TF_TOPIC = "/tf"
#: Bag suffixes `write_bag` writes.
BAG_SUFFIXES = (".mcap", ".db3", ".bag")
_FLOAT32, _UINT16 = 7, 4
TF_MESSAGE_DEFINITION = "geometry_msgs/TransformStamped[] transforms"


@dataclass
class Sweep:
    """One sweep to store: (N, 4) float32 x, y, z, intensity in its sensor frame, and what is known of it."""

    points: np.ndarray
    stamp_ns: int
    #: world_from_sensor, or None when the sweep has no pose.
    pose: np.ndarray | None = None
    ring: np.ndarray | None = None
    #: (K, 7) world-frame boxes (cx, cy, cz, length, width, height, yaw) and their (K,) class indices.
    boxes: np.ndarray | None = None
    box_class: np.ndarray | None = None


@dataclass
class Track:
    """A named stream of sweeps in time order (consumed once)."""

    name: str
    sweeps: Iterable[Sweep]
    topic: str | None = None
    frame: str | None = None
    #: Filled while writing: the sensor positions of the posed sweeps.
    path: list[np.ndarray] = field(default_factory=list)

    @property
    def topic_name(self) -> str:
        return self.topic or f"/{self.name}/points"

    @property
    def frame_name(self) -> str:
        return self.frame or f"{self.name}_lidar"


def _merged(tracks: Sequence[Track]) -> Iterator[tuple[Track, Sweep]]:
    """Every track's sweeps, merged by stamp (each track is in time order already)."""
    def keyed(k: int, track: Track) -> Iterator[tuple[int, int, Sweep]]:
        return ((sweep.stamp_ns, k, sweep) for sweep in track.sweeps)

    streams = [keyed(k, track) for k, track in enumerate(tracks)]
    for _, k, sweep in heapq.merge(*streams, key=lambda item: (item[0], item[1])):
        yield tracks[k], sweep


def range_colours(points: np.ndarray, by: str = "range") -> np.ndarray:
    """(N, 3) uint8 turbo colours of each point's range over [0, `COLOUR_RANGE_M`] or of its intensity."""
    from lidar.render import turbo

    if by == "intensity":
        values = np.clip(points[:, 3], 0.0, 1.0)
    elif by == "range":
        values = np.clip(np.linalg.norm(points[:, :3], axis=1) / COLOUR_RANGE_M, 0.0, 1.0)
    else:
        raise InputError(f"colour_by must be 'range' or 'intensity', got {by!r}")
    return np.asarray(turbo(values))


# --- Rerun ---------------------------------------------------------------------------------------------------


def write_rrd(path: str | Path, tracks: Sequence[Track], *, colour_by: str = "range",
              application_id: str = "lidarverse") -> Path:
    """Write `tracks` as a Rerun recording; returns the path."""
    import rerun as rr

    path = Path(path)
    rec = rr.RecordingStream(application_id, recording_id=path.stem)
    rec.save(str(path))
    first = None
    for track, sweep in _merged(tracks):
        first = sweep.stamp_ns if first is None else first
        _set_time(rec, sweep.stamp_ns, first)
        entity = f"world/{track.name}"
        if sweep.pose is not None:
            pose = np.asarray(sweep.pose, dtype=np.float64)
            rec.log(f"{entity}/lidar", rr.Transform3D(translation=pose[:3, 3], mat3x3=pose[:3, :3]))
            track.path.append(pose[:3, 3].copy())
        points = np.asarray(sweep.points, dtype=np.float32)
        rec.log(f"{entity}/lidar/points", rr.Points3D(points[:, :3], colors=range_colours(points, colour_by),
                                                      radii=POINT_RADIUS_M))
        if sweep.boxes is not None:
            boxes = np.asarray(sweep.boxes, dtype=np.float64).reshape(-1, 7)
            rec.log(f"{entity}/boxes", rr.Boxes3D(
                centers=boxes[:, :3], half_sizes=boxes[:, 3:6] / 2,
                rotation_axis_angles=[rr.RotationAxisAngle(axis=(0, 0, 1), radians=float(a)) for a in boxes[:, 6]],
                class_ids=None if sweep.box_class is None else np.asarray(sweep.box_class, dtype=np.uint16)))
    for track in tracks:
        if len(track.path) > 1:
            rec.log(f"world/{track.name}/path", rr.LineStrips3D([np.stack(track.path)]), static=True)
    rec.flush()
    rec.disconnect()
    return path


def _set_time(rec: object, stamp_ns: int, first_ns: int) -> None:
    """Absolute stamps (a sensor's clock) as timestamps, stamps counted from 0 as durations."""
    if first_ns > 10**15:  # later than 1970-01-12: a wall clock
        rec.set_time("time", timestamp=np.datetime64(int(stamp_ns), "ns"))  # type: ignore[attr-defined]
    else:
        rec.set_time("time", duration=np.timedelta64(int(stamp_ns), "ns"))  # type: ignore[attr-defined]


# --- ROS bags ------------------------------------------------------------------------------------------------


def write_bag(path: str | Path, tracks: Sequence[Track], *, world_frame: str = WORLD_FRAME) -> Path:
    """Write `tracks` as a ROS bag chosen by `path`'s suffix (.mcap, .db3: ROS 2; .bag: ROS 1); returns it.

    A ROS 2 bag is one self-contained storage file (schemas included), as Foxglove opens it.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in BAG_SUFFIXES:
        raise InputError(f"{path}: cannot write a bag as {suffix or 'a file without a suffix'}; expected "
                         f"{', '.join(BAG_SUFFIXES)}")
    if suffix == ".bag":
        return _write_ros1(path, tracks, world_frame)
    return _write_ros2(path, tracks, world_frame, suffix)


def _write_ros2(path: Path, tracks: Sequence[Track], world_frame: str, suffix: str) -> Path:
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    plugin = StoragePlugin.MCAP if suffix == ".mcap" else StoragePlugin.SQLITE3
    with tempfile.TemporaryDirectory(prefix="lidarverse_bag_", dir=path.parent) as tmp:
        folder = Path(tmp) / path.stem
        with Writer(folder, version=9, storage_plugin=plugin) as writer:
            _write_messages(writer, store, tracks, world_frame, store.serialize_cdr)
        storage = next(folder.glob(f"*{suffix}"))
        shutil.move(storage, path)
    return path


def _write_ros1(path: Path, tracks: Sequence[Track], world_frame: str) -> Path:
    from rosbags.rosbag1 import Writer
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS1_NOETIC)  # noetic's store leaves out tf2_msgs
    store.register(get_types_from_msg(TF_MESSAGE_DEFINITION, "tf2_msgs/msg/TFMessage"))
    path.unlink(missing_ok=True)
    with Writer(path) as writer:
        _write_messages(writer, store, tracks, world_frame, store.serialize_ros1)
    return path


def _write_messages(writer: object, store: object, tracks: Sequence[Track], world_frame: str, serialize: object) -> None:
    types = store.types  # type: ignore[attr-defined]
    add, write = writer.add_connection, writer.write  # type: ignore[attr-defined]
    clouds = {t.name: add(t.topic_name, "sensor_msgs/msg/PointCloud2", typestore=store) for t in tracks}
    tf = add(TF_TOPIC, "tf2_msgs/msg/TFMessage", typestore=store)
    for track, sweep in _merged(tracks):
        header = _header(types, sweep.stamp_ns, track.frame_name)
        write(clouds[track.name], sweep.stamp_ns,
              serialize(_cloud(types, header, sweep), "sensor_msgs/msg/PointCloud2"))  # type: ignore[operator]
        if sweep.pose is not None:
            write(tf, sweep.stamp_ns, serialize(_tf(types, sweep, world_frame, track.frame_name),  # type: ignore[operator]
                                                "tf2_msgs/msg/TFMessage"))


def _header(types: dict, stamp_ns: int, frame: str) -> object:
    cls = types["std_msgs/msg/Header"]
    stamp = types["builtin_interfaces/msg/Time"](sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000))
    if "seq" in cls.__dataclass_fields__:  # ROS 1
        return cls(seq=0, stamp=stamp, frame_id=frame)
    return cls(stamp=stamp, frame_id=frame)


def _cloud(types: dict, header: object, sweep: Sweep) -> object:
    field_cls = types["sensor_msgs/msg/PointField"]
    points = np.asarray(sweep.points, dtype=np.float32)
    layout = [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("intensity", "<f4")]
    if sweep.ring is not None:
        layout.append(("ring", "<u2"))
    table = np.zeros(len(points), dtype=np.dtype(layout))
    for k, name in enumerate(("x", "y", "z", "intensity")):
        table[name] = points[:, k]
    if sweep.ring is not None:
        table["ring"] = np.asarray(sweep.ring)
    fields = [field_cls(name=name, offset=table.dtype.fields[name][1], datatype=_UINT16 if name == "ring" else _FLOAT32,
                        count=1) for name in table.dtype.names]
    return types["sensor_msgs/msg/PointCloud2"](
        header=header, height=1, width=len(table), fields=fields, is_bigendian=False, point_step=table.dtype.itemsize,
        row_step=table.nbytes, data=table.view(np.uint8), is_dense=True)


def _tf(types: dict, sweep: Sweep, world_frame: str, frame: str) -> object:
    from scipy.spatial.transform import Rotation

    pose = np.asarray(sweep.pose, dtype=np.float64)
    x, y, z, w = Rotation.from_matrix(pose[:3, :3]).as_quat()
    transform = types["geometry_msgs/msg/Transform"](
        translation=types["geometry_msgs/msg/Vector3"](x=pose[0, 3], y=pose[1, 3], z=pose[2, 3]),
        rotation=types["geometry_msgs/msg/Quaternion"](x=x, y=y, z=z, w=w))
    stamped = types["geometry_msgs/msg/TransformStamped"](
        header=_header(types, sweep.stamp_ns, world_frame), child_frame_id=frame, transform=transform)
    return types["tf2_msgs/msg/TFMessage"](transforms=[stamped])

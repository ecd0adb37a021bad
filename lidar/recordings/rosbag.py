"""ROS 1 bags, ROS 2 bags (sqlite3 `.db3` or `.mcap`, a bag folder or the bare file) and MCAP files: the
`sensor_msgs/PointCloud2` messages of one topic, with poses from `/tf` or `nav_msgs/Odometry` when present.

Containers are opened with `rosbags` (pure Python) after `bag_guard` has checked their bounds. A cloud is
parsed from its serialized bytes here rather than by `rosbags`' deserializer, so its sizes are checked
before anything is allocated: at most `MAX_FIELDS` fields, and a height x width x point_step (and the row
step) that the data actually holds. Columns are read by name: x, y, z (required), the intensity (the first
of `INTENSITY_FIELDS`) and the ring (the first of `RING_FIELDS`). A sweep's stamp is its header stamp
(the log time when the header has none).

Poses: every transform on a `tf2_msgs/TFMessage` topic (`/tf`, `/tf_static`) and every
`nav_msgs/Odometry` message (header frame -> child frame) is an edge of one transform tree; a sweep's pose
is the chain from the tree's root down to the cloud's frame, each edge interpolated at the sweep's stamp.
Without a chain the recording has no poses (and is registered). Pose messages are small by nature and are
refused past `MAX_POSE_MESSAGE_BYTES`.
"""

from __future__ import annotations

import logging
import struct
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rosbags.highlevel import AnyReader, AnyReaderError
from rosbags.rosbag1 import ReaderError as Ros1Error
from rosbags.rosbag2 import ReaderError as Ros2Error
from rosbags.serde import SerdeError
from rosbags.typesys import Stores, get_typestore
from rosbags.typesys.base import TypesysError

from lidar.formats import Scan
from lidar.formats.scan import PointCloudError, build_scan, check_point_count
from lidar.recordings.bag_guard import check_container
from lidar.recordings.base import (
    ContainerRecording,
    check_record_size,
    check_sweep_count,
    interpolate_poses,
    make_recording,
    pose_matrix,
)
from lidar.sensors import Sensor
from lidar.sequence import MAX_TEXT_BYTES

logger = logging.getLogger(__name__)

POINTCLOUD2 = "sensor_msgs/msg/PointCloud2"
TF_MESSAGE = "tf2_msgs/msg/TFMessage"
ODOMETRY = "nav_msgs/msg/Odometry"
STATIC_TF_TOPIC = "/tf_static"
#: Column names drivers give the intensity and the ring, in order of preference.
INTENSITY_FIELDS = ("intensity", "reflectivity", "i", "signal")
RING_FIELDS = ("ring", "channel", "laser_number", "laser_id", "line")
#: Most fields a PointCloud2 may declare (drivers send 4-10).
MAX_FIELDS = 64
#: Largest pose message (a /tf message of a robot's whole tree is a few KB).
MAX_POSE_MESSAGE_BYTES = MAX_TEXT_BYTES
#: PointField datatypes as NumPy types.
_DATATYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 8: "f8"}
#: The exceptions `rosbags` raises on a container it cannot read (beside our own checks).
READ_ERRORS = (AnyReaderError, Ros1Error, Ros2Error, SerdeError, TypesysError, KeyError, IndexError, ValueError,
               struct.error, EOFError, UnicodeDecodeError, AssertionError)


@dataclass
class Cloud:
    """A PointCloud2's header and columns, from its serialized bytes."""

    stamp_ns: int
    frame_id: str
    columns: dict[str, np.ndarray] = field(default_factory=dict)


def open_bag(path: Path, topic: str | None = None, sensor: Sensor | None = None,
             max_sweeps: int | None = None) -> ContainerRecording:
    kind = check_container(path)
    reader = _open_reader(path)
    try:
        connection = _cloud_connection(reader, path, topic)
        check_sweep_count(path, connection.msgcount, connection.topic, max_sweeps)
        log_ns, stamps, frame_id = _index(reader, connection, path)
        poses = _poses(reader, path, frame_id, stamps) if frame_id else None
    except READ_ERRORS as err:
        raise _unreadable(path, err) from None
    order = np.argsort(stamps, kind="stable")
    log_ns, stamps = [log_ns[i] for i in order], [stamps[i] for i in order]
    poses = None if poses is None else poses[order]
    ranks = _ranks(log_ns)

    def decode(i: int) -> Scan:
        where = Path(f"{path}#{connection.topic}[{i}]")
        try:
            raw = _message(reader, connection, log_ns[i], ranks[i])
            cloud = parse_cloud(raw, reader.is2, where)
        except READ_ERRORS as err:
            raise _unreadable(path, err) from None
        cols = cloud.columns
        xyz = np.stack([cols["x"], cols["y"], cols["z"]], axis=1)
        intensity = next((cols[n] for n in INTENSITY_FIELDS if n in cols), None)
        ring = next((cols[n] for n in RING_FIELDS if n in cols), None)
        return build_scan(where, kind, xyz, intensity, ring, columns=tuple(cols), sensor=sensor)

    logger.info("%s: %d clouds on %s (%s), %s", path.name, len(stamps), connection.topic, kind,
                "with poses" if poses is not None else "no poses")
    return make_recording(path, kind, connection.topic, stamps, decode, poses, label=connection.topic)


def list_topics(path: Path) -> dict[str, str]:
    """topic -> message type of every connection in a bag, after its bounds are checked."""
    check_container(path)
    reader = _open_reader(path)
    return {c.topic: c.msgtype for c in reader.connections}


def _open_reader(path: Path) -> AnyReader:
    try:
        reader = AnyReader([path], default_typestore=get_typestore(Stores.ROS2_HUMBLE))
        reader.open()
    except READ_ERRORS as err:
        raise _unreadable(path, err) from None
    return reader


def _unreadable(path: Path, err: BaseException) -> PointCloudError:
    if isinstance(err, PointCloudError):
        return err
    return PointCloudError(f"{path}: the bag cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:200]})")


def _cloud_connection(reader: AnyReader, path: Path, topic: str | None) -> Any:
    types = {c.topic: c.msgtype for c in reader.connections}
    clouds = sorted(t for t, m in types.items() if m == POINTCLOUD2)
    listing = ", ".join(f"{t} ({m})" for t, m in sorted(types.items())[:20]) or "no topics"
    if topic is not None:
        if topic not in types:
            raise PointCloudError(f"{path}: no topic {topic!r}; it holds {listing}")
        if types[topic] != POINTCLOUD2:
            raise PointCloudError(f"{path}: {topic} carries {types[topic]}; expected {POINTCLOUD2} (it holds {listing})")
    elif len(clouds) == 1:
        topic = clouds[0]
    elif clouds:
        raise PointCloudError(f"{path}: {len(clouds)} {POINTCLOUD2} topics ({', '.join(clouds)}); choose one (--topic)")
    else:
        raise PointCloudError(f"{path}: no {POINTCLOUD2} topic; it holds {listing}")
    return next(c for c in reader.connections if c.topic == topic)


def _index(reader: AnyReader, connection: Any, path: Path) -> tuple[list[int], list[int], str]:
    """Log times, header stamps and the cloud frame of every message on the topic, from headers only."""
    log_ns, stamps, frame_id = [], [], ""
    for _, log_time, raw in reader.messages(connections=[connection]):
        check_record_size(path, len(raw), "a PointCloud2 message")
        stamp, frame, _ = _header(raw, reader.is2, path)
        log_ns.append(int(log_time))
        stamps.append(stamp or int(log_time))
        frame_id = frame_id or frame
    return log_ns, stamps, frame_id


def _ranks(log_ns: list[int]) -> list[int]:
    """Each message's place among those logged at the same time (messages are fetched by log time)."""
    seen: dict[int, int] = defaultdict(int)
    ranks = []
    for t in log_ns:
        ranks.append(seen[t])
        seen[t] += 1
    return ranks


def _message(reader: AnyReader, connection: Any, log_ns: int, rank: int) -> bytes:
    for k, (_, _, raw) in enumerate(reader.messages(connections=[connection], start=log_ns, stop=log_ns + 1)):
        if k == rank:
            return bytes(raw)
    raise PointCloudError(f"{connection.topic}: the message logged at {log_ns} ns is gone; the bag changed while read")


# --- PointCloud2 from its bytes -----------------------------------------------------------------------------


class _Bytes:
    """A cursor over a serialized message: ROS 1 (packed, little endian) or CDR (aligned, either endian)."""

    def __init__(self, raw: bytes, cdr: bool, where: Path) -> None:
        self.raw, self.where = raw, where
        if cdr:
            if len(raw) < 4 or raw[1] not in (0, 1):
                raise PointCloudError(f"{where}: not a CDR message (encapsulation {raw[:4].hex()})")
            self.endian, self.at, self.base, self.align = ("<" if raw[1] == 1 else ">"), 4, 4, True
        else:
            self.endian, self.at, self.base, self.align = "<", 0, 0, False

    def value(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.align:
            self.at += -(self.at - self.base) % size
        if self.at + size > len(self.raw):
            raise PointCloudError(f"{self.where}: the message ends inside its header; expected a PointCloud2")
        (out,) = struct.unpack_from(self.endian + fmt, self.raw, self.at)
        self.at += size
        return int(out)

    def blob(self) -> tuple[int, int]:
        """(start, length) of a length-prefixed byte sequence, checked against the message's size."""
        length = self.value("I")
        if self.at + length > len(self.raw):
            raise PointCloudError(f"{self.where}: a field claims {length:,} bytes, past the message's "
                                  f"{len(self.raw):,}; expected a PointCloud2")
        start = self.at
        self.at += length
        return start, length

    def text(self) -> str:
        start, length = self.blob()
        return self.raw[start:start + length].rstrip(b"\x00").decode("utf-8", errors="replace")


def _header(raw: bytes, cdr: bool, where: Path) -> tuple[int, str, _Bytes]:
    cur = _Bytes(raw, cdr, where)
    if not cdr:
        cur.value("I")  # seq
    sec, nsec = cur.value("I"), cur.value("I")
    return sec * 1_000_000_000 + nsec, cur.text().lstrip("/"), cur


def parse_cloud(raw: bytes, cdr: bool, where: Path) -> Cloud:
    """The columns of a serialized PointCloud2, each (height * width,) in its own dtype."""
    stamp, frame_id, cur = _header(raw, cdr, where)
    height, width = cur.value("I"), cur.value("I")
    count = cur.value("I")
    if count > MAX_FIELDS:
        raise PointCloudError(f"{where}: {count:,} fields; a PointCloud2 has at most {MAX_FIELDS}")
    fields = []
    for _ in range(count):
        name = cur.text()
        offset, datatype, n = cur.value("I"), cur.value("B"), cur.value("I")
        fields.append((name, offset, datatype, n))
    big = cur.value("B") != 0
    point_step, row_step = cur.value("I"), cur.value("I")
    start, length = cur.blob()
    points = height * width
    check_point_count(where, points)
    if row_step < width * point_step or height * row_step > length or point_step == 0:
        raise PointCloudError(
            f"{where}: {height} x {width} points of {point_step} bytes (rows of {row_step}) need "
            f"{height * max(row_step, width * point_step):,} bytes; the message holds {length:,}"
        )
    dtype = _dtype(fields, point_step, big, where)
    rows = np.frombuffer(raw, np.uint8, count=height * row_step, offset=start).reshape(height, row_step)
    table = np.ascontiguousarray(rows[:, :width * point_step]).view(dtype).ravel()
    return Cloud(stamp, frame_id, {name: table[name] for name in dtype.names or ()})


def _dtype(fields: list[tuple[str, int, int, int]], point_step: int, big: bool, where: Path) -> np.dtype:
    names, formats, offsets = [], [], []
    for name, offset, datatype, count in fields:
        kind = _DATATYPES.get(datatype)
        if kind is None or count != 1 or name in names or not name:
            continue
        if offset + np.dtype(kind).itemsize > point_step:
            raise PointCloudError(f"{where}: field {name!r} at byte {offset} runs past the {point_step}-byte point")
        names.append(name)
        formats.append((">" if big else "<") + kind)
        offsets.append(offset)
    missing = [axis for axis in "xyz" if axis not in names]
    if missing:
        raise PointCloudError(f"{where}: no {', '.join(missing)} field (it has {', '.join(names) or 'none'}); "
                              "expected x, y, z")
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": point_step})


# --- poses ---------------------------------------------------------------------------------------------------


@dataclass
class _Edge:
    parent: str
    stamps: list[int] = field(default_factory=list)
    matrices: list[np.ndarray] = field(default_factory=list)
    static: bool = False


def _poses(reader: AnyReader, path: Path, frame_id: str, stamps: list[int]) -> np.ndarray | None:
    """world_from_cloud at every stamp through the transform tree, or None without a chain to the cloud."""
    edges = _edges(reader, path)
    chain, frame = [], frame_id
    while frame in edges and len(chain) <= len(edges):
        chain.append(edges[frame])
        frame = edges[frame].parent
    if not chain:
        logger.info("%s: no transform reaches the cloud frame %r; the sweeps will be registered", path.name, frame_id)
        return None
    at = np.asarray(stamps, dtype=np.int64)
    poses = np.tile(np.eye(4), (len(at), 1, 1))
    for edge in chain:  # the chain runs child -> root, so each parent's transform goes on the left
        if edge.static:
            poses = edge.matrices[-1] @ poses
        else:
            poses = interpolate_poses(at, np.asarray(edge.stamps, dtype=np.int64), np.stack(edge.matrices)) @ poses
    return poses


def _edges(reader: AnyReader, path: Path) -> dict[str, _Edge]:
    """child frame -> its parent and the transform samples, from every TFMessage and Odometry topic."""
    edges: dict[str, _Edge] = {}
    wanted = [c for c in reader.connections if c.msgtype in (TF_MESSAGE, ODOMETRY)]
    if not wanted:  # rosbags reads every connection when given none
        return edges
    for connection, log_time, raw in reader.messages(connections=wanted):
        if len(raw) > MAX_POSE_MESSAGE_BYTES:
            raise PointCloudError(f"{path}: a {connection.msgtype} message on {connection.topic} of {len(raw):,} bytes; "
                                  f"a pose message holds at most {MAX_POSE_MESSAGE_BYTES:,}")
        msg = reader.deserialize(raw, connection.msgtype)
        static = connection.topic == STATIC_TF_TOPIC
        for parent, child, stamp, matrix in _transforms(msg, connection.msgtype):
            edge = edges.setdefault(child, _Edge(parent, static=static))
            if edge.parent != parent:
                continue  # a frame has one parent; a second one is a mistake of the recording
            edge.stamps.append(stamp or int(log_time))
            edge.matrices.append(matrix)
    return edges


def _transforms(msg: Any, msgtype: str) -> Iterator[tuple[str, str, int, np.ndarray]]:
    if msgtype == ODOMETRY:
        p, q = msg.pose.pose.position, msg.pose.pose.orientation
        yield (msg.header.frame_id.lstrip("/"), msg.child_frame_id.lstrip("/"), _stamp(msg.header),
               pose_matrix((p.x, p.y, p.z), (q.x, q.y, q.z, q.w)))
        return
    for t in msg.transforms:
        v, q = t.transform.translation, t.transform.rotation
        yield (t.header.frame_id.lstrip("/"), t.child_frame_id.lstrip("/"), _stamp(t.header),
               pose_matrix((v.x, v.y, v.z), (q.x, q.y, q.z, q.w)))


def _stamp(header: Any) -> int:
    stamp = header.stamp
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)

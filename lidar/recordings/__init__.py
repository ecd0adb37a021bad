"""Recordings as sensors and datasets keep them: ROS 1 bags, ROS 2 bags (sqlite3 or MCAP), MCAP files,
Velodyne and Ouster pcap captures, nuScenes LIDAR_TOP sweeps and Argoverse 2 logs.

`open_container` picks the reader from the file's first bytes (a folder from its layout) and returns a lazy
`ContainerRecording`: the sweeps' stamps, names and poses are known at once, a sweep is decoded when it is
indexed. `topic` chooses what to read where a container holds several: a PointCloud2 topic of a bag, a
nuScenes log. docs/formats.md lists what each reader keeps and its bounds.
"""

from __future__ import annotations

from pathlib import Path

from lidar.errors import MAX_SHOWN_CHARS, capped
from lidar.formats.scan import PointCloudError
from lidar.recordings.bag_guard import MCAP_MAGIC, ROS1_MAGIC, SQLITE_MAGIC
from lidar.recordings.base import ContainerRecording, unreadable
from lidar.sensors import Sensor

#: What a command line's `--topic` chooses, in its help.
TOPIC_HELP = "the PointCloud2 topic of a bag (or the log of a nuScenes root) to read; needed when it holds several"
#: File suffixes of the single-file containers (what an upload may be); folders are recognised by layout.
CONTAINER_SUFFIXES = (".bag", ".db3", ".mcap", ".pcap")
_BAG_MAGICS = (ROS1_MAGIC, MCAP_MAGIC, SQLITE_MAGIC)
#: A ROS 2 bag folder holds its storage files beside this.
ROS2_METADATA = "metadata.yaml"


def is_container(path: str | Path) -> bool:
    """True for a file with a container suffix, a ROS 2 bag folder, a nuScenes root or an Argoverse 2 log.

    A path the file system refuses to look at (a name too long, a folder it may not search) is a
    `PointCloudError` naming it, not an `OSError`.
    """
    from lidar.recordings.argoverse import is_argoverse
    from lidar.recordings.nuscenes import is_nuscenes

    path = Path(path)
    try:
        if path.is_dir():
            return (path / ROS2_METADATA).is_file() or is_nuscenes(path) or is_argoverse(path)
    except OSError as err:
        raise unreadable(path, err) from err
    return path.suffix.lower() in CONTAINER_SUFFIXES


def open_container(path: str | Path, *, topic: str | None = None, sensor: Sensor | None = None,
                   max_sweeps: int | None = None) -> ContainerRecording:
    """The recording in a container file or folder; an `InputError` names what was wrong and what was expected.

    `max_sweeps` refuses a bag whose topic lists more messages before any is read (an upload's sweep limit).
    A path or a member file the file system refuses is a `PointCloudError` naming it.
    """
    path = Path(path)
    try:
        return _open(path, topic, sensor, max_sweeps)
    except OSError as err:
        raise unreadable(path, err) from err


def _open(path: Path, topic: str | None, sensor: Sensor | None, max_sweeps: int | None) -> ContainerRecording:
    if path.is_dir():
        return _open_folder(path, topic, sensor, max_sweeps)
    if not path.is_file():
        raise PointCloudError(f"{capped(str(path), MAX_SHOWN_CHARS)}: no such file or folder")
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(_BAG_MAGICS):
        from lidar.recordings.rosbag import open_bag

        if head.startswith(ROS1_MAGIC) and path.suffix.lower() != ".bag":
            raise PointCloudError(f"{path}: a ROS 1 bag must be named *.bag")
        return open_bag(path, topic, sensor, max_sweeps)
    from lidar.recordings.pcap import is_pcap

    if is_pcap(path):
        return _open_pcap(path, sensor)
    raise PointCloudError(
        f"{path}: not a recording container; expected a ROS 1 .bag, a ROS 2 .db3 or .mcap, or a Velodyne or Ouster .pcap"
    )


def _open_pcap(path: Path, sensor: Sensor | None) -> ContainerRecording:
    from lidar.recordings.ouster import find_metadata, open_ouster_pcap
    from lidar.recordings.velodyne import is_velodyne, open_velodyne_pcap

    if is_velodyne(path):
        return open_velodyne_pcap(path, sensor)
    metadata = find_metadata(path)
    if metadata is not None:
        return open_ouster_pcap(path, metadata, sensor)
    raise PointCloudError(
        f"{path}: no Velodyne data packets among its first datagrams and no Ouster metadata json beside it; "
        "expected a Velodyne capture, or an Ouster capture with the sensor's metadata json in the same folder"
    )


def _open_folder(folder: Path, topic: str | None, sensor: Sensor | None, max_sweeps: int | None) -> ContainerRecording:
    from lidar.recordings.argoverse import is_argoverse, open_argoverse
    from lidar.recordings.nuscenes import is_nuscenes, open_nuscenes

    if (folder / ROS2_METADATA).is_file():
        storage = sorted(p for p in folder.iterdir() if p.suffix in (".db3", ".mcap"))
        if len(storage) != 1:
            raise PointCloudError(f"{folder}: a ROS 2 bag of {len(storage)} storage files; expected one .db3 or .mcap")
        return open_container(storage[0], topic=topic, sensor=sensor, max_sweeps=max_sweeps)
    if is_nuscenes(folder):
        return open_nuscenes(folder, topic, sensor)
    if is_argoverse(folder):
        return open_argoverse(folder, sensor)
    raise PointCloudError(f"{folder}: not a ROS 2 bag, a nuScenes root or an Argoverse 2 log")


__all__ = ["CONTAINER_SUFFIXES", "ContainerRecording", "is_container", "open_container"]

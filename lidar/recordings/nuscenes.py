"""nuScenes LIDAR_TOP sweeps: `samples/LIDAR_TOP/*.pcd.bin` and `sweeps/LIDAR_TOP/*.pcd.bin` under a dataset
root, with the ego poses of `<version>/ego_pose.json` when it is there.

Each file is five float32 per point (x, y, z, intensity, ring), read by `lidar.formats` like any
`.pcd.bin`. Its name `<log>__LIDAR_TOP__<microseconds>.pcd.bin` gives its log and its time stamp; one
recording is one log (the topic), in time order, keyframes and intermediate sweeps together.

Poses: nuScenes records an ego pose at every sweep's own time stamp, so a sweep takes the ego pose of its
stamp (`ego_pose.json` rows: timestamp in us, translation, rotation as w, x, y, z). The points are in the
LIDAR_TOP frame, mounted on the ego: with `calibrated_sensor.json` and `sensor.json` beside it the pose is
world_from_ego @ ego_from_lidar; a dataset holding several different LIDAR_TOP calibrations, or none, is
posed by registration instead, since a pose for the ego is not one for its sensor.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from lidar.formats import Scan, read_points
from lidar.formats.scan import PointCloudError
from lidar.recordings.base import ContainerRecording, check_sweep_count, make_recording, pose_matrix
from lidar.sensors import Sensor
from lidar.sequence import parse_json

logger = logging.getLogger(__name__)

CHANNEL = "LIDAR_TOP"
SWEEP_FOLDERS = (Path("samples") / CHANNEL, Path("sweeps") / CHANNEL)
#: Most bytes a nuScenes table read here may hold (v1.0-mini's ego_pose.json: 9 MB; trainval's: 420 MB).
MAX_TABLE_BYTES = 64 << 20
_NAME = re.compile(r"^(?P<log>.+)__LIDAR_TOP__(?P<us>\d{10,20})\.pcd\.bin$")


def is_nuscenes(folder: Path) -> bool:
    return folder.is_dir() and any((folder / sub).is_dir() for sub in SWEEP_FOLDERS)


def open_nuscenes(root: Path, log: str | None = None, sensor: Sensor | None = None) -> ContainerRecording:
    by_log: dict[str, list[tuple[int, Path]]] = {}
    for sub in SWEEP_FOLDERS:
        folder = root / sub
        for path in folder.iterdir() if folder.is_dir() else ():
            match = _NAME.match(path.name)
            if match:
                by_log.setdefault(match["log"], []).append((int(match["us"]), path))
        check_sweep_count(root, sum(len(v) for v in by_log.values()))
    if not by_log:
        raise PointCloudError(f"{root}: no <log>__LIDAR_TOP__<us>.pcd.bin files in samples/ or sweeps/{CHANNEL}/")
    if log is None and len(by_log) > 1:
        raise PointCloudError(f"{root}: sweeps of {len(by_log)} logs ({', '.join(sorted(by_log)[:10])}); choose one "
                              "(--topic LOG)")
    log = log if log is not None else next(iter(by_log))
    if log not in by_log:
        raise PointCloudError(f"{root}: no sweeps of log {log!r}; it holds {', '.join(sorted(by_log)[:10])}")
    sweeps = sorted(by_log[log])
    stamps_us = np.array([us for us, _ in sweeps], dtype=np.int64)
    files = [path for _, path in sweeps]
    poses = _poses(root, stamps_us)

    def decode(i: int) -> Scan:
        return read_points(files[i], sensor)

    return make_recording(root, "nuscenes", log, stamps_us * 1000, decode, poses, labels=[f.name for f in files])


def _tables_folder(root: Path) -> Path | None:
    """The version folder (v1.0-mini, v1.0-trainval, ...) holding ego_pose.json, if any."""
    found = sorted(p.parent for p in root.glob("*/ego_pose.json"))
    return found[0] if found else None


def _table(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise PointCloudError(f"{path}: no such nuScenes table")
    if path.stat().st_size > MAX_TABLE_BYTES:
        raise PointCloudError(f"{path}: over {MAX_TABLE_BYTES >> 20} MB; a nuScenes table read here holds at most that")
    data = parse_json(path.read_text(encoding="utf-8", errors="replace"), str(path))
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise PointCloudError(f"{path}: not a nuScenes table (a JSON list of records)")
    return data


def _poses(root: Path, stamps_us: np.ndarray) -> np.ndarray | None:
    tables = _tables_folder(root)
    if tables is None:
        return None
    lidar = _lidar_calibration(tables)
    if lidar is None:
        logger.info("%s: no single LIDAR_TOP calibration; the sweeps will be registered", tables)
        return None
    try:
        by_stamp = {int(row["timestamp"]): pose_matrix(row["translation"], _xyzw(row["rotation"]))
                    for row in _table(tables / "ego_pose.json")}
    except (KeyError, TypeError, ValueError):
        raise PointCloudError(f"{tables / 'ego_pose.json'}: rows need timestamp, translation and rotation") from None
    missing = [int(us) for us in stamps_us if int(us) not in by_stamp]
    if missing:
        logger.info("%s: no ego pose at %d of the sweeps' stamps; the sweeps will be registered", tables, len(missing))
        return None
    return np.stack([by_stamp[int(us)] for us in stamps_us]) @ lidar


def _lidar_calibration(tables: Path) -> np.ndarray | None:
    """ego_from_lidar of LIDAR_TOP when the dataset's tables give exactly one, else None."""
    if not (tables / "sensor.json").is_file() or not (tables / "calibrated_sensor.json").is_file():
        return None
    try:
        tokens = {row["token"] for row in _table(tables / "sensor.json") if row.get("channel") == CHANNEL}
        found = {(tuple(row["translation"]), tuple(row["rotation"]))
                 for row in _table(tables / "calibrated_sensor.json") if row.get("sensor_token") in tokens}
    except (KeyError, TypeError):
        raise PointCloudError(f"{tables}: sensor.json / calibrated_sensor.json rows lack token, channel, translation "
                              "or rotation") from None
    if len(found) != 1:
        return None
    translation, rotation = next(iter(found))
    return pose_matrix(translation, _xyzw(rotation))


def _xyzw(wxyz: Any) -> tuple[float, float, float, float]:
    w, x, y, z = (float(v) for v in wxyz)
    return x, y, z, w

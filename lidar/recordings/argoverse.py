"""Argoverse 2 sensor-dataset logs: `sensors/lidar/<ns>.feather` sweeps, `city_SE3_egovehicle.feather` ego
poses and `calibration/egovehicle_SE3_sensor.feather`, read with `pyarrow`.

An AV2 sweep merges two stacked VLP-32C (`up_lidar`, lasers 0-31, and `down_lidar`, 32-63, mounted upside
down about 12 cm below) and stores the points in the ego frame. They are moved into the `up_lidar` frame
here, so a sweep has a sensor origin like every other recording: the up lidar's returns are then exactly in
their sensor's frame, the down lidar's lie 12 cm off their own origin (the ring keeps them apart: the
laser number is the ring). The pose of a sweep is city_SE3_egovehicle at its stamp (the file name, ns)
times egovehicle_SE3_up_lidar; intensity is 0-255.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from lidar.formats import Scan
from lidar.formats.scan import PointCloudError, build_scan, check_file_size
from lidar.recordings.base import (
    ContainerRecording,
    check_sweep_count,
    interpolate_poses,
    make_recording,
    pose_matrix,
)
from lidar.sensors import Sensor

logger = logging.getLogger(__name__)

SWEEP_FOLDER = Path("sensors") / "lidar"
POSES_FILE = "city_SE3_egovehicle.feather"
CALIBRATION_FILE = Path("calibration") / "egovehicle_SE3_sensor.feather"
SENSOR = "up_lidar"
_POINT_COLUMNS = ("x", "y", "z", "intensity", "laser_number")
_POSE_COLUMNS = ("qw", "qx", "qy", "qz", "tx_m", "ty_m", "tz_m")


def is_argoverse(folder: Path) -> bool:
    return folder.is_dir() and (folder / SWEEP_FOLDER).is_dir()


def open_argoverse(log: Path, sensor: Sensor | None = None) -> ContainerRecording:
    files = sorted((p for p in (log / SWEEP_FOLDER).glob("*.feather") if p.stem.isdigit()), key=lambda p: int(p.stem))
    check_sweep_count(log, len(files))
    if not files:
        raise PointCloudError(f"{log}: no <nanoseconds>.feather sweeps in {SWEEP_FOLDER}/; expected an Argoverse 2 log")
    stamps = np.array([int(p.stem) for p in files], dtype=np.int64)
    ego_from_sensor = _ego_from_sensor(log)
    sensor_from_ego = np.linalg.inv(ego_from_sensor)
    poses = _ego_poses(log, stamps)

    def decode(i: int) -> Scan:
        table = _read(files[i], _POINT_COLUMNS)
        xyz = np.stack([table["x"], table["y"], table["z"]], axis=1).astype(np.float64)
        xyz = xyz @ sensor_from_ego[:3, :3].T + sensor_from_ego[:3, 3]
        return build_scan(files[i], "av2-feather", xyz, table["intensity"], table["laser_number"].astype(np.int64),
                          columns=_POINT_COLUMNS, sensor=sensor)

    world = None if poses is None else poses @ ego_from_sensor
    return make_recording(log, "argoverse2", SENSOR, stamps, decode, world, labels=[p.name for p in files])


def _read(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    import pyarrow.feather as feather  # imported when a log is read: it takes a few hundred ms

    check_file_size(path)
    try:
        table = feather.read_table(path, columns=list(columns), memory_map=True)
    except Exception as err:  # pyarrow raises its own ArrowInvalid/ArrowKeyError/OSError family
        if isinstance(err, PointCloudError):
            raise
        raise PointCloudError(f"{path}: not a feather table with columns {', '.join(columns)} "
                              f"({type(err).__name__}: {str(err)[:160]})") from None
    return {name: table.column(name).to_numpy() for name in columns}


def _ego_from_sensor(log: Path) -> np.ndarray:
    path = log / CALIBRATION_FILE
    if not path.is_file():
        raise PointCloudError(f"{log}: no {CALIBRATION_FILE}; the points are in the ego frame and need the "
                              f"{SENSOR} calibration to be moved to its sensor frame")
    table = _read(path, ("sensor_name", *_POSE_COLUMNS))
    rows = np.flatnonzero(table["sensor_name"] == SENSOR)
    if len(rows) != 1:
        raise PointCloudError(f"{path}: {len(rows)} rows for {SENSOR}; expected one")
    return _matrices(table, rows)[0]


def _matrices(table: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    return np.stack([pose_matrix((table["tx_m"][r], table["ty_m"][r], table["tz_m"][r]),
                                 (table["qx"][r], table["qy"][r], table["qz"][r], table["qw"][r])) for r in rows])


def _ego_poses(log: Path, stamps: np.ndarray) -> np.ndarray | None:
    """city_SE3_egovehicle at each sweep's stamp (interpolated between the log's pose samples), or None."""
    if not (log / POSES_FILE).is_file():
        return None
    table = _read(log / POSES_FILE, ("timestamp_ns", *_POSE_COLUMNS))
    samples = _matrices(table, np.arange(len(table["timestamp_ns"])))
    return interpolate_poses(stamps, table["timestamp_ns"].astype(np.int64), samples)

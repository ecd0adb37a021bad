"""ASPRS `.las` / `.laz` through laspy (lazrs backend): the exchange format of survey and GIS tools."""

from __future__ import annotations

from pathlib import Path

import laspy
import numpy as np

from lidar.formats.fields import split_fields
from lidar.formats.scan import PointCloudError, Scan, build_scan, check_point_count
from lidar.sensors import Sensor

#: Coordinates are stored as integers times this scale: 0.1 mm, far below any LiDAR's noise.
_SCALE = 1e-4


def read_las(path: Path, sensor: Sensor | None) -> Scan:
    try:
        with laspy.open(path) as reader:
            check_point_count(path, int(reader.header.point_count))
            las = reader.read()
    except (laspy.LaspyException, ValueError, OSError) as err:
        if isinstance(err, PointCloudError):
            raise
        raise PointCloudError(f"{path}: not a readable LAS/LAZ file ({err}); expected ASPRS LAS 1.0-1.4 or LAZ") from err
    fields = {"x": np.asarray(las.x), "y": np.asarray(las.y), "z": np.asarray(las.z), "intensity": np.asarray(las.intensity)}
    for name in las.point_format.extra_dimension_names:
        fields[name] = np.asarray(las[name])
    fmt = "laz" if path.suffix.lower() == ".laz" else "las"
    return build_scan(path, fmt, **split_fields(path, fields), sensor=sensor)


def write_las(path: Path, points: np.ndarray, ring: np.ndarray | None) -> None:
    """Intensity goes to LAS's uint16 field as 0-65535, which readers map back to [0, 1]."""
    header = laspy.LasHeader(point_format=0, version="1.4")
    if ring is not None:
        header.add_extra_dim(laspy.ExtraBytesParams(name="ring", type=np.uint16))
    header.offsets = np.floor(points[:, :3].min(axis=0)) if len(points) else np.zeros(3)
    header.scales = np.full(3, _SCALE)
    las = laspy.LasData(header)
    las.x, las.y, las.z = (points[:, k].astype(np.float64) for k in range(3))
    las.intensity = np.round(np.clip(points[:, 3], 0.0, 1.0) * 65535).astype(np.uint16)
    if ring is not None:
        las.ring = ring.astype(np.uint16)
    las.write(path)

"""ASPRS `.las` / `.laz` through laspy (lazrs backend): the exchange format of survey and GIS tools."""

from __future__ import annotations

import struct
from pathlib import Path

import laspy
import numpy as np

from lidar.formats.fields import split_fields
from lidar.formats.scan import PointCloudError, Scan, build_scan, check_decoded_size, check_point_count
from lidar.sensors import Sensor

#: Coordinates are stored as integers times this scale: 0.1 mm, far below any LiDAR's noise.
_SCALE = 1e-4


#: Bytes of one variable-length-record header; a header may not promise more records than fit before the points.
_VLR_HEADER_BYTES = 54


def _check_header(path: Path, size: int) -> None:
    """Sanity-check the public header block before laspy walks it (a corrupt VLR count makes it loop for ages)
    and bound what it will allocate: laspy sizes its point buffer from the header's count before it
    decompresses a byte, so a LAZ header promising millions of wide records is refused here."""
    with path.open("rb") as f:
        head = f.read(375)
    if len(head) < 227:
        raise PointCloudError(f"{path}: LAS header is truncated ({len(head)} bytes); expected at least 227")
    header_size, point_offset, n_vlrs = struct.unpack_from("<HII", head, 94)
    if not (227 <= header_size <= point_offset <= size):
        raise PointCloudError(
            f"{path}: corrupt LAS header (header size {header_size}, point data at byte {point_offset}, file {size} bytes)"
        )
    if n_vlrs * _VLR_HEADER_BYTES > point_offset - header_size:
        raise PointCloudError(f"{path}: corrupt LAS header: {n_vlrs:,} VLRs cannot fit before the point data")
    point_format, record_length, legacy_count = struct.unpack_from("<BHI", head, 104)
    count = legacy_count
    if header_size >= 375 and len(head) >= 255:  # LAS 1.4 keeps a 64-bit count as well
        count = max(count, struct.unpack_from("<Q", head, 247)[0])
    check_point_count(path, count)
    check_decoded_size(path, count * record_length, f"the LAS point records ({count:,} of {record_length} bytes)")
    compressed = point_format & 0xC0  # LAZ sets the top bits of the point format id
    if not compressed and count * record_length > size - point_offset:
        raise PointCloudError(
            f"{path}: LAS header promises {count:,} points of {record_length} bytes but only "
            f"{size - point_offset:,} bytes of point data follow (truncated file?)"
        )


def read_las(path: Path, sensor: Sensor | None) -> Scan:
    """Read x, y, z, intensity and any extra dimensions (a `ring` extra byte is recognised) through laspy."""
    _check_header(path, path.stat().st_size)
    try:
        with laspy.open(path) as reader:
            las = reader.read()
    except (laspy.LaspyException, ValueError, OSError) as err:
        raise PointCloudError(f"{path}: not a readable LAS/LAZ file ({err}); expected ASPRS LAS 1.0-1.4 or LAZ") from err
    fields = {"x": np.asarray(las.x), "y": np.asarray(las.y), "z": np.asarray(las.z), "intensity": np.asarray(las.intensity)}
    for name in las.point_format.extra_dimension_names:
        fields[name] = np.asarray(las[name])
    fmt = "laz" if path.suffix.lower() == ".laz" else "las"
    return build_scan(path, fmt, **split_fields(path, fields), sensor=sensor)


def write_las(path: Path, points: np.ndarray, ring: np.ndarray | None) -> None:
    """Intensity goes to LAS's uint16 field as 0-65535, which readers map back to [0, 1].

    LAS stores coordinates as 32-bit integers times a scale (0.1 mm here) from an offset, so a cloud spanning
    more than 2**31 steps (214 km) on an axis has no LAS form; it is refused here, not overflowed in laspy.
    """
    span = float((points[:, :3].max(axis=0) - points[:, :3].min(axis=0)).max()) if len(points) else 0.0
    if span >= (2**31 - 1) * _SCALE:
        raise PointCloudError(
            f"{path}: the points span {span:.3g} m on one axis; LAS holds at most {(2**31 - 1) * _SCALE / 1000:,.0f} km "
            f"at its {_SCALE * 1000:g} mm resolution"
        )
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

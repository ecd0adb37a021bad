"""ASPRS `.las` / `.laz` through laspy (lazrs backend): the exchange format of survey and GIS tools.

Everything the decoders size an allocation by is checked against the file first, because lazrs aborts its
process (not raises) when an allocation fails: the public header's counts and offsets, the extended VLRs,
and for LAZ the chunk table's length (a table claiming 0xFFFFFFFF chunks asks for 64 GiB) and the layer
sizes each layered chunk declares (up to 4 GiB each). The points are decompressed by lazrs's sequential
decoder, which sizes nothing by the table's per-chunk byte counts. Only the dimensions a sweep uses (x, y,
z, intensity and an extra dimension named like a ring or a time) are scaled into arrays; the others are
only named, so 180 scaled extra-byte dimensions cost their raw bytes, not 180 float64 columns.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import BinaryIO

import laspy
import lazrs
import numpy as np

from lidar.formats.fields import check_field_count, split_fields, used_fields
from lidar.formats.scan import PointCloudError, Scan, build_scan, check_decoded_size, check_point_count
from lidar.sensors import Sensor

#: Coordinates are stored as integers times this scale: 0.1 mm, far below any LiDAR's noise.
_SCALE = 1e-4

#: Bytes of one variable-length-record header; a header may not promise more records than fit before the points.
_VLR_HEADER_BYTES = 54
#: Bytes of one extended VLR header (LAS 1.4), which sits after the points.
_EVLR_HEADER_BYTES = 60
#: The LASzip VLR's fixed part (compressor, coder, version, options, chunk size, special EVLRs, item count).
_LASZIP_VLR = struct.Struct("<HHBBHIIqqH")
_LASZIP_ITEM = struct.Struct("<HHH")
#: LASzip compressors: one stream, fixed or variable chunks of point-wise coded points, layered chunks.
_POINT_WISE, _POINT_WISE_CHUNKED, _LAYERED_CHUNKED = 1, 2, 3
#: LASzip's chunk size for "variable-size chunks" (each chunk's point count is in the chunk table).
_VARIABLE_CHUNKS = 0xFFFFFFFF
#: Layers a layered chunk declares a byte size for, per LASzip item type (Point14, RGB14, RGBNIR14,
#: Wavepacket14); extra bytes (Byte14, type 14) have one layer per byte.
_LAYERS = {10: 9, 11: 1, 12: 2, 13: 1}
_BYTE14 = 14


def _check_header(path: Path, head: bytes, size: int) -> int:
    """Sanity-check the public header block before laspy walks it (a corrupt VLR count makes it loop for ages)
    and bound what it will allocate: laspy sizes its point buffer from the header's count before it
    decompresses a byte, so a LAZ header promising millions of wide records is refused here. Returns the
    point count."""
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
    if header_size >= 375 and len(head) >= 375:  # LAS 1.4 keeps a 64-bit count as well
        count = max(count, struct.unpack_from("<Q", head, 247)[0])
    check_point_count(path, count)
    check_decoded_size(path, count * record_length, f"the LAS point records ({count:,} of {record_length} bytes)")
    compressed = point_format & 0xC0  # LAZ sets the top bits of the point format id
    if not compressed and count * record_length > size - point_offset:
        raise PointCloudError(
            f"{path}: LAS header promises {count:,} points of {record_length} bytes but only "
            f"{size - point_offset:,} bytes of point data follow (truncated file?)"
        )
    return count


def _check_evlrs(path: Path, f: BinaryIO, head: bytes, size: int) -> None:
    """Walk the extended VLRs' headers (LAS 1.4) so laspy never reads a record past the file's end."""
    header_size = struct.unpack_from("<H", head, 94)[0]
    if header_size < 375 or len(head) < 375:
        return
    start, count = struct.unpack_from("<QI", head, 235)
    if count == 0:
        return
    if start > size or count * _EVLR_HEADER_BYTES > size - start:
        raise PointCloudError(f"{path}: corrupt LAS header: {count:,} extended VLRs cannot fit after byte {start:,}")
    at = start
    for _ in range(count):
        f.seek(at + 20)
        length = struct.unpack("<Q", f.read(8))[0]
        at += _EVLR_HEADER_BYTES + length
        if at > size:
            raise PointCloudError(f"{path}: corrupt LAS file: an extended VLR runs past the end of the file")


def _laszip_vlr(path: Path, header: laspy.LasHeader) -> tuple[int, int, list[tuple[int, int]], bytes]:
    """(compressor, chunk size, [(item type, item size)], record data) of the LASzip VLR."""
    found = header.vlrs.get("LasZipVlr")
    if not found:
        raise PointCloudError(f"{path}: a compressed LAS (LAZ) without a LASzip VLR; expected a LAZ written by LASzip")
    data = bytes(found[0].record_data)
    if len(data) < _LASZIP_VLR.size:
        raise PointCloudError(f"{path}: the LASzip VLR is truncated ({len(data)} bytes)")
    compressor, _, _, _, _, _, chunk_size, _, _, n_items = _LASZIP_VLR.unpack_from(data)
    if len(data) < _LASZIP_VLR.size + n_items * _LASZIP_ITEM.size:
        raise PointCloudError(f"{path}: the LASzip VLR lists {n_items} items but holds {len(data)} bytes")
    items = [_LASZIP_ITEM.unpack_from(data, _LASZIP_VLR.size + k * _LASZIP_ITEM.size)[:2] for k in range(n_items)]
    return compressor, chunk_size, items, data


def _chunk_table_at(f: BinaryIO, point_offset: int, size: int) -> int | None:
    """Where lazrs will look for the chunk table: the offset stored at the start of the point data, or,
    when that is not past it, the one in the file's last 8 bytes; None when neither points inside the file."""
    f.seek(point_offset)
    at = struct.unpack("<q", f.read(8).ljust(8, b"\0"))[0]
    if at <= point_offset:
        f.seek(max(size - 8, 0))
        at = struct.unpack("<q", f.read(8).ljust(8, b"\0"))[0]
    return at if point_offset < at <= size - 8 else None


def _check_chunks(path: Path, f: BinaryIO, header: laspy.LasHeader, size: int) -> None:
    """Bound every allocation lazrs sizes from the compressed data before it sees the file.

    The chunk table may list at most the chunks the point count needs (lazrs reserves 16 bytes for each
    listed chunk before reading one); its chunks must lie within the point data; and each layered chunk's
    declared layer sizes must add up to the chunk's bytes (lazrs allocates each layer at its declared size).
    """
    compressor, chunk_size, items, vlr = _laszip_vlr(path, header)
    if compressor == _POINT_WISE:
        return  # one stream, no table, nothing sized by the data
    if compressor not in (_POINT_WISE_CHUNKED, _LAYERED_CHUNKED) or chunk_size == 0:
        raise PointCloudError(f"{path}: LASzip compressor {compressor} with chunks of {chunk_size}; expected LASzip 2 or 3")
    count, point_offset = header.point_count, header.offset_to_point_data
    table = _chunk_table_at(f, point_offset, size)
    if table is None:
        raise PointCloudError(f"{path}: the LAZ chunk table offset points outside the file; expected a LAZ written by LASzip")
    f.seek(table)
    _, chunks = struct.unpack("<II", f.read(8))
    most = count if chunk_size == _VARIABLE_CHUNKS else math.ceil(count / chunk_size)
    if not 1 <= chunks <= most:
        raise PointCloudError(
            f"{path}: the LAZ chunk table lists {chunks:,} chunks; {count:,} points need 1 to {most:,}"
        )
    f.seek(point_offset)
    entries = lazrs.read_chunk_table(f, lazrs.LazVlr(vlr))
    if chunk_size != _VARIABLE_CHUNKS and len(entries) != most:
        raise PointCloudError(f"{path}: the LAZ chunk table lists {len(entries):,} chunks; {count:,} points need {most:,}")
    if chunk_size == _VARIABLE_CHUNKS and sum(points for points, _ in entries) < count:
        raise PointCloudError(f"{path}: the LAZ chunk table holds fewer than the header's {count:,} points")
    start = point_offset + 8
    for _, nbytes in entries:
        if start + nbytes > table:
            raise PointCloudError(f"{path}: a LAZ chunk runs past the point data (corrupt chunk table)")
        if compressor == _LAYERED_CHUNKED:
            _check_layers(path, f, start, nbytes, items)
        start += nbytes


def _check_layers(path: Path, f: BinaryIO, start: int, nbytes: int, items: list[tuple[int, int]]) -> None:
    """A layered chunk: the first point raw, its point count, one byte size per layer, then the layers."""
    layers = sum(item_size if kind == _BYTE14 else _LAYERS.get(kind, 0) for kind, item_size in items)
    point = sum(item_size for _, item_size in items)
    f.seek(start + point + 4)
    sizes = np.frombuffer(f.read(4 * layers), dtype="<u4")
    if len(sizes) < layers or point + 4 + 4 * layers + int(sizes.sum(dtype=np.int64)) != nbytes:
        raise PointCloudError(f"{path}: a LAZ chunk's layer sizes do not add up to its {nbytes:,} bytes (corrupt chunk)")


def _open_checked(path: Path, f: BinaryIO) -> laspy.LasReader:
    """A laspy reader on `f` once the header, extended VLRs and (LAZ) chunks passed the checks above."""
    size = path.stat().st_size
    head = f.read(375)
    _check_header(path, head, size)
    _check_evlrs(path, f, head, size)
    f.seek(0)
    reader = laspy.open(f, closefd=False, laz_backend=laspy.LazBackend.Lazrs)
    if reader.header.are_points_compressed:
        _check_chunks(path, f, reader.header, size)
        f.seek(reader.header.offset_to_point_data)
    return reader


def read_las(path: Path, sensor: Sensor | None) -> Scan:
    """Read x, y, z, intensity and any extra dimensions (a `ring` extra byte is recognised) through laspy."""
    with path.open("rb") as f:  # laspy's and lazrs's own errors, panics included, are read_points's to word
        las = _open_checked(path, f).read()
    extra = list(las.point_format.extra_dimension_names)
    check_field_count(path, len(extra), "the LAS extra-bytes VLR")
    names = ["x", "y", "z", "intensity", *extra]
    used = set(used_fields(path, names).values())
    fields = {name: np.asarray(las[name]) for name in names if name in used}
    fmt = "laz" if path.suffix.lower() == ".laz" else "las"
    return build_scan(path, fmt, **split_fields(path, fields, columns=tuple(names)), sensor=sensor)


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

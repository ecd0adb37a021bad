"""NumPy `.npy` / `.npz` clouds: a plain (N, 3+) array, a structured array, or named arrays in an archive.

Columns of a plain array follow the KITTI/nuScenes order (x, y, z, intensity, then ring or time), so a
`.bin` that someone saved with `np.save` reads the same as the raw file would.
"""

from __future__ import annotations

import math
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lidar.errors import capped, shown, shown_names
from lidar.formats.fields import (
    MAX_FIELDS,
    check_column_sizes,
    check_field_count,
    extra_column_kind,
    split_fields,
    used_fields,
)
from lidar.formats.scan import (
    PointCloudError,
    Scan,
    build_scan,
    check_decoded_size,
    check_point_count,
    max_points,
)
from lidar.sensors import Sensor

NPY_MAGIC = b"\x93NUMPY"
#: A point cloud archive holds a few named arrays; zipfile reads the whole central directory into memory
#: before anything else can be checked, so its entry count and size are read from the file's tail first.
MAX_NPZ_MEMBERS = 64
MAX_NPZ_DIRECTORY = 1 << 20
EOCD = struct.Struct("<4s4H2LH")  # end-of-central-directory record
EOCD_SIGNATURE = b"PK\x05\x06"
#: A member's local header: signature, versions, flags, method, time, CRC, sizes, then name and extra lengths.
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
#: Largest dictionary an LZMA member may ask its decoder for: 7-Zip's largest preset (ultra) uses 64 MiB.
MAX_LZMA_DICTIONARY = 64 * 2**20


def _npy_header(path: Path, f: BinaryIO, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from the .npy header at the stream's position; nothing of the array is read."""
    try:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
    except ValueError as err:
        raise PointCloudError(f"{path}: corrupt .npy header{what}: {capped(str(err), 200)}") from err
    return shape, dtype


def _check_npy_header(path: Path, shape: tuple[int, ...], dtype: np.dtype, data_bytes: int, what: str) -> None:
    """Refuse an array whose header promises more rows than the point limit or more bytes than are stored,
    so NumPy never allocates what the header claims (it sizes the array from the header, then fills it)."""
    rows = int(shape[0]) if shape else 1
    if rows > max_points():
        check_point_count(path, rows)
    promised = math.prod(shape) * dtype.itemsize
    if promised > data_bytes:
        raise PointCloudError(
            f"{path}: .npy header{what} promises {shape} {dtype} ({promised:,} bytes) but only {data_bytes:,} bytes "
            "of array data are stored (truncated or forged header)"
        )


def _check_columns(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A structured array's used fields, counted with their sub-arrays, within the point limit (from its
    header, before NumPy expands anything): a uint8 sub-array of 64 is 64 values of x a row."""
    if dtype.names is None:
        return
    check_field_count(path, len(dtype.names), "the structured array")
    used = used_fields(path, dtype.names)
    rows = math.prod(shape)
    check_column_sizes(path, used, {name: rows * math.prod(dtype[name].shape) for name in used.values()})


def _npy_rows(path: Path) -> int:
    """Row count from the .npy header alone, so an oversized array is refused before it is loaded."""
    with path.open("rb") as f:
        shape, dtype = _npy_header(path, f, "")
        _check_npy_header(path, shape, dtype, path.stat().st_size - f.tell(), "")
    _check_columns(path, shape, dtype)
    return int(shape[0]) if shape else 0


def zip_directory(path: Path, what: str = "zip") -> tuple[int, int]:
    """(entries, central-directory bytes) of a zip, from its end-of-central-directory record alone.

    `zipfile` reads the whole central directory into memory before anything can be checked (a million
    entries cost seconds and hundreds of MB), so archives are bounded by this tail record first. A zip64
    archive states 0xFFFF entries and 0xFFFFFFFF bytes here, which every bound refuses.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - EOCD.size - 0xFFFF))
        tail = f.read()
    at = tail.rfind(EOCD_SIGNATURE)
    if at < 0 or len(tail) - at < EOCD.size:
        raise PointCloudError(f"{path}: not a valid {what} (no zip end-of-directory record)")
    _, _, _, _, entries, directory_bytes, _, _ = EOCD.unpack_from(tail, at)
    return entries, directory_bytes


def check_lzma_member(path: Path, member: zipfile.ZipInfo, label: str) -> None:
    """Refuse an LZMA member whose properties ask for a dictionary past `MAX_LZMA_DICTIONARY`, before
    `zipfile` builds its decoder: liblzma allocates the whole dictionary up front, and the properties (a
    4-byte size ahead of the member's data) may ask for 4 GiB."""
    if member.compress_type != zipfile.ZIP_LZMA or not 0 <= member.header_offset < path.stat().st_size:
        return  # not LZMA, or a header zipfile refuses itself
    with path.open("rb") as f:
        f.seek(member.header_offset)
        local = f.read(_LOCAL_HEADER.size)
        if len(local) < _LOCAL_HEADER.size:
            return  # zipfile refuses the truncated header itself
        name_bytes, extra_bytes = _LOCAL_HEADER.unpack(local)[-2:]
        f.seek(member.header_offset + _LOCAL_HEADER.size + name_bytes + extra_bytes)
        head = f.read(9)  # version (2), properties size (2), lc/lp/pb (1), dictionary size (4)
    if len(head) == 9 and struct.unpack_from("<I", head, 5)[0] > MAX_LZMA_DICTIONARY:
        raise PointCloudError(
            f"{label}: the LZMA member {shown(member.filename)} asks for a {struct.unpack_from('<I', head, 5)[0]:,}-byte "
            f"dictionary; expected at most {MAX_LZMA_DICTIONARY:,} (7-Zip's largest preset)"
        )


def _check_zip_directory(path: Path) -> None:
    """Refuse an archive whose central directory lists more members, or more bytes, than a cloud needs."""
    entries, directory_bytes = zip_directory(path, ".npz")
    if entries > MAX_NPZ_MEMBERS or directory_bytes > MAX_NPZ_DIRECTORY:
        raise PointCloudError(
            f"{path}: the .npz lists {entries} members in a {directory_bytes:,}-byte directory; expected at "
            f"most {MAX_NPZ_MEMBERS} named arrays (points, ring, ...)"
        )


def _member_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{array name: (shape, dtype)} of an archive, bounded before anything is decompressed: the zip's
    declared sizes against the decode limit and each member's .npy header against the point limit and its
    declared size (zipfile never inflates a member past that size, and NumPy allocates what the header
    says before reading)."""
    _check_zip_directory(path)
    headers = {}
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        check_decoded_size(path, sum(m.file_size for m in members), "the .npz archive")
        for member in members:
            what = f" of member {shown(member.filename)}"
            check_lzma_member(path, member, str(path))
            with archive.open(member) as f:
                shape, dtype = _npy_header(path, f, what)
                _check_npy_header(path, shape, dtype, member.file_size - f.tell(), what)
            name = member.filename.removesuffix(".npy")  # the key np.load gives it
            headers[name] = (shape, dtype)
    return headers


def _columns_from_array(path: Path, arr: np.ndarray) -> dict[str, Any]:
    if arr.dtype.names:
        return split_fields(path, {name: arr[name] for name in arr.dtype.names})
    if arr.ndim != 2 or arr.shape[1] < 3 or not np.issubdtype(arr.dtype, np.number):
        raise PointCloudError(
            f"{path}: array of shape {arr.shape} and dtype {arr.dtype}; expected a numeric (N, 3+) array of "
            "x, y, z[, intensity[, ring or time]]"
        )
    data = arr[:, :5].astype(np.float64)  # columns past the fifth are named, never converted
    out: dict[str, Any] = {"xyz": data[:, :3], "columns": ("x", "y", "z")}
    if data.shape[1] > 3:
        out["intensity"] = data[:, 3]
        out["columns"] += ("intensity",)
    if data.shape[1] > 4:
        kind = extra_column_kind(data[:, 4])
        out["columns"] += (kind,)
        if kind in ("ring", "time"):
            out[kind] = data[:, 4]
    if arr.shape[1] > 5:
        out["columns"] += tuple(f"extra{k}" for k in range(5, min(arr.shape[1], MAX_FIELDS)))
    return out


def _load(path: Path, arr: np.ndarray, fmt: str, sensor: Sensor | None) -> Scan:
    notes = []
    if arr.dtype.names is None and arr.ndim == 2 and arr.shape[1] > 5:
        notes.append(f"columns beyond the 5th ignored ({arr.shape[1]} columns)")
    return build_scan(path, fmt, **_columns_from_array(path, arr), notes=notes, sensor=sensor)


def read_npy(path: Path, sensor: Sensor | None) -> Scan:
    """Load a plain or structured array without unpickling (a .npy can carry code)."""
    check_point_count(path, _npy_rows(path))
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as err:
        raise PointCloudError(
            f"{path}: cannot load the .npy array without unpickling ({capped(str(err), 200)}); expected a numeric array"
        ) from err
    return _load(path, arr, "npy", sensor)


def _npz_layout(path: Path, headers: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[str | None, dict[str, str]]:
    """(the points array's name, or None for x, y, z field arrays; the used field arrays' names), with the
    values each will give counted from the headers against the point limit."""
    lower = {k.lower(): k for k in headers}
    key = lower.get("points") or (next(iter(headers)) if len(headers) == 1 else None)
    if key is not None:
        shape, dtype = headers[key]
        _check_columns(path, shape, dtype)
        rows = int(shape[0]) if shape else 0
        check_point_count(path, rows)
        if "ring" in lower and dtype.names is None and len(shape) == 2:
            ring = math.prod(headers[lower["ring"]][0])
            if ring != rows:
                raise PointCloudError(f"{path}: the ring column has {ring:,} values for {rows:,} points; expected one per point")
            return key, {"ring": lower["ring"]}
        return key, {}
    if not all(c in lower for c in "xyz"):
        raise PointCloudError(
            f"{path}: .npz keys {shown_names(sorted(headers))}; expected 'points' (N, 3+) (optionally with 'ring') "
            "or x, y, z arrays"
        )
    used = used_fields(path, headers)
    check_column_sizes(path, used, {name: math.prod(headers[name][0]) for name in used.values()})
    return None, used


def read_npz(path: Path, sensor: Sensor | None) -> Scan:
    """Load 'points' (with an optional 'ring'), the only array, or x/y/z field arrays, without unpickling.

    Only the arrays used are inflated, once their headers passed the bounds.
    """
    headers = _member_headers(path)
    if not headers:
        raise PointCloudError(f"{path}: the .npz archive is empty; expected 'points' (N, 3+) or x, y, z arrays")
    key, used = _npz_layout(path, headers)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in ([key] if key is not None else []) + list(used.values())}
    except ValueError as err:
        raise PointCloudError(f"{path}: cannot load the .npz archive without unpickling ({capped(str(err), 200)})") from err
    if key is None:
        return build_scan(path, "npz", **split_fields(path, arrays, columns=tuple(headers)), sensor=sensor)
    arr = arrays[key]
    if "ring" in used:
        cols = _columns_from_array(path, arr[:, :4])
        cols["ring"] = arrays[used["ring"]]
        cols["columns"] += ("ring",)
        return build_scan(path, "npz", **cols, sensor=sensor)
    return _load(path, arr, "npz", sensor)


def write_npy(path: Path, points: np.ndarray, ring: np.ndarray | None) -> None:
    """(N, 4) float32, or (N, 5) with the ring as the 5th column, the same order a raw `.bin` uses."""
    data = points if ring is None else np.concatenate([points, ring[:, None].astype(np.float32)], axis=1)
    np.save(path, data.astype(np.float32))


def write_npz(path: Path, points: np.ndarray, ring: np.ndarray | None) -> None:
    """Compressed 'points' plus an integer 'ring', so the ring keeps its dtype."""
    arrays = {"points": points.astype(np.float32)}
    if ring is not None:
        arrays["ring"] = ring.astype(np.int64)
    np.savez_compressed(path, **arrays)

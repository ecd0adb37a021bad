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

from lidar.formats.fields import extra_column_kind, split_fields
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


def _npy_header(path: Path, f: BinaryIO, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from the .npy header at the stream's position; nothing of the array is read."""
    try:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
    except ValueError as err:
        raise PointCloudError(f"{path}: corrupt .npy header{what}: {err}") from err
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


def _npy_rows(path: Path) -> int:
    """Row count from the .npy header alone, so an oversized array is refused before it is loaded."""
    with path.open("rb") as f:
        shape, dtype = _npy_header(path, f, "")
        _check_npy_header(path, shape, dtype, path.stat().st_size - f.tell(), "")
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


def _check_zip_directory(path: Path) -> None:
    """Refuse an archive whose central directory lists more members, or more bytes, than a cloud needs."""
    entries, directory_bytes = zip_directory(path, ".npz")
    if entries > MAX_NPZ_MEMBERS or directory_bytes > MAX_NPZ_DIRECTORY:
        raise PointCloudError(
            f"{path}: the .npz lists {entries} members in a {directory_bytes:,}-byte directory; expected at "
            f"most {MAX_NPZ_MEMBERS} named arrays (points, ring, ...)"
        )


def _check_npz_members(path: Path) -> None:
    """Bound an archive before anything is decompressed: the zip's declared sizes against the decode limit
    and each member's .npy header against the point limit and its declared size (zipfile never inflates a
    member past that size, and NumPy allocates what the header says before reading)."""
    _check_zip_directory(path)
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        check_decoded_size(path, sum(m.file_size for m in members), "the .npz archive")
        for member in members:
            with archive.open(member) as f:
                shape, dtype = _npy_header(path, f, f" of member {member.filename!r}")
                _check_npy_header(path, shape, dtype, member.file_size - f.tell(), f" of member {member.filename!r}")


def _columns_from_array(path: Path, arr: np.ndarray) -> dict[str, Any]:
    if arr.dtype.names:
        return split_fields(path, {name: arr[name] for name in arr.dtype.names})
    if arr.ndim != 2 or arr.shape[1] < 3 or not np.issubdtype(arr.dtype, np.number):
        raise PointCloudError(
            f"{path}: array of shape {arr.shape} and dtype {arr.dtype}; expected a numeric (N, 3+) array of "
            "x, y, z[, intensity[, ring or time]]"
        )
    data = arr.astype(np.float64)
    out: dict[str, Any] = {"xyz": data[:, :3], "columns": ("x", "y", "z")}
    if data.shape[1] > 3:
        out["intensity"] = data[:, 3]
        out["columns"] += ("intensity",)
    if data.shape[1] > 4:
        kind = extra_column_kind(data[:, 4])
        out["columns"] += (kind,)
        if kind in ("ring", "time"):
            out[kind] = data[:, 4]
    if data.shape[1] > 5:
        out["columns"] += tuple(f"extra{k}" for k in range(5, data.shape[1]))
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
        raise PointCloudError(f"{path}: cannot load the .npy array without unpickling ({err}); expected a numeric array") from err
    return _load(path, arr, "npy", sensor)


def read_npz(path: Path, sensor: Sensor | None) -> Scan:
    """Load 'points' (with an optional 'ring'), the only array, or x/y/z field arrays, without unpickling."""
    _check_npz_members(path)
    try:
        archive = np.load(path, allow_pickle=False)
        arrays = {k: archive[k] for k in archive.files}
    except ValueError as err:
        raise PointCloudError(f"{path}: cannot load the .npz archive without unpickling ({err})") from err
    if not arrays:
        raise PointCloudError(f"{path}: the .npz archive is empty; expected 'points' (N, 3+) or x, y, z arrays")
    lower = {k.lower(): k for k in arrays}
    key = lower.get("points") or (next(iter(arrays)) if len(arrays) == 1 else None)
    if key is not None:
        arr = arrays[key]
        check_point_count(path, len(arr))
        if "ring" in lower and arr.dtype.names is None and arr.ndim == 2:
            cols = _columns_from_array(path, arr[:, :4])
            cols["ring"] = arrays[lower["ring"]]
            cols["columns"] += ("ring",)
            return build_scan(path, "npz", **cols, sensor=sensor)
        return _load(path, arr, "npz", sensor)
    if all(c in lower for c in "xyz"):
        check_point_count(path, len(arrays[lower["x"]]))
        return build_scan(path, "npz", **split_fields(path, arrays), sensor=sensor)
    raise PointCloudError(
        f"{path}: .npz keys {sorted(arrays)}; expected 'points' (N, 3+) (optionally with 'ring') or x, y, z arrays"
    )


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

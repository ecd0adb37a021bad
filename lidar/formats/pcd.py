"""PCL's `.pcd` (v0.7): ASCII and binary read and write, binary_compressed (LZF) read.

PCL writes binary_compressed by default, so a reader without it fails on most real-world files. Its LZF
streams are decoded by liblzf in C (`lzf`): a Python decoder spends a minute of CPU on a hostile 166 KB
upload, which a public server cannot afford.
"""

from __future__ import annotations

from pathlib import Path

import lzf
import numpy as np

from lidar.errors import shown
from lidar.formats.fields import (
    MAX_HEADER_BYTES,
    check_column_sizes,
    check_field_count,
    split_fields,
    used_fields,
)
from lidar.formats.scan import (
    PointCloudError,
    Scan,
    build_scan,
    check_decoded_size,
    check_point_count,
    read_ascii_table,
)
from lidar.sensors import Sensor

_TYPES = {("F", 4): "f4", ("F", 8): "f8", ("F", 2): "f2", ("I", 1): "i1", ("I", 2): "i2", ("I", 4): "i4",
          ("I", 8): "i8", ("U", 1): "u1", ("U", 2): "u2", ("U", 4): "u4", ("U", 8): "u8"}
_HEADER_KEYS = ("VERSION", "FIELDS", "SIZE", "TYPE", "COUNT", "WIDTH", "HEIGHT", "VIEWPOINT", "POINTS", "DATA")


def lzf_decompress(data: bytes, expected_size: int) -> bytes:
    """Decode an LZF stream with liblzf (the C library PCL itself uses, via the `lzf` module of PyPI's
    python-neo-lzf), into exactly `expected_size` bytes.

    The output buffer is `expected_size` bytes and liblzf stops as soon as the stream would pass it: a few MB
    of back-references can expand a hundredfold, so the size the header declares is the bound, not a check
    after the fact. In C, the largest stream a sweep may hold (200 MB decoded) takes about half a second;
    the pure-Python loop this replaces took a minute for a 166 KB zip.
    """
    out = lzf.decompress(bytes(data), expected_size) if data else b""
    if out is None:
        raise ValueError(f"LZF stream decodes past the {expected_size} bytes the header says")
    if len(out) != expected_size:
        raise ValueError(f"LZF stream decoded to {len(out)} bytes, header says {expected_size}")
    return out


def _parse_header(path: Path, blob: bytes) -> tuple[dict[str, list[str]], int]:
    """The header's keys and values, and where the body starts; refused past `MAX_HEADER_BYTES`."""
    header: dict[str, list[str]] = {}
    pos = 0
    while "DATA" not in header:
        end = blob.find(b"\n", pos, MAX_HEADER_BYTES + 1)
        if end < 0:
            where = f" in its first {MAX_HEADER_BYTES:,} bytes" if len(blob) > MAX_HEADER_BYTES else ""
            raise PointCloudError(
                f"{path}: PCD header has no DATA line{where}; expected the PCD v0.7 header keys {_HEADER_KEYS}"
            )
        line = blob[pos:end].decode("ascii", errors="replace").strip()
        pos = end + 1
        if not line or line.startswith("#"):
            continue
        key, *values = line.split()
        header[key.upper()] = values
    for key in ("FIELDS", "SIZE", "TYPE"):
        if key not in header:
            raise PointCloudError(f"{path}: PCD header lacks {key}; expected the PCD v0.7 header keys {_HEADER_KEYS}")
    return header, pos


def _whole_numbers(path: Path, header: dict[str, list[str]], key: str, default: list[str]) -> list[int]:
    """A header line of positive integers (SIZE, COUNT), or an error naming the first that is not one."""
    words = header.get(key, default)
    for word in words:
        if not (word.isdigit() and len(word) <= 9 and int(word) > 0):
            raise PointCloudError(f"{path}: PCD {key} {shown(word)}; expected a positive integer per field")
    return [int(word) for word in words]


def _dtype(path: Path, header: dict[str, list[str]]) -> np.dtype:
    names = header["FIELDS"]
    check_field_count(path, len(names), "the PCD header")
    counts = _whole_numbers(path, header, "COUNT", ["1"] * len(names))
    if not (len(names) == len(header["SIZE"]) == len(header["TYPE"]) == len(counts)):
        raise PointCloudError(
            f"{path}: PCD FIELDS, SIZE, TYPE and COUNT list {len(names)}, {len(header['SIZE'])}, "
            f"{len(header['TYPE'])} and {len(counts)} entries; expected one entry per field in each"
        )
    fields = []
    for k, (name, size, typ, count) in enumerate(zip(names, header["SIZE"], header["TYPE"], counts, strict=True)):
        key = (typ.upper(), int(size) if size.isdigit() and len(size) <= 2 else 0)
        if key not in _TYPES:
            raise PointCloudError(
                f"{path}: PCD field {shown(name)} has TYPE {shown(typ)} SIZE {shown(size)}; expected F 2/4/8, I or U 1/2/4/8"
            )
        unique = name if name != "_" else f"_pad{k}"
        fields.append((unique, "<" + _TYPES[key], (count,)) if count > 1 else (unique, "<" + _TYPES[key]))
    return np.dtype(fields)


def read_pcd(path: Path, sensor: Sensor | None) -> Scan:
    """Decode any PCD v0.7 body; the header's point count is checked against the limit before the body is parsed."""
    blob = path.read_bytes()
    header, offset = _parse_header(path, blob)
    dtype = _dtype(path, header)
    try:
        n = int(header["POINTS"][0]) if "POINTS" in header else int(header["WIDTH"][0]) * int(header["HEIGHT"][0])
    except (KeyError, IndexError, ValueError) as err:
        raise PointCloudError(f"{path}: PCD header needs POINTS or WIDTH and HEIGHT as integers") from err
    check_point_count(path, n)
    check_decoded_size(path, n * dtype.itemsize, f"the PCD body ({n:,} points of {dtype.itemsize} bytes)")
    fields = [name for name in dtype.names if not name.startswith("_pad")]
    used = used_fields(path, fields)
    check_column_sizes(path, used, {name: n * int(np.prod(dtype[name].shape)) for name in used.values()})
    kind = header["DATA"][0].lower() if header["DATA"] else ""
    if kind == "ascii":
        widths = [int(np.prod(dtype[name].shape or (1,))) for name in dtype.names]
        table = read_ascii_table(path, blob, offset, 0, n, sum(widths), "PCD ASCII body")
        data = np.zeros(n, dtype=dtype)
        for name, start, width in zip(dtype.names, np.cumsum([0, *widths]), widths, strict=False):
            data[name] = table[:, start : start + width].reshape(data[name].shape)
    elif kind == "binary":
        if len(blob) - offset < n * dtype.itemsize:
            raise PointCloudError(f"{path}: PCD binary body is {len(blob) - offset} bytes, expected {n} x {dtype.itemsize}")
        data = np.frombuffer(blob, dtype=dtype, count=n, offset=offset)
    elif kind == "binary_compressed":
        data = _read_compressed(path, memoryview(blob)[offset:], dtype, n)
    else:
        raise PointCloudError(f"{path}: PCD DATA {shown(kind)}; expected ascii, binary or binary_compressed")
    cols = split_fields(path, {name: np.asarray(data[name]) for name in fields})
    return build_scan(path, f"pcd-{kind}", **cols, sensor=sensor)


def _read_compressed(path: Path, body: memoryview, dtype: np.dtype, n: int) -> np.ndarray:
    """binary_compressed stores each field's values contiguously (structure of arrays), then LZF-compresses."""
    if len(body) < 8:
        raise PointCloudError(f"{path}: PCD binary_compressed body is truncated (no size words)")
    compressed, raw_size = (int(v) for v in np.frombuffer(body[:8], dtype="<u4"))
    if raw_size != n * dtype.itemsize:  # PCL writes exactly the points the header declares
        raise PointCloudError(
            f"{path}: PCD binary_compressed size word says {raw_size:,} bytes but the header declares {n:,} points "
            f"of {dtype.itemsize} bytes ({n * dtype.itemsize:,} bytes)"
        )
    try:
        raw = lzf_decompress(body[8 : 8 + compressed], raw_size)
    except ValueError as err:
        raise PointCloudError(f"{path}: corrupt PCD binary_compressed data: {err}") from err
    data = np.zeros(n, dtype=dtype)
    offset = 0
    for name in dtype.names:
        field_dtype = dtype[name]
        nbytes = field_dtype.itemsize * n
        if offset + nbytes > len(raw):
            raise PointCloudError(f"{path}: PCD binary_compressed data holds fewer than {n} points")
        data[name] = np.frombuffer(raw[offset : offset + nbytes], dtype=field_dtype.base).reshape((n, *field_dtype.shape))
        offset += nbytes
    return data


def write_pcd(path: Path, points: np.ndarray, ring: np.ndarray | None, binary: bool = True) -> None:
    """Write float32 x, y, z, intensity (+ uint16 ring) as PCL does; binary by default, ASCII for humans and diffs."""
    fields = [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("intensity", "<f4")]
    if ring is not None:
        fields.append(("ring", "<u2"))
    data = np.zeros(len(points), dtype=np.dtype(fields))
    for k, name in enumerate(("x", "y", "z", "intensity")):
        data[name] = points[:, k]
    if ring is not None:
        data["ring"] = ring
    names = [f[0] for f in fields]
    header = "\n".join([
        "# .PCD v0.7 - Point Cloud Data file format (written by LidarVerse)",
        "VERSION 0.7",
        "FIELDS " + " ".join(names),
        "SIZE " + " ".join(str(np.dtype(t).itemsize) for _, t in fields),
        "TYPE " + " ".join("U" if t == "<u2" else "F" for _, t in fields),
        "COUNT " + " ".join("1" for _ in fields),
        f"WIDTH {len(points)}",
        "HEIGHT 1",
        "VIEWPOINT 0 0 0 1 0 0 0",
        f"POINTS {len(points)}",
        "DATA " + ("binary" if binary else "ascii"),
    ]) + "\n"
    with path.open("wb") as f:
        f.write(header.encode("ascii"))
        if binary:
            f.write(data.tobytes())
        else:
            table = np.stack([data[name].astype(np.float64) for name in names], axis=1)
            np.savetxt(f, table, fmt=["%.9g"] * 4 + ["%d"] * (len(names) - 4))

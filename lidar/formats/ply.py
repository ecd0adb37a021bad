"""Stanford `.ply` point clouds: ASCII and binary (little or big endian) read, ASCII and little-endian write.

Only the `vertex` element matters for a sweep; elements before it are skipped when their size is known
(scalar properties), and anything after it (faces of a mesh) is ignored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lidar.errors import shown, shown_names
from lidar.formats.fields import MAX_HEADER_BYTES, check_field_count, split_fields, used_fields
from lidar.formats.scan import PointCloudError, Scan, build_scan, check_point_count, read_ascii_table
from lidar.sensors import Sensor

_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2", "ushort": "u2",
    "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4", "float": "f4", "float32": "f4",
    "double": "f8", "float64": "f8",
}
_FORMATS = {"ascii": None, "binary_little_endian": "<", "binary_big_endian": ">"}


def _parse_header(path: Path, blob: bytes) -> tuple[str, list[tuple[str, int, list[tuple[str, str]] | None]], int]:
    """(format, [(element, count, [(property, type)] or None if it has list properties)], body offset).

    The header is refused past `MAX_HEADER_BYTES`, and an element past `MAX_FIELDS` properties, before
    their lines are split.
    """
    end = blob.find(b"end_header", 0, MAX_HEADER_BYTES)
    if not blob.startswith(b"ply") or end < 0:
        where = f" within its first {MAX_HEADER_BYTES:,} bytes" if len(blob) > MAX_HEADER_BYTES else ""
        raise PointCloudError(
            f"{path}: not a PLY file; expected a header starting with 'ply' and ending with 'end_header'{where}"
        )
    body = blob.find(b"\n", end) + 1
    fmt = None
    elements: list[tuple[str, int, list[tuple[str, str]] | None]] = []
    for raw_line in blob[:end].decode("ascii", errors="replace").splitlines()[1:]:
        words = raw_line.split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "format" and len(words) >= 2:
            fmt = words[1]
        elif words[0] == "element" and len(words) == 3:
            if not (words[2].isdigit() and len(words[2]) <= 18):
                raise PointCloudError(f"{path}: PLY element {shown(words[1])} has count {shown(words[2])}; expected a whole number")
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property" and elements and len(words) >= 3:
            name, count, props = elements[-1]
            if words[1] == "list":
                elements[-1] = (name, count, None)
            elif props is not None:
                if words[1] not in _TYPES:
                    raise PointCloudError(f"{path}: PLY property type {shown(words[1])}; expected one of {sorted(_TYPES)}")
                props.append((words[2], words[1]))
                check_field_count(path, len(props), f"PLY element {shown(name)}")
    if fmt not in _FORMATS:
        raise PointCloudError(f"{path}: PLY format {shown(fmt)}; expected one of {sorted(_FORMATS)}")
    return fmt, elements, body


def read_ply(path: Path, sensor: Sensor | None) -> Scan:
    """Read the vertex element of any ASCII or binary PLY (meshes included) as a point cloud."""
    blob = path.read_bytes()
    fmt, elements, offset = _parse_header(path, blob)
    names = [e[0] for e in elements]
    if "vertex" not in names:
        raise PointCloudError(
            f"{path}: PLY has no 'vertex' element (elements: {shown_names(names)}); expected one point per vertex"
        )
    endian = _FORMATS[fmt]
    # 1. skip the elements before the vertices (rows in ASCII, bytes in binary); their sizes must be known
    pos = 0
    for name, count, props in elements[: names.index("vertex") + 1]:
        if props is None:
            raise PointCloudError(
                f"{path}: PLY element {shown(name)} has list properties before or in the vertex element; "
                "expected a point cloud (vertex element first or scalar-only elements before it)"
            )
        if name != "vertex":
            pos += count * (1 if endian is None else np.dtype([(p, "<" + _TYPES[t]) for p, t in props]).itemsize)
    # 2. read the vertices
    _, count, props = elements[names.index("vertex")]
    assert props is not None
    check_point_count(path, count)
    used_fields(path, [p for p, _ in props])  # no x, y, z: refused before the body is parsed
    if endian is None:  # only the rows the element counts name are parsed, however long the body
        table = read_ascii_table(path, blob, offset, pos, count, len(props), "PLY ASCII vertex element")
        fields = {p: table[:, j] for j, (p, _) in enumerate(props)}
    else:
        dtype = np.dtype([(p, endian + _TYPES[t]) for p, t in props])
        if len(blob) < offset + pos + count * dtype.itemsize:
            raise PointCloudError(f"{path}: PLY body is truncated; expected {count} vertices of {dtype.itemsize} bytes")
        data = np.frombuffer(blob, dtype=dtype, count=count, offset=offset + pos)
        fields = {p: data[p] for p, _ in props}
    return build_scan(path, f"ply-{'ascii' if endian is None else 'binary'}", **split_fields(path, fields), sensor=sensor)


def write_ply(path: Path, points: np.ndarray, ring: np.ndarray | None, binary: bool = True) -> None:
    """Write x, y, z and intensity (+ ring) so CloudCompare, Open3D and MeshLab keep the LiDAR fields.

    (`lidar.render.ply_bytes` writes the other PLY: coloured, y-up, for Gradio's viewer.)
    """
    props = [("x", "float"), ("y", "float"), ("z", "float"), ("intensity", "float")]
    if ring is not None:
        props.append(("ring", "ushort"))
    header = "\n".join([
        "ply",
        f"format {'binary_little_endian' if binary else 'ascii'} 1.0",
        "comment written by LidarVerse; intensity in [0, 1]",
        f"element vertex {len(points)}",
        *(f"property {t} {p}" for p, t in props),
        "end_header",
    ]) + "\n"
    data = np.zeros(len(points), dtype=np.dtype([(p, "<" + _TYPES[t]) for p, t in props]))
    for k, (p, _) in enumerate(props[:4]):
        data[p] = points[:, k]
    if ring is not None:
        data["ring"] = ring
    with path.open("wb") as f:
        f.write(header.encode("ascii"))
        if binary:
            f.write(data.tobytes())
        else:
            table = np.stack([data[p].astype(np.float64) for p, _ in props], axis=1)
            np.savetxt(f, table, fmt=["%.9g"] * 4 + ["%d"] * (len(props) - 4))

"""Named point fields (PCD, PLY, NPZ, LAS) to the columns `build_scan` takes, and the bounds on them.

Tools disagree on names (`intensity`, `reflectance`, `remission`, `signal`; `ring`, `laser_id`, `beam`),
so the synonyms live in one table instead of in every reader.

A header states its fields, their sub-array counts and the point count before any value is decoded, and
every reader bounds what it will allocate from that alone: at most `MAX_FIELDS` fields, and no used column
(x, y, z and the synonyms above) holding more values than the point limit. A field of 64 uint8 values a
point is 64 points' worth of x once flattened, so it counts 64 times, before it is expanded to float64.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lidar.errors import shown_names
from lidar.formats.scan import PointCloudError, check_point_count

#: Most fields (PCD FIELDS, PLY vertex properties, structured-array fields, LAS extra-byte dimensions) one
#: file may declare: a LiDAR driver writes up to about a dozen (Ouster: 9, PCL's richest point type: 13).
MAX_FIELDS = 256
#: Most bytes of a text header (PCD up to its DATA line, PLY up to end_header): `MAX_FIELDS` fields with
#: long names take a few KB.
MAX_HEADER_BYTES = 64 * 1024

_SYNONYMS = {
    "intensity": ("intensity", "reflectance", "reflectivity", "remission", "signal", "i", "scalar_intensity"),
    "ring": ("ring", "beam", "laser_id", "laser", "channel", "row", "scalar_ring"),
    "time": ("dt", "delta_t", "time_offset", "sweep_time", "time", "t"),
}


def check_field_count(path: Path, count: int, what: str) -> None:
    """Refuse a header declaring more than `MAX_FIELDS` fields, before they are parsed into a dtype."""
    if count > MAX_FIELDS:
        raise PointCloudError(
            f"{path}: {what} declares {count:,} fields; expected at most {MAX_FIELDS} "
            "(x, y, z, intensity, ring, time and a few more)"
        )


def used_fields(path: Path, names: Iterable[str]) -> dict[str, str]:
    """{"x", "y", "z" and whichever of "intensity", "ring", "time" the names hold: the name the file uses}.

    Refuses names without x, y and z; the names are quoted capped, so a header of 200,000 fields gives a
    short message.
    """
    lower = {str(name).lower(): str(name) for name in names}
    missing = [c for c in "xyz" if c not in lower]
    if missing:
        raise PointCloudError(
            f"{path}: no {'/'.join(missing)} field among {shown_names(sorted(lower.values()))}; expected at least "
            "x, y, z (plus intensity and ring if present)"
        )
    used = {c: lower[c] for c in "xyz"}
    for key, synonyms in _SYNONYMS.items():
        name = next((lower[n] for n in synonyms if n in lower), None)
        if name is not None:
            used[key] = name
    return used


def check_column_sizes(path: Path, used: Mapping[str, str], sizes: Mapping[str, int]) -> int:
    """The point count: the number of values each used column holds (rows times sub-array count), all
    equal and within the point limit. `sizes` maps a field name to its value count, known from a header."""
    counts = {key: int(sizes[name]) for key, name in used.items()}
    n = counts["x"]
    check_point_count(path, max(counts.values()))
    unequal = {used[key]: count for key, count in counts.items() if count != n}
    if unequal:
        listed = ", ".join(f"{name!r}: {count:,}" for name, count in list(unequal.items())[:6])
        raise PointCloudError(
            f"{path}: field {used['x']!r} holds {n:,} values but {listed}; expected one value of each field per point"
        )
    check_point_count(path, n)
    return n


def split_fields(path: Path, fields: Mapping[str, np.ndarray], columns: tuple[str, ...] | None = None) -> dict[str, Any]:
    """`build_scan` keyword arguments (xyz, intensity, ring, time, columns) from named fields.

    Only the used fields are converted, and only after their sizes are checked; `columns` names every
    field the file holds when `fields` carries only the used ones (LAS extra-byte dimensions).
    """
    used = used_fields(path, fields)
    n = check_column_sizes(path, used, {name: np.size(fields[name]) for name in used.values()})
    xyz = np.empty((n, 3), dtype=np.float64)
    for k, c in enumerate("xyz"):
        xyz[:, k] = np.ravel(fields[used[c]])
    out: dict[str, Any] = {"xyz": xyz, "columns": tuple(fields) if columns is None else columns}
    for key in _SYNONYMS:
        if key in used:
            out[key] = np.asarray(fields[used[key]], dtype=np.float64).ravel()
    return out


def extra_column_kind(col: np.ndarray) -> str:
    """What a fifth column holds: a beam index, a per-sweep time offset, or something unknown."""
    finite = col[np.isfinite(col)]
    if finite.size == 0:
        return "unknown"
    integral = np.all(finite == np.round(finite)) and finite.min() >= 0 and finite.max() < 256
    if integral and np.unique(finite).size > 1:
        return "ring"
    if finite.min() >= 0 and finite.max() <= 1.0 and np.unique(finite).size <= 20:
        return "time"
    return "unknown"

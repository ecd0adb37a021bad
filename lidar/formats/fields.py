"""Named point fields (PCD, PLY, NPZ, LAS) to the columns `build_scan` takes.

Tools disagree on names (`intensity`, `reflectance`, `remission`, `signal`; `ring`, `laser_id`, `beam`),
so the synonyms live in one table instead of in every reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lidar.formats.scan import PointCloudError

_SYNONYMS = {
    "intensity": ("intensity", "reflectance", "reflectivity", "remission", "signal", "i", "scalar_intensity"),
    "ring": ("ring", "beam", "laser_id", "laser", "channel", "row", "scalar_ring"),
    "time": ("dt", "delta_t", "time_offset", "sweep_time", "time", "t"),
}


def _find(fields: dict[str, np.ndarray], names: tuple[str, ...]) -> str | None:
    lower = {k.lower(): k for k in fields}
    return next((lower[n] for n in names if n in lower), None)


def split_fields(path: Path, fields: dict[str, np.ndarray]) -> dict[str, Any]:
    """`build_scan` keyword arguments (xyz, intensity, ring, time, columns) from named 1-D fields."""
    lower = {k.lower(): k for k in fields}
    missing = [c for c in "xyz" if c not in lower]
    if missing:
        raise PointCloudError(
            f"{path}: no {'/'.join(missing)} field among {sorted(fields)}; expected at least x, y, z "
            "(plus intensity and ring if present)"
        )
    xyz = np.stack([np.asarray(fields[lower[c]], dtype=np.float64).ravel() for c in "xyz"], axis=1)
    out: dict[str, Any] = {"xyz": xyz, "columns": tuple(fields)}
    for key, names in _SYNONYMS.items():
        name = _find(fields, names)
        if name is not None:
            out[key] = np.asarray(fields[name], dtype=np.float64).ravel()
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

"""Headerless `.bin` sweeps: KITTI (N x 4 float32), nuScenes (N x 5 float32 with ring) and their cousins.

A raw `.bin` says nothing about its layout, and real files break the naming convention (float16 nuScenes
dumps with a time column, Ouster dumps with a beam column). So every layout whose row size divides the
file is decoded and scored on physics: finite values, ranges a LiDAR can measure, non-negative intensity,
an integral ring or a small time offset, and consecutive points that lie near each other (a scan is
stored in firing order; a wrong row size scrambles the columns and breaks that continuity, so continuity
breaks ties but a shuffled cloud is still accepted when only one layout is plausible).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lidar.formats.fields import extra_column_kind
from lidar.formats.scan import PointCloudError, Scan, build_scan, check_point_count, max_points
from lidar.sensors import Sensor

logger = logging.getLogger(__name__)

#: Points farther than this are not a LiDAR return (the longest-range automotive sensors reach ~300 m).
_MAX_PLAUSIBLE_RANGE = 500.0
#: The winning layout must make this fraction of rows physically plausible.
_MIN_SCORE = 0.9
#: Rows scored per layout, in contiguous blocks (continuity needs neighbours); enough to tell layouts apart.
_SAMPLE_ROWS = 20_000
_BLOCK_ROWS = 1_000


@dataclass(frozen=True)
class Layout:
    """One way to cut a headerless file into rows; `name` becomes `Scan.format`."""

    name: str
    dtype: str
    columns: int

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * self.columns

    def describe(self) -> str:
        return f"{self.name} ({self.columns} x {np.dtype(self.dtype).name})"


#: Tried in this order; on equal evidence the earlier (more common) layout wins.
LAYOUTS = (
    Layout("kitti-bin", "<f4", 4),
    Layout("nuscenes-bin", "<f4", 5),
    Layout("float16-bin", "<f2", 4),
    Layout("float16x5-bin", "<f2", 5),
    Layout("float64-bin", "<f8", 4),
    Layout("float64x5-bin", "<f8", 5),
)


def score_layout(data: np.ndarray) -> tuple[float, bool, str]:
    """(fraction of plausible rows, whether consecutive rows lie near each other, the main shortfall)."""
    with np.errstate(all="ignore"):
        xyz = data[:, :3].astype(np.float64)
        rng = np.linalg.norm(xyz, axis=1)
        inten = data[:, 3].astype(np.float64)
        finite = np.isfinite(data.astype(np.float64)).all(axis=1)
        ranges_ok = (rng < _MAX_PLAUSIBLE_RANGE) & ((rng > 1e-3) | (rng == 0))
        inten_ok = (inten >= 0) & (inten < 1e6)
        ok = finite & ranges_ok & inten_ok
        reasons = {
            "non-finite values": 1 - finite.mean(),
            f"ranges beyond {_MAX_PLAUSIBLE_RANGE:.0f} m or below 1 mm": 1 - (finite & ranges_ok).mean(),
            "negative or huge intensity": 1 - (finite & inten_ok).mean(),
        }
        if data.shape[1] > 4 and extra_column_kind(data[:, 4].astype(np.float64)) == "unknown":
            ok = np.zeros_like(ok)
            reasons["5th column is neither an integral ring nor a small time offset"] = 1.0
        pair_ok = ok[1:] & ok[:-1]
        continuous = False
        if pair_ok.sum() > 10:
            step = np.median(np.linalg.norm(np.diff(xyz, axis=0), axis=1)[pair_ok])
            continuous = bool(step < 0.5 * max(np.median(rng[ok]), 1e-3))
    return float(ok.mean()), continuous, max(reasons, key=reasons.get)


def _decode(raw: bytes | np.memmap, layout: Layout, rows: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=layout.dtype, count=rows * layout.columns).reshape(rows, layout.columns)


def choose_layout(path: Path, size: int) -> Layout:
    """The plausible layout for a raw file of `size` bytes, or an error listing every layout tried."""
    fitting = [lay for lay in LAYOUTS if size % lay.row_bytes == 0]
    tried = []
    plausible: list[tuple[bool, float, Layout]] = []
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    for lay in fitting:
        rows = size // lay.row_bytes
        if rows > max_points():
            tried.append(f"{lay.describe()}: {rows:,} points, over the {max_points():,} limit")
            continue
        data = _decode(raw, lay, rows)
        starts = np.linspace(0, max(rows - _BLOCK_ROWS, 0), _SAMPLE_ROWS // _BLOCK_ROWS).astype(np.int64)
        sample = np.concatenate([data[s : s + _BLOCK_ROWS] for s in np.unique(starts)])
        score, continuous, reason = score_layout(sample)
        order = "" if continuous else ", consecutive points far apart"
        tried.append(f"{lay.describe()}: {100 * score:.0f}% plausible rows" + (order if score >= _MIN_SCORE else f" ({reason})"))
        if score >= _MIN_SCORE:
            plausible.append((continuous, score, lay))
    unfit = [lay.describe() for lay in LAYOUTS if lay not in fitting]
    if fitting and all(size // lay.row_bytes > max_points() for lay in fitting):
        check_point_count(path, size // fitting[0].row_bytes)
    if not plausible:
        detail = "; ".join(tried) if tried else "none of them divides the size"
        raise PointCloudError(
            f"{path}: {size:,} bytes is not a LiDAR sweep in any raw layout tried. Layouts whose row size divides "
            f"the file: {detail}. Layouts whose row size does not divide {size:,} bytes: {', '.join(unfit) or 'none'}. "
            "Expected x, y, z, intensity[, ring or time] rows of float32 (KITTI/nuScenes), float16 or float64"
        )
    # a layout that keeps scan order intact beats one that scrambles it; then the most plausible; then LAYOUTS order
    best = max(plausible, key=lambda p: (p[0], p[1], -LAYOUTS.index(p[2])))[2]
    logger.debug("%s: layout %s chosen from %s", path, best.name, tried)
    return best


def read_bin(path: Path, size: int, sensor: Sensor | None) -> Scan:
    """Decode a headerless sweep with the most plausible layout (see module docstring)."""
    layout = choose_layout(path, size)
    rows = size // layout.row_bytes
    with np.errstate(invalid="ignore"):  # NaN payloads in a corrupt file are dropped later, not warned about
        data = np.fromfile(path, dtype=layout.dtype).reshape(rows, layout.columns).astype(np.float64)
    notes: list[str] = []
    if layout.dtype != "<f4":
        notes.append(f"stored as {np.dtype(layout.dtype).name}, not the usual float32")
    columns: tuple[str, ...] = ("x", "y", "z", "intensity")
    ring = time = None
    if layout.columns == 5:
        kind = extra_column_kind(data[:, 4])
        columns = (*columns, kind)
        if kind == "ring":
            ring = data[:, 4]
        else:
            time = data[:, 4]
    return build_scan(
        path, layout.name, data[:, :3], data[:, 3], ring=ring, time=time, columns=columns, notes=notes, sensor=sensor
    )


def write_bin(path: Path, points: np.ndarray, ring: np.ndarray | None) -> None:
    """KITTI float32 x 4 with reflectance in [0, 1]; with a ring, nuScenes float32 x 5 with 0-255 intensity."""
    if ring is None:
        data = points[:, :4].astype("<f4")
    else:
        data = np.concatenate([points[:, :3], points[:, 3:4] * 255.0, ring[:, None]], axis=1).astype("<f4")
    path.write_bytes(data.tobytes())

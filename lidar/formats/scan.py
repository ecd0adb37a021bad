"""The `Scan` every reader returns, and the one place raw columns become LidarVerse points.

Readers only decode bytes into named float64 columns; `build_scan` applies the docs/design.md rules once for
all formats (drop NaN/inf and count them, rescale intensity to [0, 1], derive the ring of an organised
scan, flag scans whose origin is not the sensor), so a quirk is handled identically whatever the file.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lidar.errors import InputError
from lidar.formats.rings import COLUMN_RANGE, RING_FROM_FILE, RING_FROM_ORGANISED, recover_rings
from lidar.range_image import off_origin, point_elevations
from lidar.sensors import Sensor

logger = logging.getLogger(__name__)

#: Larger clouds than this are refused: no spinning LiDAR sweep comes close, so it is a merged map or garbage.
MAX_POINTS = 5_000_000
#: A lower bound in force for the current context (`point_limit`); `max_points()` reads it.
_POINT_LIMIT: ContextVar[int] = ContextVar("lidarverse_point_limit", default=MAX_POINTS)
#: Files larger than this are refused before a byte is read.
MAX_FILE_BYTES = 200_000_000
#: Decompressed or parsed data may not exceed what an uncompressed file may hold, so a small compressed
#: upload (a zip or LZF bomb, a LAZ header promising more than it holds) cannot make a reader allocate more.
MAX_DECODED_BYTES = MAX_FILE_BYTES

#: Farthest a sweep's point may lie from its sensor on any axis (m): the longest-reaching spinning LiDARs
#: see ~250-500 m, so past this it is a georeferenced map or garbage (1e30 m overflows the first arithmetic).
MAX_POINT_RANGE_M = 1000.0

#: Intensity scales recognised by their maximum: reflectance in [0, 1], 8-bit, and 16-bit counters (Ouster signal, LAS).
_INTENSITY_SCALES = (1.0, 255.0, 65535.0)
#: Range-image widths drivers and datasets use: organised dumps come in them, detected sensors get one.
STANDARD_WIDTHS = (512, 1024, 2048, 4096)
#: Organised scans (one return per pixel, no ring column) come in these beam counts.
_ORGANISED_HEIGHTS = (128, 64, 32, 16)
#: An organised scan's columns are azimuths: its returns lie at most this far (deg, median) from a turn spread
#: evenly across the width (the shared dumps: 0.6 and 1.1; a stagger is a few degrees). A sweep of other beams
#: cut into H rows misses it by 90.
_MAX_COLUMN_OFFSET_DEG = 10.0
#: A scan in its sensor's frame has at least this fraction of far returns this far below the horizon (the road).
_BELOW_HORIZON_DEG = 5.0
_MIN_BELOW_HORIZON = 0.02


class PointCloudError(InputError):
    """A file that cannot be read as a LiDAR sweep; the message names the file and what was expected."""


@dataclass
class Scan:
    """One sweep as read from a file: points in the frame the file gives, plus what the reader learnt."""

    #: (N, 4) float32 x, y, z, intensity in [0, 1].
    points: np.ndarray
    #: (N,) int64 beam index per point, or None when unknown: as the file numbers it, or recovered from the
    #: points (numbered by elevation, 0 the highest beam); `ring_source` says which.
    ring: np.ndarray | None = None
    #: Points dropped because a coordinate or the intensity was NaN/inf.
    dropped_nonfinite: int = 0
    #: Format name, e.g. "kitti-bin", "nuscenes-bin", "pcd-binary", "ply-ascii", "npy", "laz".
    format: str = ""
    #: The divisor applied to the file's intensity to bring it into [0, 1].
    intensity_scale: float = 1.0
    path: Path | None = None
    #: Human-readable quirks found while reading (shown by `python -m lidar info`).
    notes: list[str] = field(default_factory=list)
    #: Column names as the file stores them.
    columns: tuple[str, ...] = ()
    #: False when the points are evidently not in the sensor frame (origin below the sensor, e.g. PandaSet).
    sensor_frame: bool = True
    #: How `ring` was obtained: one of `lidar.formats.rings.RING_FROM_*` ("file", "organised", "scan order",
    #: "elevation clusters"); "" without a ring, and a ring given without a source counts as the file's.
    ring_source: str = ""
    #: `lidar.formats.sweep_geometry`'s answer once it has measured this sweep (in a 1-tuple; empty before): a
    #: request asks for an upload's geometry when it sizes its grid and again when it runs.
    measured: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)

    @property
    def num_points(self) -> int:
        return len(self.points)

    @classmethod
    def from_points(cls, points: np.ndarray) -> Scan:
        """A sweep held in memory ((N, 4) float32 x, y, z, intensity, finite) with what a reader learns of a
        file without a ring field: whether the points are in the sensor frame and, if so, their rings from
        the storage order or the elevations (`recover_rings`). An array then measures the geometry its file
        would: a KITTI sweep's 64 beams at its own columns, not the nearest preset's."""
        frame_note = _sensor_frame_check(points[:, :3])
        rings = recover_rings(points[:, :3]) if frame_note is None else None
        if rings is None:
            return cls(points=points, sensor_frame=frame_note is None)
        return cls(points=points, ring=rings.ring, ring_source=rings.source, notes=[rings.note])


def check_file_size(path: Path) -> int:
    """Refuse missing, empty and oversized files before reading them."""
    if not path.exists():
        raise PointCloudError(f"{path}: no such file")
    if not path.is_file():
        raise PointCloudError(f"{path}: not a regular file; expected a point-cloud file")
    size = path.stat().st_size
    if size == 0:
        raise PointCloudError(f"{path}: the file is empty (0 bytes); expected a point cloud")
    if size > MAX_FILE_BYTES:
        raise PointCloudError(
            f"{path}: {size / 1e6:.1f} MB is over the {MAX_FILE_BYTES / 1e6:.0f} MB limit for one LiDAR sweep"
        )
    return size


def max_points() -> int:
    """The most points a cloud may hold here: `MAX_POINTS`, or less inside a `point_limit` block."""
    return _POINT_LIMIT.get()


@contextlib.contextmanager
def point_limit(points: int) -> Iterator[None]:
    """Refuse clouds over `points` (at most `MAX_POINTS`) in this context, from their header, before decoding.

    The public app reads uploads under a lower bound than trusted callers: every read sweep costs CPU in
    proportion to its points, and an LZF stream of back-references can declare the full `MAX_POINTS` in 1 MB.
    """
    token = _POINT_LIMIT.set(min(points, MAX_POINTS))
    try:
        yield
    finally:
        _POINT_LIMIT.reset(token)


def check_point_count(path: Path, n: int) -> None:
    """Refuse empty and oversized clouds as soon as a header or size reveals their count."""
    if n <= 0:
        raise PointCloudError(f"{path}: the file holds no points; expected at least one")
    if n > max_points():
        raise PointCloudError(
            f"{path}: {n:,} points is over the {max_points():,}-point limit for one LiDAR sweep "
            "(is it a merged map? split it into sweeps)"
        )


def check_point_range(path: Path, xyz: np.ndarray) -> None:
    """Refuse a sweep with a coordinate past `MAX_POINT_RANGE_M`: it would pass as finite and overflow
    later (a LAS writer's integers, a pose's product)."""
    farthest = float(np.abs(xyz).max()) if len(xyz) else 0.0
    if farthest > MAX_POINT_RANGE_M:
        count = int((np.abs(xyz) > MAX_POINT_RANGE_M).any(axis=1).sum())
        raise PointCloudError(
            f"{path}: {count:,} points lie farther than {MAX_POINT_RANGE_M:.0f} m from the sensor (up to "
            f"{farthest:.3g} m); expected a LiDAR sweep in its sensor's frame (a georeferenced map? move it first)"
        )


def check_decoded_size(path: Path, nbytes: int, what: str) -> None:
    """Refuse data whose header promises more than `MAX_DECODED_BYTES` once decoded, before decoding it."""
    if nbytes > MAX_DECODED_BYTES:
        raise PointCloudError(
            f"{path}: {what} would decode to {nbytes / 1e6:,.0f} MB, over the {MAX_DECODED_BYTES / 1e6:.0f} MB limit "
            "for one LiDAR sweep (a compression bomb or a merged map?)"
        )


def read_ascii_table(path: Path, blob: bytes, offset: int, skip: int, rows: int, columns: int, what: str) -> np.ndarray:
    """(rows, columns) float64 from the text lines of `blob` after byte `offset` and `skip` lines.

    NumPy's parser stops at `rows`, so a short header count followed by megabytes of lines costs only
    the rows asked for; the table itself is bounded by `MAX_DECODED_BYTES` before parsing starts, and
    the file's bytes are shared, not copied.
    """
    check_decoded_size(path, rows * columns * 8, f"the {what} ({rows:,} rows of {columns} values)")
    text = io.BytesIO(blob)
    text.seek(offset)
    try:
        table = np.loadtxt(text, dtype=np.float64, comments=None, skiprows=skip, max_rows=rows,
                           usecols=range(columns), ndmin=2, encoding="latin1")
    except ValueError as err:
        raise PointCloudError(f"{path}: {what} is not {rows:,} rows of {columns} numbers ({err})") from err
    if len(table) < rows:
        raise PointCloudError(f"{path}: {what} has {len(table):,} rows; expected {rows:,} rows of {columns} values")
    return table


def intensity_scale_of(values: np.ndarray) -> tuple[float, str | None]:
    """The divisor that maps a file's intensities into [0, 1], and a note when it had to be guessed."""
    if values.size == 0:
        return 1.0, None
    vmax = float(values.max())
    for scale in _INTENSITY_SCALES:
        if vmax <= scale * (1.0 + 1e-6):
            return scale, None
    return vmax, f"intensity up to {vmax:g} matches no standard scale (1, 255, 65535); divided by its maximum"


def _column_offset_deg(az: np.ndarray, column: np.ndarray, width: int) -> float:
    """Median distance (deg) of azimuths `az` from one turn spread evenly over `width` columns, either way
    round: small when `column` is each return's azimuth bin, as in an organised scan's pixel order."""
    best = 180.0
    for spin in (1.0, -1.0):
        phase = np.exp(1j * (az - spin * 2.0 * np.pi * column / width))
        offset = np.abs(np.angle(phase * np.conj(phase.mean())))
        best = min(best, float(np.degrees(np.median(offset))))
    return best


def organised_ring(xyz: np.ndarray, sensor: Sensor | None) -> tuple[np.ndarray | None, str | None]:
    """Beam index of an organised scan (H*W points, pixel order), read off the elevation pattern.

    Ouster and other drivers often dump the full image without a ring column, either one azimuth column of
    H beams after another or one beam row after another; nuScenes keeps all 32 beams of every firing (about
    1,090 columns, never a round number). The layout is accepted only when each candidate beam has a tight
    elevation, the beams are distinct and the columns are azimuths, so an unorganised cloud is never given
    rings, nor a sweep of another beam count whose point count H divides (a 20 x 360 grid is no 32 x 225 one:
    its rows' medians are its beams, but each "row" covers 225 deg of a beam and the next one's start).
    """
    n = len(xyz)
    heights = (sensor.height, *_ORGANISED_HEIGHTS) if sensor is not None else _ORGANISED_HEIGHTS
    rng = np.linalg.norm(xyz, axis=1)
    valid = rng > 0.5
    elev = np.degrees(point_elevations(xyz))
    index = np.arange(n)
    az = np.arctan2(xyz[:, 1], xyz[:, 0])
    for height in dict.fromkeys(heights):
        if n % height or not COLUMN_RANGE[0] <= n // height <= COLUMN_RANGE[1]:
            continue
        width = n // height
        layouts = (("column-major", index % height, index // height), ("row-major", index // width, index % width))
        for layout, ring, column in layouts:
            groups = [elev[valid & (ring == k)] for k in range(height)]
            if any(len(g) < 8 for g in groups):
                continue
            medians = np.array([np.median(g) for g in groups])
            spread = np.median([np.median(np.abs(g - m)) for g, m in zip(groups, medians, strict=True)])
            spacing = np.median(np.abs(np.diff(np.sort(medians))))
            if (
                spacing > 0.05
                and spread < 0.25 * spacing
                and _column_offset_deg(az[valid], column[valid], width) <= _MAX_COLUMN_OFFSET_DEG
            ):
                note = f"organised {height}x{width} scan ({layout}); ring index derived from the point order"
                return ring.astype(np.int64), note
    return None, None


def _sensor_frame_check(xyz: np.ndarray) -> str | None:
    """A note when the cloud's origin is evidently not the sensor but the ground below it.

    A roof-mounted sensor sees the road well below its horizon (36-62% of returns beyond 2 m lie more than
    5 deg down in every shared sensor-frame scan); a cloud re-centred on the ground (PandaSet's ego frame)
    has almost none there, and its elevations are no longer beam angles.
    """
    far = np.linalg.norm(xyz, axis=1) > 2.0
    if far.sum() < 100:
        return None
    elev = np.degrees(point_elevations(xyz[far]))
    below = float((elev < -_BELOW_HORIZON_DEG).mean())
    if below >= _MIN_BELOW_HORIZON:
        return None
    horiz = np.hypot(xyz[:, 0], xyz[:, 1])
    near = (horiz > 5.0) & (horiz < 30.0)
    ground = ""
    if near.sum() > 100:
        counts, edges = np.histogram(xyz[near, 2], bins=np.arange(-4.0, 3.0, 0.1))
        ground = f"; the ground lies at z = {edges[counts.argmax()] + 0.05:+.1f} m (about -1.7 m in a roof sensor's frame)"
    return (
        f"not in the sensor frame: only {100 * below:.1f}% of returns lie more than {_BELOW_HORIZON_DEG:.0f} deg below "
        f"the origin's horizon (elevations {elev.min():.0f} to {elev.max():+.0f} deg){ground}; the origin is at ground "
        "level, so elevations are not beam angles and no sensor is detected"
    )


def _keyframe_rows(dt: np.ndarray) -> tuple[np.ndarray, str] | tuple[None, None]:
    """Rows of the newest sweep when a time column shows several stacked sweeps (nuScenes multi-sweep dumps)."""
    finite = dt[np.isfinite(dt)]
    if finite.size == 0:
        return None, None
    values = np.unique(finite)
    if len(values) < 2 or len(values) > 20 or values.min() < 0 or values.max() > 1.0:
        return None, None
    keep = dt == values.min()
    note = (
        f"{len(values)} sweeps stacked (time offsets {values.min():g}-{values.max():g} s); kept the keyframe sweep "
        f"(offset {values.min():g} s): {int(keep.sum()):,} of {len(dt):,} points, because the older sweeps are "
        "motion-compensated into its frame and are not one revolution of the sensor"
    )
    return keep, note


def build_scan(
    path: Path,
    fmt: str,
    xyz: np.ndarray,
    intensity: np.ndarray | None = None,
    ring: np.ndarray | None = None,
    time: np.ndarray | None = None,
    columns: tuple[str, ...] = (),
    notes: list[str] | None = None,
    sensor: Sensor | None = None,
) -> Scan:
    """Apply the docs/design.md point rules to decoded columns (float64 or any numeric dtype)."""
    notes = list(notes or [])
    xyz = np.asarray(xyz, dtype=np.float64).reshape(-1, 3)
    n = len(xyz)
    check_point_count(path, n)
    inten = np.zeros(n) if intensity is None else np.asarray(intensity, dtype=np.float64).ravel()
    if intensity is None:
        notes.append("no intensity column; intensity set to 0")
    # 1. newest sweep of stacked sweeps
    keep = np.ones(n, dtype=bool)
    rows, note = _keyframe_rows(np.asarray(time, dtype=np.float64).ravel()) if time is not None else (None, None)
    if rows is not None:
        keep &= rows
        notes.append(note)
    # 2. ring of an organised dump (one sweep), read before any row is dropped so pixel order is intact
    ring_source = "" if ring is None else RING_FROM_FILE
    if ring is None:
        sweep = np.flatnonzero(keep)
        organised, note = organised_ring(np.where(np.isfinite(xyz[sweep]), xyz[sweep], 0.0), sensor)
        if organised is not None:
            ring = np.zeros(n)
            ring[sweep] = organised
            ring_source = RING_FROM_ORGANISED
            notes.append(note)
    # 3. NaN/inf
    with np.errstate(invalid="ignore"):
        # values beyond float32's range would become inf in the float32 points, so they count as non-finite
        limit = np.finfo(np.float32).max
        finite = (np.abs(xyz) < limit).all(axis=1) & (np.abs(inten) < limit)
    if ring is not None:
        ring_f = np.asarray(ring, dtype=np.float64).ravel()
        if len(ring_f) != n:
            raise PointCloudError(f"{path}: the ring column has {len(ring_f):,} values for {n:,} points; expected one per point")
        finite &= np.isfinite(ring_f)
    dropped = int((keep & ~finite).sum())
    keep &= finite
    if dropped:
        notes.append(f"dropped {dropped:,} points with NaN/inf values")
        logger.info("%s: dropped %d non-finite points", path, dropped)
    xyz, inten = xyz[keep], inten[keep]
    if len(xyz) == 0:
        raise PointCloudError(f"{path}: no finite points left after dropping {dropped:,} NaN/inf points")
    check_point_range(path, xyz)
    ring_out = None if ring is None else np.asarray(ring, dtype=np.float64).ravel()[keep].astype(np.int64)
    if ring_out is not None and sensor is not None and ring_out.max() >= sensor.height:
        notes.append(
            f"ring index reaches {ring_out.max()} but sensor {sensor.name!r} has {sensor.height} beams; "
            "those points fall outside its range image"
        )
    # 4. intensity to [0, 1]
    negative = int((inten < 0).sum())
    if negative:
        notes.append(f"clipped {negative:,} negative intensities to 0")
        inten = np.maximum(inten, 0.0)
    scale, note = intensity_scale_of(inten)
    if note:
        notes.append(note)
    # 5. frame sanity
    origin = int((~off_origin(xyz)).sum())
    if origin:
        notes.append(f"{origin:,} points lie exactly at the origin (no-return placeholders); projection drops them")
    frame_note = _sensor_frame_check(xyz)
    if frame_note:
        notes.append(frame_note)
    # 6. the ring from the points themselves where the file has none (elevations are beam angles only here)
    if ring_out is None and frame_note is None:
        recovered = recover_rings(xyz)
        if recovered is not None:
            ring_out, ring_source = recovered.ring, recovered.source
            notes.append(recovered.note)
    points = np.concatenate([xyz, (inten / scale)[:, None]], axis=1).astype(np.float32)
    points[:, 3] = np.clip(points[:, 3], 0.0, 1.0)
    return Scan(
        points=points,
        ring=ring_out,
        dropped_nonfinite=dropped,
        format=fmt,
        intensity_scale=scale,
        path=path,
        notes=notes,
        columns=tuple(columns),
        sensor_frame=frame_note is None,
        ring_source=ring_source if ring_out is not None else "",
    )

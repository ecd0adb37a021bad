"""`read_points` / `write_points`: pick a format from the file's content first, then its extension.

Content wins because real files lie about their names (a NumPy array saved as `.bin`, a PCD renamed to
`.txt`); the extension decides only for headerless raw sweeps and when writing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lidar.cancel import checkpoint
from lidar.errors import MAX_SHOWN_CHARS, capped, native_panic
from lidar.formats.arrays import NPY_MAGIC, read_npy, read_npz, write_npy, write_npz
from lidar.formats.binary import read_bin, write_bin
from lidar.formats.las import read_las, write_las
from lidar.formats.pcd import read_pcd, write_pcd
from lidar.formats.ply import read_ply, write_ply
from lidar.formats.scan import PointCloudError, Scan, check_file_size
from lidar.sensors import Sensor

logger = logging.getLogger(__name__)

#: Writers by format name; `write_points` maps extensions onto these.
WRITERS: dict[str, Callable[[Path, np.ndarray, np.ndarray | None], None]] = {
    "kitti-bin": write_bin,
    "nuscenes-bin": write_bin,
    "pcd": write_pcd,
    "pcd-ascii": lambda p, pts, ring: write_pcd(p, pts, ring, binary=False),
    "ply": write_ply,
    "ply-ascii": lambda p, pts, ring: write_ply(p, pts, ring, binary=False),
    "npy": write_npy,
    "npz": write_npz,
    "las": write_las,
    "laz": write_las,
}
_EXTENSIONS = {".bin": "kitti-bin", ".pcd": "pcd", ".ply": "ply", ".npy": "npy", ".npz": "npz", ".las": "las", ".laz": "laz"}
#: File extensions `read_points` recognises: what uploads, folders and zips of sweeps are filtered by.
READ_SUFFIXES: tuple[str, ...] = tuple(_EXTENSIONS)


def _sniff(path: Path) -> str | None:
    """Format named by the first bytes, or None for headerless data."""
    with path.open("rb") as f:
        head = f.read(64)
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith(b"PK\x03\x04"):
        return "npz"
    if head.startswith(b"LASF"):
        return "las"
    if head.startswith(b"ply\n") or head.startswith(b"ply\r\n"):
        return "ply"
    text = head.lstrip()
    if text.startswith(b"# .PCD") or text.startswith(b"VERSION") or text.startswith(b"FIELDS"):
        return "pcd"
    return None


#: How each headed format's file starts (`_sniff`), as a refusal names it.
_HEADERS = {".pcd": "'# .PCD', 'VERSION' or 'FIELDS'", ".ply": "'ply'", ".las": "'LASF'", ".laz": "'LASF'",
            ".npy": "the NumPy magic '\\x93NUMPY'", ".npz": "a zip archive's 'PK'"}


def _not_a_sweep_file(path: Path, suffix: str) -> str:
    """Why a file whose content names no format is refused: a sweep format's file without its header, a
    recording (read by the recording readers, not as one sweep), or a file of another kind."""
    from lidar.recordings import CONTAINER_SUFFIXES  # the recordings' readers import this module

    if suffix in _HEADERS:
        return f"{path}: not a {suffix} file: it does not start with {_HEADERS[suffix]}"
    if suffix in CONTAINER_SUFFIXES:
        return (f"{path}: a {suffix} file is a recording, not one sweep; open it as a recording "
                "(lidar.sequence.open_recording; the commands take it where they take a recording)")
    return (f"{path}: {suffix} files are not read here; expected a sweep file ({', '.join(READ_SUFFIXES)}) or a "
            "recording")


def read_points(path: str | Path, sensor: Sensor | None = None) -> Scan:
    """Read one sweep from any supported file; `sensor`, if known, helps derive rings of organised dumps.

    Raises `PointCloudError` naming the file and what was expected for every kind of bad input.
    """
    path = Path(path)
    started = time.perf_counter()
    try:
        size = check_file_size(path)
        kind = _sniff(path)
    except OSError as err:  # a name the file system refuses (too long), no permission to read it
        raise PointCloudError(f"{capped(str(path), MAX_SHOWN_CHARS)}: cannot be read ({err.strerror or err})") from None
    suffix = path.suffix.lower()
    if kind is None and suffix not in (".bin", ""):
        raise PointCloudError(_not_a_sweep_file(path, suffix))
    expected = {"npy": (".npy",), "npz": (".npz",), "las": (".las", ".laz"), "ply": (".ply",), "pcd": (".pcd",)}
    notes = []
    if kind is not None and suffix not in expected[kind]:
        notes.append(f"content is a {kind.upper()} file despite the {suffix or 'missing'} extension")
    readers = {"npy": read_npy, "npz": read_npz, "las": read_las, "ply": read_ply, "pcd": read_pcd}
    checkpoint()  # a cancelled request stops before each file's decode
    try:
        scan = readers[kind](path, sensor) if kind is not None else read_bin(path, size, sensor)
    except PointCloudError:
        raise
    except BaseException as err:
        # A corrupt file can fail deep inside numpy, zipfile, zlib, laspy or lazrs with any exception type, a
        # Rust panic (a BaseException) included; the caller (CLI, app, training) must still get one clear
        # PointCloudError naming the file, never a traceback, and without the library's own wording (the log
        # keeps that). A cancellation or an interrupt passes through.
        if not (isinstance(err, Exception) or native_panic(err)):
            raise
        logger.warning("%s: %s reader failed", path, kind or "raw sweep", exc_info=True)
        raise PointCloudError(
            f"{path}: cannot read as {kind or 'a raw sweep'}: the file is corrupt or uses a variant this reader "
            "does not support"
        ) from err
    scan.notes[:0] = notes
    logger.info("read %s (%s, %d points) in %.3f s", path, scan.format, scan.num_points, time.perf_counter() - started)
    return scan


def format_for(path: Path, fmt: str | None) -> str:
    """The writer name for `fmt` or, if None, for the path's extension (`.pcd.bin` means nuScenes)."""
    if fmt is not None:
        if fmt not in WRITERS:
            raise PointCloudError(f"{path}: unknown format {fmt!r}; expected one of {sorted(WRITERS)}")
        return fmt
    name = path.name.lower()
    if name.endswith(".pcd.bin"):
        return "nuscenes-bin"
    if path.suffix.lower() not in _EXTENSIONS:
        raise PointCloudError(
            f"{path}: cannot tell the format from the extension {path.suffix or '(none)'}; expected one of "
            f"{sorted(_EXTENSIONS)} or .pcd.bin, or pass fmt= one of {sorted(WRITERS)}"
        )
    return _EXTENSIONS[path.suffix.lower()]


def write_points(path: str | Path, points: np.ndarray, fmt: str | None = None, ring: np.ndarray | None = None) -> Path:
    """Write (N, 4) points (intensity in [0, 1]) in the format of `fmt` or the extension; returns the path.

    `ring` (N,) beam indices are stored where the format has a place for them; the nuScenes layout
    requires them.
    """
    path = Path(path)
    fmt = format_for(path, fmt)
    pts = np.asarray(points, dtype=np.float32)
    if pts.ndim != 2 or pts.shape[1] != 4 or len(pts) == 0:
        raise PointCloudError(f"{path}: points have shape {pts.shape}; expected a non-empty (N, 4) x, y, z, intensity array")
    if not np.isfinite(pts).all():
        raise PointCloudError(f"{path}: points contain NaN/inf; drop them before writing")
    if ring is not None:
        ring = np.asarray(ring)
        if ring.shape != (len(pts),) or not np.issubdtype(ring.dtype, np.integer) or ring.min() < 0 or ring.max() > 255:
            raise PointCloudError(f"{path}: ring must be (N,) integers in [0, 255] matching {len(pts)} points, got {ring.shape} {ring.dtype}")
    if fmt == "nuscenes-bin" and ring is None:
        raise PointCloudError(f"{path}: the nuScenes .pcd.bin layout needs a ring column; pass ring= (or --sensor to the CLI)")
    if fmt == "kitti-bin" and ring is not None:
        ring = None
    started = time.perf_counter()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        WRITERS[fmt](path, pts, ring)
    except OSError as err:  # an unwritable or full destination is the caller's to fix, not a bug
        raise PointCloudError(f"{path}: cannot write ({err.strerror or err})") from err
    logger.info("wrote %s (%s, %d points) in %.3f s", path, fmt, len(pts), time.perf_counter() - started)
    return path

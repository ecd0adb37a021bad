"""Recorded sequences: an ordered set of sweeps from a folder, a zip or a list of files, with optional poses.

A sequence is what forecasting and re-simulation start from. Sweeps are read with `lidar.formats.read_points`
(every supported format) and ordered by the frame number in their names (KITTI `000000.bin`, `000002.bin`,
... or `frame_007.ply`; the trailing digits of the stem), then by name.

Poses come, optionally, from
- a KITTI odometry `poses.txt`: one line of 12 numbers per frame, the 3x4 pose of the left camera in the
  first camera frame. Our convention is `world_from_sensor` of the Velodyne (x forward, y left, z up), so
  each pose is conjugated with KITTI's `Tr` (velodyne -> camera 0, from the sequence's `calib.txt`):
  `world_from_velo = Tr^-1 @ cam0_from_cam @ Tr`, a world frame that is the first Velodyne frame. Without a
  `calib.txt` the nominal axis swap is assumed (velo x = cam z, y = -cam x, z = -cam y) with no lever arm:
  exact up to the ~0.3 m camera-Velodyne offset rotated by the heading change, a few cm over a short prefix.
  Line i is the pose of the sweep whose name holds frame number i (so 000000/000002/000004 take lines
  0, 2, 4), or of the i-th sweep when names carry no number;
- the `poses.json` that `python -m inference generate` / `forecast` write (`frames[*].file` and `.pose`,
  matched to sweeps by file name), or a JSON list of 4x4 `world_from_sensor` matrices, one per sweep.

Uploads from the public app go through here, so everything is bounded before it is read: the number of
sweeps, their total bytes and a zip's members (with each member's size checked while it is inflated, since
the header may lie). A zip's entry count is read from its end-of-central-directory record before `zipfile`
parses the directory. Pose, calibration and JSON files are small by nature, so they are refused past
`MAX_TEXT_BYTES` before parsing, and JSON nested past Python's recursion limit is refused cleanly. Poses
must be rigid and plausible: a translation past `MAX_POSE_TRANSLATION_M` is refused (a drive is not 100 km
long, and 1e308 m would overflow the first arithmetic done with it). Zip members are written under a fresh
folder by their base name only (zip slip safe).
"""

from __future__ import annotations

import json
import logging
import lzma
import re
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lidar.cancel import checkpoint
from lidar.errors import MAX_SHOWN_CHARS, InputError, capped, shown
from lidar.formats import MAX_FILE_BYTES, READ_SUFFIXES, PointCloudError, Scan, read_points
from lidar.formats.arrays import check_lzma_member, zip_directory
from lidar.formats.scan import max_points
from lidar.sensors import Sensor
from lidar.vocabulary import check_poses

logger = logging.getLogger(__name__)

#: Most sweeps one sequence may hold (a forecast prefix or a re-simulated scene, not a whole drive).
MAX_SWEEPS = 50
#: Most bytes all sweeps of a sequence may take together (uncompressed).
MAX_SEQUENCE_BYTES = 256 * 2**20
#: Most points all sweeps of a sequence may hold, in full clouds of the current point limit (5 M points for
#: trusted callers, 1 M in the app): an LZF stream of back-references declares a full cloud in ~180 KB, so
#: without it a 21 KB zip of 50 such sweeps cost the app 19 s and 2 GB.
SEQUENCE_POINTS_IN_CLOUDS = 4
#: Most entries a zip may list, sweeps or not (a zip of thousands of tiny entries is refused unread).
MAX_ZIP_MEMBERS = 200
#: Most bytes a zip's central directory may take (200 entries with long names need a few tens of KB).
MAX_ZIP_DIRECTORY = 1 << 20
#: Most bytes a poses, calibration or JSON file may hold: a KITTI poses.txt takes ~160 bytes a frame, so
#: this holds ~6,500 frames (KITTI's longest sequence, 02, has 4,661).
MAX_TEXT_BYTES = 1 << 20
#: Files a sequence folder may hold besides sweeps: never read as sweeps.
POSES_FILES = ("poses.json", "poses.txt")
CALIB_FILE = "calib.txt"
#: KITTI odometry keeps a sequence's sweeps in this subfolder, beside its poses.txt, calib.txt and times.txt.
KITTI_SWEEP_FOLDER = "velodyne"
TIMES_FILE = "times.txt"
#: A KITTI raw drive (`<date>_drive_<n>_sync`) keeps its sweeps here, with one clock time per sweep in
#: `velodyne_points/timestamps.txt` ("2011-09-26 13:02:25.964389445") and no poses file.
KITTI_RAW_SWEEP_FOLDER = Path("velodyne_points") / "data"
KITTI_RAW_TIMES_FILE = Path("velodyne_points") / "timestamps.txt"
#: KITTI camera 0 from Velodyne, axes only: x_cam = -y_velo, y_cam = -z_velo, z_cam = x_velo.
NOMINAL_KITTI_TR = np.array([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
_FRAME_NUMBER = re.compile(r"(\d+)$")
#: A KITTI raw clock time: date and whole seconds, then up to nine digits of fraction.
_CLOCK_TIME = re.compile(r"(\S+[ T]\d{1,2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")
#: Clock times a timestamps.txt may hold (datetime64[ns], which the drive's seconds are read in, wraps past 2262).
CLOCK_RANGE = (np.datetime64("1900-01-01T00:00:00", "s"), np.datetime64("2200-01-01T00:00:00", "s"))
#: Largest |seconds| a times.txt may hold: Unix time reaches 1.8e9 in 2027; at 1e10 float64 still resolves
#: microseconds, and a time of 1e308 s would overflow the first difference taken.
MAX_TIME_S = 1e10
#: Longest base name, in bytes, a zip member may have: what Linux file systems hold (NAME_MAX).
MAX_NAME_BYTES = 255
#: Zip members are inflated this many bytes at a time, with a cancellation check between chunks.
_CHUNK_BYTES = 4 << 20


@dataclass
class SweepSequence:
    """Sweeps in recording order, the names they came under, and their poses when a poses file gave them."""

    scans: list[Scan]
    names: list[str]
    #: (N, 4, 4) world_from_sensor, or None when the sequence came without poses (then register it).
    poses: np.ndarray | None = None
    #: (N,) seconds from the first sweep when the container recorded them, else None (frame numbers at 10 Hz).
    times: np.ndarray | None = None


def read_sequence(
    source: str | Path | Sequence[str | Path],
    *,
    sensor: Sensor | None = None,
    poses: str | Path | None = None,
    topic: str | None = None,
) -> SweepSequence:
    """Read a folder, a zip (one path), a list of sweep files, or one recording container (a bag, a pcap, a
    dataset log: `lidar.recordings`, its `topic`); poses from `poses`, else from the folder/zip/container.

    Raises `PointCloudError` (a `ValueError`) naming what was wrong and what was expected.
    """
    from lidar.recordings import is_container  # the container readers build on this module

    paths = [Path(source)] if isinstance(source, str | Path) else [Path(p) for p in source]
    if not paths:
        raise PointCloudError("no sweep files given; expected sweep files, a folder of them or a zip")
    if len(paths) == 1 and is_container(paths[0]):
        return _read_container(paths[0], sensor, poses, topic)
    if len(paths) == 1 and zipfile.is_zipfile(paths[0]) and paths[0].suffix.lower() == ".zip":
        with tempfile.TemporaryDirectory(prefix="lidarverse_zip_") as tmp:
            try:
                return _read_folder(extract_zip(paths[0], Path(tmp)), sensor, poses, label=paths[0].name)
            except InputError as err:  # name members as zip:member, not by the scratch folder
                raise PointCloudError(str(err).replace(f"{tmp}/", f"{paths[0].name}:")) from None
    if len(paths) == 1 and paths[0].is_dir():
        return _read_folder(paths[0], sensor, poses, label=str(paths[0]))
    return _read_files(paths, sensor, poses)


def sweep_files(folder: Path) -> list[Path]:
    """The sweep files of `folder`, in frame order; hidden files and poses/calibration are skipped.

    A folder in the KITTI odometry layout holds no sweeps itself but a `velodyne/` subfolder of them; a KITTI
    raw drive, a `velodyne_points/data/` subfolder.
    """
    if not folder.is_dir():
        raise PointCloudError(f"{folder}: not a folder; expected a folder of sweep files")
    files = _sweeps_in(folder)
    for sub in (KITTI_SWEEP_FOLDER, KITTI_RAW_SWEEP_FOLDER):
        if not files and (folder / sub).is_dir():
            files = _sweeps_in(folder / sub)
    return files


def _sweeps_in(folder: Path) -> list[Path]:
    files = [
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in READ_SUFFIXES
    ]
    return sorted(files, key=_frame_order)


NOT_SEARCHABLE = "a Recording cannot be searched for a sweep; compare its names or files instead"


@dataclass
class Recording(Sequence[Scan]):
    """A recorded drive on disk, read one sweep at a time: a lab's log holds thousands of sweeps, more than
    fit in memory, so training and evaluation keep only the file list and the poses. As a sequence of
    `Scan`s, each read when indexed, it registers sweep by sweep (`lidar.registration.register_sweeps`)."""

    files: list[Path]
    #: (N, 4, 4) world_from_sensor from the folder's poses file, or None (then register the sweeps).
    poses: np.ndarray | None
    #: (N,) seconds from a KITTI times.txt, or None (then 10 Hz).
    times: np.ndarray | None
    sensor: Sensor | None = None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.files]

    def sweep(self, index: int) -> Scan:
        return read_points(self.files[index], self.sensor)

    def __getitem__(self, index: int) -> Scan:  # type: ignore[override]  # no slices: each item is a file read
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"a Recording is indexed by sweep number, got {type(index).__name__}")
        return self.sweep(index)

    # Sequence's search methods would read every file and compare point arrays: not what a recording is for
    def __contains__(self, value: object) -> bool:
        raise TypeError(NOT_SEARCHABLE)

    def index(self, value: object, start: int = 0, stop: int | None = None) -> int:
        raise TypeError(NOT_SEARCHABLE)

    def count(self, value: object) -> int:
        raise TypeError(NOT_SEARCHABLE)


def open_recording(folder: str | Path, *, sensor: Sensor | None = None, topic: str | None = None) -> Recording:
    """A recorded sequence folder: KITTI odometry (`velodyne/*.bin`, `poses.txt`, `calib.txt`, `times.txt`),
    a KITTI raw drive (`velodyne_points/data/*.bin` and `velodyne_points/timestamps.txt`; its poses come from
    registration), a folder of sweeps with a poses.txt or a poses.json, or sweeps alone (poses None); or a
    recording container (a ROS bag, an MCAP, a Velodyne or Ouster pcap, a nuScenes root, an Argoverse 2
    log: `lidar.recordings`, reading `topic` where it holds several).

    Unlike `read_sequence` it reads no sweep and has no sweep limit: its callers are training and evaluation
    jobs reading a lab's own logs, not uploads.
    """
    from lidar.recordings import is_container, open_container  # the container readers build on this module

    if is_container(folder):
        return open_container(folder, topic=topic, sensor=sensor)
    folder = Path(folder)
    files = sweep_files(folder)
    own = folder / "poses.json"
    listed = _rollout_frame_files(own) if own.is_file() else None  # a rollout's poses.json orders its frames
    if listed:
        files = [folder / n for n in listed]
    if not files:
        raise PointCloudError(f"{folder}: no sweep files ({', '.join(READ_SUFFIXES)}) here, in {KITTI_SWEEP_FOLDER}/ "
                              f"or in {KITTI_RAW_SWEEP_FOLDER}/")
    names = [f.name for f in files]
    poses_file = next((folder / n for n in POSES_FILES if (folder / n).is_file()), None)
    calib = folder / CALIB_FILE
    poses = None if poses_file is None else read_poses(poses_file, names, calib if calib.is_file() else None)
    times = _kitti_times(folder / TIMES_FILE, names) if (folder / TIMES_FILE).is_file() else None
    if times is None and (folder / KITTI_RAW_TIMES_FILE).is_file():
        times = _kitti_raw_times(folder / KITTI_RAW_TIMES_FILE, names)
    logger.info("opened a recording of %d sweeps in %s (%s)", len(files), folder.name,
                "with poses" if poses is not None else "no poses")
    return Recording(files, poses, times, sensor)


def extract_zip(archive: Path, into: Path) -> Path:
    """Unpack the sweeps and poses files of `archive` flat into `into`, bounded; returns `into`.

    Only a member's base name is used, so `../x.bin` or `/etc/x.bin` lands as `into/x.bin`; folders inside
    the zip are flattened, and two members with the same base name are refused rather than overwritten.
    """
    entries, directory_bytes = zip_directory(archive)
    if entries > MAX_ZIP_MEMBERS:
        count = "65,535 or more" if entries == 0xFFFF else f"{entries:,}"  # 0xFFFF: a zip64 directory
        raise PointCloudError(f"{archive.name}: {count} entries; a sequence zip may hold at most {MAX_ZIP_MEMBERS}")
    if directory_bytes > MAX_ZIP_DIRECTORY:
        raise PointCloudError(
            f"{archive.name}: a {directory_bytes:,}-byte zip directory; a sequence zip's may take at most "
            f"{MAX_ZIP_DIRECTORY:,} bytes"
        )
    try:
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
            _check_member_names(archive.name, members)
            wanted = [m for m in members if _wanted_member(m)]
            _check_count(sum(Path(m.filename).suffix.lower() in READ_SUFFIXES for m in wanted), archive.name)
            total = 0
            for member in wanted:
                name = Path(member.filename.replace("\\", "/")).name
                target = into / name
                if target.exists():
                    raise PointCloudError(f"{archive.name}: two entries are named {shown(name)}; expected unique names")
                total += _inflate(zf, member, target, MAX_SEQUENCE_BYTES - total, archive.name)
    except PointCloudError:
        raise
    except (zipfile.BadZipFile, NotImplementedError, UnicodeDecodeError, ValueError) as exc:
        # a corrupt directory: zipfile says BadZipFile, a version or flag it does not know NotImplementedError,
        # a name flagged UTF-8 that is not UnicodeDecodeError; its own wording names its internals
        logger.info("%s: zipfile refused the directory: %r", archive.name, exc)
        raise PointCloudError(f"{archive.name}: not a readable zip (corrupt directory); expected a zip of sweep files") from None
    return into


def _check_member_names(label: str, members: list[zipfile.ZipInfo]) -> None:
    """Refuse a member whose base name the file system cannot hold (over 255 bytes), before it is written."""
    for member in members:
        name = Path(member.filename.replace("\\", "/")).name
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise PointCloudError(
                f"{label}: a member's name {shown(name)} is longer than {MAX_NAME_BYTES} bytes; expected sweep files "
                "named like 000000.bin"
            )


def read_poses(path: str | Path, names: Sequence[str], calib: str | Path | None = None) -> np.ndarray:
    """(N, 4, 4) world_from_sensor poses for the sweeps called `names`, from a poses.txt or a JSON file."""
    path = Path(path)
    text = read_text_file(path, "poses file", "a KITTI poses.txt or a poses.json")
    if text.lstrip().startswith(("{", "[")):
        poses = _json_poses(path, text, names)
    else:
        poses = _kitti_poses(path, text, names, calib)
    return check_poses(poses, str(path))


def kitti_velodyne_poses(cam_poses: np.ndarray, tr: np.ndarray = NOMINAL_KITTI_TR) -> np.ndarray:
    """KITTI camera-0 poses (N, 4, 4) -> Velodyne world_from_sensor, the world being the first Velodyne frame."""
    return np.linalg.inv(tr) @ cam_poses @ tr


def read_text_file(path: Path, what: str, expected: str) -> str:
    """The text of a small regular file (poses, calibration, JSON), refused unread past `MAX_TEXT_BYTES`.

    Only regular files: a FIFO would block the read forever and a device file never ends. At most
    `MAX_TEXT_BYTES` + 1 bytes are read whatever the size says, so a file that grows meanwhile is refused too.
    """
    if not path.is_file():
        raise PointCloudError(f"{path}: no such {what} (or not a regular file); expected {expected}")
    with path.open("rb") as f:
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise PointCloudError(f"{path}: over {MAX_TEXT_BYTES:,} bytes, too large for a {what}; expected {expected}")
    return data.decode("utf-8", errors="replace")


def parse_json(text: str, name: str) -> object:
    """`json.loads`, with every failure a `PointCloudError` naming the file: bad syntax, nesting deeper than
    Python's recursion limit (a 1 MB file of `[` is a nesting bomb) or an integer longer than Python converts;
    Python's own wording for the last two stays out of the message."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PointCloudError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise PointCloudError(f"{name}: JSON nested too deeply; expected a poses file") from None
    except ValueError:
        raise PointCloudError(f"{name}: JSON holds an integer too long to read; expected a poses file") from None


# ----------------------------------------------------------------------------------------------------------


def _read_folder(folder: Path, sensor: Sensor | None, poses: str | Path | None, label: str) -> SweepSequence:
    """A folder written by `write_rollout` is read in its poses.json order (frames only, not world.*)."""
    own = folder / "poses.json"
    names = _rollout_frame_files(own) if own.is_file() and poses is None else None
    if names is not None:
        return _read_files([folder / n for n in names], sensor, own)
    files = sweep_files(folder)
    if not files:
        raise PointCloudError(f"{label}: no sweep files ({', '.join(READ_SUFFIXES)}) found")
    if poses is None:  # a poses.json that is a list of 4x4 poses, else a KITTI poses.txt
        poses = next((p for p in (own, folder / "poses.txt") if p.is_file()), None)
    return _read_files(files, sensor, poses)


def _read_files(files: list[Path], sensor: Sensor | None, poses: str | Path | None) -> SweepSequence:
    _check_count(len(files), "the sequence")
    total = 0
    for path in files:
        total += path.stat().st_size if path.is_file() else 0
        if total > MAX_SEQUENCE_BYTES:
            raise PointCloudError(
                f"the sweeps add up to over {MAX_SEQUENCE_BYTES / 2**20:.0f} MB; a sequence may hold at most that"
            )
    scans: list[Scan] = []
    for path in files:
        scans.append(read_points(path, sensor))
        _check_points(scans)
    names = [path.name for path in files]
    pose_array = None
    if poses is not None:
        calib = Path(poses).parent / CALIB_FILE
        pose_array = read_poses(poses, names, calib if calib.is_file() else None)
    logger.info("read a sequence of %d sweeps (%s)", len(scans), "with poses" if pose_array is not None else "no poses")
    return SweepSequence(scans=scans, names=names, poses=pose_array)


def _read_container(path: Path, sensor: Sensor | None, poses: str | Path | None, topic: str | None) -> SweepSequence:
    """Every sweep of a container, within `MAX_SWEEPS` (counted from its index, before any is decoded) and the
    sequence's point limit; its own poses unless `poses` names a file."""
    from lidar.recordings import open_container

    rec = open_container(path, topic=topic, sensor=sensor, max_sweeps=MAX_SWEEPS)
    _check_count(len(rec), f"{path}{f' ({rec.topic})' if rec.topic else ''}")
    scans: list[Scan] = []
    for i in range(len(rec)):
        checkpoint()
        scans.append(rec[i])
        _check_points(scans)
    pose_array = rec.poses if poses is None else read_poses(poses, rec.names)
    logger.info("read %d sweeps of %s (%s)", len(scans), path.name, rec.kind)
    return SweepSequence(scans=scans, names=rec.names, poses=pose_array, times=rec.times)


def _check_points(scans: list[Scan]) -> None:
    """Refuse a sequence once its sweeps hold more than `SEQUENCE_POINTS_IN_CLOUDS` full clouds' points."""
    points, limit = sum(scan.num_points for scan in scans), SEQUENCE_POINTS_IN_CLOUDS * max_points()
    if points > limit:
        raise PointCloudError(
            f"{scans[-1].path}: the first {len(scans)} sweeps hold {points:,} points; a sequence may hold at most "
            f"{limit:,} (each point costs time and memory on the way to a forecast)"
        )


def _check_count(count: int, where: str) -> None:
    if count > MAX_SWEEPS:
        raise PointCloudError(f"{where}: {count} sweeps; a sequence may hold at most {MAX_SWEEPS}")


def _wanted_member(member: zipfile.ZipInfo) -> bool:
    if not member.filename:  # zipfile's is_dir fails on an empty name
        return False
    name = Path(member.filename.replace("\\", "/")).name
    hidden = name.startswith(".") or "__MACOSX" in member.filename
    return (
        not member.is_dir()
        and not hidden
        and (Path(name).suffix.lower() in READ_SUFFIXES or name in (*POSES_FILES, CALIB_FILE))
    )


def _inflate(zf: zipfile.ZipFile, member: zipfile.ZipInfo, target: Path, budget: int, label: str) -> int:
    """Write one member, reading at most its limit + 1 bytes whatever its header says: min(budget,
    MAX_FILE_BYTES) for a sweep, MAX_TEXT_BYTES for a poses or calibration file. Inflated in chunks, so a
    cancelled request stops between them."""
    text = Path(member.filename.replace("\\", "/")).name in (*POSES_FILES, CALIB_FILE)
    limit = MAX_TEXT_BYTES if text else min(budget, MAX_FILE_BYTES)
    chunks, size = [], 0
    check_lzma_member(Path(str(zf.filename)), member, label)
    try:
        with zf.open(member) as src:
            while size <= limit and (chunk := src.read(min(_CHUNK_BYTES, limit + 1 - size))):
                checkpoint()
                chunks.append(chunk)
                size += len(chunk)
    except (RuntimeError, NotImplementedError, zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError, OSError) as exc:
        # OSError: a corrupt bzip2 stream ("Invalid data stream") or a member offset before the file's start
        logger.info("%s: cannot unpack %s: %r", label, shown(member.filename), exc)
        raise PointCloudError(f"{label}: cannot unpack {capped(member.filename, MAX_SHOWN_CHARS)}: {_zip_problem(exc, member)}") from None
    if size > limit:
        what = f"a poses or calibration file <= {MAX_TEXT_BYTES:,} bytes" if text else (
            f"one sweep <= {MAX_FILE_BYTES / 1e6:.0f} MB, a sequence <= {MAX_SEQUENCE_BYTES / 2**20:.0f} MB")
        raise PointCloudError(f"{label}: {capped(member.filename, MAX_SHOWN_CHARS)} inflates past the limit ({what})")
    target.write_bytes(b"".join(chunks))
    return size


#: What a member's compressed stream is called in a message, by zip compression method.
_STREAMS = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}


def _zip_problem(exc: BaseException, member: zipfile.ZipInfo) -> str:
    """What a zipfile / zlib / bz2 / lzma failure means, in the user's terms (their own messages name their
    internals)."""
    if isinstance(exc, RuntimeError) and "encrypted" in str(exc):
        return "it is encrypted; expected an unencrypted zip"
    if isinstance(exc, NotImplementedError):
        return "its compression method is not supported; expected stored or deflated entries"
    return f"its data is corrupt (a bad checksum or {_STREAMS.get(member.compress_type, 'compressed')} stream)"


def _frame_order(path: Path) -> tuple[int, int, str]:
    match = _FRAME_NUMBER.search(path.stem)
    return (0, int(match.group(1)), path.name) if match else (1, 0, path.name)


def frame_numbers(names: Sequence[str]) -> list[int] | None:
    """The frame number in each sweep's name (`000004.bin` -> 4), or None unless every name holds one."""
    numbers = [_FRAME_NUMBER.search(Path(n).stem) for n in names]
    return [int(m.group(1)) for m in numbers] if all(numbers) else None  # type: ignore[union-attr]


def _rollout_frame_files(poses_json: Path) -> list[str] | None:
    """The frame files a LidarVerse poses.json lists, in order; None for a JSON list of 4x4 poses, which
    poses the folder's sweeps in their frame order instead."""
    data = parse_json(read_text_file(poses_json, "poses.json", "the poses.json of a LidarVerse rollout"), str(poses_json))
    if isinstance(data, list):
        return None
    try:
        names = [f["file"] for f in data["frames"] if f["file"]]
    except (KeyError, TypeError, IndexError):
        raise PointCloudError(
            f"{poses_json}: not a poses.json written by LidarVerse (frames[*].file) nor a list of 4x4 poses"
        ) from None
    if not all(isinstance(n, str) and Path(n).name == n for n in names):
        raise PointCloudError(f"{poses_json}: frame files must be plain names inside its folder")
    return names


def _json_poses(path: Path, text: str, names: Sequence[str]) -> np.ndarray:
    """A LidarVerse poses.json (matched by file name, prefix sweeps included) or a list of 4x4 matrices."""
    data = parse_json(text, str(path))
    if isinstance(data, list):
        if len(data) != len(names):
            raise PointCloudError(f"{path}: {len(data)} poses for {len(names)} sweeps; expected one per sweep")
        return _pose_array(data, path)
    try:
        records = [*data.get("prefix", []), *data["frames"]]
        by_file = {r["file"]: r["pose"] for r in records if isinstance(r.get("file"), str)}
    except (AttributeError, KeyError, TypeError):
        raise PointCloudError(f"{path}: expected a LidarVerse poses.json with frames[*].file/pose") from None
    missing = [n for n in names if n not in by_file]
    if missing:
        listed = ", ".join(str(name)[:80] for name in list(by_file)[:5])
        raise PointCloudError(f"{path}: no pose for {', '.join(missing[:3])}; it lists {listed}")
    return _pose_array([by_file[n] for n in names], path)


def _pose_array(data: list, path: Path) -> np.ndarray:
    """JSON poses as (N, 4, 4) float64, or a `PointCloudError` when they are not all 4x4 grids of numbers."""
    try:
        arr = np.asarray(data, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.shape[1:] != (4, 4):
        raise PointCloudError(f"{path}: each pose must be a 4x4 list of numbers; expected (N, 4, 4) world_from_sensor")
    return arr


def _kitti_poses(path: Path, text: str, names: Sequence[str], calib: str | Path | None) -> np.ndarray:
    try:
        rows = np.array([[float(v) for v in line.split()] for line in text.splitlines() if line.strip()])
    except ValueError:  # a word, or ragged lines
        raise PointCloudError(f"{path}: not a KITTI poses.txt (12 numbers per line) nor JSON") from None
    if rows.ndim != 2 or rows.shape[1] != 12:
        raise PointCloudError(f"{path}: lines of {rows.shape[-1] if rows.ndim == 2 else '?'} numbers; expected 12")
    numbers = frame_numbers(names) or list(range(len(names)))
    if max(numbers) >= len(rows):
        raise PointCloudError(f"{path}: {len(rows)} poses, but the sweeps need frame {max(numbers)}")
    cam = np.tile(np.eye(4), (len(numbers), 1, 1))
    cam[:, :3, :4] = rows[numbers].reshape(-1, 3, 4)
    return kitti_velodyne_poses(cam, _kitti_tr(calib))


def _kitti_times(path: Path, names: Sequence[str]) -> np.ndarray:
    """Seconds of each sweep from a KITTI times.txt (one number per frame, matched by frame number)."""
    text = read_text_file(path, "times.txt", "a KITTI times.txt (one number of seconds per line)")
    try:
        values = np.array([float(v) for v in text.split()])
    except ValueError:
        raise PointCloudError(f"{path}: not a KITTI times.txt (one number of seconds per line)") from None
    numbers = frame_numbers(names) or list(range(len(names)))
    if max(numbers) >= len(values) or not np.isfinite(values).all():
        raise PointCloudError(f"{path}: {len(values)} finite times, but the sweeps need frame {max(numbers)}")
    if np.abs(values).max() > MAX_TIME_S:
        raise PointCloudError(
            f"{path}: a time of {np.abs(values).max():.3g} s; expected seconds within {MAX_TIME_S:.0e} of zero "
            "(KITTI counts from the drive's start)"
        )
    return values[numbers]


def _kitti_raw_times(path: Path, names: Sequence[str]) -> np.ndarray:
    """Seconds of each sweep from a KITTI raw `timestamps.txt` (one clock time per frame, matched by frame
    number), counted from the first line."""
    expected = "a KITTI raw timestamps.txt (one 'YYYY-MM-DD HH:MM:SS.fffffffff' per line)"
    lines = [line.strip() for line in read_text_file(path, "timestamps.txt", expected).splitlines() if line.strip()]
    seconds = _clock_seconds(path, lines, expected)
    numbers = frame_numbers(names) or list(range(len(names)))
    if max(numbers) >= len(seconds):
        raise PointCloudError(f"{path}: {len(seconds)} clock times, but the sweeps need frame {max(numbers)}")
    return seconds[numbers]


def _clock_seconds(path: Path, lines: list[str], expected: str) -> np.ndarray:
    """Seconds of each clock time from the first, the whole seconds and the nanoseconds parsed apart.

    A clock time outside `CLOCK_RANGE` is refused: NumPy's nanosecond clock holds 1678-2262 and wraps
    silently past it (year 9999 would read as 1816).
    """
    whole, nanos = [], []
    for number, line in enumerate(lines, 1):
        match = _CLOCK_TIME.fullmatch(line)
        try:
            clock = np.datetime64(match.group(1).replace(" ", "T"), "s") if match else None
        except ValueError:
            clock = None
        if clock is None or not CLOCK_RANGE[0] <= clock < CLOCK_RANGE[1]:
            raise PointCloudError(
                f"{path}: line {number} ({shown(line)}) is not a clock time from {CLOCK_RANGE[0]} to "
                f"{CLOCK_RANGE[1]}; expected {expected}"
            )
        whole.append(clock)
        nanos.append(int((match.group(2) or "").ljust(9, "0")))
    if not whole:
        raise PointCloudError(f"{path}: no clock times; expected {expected}")
    clocks, fractions = np.array(whole, dtype="datetime64[s]"), np.array(nanos, dtype=np.int64)
    return (clocks - clocks[0]).astype(np.int64) + (fractions - fractions[0]) / 1e9


def _kitti_tr(calib: str | Path | None) -> np.ndarray:
    """`Tr` (velodyne -> camera 0) from a KITTI calib.txt, else the nominal axis swap (module docstring)."""
    if calib is None:
        logger.warning("no KITTI calib.txt beside poses.txt: assuming the nominal Velodyne-camera axis swap")
        return NOMINAL_KITTI_TR
    for line in read_text_file(Path(calib), "calib.txt", "a KITTI odometry calib.txt").splitlines():
        key, _, values = line.partition(":")
        if key.strip() == "Tr":
            tr = np.eye(4)
            try:
                tr[:3, :4] = np.array(values.split(), dtype=np.float64).reshape(3, 4)
            except ValueError:
                break
            return check_poses(tr[None], f"{calib}: Tr")[0]  # rigid, so inverting it cannot fail
    raise PointCloudError(f"{calib}: no 'Tr: <12 numbers>' line; expected a KITTI odometry calib.txt")

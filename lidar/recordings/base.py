"""What every container reader shares: the lazy `ContainerRecording`, the container bounds and the pose helpers.

A container (a bag, a pcap, a dataset's log) holds many sweeps in one file or folder. Its reader first builds
an index (where each sweep lies, its time stamp and pose) without decoding a sweep, refusing a container past
the bounds below as soon as its headers show it; a sweep is decoded only when it is indexed, so a drive of
thousands of sweeps costs one sweep's memory at a time.

Poses come out re-based on the first sweep (its sensor frame is the world frame, as in KITTI odometry), so a
city- or UTM-frame pose thousands of metres from its origin does not cost float32 points their precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lidar.errors import MAX_SHOWN_CHARS, capped
from lidar.formats import Scan
from lidar.formats.scan import MAX_DECODED_BYTES, PointCloudError
from lidar.sequence import Recording
from lidar.vocabulary import check_poses

#: Most messages, records or packets a container may list in all, read or not: a million tiny messages are
#: refused from the index, before any is read (a 10 Hz LiDAR with /tf and odometry at 100 Hz lists ~750,000 an
#: hour; a longer log is split or filtered to its LiDAR and pose topics first).
MAX_CONTAINER_MESSAGES = 1_000_000
#: Most sweeps one topic or sensor of a container may hold (a 3-hour drive at 10 Hz).
MAX_CONTAINER_SWEEPS = 100_000
#: Most bytes one message, chunk or sweep's packets may take once decompressed: what one sweep file may.
MAX_RECORD_BYTES = MAX_DECODED_BYTES
#: A sweep whose stamp lies farther than this from every pose sample gets no pose (seconds).
MAX_POSE_GAP_S = 0.5


@dataclass
class ContainerRecording(Recording):
    """A recording inside one container: `files` holds the container itself, and sweep i is decoded by
    `decode(i)` when indexed. `stamps_ns` keeps each sweep's own time stamp (ns, the container's clock), so a
    conversion keeps them exactly; `times` counts seconds from the first sweep."""

    #: Sweep names, e.g. "points_000003" (topic or sensor and index).
    labels: list[str] = field(default_factory=list)
    #: (N,) int64 time stamp of each sweep in ns.
    stamps_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: What the container is, e.g. "ros1-bag", "velodyne-pcap"; and the topic or sensor read.
    kind: str = ""
    topic: str | None = None
    decode: Callable[[int], Scan] = field(default=lambda i: None, repr=False)  # type: ignore[assignment, return-value]

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def names(self) -> list[str]:
        return list(self.labels)

    def position(self, index: int) -> int:
        """`index` (negatives count from the end) as a sweep's position; IndexError past either end."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sweep {index} of a recording of {len(self)}")
        return int(index) % len(self)

    def sweep(self, index: int) -> Scan:
        position = self.position(index)
        try:
            return self.decode(position)
        except OSError as err:  # the container moved, or its disk failed, since it was indexed
            raise unreadable(self.files[0], err) from err

    def sweeps(self, indices: Iterable[int]) -> Iterator[Scan]:
        """The sweeps at `indices`, decoded one at a time (a worker's recording reads them in batches)."""
        for index in indices:
            yield self.sweep(index)


def make_recording(
    source: Path, kind: str, topic: str | None, stamps_ns: Sequence[int] | np.ndarray, decode: Callable[[int], Scan],
    poses: np.ndarray | None = None, label: str = "sweep", labels: list[str] | None = None,
) -> ContainerRecording:
    """A `ContainerRecording` of sweeps in time order, bounded by `MAX_CONTAINER_SWEEPS`; `poses`
    (world_from_sensor in the container's world, NaN rows for sweeps without one) are re-based on the first
    sweep and dropped whole when a sweep lacks one (the recording is then registered instead). Sweeps are
    named `labels`, else `<label>_<index>`."""
    stamps = np.asarray(stamps_ns, dtype=np.int64)
    if len(stamps) == 0:
        raise PointCloudError(f"{source}: no LiDAR sweeps{f' on {topic}' if topic else ''}; expected at least one")
    check_sweep_count(source, len(stamps), topic)
    times = (stamps - stamps[0]).astype(np.float64) / 1e9
    if poses is not None and not np.isfinite(poses).all():
        poses = None
    if poses is not None:
        poses = check_poses(rebase(poses), str(source))
    stem = label.strip("/").replace("/", "_") or "sweep"
    labels = labels or [f"{stem}_{i:06d}" for i in range(len(stamps))]
    return ContainerRecording(files=[source], poses=poses, times=times, labels=labels, stamps_ns=stamps, kind=kind,
                              topic=topic, decode=decode)


def unreadable(path: Path, err: OSError) -> PointCloudError:
    """The refusal of a path the file system will not look at (a name too long, no permission, a failing
    disk), naming the path it refused (capped: a too-long name is the visitor's) and why. Raised `from err`,
    so a worker still sees an ENOMEM underneath as its memory limit."""
    where = err.filename if isinstance(err.filename, str) and err.filename else str(path)
    return PointCloudError(f"{capped(where, MAX_SHOWN_CHARS)}: cannot be read ({err.strerror or err})")


def check_sweep_count(source: Path, count: int, topic: str | None = None, limit: int | None = None) -> None:
    """Refuse more than `limit` sweeps (default `MAX_CONTAINER_SWEEPS`), naming the topic."""
    limit = MAX_CONTAINER_SWEEPS if limit is None else min(limit, MAX_CONTAINER_SWEEPS)
    if count > limit:
        where = f" on {topic}" if topic else ""
        hint = "" if limit == MAX_CONTAINER_SWEEPS else " here; cut it first: python -m lidar convert IN OUT.mcap --sweeps=-8:"
        raise PointCloudError(f"{source}: {count:,} sweeps{where}; a recording may hold at most {limit:,}{hint}")


def check_message_count(source: Path, count: int) -> None:
    if count > MAX_CONTAINER_MESSAGES:
        raise PointCloudError(
            f"{source}: lists {count:,} messages; a recording may list at most {MAX_CONTAINER_MESSAGES:,} "
            "(split it, or keep only the LiDAR and pose topics)"
        )


def check_record_size(source: Path, size: int, what: str) -> None:
    if size > MAX_RECORD_BYTES:
        raise PointCloudError(
            f"{source}: {what} of {size / 1e6:,.0f} MB, over the {MAX_RECORD_BYTES / 1e6:.0f} MB a sweep's data may take"
        )


def rebase(poses: np.ndarray) -> np.ndarray:
    """world_from_sensor poses (N, 4, 4) re-expressed with the first sweep's sensor frame as the world."""
    poses = np.asarray(poses, dtype=np.float64)
    return np.linalg.inv(poses[0]) @ poses


def pose_matrix(translation: Sequence[float], quat_xyzw: Sequence[float]) -> np.ndarray:
    """A 4x4 rigid transform from a translation and an (x, y, z, w) quaternion (normalised here)."""
    from scipy.spatial.transform import Rotation  # scipy.spatial costs every worker ~0.15 s to import

    out = np.eye(4)
    quat = np.asarray(quat_xyzw, dtype=np.float64)
    norm = np.linalg.norm(quat)
    if not np.isfinite(norm) or norm < 1e-9:
        raise PointCloudError(f"a pose's quaternion {quat.tolist()} has no direction; expected a unit quaternion")
    out[:3, :3] = Rotation.from_quat(quat / norm).as_matrix()
    out[:3, 3] = translation
    return out


def interpolate_poses(stamps_ns: np.ndarray, sample_ns: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """(N, 4, 4) poses at `stamps_ns` from time-sorted pose samples: positions linearly, rotations by slerp.

    A stamp outside the samples takes the nearest one when it lies within `MAX_POSE_GAP_S`; farther, its
    rows are NaN (no pose there). One sample poses every stamp within the gap.
    """
    from scipy.spatial.transform import Rotation, Slerp

    stamps = np.asarray(stamps_ns, dtype=np.int64)
    out = np.full((len(stamps), 4, 4), np.nan)
    if len(sample_ns) == 0:
        return out
    order = np.argsort(sample_ns, kind="stable")
    t_ns = np.asarray(sample_ns, dtype=np.int64)[order]
    t_ns, first = np.unique(t_ns, return_index=True)
    samples = np.asarray(samples, dtype=np.float64)[order][first]
    t = (t_ns - t_ns[0]).astype(np.float64) / 1e9
    at = np.clip((stamps - t_ns[0]).astype(np.float64) / 1e9, t[0], t[-1])
    gap = np.abs((stamps - t_ns[0]).astype(np.float64) / 1e9 - at)
    near = np.abs(t[np.clip(np.searchsorted(t, at), 0, len(t) - 1)] - at)
    near = np.minimum(near, np.abs(t[np.clip(np.searchsorted(t, at) - 1, 0, len(t) - 1)] - at))
    ok = (gap <= MAX_POSE_GAP_S) & (near <= MAX_POSE_GAP_S)
    if len(t) == 1:
        out[ok] = samples[0]
        return out
    rot = Slerp(t, Rotation.from_matrix(samples[:, :3, :3]))(at[ok]).as_matrix()
    out[ok] = np.eye(4)
    out[ok, :3, :3] = rot
    for axis in range(3):
        out[ok, axis, 3] = np.interp(at[ok], t, samples[:, axis, 3])
    return out

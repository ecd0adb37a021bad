"""Crash-safe file writes: temporary name, fsync, validate, rename, fsync the directory.

A reader therefore sees either the old file or the complete new one, never a torn one, and the
rename itself survives a power cut because the directory entry is flushed too.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import time
import zipfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpointing.errors import CheckpointWriteError, CorruptCheckpointError

logger = logging.getLogger(__name__)

_TMP_RE = re.compile(r"^(?P<target>.+)\.tmp\.(?P<pid>\d+)$")
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest remembers about one written file."""

    name: str
    size: int
    sha256: str


def tmp_path_for(path: Path) -> Path:
    """The per-process temporary name; the pid lets a later run tell stale leftovers from live writes."""
    return path.with_name(f"{path.name}.tmp.{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    """Flush the directory entry so a rename into it survives a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hash in large chunks; hashlib drops the GIL, so this overlaps with writing and fsync."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_complete_zip(path: Path) -> None:
    """Refuse a torch file whose zip directory is missing or inconsistent (typically truncated)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is not a complete torch zip archive ({e})") from e
    size = path.stat().st_size
    if not any(info.filename.endswith("/data.pkl") for info in infos):
        raise CorruptCheckpointError(f"{path} is a zip archive but holds no torch data.pkl record")
    for info in infos:
        if info.header_offset + info.compress_size > size:
            raise CorruptCheckpointError(f"{path}: record {info.filename} runs past the end of the file")


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data inside nested containers (the bulk of a torch file); of a sharded tensor
    (DTensor, FSDP1's ShardedTensor), only this rank's shards, which is what this rank writes.

    Told apart by their methods, so weight loading never imports torch.distributed's tensor types."""
    if hasattr(obj, "to_local"):  # DTensor
        return tensor_bytes(obj.to_local())
    if hasattr(obj, "local_shards"):  # ShardedTensor
        return sum(tensor_bytes(shard.tensor) for shard in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk, for files written by code that does not fsync itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def without_torch_crc32() -> Iterator[None]:
    """torch.save without its per-record CRC32: the manifest's sha256 already covers every byte, and
    the CRC (which torch.load never checks) costs as much CPU as the copy into the page cache."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _write_error(path: Path, e: OSError) -> CheckpointWriteError:
    hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
    err = CheckpointWriteError(e.errno or errno.EIO, f"could not write checkpoint file {path}{hint}: {e}")
    err.filename = str(path)
    return err


def atomic_torch_save_all(items: Sequence[tuple[Any, str | os.PathLike]]) -> list[FileRecord]:
    """torch.save several objects as one durable batch; each path ends up absent/old or complete.

    Steps: write every `<path>.tmp.<pid>` (largest first), fsyncing and hashing each on helper threads
    while the next one is serialised (re-reading from the page cache measured faster here than hashing
    each chunk as it is written) -> check each zip directory -> rename in the given order (put the marker last)
    -> fsync the directories. Nothing is renamed before everything is durable; on failure every
    temporary file is removed.
    """
    paths = [Path(path) for _, path in items]
    tmps = [tmp_path_for(path) for path in paths]
    start = time.perf_counter()
    current = paths[0] if paths else Path()
    # Largest first, so hashing the big files overlaps with writing the others.
    write_order = sorted(range(len(items)), key=lambda i: -tensor_bytes(items[i][0]))
    try:
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckpt-io") as pool:
            pending = {}
            for i in write_order:
                current = paths[i]
                with open(tmps[i], "wb") as f, without_torch_crc32():
                    torch.save(items[i][0], f)
                pending[i] = (pool.submit(fsync_file, tmps[i]), pool.submit(sha256_file, tmps[i]))
            records = []
            for i, (path, tmp) in enumerate(zip(paths, tmps, strict=True)):
                current = path
                synced, digest = pending[i]
                synced.result()
                records.append(FileRecord(path.name, tmp.stat().st_size, digest.result()))
                check_complete_zip(tmp)
        for path, tmp in zip(paths, tmps, strict=True):
            current = path
            os.replace(tmp, path)
        for directory in dict.fromkeys(path.parent for path in paths):
            fsync_dir(directory)
    except BaseException as e:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise _write_error(current, e) from e
        raise
    logger.debug(
        "wrote %d file(s), %.1f MB, in %.2f s",
        len(records),
        sum(r.size for r in records) / 1e6,
        time.perf_counter() - start,
    )
    return records


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> FileRecord:
    """torch.save `obj` so that `path` is either absent/old or complete and durable (see atomic_torch_save_all)."""
    return atomic_torch_save_all([(obj, path)])[0]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> FileRecord:
    """Write a small file (pointer, manifest, DCP metadata) with the same temporary-name/fsync/rename protocol."""
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise _write_error(path, e) from e
        raise
    return FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_tmp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete `*.tmp.<pid>` files whose writer process is gone (left by a crash mid-write).

    The pid test is only meaningful on this host; on a shared filesystem written by several hosts a
    live writer elsewhere could share a dead local pid, so multi-host jobs should keep one writer.
    """
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        match = _TMP_RE.match(entry.name)
        if match is None or not entry.is_file():
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        fsync_dir(directory)
        logger.warning(
            "removed %d stale temporary file(s) left by dead writers in %s", len(removed), directory
        )
    return removed

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
import threading
import time
import zipfile
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
    """Hash in large chunks; hashlib drops the GIL, so this overlaps with the caller's fsync."""
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


class _HashInBackground:
    """Hash a file on a helper thread while the caller waits on fsync (both release the GIL)."""

    def __init__(self, path: Path) -> None:
        self._result: str | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path,), name="ckpt-sha256", daemon=True)
        self._thread.start()

    def _run(self, path: Path) -> None:
        try:
            self._result = sha256_file(path)
        except BaseException as e:  # handed to the caller in result()
            self._result = e

    def result(self) -> str:
        self._thread.join()
        if isinstance(self._result, BaseException):
            raise self._result
        assert isinstance(self._result, str)
        return self._result


def _write_error(path: Path, e: OSError) -> CheckpointWriteError:
    hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
    err = CheckpointWriteError(e.errno or errno.EIO, f"could not write checkpoint file {path}{hint}: {e}")
    err.filename = str(path)
    return err


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> FileRecord:
    """torch.save `obj` to `path` so that `path` is either absent/old or complete and durable.

    Steps: write `<path>.tmp.<pid>` -> fsync it (hashing it meanwhile) -> check its zip directory
    -> rename -> fsync the directory. On any failure the temporary file is removed.
    """
    path = Path(path)
    tmp = tmp_path_for(path)
    start = time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            hasher = _HashInBackground(tmp)
            os.fsync(f.fileno())
        digest = hasher.result()
        check_complete_zip(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise _write_error(path, e) from e
        if isinstance(e, RuntimeError) and "write" in str(e).lower():  # torch's C++ writer wraps OSError
            raise _write_error(path, OSError(errno.EIO, str(e))) from e
        raise
    elapsed = time.perf_counter() - start
    logger.debug("wrote %s (%.1f MB) in %.2f s", path, size / 1e6, elapsed)
    return FileRecord(path.name, size, digest)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file (pointer, manifest) with the same temporary-name/fsync/rename protocol."""
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise _write_error(path, e) from e
        raise


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

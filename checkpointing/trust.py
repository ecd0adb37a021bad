"""The one reader of a checkpoints directory's own files: what a name may be, what a file must be, how much of
it is read.

A checkpoints directory may come from anywhere (a download, a shared disk), so nothing in it is trusted before
it is checked: a name must be a bare file name (no absolute path, no `..`, no separator), a file must be a
regular file whose real path lies inside the directory (a symbolic link may point to a sibling, never out),
and the pointer and manifest are read with a small bound and never from a FIFO or a device (a pointer linked
to /dev/zero would otherwise fill memory, a FIFO would block forever). `generations`, `manifest`, the CLI and
the inference loader all go through these functions.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from checkpointing.errors import CorruptCheckpointError

#: Largest pointer read: it holds one marker name (layout.parse_pointer accepts 256 characters).
POINTER_MAX_BYTES = 4096
#: Largest manifest read: about 120 bytes a file, so room for tens of thousands of shard files.
MANIFEST_MAX_BYTES = 8 << 20


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a file of a checkpoints directory (None when it is a bare file name)."""
    if not name or "\x00" in name or not name.isprintable():
        return f"{name!r} is not a printable file name"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return f"{name!r} is an absolute path, outside the checkpoints folder"
    if name in (".", "..") or "/" in name or "\\" in name:
        return f"{name!r} is a path that leaves the checkpoints folder"
    return None


def member_problem(directory: Path, name: str) -> str | None:
    """Why `directory / name` must not be read (None: a regular file inside `directory`).

    Only metadata is looked at (lstat, realpath, stat): a file outside the folder is never opened, and its
    size is never reported.
    """
    problem = name_problem(name)
    if problem is not None:
        return problem
    path = directory / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be examined ({e.strerror})"
    if stat.S_ISLNK(info.st_mode):
        real_dir = os.path.realpath(directory)
        target = os.path.realpath(path)
        if os.path.dirname(target) != real_dir:
            return f"{name} is a symbolic link that leads out of the checkpoints folder"
        try:
            info = os.stat(path)
        except OSError:
            return f"{name} is a dangling symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return f"{name} is not a regular file"
    return None


def read_bounded(path: Path, limit: int) -> bytes:
    """The content of a small regular file, at most `limit` bytes; CorruptCheckpointError otherwise.

    Opened non-blocking, so a FIFO swapped in after a check cannot hang the open, and checked again on the
    open descriptor (fstat), so what is read is what was checked.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"{path} cannot be opened ({e.strerror})") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise CorruptCheckpointError(f"{path} has {info.st_size} bytes, more than the {limit} allowed")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise CorruptCheckpointError(f"{path} cannot be read ({e.strerror})") from e
    finally:
        os.close(fd)
    if size > limit:
        raise CorruptCheckpointError(f"{path} grew past the {limit} bytes allowed while being read")
    return b"".join(chunks)


def read_member(directory: Path, name: str, limit: int) -> bytes | None:
    """`read_bounded` of a checked member of `directory`; None when it does not exist."""
    if not os.path.lexists(directory / name):
        return None
    problem = member_problem(directory, name)
    if problem is not None:
        raise CorruptCheckpointError(f"{directory / name}: {problem}")
    return read_bounded(directory / name, limit)

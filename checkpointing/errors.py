"""Exception types, so callers can tell a refused file from a torn one from a full disk."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: something about a checkpoint (not the caller's code) is wrong."""


class CheckpointPointerError(CheckpointError, ValueError):
    """`latest_checkpoint.txt` holds something that must not be used as a file name."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, bit-flipped, missing, or not what its manifest says."""


class NoValidCheckpointError(CheckpointError):
    """The pointer names a generation that is broken and no older valid one exists."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle needs globals that weights-only loading refuses (it could run code)."""


class StateDictMismatchError(CheckpointError, ValueError):
    """Weights do not fit the model: missing keys, unexpected keys or shape mismatches."""


class AsyncSaveError(CheckpointError):
    """An earlier save failed (on this or another rank); raised at the next save() or finalize()."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint file failed; `errno` is kept (ENOSPC for a full disk)."""

"""Loading pickled torch files without running code from them.

`torch.load(weights_only=False)` executes whatever a pickle's globals say, so a downloaded
checkpoint could run an attacker's code. Everything here loads with `weights_only=True`; a file
that needs more is refused with the globals it asks for, unless the caller explicitly trusts it.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

logger = logging.getLogger(__name__)


def unsafe_globals(path: Path) -> list[str]:
    """The globals in a torch zip pickle that weights-only loading would refuse."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (RuntimeError, ValueError, OSError, zipfile.BadZipFile, pickle.UnpicklingError):
        return []


def safe_torch_load(path: str | Path, *, trusted: bool = False, mmap: bool = False) -> Any:
    """torch.load on CPU with weights_only=True.

    trusted=True is the opt-in for legacy files you wrote yourself that pickle custom classes; it
    runs their code, so never set it for downloaded files.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        offending = unsafe_globals(path)
        if not offending:
            raise CorruptCheckpointError(f"{path} could not be unpickled ({e})") from e
        if trusted:
            logger.warning("loading %s with code-running pickle globals %s (trusted opt-in)", path, offending)
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        raise UnsafeCheckpointError(
            f"{path} needs pickle globals that could run code: {', '.join(offending)}. "
            "Checkpoints should hold only tensors and plain containers. If you wrote this file yourself "
            "and trust it, opt in with CheckpointConfig(trust_legacy_pickle=True) "
            "(or torch.serialization.add_safe_globals for specific classes)."
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{path} could not be read as a torch checkpoint ({e})") from e

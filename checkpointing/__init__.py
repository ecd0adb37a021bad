"""Crash-safe, seed-compatible FSDP checkpointing. Knows nothing about LiDAR.

Training: `FSDPCheckpointer(CheckpointConfig(...), JobConfig(...), CallBackGroup())`.
Loading weights elsewhere (inference): `resolve_weights`, `read_weights`, `load_weights_into`,
`load_weights_file` (a sharded generation's part too), `resolve_generation`, or the seed's
`FSDPInferenceCheckpointer`.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Where each public name lives. Imports are lazy (PEP 562) so that an inference process, which only
# reads weights, never pays for torch.distributed.checkpoint's import (seconds on a laptop).
_EXPORTS = {
    "atomic_torch_save": "atomic",
    "atomic_write_text": "atomic",
    "CallBackGroup": "callbacks",
    "FSDPCheckpointer": "checkpointer",
    "CheckpointConfig": "config",
    "JobConfig": "config",
    "AsyncSaveError": "errors",
    "CheckpointError": "errors",
    "CheckpointPointerError": "errors",
    "CheckpointWriteError": "errors",
    "CorruptCheckpointError": "errors",
    "NoValidCheckpointError": "errors",
    "StateDictMismatchError": "errors",
    "UnsafeCheckpointError": "errors",
    "FSDPInferenceCheckpointer": "inference",
    "ModelWithEMA": "state",
    "ResolvedWeights": "weights",
    "load_weights_file": "weights",
    "load_weights_into": "weights",
    "read_weights": "weights",
    "resolve_generation": "weights",
    "resolve_weights": "weights",
    "strip_wrapper_prefixes": "weights",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'checkpointing' has no attribute {name!r}")
    value = getattr(import_module(f"checkpointing.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from checkpointing.atomic import atomic_torch_save, atomic_write_text
    from checkpointing.callbacks import CallBackGroup
    from checkpointing.checkpointer import FSDPCheckpointer
    from checkpointing.config import CheckpointConfig, JobConfig
    from checkpointing.errors import (
        AsyncSaveError,
        CheckpointError,
        CheckpointPointerError,
        CheckpointWriteError,
        CorruptCheckpointError,
        NoValidCheckpointError,
        StateDictMismatchError,
        UnsafeCheckpointError,
    )
    from checkpointing.inference import FSDPInferenceCheckpointer
    from checkpointing.state import ModelWithEMA
    from checkpointing.weights import (
        ResolvedWeights,
        load_weights_file,
        load_weights_into,
        read_weights,
        resolve_generation,
        resolve_weights,
        strip_wrapper_prefixes,
    )

__all__ = [
    "AsyncSaveError",
    "CallBackGroup",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointPointerError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "FSDPCheckpointer",
    "FSDPInferenceCheckpointer",
    "JobConfig",
    "ModelWithEMA",
    "NoValidCheckpointError",
    "ResolvedWeights",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
    "atomic_torch_save",
    "atomic_write_text",
    "load_weights_file",
    "load_weights_into",
    "read_weights",
    "resolve_generation",
    "resolve_weights",
    "strip_wrapper_prefixes",
]

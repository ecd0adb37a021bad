"""Crash-safe, seed-compatible FSDP checkpointing. Knows nothing about LiDAR.

Training: `FSDPCheckpointer(CheckpointConfig(...), JobConfig(...), CallBackGroup())`.
Loading weights elsewhere (inference): `resolve_weights`, `read_weights`, `load_weights_into`,
`resolve_generation`, or the seed's `FSDPInferenceCheckpointer`.
"""

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
    "load_weights_into",
    "read_weights",
    "resolve_generation",
    "resolve_weights",
    "strip_wrapper_prefixes",
]

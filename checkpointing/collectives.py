"""The few torch.distributed calls the checkpointer makes, each a no-op without a process group.

Saves coordinate on a private gloo group: the background writer thread uses it while the training
thread keeps the default group, so the two never interleave collectives on one group (torchtitan
does the same for async checkpointing).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def new_checkpoint_group(timeout_s: float) -> Any:
    """A gloo group for checkpoint coordination (collective: every rank must call it)."""
    if not initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def all_gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's `obj`, indexed by rank."""
    if not initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_from_rank0(obj: Any, group: Any) -> Any:
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]

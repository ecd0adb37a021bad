"""Getting full (unsharded) training state out of whatever the trainer holds, and putting it back.

Models come in two shapes:
  * the seed's protocol: `state_dict_model() -> {"model": sd, "ema": sd | None}`, `.model` (the
    wrapped module) and `get_ckpt_postfix() -> (postfix, replicate_idx, shard_idx, total_ema_num)`;
  * an `nn.Module` (plain, DDP, FSDP1 or FSDP2), optionally paired with an EMA module in
    `ModelWithEMA`.
Full state dicts come from torch.distributed.checkpoint.state_dict, so the files do not depend on
the world size that wrote them.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from checkpointing import collectives

logger = logging.getLogger(__name__)

# Keys of the files, named once.
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
GRAD_SCALER = "grad_scaler"
ITERATION = "iteration"
RNG = "rng"
WORLD_SIZE = "world_size"


@dataclass
class ModelWithEMA:
    """An nn.Module (any wrapping) and the EMA module saved alongside it as `_ema_model.pt`."""

    model: nn.Module
    ema: nn.Module | None = None


@dataclass
class SaveRole:
    """What this rank writes for a generation."""

    postfix: str  # "" for the primary writer, "_RANK{k}" for EMA replica k
    primary: bool  # writes the marker, regular weights and optimizer file
    writes_ema: bool


def is_seed_protocol(model: Any) -> bool:
    return all(hasattr(model, name) for name in ("state_dict_model", "get_ckpt_postfix", "model"))


def module_of(model: Any) -> nn.Module:
    """The module whose parameters the optimizer updates."""
    if isinstance(model, ModelWithEMA) or is_seed_protocol(model):
        return model.model
    if isinstance(model, nn.Module):
        return model
    raise TypeError(
        f"cannot checkpoint a {type(model).__name__}: expected an nn.Module, a ModelWithEMA, or an object with "
        "state_dict_model(), get_ckpt_postfix() and .model (the seed's model protocol)"
    )


def ema_of(model: Any) -> nn.Module | None:
    return model.ema if isinstance(model, ModelWithEMA) else None


def _full_options() -> StateDictOptions:
    # Full tensors offloaded to CPU on rank 0 only; without a process group there is nothing to gather.
    if collectives.initialized():
        return StateDictOptions(full_state_dict=True, cpu_offload=True)
    return StateDictOptions()


def save_role(model: Any) -> SaveRole:
    if not is_seed_protocol(model):
        primary = collectives.rank() == 0
        return SaveRole("", primary, primary)
    postfix_info = tuple(model.get_ckpt_postfix())
    if len(postfix_info) == 3:  # older seed models: (postfix, replicate_idx, total_ema_num)
        postfix, replicate_idx, total_ema_num = postfix_info
        shard_idx = 0
    else:
        postfix, replicate_idx, shard_idx, total_ema_num = postfix_info
    if replicate_idx == 0 and shard_idx == 0:
        if postfix:
            raise ValueError(
                f"get_ckpt_postfix() gave the primary writer the postfix {postfix!r}; expected ''"
            )
        return SaveRole("", True, True)
    if replicate_idx < total_ema_num and shard_idx == 0:
        return SaveRole(postfix or f"_RANK{replicate_idx}", False, True)
    return SaveRole(postfix, False, False)


def gather_model_states(model: Any) -> tuple[dict | None, dict | None]:
    """(regular, EMA) full state dicts; collective on every rank, content only where it is written."""
    if is_seed_protocol(model):
        states = model.state_dict_model()
        return states.get("model"), states.get("ema")
    reg = get_model_state_dict(module_of(model), options=_full_options())
    ema_module = ema_of(model)
    ema = get_model_state_dict(ema_module, options=_full_options()) if ema_module is not None else None
    return reg, ema


def gather_optimizer_state(model: Any, optimizer: torch.optim.Optimizer | None) -> dict | None:
    if optimizer is None:
        return None
    return get_optimizer_state_dict(module_of(model), optimizer, options=_full_options())


def _fqn_keyed(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Re-key a plain `optimizer.state_dict()` (integer ids, as the seed wrote) by parameter name."""
    ids = [pid for group in state["param_groups"] for pid in group["params"]]
    if not ids or not all(isinstance(pid, int) for pid in ids):
        return state
    names = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(ids):
        raise ValueError(f"the saved optimizer has {len(ids)} parameters, this one has {len(params)}")
    fqn = {pid: names[id(p)] for pid, p in zip(ids, params, strict=True)}
    return {
        "state": {fqn[pid]: value for pid, value in state["state"].items()},
        "param_groups": [{**g, "params": [fqn[pid] for pid in g["params"]]} for g in state["param_groups"]],
    }


def restore_optimizer(model: Any, optimizer: torch.optim.Optimizer, state: dict) -> None:
    module = module_of(model)
    state = _fqn_keyed(module, optimizer, state)
    options = StateDictOptions(full_state_dict=collectives.initialized())
    set_optimizer_state_dict(module, optimizer, state, options=options)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain containers and tensors (loadable weights-only)."""
    np_state = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

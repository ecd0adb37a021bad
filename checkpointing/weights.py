"""Model weights as files: read any of our weight files safely, find the right one in a job, and load
it into a module with a precise report of what did not fit.

This is the part of the package the inference loader shares, so a job directory resolves to the same
generation, with the same validation and fallback, for training and for the demo.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from torch import nn

from checkpointing import layout
from checkpointing.errors import CheckpointError, CorruptCheckpointError, StateDictMismatchError
from checkpointing.generations import Resolution, generation_problems, list_generations, resolve_latest
from checkpointing.safe_load import safe_torch_load

logger = logging.getLogger(__name__)

# Wrapper modules that insert a name component without adding parameters.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
_DDP_PREFIX = "module."
_NESTED_KEYS = ("state_dict", "model")


def strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Key names as the bare module sees them: drop FSDP1/compile/activation-checkpoint segments
    anywhere and a DDP `module.` prefix when every key has it."""
    cleaned = {}
    for key, value in state_dict.items():
        for segment in _WRAPPER_SEGMENTS:
            key = key.replace(segment, "")
        cleaned[key] = value
    while cleaned and all(k.startswith(_DDP_PREFIX) for k in cleaned):
        cleaned = {k[len(_DDP_PREFIX) :]: v for k, v in cleaned.items()}
    if len(cleaned) != len(state_dict):
        raise StateDictMismatchError("state dict keys collide after removing wrapper prefixes")
    return cleaned


def read_weights(path: str | os.PathLike, *, trusted: bool = False) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict from a `.safetensors` or torch `.pt`/`.pth`/`.bin` file.

    Pickles load weights-only (no code runs); a `{"model": sd}` / `{"state_dict": sd}` wrapper is
    unwrapped and wrapper prefixes are stripped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            state = load_safetensors(path, device="cpu")
        except (SafetensorError, OSError) as e:
            raise CorruptCheckpointError(f"{path} is not a readable safetensors file ({e})") from e
    elif path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        state = safe_torch_load(path, trusted=trusted, mmap=True)  # no copy until tensors are used
    else:
        raise ValueError(f"{path}: expected a .safetensors or torch .pt/.pth/.bin/.ckpt weights file")
    if isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        nested = [k for k in _NESTED_KEYS if isinstance(state.get(k), dict)]
        if nested:
            state = state[nested[0]]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CorruptCheckpointError(
            f"{path} does not hold a name -> tensor state dict (found {type(state).__name__}); "
            "expected model weights"
        )
    return strip_wrapper_prefixes(state)


@dataclass
class ResolvedWeights:
    """Which weights file a source means, and why (notices are meant for the user)."""

    path: Path
    kind: str  # "ema", "reg" (from a checkpoint generation) or "file" (a weights file as given)
    iteration: int | None = None
    notices: list[str] = field(default_factory=list)


def checkpoints_dir_of(directory: Path) -> Path:
    """`<job>` or `<job>/checkpoints` -> the directory that holds the generations."""
    nested = directory / layout.CHECKPOINTS_DIRNAME
    if nested.is_dir():
        return nested
    if (directory / layout.POINTER_NAME).exists() or any(
        layout.generation_of(n) for n in os.listdir(directory)
    ):
        return directory
    raise CheckpointError(
        f"{directory} holds no checkpoints: expected a job directory with checkpoints/ or a directory "
        f"with {layout.POINTER_NAME} and iter_*.pt / ckpt_.pt files"
    )


def resolve_generation(directory: str | os.PathLike, verify: str = "size") -> Resolution:
    """A job dir or checkpoints dir -> its newest valid generation.

    The pointer's generation wins when valid; otherwise (or without a pointer) the newest valid one,
    with a notice. Raises NoValidCheckpointError / CheckpointPointerError / CheckpointError.
    """
    ckpt_dir = checkpoints_dir_of(Path(directory))
    resolution = resolve_latest(ckpt_dir, verify)
    if resolution is not None:
        return resolution
    for generation in reversed(list_generations(ckpt_dir)):
        if not generation_problems(ckpt_dir, generation, verify):
            notice = f"{ckpt_dir} has no {layout.POINTER_NAME}; using the newest valid generation {generation.marker}"
            logger.warning("%s", notice)
            return Resolution(ckpt_dir, generation, None, [notice])
    raise CheckpointError(f"{ckpt_dir} has no {layout.POINTER_NAME} and no valid checkpoint generation")


def resolve_weights(
    source: str | os.PathLike, prefer_ema: bool = True, verify: str = "size"
) -> ResolvedWeights:
    """A weights file, a marker `.pt`, a checkpoints dir or a job dir -> the weights file to load.

    For a generation the EMA weights are preferred (when asked) and the regular ones used otherwise,
    with a notice saying so.
    """
    source = Path(source)
    if source.is_dir():
        resolution = resolve_generation(source, verify)
        directory, marker, notices = (
            resolution.directory,
            resolution.generation.marker,
            list(resolution.notices),
        )
        iteration = resolution.generation.iteration
    elif source.is_file():
        try:
            iteration = layout.parse_marker(source.name)
        except ValueError:
            return ResolvedWeights(source, "file")
        if not layout.sibling_path(source, layout.REG_MODEL).is_file():
            return ResolvedWeights(source, "file")  # a release file that happens to be named like a marker
        directory, marker, notices = source.parent, source.name, []
    else:
        raise FileNotFoundError(f"checkpoint source {source} does not exist")
    ema = directory / layout.sibling_name(marker, layout.EMA_MODEL)
    reg = directory / layout.sibling_name(marker, layout.REG_MODEL)
    if prefer_ema and ema.is_file():
        return ResolvedWeights(ema, "ema", iteration, notices)
    if prefer_ema:
        notices.append(f"{marker} has no EMA weights; using the regular weights {reg.name}")
        logger.warning("%s", notices[-1])
    return ResolvedWeights(reg, "reg", iteration, notices)


def _is_plain(module: nn.Module) -> bool:
    """True for a module no data-parallel wrapper touched.

    Such modules (every inference load) skip torch.distributed.checkpoint, whose first call imports
    torch._dynamo and costs seconds of start-up on a laptop; their own state_dict already has clean FQNs.
    """
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return False
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        return False
    return not any(type(p).__name__ == "DTensor" for p in module.parameters())


def _expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shapes by clean FQN, without all-gathering (DTensor/ShardedTensor report global shapes)."""
    if _is_plain(module):
        return {k: tuple(v.shape) for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: tuple(v.shape) for k, v in get_model_state_dict(module).items()}


def mismatch_report(
    module: nn.Module, state_dict: dict[str, torch.Tensor]
) -> tuple[list[str], list[str], list[str]]:
    """(missing keys, unexpected keys, 'name: file (..) vs model (..)' shape mismatches)."""
    expected = _expected_shapes(module)
    missing = sorted(k for k in expected if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in expected)
    shapes = sorted(
        f"{k}: file {tuple(state_dict[k].shape)} vs model {expected[k]}"
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != expected[k]
    )
    return missing, unexpected, shapes


def load_weights_into(
    module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True, source: str = "weights"
) -> tuple[list[str], list[str], list[str]]:
    """Copy a full (unsharded) state dict into a plain, DDP, FSDP1 or FSDP2 module.

    strict: raise StateDictMismatchError listing every missing key, unexpected key and shape mismatch.
    Not strict: load what fits, log the rest. Returns (missing, unexpected, shape mismatches).
    """
    state_dict = strip_wrapper_prefixes(state_dict)
    missing, unexpected, shapes = mismatch_report(module, state_dict)
    if strict and (missing or unexpected or shapes):
        parts = [
            f"{label} ({len(items)}): {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}"
            for label, items in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatches", shapes),
            )
            if items
        ]
        raise StateDictMismatchError(
            f"{source} does not fit {type(module).__name__}: "
            + "; ".join(parts)
            + ". Pass strict_resume=False to load only what matches."
        )
    bad = set(unexpected) | {s.split(":")[0] for s in shapes}
    fitting = {k: v for k, v in state_dict.items() if k not in bad}
    if missing or bad:
        logger.warning(
            "%s: loading non-strictly; %d missing, %d unexpected, %d shape-mismatched keys left out",
            source,
            len(missing),
            len(unexpected),
            len(shapes),
        )
    if _is_plain(module):
        module.load_state_dict(fitting, strict=False)
        return missing, unexpected, shapes
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = torch.distributed.is_available() and torch.distributed.is_initialized()
    set_model_state_dict(module, fitting, options=StateDictOptions(full_state_dict=full, strict=False))
    return missing, unexpected, shapes

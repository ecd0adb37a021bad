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
from checkpointing.generations import (
    Generation,
    Resolution,
    generation_problems,
    list_generations,
    resolve_latest,
)
from checkpointing.safe_load import safe_torch_load

logger = logging.getLogger(__name__)

# Wrapper modules that insert a name component without adding parameters.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
_DDP_PREFIX = "module."
_NESTED_KEYS = ("state_dict", "model")
#: Torch pickle suffixes `read_weights` loads weights-only, and every weights file it reads.
TORCH_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", *TORCH_WEIGHT_SUFFIXES)


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
    """A flat name -> tensor dict from a `.safetensors` or torch `.pt`/`.pth`/`.bin`/`.ckpt` file.

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
    elif path.suffix in TORCH_WEIGHT_SUFFIXES:
        state = safe_torch_load(path, trusted=trusted, mmap=True)  # no copy until tensors are used
    else:
        raise ValueError(f"{path}: expected a weights file ending in {' or '.join(WEIGHT_SUFFIXES)}")
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


def _named_generation(marker_path: Path, verify: str) -> Generation | None:
    """The generation a marker file names, checked like a resume checks it; None when the file is no
    generation's marker (a weights file, or a release file that happens to be named like a marker)."""
    try:
        layout.parse_marker(marker_path.name)
    except ValueError:
        return None
    directory = marker_path.parent
    generation = next((g for g in list_generations(directory) if g.marker == marker_path.name), None)
    if generation is None or (
        generation.manifest is None
        and generation.manifest_error is None
        and layout.sibling_name(generation.marker, layout.REG_MODEL) not in generation.files
    ):
        return None
    problems = generation_problems(directory, generation, verify)
    if problems:
        raise CorruptCheckpointError(f"{marker_path} is not a loadable generation: {'; '.join(problems)}")
    return generation


def resolve_weights(
    source: str | os.PathLike, prefer_ema: bool = True, verify: str = "size"
) -> ResolvedWeights:
    """A weights file, a marker `.pt`, a checkpoints dir or a job dir -> the weights to load.

    For a generation the EMA weights are preferred (when asked) and the regular ones used otherwise,
    with a notice saying so. A marker's generation is checked as a resume would check it. For a sharded
    generation the path is the part's DCP metadata (`iter_…_ema_model.metadata`), which
    `load_weights_file` reads with its shards.
    """
    source = Path(source)
    if source.is_dir():
        resolution = resolve_generation(source, verify)
        directory, generation, notices = resolution.directory, resolution.generation, list(resolution.notices)
    elif source.is_file():
        generation = _named_generation(source, verify)
        if generation is None:
            return ResolvedWeights(source, "file")
        directory, notices = source.parent, []
    else:
        raise FileNotFoundError(f"checkpoint source {source} does not exist")
    marker = generation.marker
    sharded = generation.manifest is not None and generation.manifest.state_layout == layout.SHARDED
    name_of = layout.part_metadata_name if sharded else layout.sibling_name
    ema, reg = directory / name_of(marker, layout.EMA_MODEL), directory / name_of(marker, layout.REG_MODEL)
    if prefer_ema and ema.name in generation.files:
        return ResolvedWeights(ema, "ema", generation.iteration, notices)
    if prefer_ema:
        notices.append(f"{marker} has no EMA weights; using the regular weights {reg.name}")
        logger.warning("%s", notices[-1])
    return ResolvedWeights(reg, "reg", generation.iteration, notices)


def load_weights_file(module: nn.Module, path: Path, strict: bool = True, trusted: bool = False) -> None:
    """Load one weights source `resolve_weights` named into `module`: a `.safetensors` or torch file, or a
    sharded generation's part (its `.metadata`), read in this process alone with no process group and
    without touching the generation's other parts (the optimizer's shards stay unread)."""
    part = layout.part_file(path.name)
    if part is None or part[2] is not None:
        load_weights_into(module, read_weights(path, trusted=trusted), strict=strict, source=str(path))
        return
    marker, kind, _ = part
    if _named_generation(path.parent / marker, "size") is None:
        raise CorruptCheckpointError(f"{path} belongs to no checkpoint generation beside it ({marker} is missing)")
    from checkpointing import sharded  # DCP's import costs seconds; plain weights files never pay it

    sharded.load_module(module, path.parent, marker, kind, group=None, strict=strict)


def is_plain(module: nn.Module) -> bool:
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
    if is_plain(module):
        return {k: tuple(v.shape) for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: tuple(v.shape) for k, v in get_model_state_dict(module).items()}


def mismatch_report(
    module: nn.Module, shapes: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[str], list[str]]:
    """(missing keys, unexpected keys, 'name: file (..) vs model (..)' shape mismatches) of weights whose
    global shapes are `shapes`, against the module."""
    expected = _expected_shapes(module)
    missing = sorted(k for k in expected if k not in shapes)
    unexpected = sorted(k for k in shapes if k not in expected)
    mismatched = sorted(
        f"{k}: file {tuple(shapes[k])} vs model {expected[k]}"
        for k in expected
        if k in shapes and tuple(shapes[k]) != expected[k]
    )
    return missing, unexpected, mismatched


def check_fit(module: nn.Module, shapes: dict[str, tuple[int, ...]], strict: bool, source: str) -> set[str]:
    """The keys of `shapes` to load into `module`: all of them, or (strict) StateDictMismatchError listing every
    missing key, unexpected key and shape mismatch; not strict, the ones that fit, the rest logged."""
    missing, unexpected, mismatched = mismatch_report(module, shapes)
    if strict and (missing or unexpected or mismatched):
        parts = [
            f"{label} ({len(items)}): {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}"
            for label, items in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatches", mismatched),
            )
            if items
        ]
        raise StateDictMismatchError(
            f"{source} does not fit {type(module).__name__}: "
            + "; ".join(parts)
            + ". Pass strict_resume=False to load only what matches."
        )
    bad = set(unexpected) | {s.split(":")[0] for s in mismatched}
    if missing or bad:
        logger.warning(
            "%s: loading non-strictly; %d missing, %d unexpected, %d shape-mismatched keys left out",
            source,
            len(missing),
            len(unexpected),
            len(mismatched),
        )
    return set(shapes) - bad


def load_weights_into(
    module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True, source: str = "weights"
) -> None:
    """Copy a full (unsharded) state dict into a plain, DDP, FSDP1 or FSDP2 module.

    strict: raise StateDictMismatchError listing every missing key, unexpected key and shape mismatch.
    Not strict: load what fits, log the rest.
    """
    state_dict = strip_wrapper_prefixes(state_dict)
    fitting = check_fit(module, {k: tuple(v.shape) for k, v in state_dict.items()}, strict, source)
    state_dict = {k: v for k, v in state_dict.items() if k in fitting}
    if is_plain(module):
        module.load_state_dict(state_dict, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = torch.distributed.is_available() and torch.distributed.is_initialized()
    set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=full, strict=False))

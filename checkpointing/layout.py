"""File names of the seed's on-disk layout, and the only place that parses them.

In `<job>/checkpoints/`:
    iter_000000100.pt               marker {"iteration": 100, ...}, written after its siblings
    iter_000000100_reg_model.pt     model weights
    iter_000000100_ema_model.pt     EMA weights (replica k: iter_000000100_RANK{k}_ema_model.pt)
    iter_000000100_optim.pt         {"optimizer", "scheduler", "grad_scaler"}
    iter_000000100_manifest.json    sizes + sha256 of every file (this package's addition)
    latest_checkpoint.txt           "iter_000000100.pt\n", published last
Without retention the stem is `ckpt_` (ckpt_.pt, ckpt__reg_model.pt, ...), overwritten by each save.

The sharded layout keeps the marker, `_optim.pt` (everything but the optimizer's tensors) and the
manifest, and replaces each weights or optimizer-tensor file by a torch.distributed.checkpoint part:
    iter_000000100_reg_model.metadata          the part's DCP metadata (written by rank 0)
    iter_000000100_reg_model_rank{r}.distcp    rank r's shards of it (one file per rank)
and likewise `_ema_model` and `_optim`.

Sibling names are derived from the file name only: the seed's `path.replace(".pt", ...)` also rewrote
directories whose names contain ".pt".
"""

from __future__ import annotations

import re
from pathlib import Path

from checkpointing.errors import CheckpointPointerError

CHECKPOINTS_DIRNAME = "checkpoints"
POINTER_NAME = "latest_checkpoint.txt"
REG_MODEL = "reg_model"
EMA_MODEL = "ema_model"
OPTIM = "optim"
MANIFEST = "manifest"
#: The two state layouts (CheckpointConfig.state_layout; the manifest records which one a generation uses).
FULL = "full"
SHARDED = "sharded"
STATE_LAYOUTS = (FULL, SHARDED)
#: What the sharded layout writes as DCP parts, in the order they are saved.
SHARDED_PARTS = (REG_MODEL, EMA_MODEL, OPTIM)
#: Key present in every marker this package writes and absent from the seed's: a marker carrying it
#: counts only together with its complete manifest (the commit record).
FORMAT = "checkpointing_format"

_MARKER_RE = re.compile(r"^(?:iter_(?P<iteration>\d{9,})|ckpt_)\.pt$")
# Any file that belongs to a generation: its stem, then a full-layout file (optional replica postfix, optional
# kind) or a sharded part's metadata or shard.
_MEMBER_RE = re.compile(
    r"^(?P<stem>iter_\d{9,}|ckpt_)(?:(?:_RANK\d+)?(?:_(?:reg_model|ema_model|optim|manifest))?\.(?:pt|json)"
    r"|_(?P<part>reg_model|ema_model|optim)(?:\.metadata|_rank(?P<rank>\d+)\.distcp))$"
)


def marker_name(iteration: int, postfix: str = "", numbered: bool = True) -> str:
    """The seed's marker name: iter_{iteration:09d}{postfix}.pt, or ckpt_{postfix}.pt without retention."""
    return f"iter_{iteration:09d}{postfix}.pt" if numbered else f"ckpt_{postfix}.pt"


def stem_of(marker: str) -> str:
    """`iter_000000100.pt` -> `iter_000000100`; only the final suffix is removed."""
    if not marker.endswith(".pt"):
        raise ValueError(f"checkpoint marker names end in .pt, got {marker!r}")
    return marker[: -len(".pt")]


def sibling_name(marker: str, kind: str) -> str:
    """`iter_000000100.pt` + `reg_model` -> `iter_000000100_reg_model.pt`."""
    if kind == MANIFEST:
        return f"{stem_of(marker)}_{MANIFEST}.json"
    return f"{stem_of(marker)}_{kind}.pt"


def part_metadata_name(marker: str, kind: str) -> str:
    """`iter_000000100.pt` + `reg_model` -> `iter_000000100_reg_model.metadata` (a sharded part's DCP metadata)."""
    return f"{stem_of(marker)}_{kind}.metadata"


def shard_name(marker: str, kind: str, rank: int) -> str:
    """`iter_000000100.pt` + `reg_model` + 3 -> `iter_000000100_reg_model_rank3.distcp`."""
    return f"{stem_of(marker)}_{kind}_rank{rank}.distcp"


def part_file(name: str) -> tuple[str, str, int | None] | None:
    """(marker, kind, rank) of a sharded part's file name (rank None for its metadata); None for other names."""
    match = _MEMBER_RE.match(name)
    if match is None or match["part"] is None:
        return None
    return f"{match['stem']}.pt", match["part"], None if match["rank"] is None else int(match["rank"])


def required_files(marker: str, state_layout: str, world_size: int, listed: set[str] | dict) -> list[str]:
    """Files a committed generation of `marker` must have: without one of them it cannot be resumed.

    Full layout: the marker, the weights and the optimizer file. Sharded: the marker, `_optim.pt`, the
    regular weights' metadata and, for every part whose metadata is `listed`, one shard per rank.
    """
    if state_layout == FULL:
        return [marker, sibling_name(marker, REG_MODEL), sibling_name(marker, OPTIM)]
    required = [marker, sibling_name(marker, OPTIM), part_metadata_name(marker, REG_MODEL)]
    for kind in SHARDED_PARTS:
        if part_metadata_name(marker, kind) in listed:
            required += [shard_name(marker, kind, rank) for rank in range(world_size)]
    return required


def replica_marker(marker: str, replica: int) -> str:
    """The (never written) marker name of EMA replica k, from which its siblings are named."""
    return f"{stem_of(marker)}_RANK{replica}.pt"


def sibling_path(marker_path: Path, kind: str) -> Path:
    """Sibling of a marker anywhere on disk; the directory part is never rewritten."""
    return marker_path.with_name(sibling_name(marker_path.name, kind))


def parse_marker(name: str) -> int | None:
    """The iteration a rank-0 marker name carries (None for ckpt_.pt); ValueError if it is not one."""
    match = _MARKER_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint marker name (iter_<9+ digits>.pt or ckpt_.pt)")
    return int(match["iteration"]) if match["iteration"] else None


def generation_of(name: str) -> str | None:
    """The marker name of the generation a file belongs to, or None for unrelated files."""
    match = _MEMBER_RE.match(name)
    if match is None:
        return None
    return f"{match['stem']}.pt"


def parse_pointer(text: str, source: str | Path = POINTER_NAME) -> str:
    """Validate the pointer's content and return the marker file name it names.

    The content must be a bare marker name: it is joined to the checkpoints directory, so anything
    that could reach outside it (absolute paths, `..`, separators) or is not a marker is refused.
    """
    expected = "expected one marker file name such as 'iter_000000100.pt' or 'ckpt_.pt' and a newline"
    name = text.strip()
    if not name:
        raise CheckpointPointerError(f"{source} is empty; {expected}")
    if len(text) > 256 or "\n" in name or "\x00" in name or not name.isprintable():
        raise CheckpointPointerError(f"{source} holds garbled content {text[:80]!r}; {expected}")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise CheckpointPointerError(f"{source} holds an absolute path {name!r}; {expected}")
    if ".." in name.replace("\\", "/").split("/") or "/" in name or "\\" in name:
        raise CheckpointPointerError(
            f"{source} holds a path {name!r} that leaves the checkpoints directory; {expected}"
        )
    if _MARKER_RE.match(name) is None:
        raise CheckpointPointerError(f"{source} names {name!r}, which is not a checkpoint marker; {expected}")
    return name

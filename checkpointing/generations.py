"""What is in a checkpoints directory: generations, their validity, which one to resume, which to prune.

A generation is every file sharing a marker's stem. It is valid when its marker exists and its
manifest says complete and matches the files. Only a true seed-era folder (no manifest, and a marker
without this package's format key) is judged without one: every file must at least be a complete zip
archive. A marker of ours with no manifest is a save that never committed, and never counts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from checkpointing import layout
from checkpointing.atomic import check_complete_zip, fsync_dir
from checkpointing.errors import (
    CheckpointError,
    CheckpointPointerError,
    CorruptCheckpointError,
    NoValidCheckpointError,
)
from checkpointing.manifest import Manifest
from checkpointing.safe_load import safe_torch_load
from checkpointing.trust import POINTER_MAX_BYTES, member_problem, read_member

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One saved generation as found on disk."""

    marker: str  # rank-0 marker name, e.g. iter_000000100.pt or ckpt_.pt
    files: list[str]  # every file on disk that belongs to it, the marker included if present
    manifest: Manifest | None
    manifest_error: str | None = None

    @property
    def iteration(self) -> int | None:
        if self.manifest is not None:
            return self.manifest.iteration
        return layout.parse_marker(self.marker)

    @property
    def has_marker(self) -> bool:
        return self.marker in self.files

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest is not None else 0

    @property
    def pinned(self) -> bool:
        return self.manifest is not None and self.manifest.pinned


@dataclass
class Resolution:
    """The generation a resume will use and what the user should be told about the choice."""

    directory: Path
    generation: Generation
    pointer: str | None  # the marker the pointer names (may differ from generation.marker)
    notices: list[str] = field(default_factory=list)

    @property
    def marker_path(self) -> Path:
        return self.directory / self.generation.marker


def list_generations(directory: Path) -> list[Generation]:
    """All generations in `directory`, oldest first (ckpt_.pt by its recorded iteration)."""
    groups: dict[str, list[str]] = {}
    if directory.is_dir():
        for entry in sorted(os.listdir(directory)):
            marker = layout.generation_of(entry)
            if marker is not None:
                groups.setdefault(marker, []).append(entry)
    generations = []
    for marker, files in groups.items():
        manifest_path = directory / layout.sibling_name(marker, layout.MANIFEST)
        manifest, error = None, None
        if manifest_path.name in files:
            try:
                manifest = Manifest.read(manifest_path)
            except CorruptCheckpointError as e:
                error = str(e)
        generations.append(Generation(marker, files, manifest, error))
    generations.sort(key=lambda g: (g.iteration if g.iteration is not None else -1, g.marker))
    return generations


def generation_problems(directory: Path, generation: Generation, verify: str) -> list[str]:
    """Why `generation` must not be loaded ([] means valid under `verify`)."""
    if not generation.has_marker:
        return [f"marker {generation.marker} is missing (the save never finished)"]
    if generation.manifest_error is not None:
        return [generation.manifest_error]
    if generation.manifest is not None:
        return generation.manifest.problems(directory, generation.marker, generation.files, verify)
    # No manifest: nothing is opened before every file is known to be a regular file inside the folder.
    problems = [p for name in generation.files if (p := member_problem(directory, name)) is not None]
    if problems:
        return problems
    if is_committed_format(directory / generation.marker):
        return [
            f"{generation.marker} was written by this package but its manifest is missing: the save never "
            "committed (a rank failed or the job died before the manifest was written)"
        ]
    # Written by the seed: no manifest, so check what can be checked without one.
    if verify == "none":
        return []
    for name in generation.files:
        if name.endswith(".pt"):
            try:
                check_complete_zip(directory / name)
            except CorruptCheckpointError as e:
                problems.append(str(e))
    if layout.sibling_name(generation.marker, layout.REG_MODEL) not in generation.files:
        problems.append(f"{layout.sibling_name(generation.marker, layout.REG_MODEL)} is missing")
    return problems


def state_layout_of(marker_path: Path) -> str:
    """The layout of the generation `marker_path` names, as its manifest records it; a marker without a
    readable manifest (seed-era, a release file named like a marker, a weights file) is read as full."""
    try:
        return Manifest.read(layout.sibling_path(marker_path, layout.MANIFEST)).state_layout
    except (CorruptCheckpointError, ValueError):  # ValueError: not a marker's name, so no manifest beside it
        return layout.FULL


def is_committed_format(marker_path: Path) -> bool:
    """True when the marker carries this package's format key, so only a complete manifest makes it count.

    Read weights-only; a marker that cannot be read that way is no marker of ours (the seed's could
    pickle anything), and its other problems are reported by the seed-era checks.
    """
    try:
        state = safe_torch_load(marker_path)
    except (CheckpointError, OSError):
        return False
    return isinstance(state, dict) and layout.FORMAT in state


def read_pointer(directory: Path) -> str | None:
    """The marker named by latest_checkpoint.txt; None when there is no pointer; error when it is bad.

    Read through the bounded reader (trust.py): only a small regular file inside the folder is read.
    """
    try:
        raw = read_member(directory, layout.POINTER_NAME, POINTER_MAX_BYTES)
    except CorruptCheckpointError as e:
        raise CheckpointPointerError(f"{e}; expected a small text file naming one marker") from e
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return layout.parse_pointer(text, directory / layout.POINTER_NAME)


def resolve_latest(directory: Path, verify: str) -> Resolution | None:
    """The generation to resume: the pointer's if valid, else the newest valid older one (with a notice).

    Returns None when there is no pointer (a fresh job). Raises CheckpointPointerError for a bad
    pointer and NoValidCheckpointError when nothing valid is left.
    """
    pointer = read_pointer(directory)
    if pointer is None:
        return None
    generations = list_generations(directory)
    by_marker = {g.marker: g for g in generations}
    target = by_marker.get(pointer)
    problems = (
        generation_problems(directory, target, verify)
        if target is not None
        else [f"{pointer} does not exist"]
    )
    if not problems:
        return Resolution(directory, target, pointer)
    # Never jump forward past what was published: only generations up to the pointer's iteration.
    ceiling = target.iteration if target is not None else layout.parse_marker(pointer)
    rejected = [f"{pointer}: {'; '.join(problems)}"]
    for candidate in reversed(generations):
        if candidate is target or candidate.iteration is None:
            continue
        if ceiling is not None and candidate.iteration > ceiling:
            continue
        candidate_problems = generation_problems(directory, candidate, verify)
        if candidate_problems:
            rejected.append(f"{candidate.marker}: {'; '.join(candidate_problems)}")
            continue
        notice = (
            f"latest checkpoint {pointer} in {directory} is unusable ({'; '.join(problems)}); "
            f"falling back to {candidate.marker} (iteration {candidate.iteration})"
        )
        logger.warning("%s", notice)
        return Resolution(directory, candidate, pointer, [notice])
    raise NoValidCheckpointError(
        f"no valid checkpoint generation in {directory} (verify={verify!r}):\n  " + "\n  ".join(rejected)
    )


def prune_plan(
    directory: Path, keep_last: int, save_at_iters: tuple[int, ...] = (), verify: str = "sha256"
) -> list[Generation]:
    """Generations retention may delete: numbered ones older than the pointer's, beyond the newest
    `keep_last` valid ones, neither pinned nor in save_at_iters.

    The pointer's generation and the newest valid one (the resume fallback) are always kept, and
    nothing newer than the pointer is touched (it may be a save in flight). `verify` decides what
    counts as valid; "size" is enough right after a save, whose files were just hashed as written.
    """
    pointer = read_pointer(directory)
    generations = list_generations(directory)
    by_marker = {g.marker: g for g in generations}
    if pointer is None or pointer not in by_marker or by_marker[pointer].iteration is None:
        return []
    ceiling = by_marker[pointer].iteration
    keep: set[str] = {pointer}
    kept_valid = 0
    for g in reversed(generations):
        if g.iteration is None or g.iteration > ceiling or layout.parse_marker(g.marker) is None:
            keep.add(g.marker)  # ckpt_ and in-flight/newer generations are not retention's business
            continue
        if g.pinned or g.iteration in save_at_iters:
            keep.add(g.marker)
            continue
        if kept_valid < max(keep_last, 1) and not generation_problems(directory, g, verify):
            keep.add(g.marker)
            kept_valid += 1
    return [g for g in generations if g.marker not in keep]


def delete_generation(directory: Path, generation: Generation) -> None:
    """Remove a generation marker-first, so a half-deleted one is never taken for valid."""
    order = sorted(generation.files, key=lambda name: name != generation.marker)
    for name in order:
        (directory / name).unlink(missing_ok=True)
    fsync_dir(directory)
    logger.info("pruned checkpoint generation %s (%d files)", generation.marker, len(order))

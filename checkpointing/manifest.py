"""The per-generation manifest: the commit record that says which files make a generation, how big
they are and what they hash to.

It is written twice per save: first as `complete: false` before any file of the generation is
replaced (so an interrupted overwrite of `ckpt_.pt` is never mistaken for a good one), then as
`complete: true` after every file, EMA replicas included, is durable.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from checkpointing import layout
from checkpointing.atomic import FileRecord, atomic_write_text, sha256_file
from checkpointing.errors import CorruptCheckpointError
from checkpointing.trust import MANIFEST_MAX_BYTES, member_problem, name_problem, read_member

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _schema_problem(data: object) -> str | None:
    """What makes `data` something other than a manifest this package writes (None: it is one)."""
    if not isinstance(data, dict):
        return f"expected a JSON object, found {type(data).__name__}"
    known = {f.name for f in fields(Manifest)}
    unknown = sorted(set(data) - known)
    if unknown:
        return f"unknown field(s) {unknown[:5]}"
    if "iteration" not in data or "complete" not in data:
        return "'iteration' and 'complete' are required"
    for name, minimum in (("iteration", 0), ("world_size", 1), ("format", 1)):
        if name in data and not _is_int(data[name], minimum):
            return f"{name!r} must be an integer >= {minimum}, found {data[name]!r}"[:200]
    if data.get("state_layout", layout.FULL) not in layout.STATE_LAYOUTS:
        return f"'state_layout' must be one of {layout.STATE_LAYOUTS}"
    for name in ("complete", "pinned", "backup"):
        if name in data and not isinstance(data[name], bool):
            return f"{name!r} must be true or false"
    files = data.get("files", {})
    if not isinstance(files, dict):
        return "'files' must map file names to {size, sha256}"
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or set(entry) != {"size", "sha256"}
            or not _is_int(entry["size"], 0)
            or not isinstance(entry["sha256"], str)
            or not _SHA256_HEX.match(entry["sha256"])
        ):
            return f"the entry of {name!r} is not {{size: integer >= 0, sha256: 64 hex digits}}"[:200]
    return None


@dataclass
class Manifest:
    """Self-describing record of one generation."""

    iteration: int
    complete: bool
    world_size: int = 1
    pinned: bool = False  # in save_at_iters when written: retention never deletes it
    backup: bool = False  # hard-linked copy of ckpt_.pt kept only while ckpt_.pt is being overwritten
    files: dict[str, dict[str, int | str]] = field(default_factory=dict)  # name -> {"size", "sha256"}
    format: int = FORMAT_VERSION
    state_layout: str = layout.FULL  # manifests written before the sharded layout lack it: they are all full

    @classmethod
    def from_records(
        cls, iteration: int, records: list[FileRecord], world_size: int, pinned: bool, state_layout: str
    ) -> Manifest:
        files = {r.name: {"size": r.size, "sha256": r.sha256} for r in records}
        return cls(iteration, True, world_size, pinned, files=files, state_layout=state_layout)

    @property
    def total_bytes(self) -> int:
        return sum(int(entry["size"]) for entry in self.files.values())

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse a manifest through the bounded reader (trust.py); any deviation from the schema is refused."""
        raw = read_member(path.parent, path.name, MANIFEST_MAX_BYTES)
        if raw is None:
            raise CorruptCheckpointError(f"manifest {path} is missing")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"manifest {path} is not valid JSON ({type(e).__name__})") from e
        problem = _schema_problem(data)
        if problem is not None:
            raise CorruptCheckpointError(f"manifest {path} is malformed: {problem}")
        return cls(**data)

    def problems(self, directory: Path, marker: str, on_disk: list[str], verify: str) -> list[str]:
        """Why the files on disk are not exactly the generation this manifest records ([] when they are).

        The manifest must name only files of `marker`'s generation (a name elsewhere is reported, never
        stat'ed or hashed), every file the layout requires, and every file of the generation on disk
        (`on_disk`, from the directory listing); each must be a regular file inside `directory` whose
        size (and sha256, per `verify`) match the record.
        """
        if not self.complete:
            return ["its save was interrupted (manifest still marked incomplete)"]
        own_name = layout.sibling_name(marker, layout.MANIFEST)
        outside = [
            f"the manifest lists {name!r}, which is not a file of {marker}: "
            + (name_problem(name) or "another generation's name")
            for name in sorted(self.files)
            if name_problem(name) is not None or layout.generation_of(name) != marker or name == own_name
        ]
        if outside:
            return outside
        found = [
            f"{name} is required but the manifest does not list it"
            for name in layout.required_files(marker, self.state_layout, self.world_size, self.files)
            if name not in self.files
        ]
        found += [
            f"{name} is on disk but the manifest does not list it"
            for name in sorted(set(on_disk) - set(self.files) - {own_name})
        ]
        for name, entry in sorted(self.files.items()):
            problem = member_problem(directory, name)
            if problem is not None:
                found.append(problem)
                continue
            if verify == "none":
                continue
            size = (directory / name).stat().st_size
            if size != entry["size"]:
                found.append(
                    f"{name} has {size} bytes, the manifest recorded {entry['size']} (truncated or replaced)"
                )
            elif verify == "sha256" and sha256_file(directory / name) != entry["sha256"]:
                found.append(f"{name} does not match its recorded sha256 (corrupted on disk)")
        return found

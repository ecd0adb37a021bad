"""The per-generation manifest: the commit record that says which files make a generation, how big
they are and what they hash to.

It is written twice per save: first as `complete: false` before any file of the generation is
replaced (so an interrupted overwrite of `ckpt_.pt` is never mistaken for a good one), then as
`complete: true` after every file, EMA replicas included, is durable.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from checkpointing.atomic import FileRecord, atomic_write_text, sha256_file
from checkpointing.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


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

    @classmethod
    def from_records(
        cls, iteration: int, records: list[FileRecord], world_size: int, pinned: bool
    ) -> Manifest:
        files = {r.name: {"size": r.size, "sha256": r.sha256} for r in records}
        return cls(iteration=iteration, complete=True, world_size=world_size, pinned=pinned, files=files)

    @property
    def total_bytes(self) -> int:
        return sum(int(entry["size"]) for entry in self.files.values())

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            manifest = cls(**data)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
            raise CorruptCheckpointError(f"manifest {path} is unreadable ({e})") from e
        if not isinstance(manifest.files, dict) or not isinstance(manifest.iteration, int):
            raise CorruptCheckpointError(f"manifest {path} does not have the expected fields")
        return manifest

    def problems(self, directory: Path, verify: str) -> list[str]:
        """Why the files on disk are not the ones recorded ([] when they match, per `verify`)."""
        if not self.complete:
            return ["its save was interrupted (manifest still marked incomplete)"]
        found = []
        for name, entry in sorted(self.files.items()):
            path = directory / name
            if not path.is_file():
                found.append(f"{name} is missing")
                continue
            if verify == "none":
                continue
            size = path.stat().st_size
            if size != entry["size"]:
                found.append(
                    f"{name} has {size} bytes, the manifest recorded {entry['size']} (truncated or replaced)"
                )
            elif verify == "sha256" and sha256_file(path) != entry["sha256"]:
                found.append(f"{name} does not match its recorded sha256 (corrupted on disk)")
        return found

"""Configuration dataclasses, validated when built so a typo fails at start-up, not at the first save."""

from __future__ import annotations

import os
from dataclasses import dataclass

from checkpointing.layout import FULL, STATE_LAYOUTS

VERIFY_MODES = ("size", "sha256", "none")


@dataclass
class CheckpointConfig:
    """What to resume from, what to keep, and how hard to check files before trusting them.

    The first five fields keep the seed's names and meaning so existing job configs work unchanged.
    """

    load_path: str = ""  # weights or a marker to start from when the job has no checkpoint of its own
    load_training_state: bool = False  # with load_path: also restore iteration, optimizer, scheduler, RNG
    strict_resume: bool = True  # refuse weights with missing/unexpected keys or other shapes
    keep_last_checkpoints: int = 0  # > 0: numbered generations, keep the newest N; 0: overwrite ckpt_.pt
    save_at_iters: tuple[int, ...] = ()  # numbered generations that retention never deletes
    save_iter: int = 1000  # the trainer saves every save_iter iterations (see should_save)
    async_saving: bool = True  # False forces every save to block, whatever save() is asked
    verify: str = "size"  # before loading: "size" (torn/truncated/missing), "sha256" (+ bit rot), "none"
    trust_legacy_pickle: bool = False  # allow code-running pickles; only for files you wrote yourself
    disk_headroom: float = 1.1  # a save needs this many times its estimated bytes free on the disk
    replica_timeout_s: float = 1800.0  # how long ranks wait for each other while writing a generation
    # "full": rank 0 gathers and writes whole files (the seed's layout); "sharded": every rank writes its own
    # shards with torch.distributed.checkpoint, so a save's memory and time stay flat as the job grows.
    # A resume reads whichever layout a generation has, at any world size.
    state_layout: str = FULL

    def __post_init__(self) -> None:
        if not isinstance(self.load_path, str | os.PathLike):
            raise TypeError(f"CheckpointConfig.load_path must be a path string, got {self.load_path!r}")
        self.load_path = os.fspath(self.load_path)
        for name in ("load_training_state", "strict_resume", "async_saving", "trust_legacy_pickle"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.keep_last_checkpoints, int) or self.keep_last_checkpoints < 0:
            raise ValueError(
                f"CheckpointConfig.keep_last_checkpoints must be an integer >= 0, got {self.keep_last_checkpoints!r}"
            )
        if isinstance(self.save_at_iters, int) or not all(
            isinstance(i, int) and i >= 0 for i in self.save_at_iters
        ):
            raise ValueError(
                f"CheckpointConfig.save_at_iters must be a sequence of iterations >= 0, got {self.save_at_iters!r}"
            )
        self.save_at_iters = tuple(sorted(set(self.save_at_iters)))
        if not isinstance(self.save_iter, int) or self.save_iter <= 0:
            raise ValueError(f"CheckpointConfig.save_iter must be an integer > 0, got {self.save_iter!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"CheckpointConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.state_layout not in STATE_LAYOUTS:
            raise ValueError(
                f"CheckpointConfig.state_layout must be one of {STATE_LAYOUTS}, got {self.state_layout!r}"
            )
        if not self.disk_headroom >= 1.0:
            raise ValueError(f"CheckpointConfig.disk_headroom must be >= 1.0, got {self.disk_headroom!r}")
        if not self.replica_timeout_s > 0:
            raise ValueError(
                f"CheckpointConfig.replica_timeout_s must be > 0, got {self.replica_timeout_s!r}"
            )

    def should_save(self, iteration: int) -> bool:
        """True on every save_iter-th iteration and on each pinned iteration."""
        return iteration % self.save_iter == 0 or iteration in self.save_at_iters

    def is_numbered(self, iteration: int) -> bool:
        """Whether this iteration gets an iter_XXXXXXXXX.pt generation (else the overwritten ckpt_.pt)."""
        return self.keep_last_checkpoints > 0 or iteration in self.save_at_iters


@dataclass
class JobConfig:
    """Where a job lives. `path_local` wins; otherwise it is jobs/<project>/<group>/<name>."""

    project: str = "lidarverse"
    group: str = "default"
    name: str = "default"
    path_local: str = ""

    def __post_init__(self) -> None:
        for field in ("project", "group", "name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
                raise ValueError(f"JobConfig.{field} must be a non-empty name without '/', got {value!r}")
        if not isinstance(self.path_local, str | os.PathLike):
            raise TypeError(f"JobConfig.path_local must be a path string, got {self.path_local!r}")
        self.path_local = os.fspath(self.path_local) or os.path.join(
            "jobs", self.project, self.group, self.name
        )

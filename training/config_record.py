"""Which config made a job's checkpoints, and refusing to resume them with another one by accident.

Every checkpoint marker carries the resolved training config it was saved under (`ConfigRecorder`), and
`<job>/config.json` holds the job's current config. A launch that resumes a checkpoint with a config that
differs from the one the checkpoint was made with is refused, naming every field that differs, because a
silently changed learning rate, objective or architecture makes the run's history meaningless. A deliberate
change (`--allow-config-change`, e.g. a longer schedule) is allowed, and the replaced config is appended to
`<job>/config_history.jsonl` with the fields that changed and the iteration it applied from, so the job dir
still says how every checkpoint was made.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

from checkpointing import CheckpointError, resolve_generation
from checkpointing.atomic import atomic_write_text, fsync_file
from checkpointing.safe_load import safe_torch_load
from training.config import TrainConfig

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
HISTORY_NAME = "config_history.jsonl"
#: Marker entry holding the training config (a JSON string, so the marker still loads weights-only).
MARKER_KEY = "train_config"


class ConfigChangeError(ValueError):
    """A resume would continue a checkpoint under a config other than the one it was made with."""


class ConfigRecorder:
    """Checkpoint callback: writes the launch's config into every marker it saves."""

    def __init__(self, cfg: TrainConfig) -> None:
        self._json = cfg.to_json()

    def on_save_checkpoint(self, model: Any, state_dict: dict[str, Any]) -> None:
        state_dict[MARKER_KEY] = self._json


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """`field: old -> new` for every value that differs; nested dicts by dotted name."""
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return found


def _normalised(data: dict[str, Any]) -> dict[str, Any]:
    """The config as TrainConfig would write it, so fields added since (with defaults) are no difference."""
    try:
        return TrainConfig.from_dict(data).to_dict()
    except (TypeError, ValueError):  # a field since removed or renamed: compare what was written
        return data


def checkpoint_config(job_dir: Path) -> tuple[int, dict[str, Any] | None] | None:
    """(iteration, config) of the checkpoint a launch would resume, None for a job with no checkpoint.

    The config comes from the marker; checkpoints saved before markers carried it fall back to the job's
    config.json, and to None when the job has no record at all (checkpoints copied from another job).
    """
    checkpoints = job_dir / "checkpoints"
    if not checkpoints.is_dir():
        return None
    try:
        resolution = resolve_generation(checkpoints)
    except CheckpointError:
        return None  # nothing resumable: the checkpointer reports any broken generation itself
    iteration = int(resolution.generation.iteration or 0)
    recorded = safe_torch_load(resolution.marker_path).get(MARKER_KEY)
    if recorded is not None:
        return iteration, json.loads(recorded)
    if (job_dir / CONFIG_NAME).is_file():
        return iteration, json.loads((job_dir / CONFIG_NAME).read_text())
    return iteration, None


def check_resume_config(job_dir: Path, cfg: TrainConfig, allow_change: bool) -> tuple[int, list[str]]:
    """Refuse a resume whose config differs from its checkpoint's unless `allow_change`.

    Returns (iteration resumed, the differences accepted). Reads only files, so every rank gets the same
    answer before any collective starts.
    """
    found = checkpoint_config(job_dir)
    if found is None:
        return 0, []
    iteration, recorded = found
    if recorded is None:
        changes = [f"(no record of the config that made the checkpoint at iteration {iteration})"]
    else:
        changes = config_differences(_normalised(recorded), cfg.to_dict())
    if changes and not allow_change:
        raise ConfigChangeError(
            f"{job_dir} resumes the checkpoint at iteration {iteration}, made with another config: "
            + "; ".join(changes)
            + ". Launch with that job's config, or pass --allow-config-change if the change is deliberate "
            "(e.g. a longer schedule); the replaced config is kept in " + HISTORY_NAME
        )
    return iteration, changes


def record_config(job_dir: Path, cfg: TrainConfig, iteration: int, changes: list[str]) -> None:
    """Write `<job>/config.json`, first appending a config it replaces to the history (rank 0 only).

    `changes` are the differences check_resume_config accepted for the checkpoint at `iteration`.
    """
    if changes:
        logger.warning("resuming iteration %d with a deliberately changed config: %s", iteration, "; ".join(changes))
    path = job_dir / CONFIG_NAME
    text = cfg.to_json()
    previous = path.read_text() if path.is_file() else None
    if previous == text:
        return
    if previous is not None:
        entry = {
            "replaced_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "from_iteration": iteration,
            "changed": changes or config_differences(_normalised(json.loads(previous)), cfg.to_dict()),
            "config": json.loads(previous),
        }
        history = job_dir / HISTORY_NAME
        with open(history, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        fsync_file(history)
        logger.info("kept the replaced config of %s in %s", job_dir, history)
    atomic_write_text(path, text)

"""The training job's configuration: one JSON file, one dataclass, checked before any process starts work.

A bad value fails in `__post_init__` with the field's name and what was expected, so a typo in a config
costs seconds instead of a queued GPU job (torchtitan's habit). The resolved config is written into the
job dir, so a checkpoint folder always says how it was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from checkpointing.layout import STATE_LAYOUTS

#: `TrainConfig.checkpoint_layout` value that picks the sharded layout above one rank, the full one on one.
AUTO_LAYOUT = "auto"


@dataclass
class AugmentConfig:
    """How the ground-truth cache is corrupted (`inference.conditioning.augment_cache_points`) so the model
    tolerates its own rollout errors. The empty-cache and dropped-map probabilities belong to the model
    config (`p_drop_cache`, `p_drop_map`), since rollout's guidance depends on them."""

    #: Fraction of cached points removed at random.
    dropout: float = 0.2
    #: Std of each cached point's displacement along its ray (metres).
    range_noise: float = 0.05
    #: Std of the translation of the whole cache's rigid pose error (metres). The size of a registration's
    #: error (KISS-ICP on real sweeps, `lidar.registration`); rollout's own poses are exact. At the former
    #: 0.1 m and 0.5 deg, a grazing ground ray's cached range moved by metres.
    jitter_translation: float = 0.03
    #: Std of the rotation of the whole cache's rigid pose error (degrees).
    jitter_rotation_deg: float = 0.1
    #: Fraction of the layout's actors left out (missed detections).
    layout_missing: float = 0.1
    #: Probability that the layout is 1-3 frames old (moving actors stale).
    layout_stale: float = 0.2
    #: Std of each box centre's displacement (metres).
    layout_center_noise: float = 0.1
    #: Probability that the cache comes from a sensor with a narrower vertical field of view than the model's
    #: (`training.data.FOV_TOP_DEG`, `FOV_BOTTOM_DEG`): a KITTI HDL-64E stops at +2 deg, a VLP-16 at +-15.
    #: Forecasting from such a sweep leaves the model's upper rows uncached; trained on full caches only, the
    #: model filled that band, and the cached rows next to it, with facades the real scene did not hold.
    fov_crop: float = 0.0
    #: Probability that the cache ends 1..`FORECAST_FRAMES` frames before the target instead of at the frame
    #: before it: what a forecast from observed sweeps conditions on at its horizons. Trained only on caches
    #: that end one frame back, the model drew far returns through the walls a real forecast had not yet
    #: seen in full (KITTI 00 at 1.0 s: 60-70 such points made 86-90 % of the squared Chamfer).
    forecast_gap: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dropout", "layout_missing", "layout_stale", "fov_crop", "forecast_gap"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"augment.{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("range_noise", "jitter_translation", "jitter_rotation_deg", "layout_center_noise"):
            value = getattr(self, name)
            if not 0.0 <= value < 10.0:
                raise ValueError(f"augment.{name} must be in [0, 10), got {value!r}")


@dataclass
class TrainConfig:
    """Everything a run needs besides the job dir. Field docs are one line each; units are in the name."""

    #: `inference.network.WorldModelConfig.to_dict()` of the network to train (team model's schema).
    model: dict[str, Any]
    #: Dataset folder written by `python -m lidar.sim ... --out DIR` (relative to the working directory); ""
    #: trains on `recordings` alone.
    data_root: str
    #: More simulated datasets, each at its own sensor and width (`python -m lidar.sim --sensor S --width W`):
    #: the network learns every beam table they hold at its native grid. Each batch comes from one of them.
    data_roots: tuple[str, ...] = ()
    #: Azimuth crops of about this many pixels (beams x columns) are cut from the full rings of `data_roots`
    #: (0: full rings): the step's cost stays flat whatever the sensor, and the angular resolution is native.
    crop_pixels: int = 0
    #: Samples per rank per step.
    batch_size: int = 8
    #: Peak learning rate of AdamW.
    lr: float = 1e-3
    #: AdamW weight decay.
    weight_decay: float = 0.01
    #: AdamW betas.
    betas: tuple[float, float] = (0.9, 0.99)
    #: Global gradient-norm clip; 0 disables it.
    grad_clip: float = 1.0
    #: Steps of linear warm-up from 0 to `lr`.
    warmup_iters: int = 200
    #: Total optimiser steps; the cosine schedule ends here at `min_lr_ratio * lr`.
    max_iters: int = 5000
    #: Final learning rate as a fraction of `lr`.
    min_lr_ratio: float = 0.05
    #: EMA decay per step (the released weights are the EMA).
    ema_decay: float = 0.999
    #: Steps before the EMA starts tracking (it copies the weights until then).
    ema_start_iter: int = 100
    #: Save a checkpoint every this many steps.
    save_iter: int = 500
    #: Ordinary checkpoint generations to keep (0: overwrite one `ckpt_` generation).
    keep_last_checkpoints: int = 2
    #: Steps whose checkpoints are kept forever.
    save_at_iters: tuple[int, ...] = ()
    #: Checkpoint layout: "full" (rank 0 gathers and writes whole files), "sharded" (every rank writes its own
    #: shards, so a save's memory and time stay flat as the job grows) or "auto": sharded above one rank. A
    #: resume reads either layout at any world size.
    checkpoint_layout: str = AUTO_LAYOUT
    #: Log loss and samples/s every this many steps.
    log_iter: int = 20
    #: Seed of weights init, sample order and augmentation (each rank derives its own stream).
    seed: int = 0
    #: Previous ground-truth frames merged into the training cache.
    cache_frames: int = 4
    #: DataLoader worker processes per rank (0: build batches in the training process).
    num_workers: int = 1
    #: torch intra-op threads per rank on CPU.
    torch_threads: int = 2
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    #: Recorded drives (`lidar.sequence.open_recording` folders: KITTI odometry layout, sweeps with a poses
    #: file, or bare sweeps, then registered on load), trained on with no map and no layout.
    recordings: tuple[str, ...] = ()
    #: Share of samples drawn from `recordings` when `data_root` is given too.
    recording_fraction: float = 0.5
    #: Weights a new job starts from ("" = random init): a release folder, weights file, job dir or Hub id,
    #: to fine-tune a release on new data. A job that resumes from its own checkpoint ignores it.
    init_from: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.augment, dict):
            self.augment = _from_dict(AugmentConfig, self.augment, "augment.")
        self.betas = tuple(self.betas)  # JSON gives lists
        self.save_at_iters = tuple(int(i) for i in self.save_at_iters)
        if not isinstance(self.model, dict) or not self.model:
            raise ValueError(f"model must be a non-empty WorldModelConfig dict, got {self.model!r}")
        from inference.network import WorldModelConfig

        try:
            WorldModelConfig.from_dict(self.model)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"model: not a valid WorldModelConfig ({exc})") from exc
        if not isinstance(self.init_from, str):
            raise ValueError(f"init_from must be a model source string ('' for random init), got {self.init_from!r}")
        self.recordings = tuple(self.recordings)
        self.data_roots = tuple(self.data_roots)
        if not isinstance(self.data_root, str) or not all(
            isinstance(r, str) and r for r in (*self.recordings, *self.data_roots)
        ):
            raise ValueError(f"data_root must be a folder path, and data_roots and recordings folder paths; got "
                             f"{self.data_root!r}, {self.data_roots!r} and {self.recordings!r}")
        if not self.data_root and not self.data_roots and not self.recordings:
            raise ValueError("no training data: give data_root or data_roots (simulated datasets), recordings, or both")
        if isinstance(self.crop_pixels, bool) or not isinstance(self.crop_pixels, int) or self.crop_pixels < 0:
            raise ValueError(f"crop_pixels must be an integer >= 0 (0: full rings), got {self.crop_pixels!r}")
        if not 0.0 <= self.recording_fraction <= 1.0:
            raise ValueError(f"recording_fraction must be in [0, 1], got {self.recording_fraction!r}")
        positive_ints = ("batch_size", "max_iters", "save_iter", "log_iter", "cache_frames", "torch_threads")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("warmup_iters", "keep_last_checkpoints", "num_workers", "ema_start_iter", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.warmup_iters >= self.max_iters:
            raise ValueError(f"warmup_iters ({self.warmup_iters}) must be smaller than max_iters ({self.max_iters})")
        if not 0.0 < self.lr < 1.0:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if not 0.0 <= self.weight_decay < 1.0:
            raise ValueError(f"weight_decay must be in [0, 1), got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip < 0.0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables it), got {self.grad_clip!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay!r}")
        if self.checkpoint_layout not in (AUTO_LAYOUT, *STATE_LAYOUTS):
            raise ValueError(
                f"checkpoint_layout must be one of {(AUTO_LAYOUT, *STATE_LAYOUTS)}, got {self.checkpoint_layout!r}"
            )
        if any(i < 1 for i in self.save_at_iters):
            raise ValueError(f"save_at_iters must hold positive iterations, got {self.save_at_iters!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, data, "")

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist; expected a JSON training config") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        out["save_at_iters"] = list(self.save_at_iters)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Build a config dataclass, naming unknown or missing fields instead of a bare TypeError."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config field(s) {[prefix + u for u in unknown]}; expected some of {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"config {prefix or cls.__name__}: {exc}") from None

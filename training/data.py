"""Training samples: (target image, condition) pairs cut from simulated drives, exactly as rollout sees them.

The target is one frame's range image in the network's encoding. The condition is built with
`inference.conditioning.build_condition`, whose two halves rollout calls in turn, from a cache of the previous
ground-truth frames: each is unprojected like a generated frame, corrupted like a model's own errors
(`augment_cache_points`) and merged through a `SpatialCache`; from the drive's HD map ray-cast at the
frame's pose; and from the actor boxes of the frame, with some missing, shifted or stale
(`augment_layout`), so the model does not trust the layout blindly. With the model config's probabilities
the cache is emptied (a rollout's first frame), the map dropped (free generation, the CFG branch) or the
layout dropped (real-data forecasting).

Every batch is a pure function of (seed, iteration, rank): a resumed job sees the batches it would have
seen, and no two ranks or workers share a random stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from inference.cache import SpatialCache
from inference.conditioning import (
    LayoutView,
    augment_cache_points,
    augment_layout,
    build_condition,
    encode_image,
    layout_view,
)
from inference.network import WorldModelConfig
from lidar.range_image import RangeImage, elevation_span, project, unproject
from lidar.registration import register_sweeps
from lidar.sensors import Sensor
from lidar.sequence import open_recording
from lidar.sim.dataset import SimDataset
from lidar.sim.hdmap import HDMap
from lidar.vocabulary import transform_points
from training.config import TrainConfig

logger = logging.getLogger(__name__)

#: Top and bottom beam elevations (deg) a cropped cache's sensor is drawn between (`AugmentConfig.fov_crop`):
#: from a KITTI HDL-64E's +2 / -24.9 and a VLP-16's +-15 to the model sensor's own.
FOV_TOP_DEG = (0.0, 11.0)
FOV_BOTTOM_DEG = (-31.0, -15.0)
#: The margin (rad) a model beam may lie beyond a recording's field of view and still count as seen (half a
#: beam spacing of a 32-beam sensor).
BEAM_MARGIN = np.radians(0.67)
#: Longest forecast horizon a training cache is aged by (`AugmentConfig.forecast_gap`): 1.0 s at 10 Hz.
FORECAST_FRAMES = 10


@dataclass
class Drive:
    """One drive at one sensor, simulated or recorded: what a training sample is cut from."""

    #: The grid of its range images, at the model's range encoding (`max_range`).
    sensor: Sensor
    range: np.ndarray  # (T, H, W) float32 metres, 0 = no return
    intensity: np.ndarray  # (T, H, W) float32 in [0, 1]
    poses: np.ndarray  # (T, 4, 4) float64 world_from_sensor
    #: The HD map and the actors' boxes; None for a recorded drive, which has neither.
    hdmap: HDMap | None
    boxes: np.ndarray | None  # (B, 7) float32 world boxes of every frame
    box_class: np.ndarray | None  # (B,) OBJECT_CLASSES index
    box_frame: np.ndarray | None  # (B,) frame of each box
    #: (H,) rows the recording's sensor covers: outside them its sweeps say nothing, so the loss skips them.
    rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.range)

    def image(self, t: int) -> RangeImage:
        return RangeImage(self.range[t], self.intensity[t])

    def frame_boxes(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        at = self.box_frame == t
        return self.boxes[at], self.box_class[at]


def load_drives(root: str, sensor: Sensor, native: bool = False) -> list[Drive]:
    """Every sequence of a `python -m lidar.sim --out ROOT` dataset: at the model sensor's grid, or with
    `native` at the dataset's own (its returns beyond the model's `max_range` dropped, as the encoding would
    clip them onto it)."""
    start = time.perf_counter()
    dataset = SimDataset(root, cache_size=1)
    if native:
        grid = replace(dataset.sensor, max_range=sensor.max_range)
    elif dataset.sensor.shape != sensor.shape or dataset.sensor.max_range != sensor.max_range:
        raise ValueError(
            f"dataset {root} was simulated for sensor {dataset.sensor.name} {dataset.sensor.shape} (max range "
            f"{dataset.sensor.max_range} m) but the model expects {sensor.name} {sensor.shape} (max range "
            f"{sensor.max_range} m); regenerate it with `python -m lidar.sim --sensor/--width` matching the model, "
            "or list it in data_roots"
        )
    else:
        grid = sensor
    drives = []
    for i in range(len(dataset.manifest["sequences"])):
        a = dataset.load_sequence(i)
        beyond = a["range"] > grid.max_range
        drives.append(Drive(grid, np.where(beyond, 0.0, a["range"]).astype(np.float32),
                            np.where(beyond, 0.0, a["intensity"]).astype(np.float32), a["poses"],
                            HDMap.from_dict(a), a["boxes"], a["box_class"], a["box_frame"]))
    logger.info("loaded %d drives (%d frames) from %s in %.1fs", len(drives), sum(len(d) for d in drives), root,
                time.perf_counter() - start)
    return drives


def load_recordings(folders: tuple[str, ...], sensor: Sensor) -> list[Drive]:
    """Recorded drives projected onto the model sensor's grid, posed by their poses file or by KISS-ICP.

    A recording's sensor may differ from the model's (a KITTI HDL-64E for an HDL-32E model): its sweeps are
    z-buffered onto the model's beams, and the rows beyond its vertical field of view are marked unseen.
    """
    drives = []
    for folder in folders:
        start = time.perf_counter()
        rec = open_recording(folder)
        poses = rec.poses if rec.poses is not None else register_sweeps(rec, names=rec.names).poses
        images, spans = [], []
        for scan in rec:  # one sweep in memory at a time: only its range image stays
            images.append(project(scan.points, sensor))
            spans.append(elevation_span(scan.points))
        low, high = np.median(spans, axis=0)  # one sensor: the same field of view in every sweep
        rows = (sensor.elevations >= low - BEAM_MARGIN) & (sensor.elevations <= high + BEAM_MARGIN)
        drives.append(Drive(sensor, np.stack([im.range for im in images]),
                            np.stack([im.intensity for im in images]), np.asarray(poses), None, None, None, None,
                            rows))
        logger.info("loaded the recording %s (%d sweeps, %d of %d rows seen) in %.1fs", folder, len(rec),
                    rows.sum(), sensor.height, time.perf_counter() - start)
    return drives


class WorldModelSamples(Dataset):
    """Indexed by (iteration, rank, slot); the key alone decides the frame and every augmentation draw.

    Drives come in groups of one sensor (the model's simulated set, each of `data_roots`, the recordings);
    one batch is drawn from one group, so its images share a shape. With `crop_pixels` every sample of a
    `data_roots` group is an azimuth window of its full ring (`crop`), placed at random.
    """

    def __init__(self, drives: list[Drive], cfg: TrainConfig, recorded: list[Drive] | None = None,
                 native: list[list[Drive]] | None = None) -> None:
        recorded, native = recorded or [], [group for group in native or [] if group]
        if not drives and not recorded and not native:
            raise ValueError(f"no drives found in {cfg.data_root or cfg.data_roots or cfg.recordings}; expected a "
                             "`python -m lidar.sim --out` dataset or recorded sequences")
        self.cfg = cfg
        self.model_cfg = WorldModelConfig.from_dict(cfg.model)
        self.drives: list[Drive] = []
        #: (drive, frame) pools of the simulated groups and of the recorded one, drawn from at
        #: `recording_fraction`.
        self.simulated = [self._pool(group) for group in ([drives] if drives else []) + native]
        self.recorded = self._pool(recorded) if recorded else []
        self.share = cfg.recording_fraction if self.simulated and recorded else float(bool(recorded))
        self.cropped = {id(drive) for group in native for drive in group} if cfg.crop_pixels else set()

    def _pool(self, group: list[Drive]) -> list[tuple[int, int]]:
        first = len(self.drives)
        self.drives.extend(group)
        return [(first + d, t) for d, drive in enumerate(group) for t in range(len(drive))]

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.simulated) + len(self.recorded)

    def batch_pool(self, iteration: int, rank: int) -> list[tuple[int, int]]:
        """The pool every sample of a batch comes from: a function of (seed, iteration, rank) alone."""
        rng = np.random.default_rng([self.cfg.seed, iteration, rank, 0xBA7C4])
        if self.share and (self.share == 1 or rng.random() < self.share):
            return self.recorded
        return self.simulated[int(rng.integers(len(self.simulated)))]

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        pool = self.batch_pool(key[0], key[1])
        rng = np.random.default_rng([self.cfg.seed, *key])
        drive_idx, t = pool[int(rng.integers(len(pool)))]
        drive = self.drives[drive_idx]
        sensor = drive.sensor
        x = encode_image(drive.image(t), sensor)
        pose = drive.poses[t]
        cache = None if rng.random() < self.model_cfg.p_drop_cache else self.cache_before(drive, t, rng)
        if drive.hdmap is None:  # a recording: no map, no layout, and rows its sensor never covered
            cond = build_condition(cache, pose, None, None, sensor, self.model_cfg.num_map_classes)
            seen = np.broadcast_to(drive.rows[:, None], sensor.shape).astype(np.float32)
        else:
            map_view = None if rng.random() < self.model_cfg.p_drop_map else drive.hdmap.range_view(pose, sensor)
            layout = None if rng.random() < self.model_cfg.p_drop_layout else self.layout_at(drive, t, rng)
            cond = build_condition(cache, pose, map_view, layout, sensor, self.model_cfg.num_map_classes)
            seen = np.ones(sensor.shape, dtype=np.float32)
        sample = {"x": x, "cond": np.asarray(cond), "seen": seen}
        if id(drive) in self.cropped:
            sample = crop(sample, crop_columns(sensor, self.cfg.crop_pixels), rng)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sample.items()}

    def layout_at(self, drive: Drive, t: int, rng: np.random.Generator) -> LayoutView:
        """Frame t's boxes as a rollout would get them: sometimes a few frames stale, some missing, all a bit off."""
        aug = self.cfg.augment
        source = t - int(rng.integers(1, 4)) if t > 0 and rng.random() < aug.layout_stale else t
        boxes, classes = augment_layout(*drive.frame_boxes(max(source, 0)), rng, aug.layout_missing,
                                        aug.layout_center_noise)
        return layout_view(boxes, classes, drive.poses[t], drive.sensor)

    def cache_before(self, drive: Drive, t: int, rng: np.random.Generator) -> np.ndarray | None:
        """World points of 1..cache_frames frames before t, each with its own simulated rollout error; they end
        at frame t - 1, or with `forecast_gap` at a forecast's horizon before t.

        Frames go into the `SpatialCache` newest first in one `add`, which keeps the same point per voxel
        as adding them one by one in time order (the newest wins) at a fraction of the cost.
        """
        if t == 0:
            return None
        aug, sensor = self.cfg.augment, drive.sensor
        newest = t - 1
        if aug.forecast_gap > 0 and rng.random() < aug.forecast_gap:  # a forecast's horizon behind the target
            newest = t - int(rng.integers(1, min(t, FORECAST_FRAMES) + 1))
        first = newest + 1 - int(rng.integers(1, min(newest + 1, self.cfg.cache_frames) + 1))
        beams = np.ones(sensor.height, dtype=bool)
        if aug.fov_crop > 0 and rng.random() < aug.fov_crop:  # one narrower sensor saw every cached frame
            elevations = np.degrees(sensor.elevations)
            beams = (elevations <= rng.uniform(*FOV_TOP_DEG)) & (elevations >= rng.uniform(*FOV_BOTTOM_DEG))
        frames = []
        for j in range(newest, first - 1, -1):
            image = drive.image(j)
            seen = RangeImage(np.where(beams[:, None], image.range, 0.0).astype(np.float32), image.intensity)
            world = transform_points(unproject(seen, sensor), drive.poses[j])
            frames.append(augment_cache_points(
                world, drive.poses[j], rng, dropout=aug.dropout, range_noise=aug.range_noise,
                jitter_translation=aug.jitter_translation, jitter_rotation_deg=aug.jitter_rotation_deg,
            ))
        cache = SpatialCache()
        cache.add(np.concatenate(frames), drive.poses[newest], observed=True)
        return cache.points()


def crop_columns(sensor: Sensor, pixels: int) -> int:
    """Columns of an azimuth crop of about `pixels` pixels of `sensor`'s image: a multiple of the shipped
    network's total width stride (8), at least 64 columns, at most the whole ring."""
    return int(min(sensor.width, max(64, pixels // sensor.height // 8 * 8)))


def crop(sample: dict[str, np.ndarray], columns: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every (..., H, W) array of a sample cut to the same `columns`-wide azimuth window, wrapping around the
    ring; the condition's own azimuth channels say where the window looks, so the network pads its edges
    with zeros rather than around the ring (`inference.network.full_ring`)."""
    width = sample["x"].shape[-1]
    if columns >= width:
        return sample
    window = (int(rng.integers(width)) + np.arange(columns)) % width
    return {k: np.take(v, window, axis=-1) for k, v in sample.items()}


class StepBatches(Sampler[list[tuple[int, int, int]]]):
    """Batch keys for iterations start..max_iters-1 of one rank: resuming at N yields exactly N's batch."""

    def __init__(self, start_iter: int, max_iters: int, batch_size: int, rank: int) -> None:
        self.start_iter, self.max_iters, self.batch_size, self.rank = start_iter, max_iters, batch_size, rank

    def __len__(self) -> int:
        return max(0, self.max_iters - self.start_iter)

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        for it in range(self.start_iter, self.max_iters):
            yield [(it, self.rank, k) for k in range(self.batch_size)]


def make_loader(cfg: TrainConfig, rank: int, start_iter: int) -> DataLoader:
    """The rank's batches from `start_iter` on; workers are torch threads-limited so ranks share CPUs fairly."""
    sensor = WorldModelConfig.from_dict(cfg.model).sensor_obj
    simulated = load_drives(cfg.data_root, sensor) if cfg.data_root else []
    native = [load_drives(root, sensor, native=True) for root in cfg.data_roots]
    samples = WorldModelSamples(simulated, cfg, load_recordings(cfg.recordings, sensor), native)
    return DataLoader(
        samples,
        batch_sampler=StepBatches(start_iter, cfg.max_iters, cfg.batch_size, rank),
        num_workers=cfg.num_workers,
        worker_init_fn=_one_thread if cfg.num_workers else None,
        persistent_workers=False,
        prefetch_factor=2 if cfg.num_workers else None,
    )


def _one_thread(_worker_id: int) -> None:
    torch.set_num_threads(1)

"""Score a model against the ground truth of the same poses: `python -m training.evaluate --model SRC [--json] [--quick]`.

Protocol, everything measured in the same run:
1. Held-out drives are sequences of a `lidar.sim` dataset with seed `EVAL_SEED`; their worlds are checked to
   be disjoint from the training dataset's. Frame 0 of each drive is observed; frames 1..10 (10 Hz) are the
   targets, so the horizons 0.5 s and 1.0 s are frames 5 and 10.
2. Methods, all on the same drives and poses:
   - "model (forecast)": `pipe.forecast` from frame 0 along the drive's poses, conditioned on the drive's
     `World` (HD map and actor layout); "model (generate)": `pipe.generate_world` on the same World with
     nothing observed;
   - "cache-only" (the ray-tracing baseline of 4D occupancy forecasting): frame 0 moved to each target pose
     and z-buffered onto the sensor's grid, holes left empty; "map-only": the map's ground under every ray;
   - "noise floor": the same world, poses and times simulated again with another sensor-noise seed, i.e.
     the best any method can do against one noisy ground truth.
3. Per-ray forecasting metrics (Khurana et al. 2023, also Copilot4D; `lidar.metrics.per_ray_errors` and
   `forecast_chamfer`): each frame is projected onto the model sensor's grid; per ground-truth ray that
   returns where the method also returns, L1 depth (mean, median) and AbsRel, with that coverage beside them;
   return-mask IoU; Chamfer in m^2 within +-70 m x/y, +-4.5 m z. Values are per (drive, frame), averaged
   over drives: the JSON keeps the per-frame curves, the tables show 0.5 s, 1.0 s and the mean over frames
   1..10. **The bars use the mean over frames 1..10**: Khurana's "1 s" results average every forecast frame
   within the horizon, and the mean is steadier than one frame in small runs.
4. Real data: KITTI seq 00 sweeps 000000, 000002, 000004 (`lidar.real_scans_dir()`), registered with
   KISS-ICP (`lidar.registration`); for the pairs 0->2, 2->4, 0->4 the model forecasts the second sweep
   from the first at the registered pose (no map; its frame on the first sweep's own measured grid), beside
   the first sweep moved to that pose, every point of it. Both are scored against the second sweep as the
   sensor took it, at full resolution (`training.sweep_scores`, as `training.evaluate_real` scores recorded
   drives): squared Chamfer in the 4D-Occ region, per-ray L1 and AbsRel along the truth's rays on the rays
   both return on, coverage of the truth's rays and points / the truth's, each method within the truth's
   vertical field of view (KITTI's beams stop at +2 deg). Missing scans or a failed registration skip this
   part, logged.
5. Distribution metrics: BEV JSD / MMD (`lidar.metrics`) of each method's frames against the held-out
   frames; the sim-vs-sim floor compares a second, disjoint simulated set (seed `FLOOR_SEED`).
   Temporal consistency: Chamfer (m) between consecutive frames after ego-motion compensation, against the
   ground truth's. Map adherence: of the returns at or below 0.5 m above the map's ground, the fraction
   lying on the ground (within 0.25 m) of a surface class (not "none", not "building").
6. Bars: the release's limits and goals (`bars`), every ratio taken within this run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from inference import ModelSourceError, load_pipeline
from inference.pipeline import LidarVersePipeline
from lidar.errors import InputError
from lidar.formats import Scan, read_points
from lidar.metrics import bev_jsd, bev_mmd, chamfer_distance, forecast_chamfer, per_ray_errors
from lidar.range_image import RangeImage, elevation_span, project, unproject
from lidar.ray_grid import field_of_view, in_field_of_view
from lidar.real_scans import real_scans_dir
from lidar.registration import RegistrationError, register_sweeps
from lidar.render import bev_image, labelled, range_image_png
from lidar.sensors import Sensor
from lidar.sim.dataset import MANIFEST, SIMULATOR_VERSION, SimDataset, write_dataset
from lidar.sim.hdmap import HDMap
from lidar.sim.sequence import simulate_sequence
from lidar.sim.world import World, make_world
from lidar.vocabulary import FRAME_RATE_HZ, MAP_CLASS_INDEX, transform_points
from training.sweep_scores import COLUMNS, sweep_scores

logger = logging.getLogger(__name__)

#: Dataset seeds of the held-out drives and of the second simulated set; training uses seed 0.
EVAL_SEED = 100_000
FLOOR_SEED = 200_000
#: Ground tolerance (m) of map adherence, and the height below which a return counts as near the ground.
GROUND_TOLERANCE = 0.25
NEAR_GROUND = 0.5
NOT_SURFACE = (MAP_CLASS_INDEX["none"], MAP_CLASS_INDEX["building"])
#: Reported horizons (label -> target frame at 10 Hz) and the span the bars average over.
HORIZONS = {"0.5 s": 5, "1.0 s": 10}
BAR_SPAN = "frames 1-10"
#: The frames the bar span averages: the first, up to the longest horizon.
BAR_FRAMES = max(HORIZONS.values())
#: Most held-out drives the markdown report lists one by one.
DRIVE_COLUMNS = 16
#: Per-ray metrics: key in the JSON -> table header (arrow: which way is better).
PER_RAY = {"chamfer": "Chamfer (m²) ↓", "l1_mean": "L1 mean (m) ↓", "l1_median": "L1 median (m) ↓",
           "absrel": "AbsRel ↓", "iou": "return IoU ↑", "coverage": "coverage"}
#: The shared KITTI seq 00 sweeps (10 Hz, so the frame numbers are tenths of a second) and the scored pairs.
KITTI_SWEEPS = ("kitti_patchworkpp_000000.bin", "kitti_patchworkpp_000002.bin", "kitti_patchworkpp_000004.bin")
KITTI_FRAMES = (0, 2, 4)
KITTI_PAIRS = ((0, 1), (1, 2), (0, 2))
#: The pair drawn in the KITTI picture: 000000 -> 000004.
KITTI_PICTURE_PAIR = (0, 2)
#: BEV pictures: half-width (m), metres per pixel, label strip (px) and the pinned height colour scale (m).
PICTURE_EXTENT = 50.0
PICTURE_RESOLUTION = 0.2
PICTURE_LABEL = 28
PICTURE_HEIGHTS = (-2.5, 2.0)
#: What every sensor the model was trained on is held to on its own simulated drives (Chamfer ÷ cache-only's).
SENSOR_BARS = {"forecast": 0.4, "generate": 1.0}
SIM_PICTURE = "eval_sim_bev.png"
SIM_RANGE_PICTURE = "eval_sim_range.png"
#: Rows a range-image picture has at most: each beam is repeated until then (16 beams 8 times, 128 once).
RANGE_PICTURE_ROWS = 128
KITTI_PICTURE = "eval_kitti_bev.png"
#: The training config whose dataset the held-out drives are checked against by default.
DEFAULT_TRAIN_CONFIG = Path(__file__).resolve().parent / "configs" / "default.json"

MODEL_FORECAST = "model (forecast)"
MODEL_GENERATE = "model (generate)"
CACHE_ONLY = "cache-only"
MAP_ONLY = "map-only"
NOISE_FLOOR = "noise floor"
MOVED_FIRST = "moved first sweep"
GROUND_TRUTH = "ground truth"
FLOOR = "sim-vs-sim floor"


@dataclass
class EvalConfig:
    """Sizes of one evaluation; the defaults are the release protocol, `quick()` the CI smoke test."""

    #: Held-out drives (one rollout each) and the size of the floor set.
    rollouts: int = 64
    #: Target frames per drive after the observed frame 0; at least the last horizon's frame (10).
    frames: int = max(HORIZONS.values())
    #: Sampler steps and guidance; None takes the model config's defaults.
    steps: int | None = None
    guidance: float | None = None
    #: Where reference datasets are kept between runs (generated there when missing).
    data_dir: str = "data/eval"
    #: Training dataset whose world seeds must not appear among the held-out ones ("" skips the check).
    train_data: str = ""
    #: Processes for simulating missing reference sets.
    workers: int = 2
    #: Also generate with nothing observed ("model (generate)"); doubles the model's share of the run.
    free_generation: bool = True
    #: Score the KITTI pairs (skipped with a logged reason when the shared scans are absent).
    real: bool = True
    #: The drives' sensor: a preset name at `columns` azimuth bins; None takes the model's own grid.
    sensor: str | None = None
    columns: int | None = None

    def __post_init__(self) -> None:
        if self.rollouts < 2:
            raise ValueError(f"rollouts must be >= 2 (MMD needs a set), got {self.rollouts}")
        if self.frames < max(HORIZONS.values()):
            raise ValueError(f"frames must be >= {max(HORIZONS.values())} (the 1.0 s horizon), got {self.frames}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @classmethod
    def quick(cls, data_dir: str) -> EvalConfig:
        return cls(rollouts=2, data_dir=data_dir, workers=1)


def reference_set(cfg: EvalConfig, name: str, seed: int, sensor: Sensor) -> SimDataset:
    """A simulated set for this protocol, reused from `data_dir` (its first `rollouts` drives) or simulated now."""
    path = Path(cfg.data_dir) / f"{name}_s{seed}_f{cfg.frames + 1}_{sensor.name}x{sensor.width}"
    manifest = path / MANIFEST
    if not manifest.is_file() or _stale(json.loads(manifest.read_text()), cfg.rollouts):
        start = time.perf_counter()
        write_dataset(path, sensor, cfg.rollouts, cfg.frames + 1, seed=seed, workers=cfg.workers)
        logger.info("simulated %s in %.1fs", path, time.perf_counter() - start)
    dataset = SimDataset(path, cache_size=1)
    if dataset.sensor != sensor:
        raise ValueError(f"reference set {path} is for sensor {dataset.sensor.name} {dataset.sensor.shape}, "
                         f"the model for {sensor.name} {sensor.shape}; delete it to regenerate")
    return dataset


def _stale(manifest: dict[str, Any], rollouts: int) -> bool:
    """Too few drives, or simulated by another simulator version (manifests before versions were version 1)."""
    return len(manifest["sequences"]) < rollouts or manifest.get("simulator", 1) != SIMULATOR_VERSION


def check_disjoint(heldout: SimDataset, train_data: str) -> None:
    if not train_data:
        return
    path = Path(train_data) / MANIFEST
    if not path.is_file():
        logger.warning("training manifest %s not found; held-out worlds not checked for overlap", path)
        return
    train = {s["world_seed"] for s in json.loads(path.read_text())["sequences"]}
    shared = train & {s["world_seed"] for s in heldout.manifest["sequences"]}
    if shared:
        raise ValueError(f"held-out worlds {sorted(shared)} also appear in the training data {train_data}")


@dataclass
class Drive:
    """One held-out drive: its World rebuilt from the manifest, frame 0 observed and the targets after it."""

    world: World
    #: (F + 1, 4, 4) world_from_sensor and (F + 1,) seconds, frame 0 included.
    poses: np.ndarray
    times: np.ndarray
    images: list[RangeImage]
    points: list[np.ndarray]
    sim_seed: int


def load_drive(dataset: SimDataset, index: int, sensor: Sensor) -> Drive:
    """Drive `index` with its World, which the model is conditioned on (HD map and actor layout)."""
    arrays = dataset.load_sequence(index)
    spec = dataset.manifest["sequences"][index]
    world = make_world(spec["world_seed"], spec["style"])
    if not np.array_equal(world.hdmap.raster, arrays["map_raster"]):
        raise ValueError(f"world {spec['world_seed']} ({spec['style']}) rebuilt today differs from the map stored "
                         f"in {dataset.root}; the simulator changed since that set was written: delete it to regenerate")
    images = [RangeImage(r, i) for r, i in zip(arrays["range"], arrays["intensity"], strict=True)]
    return Drive(world=world, poses=arrays["poses"], times=arrays["times"], images=images,
                 points=[unproject(im, sensor) for im in images], sim_seed=int(spec["sim_seed"]))


# ------------------------------------------------------------------------------------------- methods


def cache_only(first: np.ndarray, poses: np.ndarray, sensor: Sensor) -> list[np.ndarray]:
    """Frame 0 (at poses[0]) moved to each later pose and z-buffered onto the sensor's grid; holes stay empty."""
    world = transform_points(first, poses[0])
    return [unproject(project(transform_points(world, np.linalg.inv(pose)), sensor), sensor) for pose in poses[1:]]


def map_only(hdmap: HDMap, poses: np.ndarray, sensor: Sensor) -> list[np.ndarray]:
    """The map's ground under every ray that meets it within range; no objects, zero intensity."""
    frames = []
    dirs = sensor.ray_directions().reshape(-1, 3)
    for pose in poses:
        t = hdmap.intersect_terrain(pose[:3, 3], dirs @ pose[:3, :3].T, sensor.max_range)
        rng = np.where(np.isfinite(t) & (t >= sensor.min_range), t, 0.0).astype(np.float32)
        image = RangeImage(rng.reshape(sensor.shape), np.zeros(sensor.shape, np.float32))
        frames.append(unproject(image, sensor))
    return frames


def noise_floor(drive: Drive, sensor: Sensor) -> list[np.ndarray]:
    """The targets simulated again from the same world, poses and times with another sensor-noise seed."""
    seed = (drive.sim_seed + 1) % (2**31 - 1)
    seq = simulate_sequence(drive.world, drive.poses[1:], sensor, seed=seed, times=drive.times[1:])
    return [unproject(f.image, sensor) for f in seq.frames]


def model_frames(pipe: LidarVersePipeline, drive: Drive, cfg: EvalConfig, seed: int, observed: bool,
                 sensor: Sensor) -> tuple[list[np.ndarray], float]:
    """Model frames at the targets on `sensor`'s grid: forecast from frame 0 (`observed`) or generated from the
    World alone."""
    targets, times = drive.poses[1:], drive.times[1:]
    sampling = {"steps": cfg.steps, "seed": seed, "guidance": cfg.guidance}
    if observed:
        result = pipe.forecast(prefix_scans=[drive.points[0]], prefix_poses=drive.poses[:1], poses=targets,
                               map=drive.world, times=times, sensor=sensor, **sampling)
    else:
        result = pipe.generate_world(map=drive.world, poses=targets, times=times, sensor=sensor, **sampling)
    return [f.points for f in result.frames], result.timings["total"]


# ------------------------------------------------------------------------------------------- metrics


def frame_scores(points: np.ndarray, truth: RangeImage, truth_points: np.ndarray, sensor: Sensor) -> dict[str, float]:
    """Per-ray errors and Chamfer of one frame against the ground truth on the sensor's grid (NaN if undefined)."""
    scores = per_ray_errors(project(points, sensor), truth)
    try:
        scores["chamfer"] = forecast_chamfer(points, truth_points)
    except ValueError as exc:  # nothing inside the crop: no distance to speak of, counted as NaN
        logger.warning("Chamfer undefined: %s", exc)
        scores["chamfer"] = float("nan")
    return scores


def temporal_chamfer(frames: list[np.ndarray], poses: np.ndarray) -> list[float]:
    """Chamfer (m) between each frame and the previous one moved into its sensor frame."""
    out = []
    for t in range(1, len(frames)):
        prev = transform_points(frames[t - 1], np.linalg.inv(poses[t]) @ poses[t - 1])
        if len(prev) and len(frames[t]):
            out.append(chamfer_distance(prev[:, :3], frames[t][:, :3]))
    return out


def map_adherence_counts(frames: list[np.ndarray], poses: np.ndarray, hdmap: HDMap) -> tuple[int, int]:
    """(returns on the map's surface, returns near or below the ground) summed over frames."""
    on, near = 0, 0
    for points, pose in zip(frames, poses, strict=True):
        world = transform_points(points, pose)
        x, y = world[:, 0].astype(np.float64), world[:, 1].astype(np.float64)
        dz = world[:, 2] - hdmap.ground_height(x, y)
        surface = ~np.isin(hdmap.class_at(x, y), NOT_SURFACE)
        low = dz < NEAR_GROUND
        near += int(low.sum())
        on += int((low & (np.abs(dz) < GROUND_TOLERANCE) & surface).sum())
    return on, near


def _mean(values: np.ndarray) -> float | None:
    """Mean ignoring NaN (undefined frames), None when nothing is defined; JSON has no NaN."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def summarise_per_ray(scores: dict[str, dict[str, list[list[float]]]]) -> tuple[dict, dict]:
    """(per-frame curves, tables by horizon) from per-drive, per-frame scores of each method."""
    curves: dict[str, dict[str, list[float | None]]] = {}
    tables: dict[str, dict[str, dict[str, float | None]]] = {h: {} for h in (*HORIZONS, BAR_SPAN)}
    for method, by_metric in scores.items():
        curves[method] = {}
        for metric, per_drive in by_metric.items():
            arr = np.asarray(per_drive, dtype=np.float64)  # (drives, frames)
            curves[method][metric] = [_mean(arr[:, t]) for t in range(arr.shape[1])]
            for label, frame in HORIZONS.items():
                tables[label].setdefault(method, {})[metric] = curves[method][metric][frame - 1]
            tables[BAR_SPAN].setdefault(method, {})[metric] = _mean(arr[:, :BAR_FRAMES])
    return curves, tables


def per_drive_chamfer(scores: dict[str, dict[str, list[list[float]]]]) -> dict[str, list[float | None]]:
    """Each method's squared Chamfer per drive, the mean over the bar span: the bars are ratios of means over
    drives, which one drive can carry, so the report shows what each drive gives."""
    return {method: [_mean(np.asarray(drive[:BAR_FRAMES], dtype=np.float64)) for drive in by_metric["chamfer"]]
            for method, by_metric in scores.items()}


# ------------------------------------------------------------------------------------------- simulated drives


@dataclass
class SimTally:
    """What the held-out drives add up to, method by method."""

    per_ray: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    frames: dict[str, list[np.ndarray]] = field(default_factory=dict)
    temporal: dict[str, list[float]] = field(default_factory=dict)
    adherence: dict[str, list[int]] = field(default_factory=dict)
    model_seconds: float = 0.0
    model_frames: int = 0

    def add(self, name: str, frames: list[np.ndarray], drive: Drive, sensor: Sensor, per_ray: bool) -> None:
        """Score one method's frames of one drive now, so only the frames the set metrics need stay in memory."""
        self.frames.setdefault(name, []).extend(frames)
        self.temporal.setdefault(name, []).extend(temporal_chamfer(frames, drive.poses[1:]))
        on, near = map_adherence_counts(frames, drive.poses[1:], drive.world.hdmap)
        counts = self.adherence.setdefault(name, [0, 0])
        counts[0], counts[1] = counts[0] + on, counts[1] + near
        if per_ray:
            rows = [frame_scores(p, im, tp, sensor)
                    for p, im, tp in zip(frames, drive.images[1:], drive.points[1:], strict=True)]
            by_metric = self.per_ray.setdefault(name, {k: [] for k in PER_RAY})
            for metric in PER_RAY:
                by_metric[metric].append([r[metric] for r in rows])

    def picture(self) -> dict[str, np.ndarray]:
        """Drive 0 at the 1.0 s horizon: the frame the pictures compare."""
        return {m: self.frames[m][HORIZONS["1.0 s"] - 1]
                for m in (GROUND_TRUTH, MODEL_FORECAST, CACHE_ONLY, MODEL_GENERATE) if m in self.frames}


def run_drives(pipe: LidarVersePipeline, heldout: SimDataset, cfg: EvalConfig, seed: int,
               sensor: Sensor) -> SimTally:
    """Every method on every held-out drive of `sensor`, scored as it goes (frames are kept for the set metrics)."""
    tally, start = SimTally(), time.perf_counter()
    for i in range(cfg.rollouts):
        drive = load_drive(heldout, i, sensor)
        truth = drive.points[1:]
        methods = {MODEL_FORECAST: True, **({MODEL_GENERATE: False} if cfg.free_generation else {})}
        for name, observed in methods.items():
            frames, seconds = model_frames(pipe, drive, cfg, seed + i, observed, sensor)
            tally.model_seconds += seconds
            tally.model_frames += len(frames)
            tally.add(name, frames, drive, sensor, per_ray=True)
        tally.add(CACHE_ONLY, cache_only(drive.points[0], drive.poses, sensor), drive, sensor, per_ray=True)
        tally.add(MAP_ONLY, map_only(drive.world.hdmap, drive.poses[1:], sensor), drive, sensor, per_ray=True)
        tally.add(NOISE_FLOOR, noise_floor(drive, sensor), drive, sensor, per_ray=True)
        tally.add(GROUND_TRUTH, truth, drive, sensor, per_ray=False)
        logger.info("drive %d/%d done (%.0fs)", i + 1, cfg.rollouts, time.perf_counter() - start)
    return tally


def distribution_rows(tally: SimTally, floor_frames: list[np.ndarray], pixels: int) -> list[dict[str, Any]]:
    """BEV JSD/MMD against the held-out frames, temporal Chamfer, map adherence and return rate per method."""
    reference = tally.frames[GROUND_TRUTH]
    rows = []
    for name in (MODEL_FORECAST, MODEL_GENERATE, CACHE_ONLY, MAP_ONLY, NOISE_FLOOR, GROUND_TRUTH):
        if name not in tally.frames:
            continue
        frames, adherence = tally.frames[name], tally.adherence[name]
        rows.append({
            "name": name,
            "bev_jsd": None if name == GROUND_TRUTH else bev_jsd(frames, reference),
            "bev_mmd": None if name == GROUND_TRUTH else bev_mmd(frames, reference),
            "temporal_chamfer_m": float(np.mean(tally.temporal[name])) if tally.temporal[name] else None,
            "map_adherence": adherence[0] / adherence[1] if adherence[1] else None,
            "return_rate": sum(len(f) for f in frames) / pixels,
        })
    rows.append({"name": FLOOR, "bev_jsd": bev_jsd(floor_frames, reference),
                 "bev_mmd": bev_mmd(floor_frames, reference), "temporal_chamfer_m": None, "map_adherence": None,
                 "return_rate": sum(len(f) for f in floor_frames) / pixels})
    return rows


def floor_set_frames(floor: SimDataset, cfg: EvalConfig, sensor: Sensor) -> list[np.ndarray]:
    """The second simulated set's target frames: what another set of worlds looks like to the BEV metrics."""
    frames = []
    for i in range(cfg.rollouts):
        arrays = floor.load_sequence(i)
        frames += [unproject(RangeImage(r, it), sensor)
                   for r, it in zip(arrays["range"][1:], arrays["intensity"][1:], strict=True)]
    return frames


# ------------------------------------------------------------------------------------------- real data


@dataclass
class RealResult:
    """The KITTI section of the report, and the picture pair's clouds (ground truth, forecast, moved)."""

    report: dict[str, Any]
    picture: dict[str, np.ndarray] = field(default_factory=dict)


def _kitti_sweeps() -> tuple[list[Scan] | None, str]:
    """The shared KITTI sweeps (their rings recovered, so a forecast is drawn on their own grid), or None and
    why not."""
    folder = real_scans_dir()
    missing = [name for name in KITTI_SWEEPS if not (folder / name).is_file()]
    if missing:
        return None, f"shared real scans {missing} not found in {folder} (set LIDARVERSE_REAL_SCANS)"
    return [read_points(folder / name) for name in KITTI_SWEEPS], ""


#: The KITTI table's columns: `sweep_scores`' metrics (its "l1_mean" too, kept in the JSON).
REAL_COLUMNS = {**COLUMNS, "l1_mean": "L1 mean, common rays (m) ↓"}


def real_pairs(pipe: LidarVersePipeline, cfg: EvalConfig, seed: int) -> RealResult:
    """Forecast each KITTI pair's second sweep from its first; score it beside the first moved to the registered
    pose, both against the second sweep as the sensor took it (`sweep_scores`)."""
    # 1. the sweeps and their poses
    scans, reason = _kitti_sweeps()
    if scans is None:
        logger.warning("real-data section skipped: %s", reason)
        return RealResult({"skipped": reason})
    sweeps = [scan.points for scan in scans]
    try:
        reg = register_sweeps(sweeps, names=list(KITTI_SWEEPS))
    except RegistrationError as exc:
        logger.warning("real-data section skipped: registration failed: %s", exc)
        return RealResult({"skipped": f"registration failed: {exc}"})
    # 2. both methods on every pair, against the second sweep at full resolution
    pairs, result = [], RealResult({})
    for a, b in KITTI_PAIRS:
        truth = sweeps[b]
        moved = transform_points(sweeps[a], np.linalg.inv(reg.poses[b]) @ reg.poses[a])
        frame = pipe.forecast(prefix_scans=[scans[a]], prefix_poses=reg.poses[a][None], poses=reg.poses[b][None],
                              steps=cfg.steps, seed=seed, guidance=cfg.guidance).frames[0]
        clouds = {MODEL_FORECAST: frame.points, MOVED_FIRST: moved}
        scores, common = sweep_scores(truth, clouds)
        pairs.append({"pair": f"{KITTI_FRAMES[a]:06d}->{KITTI_FRAMES[b]:06d}",
                      "gap_s": (KITTI_FRAMES[b] - KITTI_FRAMES[a]) / FRAME_RATE_HZ, "truth_points": len(truth),
                      "forecast_shape": list(frame.range_image.shape), "common_rays": common, "methods": scores})
        if (a, b) == KITTI_PICTURE_PAIR:
            span = field_of_view(elevation_span(truth))
            result.picture = {GROUND_TRUTH: truth, **{m: c[in_field_of_view(c, span)] for m, c in clouds.items()}}
    # 3. the mean over pairs
    mean = {m: {k: _mean(np.array([p["methods"][m][k] for p in pairs])) for k in REAL_COLUMNS}
            for m in (MODEL_FORECAST, MOVED_FIRST)}
    for p in pairs:
        p["methods"] = {m: {k: (v if math.isfinite(v) else None) for k, v in s.items()} for m, s in p["methods"].items()}
    result.report = {"sweeps": list(KITTI_SWEEPS), "registration": reg.summary(), "pairs": pairs, "mean": mean}
    return result


# ------------------------------------------------------------------------------------------- pictures


def bev_panels(panels: Sequence[tuple[str, np.ndarray]]) -> Image.Image:
    """Side-by-side BEVs (one colour scale for all) with a label strip above each: pictures to compare by eye."""
    return labelled([(label, bev_image(points, extent=PICTURE_EXTENT, resolution=PICTURE_RESOLUTION,
                                       value_range=PICTURE_HEIGHTS)) for label, points in panels],
                    label_height=PICTURE_LABEL)


def sim_pictures(sensor: str | None = None) -> tuple[str, str]:
    """The simulated drive's BEV and range-image files: on the model's own grid, or on preset `sensor`'s
    (`--sensor`), so one release folder holds the pictures of every sensor it was evaluated on."""
    suffix = f"_{sensor}" if sensor else ""
    return f"{Path(SIM_PICTURE).stem}{suffix}.png", f"{Path(SIM_RANGE_PICTURE).stem}{suffix}.png"


def write_pictures(out_dir: Path, sim: dict[str, np.ndarray], real: dict[str, np.ndarray], sensor: Sensor,
                   preset: str | None = None) -> list[Path]:
    """The simulated drive 0 at 1.0 s on `sensor`'s grid, every point drawn (`sim_pictures(preset)`: BEVs side
    by side, range images one above the other), and `eval_kitti_bev.png` (000000 -> 000004, if scored)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sim_labels = {GROUND_TRUTH: "ground truth, 1.0 s", MODEL_FORECAST: "model forecast (frame 0 observed)",
                  CACHE_ONLY: "frame 0 moved to the pose", MODEL_GENERATE: "model generate (map + layout)"}
    a, b = (f"{KITTI_FRAMES[i]:06d}" for i in KITTI_PICTURE_PAIR)
    real_labels = {GROUND_TRUTH: f"KITTI {b} (every point)", MODEL_FORECAST: f"model forecast from {a}",
                   MOVED_FIRST: f"{a} moved to {b}'s pose"}
    bev_name, range_name = sim_pictures(preset)
    pictures: dict[str, Image.Image] = {}
    if sim:
        shown = [(f"{sim_labels[m]} ({sensor.height} x {sensor.width})" if m == GROUND_TRUTH else sim_labels[m], sim[m])
                 for m in sim_labels if m in sim]
        pictures[bev_name] = bev_panels(shown)
        scale = max(1, RANGE_PICTURE_ROWS // sensor.height)
        pictures[range_name] = labelled([(label, range_image_png(project(points, sensor), max_range=sensor.max_range,
                                                                 scale=scale)) for label, points in shown],
                                        across=False, label_height=PICTURE_LABEL)
    if real:
        pictures[KITTI_PICTURE] = bev_panels([(real_labels[m], real[m]) for m in real_labels if m in real])
    written = []
    for name, picture in pictures.items():
        picture.save(out_dir / name)
        logger.info("wrote %s", out_dir / name)
        written.append(out_dir / name)
    return written


# ------------------------------------------------------------------------------------------- the run


def evaluate(pipe: LidarVersePipeline, cfg: EvalConfig, seed: int = 0, pictures: Path | None = None) -> dict[str, Any]:
    """Run the whole protocol; returns the JSON-ready report. `pictures` also writes the BEV comparisons there."""
    start = time.perf_counter()
    sensor = pipe.grid(cfg.sensor, columns=cfg.columns)
    # 1. reference sets: the held-out drives and a disjoint second simulated set
    heldout = reference_set(cfg, "heldout", EVAL_SEED, sensor)
    floor = reference_set(cfg, "floor", FLOOR_SEED, sensor)
    check_disjoint(heldout, cfg.train_data)
    t_refs = time.perf_counter() - start
    # 2. every method on every held-out drive, then the set metrics
    tally = run_drives(pipe, heldout, cfg, seed, sensor)
    curves, tables = summarise_per_ray(tally.per_ray)
    rows = distribution_rows(tally, floor_set_frames(floor, cfg, sensor), cfg.rollouts * cfg.frames * sensor.height * sensor.width)
    # 3. real pairs
    real = real_pairs(pipe, cfg, seed) if cfg.real else RealResult({"skipped": "disabled (--no-real)"})
    # 4. pictures
    if pictures is not None:
        write_pictures(pictures, tally.picture(), real.picture, sensor, sensor.name if cfg.sensor else None)
    return {
        "protocol": {**asdict(cfg), "eval_seed": EVAL_SEED, "floor_seed": FLOOR_SEED, "sensor": sensor.name,
                     "shape": list(sensor.shape), "steps": cfg.steps or pipe.config.default_steps,
                     "guidance": cfg.guidance if cfg.guidance is not None else pipe.config.default_guidance,
                     "noise_scale": pipe.config.default_noise_scale, "prior_snap": pipe.config.prior_snap,
                     "horizons": HORIZONS, "bar_span": BAR_SPAN},
        "per_frame": curves,
        "per_ray": tables,
        "per_drive": {"chamfer": per_drive_chamfer(tally.per_ray)},
        "real": real.report,
        "rows": rows,
        "bars": bars(tables[BAR_SPAN], real.report.get("mean"), rows),
        "timings": {"total_s": time.perf_counter() - start, "reference_sets_s": t_refs,
                    "model_frames_per_s": tally.model_frames / tally.model_seconds if tally.model_seconds else None},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _bar(name: str, value: float | None, limit: float | None, goal: float | None, at_most: bool) -> dict[str, Any]:
    """One bar: `value` against `limit` (must hold) and `goal`; None when the run could not measure it."""
    def holds(bound: float | None) -> bool | None:
        if value is None or bound is None:
            return None
        return value <= bound if at_most else value >= bound

    return {"bar": name, "value": value, "limit": limit, "goal": goal, "at_most": at_most,
            "pass": holds(limit), "goal_met": holds(goal)}


def bars(sim: dict[str, dict[str, float | None]], real: dict[str, dict[str, float | None]] | None,
         rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The release's bars: `sim` is the per-ray table the bars use (`BAR_SPAN`), `real` the KITTI mean or None."""
    f, c, n = sim[MODEL_FORECAST], sim[CACHE_ONLY], sim[NOISE_FLOOR]
    g = sim.get(MODEL_GENERATE, {})
    by = {r["name"]: r for r in rows}
    real = real or {}
    return [
        _bar("sim forecast Chamfer ÷ cache-only's", _ratio(f["chamfer"], c["chamfer"]), 0.7, 0.4, True),
        _bar("sim forecast L1 median ÷ cache-only's", _ratio(f["l1_median"], c["l1_median"]), 1.0, 0.5, True),
        _bar("sim forecast return IoU ≥ cache-only's + 0.2 (goal 0.9 × noise floor's)", f["iou"],
             None if c["iou"] is None else c["iou"] + 0.2, None if n["iou"] is None else 0.9 * n["iou"], False),
        _bar("sim generate Chamfer ÷ cache-only forecast's", _ratio(g.get("chamfer"), c["chamfer"]), 1.0, 0.5, True),
        _bar("real KITTI forecast Chamfer ÷ moved first sweep's",
             _ratio(real.get(MODEL_FORECAST, {}).get("chamfer"), real.get(MOVED_FIRST, {}).get("chamfer")),
             1.0, 0.7, True),
        _bar("BEV JSD ÷ sim-vs-sim floor", _ratio(by[MODEL_FORECAST]["bev_jsd"], by[FLOOR]["bev_jsd"]), 1.5, 1.1, True),
    ]


# ------------------------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _per_ray_table(first_column: str, rows: list[tuple[str, dict[str, float | None]]],
                   columns: dict[str, str] = PER_RAY) -> list[str]:
    lines = [f"| {first_column} | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, scores in rows:
        lines.append(f"| {name} | " + " | ".join(_fmt(scores.get(k), 3) for k in columns) + " |")
    return lines


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("yes" if ok else "NO")


def _per_drive_table(report: dict[str, Any]) -> list[str]:
    """One row per method, one column per held-out drive, for runs of up to `DRIVE_COLUMNS` drives (where one
    drive can carry a bar); a larger run's drives stay in the JSON."""
    by_method, span = report["per_drive"]["chamfer"], report["protocol"]["bar_span"]
    drives = max((len(v) for v in by_method.values()), default=0)
    if drives > DRIVE_COLUMNS:
        return [f"Each of the {drives} drives' squared Chamfer, mean over {span}, is in the JSON report (`per_drive`)."]
    lines = [f"Squared Chamfer (m²) per drive, mean over {span}:", "",
             "| method | " + " | ".join(f"drive {i}" for i in range(drives)) + " |", "|---|" + "---|" * drives]
    return lines + [f"| {m} | " + " | ".join(_fmt(v, 3) for v in values) + " |" for m, values in by_method.items()]


def format_report(report: dict[str, Any]) -> str:
    """Markdown: the protocol, per-ray tables by horizon, the KITTI table, the set metrics and the bars."""
    p, t = report["protocol"], report["timings"]
    lines = [
        f"{p['rollouts']} held-out drives (dataset seed {p['eval_seed']}), frame 0 observed, {p['frames']} target "
        f"frames at 10 Hz; {p['steps']} sampler steps, guidance {p['guidance']}, noise scale "
        f"{p.get('noise_scale', 1.0)}, prior snap {p.get('prior_snap', 0.0)}, sensor {p['sensor']} "
        f"{p['shape'][0]}x{p['shape'][1]}; floor set seed {p['floor_seed']}. Wall time {t['total_s'] / 60:.1f} min, "
        f"model {_fmt(t['model_frames_per_s'], 2)} frames/s. Per-ray metrics on the model's grid against the "
        f"ground truth at the same pose; L1 and AbsRel over the rays both return on (coverage).",
    ]
    for label, table in report["per_ray"].items():
        span = f"mean over {label} (the bars)" if label == p["bar_span"] else f"at {label} (frame {p['horizons'][label]})"
        lines += ["", f"Simulated drives, {span}:", "", *_per_ray_table("method", list(table.items()))]
    if "per_drive" in report:  # reports written before it was measured have none
        lines += ["", *_per_drive_table(report)]
    real = report["real"]
    lines += ["", "Real KITTI seq 00 pairs (KISS-ICP poses; ground truth = the second sweep as the sensor took it, "
              "every point; L1 and AbsRel along its rays on the rays both methods return on):", ""]
    if "skipped" in real:
        lines.append(f"Skipped: {real['skipped']}.")
    else:
        rows = [(f"{pair['pair']} {m}", s) for pair in real["pairs"] for m, s in pair["methods"].items()]
        rows += [(f"mean {m}", s) for m, s in real["mean"].items()]
        lines += _per_ray_table("pair, method", rows, REAL_COLUMNS)
        fitness = " / ".join(f"{r['fitness']:.2f}" for r in real["registration"])
        lines += ["", f"KISS-ICP fitness of {' / '.join(real['sweeps'])}: {fitness}."]
    lines += ["", "| method | BEV JSD ↓ | BEV MMD ↓ | temporal Chamfer (m) | map adherence | return rate |",
              "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['name']} | {_fmt(r['bev_jsd'])} | {_fmt(r['bev_mmd'], 6)} | "
                     f"{_fmt(r['temporal_chamfer_m'], 3)} | {_fmt(r['map_adherence'], 3)} | {_fmt(r['return_rate'], 3)} |")
    lines += ["", "| bar | value | bar | goal | pass | goal met |", "|---|---|---|---|---|---|"]
    for b in report["bars"]:
        sign = "≤" if b["at_most"] else "≥"
        lines.append(f"| {b['bar']} | {_fmt(b['value'], 3)} | {sign} {_fmt(b['limit'], 3)} | {sign} {_fmt(b['goal'], 3)} "
                     f"| {_verdict(b['pass'])} | {_verdict(b['goal_met'])} |")
    return "\n".join(lines)


def format_sensor_table(reports: list[dict[str, Any]]) -> str:
    """Markdown: one row per sensor the drives were simulated on (`--sensor`), the bars every trained sensor is
    held to (`SENSOR_BARS`) beside the forecast's L1 median and return IoU."""
    lines = ["| sensor | beams x columns | drives | forecast Chamfer ÷ cache-only's "
             f"(≤ {SENSOR_BARS['forecast']:g}) | generate Chamfer ÷ cache-only's (≤ {SENSOR_BARS['generate']:g}) | "
             "forecast L1 median ÷ cache-only's | forecast return IoU (cache-only's) | model frames/s |",
             "|---|---|---|---|---|---|---|---|"]
    for report in reports:
        p, table = report["protocol"], report["per_ray"][report["protocol"]["bar_span"]]
        f, c, g = table[MODEL_FORECAST], table[CACHE_ONLY], table.get(MODEL_GENERATE, {})
        forecast, generate = _ratio(f["chamfer"], c["chamfer"]), _ratio(g.get("chamfer"), c["chamfer"])
        lines.append(
            f"| {p['sensor']} | {p['shape'][0]} x {p['shape'][1]} | {p['rollouts']} | {_fmt(forecast, 3)} "
            f"{_verdict(None if forecast is None else forecast <= SENSOR_BARS['forecast'])} | {_fmt(generate, 3)} "
            f"{_verdict(None if generate is None else generate <= SENSOR_BARS['generate'])} | "
            f"{_fmt(_ratio(f['l1_median'], c['l1_median']), 3)} | {_fmt(f['iou'], 3)} ({_fmt(c['iou'], 3)}) | "
            f"{_fmt(report['timings']['model_frames_per_s'], 2)} |")
    return "\n".join(lines)


def report_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every evaluation command shares: the model, its threads and seed, and where the report goes."""
    parser.add_argument("--model", default=None, help="release folder, weights file, job dir or Hub id "
                        "(default: $LIDARVERSE_MODEL or weights/default)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a busy machine)")
    parser.add_argument("--dtype", default="float32", help="the world model's dtype: float32 (the default, the "
                        "same figures on every CPU), bfloat16 (what a CPU with AMX runs by default) or float16")


def start_run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)


def publish_report(report: dict[str, Any], pipe: LidarVersePipeline, args: argparse.Namespace,
                   render: Callable[[dict[str, Any]], str]) -> int:
    """Name the model in the report, write it to `--out` and print it (JSON or `render`'s markdown)."""
    report["model"] = pipe.provenance.to_dict()
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if args.json else render(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a few tiny rollouts (CI smoke test)")
    parser.add_argument("--rollouts", type=int, default=None, help="override the number of held-out drives")
    parser.add_argument("--frames", type=int, default=None, help="target frames per drive (>= 10)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's)")
    parser.add_argument("--data-dir", default=None, help="where reference sets are cached (default data/eval)")
    parser.add_argument("--train-data", default=json.loads(DEFAULT_TRAIN_CONFIG.read_text())["data_root"],
                        help="training dataset to check disjointness (default: the default config's)")
    parser.add_argument("--no-free-generation", action="store_true", help="skip the nothing-observed rollouts")
    parser.add_argument("--no-real", action="store_true", help="skip the KITTI pairs")
    parser.add_argument("--sensor", default=None, help="simulate the drives on this preset (default: the model's grid)")
    parser.add_argument("--columns", type=int, default=None, help="the drives' azimuth columns (default: the sensor's)")
    parser.add_argument("--pictures", type=Path, default=None, help=f"write {SIM_PICTURE}, {SIM_RANGE_PICTURE} (with --sensor: "
                        f"{sim_pictures('NAME')[0]}, ...) and {KITTI_PICTURE} here")
    args = parser.parse_args(argv)
    start_run(args)

    try:
        pipe = load_pipeline(args.model, device="cpu", dtype=args.dtype)
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lidarverse-eval-") as tmp:
        base = EvalConfig.quick(args.data_dir or tmp) if args.quick else EvalConfig(data_dir=args.data_dir or "data/eval")
        overrides = {"rollouts": args.rollouts, "frames": args.frames, "steps": args.steps, "guidance": args.guidance,
                     "sensor": args.sensor, "columns": args.columns}
        try:
            cfg = EvalConfig(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None},
                                "train_data": args.train_data, "free_generation": not args.no_free_generation,
                                "real": not args.no_real})
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            report = evaluate(pipe, cfg, seed=args.seed, pictures=args.pictures)
        except InputError as exc:  # a sensor or column count the model cannot draw
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return publish_report(report, pipe, args, format_report)


if __name__ == "__main__":
    sys.exit(main())

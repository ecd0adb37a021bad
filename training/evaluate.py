"""Score a model on held-out simulated drives: `python -m training.evaluate --model SRC [--json] [--quick]`.

Protocol (issue 5), everything measured in the same run:
- Held-out drives are sequences of a `lidar.sim` dataset with seed `EVAL_SEED`; their worlds are checked to
  be disjoint from the training dataset's. Frame 0 of each drive is observed; frames 1..F are the targets.
- "model (forecast)": rollout along the drive's poses with the map and a cache seeded with frame 0.
  "model (generate)": the same from an empty cache (free world generation on the map).
- Baselines: "cache-only" reprojects the previous frame into the next pose (holes stay empty), starting
  from frame 0; "map-only" returns the map's ground under every ray that meets it, nothing else.
- BEV JSD / MMD (`lidar.metrics`) of each method's frames against the held-out frames; the sim-vs-sim
  floor compares a second, disjoint simulated set (seed `FLOOR_SEED`) with the held-out frames.
- Temporal consistency: Chamfer distance between consecutive frames after ego-motion compensation,
  against the same figure for the ground truth.
- Map adherence: of the returns at or below 0.5 m above the map's ground, the fraction lying on the
  ground (within 0.25 m) of a surface class (not "none", not "building").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference import ModelSourceError, load_pipeline
from inference.cache import transform_points
from inference.network import WorldModel
from inference.rollout import cache_from_scans, rollout
from lidar.metrics import bev_jsd, bev_mmd, chamfer_distance
from lidar.range_image import RangeImage, project, unproject
from lidar.sensors import Sensor
from lidar.sim.dataset import MANIFEST, SimDataset, write_dataset
from lidar.sim.hdmap import MAP_CLASS_INDEX, HDMap

logger = logging.getLogger(__name__)

#: Dataset seeds of the held-out drives and of the second simulated set; training uses seed 0.
EVAL_SEED = 100_000
FLOOR_SEED = 200_000
#: Ground tolerance (m) of map adherence, and the height below which a return counts as near the ground.
GROUND_TOLERANCE = 0.25
NEAR_GROUND = 0.5
NOT_SURFACE = (MAP_CLASS_INDEX["none"], MAP_CLASS_INDEX["building"])

MODEL_FORECAST = "model (forecast)"
MODEL_GENERATE = "model (generate)"
CACHE_ONLY = "cache-only"
MAP_ONLY = "map-only"
GROUND_TRUTH = "ground truth"
FLOOR = "sim-vs-sim floor"


@dataclass
class EvalConfig:
    """Sizes of one evaluation; the defaults are the release protocol, `quick()` the CI smoke test."""

    #: Held-out drives (one rollout each) and the size of the floor set.
    rollouts: int = 64
    #: Generated frames per rollout (the drive has one more: the observed frame 0).
    frames: int = 8
    #: Sampler steps and guidance; None takes the model config's defaults.
    steps: int | None = None
    guidance: float | None = None
    #: Where reference datasets are kept between runs (generated there when missing).
    data_dir: str = "data/eval"
    #: Training dataset whose world seeds must not appear among the held-out ones ("" skips the check).
    train_data: str = ""
    #: Processes for simulating missing reference sets.
    workers: int = 2
    #: Also roll out from an empty cache ("model (generate)"); doubles the model's share of the run.
    free_generation: bool = True

    def __post_init__(self) -> None:
        if self.rollouts < 2:
            raise ValueError(f"rollouts must be >= 2 (MMD needs a set), got {self.rollouts}")
        if self.frames < 2:
            raise ValueError(f"frames must be >= 2 (temporal consistency needs pairs), got {self.frames}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @classmethod
    def quick(cls, data_dir: str) -> EvalConfig:
        return cls(rollouts=3, frames=2, data_dir=data_dir, workers=1)


def reference_set(cfg: EvalConfig, name: str, seed: int, sensor: Sensor) -> SimDataset:
    """A simulated set for this protocol, reused from `data_dir` (its first `rollouts` drives) or simulated now."""
    path = Path(cfg.data_dir) / f"{name}_s{seed}_f{cfg.frames + 1}_{sensor.name}x{sensor.width}"
    manifest = path / MANIFEST
    if not manifest.is_file() or len(json.loads(manifest.read_text())["sequences"]) < cfg.rollouts:
        start = time.perf_counter()
        write_dataset(path, sensor, cfg.rollouts, cfg.frames + 1, seed=seed, workers=cfg.workers)
        logger.info("simulated %s in %.1fs", path, time.perf_counter() - start)
    dataset = SimDataset(path, cache_size=1)
    if dataset.sensor != sensor:
        raise ValueError(f"reference set {path} is for sensor {dataset.sensor.name} {dataset.sensor.shape}, "
                         f"the model for {sensor.name} {sensor.shape}; delete it to regenerate")
    return dataset


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


# ------------------------------------------------------------------------------------------- methods


def cache_only(first: np.ndarray, poses: np.ndarray, sensor: Sensor) -> list[np.ndarray]:
    """Each frame is the previous one reprojected into the next pose, holes left empty."""
    frames, prev_world = [], transform_points(first, poses[0])
    for pose in poses[1:]:
        image = project(transform_points(prev_world, np.linalg.inv(pose)), sensor)
        points = unproject(image, sensor)
        frames.append(points)
        prev_world = transform_points(points, pose)
    return frames


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


def generate(model: WorldModel, hdmap: HDMap, first: np.ndarray | None, poses: np.ndarray, cfg: EvalConfig,
             seed: int) -> tuple[list[np.ndarray], float]:
    """Model frames at poses[1:], the cache seeded with frame 0 (forecast) or empty (generate)."""
    cache = cache_from_scans([first], poses[:1]) if first is not None else None
    result = rollout(model, poses[1:], map_source=hdmap, cache=cache, steps=cfg.steps, seed=seed,
                     guidance=cfg.guidance)
    return [f.points for f in result.frames], result.timings["total"]


# ------------------------------------------------------------------------------------------- metrics


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


def evaluate(model: WorldModel, cfg: EvalConfig, seed: int = 0) -> dict[str, Any]:
    """Run the whole protocol; returns the JSON-ready report (rows, floor, bars, timings)."""
    start = time.perf_counter()
    sensor = model.sensor
    # 1. Reference sets: the held-out drives and a disjoint second simulated set.
    heldout = reference_set(cfg, "heldout", EVAL_SEED, sensor)
    floor = reference_set(cfg, "floor", FLOOR_SEED, sensor)
    check_disjoint(heldout, cfg.train_data)
    t_refs = time.perf_counter() - start
    # 2. Every method on every held-out drive.
    methods = (MODEL_FORECAST, *((MODEL_GENERATE,) if cfg.free_generation else ()), CACHE_ONLY, MAP_ONLY,
               GROUND_TRUTH)
    frames: dict[str, list[np.ndarray]] = {m: [] for m in methods}
    chamfers: dict[str, list[float]] = {m: [] for m in methods}
    adherence = {m: [0, 0] for m in methods}
    returns = {m: 0 for m in methods}
    model_seconds, model_frames = 0.0, 0
    for i in range(cfg.rollouts):
        arrays = heldout.load_sequence(i)
        hdmap = HDMap.from_dict(arrays)
        poses = arrays["poses"]
        gt = [unproject(RangeImage(r, it), sensor) for r, it in zip(arrays["range"], arrays["intensity"], strict=True)]
        forecast, seconds = generate(model, hdmap, gt[0], poses, cfg, seed + i)
        per_method = {MODEL_FORECAST: forecast}
        if cfg.free_generation:
            per_method[MODEL_GENERATE], sec_g = generate(model, hdmap, None, poses, cfg, seed + i)
            seconds += sec_g
        model_seconds += seconds
        model_frames += len(per_method) * cfg.frames
        per_method.update({
            CACHE_ONLY: cache_only(gt[0], poses, sensor),
            MAP_ONLY: map_only(hdmap, poses[1:], sensor),
            GROUND_TRUTH: gt[1:],
        })
        for name, fr in per_method.items():
            frames[name] += fr
            chamfers[name] += temporal_chamfer(fr, poses[1:])
            on, near = map_adherence_counts(fr, poses[1:], hdmap)
            adherence[name][0] += on
            adherence[name][1] += near
            returns[name] += sum(len(f) for f in fr)
        logger.info("rollout %d/%d done (%.0fs)", i + 1, cfg.rollouts, time.perf_counter() - start)
    floor_frames = []
    for i in range(cfg.rollouts):
        arrays = floor.load_sequence(i)
        floor_frames += [unproject(RangeImage(r, it), sensor)
                         for r, it in zip(arrays["range"][1:], arrays["intensity"][1:], strict=True)]
    # 3. Scores against the held-out frames.
    reference = frames[GROUND_TRUTH]
    pixels = cfg.rollouts * cfg.frames * sensor.height * sensor.width
    rows = []
    for name in methods:
        rows.append({
            "name": name,
            "bev_jsd": None if name == GROUND_TRUTH else bev_jsd(frames[name], reference),
            "bev_mmd": None if name == GROUND_TRUTH else bev_mmd(frames[name], reference),
            "temporal_chamfer_m": float(np.mean(chamfers[name])) if chamfers[name] else None,
            "map_adherence": adherence[name][0] / adherence[name][1] if adherence[name][1] else None,
            "return_rate": returns[name] / pixels,
        })
    rows.append({"name": FLOOR, "bev_jsd": bev_jsd(floor_frames, reference),
                 "bev_mmd": bev_mmd(floor_frames, reference), "temporal_chamfer_m": None, "map_adherence": None,
                 "return_rate": sum(len(f) for f in floor_frames) / pixels})
    report = {
        "protocol": {**asdict(cfg), "eval_seed": EVAL_SEED, "floor_seed": FLOOR_SEED, "sensor": sensor.name,
                     "shape": list(sensor.shape), "steps": cfg.steps or model.config.default_steps,
                     "guidance": cfg.guidance if cfg.guidance is not None else model.config.default_guidance},
        "rows": rows,
        "bars": bars(rows),
        "timings": {"total_s": time.perf_counter() - start, "reference_sets_s": t_refs,
                    "model_frames_per_s": model_frames / model_seconds if model_seconds else None},
    }
    return report


def bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 5's bars for the default release, checked on the forecast rollouts."""
    by = {r["name"]: r for r in rows}
    m, gt, fl = by[MODEL_FORECAST], by[GROUND_TRUTH], by[FLOOR]
    out = []
    for metric in ("bev_jsd", "bev_mmd"):
        for base in (CACHE_ONLY, MAP_ONLY):
            out.append({"bar": f"{metric}: model < {base}", "value": m[metric], "limit": by[base][metric],
                        "pass": m[metric] < by[base][metric]})
    jsd_ratio = m["bev_jsd"] / fl["bev_jsd"] if fl["bev_jsd"] else float("inf")
    out.append({"bar": "bev_jsd <= 3x floor (goal 1.5x)", "value": jsd_ratio, "limit": 3.0, "pass": jsd_ratio <= 3.0})
    if m["temporal_chamfer_m"] is not None and gt["temporal_chamfer_m"]:
        ratio = m["temporal_chamfer_m"] / gt["temporal_chamfer_m"]
        out.append({"bar": "temporal Chamfer <= 1.5x ground truth", "value": ratio, "limit": 1.5, "pass": ratio <= 1.5})
    return out


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
    """Markdown: the protocol in one sentence, the metrics table and the bars."""
    p = report["protocol"]
    lines = [
        f"{p['rollouts']} rollouts x {p['frames']} frames on held-out drives (dataset seed {p['eval_seed']}; "
        f"frame 0 observed), {p['steps']} sampler steps, guidance {p['guidance']}, sensor {p['sensor']} "
        f"{p['shape'][0]}x{p['shape'][1]}; floor set seed {p['floor_seed']}. Wall time "
        f"{report['timings']['total_s'] / 60:.1f} min, model {_fmt(report['timings']['model_frames_per_s'], 2)} frames/s.",
        "",
        "| method | BEV JSD ↓ | BEV MMD ↓ | temporal Chamfer (m) | map adherence | return rate |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['name']} | {_fmt(r['bev_jsd'])} | {_fmt(r['bev_mmd'], 6)} | "
                     f"{_fmt(r['temporal_chamfer_m'], 3)} | {_fmt(r['map_adherence'], 3)} | {_fmt(r['return_rate'], 3)} |")
    lines += ["", "| bar | value | limit | pass |", "|---|---|---|---|"]
    for b in report["bars"]:
        lines.append(f"| {b['bar']} | {_fmt(b['value'], 4)} | {_fmt(b['limit'], 4)} | {'yes' if b['pass'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="release folder, weights file, job dir or Hub id "
                        "(default: $LIDARVERSE_MODEL or weights/default)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    parser.add_argument("--quick", action="store_true", help="a few tiny rollouts (CI smoke test)")
    parser.add_argument("--rollouts", type=int, default=None, help="override the number of rollouts")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's)")
    parser.add_argument("--data-dir", default=None, help="where reference sets are cached (default data/eval)")
    parser.add_argument("--train-data", default="data/sim_hdl32_512", help="training dataset to check disjointness")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-free-generation", action="store_true", help="skip the empty-cache rollouts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a busy machine)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        pipe = load_pipeline(args.model, device="cpu")
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lidarverse-eval-") as tmp:
        if args.quick:
            cfg = EvalConfig.quick(args.data_dir or tmp)
        else:
            cfg = EvalConfig(data_dir=args.data_dir or "data/eval")
        overrides = {"rollouts": args.rollouts, "steps": args.steps, "guidance": args.guidance}
        cfg = EvalConfig(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v is not None},
                            "train_data": args.train_data, "free_generation": not args.no_free_generation})
        report = evaluate(pipe.model, cfg, seed=args.seed)
    report["model"] = pipe.provenance.to_dict()
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

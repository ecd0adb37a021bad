"""Forecasts of real recorded drives against the sweeps that followed: `python -m training.evaluate_real --data DIR`.

Protocol (issue 19), every method scored at the same poses in the same run:
1. A recording (`lidar.sequence.open_recording`: KITTI odometry `velodyne/` + `poses.txt` + `calib.txt`, a
   folder with our `poses.json`, or bare sweeps) is posed by registering all its sweeps with KISS-ICP
   (default: the shared KITTI 00 README measures registration 2-5x tighter than the ground-truth file), or
   by its poses file (`--poses file`). With both available the report gives how far they differ.
2. Every start: a prefix of K consecutive sweeps (K in `PREFIX_LENGTHS`) ending at sweep p, forecast at the
   poses of sweeps p + h for every horizon h (`HORIZONS`, frames at 10 Hz), conditioned on the prefix
   alone (no map, no layout, nothing fed back). Starts run over every p the recording allows.
3. Baselines at the same poses (the ray-tracing baselines of 4D occupancy forecasting): the last prefix sweep
   moved to the target pose; every prefix sweep moved and z-buffered together.
4. Metrics on the model's grid, within the real sensor's vertical field of view (the target sweep's
   elevation span: above a KITTI HDL-64E's +2 deg there is no truth to score against):
   - return IoU of each method's mask against the truth's;
   - per-ray L1 (median, mean) on the common rays: those the truth, the model and both baselines return,
     so every method is scored on the same rays; and the share of those rays within `KEPT_WITHIN` of the
     moved prefix (how much of the measurement a method keeps);
   - Chamfer in the squared, +-70 m form (`forecast_chamfer`) and as the mean nearest-neighbour distance in
     metres within `NEAR_RADIUS` (`chamfer_distance`), on points: the truth and the baselines thinned to the
     model's density with their points left where they were measured (`thin_to_grid`), every method's points
     within the truth's field of view (`in_field_of_view`: moved sweeps reach below the real sensor's lowest
     beam from the new pose, where the truth cannot see).
5. Pictures: BEV and range image, truth | forecast | moved prefix, at the two longest horizons (0.5 s and
   1.0 s) of the longest prefix's first start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from inference import load_pipeline
from inference.pipeline import LidarVersePipeline
from lidar.errors import InputError
from lidar.metrics import chamfer_distance, forecast_chamfer
from lidar.range_image import elevation_span, project
from lidar.registration import register_sweeps
from lidar.render import range_image_png
from lidar.sensors import Sensor
from lidar.sequence import Recording, open_recording
from lidar.vocabulary import FRAME_RATE_HZ, transform_points
from training.evaluate import (
    bev_panels,
    in_field_of_view,
    publish_report,
    report_arguments,
    start_run,
    thin_to_grid,
)

logger = logging.getLogger(__name__)

#: Prefix lengths (sweeps observed) and horizons (frames ahead at 10 Hz) of the protocol.
PREFIX_LENGTHS = (1, 3)
HORIZONS = (1, 3, 5, 10)
#: A kept ray lies within this of the moved prefix's range (m): a sensor's ranging noise.
KEPT_WITHIN = 0.02
#: A kept range differs from the measured one by float rounding (an encode-decode of the range): 1 mm.
L1_TOLERANCE = 1e-3
#: Horizontal radius (m) of the plain-metre Chamfer: beyond it a sweep is too sparse to compare point sets.
NEAR_RADIUS = 40.0
MODEL = "model forecast"
LAST_MOVED = "last sweep moved"
PREFIX_MOVED = "every prefix sweep moved"
METHODS = (MODEL, LAST_MOVED, PREFIX_MOVED)
#: Report key -> table header.
COLUMNS = {"iou": "return IoU ↑", "l1_median": "L1 median (m) ↓", "l1_mean": "L1 mean (m) ↓",
           "kept": f"within {KEPT_WITHIN * 100:.0f} cm of moved prefix", "chamfer": "Chamfer (m², ±70 m) ↓",
           "chamfer_near": f"Chamfer (m, NN ≤ {NEAR_RADIUS:.0f} m) ↓"}


@dataclass
class RealSequenceConfig:
    """One real-sequence evaluation; the defaults are the release protocol on the shared KITTI 00 frames."""

    data: str = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00")
    #: "registered" (KISS-ICP over the whole recording) or "file" (the recording's poses file).
    poses: str = "registered"
    prefixes: tuple[int, ...] = PREFIX_LENGTHS
    horizons: tuple[int, ...] = HORIZONS
    steps: int | None = None
    guidance: float | None = None
    #: Most starts per prefix length (evenly spread), 0 for all.
    max_starts: int = 0

    def __post_init__(self) -> None:
        if self.poses not in ("registered", "file"):
            raise InputError(f"poses must be 'registered' or 'file', got {self.poses!r}")
        if not self.prefixes or min(self.prefixes) < 1 or not self.horizons or min(self.horizons) < 1:
            raise InputError(f"prefixes and horizons must be integers >= 1, got {self.prefixes}, {self.horizons}")


def recording_poses(rec: Recording, how: str) -> tuple[np.ndarray, dict[str, Any]]:
    """World_from_sensor poses of every sweep, and how they were obtained (with the gap to the file's)."""
    if how == "file":
        if rec.poses is None:
            raise InputError("the recording has no poses file; use registered poses")
        return rec.poses, {"source": "file"}
    reg = register_sweeps(rec, names=rec.names)  # read sweep by sweep
    info: dict[str, Any] = {"source": "registered (KISS-ICP)", "fitness_min": float(reg.fitness.min())}
    if rec.poses is not None:  # both start at the first sweep, so positions compare directly
        gap = np.linalg.norm(reg.poses[:, :3, 3] - rec.poses[:, :3, 3], axis=1)
        step_reg = np.linalg.norm(np.diff(reg.poses[:, :3, 3], axis=0), axis=1)
        step_file = np.linalg.norm(np.diff(rec.poses[:, :3, 3], axis=0), axis=1)
        info.update(file_gap_m_max=float(gap.max()), step_m_registered=float(step_reg.mean()),
                    step_m_file=float(step_file.mean()))
    return reg.poses, info


def starts(count: int, prefix: int, horizon: int, limit: int) -> list[int]:
    """Last prefix indices p with a full prefix behind and the longest horizon ahead, `limit` evenly spread."""
    ends = list(range(prefix - 1, count - horizon))
    if limit and len(ends) > limit:
        ends = [ends[i] for i in np.linspace(0, len(ends) - 1, limit).round().astype(int)]
    return ends


def fov_rows(span: tuple[float, float], sensor: Sensor) -> np.ndarray:
    """(H,) bool: the model's rows inside the truth sweep's elevation span."""
    return (sensor.elevations >= span[0]) & (sensor.elevations <= span[1])


def near(points: np.ndarray) -> np.ndarray:
    return points[np.hypot(points[:, 0], points[:, 1]) <= NEAR_RADIUS]


def frame_scores(truth: np.ndarray, model_image: np.ndarray, model_points: np.ndarray,
                 moved: dict[str, np.ndarray], sensor: Sensor) -> dict[str, dict[str, float]]:
    """Every metric of the protocol for one target: `moved` holds each baseline's points at the target pose."""
    span = elevation_span(truth)
    rows = fov_rows(span, sensor)[:, None]
    truth_img = np.where(rows, project(truth, sensor).range, 0.0)
    images = {MODEL: np.where(rows, model_image, 0.0)}
    images.update({m: np.where(rows, project(p, sensor).range, 0.0) for m, p in moved.items()})
    clouds = {MODEL: in_field_of_view(model_points, span)}
    clouds.update({m: in_field_of_view(thin_to_grid(p, sensor), span) for m, p in moved.items()})
    truth_pts = thin_to_grid(truth, sensor)
    query = truth_img > 0
    common = query & np.logical_and.reduce([img > 0 for img in images.values()])
    out = {}
    for method, img in images.items():
        hit = img > 0
        err = np.abs(img[common] - truth_img[common])
        out[method] = {
            "iou": float((query & hit).sum() / max((query | hit).sum(), 1)),
            "l1_median": float(np.median(err)) if err.size else math.nan,
            "l1_mean": float(err.mean()) if err.size else math.nan,
            "kept": float((np.abs(img[common] - images[PREFIX_MOVED][common]) <= KEPT_WITHIN).mean())
            if err.size else math.nan,
            "chamfer": forecast_chamfer(clouds[method], truth_pts),
            "chamfer_near": chamfer_distance(near(clouds[method]), near(truth_pts)),
        }
    return out


@dataclass
class Forecast:
    """One start's clouds at one horizon, kept for the pictures."""

    truth: np.ndarray
    model_points: np.ndarray
    model_image: np.ndarray
    prefix_points: np.ndarray


def forecast_start(pipe: LidarVersePipeline, sweep: Callable[[int], np.ndarray], times_s: np.ndarray | None,
                   poses: np.ndarray, end: int, prefix: int, horizons: tuple[int, ...], cfg: RealSequenceConfig,
                   seed: int) -> tuple[dict[int, dict[str, dict[str, float]]], dict[int, Forecast]]:
    """Forecast every horizon from the prefix ending at `end`; score it and both baselines. `sweep(i)` gives
    sweep i's points, `times_s` the recording's seconds (None: 10 Hz)."""
    # 1. the prefix and its world points
    sweeps = [sweep(i) for i in range(end - prefix + 1, end + 1)]
    prefix_poses = poses[end - prefix + 1 : end + 1]
    world = [transform_points(s, p) for s, p in zip(sweeps, prefix_poses, strict=True)]
    # 2. the model, at every target pose in one rollout (frames are independent: nothing is fed back)
    targets = [end + h for h in horizons]
    times = None if times_s is None else times_s[targets] - times_s[end]
    result = pipe.forecast(prefix_scans=sweeps, prefix_poses=prefix_poses, poses=poses[targets],
                           times=times, steps=cfg.steps, seed=seed, guidance=cfg.guidance)
    # 3. score against the truth beside both baselines
    scores, kept = {}, {}
    for h, target, frame in zip(horizons, targets, result.frames, strict=True):
        into = np.linalg.inv(poses[target])
        moved = {LAST_MOVED: transform_points(world[-1], into),
                 PREFIX_MOVED: transform_points(np.concatenate(world), into)}
        truth = sweep(target)
        scores[h] = frame_scores(truth, frame.range_image.range, frame.points, moved, pipe.sensor)
        kept[h] = Forecast(truth, frame.points, frame.range_image.range, moved[PREFIX_MOVED])
    return scores, kept


def evaluate_recording(pipe: LidarVersePipeline, cfg: RealSequenceConfig, seed: int = 0,
                       pictures: Path | None = None) -> dict[str, Any]:
    """The whole protocol on one recording; returns the JSON-ready report (`format_real` renders it)."""
    rec = open_recording(cfg.data)
    poses, pose_info = recording_poses(rec, cfg.poses)
    horizons = tuple(sorted(cfg.horizons))
    # neighbouring starts share their sweeps: keep a start's worth in memory rather than read them again
    sweep = functools.lru_cache(maxsize=max(cfg.prefixes) + horizons[-1])(lambda i: rec.sweep(i).points)
    tables: dict[str, Any] = {}
    for prefix in cfg.prefixes:
        ends = starts(len(rec), prefix, horizons[-1], cfg.max_starts)
        if not ends:
            logger.warning("%d sweeps are too few for a prefix of %d and a horizon of %d", len(rec), prefix,
                           horizons[-1])
            continue
        per_start = []
        for end in ends:
            scores, kept = forecast_start(pipe, sweep, rec.times, poses, end, prefix, horizons, cfg, seed)
            per_start.append(scores)
            if pictures is not None and prefix == max(cfg.prefixes) and end == ends[0]:
                write_pictures(pictures, kept, rec.names[end], pipe.sensor)
        tables[f"K={prefix}"] = {"starts": [rec.names[e] for e in ends], "horizons": {
            f"{h / FRAME_RATE_HZ:.1f} s": {m: {k: _mean([s[h][m][k] for s in per_start]) for k in COLUMNS}
                                           for m in METHODS} for h in horizons}}
    if not tables:
        raise InputError(f"{cfg.data}: {len(rec)} sweeps are too few for any prefix of {list(cfg.prefixes)} sweeps "
                         f"and a horizon of {horizons[-1]} frames")
    return {"recording": Path(cfg.data).name, "sweeps": len(rec), "poses": pose_info, "protocol": asdict(cfg),
            "steps": cfg.steps or pipe.config.default_steps, "tables": tables, "bars": real_bars(tables)}


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def real_bars(tables: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 19's bars per prefix length and horizon: L1 on common rays <= the moved prefix's; Chamfer <= 1.0x
    the better baseline up to 0.3 s and <= 0.9x from 0.5 s; IoU above both."""
    out = []
    for prefix, table in tables.items():
        for horizon, rows in table["horizons"].items():
            m, last, pre = rows[MODEL], rows[LAST_MOVED], rows[PREFIX_MOVED]
            limit = 1.0 if float(horizon.split()[0]) < 0.5 else 0.9
            squared, near_ = (m[k] / min(last[k], pre[k]) for k in ("chamfer", "chamfer_near"))
            out.append({"prefix": prefix, "horizon": horizon, "l1_ratio": m["l1_median"] / pre["l1_median"],
                        "l1_pass": m["l1_median"] <= pre["l1_median"] + L1_TOLERANCE,
                        "chamfer_ratio": squared, "chamfer_near_ratio": near_, "chamfer_limit": limit,
                        "chamfer_pass": squared <= limit, "chamfer_near_pass": near_ <= limit,
                        "iou_pass": m["iou"] > max(last["iou"], pre["iou"])})
    return out


def write_pictures(out_dir: Path, kept: dict[int, Forecast], start: str, sensor: Sensor) -> None:
    """`real_bev_<h>.png` and `real_range_<h>.png`: truth | forecast | moved prefix at the two longest horizons."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for h in sorted(kept)[-2:]:
        f, label = kept[h], f"{h / FRAME_RATE_HZ:.1f} s after {Path(start).stem}"
        span = elevation_span(f.truth)
        panels = [(f"truth, {label}", thin_to_grid(f.truth, sensor)),
                  ("model forecast", in_field_of_view(f.model_points, span)),
                  ("every prefix sweep moved", in_field_of_view(thin_to_grid(f.prefix_points, sensor), span))]
        bev_panels(panels).save(out_dir / f"real_bev_{h}.png")
        rows = fov_rows(span, sensor)[:, None]
        images = [np.where(rows, project(f.truth, sensor).range, 0.0), np.where(rows, f.model_image, 0.0),
                  np.where(rows, project(f.prefix_points, sensor).range, 0.0)]
        strips = [range_image_png(img, max_range=sensor.max_range, scale=4) for img in images]
        canvas = Image.new("RGB", (strips[0].width, sum(s.height + 4 for s in strips)), (255, 255, 255))
        for k, strip in enumerate(strips):
            canvas.paste(strip, (0, k * (strip.height + 4)))
        canvas.save(out_dir / f"real_range_{h}.png")
        logger.info("wrote the %s pictures in %s", label, out_dir)


def format_real(report: dict[str, Any]) -> str:
    """Markdown: one table per prefix length, rows by horizon and method, then the bars."""
    p = report["poses"]
    lines = [f"Real recording `{report['recording']}` ({report['sweeps']} sweeps), poses {p['source']}"
             + (f" (largest gap to the poses file {p['file_gap_m_max']:.2f} m; mean step {p['step_m_registered']:.3f} m "
                f"registered, {p['step_m_file']:.3f} m in the file)" if "file_gap_m_max" in p else "")
             + f"; {report['steps']} sampler steps; model's grid within the real sensor's field of view."]
    for prefix, table in report["tables"].items():
        lines += ["", f"Prefix {prefix} ({len(table['starts'])} starts: {', '.join(table['starts'])}):", "",
                  "| horizon | method | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
        for horizon, rows in table["horizons"].items():
            for method, scores in rows.items():
                cells = " | ".join("–" if scores[k] is None else f"{scores[k]:.3f}" for k in COLUMNS)
                lines.append(f"| {horizon} | {method} | {cells} |")
    lines += ["", "| prefix | horizon | L1 ÷ moved prefix (≤ 1) | Chamfer m² ÷ better baseline | Chamfer m (NN ≤ "
              f"{NEAR_RADIUS:.0f} m) ÷ better baseline | limit | IoU above both |", "|---|---|---|---|---|---|---|"]

    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    for b in report["bars"]:
        lines.append(f"| {b['prefix']} | {b['horizon']} | {b['l1_ratio']:.3f} {mark(b['l1_pass'])} | "
                     f"{b['chamfer_ratio']:.3f} {mark(b['chamfer_pass'])} | {b['chamfer_near_ratio']:.3f} "
                     f"{mark(b['chamfer_near_pass'])} | ≤ {b['chamfer_limit']} | {mark(b['iou_pass'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report_arguments(parser)
    parser.add_argument("--data", default=RealSequenceConfig.data, help="recording folder (KITTI odometry layout, "
                        "a folder with poses.json, or sweeps alone)")
    parser.add_argument("--poses", default="registered", choices=("registered", "file"))
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(PREFIX_LENGTHS), help="sweeps observed")
    parser.add_argument("--horizons", type=int, nargs="+", default=list(HORIZONS), help="frames ahead (10 Hz)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-starts", type=int, default=0, help="most starts per prefix length (0: all)")
    parser.add_argument("--pictures", type=Path, default=None, help="write the BEV and range-image pictures here")
    args = parser.parse_args(argv)
    start_run(args)
    try:
        cfg = RealSequenceConfig(data=args.data, poses=args.poses, prefixes=tuple(args.prefixes),
                                 horizons=tuple(args.horizons), steps=args.steps, max_starts=args.max_starts)
        pipe = load_pipeline(args.model, device="cpu")
        report = evaluate_recording(pipe, cfg, seed=args.seed, pictures=args.pictures)
    except InputError as exc:  # a bad model source, recording or option; anything else is a bug
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return publish_report(report, pipe, args, format_real)


if __name__ == "__main__":
    sys.exit(main())

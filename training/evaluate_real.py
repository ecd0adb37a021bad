"""Forecasts of real recorded drives against the sweeps that followed: `python -m training.evaluate_real --data DIR`.

Every method is scored against the sweep the sensor took, at its full resolution, at the same poses in the
same run (docs/evaluation.md has the protocol and its bars):
1. A recording (`lidar.sequence.open_recording`) is posed by registering all its sweeps with KISS-ICP
   (default: the shared KITTI 00 README measures registration 2-5x tighter than the ground-truth file), or
   by its poses file (`--poses file`). With both available the report gives how far they differ.
2. Settings (`Setting`): a prefix of K consecutive sweeps (K in `PREFIX_LENGTHS`) forecast `HORIZONS` frames
   ahead, and the 4D occupancy forecasting setting on KITTI (`OCC4D_SETTINGS`: 5 sweeps at 5 Hz, 5 future
   sweeps to 1 s and to 3 s). Each start is conditioned on its prefix alone (no map, no layout, nothing fed
   back) with the future poses given. A setting's horizons up to its common span are scored on the same
   starts; a longer horizon on the starts that reach it; one no start reaches is skipped, with the reason.
3. Baselines at the same poses, at full density: the last prefix sweep moved to the target pose; every
   prefix sweep moved there and z-buffered together on the ray grid (`lidar.ray_grid`).
4. Metrics (`training.sweep_scores`, shared with `training.evaluate`'s KITTI pairs): squared Chamfer in the
   4D-Occ region against the whole truth; per-ray L1 and AbsRel along the truth's rays on the rays every
   method returns on, and each method's coverage of the truth's rays; points / the truth's in the region,
   every method within the truth's vertical field of view.
5. Pictures: BEV and a range image on the ray grid, truth | forecast | moved prefix, at the two longest
   horizons of the longest prefix's first start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference import load_pipeline
from inference.pipeline import LidarVersePipeline
from lidar.errors import InputError
from lidar.range_image import elevation_span
from lidar.ray_grid import field_of_view, in_field_of_view, nearest_per_ray, ray_image, span_rows, z_buffer
from lidar.recordings import TOPIC_HELP
from lidar.registration import register_sweeps
from lidar.render import labelled, range_image_png
from lidar.sequence import Recording, open_recording
from lidar.vocabulary import FRAME_RATE_HZ, transform_points
from training.evaluate import bev_panels, publish_report, report_arguments, start_run
from training.sweep_scores import COLUMNS, sweep_scores

logger = logging.getLogger(__name__)

#: Prefix lengths (sweeps observed) and horizons (frames ahead at 10 Hz) of the main protocol.
PREFIX_LENGTHS = (1, 3)
HORIZONS = (1, 3, 5, 10, 30)
#: Frames ahead every start of the main protocol has, so its rows up to 1.0 s compare on the same starts.
COMMON_SPAN = 10
#: A kept range differs from the measured one by float rounding (an encode-decode of the range): 1 mm.
L1_TOLERANCE = 1e-3
MODEL = "model forecast"
LAST_MOVED = "last sweep moved"
PREFIX_MOVED = "every prefix sweep moved"
METHODS = (MODEL, LAST_MOVED, PREFIX_MOVED)
#: Bars of the main protocol: points at 0.1 s, squared Chamfer over the better baseline per horizon (frames).
POINTS_BAR = (1, 0.9)
CHAMFER_BARS = {1: 1.0, 3: 1.0, 5: 0.85, 10: 0.85}
#: Goals beyond the bars (reported, not passed or failed).
CHAMFER_GOALS = {10: 0.6, 30: 0.8}
#: Range (m) at the far end of the range pictures' colour scale.
PICTURE_MAX_RANGE = 80.0


@dataclass(frozen=True)
class Setting:
    """Which sweeps a start observes and which it forecasts."""

    name: str
    #: Sweeps observed, `stride` frames apart; the last one is the start.
    prefix: int
    stride: int
    #: Frames ahead of the start, in increasing order.
    horizons: tuple[int, ...]
    #: Frames ahead every start has: the horizons up to it are scored on the same starts.
    common: int

    @property
    def history(self) -> int:
        """Frames from the first observed sweep to the start."""
        return (self.prefix - 1) * self.stride

    def observed(self, end: int) -> list[int]:
        return [end - self.history + k * self.stride for k in range(self.prefix)]

    def reach(self, horizon: int) -> int:
        """Frames a start must have ahead to be scored at `horizon`."""
        return max(horizon, self.common)


#: The 4D occupancy forecasting setting on KITTI (Khurana et al. 2023): 5 sweeps at 5 Hz observed, 5 future
#: sweeps 0.2 s apart to 1 s, and 0.6 s apart to 3 s, each set scored on the starts with all of it ahead.
OCC4D_SETTINGS = (Setting("4D-Occ 1 s", 5, 2, (2, 4, 6, 8, 10), 10), Setting("4D-Occ 3 s", 5, 2, (6, 12, 18, 24, 30), 30))


@dataclass
class RealSequenceConfig:
    """One real-sequence evaluation; the defaults are the release protocol on the shared KITTI 00 frames."""

    data: str = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00")
    #: The stream to read where `data` is a recording container holding several (a bag's PointCloud2 topic,
    #: a nuScenes log).
    topic: str | None = None
    #: "registered" (KISS-ICP over the whole recording) or "file" (the recording's poses file).
    poses: str = "registered"
    prefixes: tuple[int, ...] = PREFIX_LENGTHS
    horizons: tuple[int, ...] = HORIZONS
    steps: int | None = None
    guidance: float | None = None
    #: Most starts per setting (evenly spread), 0 for all.
    max_starts: int = 0
    #: Also score the 4D-Occ setting where the recording is long enough.
    occ4d: bool = True

    def __post_init__(self) -> None:
        if self.poses not in ("registered", "file"):
            raise InputError(f"poses must be 'registered' or 'file', got {self.poses!r}")
        if not self.prefixes or min(self.prefixes) < 1 or not self.horizons or min(self.horizons) < 1:
            raise InputError(f"prefixes and horizons must be integers >= 1, got {self.prefixes}, {self.horizons}")
        if self.max_starts < 0:
            raise InputError(f"max_starts must be >= 0 (0: every start), got {self.max_starts}")

    def settings(self) -> list[Setting]:
        """The main protocol's settings, one per prefix length."""
        horizons = tuple(sorted(set(self.horizons)))
        common = max([h for h in horizons if h <= COMMON_SPAN], default=horizons[0])
        return [Setting(f"K={k}", k, 1, horizons, common) for k in self.prefixes]


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


#: A recording whose sweep interval is off 1 / FRAME_RATE_HZ by more than this share gets `clock_note`.
CLOCK_TOLERANCE = 0.05


def seconds(horizon: int) -> str:
    return f"{horizon / FRAME_RATE_HZ:.1f} s"


def start_plan(setting: Setting, count: int, limit: int) -> tuple[dict[int, list[int]], list[str]]:
    """Each horizon's starts (last observed sweep indices) in a recording of `count` sweeps, and why any
    horizon has none. The starts with the common span ahead, `limit` of them evenly spread, are every
    horizon's candidates, so the rows up to the common span compare on the same starts."""
    ends = list(range(setting.history, count - setting.common))
    if limit and len(ends) > limit:
        ends = [ends[i] for i in np.linspace(0, len(ends) - 1, limit).round().astype(int)]
    plan = {h: reach for h in setting.horizons if (reach := [e for e in ends if e + setting.reach(h) < count])}
    missing = [h for h in setting.horizons if h not in plan]
    if not missing:
        return plan, []
    spacing = f" {setting.stride} frames apart" if setting.stride > 1 else ""
    what = setting.name if not plan else f"{setting.name} at {', '.join(seconds(h) for h in missing)}"
    need = setting.history + setting.reach(missing[-1]) + 1
    return plan, [f"{what}: {count} sweeps are too few for {setting.prefix} observed{spacing} and "
                  f"{seconds(setting.reach(missing[-1]))} ahead (needs {need})"]


def baselines(world: list[np.ndarray], into: np.ndarray) -> dict[str, np.ndarray]:
    """Both baselines at the target pose (`into`: sensor_from_world), at full density."""
    return {LAST_MOVED: transform_points(world[-1], into),
            PREFIX_MOVED: z_buffer(transform_points(np.concatenate(world), into))}


@dataclass
class Forecast:
    """One start's clouds at one horizon, kept for the pictures."""

    truth: np.ndarray
    model_points: np.ndarray
    prefix_points: np.ndarray


@dataclass
class StartScores:
    """One start's scores per horizon (frames): per method, and the common rays' share."""

    methods: dict[int, dict[str, dict[str, float]]]
    common: dict[int, float]
    kept: dict[int, Forecast]


def forecast_start(pipe: LidarVersePipeline, sweep: Callable[[int], np.ndarray], clock: np.ndarray,
                   poses: np.ndarray, end: int, setting: Setting, horizons: list[int], cfg: RealSequenceConfig,
                   seed: int) -> StartScores:
    """Forecast `horizons` from the setting's prefix ending at `end`; score it and both baselines. `sweep(i)`
    gives sweep i's points, `clock` every sweep's seconds."""
    # 1. the prefix and its world points
    observed = setting.observed(end)
    sweeps, prefix_poses = [sweep(i) for i in observed], poses[observed]
    world = [transform_points(s, p) for s, p in zip(sweeps, prefix_poses, strict=True)]
    # 2. the model, at every target pose in one rollout (frames are independent: nothing is fed back)
    targets = [end + h for h in horizons]
    times, prefix_times = clock[targets] - clock[end], clock[observed] - clock[end]
    result = pipe.forecast(prefix_scans=sweeps, prefix_poses=prefix_poses, prefix_times=prefix_times,
                           poses=poses[targets], times=times, steps=cfg.steps, seed=seed, guidance=cfg.guidance)
    # 3. score against the truth beside both baselines
    scores = StartScores({}, {}, {})
    for h, target, frame in zip(horizons, targets, result.frames, strict=True):
        moved = baselines(world, np.linalg.inv(poses[target]))
        truth = sweep(target)
        scores.methods[h], scores.common[h] = sweep_scores(truth, {MODEL: frame.points, **moved})
        scores.kept[h] = Forecast(truth, frame.points, moved[PREFIX_MOVED])
    return scores


def evaluate_setting(pipe: LidarVersePipeline, rec: Recording, sweep: Callable[[int], np.ndarray],
                     poses: np.ndarray, setting: Setting, cfg: RealSequenceConfig, seed: int,
                     pictures: Path | None) -> tuple[dict[str, Any] | None, list[str]]:
    """One setting's table over its starts (None where no horizon has a start), and what was skipped."""
    plan, skipped = start_plan(setting, len(rec), cfg.max_starts)
    for reason in skipped:
        logger.warning("skipped %s", reason)
    if not plan:
        return None, skipped
    per_start: dict[int, list[StartScores]] = {h: [] for h in plan}
    clock = rec.times if rec.times is not None else np.arange(len(rec)) / FRAME_RATE_HZ
    for end in sorted({e for ends in plan.values() for e in ends}):
        horizons = [h for h in plan if end in plan[h]]
        scores = forecast_start(pipe, sweep, clock, poses, end, setting, horizons, cfg, seed)
        for h in horizons:
            per_start[h].append(scores)
        if pictures is not None and end == plan[min(plan)][0]:
            write_pictures(pictures, scores.kept, rec.names[end], Path(cfg.data).name, pipe.provenance.dtype)
    table = {"prefix": setting.prefix, "stride": setting.stride,
             "starts": {seconds(h): [rec.names[e] for e in plan[h]] for h in plan},
             "common_rays": {seconds(h): _mean([s.common[h] for s in per_start[h]]) for h in plan},
             "horizons": {seconds(h): {m: {k: _mean([s.methods[h][m][k] for s in per_start[h]])
                                           for k in (*COLUMNS, "l1_mean")} for m in METHODS} for h in plan}}
    return table, skipped


def evaluate_recording(pipe: LidarVersePipeline, cfg: RealSequenceConfig, seed: int = 0,
                       pictures: Path | None = None) -> dict[str, Any]:
    """The whole protocol on one recording; returns the JSON-ready report (`format_real` renders it)."""
    rec = open_recording(cfg.data, topic=cfg.topic)
    poses, pose_info = recording_poses(rec, cfg.poses)
    main_settings = cfg.settings()
    extra = OCC4D_SETTINGS if cfg.occ4d else ()
    longest = max(s.history + s.reach(s.horizons[-1]) for s in (*main_settings, *extra)) + 1
    # neighbouring starts share their sweeps: keep a start's worth in memory rather than read them again
    sweep = functools.lru_cache(maxsize=longest)(lambda i: rec.sweep(i).points)
    tables: dict[str, Any] = {}
    occ4d: dict[str, Any] = {}
    skipped: list[str] = []
    picture_prefix = max(cfg.prefixes)
    for setting in (*main_settings, *extra):
        table, why = evaluate_setting(pipe, rec, sweep, poses, setting, cfg, seed,
                                      pictures if setting.name == f"K={picture_prefix}" else None)
        skipped += why
        if table is not None:
            (occ4d if setting in extra else tables)[setting.name] = table
    if not tables:
        raise InputError(f"{cfg.data}: {len(rec)} sweeps are too few for any prefix of {list(cfg.prefixes)} sweeps "
                         f"and {seconds(main_settings[0].common)} ahead")
    bars, goals = real_bars(tables)
    interval = float(np.median(np.diff(rec.times))) if rec.times is not None and len(rec) > 1 else None
    return {"recording": Path(cfg.data).name, "sweeps": len(rec), "sweep_interval_s": interval, "poses": pose_info,
            "protocol": asdict(cfg), "steps": cfg.steps or pipe.config.default_steps, "tables": tables,
            "occ4d": occ4d, "skipped": skipped, "bars": bars, "goals": goals}


def clock_note(interval: float | None) -> str | None:
    """What the horizons' labels mean for a recording whose sweeps are not 1 / `FRAME_RATE_HZ` apart (a Velodyne
    capture at 11.7 Hz): a horizon counts sweeps, and the model is asked for the sweeps' own times."""
    if interval is None or not math.isfinite(interval) or interval <= 0.0:
        return None  # no clock to speak of: the sweeps are placed at the protocol's 10 Hz
    if abs(interval * FRAME_RATE_HZ - 1.0) <= CLOCK_TOLERANCE:
        return None
    return (f"This recording's sweeps are {interval:.3f} s apart, not {1.0 / FRAME_RATE_HZ:.1f}: a horizon counts "
            f"sweeps, labelled at {FRAME_RATE_HZ:g} Hz, so \"{seconds(1)}\" is one sweep ahead ({interval:.3f} s here), "
            "and each forecast is made for its sweep's own time.")


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def real_bars(tables: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bars per prefix length and horizon (`POINTS_BAR`, `CHAMFER_BARS`, per-ray L1 on common rays at most
    the moved prefix's at every horizon) and the goals (`CHAMFER_GOALS`)."""
    bars, goals = [], []
    for prefix, table in tables.items():
        for horizon, rows in table["horizons"].items():
            frames = round(float(horizon.split()[0]) * FRAME_RATE_HZ)
            m, last, pre = rows[MODEL], rows[LAST_MOVED], rows[PREFIX_MOVED]
            chamfer = _ratio(m["chamfer"], min(last["chamfer"], pre["chamfer"]))
            l1 = _ratio(m["l1_median"], pre["l1_median"])
            bar: dict[str, Any] = {
                "prefix": prefix, "horizon": horizon, "points_ratio": m["points"], "chamfer_ratio": chamfer,
                "l1_ratio": l1, "l1_pass": l1 is not None and m["l1_median"] <= pre["l1_median"] + L1_TOLERANCE}
            if frames == POINTS_BAR[0]:
                bar.update(points_limit=POINTS_BAR[1], points_pass=m["points"] >= POINTS_BAR[1])
            if frames in CHAMFER_BARS:
                bar.update(chamfer_limit=CHAMFER_BARS[frames],
                           chamfer_pass=chamfer is not None and chamfer <= CHAMFER_BARS[frames])
            bars.append(bar)
            if frames in CHAMFER_GOALS:
                goals.append({"prefix": prefix, "horizon": horizon, "chamfer_ratio": chamfer,
                              "chamfer_goal": CHAMFER_GOALS[frames],
                              "met": chamfer is not None and chamfer <= CHAMFER_GOALS[frames]})
    return bars, goals


def recording_slug(recording: str) -> str:
    """`recording` (its folder's name) as its pictures' files name it: lower case, a dash for anything else."""
    return re.sub(r"[^a-z0-9_-]+", "-", recording.lower()) or "recording"


def picture_names(recording: str, frames: int, dtype: str = "float32") -> tuple[str, str]:
    """The BEV and range-image files of `recording` `frames` ahead: named by the recording (and the model's
    dtype where it is not float32), so one release folder holds the pictures of every recording and dtype it was
    evaluated on."""
    stem = f"{recording_slug(recording)}_{{}}_{frames}" + ("" if dtype == "float32" else f"_{dtype}")
    return f"real_{stem.format('bev')}.png", f"real_{stem.format('range')}.png"


def write_pictures(out_dir: Path, kept: dict[int, Forecast], start: str, recording: str,
                   dtype: str = "float32") -> None:
    """`picture_names(recording, h, dtype)`: truth | forecast | moved prefix at the two longest horizons, every point
    drawn (the range images on the ray grid, rows cropped to the truth's elevation span)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for h in sorted(kept)[-2:]:
        f, label = kept[h], f"{seconds(h)} after {Path(start).stem}"
        span = field_of_view(elevation_span(f.truth))
        model, prefix = (c[in_field_of_view(c, span)] for c in (f.model_points, f.prefix_points))
        clouds = {f"truth, {label} ({len(f.truth):,} points)": f.truth,
                  f"{MODEL} ({len(model):,})": model, f"{PREFIX_MOVED} ({len(prefix):,})": prefix}
        bev_name, range_name = picture_names(recording, h, dtype)
        bev_panels(list(clouds.items())).save(out_dir / bev_name)
        rows = span_rows(span)
        strips = {name: range_image_png(ray_image(nearest_per_ray(c), rows), max_range=PICTURE_MAX_RANGE, scale=2)
                  for name, c in clouds.items()}
        labelled(list(strips.items()), across=False).save(out_dir / range_name)
        logger.info("wrote the %s pictures in %s", label, out_dir)


def _cell(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _starts_line(name: str, table: dict[str, Any]) -> str:
    counts = ", ".join(f"{h}: {len(s)}" for h, s in table["starts"].items())
    first = next(iter(table["starts"].values()))
    spacing = f", every {table['stride']} frames" if table["stride"] > 1 else ""
    sweeps = "1 sweep" if table["prefix"] == 1 else f"{table['prefix']} sweeps"
    return (f"{name}: {sweeps} observed{spacing}; starts {first[0]}-{first[-1]} (per horizon "
            f"{counts}):")


def format_table(name: str, table: dict[str, Any]) -> list[str]:
    """One setting's rows by horizon and method; the common rays' share beside each horizon."""
    lines = ["", _starts_line(name, table), "",
             "| horizon | common rays | method | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 3) + "|"]
    for horizon, rows in table["horizons"].items():
        common = table["common_rays"][horizon]
        for k, (method, scores) in enumerate(rows.items()):
            cells = " | ".join(_cell(scores[c]) for c in COLUMNS)
            first = f"{horizon} | {_cell(None if common is None else common * 100, 1)} %" if k == 0 else " | "
            lines.append(f"| {first} | {method} | {cells} |")
    return lines


def format_bars(report: dict[str, Any]) -> list[str]:
    def mark(ok: bool | None) -> str:
        return "" if ok is None else (" ✓" if ok else " ✗")

    lines = ["", "| prefix | horizon | points ÷ truth's (bar) | Chamfer ÷ better baseline (bar) | L1 ÷ moved prefix (≤ 1) |",
             "|---|---|---|---|---|"]
    for b in report["bars"]:
        points = _cell(b["points_ratio"]) + (f" (≥ {b['points_limit']}){mark(b['points_pass'])}"
                                             if "points_limit" in b else "")
        chamfer = _cell(b["chamfer_ratio"]) + (f" (≤ {b['chamfer_limit']}){mark(b['chamfer_pass'])}"
                                               if "chamfer_limit" in b else "")
        lines.append(f"| {b['prefix']} | {b['horizon']} | {points} | {chamfer} | {_cell(b['l1_ratio'])}"
                     f"{mark(b['l1_pass'])} |")
    if report["goals"]:
        lines += ["", "Goals (not bars): " + "; ".join(
            f"{g['prefix']} at {g['horizon']}: Chamfer ÷ better baseline {_cell(g['chamfer_ratio'])} "
            f"(goal ≤ {g['chamfer_goal']}){mark(g['met'])}" for g in report["goals"])]
    return lines


def format_real(report: dict[str, Any]) -> str:
    """Markdown: one table per setting, rows by horizon and method, then the bars and what was skipped."""
    p = report["poses"]
    lines = [f"Real recording `{report['recording']}` ({report['sweeps']} sweeps), poses {p['source']}"
             + (f" (largest gap to the poses file {p['file_gap_m_max']:.2f} m; mean step {p['step_m_registered']:.3f} m "
                f"registered, {p['step_m_file']:.3f} m in the file)" if "file_gap_m_max" in p else "")
             + f"; {report['steps']} sampler steps; scored against the full-resolution sweeps."]
    if note := clock_note(report.get("sweep_interval_s")):
        lines += ["", note]
    for name, table in report["tables"].items():
        lines += format_table(f"Prefix {name}", table)
    lines += format_bars(report)
    for name, table in report.get("occ4d", {}).items():
        lines += format_table(f"{name} (4D occupancy forecasting setting, future poses given)", table)
    if report.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(report["skipped"]) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report_arguments(parser)
    parser.add_argument("--data", default=RealSequenceConfig.data, help="recording folder (KITTI odometry or raw "
                        "layout, a folder with poses.json, or sweeps alone) or recording (a Velodyne or Ouster "
                        "pcap, a ROS bag, an MCAP, a nuScenes root, an Argoverse 2 log)")
    parser.add_argument("--topic", default=None, help=TOPIC_HELP)
    parser.add_argument("--poses", default="registered", choices=("registered", "file"))
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(PREFIX_LENGTHS), help="sweeps observed")
    parser.add_argument("--horizons", type=int, nargs="+", default=list(HORIZONS), help="frames ahead (10 Hz)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-starts", type=int, default=0, help="most starts per setting (0: all)")
    parser.add_argument("--no-occ4d", action="store_true", help="skip the 4D occupancy forecasting setting")
    parser.add_argument("--pictures", type=Path, default=None, help="write the BEV and range-image pictures here")
    args = parser.parse_args(argv)
    start_run(args)
    try:
        cfg = RealSequenceConfig(data=args.data, topic=args.topic, poses=args.poses, prefixes=tuple(args.prefixes),
                                 horizons=tuple(args.horizons), steps=args.steps, max_starts=args.max_starts,
                                 occ4d=not args.no_occ4d)
        pipe = load_pipeline(args.model, device="cpu", dtype=args.dtype)
        report = evaluate_recording(pipe, cfg, seed=args.seed, pictures=args.pictures)
    except InputError as exc:  # a bad model source, recording or option; anything else is a bug
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return publish_report(report, pipe, args, format_real)


if __name__ == "__main__":
    sys.exit(main())

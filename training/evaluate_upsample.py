"""Beam upsampling and completion on real sweeps: `python -m training.evaluate_upsample [--data PATH ...]`.

Every method fills the same rays of the same sweeps, through `inference.upsample.upsample`, and is scored
against what the sensor measured there (docs/evaluation.md, "Upsampling", has the protocol and its bars):
1. Sweeps: the shared real KITTI sweeps by default (`real_seq/kitti00` and the KITTI files of
   `real_scans`), each once (byte-identical files are one sweep). Each is read on its own geometry
   (`lidar.formats.sweep_geometry`: its measured 64 beams by ~2,010 columns); that grid, with every point
   on its own beam's row, is the truth.
2. Settings (`SETTINGS`): every 4th ring kept (16 of a KITTI sweep's 64), every 2nd, and 50 % or 90 % of the
   grid's rays dropped at random (returning or not, so a dropped sky ray must come back silent). The
   dropped rings or rays, in the columns the sweep returns on, are the mask to fill, on the sweep's own
   table.
3. Methods: nearest kept ring and linear between kept rings (the baselines), the edge-aware planar fill,
   the learned fill (where the release ships its network) and the world model's fill.
4. Metrics on the rays to fill: MAE and median absolute error of the range (m) where both the method and
   the truth return, and the return IoU; the squared Chamfer (`lidar.metrics.forecast_chamfer`, 4D-Occ
   region) of the whole cloud (the kept points and the filled ones) against the whole sweep; sweeps per
   second. Each is the mean over sweeps.
5. Pictures of the first sweep, every point drawn: BEV and range images, given | each fill | truth; and of a
   real sparse sweep (`SPARSE_EXAMPLE`, a VLP-16's revolution) made `DEFAULT_FACTOR` times denser, given | each
   fill, which has no denser truth to score against but shows what a 16-beam lab gets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from inference import load_pipeline
from inference.fill_network import fill_metadata
from inference.pipeline import LidarVersePipeline
from inference.upsample import DEFAULT_FACTOR, EDGE_AWARE, LEARNED, LINEAR, MODEL, NEAREST, UpsampleResult
from lidar.errors import InputError
from lidar.formats import READ_SUFFIXES, Scan, read_points, sweep_geometry
from lidar.formats.detect import ROWS_FROM_PRESET, SweepGeometry
from lidar.metrics import forecast_chamfer
from lidar.range_image import RangeImage, azimuth_columns, project
from lidar.real_scans import example_scans_dir, real_scans_dir
from lidar.render import labelled, range_image_png
from lidar.sequence import open_recording
from training.evaluate import bev_panels, publish_report, report_arguments, start_run
from training.evaluate_real import PICTURE_MAX_RANGE

logger = logging.getLogger(__name__)

SHARED = real_scans_dir().parent
#: The shared real KITTI sweeps: a drive's consecutive sweeps and the single scans.
DEFAULT_DATA = (str(SHARED / "real_seq" / "kitti00" / "velodyne"), *(str(p) for p in sorted(SHARED.glob("real_scans/kitti_*.bin"))))
#: A real sparse sweep for the pictures: the shipped copy of a VLP-16 capture (its one revolution), so a clone
#: without the shared data still draws them.
SPARSE_EXAMPLE = example_scans_dir() / "velodyne_vlp16.pcap"
SPARSE_BEAMS = 16
SPARSE_CAPTION = (f"a real VLP-16 sweep made {DEFAULT_FACTOR}x denser "
                  f"({SPARSE_BEAMS} beams to {(SPARSE_BEAMS - 1) * DEFAULT_FACTOR + 1})")
#: The methods compared; "learned" where the release ships a fill network.
METHODS = (NEAREST, LINEAR, EDGE_AWARE, LEARNED, MODEL)
BASELINE = LINEAR
#: Report key -> table header.
COLUMNS = {"mae": "MAE (m) ↓", "median": "median AE (m) ↓", "iou": "return IoU ↑", "chamfer": "Chamfer (m², 4D-Occ) ↓",
           "sweeps_per_s": "sweeps/s ↑"}
#: The bars of the every-4th-ring setting (16 of 64 on KITTI), against the baseline: MAE and Chamfer at most
#: these ratios, IoU at least 1.
MAE_BAR, CHAMFER_BAR, IOU_BAR = 0.8, 0.8, 1.0
#: Goals beyond the bars (reported, not passed or failed): ratios, and sweeps per second on one thread.
MAE_GOAL, CHAMFER_GOAL, SPEED_GOAL = 0.6, 0.6, 5.0
#: Fewest measured beams a sweep needs to keep one in four of them and still have rows to fill between.
MIN_BEAMS = 8


@dataclass(frozen=True)
class Setting:
    """Which rays of a sweep are given: every `every`-th ring, or all but a random share `drop` of the rays."""

    name: str
    every: int = 1
    drop: float = 0.0

    def mask(self, truth: RangeImage, rng: np.random.Generator) -> np.ndarray:
        """(H, W) the rays to fill, in the columns the sweep returns on (a sweep cropped to a camera's view has
        no rays to fill outside it)."""
        shape = truth.shape
        if self.drop:
            fill = rng.random(shape) < self.drop
        else:
            fill = np.broadcast_to((np.arange(shape[0]) % self.every != 0)[:, None], shape)
        return fill & truth.mask.any(axis=0)[None, :]


SETTINGS = (Setting("every 4th ring kept", every=4), Setting("every 2nd ring kept", every=2),
            Setting("50 % of rays dropped", drop=0.5), Setting("90 % of rays dropped", drop=0.9))
#: The setting the bars are on.
BAR_SETTING = SETTINGS[0].name


@dataclass
class UpsampleEvalConfig:
    """One evaluation; the defaults are the protocol on the shared KITTI sweeps."""

    data: tuple[str, ...] = DEFAULT_DATA
    methods: tuple[str, ...] = METHODS
    steps: int | None = None
    #: Most sweeps (evenly spread), 0 for all.
    max_sweeps: int = 0
    #: The sparse sweep the pictures show made denser (a recording or a sweep file); skipped where it is missing.
    sparse_example: str = str(SPARSE_EXAMPLE)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise InputError(f"methods must be some of {', '.join(METHODS)}, got {unknown or 'none'}")
        if self.max_sweeps < 0:
            raise InputError(f"max_sweeps must be >= 0 (0: every sweep), got {self.max_sweeps}")


@dataclass
class Sweep:
    """One real sweep, its own geometry and the truth on its grid."""

    name: str
    scan: Scan
    geometry: SweepGeometry
    truth: RangeImage

    def given(self, fill: np.ndarray) -> Scan:
        """The sweep without the points on the rays to fill (nor those on no measured beam), rings kept."""
        sensor = self.geometry.sensor
        rows = self.geometry.rows
        pixels = np.maximum(rows, 0) * sensor.width + azimuth_columns(self.scan.points[:, :2], sensor.width)
        keep = (rows >= 0) & ~fill.reshape(-1)[pixels]
        return Scan(points=self.scan.points[keep], ring=rows[keep], ring_source="file", path=self.scan.path)


def _digest(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def sweep_files(data: tuple[str, ...]) -> tuple[dict[Path, str], list[str]]:
    """The sweep files of `data` (files, or folders of them), each content once, with their content digests, and
    the duplicates skipped."""
    files: list[Path] = []
    for entry in map(Path, data):
        if entry.is_dir():
            files += sorted(p for p in entry.iterdir() if p.suffix.lower() in READ_SUFFIXES)
        elif entry.is_file():
            files.append(entry)
        else:
            raise InputError(f"--data {entry}: no such file or folder; expected sweep files or folders of them")
    seen: dict[str, Path] = {}
    kept: dict[Path, str] = {}
    duplicates = []
    for path in files:
        digest = _digest(path)
        if digest in seen:
            duplicates.append(f"{path.name} (= {seen[digest].name})")
        else:
            seen[digest] = path
            kept[path] = digest
    return kept, duplicates


def load_sweep(path: Path) -> Sweep | str:
    """The sweep at `path` on its own geometry, or why it cannot be scored."""
    return sweep_of(read_points(path), path.name)


def sweep_of(scan: Scan, name: str) -> Sweep | str:
    """`scan` on its own geometry, or why it cannot be scored."""
    geometry = sweep_geometry(scan)
    if geometry is None or geometry.source == ROWS_FROM_PRESET:
        return f"{name}: no beams recovered"
    if geometry.sensor.height < MIN_BEAMS:
        return f"{name}: {geometry.sensor.height} beams, fewer than {MIN_BEAMS}"
    truth = project(scan.points, geometry.sensor, ring=geometry.rows)
    return Sweep(name, scan, geometry, truth)


def scores(result: UpsampleResult, sweep: Sweep) -> dict[str, float]:
    """The metrics of one method on one sweep's rays to fill (`result.mask`), and its Chamfer and time."""
    fill, pred, truth = result.mask, result.image, sweep.truth
    both = fill & pred.mask & truth.mask
    either = fill & (pred.mask | truth.mask)
    error = np.abs(pred.range - truth.range)[both].astype(np.float64)
    return {
        "mae": float(error.mean()) if error.size else float("nan"),
        "median": float(np.median(error)) if error.size else float("nan"),
        "iou": float(both.sum() / either.sum()) if either.any() else float("nan"),
        "chamfer": forecast_chamfer(result.points, sweep.scan.points),
        "seconds": result.timings["total"],
    }


def evaluate_sweep(pipe: LidarVersePipeline, sweep: Sweep, index: int, cfg: UpsampleEvalConfig,
                   seed: int) -> dict[str, dict[str, UpsampleResult]]:
    """Every setting and method on one sweep: the results, for its scores and pictures."""
    out: dict[str, dict[str, UpsampleResult]] = {}
    for k, setting in enumerate(SETTINGS):
        fill = setting.mask(sweep.truth, np.random.default_rng([seed, index, k]))
        given = sweep.given(fill)
        out[setting.name] = {m: pipe.upsample(given, sensor=sweep.geometry.sensor, mask=fill, method=m,
                                              steps=cfg.steps, seed=seed) for m in cfg.methods}
    return out


def summarise(rows: list[dict[str, Any]], methods: tuple[str, ...]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per setting and method, the mean of each metric over sweeps and the sweeps per second."""
    tables: dict[str, dict[str, dict[str, float | None]]] = {}
    for setting in SETTINGS:
        table = tables.setdefault(setting.name, {})
        for method in methods:
            picked = [r["scores"][setting.name][method] for r in rows]
            means = {k: _mean([p[k] for p in picked]) for k in ("mae", "median", "iou", "chamfer")}
            seconds = sum(p["seconds"] for p in picked)
            table[method] = {**means, "sweeps_per_s": len(picked) / seconds if seconds > 0 else None}
    return tables


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def bars(tables: dict[str, dict[str, dict[str, float | None]]]) -> list[dict[str, Any]]:
    """Each non-baseline method of `BAR_SETTING` against the baseline: the bars, the goals and the speed."""
    table = tables[BAR_SETTING]
    base = table[BASELINE]
    out = []
    for method, row in table.items():
        if method in (BASELINE, NEAREST):
            continue
        mae, chamfer = _ratio(row["mae"], base["mae"]), _ratio(row["chamfer"], base["chamfer"])
        iou = _ratio(row["iou"], base["iou"])
        speed = row["sweeps_per_s"]
        out.append({
            "method": method, "mae_ratio": mae, "chamfer_ratio": chamfer, "iou_ratio": iou, "sweeps_per_s": speed,
            "mae_pass": None if mae is None else mae <= MAE_BAR,
            "chamfer_pass": None if chamfer is None else chamfer <= CHAMFER_BAR,
            "iou_pass": None if iou is None else iou >= IOU_BAR,
            "goal_met": None if None in (mae, chamfer, speed) else (mae <= MAE_GOAL and chamfer <= CHAMFER_GOAL
                                                                     and speed >= SPEED_GOAL),
        })
    return out


def write_pictures(out_dir: Path, sweep: Sweep, results: dict[str, dict[str, UpsampleResult]]) -> list[Path]:
    """`upsample_bev_<k>.png` and `upsample_range_<k>.png` per setting k: given | each fill | truth, every point
    (the range images on the sweep's own grid)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for k, (setting, by_method) in enumerate(results.items()):
        first = next(iter(by_method.values()))
        given = first.points[: first.input_count]
        clouds = {f"given, {setting} ({len(given):,})": given}
        clouds |= {f"{m} ({len(r.points):,})": r.points for m, r in by_method.items()}
        clouds[f"truth ({len(sweep.scan.points):,})"] = sweep.scan.points
        bev = out_dir / f"upsample_bev_{k}.png"
        bev_panels(list(clouds.items())).save(bev)
        images = {f"given: {setting}": first.given} | {m: r.image for m, r in by_method.items()}
        images["truth"] = sweep.truth
        strips = {label: range_image_png(image, max_range=PICTURE_MAX_RANGE, scale=2) for label, image in images.items()}
        strip = out_dir / f"upsample_range_{k}.png"
        labelled(list(strips.items()), across=False).save(strip)
        written += [bev, strip]
    logger.info("wrote %d pictures to %s", len(written), out_dir)
    return written


def write_sparse_pictures(out_dir: Path, pipe: LidarVersePipeline, cfg: UpsampleEvalConfig, seed: int) -> list[Path]:
    """`upsample_bev_sparse.png` and `upsample_range_sparse.png`: the first sweep of `cfg.sparse_example` (a
    recording or a sweep file) given | each method at `DEFAULT_FACTOR`, every point; none where it is missing."""
    example = Path(cfg.sparse_example)
    if not example.exists():
        logger.warning("no sparse example at %s: its pictures are skipped", example)
        return []
    scan = open_recording(example).sweep(0) if example.suffix.lower() not in READ_SUFFIXES else read_points(example)
    results = {m: pipe.upsample(scan, DEFAULT_FACTOR, method=m, steps=cfg.steps, seed=seed) for m in cfg.methods}
    first = next(iter(results.values()))
    rows = f"{first.sensor.height} x {first.sensor.width}"
    clouds = {f"given: {example.name} ({first.input_count:,} points)": scan.points}
    clouds |= {f"{m} on {rows} ({len(r.points):,})": r.points for m, r in results.items()}
    images = {"given": first.given} | {m: r.image for m, r in results.items()}
    strips = {label: range_image_png(image, max_range=PICTURE_MAX_RANGE, scale=4) for label, image in images.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    bev, strip = out_dir / "upsample_bev_sparse.png", out_dir / "upsample_range_sparse.png"
    bev_panels(list(clouds.items())).save(bev)
    labelled(list(strips.items()), across=False).save(strip)
    return [bev, strip]


def fill_summary(pipe: LidarVersePipeline) -> dict[str, Any] | None:
    """What the release's fill network is and was trained on (its file's metadata), for the report."""
    if pipe.fill_network is None or pipe.provenance.fill is None:
        return None
    meta = fill_metadata(pipe.provenance.fill)
    config = json.loads(meta.get("config", "{}"))
    return {"parameters": sum(p.numel() for p in pipe.fill_network.parameters()), "steps": int(meta.get("steps", 0)),
            "real": config.get("real", []), "sim": config.get("sim", []), "camera_view": config.get("camera_view"),
            "every": config.get("every", []), "sensors": list(pipe.fill_network.sensors or [])}


def training_digests(fill: dict[str, Any] | None) -> set[str] | None:
    """The content digests of the real sweeps a fill network learnt from (`fill_summary`'s `real`, relative to
    the working directory), or None where there is no network or its data is not here to compare."""
    if fill is None:
        return None
    try:
        return set(sweep_files(tuple(fill["real"]))[0].values())
    except InputError:
        return None


def evaluate(pipe: LidarVersePipeline, cfg: UpsampleEvalConfig, seed: int = 0,
             pictures: Path | None = None) -> dict[str, Any]:
    """Run the protocol; returns the JSON-ready report. Each row says whether the fill network learnt from its
    sweep (`in_training`, by content; None where that cannot be told): a figure there is a fit. The pictures
    show the first sweep it did not learn from, else the first sweep."""
    start = time.perf_counter()
    without = [m for m in cfg.methods if m == LEARNED and pipe.fill_network is None]
    if without:
        logger.warning("the model ships no fill network: method %s is left out", LEARNED)
        if set(cfg.methods) <= set(without):
            raise InputError(f"method {LEARNED} needs a fill network and the model ships none; add another method")
        cfg = replace(cfg, methods=tuple(m for m in cfg.methods if m not in without))
    digests, duplicates = sweep_files(cfg.data)
    files = list(digests)
    if cfg.max_sweeps and len(files) > cfg.max_sweeps:
        files = [files[i] for i in np.linspace(0, len(files) - 1, cfg.max_sweeps).round().astype(int)]
    fill = fill_summary(pipe)
    learnt = training_digests(fill)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    pictured: Sweep | None = None
    first: tuple[Sweep, dict[str, dict[str, UpsampleResult]]] | None = None
    for index, path in enumerate(files):
        sweep = load_sweep(path)
        if isinstance(sweep, str):
            skipped.append(sweep)
            continue
        results = evaluate_sweep(pipe, sweep, index, cfg, seed)
        in_training = None if learnt is None else digests[path] in learnt
        if pictures is not None and pictured is None:
            if not in_training:
                write_pictures(pictures, sweep, results)
                pictured = sweep
            elif first is None:
                first = (sweep, results)  # pictured if every sweep was learnt from
        rows.append({"sweep": sweep.name, "shape": list(sweep.truth.shape), "in_training": in_training,
                     "scores": {s: {m: scores(r, sweep) for m, r in by.items()} for s, by in results.items()}})
        logger.info("%s: %s", sweep.name, {m: round(r["mae"], 3) for m, r in rows[-1]["scores"][BAR_SETTING].items()})
    if not rows:
        raise InputError(f"no sweep of {', '.join(cfg.data)} could be scored: {'; '.join(skipped) or 'none found'}")
    if pictures is not None and pictured is None and first is not None:
        write_pictures(pictures, *first)
        pictured = first[0]
    if fill is not None:
        fill["scored_in_training"] = None if learnt is None else [r["sweep"] for r in rows if r["in_training"]]
    if pictures is not None:
        write_sparse_pictures(pictures, pipe, cfg, seed)
    tables = summarise(rows, cfg.methods)
    return {
        "protocol": {**asdict(cfg), "left_out": without, "settings": [asdict(s) for s in SETTINGS], "seed": seed,
                     "steps": cfg.steps or pipe.config.default_steps, "baseline": BASELINE, "bar_setting": BAR_SETTING,
                     "sweeps": [r["sweep"] for r in rows], "duplicates": duplicates, "skipped": skipped,
                     "pictured": None if pictured is None else pictured.name},
        "tables": tables,
        "bars": bars(tables) if BASELINE in cfg.methods else [],
        "fill_network": fill,
        "per_sweep": rows,
        "timings": {"total_s": time.perf_counter() - start},
    }


def _seen(names: list[str] | None) -> str:
    if names is None:
        return "its training sweeps are not here to compare with the sweeps scored here"
    if not names:
        return "none of the sweeps scored here"
    return f"{len(names)} of the sweeps scored here were among them, so their figures are a fit ({', '.join(names)})"


def _unseen_line(report: dict[str, Any]) -> list[str]:
    """Where some scored sweeps were training sweeps, the bar setting's MAE on the others alone: what a sweep
    the network never saw gets."""
    marks = [r.get("in_training") for r in report["per_sweep"]]
    rows = [r for r, seen in zip(report["per_sweep"], marks, strict=True) if seen is False] if any(marks) else []
    methods = [m for m in (BASELINE, EDGE_AWARE, LEARNED) if rows and m in rows[0]["scores"][BAR_SETTING]]
    if not rows or LEARNED not in methods:
        return []
    mae = {m: _mean([r["scores"][BAR_SETTING][m]["mae"] for r in rows]) for m in methods}
    others = ", ".join(f"{m} {_cell(mae[m])} m" for m in methods if m != LEARNED)
    ratio = _ratio(mae[LEARNED], mae.get(BASELINE))
    return [f"On the {len(rows)} scored sweeps it did not learn from ({', '.join(r['sweep'] for r in rows)}), "
            f"{BAR_SETTING}: learned MAE {_cell(mae[LEARNED])} m against {others}"
            + (f" ({_cell(ratio)}× {BASELINE}'s)." if ratio is not None else ".")]


def _cell(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


def format_report(report: dict[str, Any]) -> str:
    """Markdown: the protocol in a sentence, one table per setting, the bars."""
    p = report["protocol"]
    shapes = sorted({f"{r['shape'][0]} x {r['shape'][1]}" for r in report["per_sweep"]})
    lines = [f"{len(p['sweeps'])} real sweeps on their own grids ({', '.join(shapes)}); {p['steps']} sampler steps for "
             f"the model, seed {p['seed']}; scored on the rays to fill, Chamfer on the whole cloud. "
             f"Wall time {report['timings']['total_s'] / 60:.1f} min."]
    if p["duplicates"]:
        lines.append(f"Byte-identical files counted once: {', '.join(p['duplicates'])}.")
    if p["skipped"]:
        lines.append(f"Skipped: {'; '.join(p['skipped'])}.")
    fill = report.get("fill_network")
    if fill:
        data = [f"`{d}`" for d in fill["real"] + fill["sim"]]
        views = " (each also cut to a camera's view)" if fill["camera_view"] else ""
        lines.append(f"The learned fill: a {fill['parameters'] / 1e6:.2f} M-parameter network trained "
                     f"(`python -m training.train_fill`) for {fill['steps']:,} steps on {', '.join(data)}{views}, every "
                     f"{' or '.join(map(str, fill['every']))} rings kept; {_seen(fill.get('scored_in_training'))}.")
        if fill.get("sensors"):
            lines.append(f"It is the default fill for new beams of sweeps from sensors like {', '.join(fill['sensors'])} "
                         "(those it learnt from), the edge-aware fill for other sensors' (docs/upsampling.md).")
        lines += _unseen_line(report)
    if p.get("left_out"):
        lines.append(f"Left out (the model ships no fill network): {', '.join(p['left_out'])}.")
    pictured = next((r for r in report["per_sweep"] if p.get("pictured") and r["sweep"] == p["pictured"]), None)
    if pictured is not None:
        unseen = {False: ", a sweep the fill network did not learn from", True: ", a sweep the fill network learnt from"}
        lines.append(f"The pictures show {pictured['sweep']}{unseen.get(pictured['in_training'], '')}.")
    for setting, table in report["tables"].items():
        lines += ["", f"{setting}:", "", "| method | " + " | ".join(COLUMNS.values()) + " |",
                  "|---" * (len(COLUMNS) + 1) + "|"]
        for method, row in table.items():
            lines.append(f"| {method} | " + " | ".join(_cell(row[c], 4 if c == "chamfer" else 3) for c in COLUMNS) + " |")
    if report["bars"]:
        lines += ["", f"Bars on {p['bar_setting']}, against {p['baseline']}:", "",
                  f"| method | MAE ÷ {p['baseline']}'s (≤ {MAE_BAR}) | Chamfer ÷ (≤ {CHAMFER_BAR}) | IoU ÷ (≥ {IOU_BAR}) "
                  f"| goal (≤ {MAE_GOAL}, ≤ {CHAMFER_GOAL}, ≥ {SPEED_GOAL} sweeps/s) |", "|---|---|---|---|---|"]
        for b in report["bars"]:
            lines.append(f"| {b['method']} | {_cell(b['mae_ratio'])}{_mark(b['mae_pass'])} | "
                         f"{_cell(b['chamfer_ratio'])}{_mark(b['chamfer_pass'])} | {_cell(b['iou_ratio'])}"
                         f"{_mark(b['iou_pass'])} | {_mark(b['goal_met']).strip() or '–'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report_arguments(parser)
    parser.add_argument("--data", nargs="+", default=list(DEFAULT_DATA),
                        help="sweep files or folders of them (default: the shared real KITTI sweeps)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=None, help="sampler steps of the model (default: the model's)")
    parser.add_argument("--max-sweeps", type=int, default=0, help="most sweeps, evenly spread (default: all)")
    parser.add_argument("--pictures", type=Path, default=None, help="write the BEV and range-image pictures here")
    args = parser.parse_args(argv)
    start_run(args)
    try:
        cfg = UpsampleEvalConfig(data=tuple(args.data), methods=tuple(args.methods), steps=args.steps,
                                 max_sweeps=args.max_sweeps)
        pipe = load_pipeline(args.model, device="cpu", dtype=args.dtype)
        report = evaluate(pipe, cfg, seed=args.seed, pictures=args.pictures)
    except InputError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return publish_report(report, pipe, args, format_report)


if __name__ == "__main__":
    sys.exit(main())

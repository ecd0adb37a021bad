"""Native-resolution speed: a whole frame at 64x2048 against its bare network passes, and where the rest goes.

Timed in the same run, alternating, on one torch thread by default:
- the bare network: what the network computes for one frame at 64x2048, on the condition of the call's last
  frame: `model.prepare(cond)` once (the condition's share of the stem convolution, 18 of its 23 ms, and the
  prior) and the sampler's steps of `model(x, t, prepared)`; nothing else. The share is also printed with the
  steps alone as the network, for comparison with figures that count only them;
- a forecast of one real KITTI sweep, `--frames` frames and 1 frame (the once-per-call set-up on a single
  frame), in the sweep's own geometry (`LidarVersePipeline.forecast` from its file pose: the measured sensor,
  the cache, the measurement kept, the additions settled);
- a `generate_world` frame on an HDL-64E at 2048 columns (the world is built once, outside the timing; the
  drive's frames after the first see the cache of those before).

End-to-end is the pipeline call's wall time per frame; "bare / end-to-end" is the share of a frame the
network takes. Each figure is the fastest of `--repeats` runs: on a shared machine other jobs only ever add
time, and the fastest run is the one they touched least. The split charges each stage's own time, less the stages it calls (exclusive), so the rows
add up to the frame; "other" is what no named stage holds. `--profile N` also prints cProfile's N costliest
functions per call (own time), which is what the stage rows are made of.

    python -m bench.native_bench [--model SRC] [--data DIR] [--steps 1 2 4] [--frames 3] [--repeats 5]
                                 [--threads 1] [--profile 0]
"""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core unless told: on a shared 2-core machine its matrix products then
# run 4x slower (a 124 k-point pose product 39 ms against 9 ms), and `torch.set_num_threads` does not reach it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import cProfile
import io
import pstats
import resource
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import inference.cache as cache_module
import inference.conditioning as conditioning_module
import inference.measured as measured_module
import inference.pipeline as pipeline_module
import inference.rollout as rollout_module
import lidar.formats.detect as detect_module
import lidar.sim.hdmap as hdmap_module
from inference import LidarVersePipeline, load_pipeline
from inference.flow import FlowMatchSampler
from inference.network import IMAGE_CHANNELS, PreparedCondition
from lidar.errors import InputError
from lidar.sensors import HDL64
from lidar.sequence import open_recording
from lidar.sim import World, make_world
from training.evaluate_real import RealSequenceConfig

#: The issue's grid: KITTI's HDL-64E at the 2048 columns its forecasting work uses.
NATIVE = HDL64.with_width(2048)
TARGET_FPS = 1.0
TARGET_SHARE = 0.9

#: (namespace, attribute, stage) timed in the split: the names the pipeline and the rollout call, where
#: they call them, then the costlier steps inside them, where those call them (a step's time is its own
#: row, not its caller's). A name a namespace does not hold is listed as not found, not timed.
STAGES: tuple[tuple[Any, str, str], ...] = (
    (pipeline_module, "native_sensor", "sensor geometry (detect_sensor)"),
    (detect_module, "_matched_preset", "sensor geometry: preset match"),
    (pipeline_module, "_check_returns", "scan check (returns on the beams)"),
    (pipeline_module, "ego_body", "car's own returns (ego_body)"),
    (pipeline_module, "cache_from_scans", "cache from scans"),
    (pipeline_module, "observation", "observation"),
    (measured_module, "project", "observation: the sweeps' rays (project)"),
    (measured_module, "measured_points", "observation: points to world"),
    (measured_module, "sensor_shadow", "observation: sensor shadow"),
    (rollout_module, "layout_view", "layout view"),
    (conditioning_module, "box_range_view", "layout view: box ray-cast"),
    (hdmap_module.HDMap, "_ground_cast", "map view: ground cast"),
    (hdmap_module, "box_range_view", "map view: footprint box ray-cast"),
    (rollout_module, "views_condition", "condition: map and layout (views_condition)"),
    (rollout_module, "cache_view", "condition: the cache's view (cache_view)"),
    (rollout_module, "with_cache", "condition: the cache (with_cache)"),
    (conditioning_module, "project", "condition: cache z-buffer (project)"),
    (cache_module.SpatialCache, "points", "cache: points"),
    (cache_module.SpatialCache, "add", "cache: add"),
    (rollout_module, "guided_velocity", "sampler glue (predict_x0, velocity)"),
    (FlowMatchSampler, "init_noise", "sampler: noise"),
    (FlowMatchSampler, "step", "sampler: step"),
    (rollout_module, "measured_view", "measured view"),
    (measured_module.Observation, "seen_from", "measured view: points to pose"),
    (measured_module, "_winners", "measured view: z-buffer (_winners)"),
    (measured_module, "row_misses", "measured view: row misses"),
    (measured_module, "beside_grid", "measured view: beside the grid"),
    (measured_module, "_fine_winners", "measured view: fine-grid winners"),
    (measured_module.MeasuredView, "ready_to_settle", "measured view: what settling asks of it"),
    (rollout_module, "keep_measured", "keep measured"),
    (rollout_module, "decode_image", "decode"),
    (rollout_module, "unproject", "unproject"),
    (rollout_module, "measured_points_of", "measured points of"),
    (rollout_module, "settle_additions", "settle additions"),
    (measured_module, "near_ground", "settle additions: near ground"),
    (measured_module, "on_measured_rays", "settle additions: on measured rays"),
    (measured_module, "far_behind", "settle additions: far behind a kept surface"),
    (rollout_module, "transform_points", "to world frame"),
    (rollout_module, "on_mapped_surfaces", "invented occluders onto the map's surfaces"),
)
NETWORK = "network forward (model(...))"
PREPARE = "prepare condition (model.prepare)"
VIEWS_STEM = "prepare condition: the views' stem (model.views_stem)"
MAP_VIEW = "map view (HDMap.range_view)"


@dataclass
class Split:
    """Exclusive seconds per stage over the timed calls, kept by wrappers that share one call stack per thread.

    The rollout draws a frame's pose-only views in a second thread while the network samples, and finishes a
    forecast's frame there while the next frame samples; the pipeline builds an observation's cache in one
    while it measures the sweep's geometry. Their stages are kept apart (`beside`): they overlap the frame
    instead of adding to it, but for the last frame's finish, which the call waits for (its share of
    "other")."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    beside: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _local: threading.local = field(default_factory=threading.local)

    def wrap(self, function: Callable[..., Any], stage: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            children = self._local.__dict__.setdefault("children", [])
            book = self.seconds if threading.current_thread() is threading.main_thread() else self.beside
            children.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                book[stage] += elapsed - children.pop()
                if children:
                    children[-1] += elapsed

        return timed


@contextmanager
def staged(split: Split, pipe: LidarVersePipeline, world: World) -> Iterator[list[str]]:
    """Every stage of `STAGES`, the network's forward and prepare and the map view wrapped into `split` for
    the duration; yields the stage names not found."""
    model = pipe.model
    targets = [*STAGES, (model, "forward", NETWORK), (model, "prepare", PREPARE), (model, "views_stem", VIEWS_STEM),
               (world.hdmap, "range_view", MAP_VIEW)]
    saved, missing = [], []
    for owner, name, stage in targets:
        if not hasattr(owner, name):
            missing.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
            continue
        own = name in vars(owner)  # an instance attribute set here, or a class's own, is put back as found
        saved.append((owner, name, vars(owner).get(name) if own else None, own))
        setattr(owner, name, split.wrap(getattr(owner, name), stage))
    try:
        yield missing
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@dataclass
class Case:
    """One end-to-end call and the frames it makes."""

    name: str
    grid: str
    frames: int
    call: Callable[[int], Any]
    #: The condition of the call's last frame (`warm_up`): what its bare network runs on.
    cond: torch.Tensor | None = None


def cases(pipe: LidarVersePipeline, data: str, frames: int) -> tuple[list[Case], World]:
    """The calls timed: forecasts of the recording's first sweep at its file pose, in its own geometry, over
    `frames` frames and over one (its once-per-call set-up on a single frame), and a `frames`-frame drive through
    world 0 on `NATIVE`; and that world."""
    rec = open_recording(data)
    if rec.poses is None:
        raise InputError(f"--data {data} has no poses file; expected a recorded sequence with its poses")
    scan, pose = rec.sweep(0), rec.poses[:1]  # a Scan: its rings recovered from the file's order
    native = pipe.grid(None, [scan])
    world = make_world(0, "urban")

    def forecast(count: int) -> Callable[[int], Any]:
        return lambda steps: pipe.forecast([scan], prefix_poses=pose, frames=count, steps=steps, seed=0)

    def generate(steps: int) -> Any:
        return pipe.generate_world(world, frames=frames, steps=steps, seed=0, sensor=NATIVE)

    grid = f"{native.name} {native.height}x{native.width}"
    return [
        Case(f"forecast, 1 KITTI sweep, {frames} frames", grid, frames, forecast(frames)),
        Case("forecast, 1 KITTI sweep, 1 frame", grid, 1, forecast(1)),
        Case(f"generate_world, {frames} frames", f"{NATIVE.name} {NATIVE.height}x{NATIVE.width} (preset)", frames, generate),
    ], world


def warm_up(pipe: LidarVersePipeline, case: Case) -> None:
    """One call at 1 step (the allocator, the kernels, the sweep's file cache), keeping its last condition."""
    prepare = pipe.model.prepare

    def keep(cond: torch.Tensor, views_stem: torch.Tensor | None = None) -> PreparedCondition:
        case.cond = cond
        return prepare(cond, views_stem=views_stem)

    pipe.model.prepare = keep  # type: ignore[method-assign]  # an instance attribute over the method
    try:
        case.call(1)
    finally:
        del pipe.model.prepare


def bare_network(pipe: LidarVersePipeline, cond: torch.Tensor, steps: int) -> tuple[float, float]:
    """Seconds of one frame's network on the frame's condition: all of it (`prepare` once, then `steps` forward
    passes at the sampler's times), and the forward passes alone."""
    sampler = FlowMatchSampler()
    sampler.set_timesteps(steps)
    x = torch.randn(1, IMAGE_CHANNELS, *cond.shape[-2:], dtype=next(pipe.model.parameters()).dtype)
    with torch.inference_mode():
        start = time.perf_counter()
        prepared = pipe.model.prepare(cond)
        stepping = time.perf_counter()
        for t in sampler.timesteps:
            pipe.model(x, t.reshape(1), prepared)
        end = time.perf_counter()
    return end - start, end - stepping


def per_frame(case: Case, steps: int) -> float:
    start = time.perf_counter()
    case.call(steps)
    return (time.perf_counter() - start) / case.frames


def page_faults() -> int:
    """Minor page faults of this process so far: memory the allocator gave back to the system and touched anew
    (each costs about 1.6 us on this VM), which no other job's load changes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def speed_table(pipe: LidarVersePipeline, all_cases: list[Case], steps_list: list[int], repeats: int) -> None:
    print("| call | grid | steps | bare network s/frame (prepare + steps) | end-to-end s/frame | frames/s | "
          f"vs {TARGET_FPS:g} fps | bare / end-to-end (target ≥ {TARGET_SHARE:g}) | steps alone / end-to-end | "
          "page faults/frame |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for steps in steps_list:
        bare: dict[str, list[float]] = {case.name: [] for case in all_cases}
        stepping: dict[str, list[float]] = {case.name: [] for case in all_cases}
        ends: dict[str, list[float]] = {case.name: [] for case in all_cases}
        faults: dict[str, list[float]] = {case.name: [] for case in all_cases}
        for _ in range(repeats):  # alternated, so a busy minute slows all of them
            for case in all_cases:
                assert case.cond is not None, "warm_up keeps each case's condition"
                whole, steps_only = bare_network(pipe, case.cond, steps)
                bare[case.name].append(whole)
                stepping[case.name].append(steps_only)
                before = page_faults()
                ends[case.name].append(per_frame(case, steps))
                faults[case.name].append((page_faults() - before) / case.frames)
        mark = " (default)" if steps == pipe.config.default_steps else ""
        for case in all_cases:
            net, end, alone = min(bare[case.name]), min(ends[case.name]), min(stepping[case.name])
            print(f"| {case.name} | {case.grid} | {steps}{mark} | {net:.3f} | {end:.3f} | {1 / end:.2f} | "
                  f"{1 / end / TARGET_FPS:.2f}x | {net / end:.2f} | {alone / end:.2f} | "
                  f"{statistics.median(faults[case.name]):,.0f} |")


def _stage_row(stage: str, cells: list[tuple[float, float | None]]) -> None:
    """One stage's row of ms per frame, each with its share of the frame's seconds where given; none when no
    call spends half a millisecond there."""
    shown = [("" if ms < 0.5 else f"{ms:.0f}" if frame is None else f"{ms:.0f} ({ms / 10 / frame:.0f} %)")
             for ms, frame in cells]
    if any(shown):
        print(f"| {stage} | " + " | ".join(shown) + " |")


def split_table(pipe: LidarVersePipeline, all_cases: list[Case], world: World, steps: int, repeats: int) -> None:
    splits, totals = {}, {}
    for case in all_cases:
        split, total = Split(), 0.0
        with staged(split, pipe, world) as missing:
            for _ in range(repeats):
                total += per_frame(case, steps) * case.frames
        splits[case.name], totals[case.name] = split, total / (repeats * case.frames)
    if missing:
        print(f"stages not found in this version (not timed): {', '.join(missing)}\n")
    names = [case.name for case in all_cases]
    print(f"ms per frame at {steps} steps, each stage's own time (the stages it calls are their own rows; the rows "
          "'in a second thread' overlap the frame and are not in its sum):\n")
    print("| stage | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    stages = [NETWORK, PREPARE, VIEWS_STEM, MAP_VIEW, *dict.fromkeys(stage for *_, stage in STAGES)]
    to_ms = {case.name: 1000 / (repeats * case.frames) for case in all_cases}
    for stage in stages:
        _stage_row(stage, [(to_ms[n] * splits[n].seconds.get(stage, 0.0), totals[n]) for n in names])
    for stage in stages:  # drawn beside the main thread's work: not in the frame's sum
        _stage_row(f"{stage}, in a second thread",
                   [(to_ms[n] * splits[n].beside.get(stage, 0.0), None) for n in names])
    others = []
    for case in all_cases:
        named = sum(splits[case.name].seconds.values()) / (repeats * case.frames)
        others.append(f"{1000 * (totals[case.name] - named):.0f}")
    print("| other (unnamed) | " + " | ".join(others) + " |")
    print("| **frame** | " + " | ".join(f"**{1000 * totals[n]:.0f}**" for n in names) + " |\n")


def profile(all_cases: list[Case], steps: int, top: int) -> None:
    for case in all_cases:
        profiler = cProfile.Profile()
        profiler.enable()
        case.call(steps)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        print(f"cProfile of {case.name}, {steps} steps (own time):\n```\n{out.getvalue().strip()}\n```\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model source for inference.load_pipeline")
    parser.add_argument("--data", default=RealSequenceConfig().data, help="a recorded sequence with its poses")
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="sampler steps (default: 1 2 and the "
                        "model's)")
    parser.add_argument("--frames", type=int, default=3, help="frames per generate_world call and per "
                        "multi-frame forecast")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs per figure (the fastest)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions per call")
    parser.add_argument("--dtype", default="float32", help="the network's dtype (bfloat16: a CPU with AMX's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, device="cpu", dtype=args.dtype)
    default = pipe.config.default_steps
    steps_list = args.steps or sorted({1, 2, default})
    try:
        all_cases, world = cases(pipe, args.data, args.frames)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for case in all_cases:
        warm_up(pipe, case)
    print(f"{pipe.provenance.source}; {args.threads} torch thread(s), OpenBLAS {os.environ['OPENBLAS_NUM_THREADS']}; "
          f"load average {os.getloadavg()[0]:.2f}; fastest of {args.repeats} alternating runs\n")
    speed_table(pipe, all_cases, steps_list, args.repeats)
    print()
    split_table(pipe, all_cases, world, default, args.repeats)
    if args.profile:
        profile(all_cases, default, args.profile)


if __name__ == "__main__":
    main()

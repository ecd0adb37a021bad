"""Upsampling speed: each fill of one real KITTI sweep against linear interpolation, timed in the same run.

Two calls of `pipe.upsample` on the shared KITTI 00 sweep 000000 (64 x 2,012, read once outside the timing):
16 of its 64 rings kept and the other 48 filled on its own table (the evaluation's bar setting), and the whole
sweep at factor 2 (127 x 2,012, the app's default, within its ray limit). Methods alternate; each figure is the
fastest of `--repeats` runs, on one torch thread by default. The goal is 5 sweeps/s at 64 x 2,048.

    python -m bench.upsample_bench [--model SRC] [--scan FILE] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from inference import load_pipeline
from inference.upsample import EDGE_AWARE, LEARNED, LINEAR, NEAREST
from lidar.formats import read_points
from training.evaluate_upsample import BAR_SETTING, DEFAULT_DATA, SETTINGS, load_sweep

METHODS = (LINEAR, NEAREST, EDGE_AWARE, LEARNED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--scan", type=Path, default=Path(DEFAULT_DATA[0]) / "000000.bin")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="the networks' dtype (bfloat16: a CPU with AMX's default)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, device="cpu", dtype=args.dtype)
    methods = [m for m in METHODS if m != LEARNED or pipe.fill_network is not None]
    sweep = load_sweep(args.scan)
    if isinstance(sweep, str):
        print(f"error: {sweep}", file=sys.stderr)
        return 2
    setting = next(s for s in SETTINGS if s.name == BAR_SETTING)
    fill = setting.mask(sweep.truth, np.random.default_rng(0))
    given, whole = sweep.given(fill), read_points(args.scan)
    calls = {f"{BAR_SETTING}, {sweep.truth.shape[0]} x {sweep.truth.shape[1]}":
             lambda m: pipe.upsample(given, sensor=sweep.geometry.sensor, mask=fill, method=m),
             "factor 2": lambda m: pipe.upsample(whole, 2, method=m)}
    best = {(c, m): float("inf") for c in calls for m in methods}
    for _ in range(args.repeats):
        for call, run in calls.items():
            for method in methods:
                start = time.perf_counter()
                run(method)
                best[call, method] = min(best[call, method], time.perf_counter() - start)
    print(f"{args.scan.name}; {args.threads} torch thread(s); fastest of {args.repeats} alternating runs\n")
    print("| call | method | s/sweep | sweeps/s (goal ≥ 5) | time ÷ linear's |")
    print("|---|---|---:|---:|---:|")
    for call in calls:
        for method in methods:
            seconds = best[call, method]
            print(f"| {call} | {method} | {seconds:.3f} | {1 / seconds:.2f} | {seconds / best[call, LINEAR]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

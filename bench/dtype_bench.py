"""bfloat16 against float32 on this CPU: the same calls end to end, timed alternating in one run.

A CPU with AMX tiles (Intel Xeon since Sapphire Rapids) multiplies bfloat16 matrices in hardware, and a
pipeline loads its networks in bfloat16 there (`inference.loader.inference_device`); elsewhere it keeps
float32. The calls, on one torch thread by default, each from two pipelines of the same release, one
per dtype: a 1-frame forecast of one shared KITTI sweep in its own geometry and a 3-frame `generate_world`
on an HDL-64E at 2048 columns (`bench.native_bench`'s cases), and the learned fill of the same sweep with
16 of its 64 rings kept (the upsampling evaluation's bar setting). Each figure is the fastest of `--repeats`
runs; "float32 ÷ bfloat16" is the speed-up. On a CPU without bfloat16 in hardware it reads below 1.

    python -m bench.dtype_bench [--model SRC] [--data DIR] [--repeats 4] [--threads 1]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # numpy's OpenBLAS, as in bench.native_bench
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.native_bench import cases
from inference import load_pipeline
from inference.loader import cpu_computes_bfloat16
from inference.upsample import LEARNED
from training.evaluate_real import RealSequenceConfig
from training.evaluate_upsample import BAR_SETTING, SETTINGS, load_sweep

DTYPES = (torch.float32, torch.bfloat16)


def calls(model: str | None, data: str) -> dict[str, tuple[int, dict[torch.dtype, Callable[[], Any]]]]:
    """Per call: its frames, and per dtype the call on that dtype's pipeline."""
    pipes = {dtype: load_pipeline(model, device="cpu", dtype=dtype) for dtype in DTYPES}
    sweep = load_sweep(Path(data) / "velodyne" / "000000.bin")
    if isinstance(sweep, str):
        raise SystemExit(f"error: {sweep}")
    fill = next(s for s in SETTINGS if s.name == BAR_SETTING).mask(sweep.truth, np.random.default_rng(0))
    given = sweep.given(fill)
    out: dict[str, tuple[int, dict[torch.dtype, Callable[[], Any]]]] = {}
    per_dtype = {dtype: cases(pipe, data, 3)[0] for dtype, pipe in pipes.items()}
    for k in (1, 2):  # the 1-frame forecast and the generation
        case = per_dtype[torch.float32][k]
        out[case.name] = (case.frames, {d: (lambda c=c[k]: c.call(2)) for d, c in per_dtype.items()})
    if all(pipe.fill_network is not None for pipe in pipes.values()):
        out[f"learned fill, {BAR_SETTING}"] = (1, {d: (lambda p=p: p.upsample(
            given, sensor=sweep.geometry.sensor, mask=fill, method=LEARNED)) for d, p in pipes.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=RealSequenceConfig().data, help="a recorded KITTI sequence")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    timed = calls(args.model, args.data)
    best = {(name, d): float("inf") for name in timed for d in DTYPES}
    for _, by_dtype in timed.values():
        for run in by_dtype.values():
            run()  # the allocator, the kernels, the file cache
    for _ in range(args.repeats):
        for name, (_, by_dtype) in timed.items():
            for dtype, run in by_dtype.items():
                start = time.perf_counter()
                run()
                best[name, dtype] = min(best[name, dtype], time.perf_counter() - start)
    print(f"bfloat16 in hardware (AMX): {cpu_computes_bfloat16()}; {args.threads} torch thread(s); 2 sampler "
          f"steps; fastest of {args.repeats} alternating runs\n")
    print("| call | float32 s/frame | bfloat16 s/frame | float32 ÷ bfloat16 |")
    print("|---|---:|---:|---:|")
    for name, (frames, _) in timed.items():
        f32, b16 = best[name, torch.float32] / frames, best[name, torch.bfloat16] / frames
        print(f"| {name} | {f32:.3f} | {b16:.3f} | {f32 / b16:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

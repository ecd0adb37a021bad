"""Forecast speed from recorded sweeps: what keeping the measurement costs (`inference.measured`).

A forecast from K posed sweeps runs the network on each target pose and then writes the measurement back:
the observed sweeps moved to the pose and z-buffered, their misses and shadow, the car's own returns, and
(without a map) the network's additions settled against them. Timed in the same run, alternating: the
pipeline's forecast, and the same rollout from the same cache without the measurement (`measured=None`, the
cache-only forecast the network alone would give; the car's own returns stay in its cache).

    python -m bench.forecast_bench [--data DIR] [--prefixes 1 3] [--frames 10] [--repeats 2] [--threads 1]

`--data` is a recorded sequence (default: the shared KITTI 00 frames); its file poses are used.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import inference.pipeline as pipeline_module
from inference import load_pipeline
from lidar.sequence import open_recording
from training.evaluate_real import RealSequenceConfig


def time_forecast(pipe, scans: list[np.ndarray], poses: np.ndarray, frames: int, keep: bool) -> float:
    """Frames/s of one forecast of `frames` frames at 10 Hz from `scans` at `poses`."""
    real = pipeline_module.rollout, pipeline_module.observation, pipeline_module.ego_body
    if not keep:  # the same rollout from every observed point, with no measurement gathered or handed to it
        pipeline_module.rollout = lambda *a, **k: real[0](*a, **{**k, "measured": None})
        pipeline_module.observation = lambda *a, **k: None
        pipeline_module.ego_body = lambda scans, _poses: [np.zeros(len(s), dtype=bool) for s in scans]
    try:
        start = time.perf_counter()
        pipe.forecast(scans, prefix_poses=poses, frames=frames, seed=0)
        return frames / (time.perf_counter() - start)
    finally:
        pipeline_module.rollout, pipeline_module.observation, pipeline_module.ego_body = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=RealSequenceConfig().data, help="a recorded sequence with its poses")
    parser.add_argument("--model", default=None, help="a model source for inference.load_pipeline")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--frames", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, dtype=torch.float32)  # the tables' dtype on every CPU (dtype_bench: bf16)
    rec = open_recording(args.data)
    if rec.poses is None:
        raise SystemExit(f"error: {args.data} has no poses file")
    pipe.forecast([rec.sweep(0).points], prefix_poses=rec.poses[:1], frames=1, seed=0)  # warm-up
    print(f"{pipe.provenance.source}, {args.frames} frames per forecast, {args.threads} thread(s), "
          f"{args.repeats} alternating runs each\n")
    print("| sweeps observed | frames/s, measurement kept | frames/s, cache only | kept ÷ cache only |")
    print("|---:|---:|---:|---:|")
    for k in args.prefixes:
        scans = [rec.sweep(i).points for i in range(k)]
        kept, bare = [], []
        for _ in range(args.repeats):
            kept.append(time_forecast(pipe, scans, rec.poses[:k], args.frames, keep=True))
            bare.append(time_forecast(pipe, scans, rec.poses[:k], args.frames, keep=False))
        fast, slow = float(np.median(kept)), float(np.median(bare))
        print(f"| {k} | {fast:.2f} | {slow:.2f} | {fast / slow:.2f} |")


if __name__ == "__main__":
    main()

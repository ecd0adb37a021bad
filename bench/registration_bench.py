"""Registration cost against generation: KISS-ICP seconds per sweep ÷ seconds of one generated frame.

Registering the observed prefix happens once per request, before the model runs; this bench says how much
it adds next to the frames it precedes. Both are timed in the same run on the same sweeps: the shared KITTI
seq-00 sweeps (or --scans) are read, registered `--repeats` times (median per sweep, the first sweep
excluded: it only seeds the map), then forecast from (median seconds of one frame at the model's default
steps, after a warm-up frame).

    python -m bench.registration_bench [--scans F1 F2 ...] [--repeats 5] [--frames 4] [--model SRC] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from inference import load_pipeline
from lidar.real_scans import real_scans_dir
from lidar.registration import RegisterConfig, register_sweeps
from lidar.sequence import read_sequence

KITTI_SEQ00 = [f"kitti_patchworkpp_{i:06d}.bin" for i in (0, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scans", type=Path, nargs="+", default=[real_scans_dir() / n for n in KITTI_SEQ00])
    parser.add_argument("--repeats", type=int, default=5, help="registrations of the whole sequence")
    parser.add_argument("--frames", type=int, default=4, help="forecast frames timed (after one warm-up)")
    parser.add_argument("--model", default=None, help="a model source for inference.load_pipeline")
    parser.add_argument("--threads", type=int, default=1, help="torch and KISS-ICP threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    # 1. read, timed per sweep
    start = time.perf_counter()
    seq = read_sequence(args.scans)
    read_s = (time.perf_counter() - start) / len(seq.scans)
    # 2. register, median per sweep over repeats (sweep 0 only seeds the map)
    config = RegisterConfig(threads=args.threads)
    runs = [register_sweeps(seq.scans, names=seq.names, config=config) for _ in range(args.repeats)]
    register_s = float(np.median([run.seconds[1:] for run in runs]))
    # 3. one generated frame, forecasting from the registered sweeps
    pipe = load_pipeline(args.model, device="cpu", dtype=torch.float32)
    poses = runs[0].poses
    pipe.forecast(seq.scans, prefix_poses=poses, frames=1, seed=0)  # warm-up
    result = pipe.forecast(seq.scans, prefix_poses=poses, frames=args.frames, seed=0)
    frame_s = float(np.median([f.seconds for f in result.frames]))

    print(
        f"model {pipe.provenance.source} ({pipe.sensor.name} {pipe.sensor.shape[0]}x{pipe.sensor.shape[1]}, "
        f"{pipe.config.default_steps} steps); {len(seq.scans)} sweeps ({', '.join(seq.names)}), "
        f"{np.mean([s.num_points for s in seq.scans]):.0f} points each; threads {args.threads}; "
        f"load average {os.getloadavg()[0]:.2f}; fitness {np.round(runs[0].fitness[1:], 3).tolist()}\n"
    )
    print("| step (per sweep or frame) | seconds | ÷ one generated frame |")
    print("|---|---:|---:|")
    for name, seconds in (
        ("read a sweep (`read_points`)", read_s),
        ("register a sweep (KISS-ICP + fitness)", register_s),
        (f"generate one frame ({pipe.config.default_steps} steps)", frame_s),
    ):
        print(f"| {name} | {seconds:.3f} | {seconds / frame_s:.2f} |")


if __name__ == "__main__":
    main()

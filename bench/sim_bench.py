"""Simulator speed: HDL-32E sweeps (32x1024) per second on one core, and how cost grows with world size.

    python -m bench.sim_bench [--frames 30]

Prints two tables. The first gives frames/s per world style and its ratio to the issue's target (10
frames/s) and goal (20). The second tiles one world's solids k x k times: with the culling grid a scan
only looks at the cells in sensor range, so its time stays flat; the baseline, timed in the same run,
hands every solid to the caster (which still rejects far ones per solid) and grows with the world.
Times are CPU seconds of this process (the machine is shared), wall time is shown alongside.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import time
from dataclasses import replace

import numpy as np

from lidar.sensors import HDL32
from lidar.sim import LidarSimulator, make_world, plan_drive
from lidar.sim.primitives import Shapes
from lidar.sim.world import CullingGrid, World

TARGET_FPS = 10.0
GOAL_FPS = 20.0


def time_scans(world: World, poses: np.ndarray, sim: LidarSimulator) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per scan, after one warm-up scan."""
    sim.scan(world, poses[0], 0.0)
    c0, w0 = time.process_time(), time.perf_counter()
    for i, pose in enumerate(poses):
        sim.scan(world, pose, i * 0.1)
    n = len(poses)
    return (time.process_time() - c0) / n, (time.perf_counter() - w0) / n


def tiled(world: World, k: int) -> World:
    """The world's solids repeated k x k times side by side (the map under them is unchanged)."""
    xmin, ymin, xmax, ymax = world.hdmap.extent
    parts = []
    for i in range(k):
        for j in range(k):
            s = world.scenery.take(np.arange(len(world.scenery)))
            s.center = s.center + np.array([i * (xmax - xmin), j * (ymax - ymin), 0.0])
            parts.append(s)
    return replace(world, scenery=Shapes.concat(parts), grid=None, table=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30)
    args = parser.parse_args()
    sensor = HDL32
    sim = LidarSimulator(sensor, seed=0)

    print(f"## lidar.sim speed, {sensor.name} {sensor.height}x{sensor.width}, one core\n")
    print(
        "| world | solids | CPU ms/frame | wall ms/frame | frames/s (CPU) | ratio to target 10 | ratio to goal 20 |"
    )
    print("|---|---|---|---|---|---|---|")
    worlds = {}
    for style in ("urban", "suburban", "highway"):
        world = make_world(0, style)
        worlds[style] = world
        poses = plan_drive(world, "straight", args.frames, seed=0, mount_height=sensor.mount_height)
        cpu, wall = time_scans(world, poses, sim)
        fps = 1.0 / cpu
        print(
            f"| {style} | {len(world.scenery)} | {cpu * 1e3:.1f} | {wall * 1e3:.1f} | {fps:.1f} | "
            f"{fps / TARGET_FPS:.2f} | {fps / GOAL_FPS:.2f} |"
        )

    print("\n## time vs world size (urban seed 0 tiled k x k; baseline = no culling grid, same run)\n")
    print("| tiles | solids | grid CPU ms/frame | baseline CPU ms/frame | baseline / grid |")
    print("|---|---|---|---|---|")
    base = worlds["urban"]
    poses = plan_drive(base, "straight", max(args.frames // 3, 5), seed=0, mount_height=sensor.mount_height)
    for k in (1, 2, 4, 8):
        world = tiled(base, k)
        grid_cpu, _ = time_scans(world, poses, sim)
        brute = replace(world, grid=CullingGrid.build(world.scenery, cell=1e6))  # one cell holds everything
        brute_cpu, _ = time_scans(brute, poses, sim)
        print(
            f"| {k}x{k} | {len(world.scenery)} | {grid_cpu * 1e3:.1f} | {brute_cpu * 1e3:.1f} | "
            f"{brute_cpu / grid_cpu:.2f} |"
        )


if __name__ == "__main__":
    main()

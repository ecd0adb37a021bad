"""A picture of a world: the HD map raster with the ego drive and one simulated sweep on top.

    python -m lidar.sim.preview --seed 3 --style urban --action turn_left --out docs/sim_map.png

Used to pick a world by eye (and for docs/simulator.md); the same function serves any caller that wants a PNG.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from PIL import Image, ImageDraw

from lidar.sensors import HDL32, Sensor, get_sensor
from lidar.sim.drive import plan_drive
from lidar.sim.hdmap import HDMap
from lidar.sim.sensor_model import LidarSimulator
from lidar.sim.styles import STYLES
from lidar.sim.world import World, make_world
from lidar.vocabulary import ACTIONS


def world_preview(
    world: World, poses: np.ndarray, sensor: Sensor = HDL32, resolution: float = 0.25, extent: float = 70.0
) -> Image.Image:
    """Map classes (MAP_COLORS) around the drive, the path in red, the last pose's sweep in white."""
    centre = poses[:, :2, 3].mean(axis=0)
    half = extent + float(np.abs(poses[:, :2, 3] - centre).max())
    classes = world.hdmap.bev_raster(
        resolution=resolution, extent=half, center=(float(centre[0]), float(centre[1]))
    )
    img = Image.fromarray(HDMap.colorize(classes))
    n = classes.shape[0]

    def px(xy: np.ndarray) -> np.ndarray:
        return np.stack(
            [(xy[:, 0] - centre[0] + half) / resolution, (centre[1] + half - xy[:, 1]) / resolution], 1
        )

    scan = LidarSimulator(sensor, seed=world.seed).scan(world, poses[-1], (len(poses) - 1) * 0.1)
    pts = scan.points[:, :3].astype(np.float64) @ poses[-1][:3, :3].T + poses[-1][:3, 3]
    p = np.round(px(pts[:, :2])).astype(np.int64)
    ok = (p >= 0).all(axis=1) & (p < n).all(axis=1)
    arr = np.asarray(img).copy()
    arr[p[ok, 1], p[ok, 0]] = (255, 255, 255)
    img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    draw.line(
        [tuple(q) for q in px(poses[:, :2, 3])], fill=(230, 30, 30), width=max(2, round(0.6 / resolution))
    )
    return img


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lidar.sim.preview", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--style", choices=STYLES, default="urban")
    parser.add_argument("--action", choices=ACTIONS, default="turn_left")
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--sensor", default="hdl32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        sensor = get_sensor(args.sensor)
        world = make_world(args.seed, args.style)
        poses = plan_drive(world, args.action, args.frames, seed=args.seed, mount_height=sensor.mount_height)
        world_preview(world, poses, sensor).save(args.out)
    except (ValueError, OSError) as exc:  # bad sensor/seed/frames or an unwritable --out: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

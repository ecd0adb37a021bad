"""Dataset CLI: `python -m lidar.sim --sensor hdl32 --width 512 --sequences 100 --frames 20 --seed 0 --out DIR`."""

from __future__ import annotations

import argparse
import logging
import sys

from lidar.sensors import get_sensor
from lidar.sim.dataset import write_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lidar.sim", description="Write a simulated LiDAR dataset."
    )
    parser.add_argument(
        "--sensor", default="hdl32", help="sensor preset or alias (hdl32, hdl64, vlp16, os1-64, ...)"
    )
    parser.add_argument("--width", type=int, default=None, help="range-image width (default: the preset's)")
    parser.add_argument("--sequences", type=int, default=10, help="number of drives")
    parser.add_argument("--frames", type=int, default=20, help="frames per drive (10 Hz)")
    parser.add_argument(
        "--seed", type=int, default=0, help="dataset seed; sequence i depends only on (seed, i)"
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--points", action="store_true", help="also store point clouds (N, 4) per frame")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        sensor = get_sensor(args.sensor)
        if args.width is not None:
            sensor = sensor.with_width(args.width)
        manifest = write_dataset(
            args.out,
            sensor,
            args.sequences,
            args.frames,
            seed=args.seed,
            with_points=args.points,
            workers=args.workers,
        )
    # Bad arguments, or the disk failing mid-write: one line, no traceback.
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

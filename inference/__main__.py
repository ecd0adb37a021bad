"""Command line: generate a world, forecast from scan files, or show where a model comes from.

    python -m inference generate --model SRC --map-seed 3 --style urban --action turn_left --frames 8 \\
        --steps 4 --seed 0 --out DIR --format bin
    python -m inference forecast --model SRC --prefix FILE [FILE ...] --action straight --frames 8 --out DIR
    python -m inference info --model SRC [--json]

Output folders hold one point file per frame (sensor frame), `world.<ext>` (the accumulated world, world
frame) and `poses.json`. Any bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from inference.loader import ModelSourceError
from inference.pipeline import (
    MAX_FRAMES,
    MAX_STEPS,
    POSES_NAME,
    LidarVersePipeline,
    load_pipeline,
    write_rollout,
)
from inference.rollout import Progress, RolloutResult
from lidar.formats import read_points
from lidar.sim import ACTIONS, STYLES

FORMATS = ("bin", "pcd", "ply", "npz")


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Run one command; `started` (a perf_counter value) is when the wait began, for the "ready" time."""
    started = time.perf_counter() if started is None else started
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.run(args, started)
    except (ModelSourceError, ValueError, OSError) as exc:  # bad input: one line, no traceback
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    pipe = _load(args)
    ready = time.perf_counter() - started
    out = pipe.generate_world(
        map=args.map_seed,
        style=args.style,
        action=args.action,
        frames=args.frames,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        callback=_progress_printer(args.quiet),
    )
    _write(args, pipe, out, ready, {"map_seed": args.map_seed, "style": args.style, "action": args.action})
    return 0


def _forecast(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    scans = [read_points(path) for path in args.prefix]  # fail on a bad file before loading the model
    prefix_poses = _read_poses(args.prefix_poses, len(scans)) if args.prefix_poses else None
    pipe = _load(args)
    ready = time.perf_counter() - started
    out = pipe.forecast(
        scans,
        prefix_poses=prefix_poses,
        action=args.action,
        frames=args.frames,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        callback=_progress_printer(args.quiet),
    )
    _write(args, pipe, out, ready, {"prefix": [str(p) for p in args.prefix], "action": args.action})
    return 0


def _info(args: argparse.Namespace, started: float) -> int:
    pipe = _load(args)
    info = {
        **pipe.provenance.to_dict(),
        "sensor_shape": list(pipe.sensor.shape),
        "default_steps": pipe.config.default_steps,
        "default_guidance": pipe.config.default_guidance,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """Refuse to overwrite an earlier rollout before minutes are spent generating the new one."""
    if (args.out / POSES_NAME).exists() and not args.overwrite:
        raise ValueError(
            f"{args.out} already holds a rollout ({POSES_NAME}); choose another --out or pass --overwrite"
        )


def _load(args: argparse.Namespace) -> LidarVersePipeline:
    return load_pipeline(args.model, device=args.device, dtype=args.dtype, config=args.config)


def _progress_printer(quiet: bool):
    def report(progress: Progress) -> None:
        frame = progress.frame_result
        if frame is not None and not quiet:
            print(
                f"frame {progress.frame + 1}/{progress.frames}: {len(frame.points)} points in {frame.seconds:.2f} s",
                file=sys.stderr,
            )

    return report


def _write(
    args: argparse.Namespace,
    pipe: LidarVersePipeline,
    out: RolloutResult,
    ready: float,
    request: dict[str, Any],
) -> None:
    """Frame files, world and poses.json (`write_rollout`), then the timing table on stdout."""
    request = {
        "command": args.command,
        **request,
        "frames": args.frames,
        "steps": args.steps,
        "seed": args.seed,
        "guidance": args.guidance,
    }
    meta = write_rollout(
        args.out,
        out,
        args.format,
        sensor=pipe.sensor,
        provenance=pipe.provenance,
        request=request,
        overwrite=args.overwrite,
    )
    steps = args.steps or pipe.config.default_steps
    print(f"wrote {len(out.frames)} frames + {meta['world']} ({len(out.world)} points) to {args.out}")
    print(f"{'frames':>6} {'steps':>5} {'ready s':>8} {'rollout s':>9} {'frames/s':>8} {'write s':>7}")
    print(
        f"{len(out.frames):>6} {steps:>5} {ready:>8.2f} {out.timings['total']:>9.2f} "
        f"{out.timings['frames_per_second']:>8.2f} {meta['timings']['write']:>7.2f}"
    )


def _read_poses(path: Path, count: int) -> np.ndarray:
    """Poses from JSON: a list of 4x4 matrices, or a poses.json written by this command."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); expected a list of 4x4 world_from_sensor poses"
        ) from None
    if isinstance(data, dict) and "frames" in data:
        data = [f["pose"] for f in data["frames"]]
    poses = np.asarray(data, dtype=np.float64)
    if poses.shape != (count, 4, 4):
        raise ValueError(
            f"{path} holds poses of shape {poses.shape}; expected ({count}, 4, 4), one per --prefix file"
        )
    return poses


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            default=None,
            help="release folder, weights file, job dir or Hub id "
            "(default: $LIDARVERSE_MODEL, else weights/default)",
        )
        p.add_argument("--config", default=None, help="config.json for a bare weights file")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
        p.add_argument(
            "--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)"
        )
        p.add_argument("--quiet", action="store_true", help="no per-frame progress lines")
        p.add_argument("--verbose", action="store_true", help="log loading and I/O details")

    def rollout_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--action", default="straight", choices=ACTIONS)
        p.add_argument("--frames", type=int, default=8, help=f"1..{MAX_FRAMES}")
        p.add_argument(
            "--steps",
            type=int,
            default=None,
            help=f"sampler steps per frame, 1..{MAX_STEPS} (default: the model's)",
        )
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--guidance", type=float, default=None, help="classifier-free guidance (default: the model's)"
        )
        p.add_argument("--out", type=Path, required=True, help="output folder")
        p.add_argument("--format", default="bin", choices=FORMATS, help="point file format")
        p.add_argument("--overwrite", action="store_true", help="replace a rollout already in --out")

    gen = sub.add_parser("generate", help="roll out a drive through a procedural world")
    common(gen)
    gen.add_argument("--map-seed", type=int, default=0, help="procedural world seed")
    gen.add_argument("--style", default="urban", choices=STYLES)
    rollout_args(gen)
    gen.set_defaults(run=_generate)

    fc = sub.add_parser("forecast", help="continue from observed scan files")
    common(fc)
    fc.add_argument(
        "--prefix", type=Path, nargs="+", required=True, help="scan files, oldest first (sensor frame)"
    )
    fc.add_argument(
        "--prefix-poses",
        type=Path,
        default=None,
        help="JSON list of 4x4 world_from_sensor poses, one per prefix file (default: identity)",
    )
    rollout_args(fc)
    fc.set_defaults(run=_forecast)

    info = sub.add_parser("info", help="print the model's provenance")
    common(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    return parser


if __name__ == "__main__":
    # From the command line "ready" counts from process start, imports included: what the user waits for.
    sys.exit(main(started=time.perf_counter() - (time.time() - psutil.Process().create_time())))

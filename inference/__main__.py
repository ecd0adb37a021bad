"""Command line: generate a world, forecast from scan files, or show where a model comes from.

    python -m inference generate --model SRC --map-seed 3 --style urban --action turn_left --frames 8 \\
        [--sensor hdl64 --columns 2048] --steps 2 --seed 0 --out DIR --format bin
    python -m inference forecast --model SRC --prefix FILE [FILE ...] [--poses FILE | --register] \\
        [--topic T] --action straight --frames 8 --out DIR
    python -m inference resimulate --model SRC --scan FILE [FILE ...] [--poses FILE | --register] \\
        --shift DX DY --yaw DEG [--frames N] --out DIR
    python -m inference upsample --model SRC --scan FILE|RECORDING [--sweep K] [--factor 4 | --sensor NAME] \\
        [--method edge-aware] --out DIR --format pcd
    python -m inference info --model SRC [--json]

`--prefix` / `--scan` take sweep files, a folder of them, one zip, or one recording (a ROS bag, an MCAP, a
Velodyne or Ouster pcap, a nuScenes root, an Argoverse 2 log; `--topic` picks a bag's PointCloud2 topic;
`lidar.sequence`); several sweeps without `--poses` are registered with KISS-ICP (`lidar.registration`).
`upsample` takes one sweep (a sweep file, or `--sweep K` of a recording, a folder or a zip) and writes it on a
denser beam table (`inference.upsample`): `upsampled.<ext>`, every input point first and unchanged, then the
filled rays, `upsample.json`, and the input beside the result as `result.rrd` and `result.mcap`.
Output folders hold one point file per frame (sensor frame), `world.<ext>` (the accumulated world, world
frame), `poses.json`, whose `prefix` list gives each observed sweep's file and pose, and the rollout with
its observed sweeps as `result.rrd` (Rerun) and `result.mcap` (PointCloud2 and /tf; `inference.results4d`). Bad input (an `InputError`: a file, pose file,
model source or argument the user can fix) ends with one `error:` line on stderr and exit status 2; any
other exception is a bug and ends in a traceback with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from inference.limits import LIBRARY_LIMITS
from inference.loader import DTYPE_HELP
from inference.observed import ObservedScene, check_inside, observe, record_prefix, shifted_path
from inference.pipeline import (
    MAX_FRAMES,
    MAX_STEPS,
    POSES_NAME,
    LidarVersePipeline,
    load_pipeline,
    write_rollout,
)
from inference.results4d import BoxSource, write_upsample_views, write_views
from inference.rollout import Progress, RolloutResult
from inference.upsample import (
    AUTO,
    DEFAULT_FACTOR,
    DEFAULT_METHOD,
    LEARNED,
    METHODS,
    RECORD_NAME,
    SWEEP_FORMATS,
    check_factor,
    write_upsample,
)
from lidar import sandbox
from lidar.errors import InputError, shown
from lidar.recordings import TOPIC_HELP
from lidar.sensors import PRESETS, Sensor
from lidar.sim import ACTIONS, STYLES, make_world
from lidar.sim.world import World

FORMATS = ("bin", "pcd", "ply", "npz")


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Run one command; `started` (a perf_counter value) is when the wait began, for the "ready" time."""
    started = time.perf_counter() if started is None else started
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        _check_arguments(args)
        return args.run(args, started)
    except InputError as exc:  # bad input: one line, no traceback (a bug keeps its traceback and exit 1)
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    pipe = _load(args)
    ready = time.perf_counter() - started
    world = make_world(args.map_seed, args.style) if args.map_seed >= 0 else None  # its boxes go in the views
    grid = pipe.grid(args.sensor, columns=args.columns)
    out = pipe.generate_world(
        map=world if world is not None else args.map_seed,
        style=args.style,
        action=args.action,
        frames=args.frames,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        sensor=grid,
        callback=_progress_printer(args.quiet),
    )
    _write(args, pipe, out, ready, grid, {"map_seed": args.map_seed, "style": args.style, "action": args.action},
           boxes=_world_boxes(world))
    return 0


def _world_boxes(world: World | None) -> BoxSource | None:
    """The actors' boxes a frame of `world` shows at its time (counted from `World.time`) and pose."""
    if world is None:
        return None

    def boxes(t: float, pose: Any) -> tuple[Any, Any]:
        shown = world.boxes(world.time + t, pose)
        return shown["boxes"], shown["box_class"]

    return boxes


def _forecast(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    scene = _observe(args, args.prefix)  # fail on a bad file or registration before loading the model
    pipe = _load(args)
    ready = time.perf_counter() - started
    grid = pipe.grid(args.sensor, scene.scans, columns=args.columns)
    out = pipe.forecast(
        scene.scans,
        prefix_poses=scene.poses,
        prefix_times=scene.times,
        action=args.action,
        frames=args.frames,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        feedback=args.feedback,
        sensor=grid,
        callback=_progress_printer(args.quiet),
    )
    request = {"prefix": [str(p) for p in args.prefix], "poses": scene.pose_source, "action": args.action,
               "feedback": args.feedback}
    _write(args, pipe, out, ready, grid, request, scene)
    record_prefix(args.out, scene)
    return 0


def _resimulate(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    scene = _observe(args, args.scan)
    targets = shifted_path(scene.poses, tuple(args.shift), args.yaw, args.frames)
    check_inside(targets, scene.poses)
    pipe = _load(args)
    ready = time.perf_counter() - started
    grid = pipe.grid(args.sensor, scene.scans, columns=args.columns)
    out = pipe.resimulate(
        scene.scans,
        scene.poses,
        targets,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        sensor=grid,
        callback=_progress_printer(args.quiet),
    )
    request = {
        "scan": [str(p) for p in args.scan],
        "poses": scene.pose_source,
        "shift": list(args.shift),
        "yaw_deg": args.yaw,
    }
    _write(args, pipe, out, ready, grid, request, scene)
    record_prefix(args.out, scene)
    return 0


def _upsample(args: argparse.Namespace, started: float) -> int:
    _check_out(args)
    if (args.out / RECORD_NAME).exists() and not args.overwrite:
        raise InputError(f"{args.out} already holds an upsampled sweep ({RECORD_NAME}); choose another --out or "
                         "pass --overwrite")
    # in a bounded worker; a bad file fails before the model loads
    scan, name = sandbox.one_sweep(args.scan, args.sweep, topic=args.topic)
    pipe = _load(args)
    ready = time.perf_counter() - started
    out = pipe.upsample(scan, args.factor, sensor=args.sensor, method=args.method, steps=args.steps, seed=args.seed)
    request = {"command": args.command, "scan": str(args.scan), **({"sweep": args.sweep, "name": name} if name else {}),
               "factor": args.factor, "sensor": args.sensor, "method": args.method, "steps": args.steps,
               "seed": args.seed}
    record = write_upsample(args.out, out, args.format, provenance=pipe.provenance, request=request,
                            overwrite=args.overwrite)
    views = write_upsample_views(args.out, scan, out)
    print(f"wrote {record['file']} ({record['input_points']:,} input + {record['filled_points']:,} filled points, "
          f"{out.sensor.height} x {out.sensor.width} {out.sensor.name}), {RECORD_NAME} and {', '.join(views)} "
          f"to {args.out}")
    print(f"ready {ready:.2f} s, upsample {out.timings['total']:.2f} s, write {record['timings']['write']:.2f} s")
    return 0


def _observe(args: argparse.Namespace, sources: list[Path]) -> ObservedScene:
    """The sweeps posed from --poses, by registration, or (one sweep) at the identity."""
    scene = observe(sources, poses=args.poses, register=args.register or None, topic=args.topic)
    if scene.registration is not None and not args.quiet:
        for name, row in zip(scene.names, scene.registration.summary(), strict=True):
            print(f"registered {name}: xyz {row['xyz']} yaw {row['yaw_deg']} deg, fitness {row['fitness']}",
                  file=sys.stderr)
    return scene


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
    """Refuse an --out that cannot take the rollout (an earlier rollout, a file, no write permission) before
    minutes are spent generating it."""
    if (args.out / POSES_NAME).exists() and not args.overwrite:
        raise InputError(
            f"{args.out} already holds a rollout ({POSES_NAME}); choose another --out or pass --overwrite"
        )
    existing = next(p for p in (args.out, *args.out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "is not writable"
        raise InputError(f"--out {args.out}: {existing} {what}; expected a folder this user may write in")


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
    grid: Sensor,
    request: dict[str, Any],
    scene: ObservedScene | None = None,
    boxes: BoxSource | None = None,
) -> None:
    """Frame files, world and poses.json (`write_rollout`; its sensor is the frames' `grid`, as the app's
    download names it, not the model's), the 4D views (`write_views`), then the timing table on stdout."""
    request = {
        "command": args.command,
        **request,
        "frames": len(out.frames),
        "steps": args.steps,
        "seed": args.seed,
        "guidance": args.guidance,
    }
    meta = write_rollout(
        args.out,
        out,
        args.format,
        sensor=grid,
        provenance=pipe.provenance,
        request=request,
        overwrite=args.overwrite,
    )
    views = write_views(args.out, out, args.command, scene, boxes)
    steps = args.steps or pipe.config.default_steps
    print(f"wrote {len(out.frames)} frames + {meta['world']} ({len(out.world)} points) + {', '.join(views)} to {args.out}")
    print(f"{'frames':>6} {'steps':>5} {'ready s':>8} {'rollout s':>9} {'frames/s':>8} {'write s':>7}")
    print(
        f"{len(out.frames):>6} {steps:>5} {ready:>8.2f} {out.timings['total']:>9.2f} "
        f"{out.timings['frames_per_second']:>8.2f} {meta['timings']['write']:>7.2f}"
    )


def _number(parse: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type: the text parsed by `parse` (finite, for floats), or a usage error quoting it capped
    (argparse's own would echo a 5,000-digit argument whole)."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, OverflowError):
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {shown(text)}")
        return value

    return convert


_WHOLE = _number(int, "a whole number")
_FINITE = _number(float, "a finite number")


def _check_arguments(args: argparse.Namespace) -> None:
    """The command's numbers against the library's limits (`inference.limits`), before anything is read or
    allocated: `--frames 1000000000000` would ask for 116 TiB of poses."""
    checks: dict[str, Callable[[Any, str], Any]] = {
        "frames": LIBRARY_LIMITS.check_frames, "seed": LIBRARY_LIMITS.check_seed, "map_seed": LIBRARY_LIMITS.check_seed,
        "steps": LIBRARY_LIMITS.check_steps, "guidance": LIBRARY_LIMITS.check_guidance, "factor": check_factor}
    for name, check in checks.items():
        if getattr(args, name, None) is not None:
            check(getattr(args, name), "--" + name.replace("_", "-"))


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
        p.add_argument("--dtype", default=None, help=DTYPE_HELP)
        p.add_argument("--quiet", action="store_true", help="no per-frame progress lines")
        p.add_argument("--verbose", action="store_true", help="log loading and I/O details")

    def observed_args(p: argparse.ArgumentParser) -> None:
        how = p.add_mutually_exclusive_group()
        how.add_argument(
            "--poses",
            "--prefix-poses",
            dest="poses",
            type=Path,
            default=None,
            help="KITTI poses.txt (with calib.txt beside it for Tr), a poses.json written by this command, or "
            "a JSON list of 4x4 world_from_sensor poses (default: register several scans, identity for one)",
        )
        how.add_argument("--register", action="store_true", help="register the scans with KISS-ICP")
        p.add_argument("--topic", default=None, help=TOPIC_HELP)

    scans_geometry = "the scans' own geometry, else the model's"

    def rollout_args(p: argparse.ArgumentParser, sensor_default: str) -> None:
        p.add_argument("--action", default="straight", choices=ACTIONS)
        p.add_argument("--frames", type=_WHOLE, default=8, help=f"1..{MAX_FRAMES}")
        sensor_args(p, sensor_default)
        sampling_args(p)
        output_args(p)

    def sensor_args(p: argparse.ArgumentParser, default: str = scans_geometry) -> None:
        """--sensor and --columns; `default` says which sensor the frames get without them."""
        p.add_argument("--sensor", default=None, help=f"the frames' sensor, one of {', '.join(PRESETS)} (default: "
                       f"{default})")
        p.add_argument("--columns", type=_WHOLE, default=None,
                       help="azimuth columns of the frames (default: the sensor's own)")

    def sampling_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--steps",
            type=_WHOLE,
            default=None,
            help=f"sampler steps per frame, 1..{MAX_STEPS} (default: the model's)",
        )
        p.add_argument("--seed", type=_WHOLE, default=0)
        p.add_argument(
            "--guidance", type=_FINITE, default=None, help="classifier-free guidance (default: the model's)"
        )

    def output_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=Path, required=True, help="output folder")
        p.add_argument("--format", default="bin", choices=FORMATS, help="point file format")
        p.add_argument("--overwrite", action="store_true", help="replace a rollout already in --out")

    gen = sub.add_parser("generate", help="roll out a drive through a procedural world")
    common(gen)
    gen.add_argument("--map-seed", type=_WHOLE, default=0, help="procedural world seed")
    gen.add_argument("--style", default="urban", choices=STYLES)
    rollout_args(gen, "the model's")
    gen.set_defaults(run=_generate)

    fc = sub.add_parser("forecast", help="continue from observed scan files")
    common(fc)
    fc.add_argument(
        "--prefix",
        type=Path,
        nargs="+",
        required=True,
        help="scan files (sensor frame; ordered by the frame number in their names), a folder or a zip",
    )
    observed_args(fc)
    rollout_args(fc, scans_geometry)
    fc.add_argument("--feedback", action="store_true",
                    help="feed each generated frame back into the cache (invented content stays put; errors compound)")
    fc.set_defaults(run=_forecast)

    rs = sub.add_parser("resimulate", help="render observed scans from a shifted / rotated path")
    common(rs)
    rs.add_argument("--scan", type=Path, nargs="+", required=True, help="as --prefix of forecast")
    observed_args(rs)
    rs.add_argument(
        "--shift",
        type=_FINITE,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("DX", "DY"),
        help="metres forward and left of each observed pose",
    )
    rs.add_argument("--yaw", type=_FINITE, default=0.0, help="degrees, counter-clockwise seen from above")
    rs.add_argument("--frames", type=_WHOLE, default=None,
                    help=f"poses along the path, 1..{MAX_FRAMES} (default: one per scan)")
    sensor_args(rs)
    sampling_args(rs)
    output_args(rs)
    rs.set_defaults(run=_resimulate)

    up = sub.add_parser("upsample", help="put new beams between a sweep's measured ones, or fill its missing rays")
    common(up)
    up.add_argument("--scan", type=Path, required=True,
                    help="one sweep file (sensor frame), or a recording (a pcap, a bag, an MCAP, a nuScenes root, an "
                         "Argoverse 2 log), a folder or a zip of sweeps, of which --sweep is taken")
    up.add_argument("--sweep", type=_WHOLE, default=0,
                    help="which sweep of a recording, folder or zip (default: 0, the first)")
    up.add_argument("--topic", default=None, help=TOPIC_HELP)
    target = up.add_mutually_exclusive_group()
    target.add_argument("--factor", type=_WHOLE, default=None,
                        help=f"beams per measured gap (default {DEFAULT_FACTOR}; 1 fills the sweep's own silent rays)")
    target.add_argument("--sensor", default=None, help="a preset whose beam table to fill, at the sweep's columns")
    up.add_argument("--method", default=AUTO, choices=(AUTO, *METHODS),
                    help=f"what fills the new rays (default {AUTO}: {LEARNED} for new beams of a sweep from a sensor "
                         f"like those the model's fill network learnt from, else {DEFAULT_METHOD})")
    up.add_argument("--steps", type=_WHOLE, default=None,
                    help=f"sampler steps of --method model, 1..{MAX_STEPS} (default: the model's)")
    up.add_argument("--seed", type=_WHOLE, default=0)
    up.add_argument("--out", type=Path, required=True, help="output folder")
    up.add_argument("--format", default="pcd", choices=SWEEP_FORMATS, help="point file format (bin drops the rings)")
    up.add_argument("--overwrite", action="store_true", help="replace an upsampled sweep already in --out")
    up.set_defaults(run=_upsample)

    info = sub.add_parser("info", help="print the model's provenance")
    common(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    return parser


if __name__ == "__main__":
    # From the command line "ready" counts from process start, imports included: what the user waits for.
    sys.exit(main(started=time.perf_counter() - (time.time() - psutil.Process().create_time())))

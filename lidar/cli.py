"""`python -m lidar`: inspect, convert and picture LiDAR files from the shell.

    python -m lidar info FILE [--json] [--topic T]
    python -m lidar convert IN OUT [--sensor S] [--topic T] [--sweeps START:STOP]
    python -m lidar render FILE --out PNG [--view bev|range] [--sensor S] [--topic T] [--sweep K]

Files, and recording containers (their index and every sweep), are read in worker processes with bounded
memory, CPU and time (`lidar.sandbox`), so a file that crashes its decoder or needs more than the reader's
limits is bad input too. Bad input (an `InputError`: a
file that is not a sweep, an unknown sensor, an unwritable output) prints one `lidar: error: ...` line to
stderr and exits with status 2. Anything else is a bug and ends in a traceback
with status 1, so it is reported rather than passed off as the user's mistake.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from lidar.errors import InputError, shown
from lidar.formats import (
    PointCloudError,
    Scan,
    azimuth_coverage_deg,
    detect_sensor,
    write_points,
)
from lidar.formats.io import format_for
from lidar.range_image import beam_rows, point_elevations, project
from lidar.recordings import TOPIC_HELP, is_container
from lidar.recordings.convert import (
    BAG_SUFFIXES,
    check_bag_output,
    convert_recording,
    convert_sweep,
    print_recording,
    summarize_recording,
)
from lidar.sandbox import WorkerContainer, one_sweep, open_recording, read_points
from lidar.sensors import PRESETS, Sensor, get_sensor

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, like every other error of this CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"lidar: error: {message} (see `python -m lidar --help`)\n")


#: Widest BEV picture `render` draws: bev_image refuses more than 4096 pixels a side at its 0.125 m a pixel.
MAX_EXTENT_M = 256.0


def _sensor_arg(name: str | None) -> Sensor | None:
    if name is None:
        return None
    try:
        return get_sensor(name)
    except ValueError as err:  # the preset table's own message lists every name and alias
        raise InputError(f"--sensor: {err}") from None


def _extent_metres(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_EXTENT_M:
        raise argparse.ArgumentTypeError(f"expected a number of metres in (0, {MAX_EXTENT_M:g}], got {shown(text)}")
    return value


def summarize(scan: Scan, sensor: Sensor | None = None) -> dict[str, Any]:
    """Everything `info` prints, as JSON-ready values; `sensor` overrides detection."""
    pts = scan.points
    rng = np.linalg.norm(pts[:, :3], axis=1)
    elev = np.degrees(point_elevations(pts))
    detected = sensor or detect_sensor(scan)
    out: dict[str, Any] = {
        "file": str(scan.path),
        "format": scan.format,
        "points": scan.num_points,
        "dropped_nonfinite": scan.dropped_nonfinite,
        "columns": list(scan.columns),
        "range_m": {"min": float(rng.min()), "median": float(np.median(rng)), "max": float(rng.max())},
        "elevation_deg": {"min": float(elev.min()), "max": float(elev.max())},
        "azimuth_coverage_deg": azimuth_coverage_deg(pts),
        "intensity_scale": scan.intensity_scale,
        "intensity": {"min": float(pts[:, 3].min()), "mean": float(pts[:, 3].mean()), "max": float(pts[:, 3].max())},
        "rings": None if scan.ring is None else int(np.unique(scan.ring).size),
        "sensor_frame": scan.sensor_frame,
        "likely_sensor": None if detected is None else detected.to_dict(),
        "kept_fraction": None,
        "notes": list(scan.notes),
    }
    if detected is not None:
        image = project(pts, detected, ring=scan.ring)
        out["kept_fraction"] = float(image.mask.sum()) / scan.num_points
    return out


def _print_info(info: dict[str, Any]) -> None:
    r, e, i = info["range_m"], info["elevation_deg"], info["intensity"]
    sensor = info["likely_sensor"]
    if sensor is None:
        sensor_line = "none (unsure" + ("" if info["sensor_frame"] else "; not in the sensor frame") + ")"
    else:
        elev = sensor["elevations_deg"]
        sensor_line = (
            f"{sensor['name']} ({len(elev)} beams, {elev[0]:+.1f} to {elev[-1]:+.1f} deg, {sensor['width']} columns); "
            f"project keeps {100 * info['kept_fraction']:.1f}% of the points"
        )
    lines = [
        f"file:        {info['file']}",
        f"format:      {info['format']}",
        f"points:      {info['points']:,} ({info['dropped_nonfinite']:,} NaN/inf dropped)",
        f"columns:     {', '.join(info['columns']) or '-'}",
        f"range:       {r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f} m (min / median / max)",
        f"elevation:   {e['min']:+.1f} to {e['max']:+.1f} deg",
        f"azimuth:     {info['azimuth_coverage_deg']} of 360 one-degree bins occupied",
        f"intensity:   file values / {info['intensity_scale']:g} -> {i['min']:.3f} .. {i['max']:.3f} (mean {i['mean']:.3f})",
        f"rings:       {info['rings'] if info['rings'] is not None else 'none'}",
        f"sensor:      {sensor_line}",
    ]
    lines += [f"note:        {note}" for note in info["notes"]]
    print("\n".join(lines))


def _print_notes(scan: Scan) -> None:
    """Quirks that change what gets written or drawn (e.g. a dropped multi-sweep stack) go to stderr."""
    for note in scan.notes:
        print(f"lidar: note: {note}", file=sys.stderr)


def cmd_info(args: argparse.Namespace) -> int:
    sensor = _sensor_arg(args.sensor)
    if is_container(args.file):  # a bag, pcap or dataset log: the recording, and its first sweep
        summary = summarize_recording(_container(args.file, args.topic, sensor))
        print(json.dumps(summary, indent=2)) if args.json else print_recording(summary)
        return 0
    info = summarize(read_points(args.file, sensor=sensor), sensor)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if is_container(args.input) or args.output.suffix.lower() in BAG_SUFFIXES:
        return _convert_recording(args)
    format_for(args.output, None)  # an unwritable extension fails before the input is read
    sensor = _sensor_arg(args.sensor)
    scan = read_points(args.input, sensor=sensor)
    points, ring = scan.points, scan.ring
    if ring is None and (sensor is not None or args.output.name.lower().endswith(".pcd.bin")):
        # 1. a ring the target can store: nearest beam of the given (or detected) sensor
        sensor = sensor or detect_sensor(scan)
        if sensor is None:
            raise PointCloudError(
                f"{args.input}: {args.output.name} needs a ring column, the file has none and its sensor cannot be "
                f"detected; pass --sensor (one of {sorted(PRESETS)})"
            )
        rows = beam_rows(points, sensor)
        if (rows < 0).any():
            print(f"lidar: dropped {(rows < 0).sum():,} points outside the beams of {sensor.name}", file=sys.stderr)
        points, ring = points[rows >= 0], rows[rows >= 0]
    _print_notes(scan)
    out = write_points(args.output, points, ring=ring)
    print(f"wrote {out} ({len(points):,} points{'' if ring is None else ', with ring'}) from {scan.format}")
    return 0


def _convert_recording(args: argparse.Namespace) -> int:
    """A container to a bag, or one sweep file to a bag of one sweep."""
    check_bag_output(args.output)
    sensor = _sensor_arg(args.sensor)
    if is_container(args.input):
        count, points = convert_recording(_container(args.input, args.topic, sensor), args.output, sweeps=args.sweeps)
    else:
        count, points = convert_sweep(read_points(args.input, sensor=sensor), args.output)
    print(f"wrote {args.output} ({count} sweeps, {points:,} points)")
    return 0


def _container(path: Path, topic: str | None, sensor: Sensor | None) -> WorkerContainer:
    """The recording in the container `path`, indexed and decoded in workers."""
    rec = open_recording(path, sensor=sensor, topic=topic)
    if not isinstance(rec, WorkerContainer):  # is_container said so from the path; the worker read the layout
        raise PointCloudError(f"{path}: not a recording container")
    return rec


def _check_picture_path(out: Path) -> None:
    """Refuse an --out Pillow cannot write before the scan is read, naming what would work."""
    from PIL import Image

    suffix = out.suffix.lower()
    if Image.registered_extensions().get(suffix) not in Image.SAVE:
        raise InputError(
            f"{out}: cannot save a picture as {suffix or 'a file without an extension'}; "
            "expected --out ending in .png (or another image type such as .jpg or .webp)"
        )


def cmd_render(args: argparse.Namespace) -> int:
    from lidar.render import bev_image, range_image_png  # Pillow drawing only when rendering

    _check_picture_path(args.out)
    sensor = _sensor_arg(args.sensor)
    scan, _ = one_sweep(args.file, args.sweep, topic=args.topic, sensor=sensor)
    _print_notes(scan)
    if args.view == "bev":
        image = bev_image(scan.points, extent=args.extent, color_by=args.color_by)
    else:
        sensor = sensor or detect_sensor(scan)
        if sensor is None:
            reason = "it is not in the sensor frame" if not scan.sensor_frame else "no preset fits its beams"
            raise PointCloudError(f"{args.file}: cannot pick a sensor for the range view ({reason}); pass --sensor")
        image = range_image_png(project(scan.points, sensor, ring=scan.ring), max_range=sensor.max_range)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        image.save(args.out)
    except OSError as err:
        raise InputError(f"{args.out}: cannot write ({err.strerror or err})") from err
    print(f"wrote {args.out} ({image.width}x{image.height}, {args.view} view of {scan.num_points:,} points)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m lidar", description="Inspect, convert and render LiDAR point-cloud files.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sensors = f"sensor preset or alias ({', '.join(sorted(PRESETS))}, kitti, nuscenes, ...)"

    info = sub.add_parser("info", help="points, columns, range, elevation/azimuth coverage, intensity scale, sensor")
    info.add_argument("file", type=Path)
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--sensor", help=f"use this {sensors} instead of detecting it")
    info.add_argument("--topic", help=TOPIC_HELP)
    info.set_defaults(func=cmd_info)

    convert = sub.add_parser("convert", help="rewrite a file in the format of OUT's extension")
    convert.add_argument("input", type=Path)
    convert.add_argument("output", type=Path, help=".bin, .pcd.bin (nuScenes), .pcd, .ply, .npy, .npz, .las, .laz; "
                         "a recording (bag, pcap, dataset log) to .mcap, .db3 or .bag")
    convert.add_argument("--sensor", help=f"{sensors}; derives a ring column (nearest beam) when the file has none")
    convert.add_argument("--topic", help=TOPIC_HELP)
    convert.add_argument("--sweeps", help="START:STOP, the sweeps of a recording to write, e.g. 0:8 or --sweeps=-8: "
                         "(default: all)")
    convert.set_defaults(func=cmd_convert)

    render = sub.add_parser("render", help="draw a bird's-eye or range-image PNG")
    render.add_argument("file", type=Path)
    render.add_argument("--out", type=Path, required=True, help="output picture (.png)")
    render.add_argument("--view", choices=("bev", "range"), default="bev")
    render.add_argument("--sensor", help=f"{sensors} for the range view (default: detected)")
    render.add_argument("--extent", type=_extent_metres, default=50.0,
                        help=f"BEV half-width in metres, up to {MAX_EXTENT_M:g} (default 50)")
    render.add_argument("--color-by", choices=("height", "density", "intensity"), default="height")
    render.add_argument("--topic", help=TOPIC_HELP)
    render.add_argument("--sweep", type=int, default=0, help="the sweep of a recording to draw (default 0, the first)")
    render.set_defaults(func=cmd_render)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except InputError as err:
        print(f"lidar: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE

"""What `python -m lidar info` and `convert` do with a recording container: summarise it, and rewrite its
sweeps (or a slice of them) as a ROS bag (`lidar.export4d.write_bag`: .mcap, .db3, .bag) that keeps the
points, rings, stamps and poses, sweep by sweep."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lidar.errors import InputError
from lidar.export4d import BAG_SUFFIXES, Sweep, Track, write_bag
from lidar.formats import Scan
from lidar.recordings import ContainerRecording


def parse_slice(text: str | None, count: int) -> range:
    """`START:STOP` (either may be left out, negatives count from the end) as the sweeps it selects."""
    if text is None:
        return range(count)
    start, colon, stop = text.partition(":")
    try:
        chosen = slice(int(start) if start else None, int(stop) if stop else None) if colon else None
    except ValueError:
        chosen = None
    if chosen is None:
        raise InputError(f"--sweeps {text!r}: expected START:STOP, e.g. 0:8 or -8:")
    picked = range(count)[chosen]
    if not picked:
        raise InputError(f"--sweeps {text!r} selects none of the {count} sweeps")
    return picked


def summarize_recording(rec: ContainerRecording) -> dict[str, Any]:
    """What `info` prints about a container, with its first sweep's points and rings."""
    first = rec[0]
    return {
        "file": str(rec.files[0]),
        "container": rec.kind,
        "topic": rec.topic,
        "sweeps": len(rec),
        "seconds": float(rec.times[-1]) if rec.times is not None and len(rec.times) else 0.0,
        "first_stamp_ns": int(rec.stamps_ns[0]),
        "poses": rec.poses is not None,
        "first_sweep": {"name": rec.names[0], "points": first.num_points,
                        "rings": None if first.ring is None else int(np.unique(first.ring).size),
                        "notes": list(first.notes)},
    }


def print_recording(info: dict[str, Any]) -> None:
    sweep = info["first_sweep"]
    lines = [
        f"file:        {info['file']}",
        f"container:   {info['container']}" + (f" ({info['topic']})" if info["topic"] else ""),
        f"sweeps:      {info['sweeps']} over {info['seconds']:.3f} s (first stamp {info['first_stamp_ns']} ns)",
        f"poses:       {'from the container' if info['poses'] else 'none (registered when used)'}",
        f"first sweep: {sweep['name']}: {sweep['points']:,} points, "
        f"{sweep['rings'] if sweep['rings'] is not None else 'no'} rings",
    ]
    lines += [f"note:        {note}" for note in sweep["notes"]]
    print("\n".join(lines))


def check_bag_output(output: Path) -> None:
    """Refuse an output a recording cannot be written as, before anything is read."""
    if output.suffix.lower() not in BAG_SUFFIXES:
        raise InputError(f"{output}: a recording converts to a bag ({', '.join(BAG_SUFFIXES)}); to write one sweep "
                         "as a point file, convert a single sweep file")


def convert_recording(rec: ContainerRecording, output: Path, *, sweeps: str | None = None) -> tuple[int, int]:
    """Write the chosen `sweeps` (START:STOP, default all) of `rec` as the bag `output`, on the recording's
    topic (else /points); returns (sweeps, points)."""
    chosen = parse_slice(sweeps, len(rec))
    stream = (Sweep(scan.points, int(rec.stamps_ns[i]), None if rec.poses is None else rec.poses[i], scan.ring)
              for i, scan in zip(chosen, rec.sweeps(chosen), strict=True))
    return write_sweeps(output, rec.topic or "/points", stream)


def convert_sweep(scan: Scan, output: Path) -> tuple[int, int]:
    """Write one sweep as a bag of one message on /points, stamped 0; returns (1, points)."""
    return write_sweeps(output, "/points", iter([Sweep(scan.points, 0, None, scan.ring)]))


def write_sweeps(output: Path, topic: str, stream: Iterator[Sweep]) -> tuple[int, int]:
    """Write `stream` as the bag `output` on `topic` (frame "lidar"), a sweep at a time; returns (sweeps, points)."""
    check_bag_output(output)
    counted = [0, 0]

    def counting() -> Iterator[Sweep]:
        for sweep in stream:
            counted[0] += 1
            counted[1] += len(sweep.points)
            yield sweep

    topic_name = topic if topic.startswith("/") else f"/{topic}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_bag(output, [Track("points", counting(), topic=topic_name, frame="lidar")])
    except OSError as err:
        raise InputError(f"{output}: cannot write ({err.strerror or err})") from err
    return counted[0], counted[1]

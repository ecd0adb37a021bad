"""Every rollout as a 4D recording beside its frame files: `result.rrd` (Rerun) and `result.mcap` (a ROS 2 bag
of PointCloud2 plus /tf, for Foxglove and RViz), written by `lidar.export4d` from the rollout's arrays.

The generated frames are the track `generated`; the sweeps a forecast or re-simulation started from are the
track `observed`, at their recorded times (10 Hz when they came without). Generated frames follow at 10 Hz:
a forecast's after its newest observed sweep, a generation's from 0, and a re-simulation's spread over the
observed span, since it re-renders the same moments from another path. Stamps count from 0 (ns).
An upsampled sweep is the track `observed` (the input) beside `generated` (every point of the result, the
input's first), both at time 0 in the sensor frame, each with its rings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from inference.observed import ObservedScene
from inference.rollout import RolloutResult
from inference.upsample import UpsampleResult
from lidar.export4d import Sweep, Track, write_bag, write_rrd
from lidar.formats import Scan
from lidar.vocabulary import FRAME_RATE_HZ

RRD_NAME = "result.rrd"
MCAP_NAME = "result.mcap"
#: Boxes at a frame's time and pose: (K, 7) world boxes and their (K,) classes.
BoxSource = Callable[[float, np.ndarray], tuple[np.ndarray, np.ndarray]]


def observed_times(scene: ObservedScene) -> np.ndarray:
    times = scene.times
    return np.arange(len(scene.scans)) / FRAME_RATE_HZ if times is None else np.asarray(times, dtype=np.float64)


def frame_times(kind: str, frames: int, scene: ObservedScene | None = None) -> np.ndarray:
    """Seconds of each generated frame (module docstring)."""
    step = np.arange(frames) / FRAME_RATE_HZ
    if scene is None:
        return step
    seen = observed_times(scene)
    if kind == "resimulate" and len(seen) > 1:
        return np.linspace(seen[0], seen[-1], frames)
    return seen[-1] + step + (1.0 / FRAME_RATE_HZ if kind == "forecast" else 0.0)


def write_views(folder: str | Path, result: RolloutResult, kind: str, scene: ObservedScene | None = None,
                boxes: BoxSource | None = None) -> dict[str, Path]:
    """Write `result.rrd` and `result.mcap` into `folder`; returns their paths by name."""
    folder = Path(folder)
    times = frame_times(kind, len(result.frames), scene)
    paths = {}
    for name, writer in ((RRD_NAME, write_rrd), (MCAP_NAME, write_bag)):
        tracks = [Track("generated", _generated(result, times, boxes))]
        if scene is not None:
            tracks.insert(0, Track("observed", _observed(scene)))
        paths[name] = writer(folder / name, tracks)
    return paths


def write_upsample_views(folder: str | Path, scan: Scan, result: UpsampleResult) -> dict[str, Path]:
    """Write `result.rrd` and `result.mcap` of an upsampled sweep into `folder`; returns their paths by name."""
    folder = Path(folder)
    paths = {}
    for name, writer in ((RRD_NAME, write_rrd), (MCAP_NAME, write_bag)):
        tracks = [Track("observed", [Sweep(scan.points, 0, np.eye(4), scan.ring)]),
                  Track("generated", [Sweep(result.points, 0, np.eye(4), result.rings)])]
        paths[name] = writer(folder / name, tracks)
    return paths


def _ns(seconds: float) -> int:
    return round(float(seconds) * 1e9)


def _generated(result: RolloutResult, times: np.ndarray, boxes: BoxSource | None):
    for frame, t in zip(result.frames, times, strict=True):
        shown = (None, None) if boxes is None else boxes(float(t), frame.pose)
        yield Sweep(frame.points, _ns(t), frame.pose, frame.rings, shown[0], shown[1])


def _observed(scene: ObservedScene):
    for scan, pose, t in zip(scene.scans, scene.poses, observed_times(scene), strict=True):
        yield Sweep(scan.points, _ns(t), pose, scan.ring)

"""Simulated vs real sweeps: range and intensity histograms, per-beam return rates, ground-ring radii.

`python -m lidar.sim.realism [--out docs/sim_real_vs_sim.png]` prints the tables of docs/simulator.md: each statistic
for the real scans (min-max over the scans, so the spread is visible) next to the simulator's, for
HDL-64E (KITTI) and HDL-32E (nuScenes: the first 3 of the 10 sweeps its file stacks, split by time offset).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.spatial.distance import jensenshannon

from lidar.range_image import RangeImage, project
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL32, HDL64, Sensor

REAL_DIR = real_scans_dir()
KITTI_FILES = ("kitti_patchworkpp_000000.bin", "kitti_patchworkpp_000002.bin", "kitti_patchworkpp_000004.bin")
NUSCENES_FILE = "nuscenes_lidaraisolution_ff9eff4389a740848f9a56ad749a4ae8.bin"
RANGE_BINS = np.concatenate([np.arange(0.0, 30.0, 2.0), np.arange(30.0, 101.0, 10.0)])
INTENSITY_BINS = np.linspace(0.0, 1.0, 21)
RING_BEAMS = 3  # lowest beams whose ground-ring radius is compared


@dataclass
class ScanStats:
    returns: int
    beam_rate: np.ndarray  # (H,) fraction of pixels with a return
    range_hist: np.ndarray  # pmf over RANGE_BINS
    range_pct: np.ndarray  # p10, p50, p90
    ring_radius: np.ndarray  # (RING_BEAMS,) median horizontal radius of ground returns, lowest beam first
    intensity_hist: np.ndarray
    intensity_pct: np.ndarray


def scan_stats(image: RangeImage, sensor: Sensor) -> ScanStats:
    """Statistics of one range image (real scans are projected into the same sensor grid first)."""
    mask = image.mask
    r = image.range[mask]
    inten = image.intensity[mask]
    dirs = sensor.ray_directions()
    z = dirs[..., 2] * image.range
    radius = np.hypot(dirs[..., 0], dirs[..., 1]) * image.range
    rings = []
    low = mask[-1]
    ground_z = np.median(z[-1][low]) if low.any() else -sensor.mount_height
    for row in range(sensor.height - 1, sensor.height - 1 - RING_BEAMS, -1):
        g = mask[row] & (np.abs(z[row] - ground_z) < 0.25)
        rings.append(float(np.median(radius[row][g])) if g.any() else np.nan)
    rh = np.histogram(np.clip(r, 0, 100.0), RANGE_BINS)[0].astype(np.float64)
    ih = np.histogram(inten, INTENSITY_BINS)[0].astype(np.float64)
    return ScanStats(
        returns=int(mask.sum()),
        beam_rate=mask.mean(axis=1),
        range_hist=rh / max(rh.sum(), 1.0),
        range_pct=np.percentile(r, [10, 50, 90]) if len(r) else np.zeros(3),
        ring_radius=np.array(rings),
        intensity_hist=ih / max(ih.sum(), 1.0),
        intensity_pct=np.percentile(inten, [10, 50, 90]) if len(inten) else np.zeros(3),
    )


def real_images(sensor_name: str, real_dir: Path = REAL_DIR) -> list[RangeImage]:
    """Real sweeps projected to the matching preset: 3 KITTI frames, or the 10 nuScenes sweeps."""
    from lidar.formats import read_points

    if sensor_name == "hdl64":
        return [project(read_points(real_dir / f).points, HDL64) for f in KITTI_FILES]
    if sensor_name == "hdl32":
        # The reader keeps only the keyframe of this stacked file; split the raw rows by their time offset
        # (intensity is 0-255 there).
        raw = np.fromfile(real_dir / NUSCENES_FILE, dtype=np.float16).reshape(-1, 5).astype(np.float32)
        raw = raw[np.isfinite(raw).all(axis=1)]
        raw[:, 3] /= 255.0
        # Older sweeps are motion-compensated into the keyframe and thin out, so only the first three
        # (0-0.1 s, under a metre of ego motion) stand for single sweeps.
        return [project(raw[raw[:, 4] == t, :4], HDL32) for t in np.unique(raw[:, 4])[:3]]
    raise ValueError(f"no real scans for sensor {sensor_name!r}; expected 'hdl64' or 'hdl32'")


def sim_images(sensor: Sensor, worlds: int = 4, frames: int = 3, seed: int = 0) -> list[RangeImage]:
    """Simulated sweeps from urban and suburban drives (the street scenes the real scans show)."""
    from lidar.sim.drive import plan_drive
    from lidar.sim.sensor_model import LidarSimulator
    from lidar.sim.world import make_world

    out = []
    for i in range(worlds):
        world = make_world(seed + i, ("urban", "suburban")[i % 2])
        poses = plan_drive(
            world,
            ("straight", "turn_left", "turn_right")[i % 3],
            frames * 5,
            seed=i,
            mount_height=sensor.mount_height,
        )
        sim = LidarSimulator(sensor, seed=seed + i)
        out += [sim.scan(world, poses[k], k * 0.1).image for k in range(0, frames * 5, 5)]
    return out


def _fmt(vals: list[float], digits: int = 2) -> str:
    lo, hi = min(vals), max(vals)
    return f"{lo:.{digits}f}" if abs(hi - lo) < 10**-digits else f"{lo:.{digits}f}-{hi:.{digits}f}"


def compare(
    real: list[ScanStats], sim: list[ScanStats], rel_tol: float = 0.2
) -> list[tuple[str, str, str, str]]:
    """Rows (statistic, real min-max, sim min-max, verdict).

    The verdict says whether the sim mean lies in the real spread, else whether it is within `rel_tol`
    of the real mean (a few frames of one drive barely spread, so the spread alone is too strict).
    """
    rows = []

    def verdict(rv: list[float], sv: list[float]) -> str:
        m = float(np.mean(sv))
        if min(rv) - 1e-9 <= m <= max(rv) + 1e-9:
            return "in spread"
        rm = float(np.mean(rv))
        return f"within {rel_tol:.0%}" if abs(m - rm) <= rel_tol * abs(rm) else f"off ({m / rm - 1:+.0%})"

    def add(name: str, f, digits: int = 2) -> None:
        rv = [float(f(s)) for s in real]
        sv = [float(f(s)) for s in sim]
        rows.append((name, _fmt(rv, digits), _fmt(sv, digits), verdict(rv, sv)))

    add("returns per sweep", lambda s: s.returns, 0)
    add("return rate, all beams", lambda s: s.beam_rate.mean())
    h = len(real[0].beam_rate)
    add("return rate, upper half", lambda s: s.beam_rate[: h // 2].mean())
    add("return rate, lower half", lambda s: s.beam_rate[h // 2 :].mean())
    for i, q in enumerate(("p10", "median", "p90")):
        add(f"range {q} (m)", lambda s, i=i: s.range_pct[i], 1)
    for b in range(RING_BEAMS):
        add(f"ground ring radius, beam {h - 1 - b} (m)", lambda s, b=b: s.ring_radius[b], 2)
    for i, q in enumerate(("p10", "median", "p90")):
        add(f"intensity {q}", lambda s, i=i: s.intensity_pct[i], 3)
    # Distribution distances: real-to-real spread vs sim-to-real (lower is better; "in spread" if no worse).
    for name, key in (
        ("range-histogram JSD to real mean", "range_hist"),
        ("intensity-histogram JSD to real mean", "intensity_hist"),
        ("per-beam return rate, mean abs diff to real", "beam_rate"),
    ):
        ref = np.mean([getattr(s, key) for s in real], axis=0)

        def dist(s, key=key, ref=ref):
            v = getattr(s, key)
            return float(np.abs(v - ref).mean()) if key == "beam_rate" else float(jensenshannon(v, ref))

        rv, sv = [dist(s) for s in real], [dist(s) for s in sim]
        rows.append((name, _fmt(rv, 3), _fmt(sv, 3), "in spread" if np.mean(sv) <= max(rv) else "farther"))
    return rows


def markdown_table(sensor_label: str, real_label: str, rows: list[tuple[str, str, str, str]]) -> str:
    """A realism table of docs/simulator.md, printed so the numbers there can be regenerated rather than retyped."""
    lines = [
        f"| {sensor_label} | {real_label} (real, min-max) | simulated (min-max) | sim mean vs real |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {r} | {s} | {v} |" for name, r, s, v in rows]
    return "\n".join(lines)


def side_by_side(out: Path, seed: int = 0, real_dir: Path = REAL_DIR) -> Path:
    """Real KITTI frame next to a simulated HDL-64E sweep, same BEV renderer and colours."""
    from PIL import Image, ImageDraw

    from lidar.formats import read_points
    from lidar.range_image import unproject
    from lidar.render import bev_image

    real = read_points(real_dir / KITTI_FILES[0]).points
    sim = unproject(sim_images(HDL64, worlds=2, frames=1, seed=seed)[1], HDL64)
    a = bev_image(real, extent=50.0, color_by="intensity")
    b = bev_image(sim, extent=50.0, color_by="intensity")
    canvas = Image.new("RGB", (a.width + b.width + 10, max(a.height, b.height) + 28), (255, 255, 255))
    canvas.paste(a, (0, 28))
    canvas.paste(b, (a.width + 10, 28))
    draw = ImageDraw.Draw(canvas)
    draw.text((8, 8), "real: KITTI seq 00 frame 0 (HDL-64E)", fill=(0, 0, 0))
    draw.text((a.width + 18, 8), "simulated: lidar.sim HDL-64E, suburban world", fill=(0, 0, 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lidar.sim.realism", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=4)
    parser.add_argument("--frames", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the side-by-side BEV PNG here")
    parser.add_argument("--real-dir", type=Path, default=REAL_DIR, help="folder with the shared real scans")
    args = parser.parse_args(argv)
    if args.worlds < 1 or args.frames < 1:
        print(
            f"error: need --worlds >= 1 and --frames >= 1, got {args.worlds} and {args.frames}",
            file=sys.stderr,
        )
        return 2
    missing = [f for f in (*KITTI_FILES, NUSCENES_FILE) if not (args.real_dir / f).is_file()]
    if missing:
        print(f"error: real scans {missing} not found in {args.real_dir}; pass --real-dir", file=sys.stderr)
        return 2
    for sensor, real_label in ((HDL64, "KITTI seq 00, 3 frames"), (HDL32, "nuScenes, 3 sweeps")):
        real = [scan_stats(im, sensor) for im in real_images(sensor.name, args.real_dir)]
        sim = [scan_stats(im, sensor) for im in sim_images(sensor, args.worlds, args.frames)]
        print(markdown_table(f"{sensor.name} statistic", real_label, compare(real, sim)))
        print()
    if args.out is not None:
        print(side_by_side(args.out, real_dir=args.real_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

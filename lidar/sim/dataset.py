"""Simulated datasets on disk (one .npz per sequence + manifest.json), written by `write_dataset` and read
back by `SimDataset`.

Sequence i of a dataset is a pure function of (seed, i): `sequence_spec` picks its world, style, action and
drive, so any one sequence can be rebuilt alone (`generate_sequence`) and equals what the writer wrote.

File layout (keys are a contract with training; extend only by adding):
    DIR/manifest.json        written last (tmp + rename): sensor, class names, keys, one entry per sequence
    DIR/seq_00000.npz        range (T,H,W) float32 m, 0 = no return; intensity (T,H,W) float32 [0,1];
                             labels (T,H,W) uint8 POINT_CLASSES; instances (T,H,W) int32 actor id or -1;
                             map_classes (T,H,W) uint8 MAP_CLASSES; poses (T,4,4) float64 world_from_sensor;
                             times (T,) float64 s; boxes (B,7) float32 world cx,cy,cz,l,w,h,yaw;
                             box_class (B,) int16 OBJECT_CLASSES; box_id (B,) int32; box_frame (B,) int32;
                             map_* (HDMap.to_dict: raster, origin, resolution, terrain, vectors JSON);
                             optional points (N,4) float32 sensor frame + point_offsets (T+1,) int64.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lidar.sensors import Sensor
from lidar.sim.drive import plan_drive
from lidar.sim.hdmap import HDMap
from lidar.sim.sequence import SimSequence, simulate_sequence
from lidar.sim.styles import STYLE_PROFILES, STYLES
from lidar.sim.world import check_seed, make_world
from lidar.vocabulary import ACTIONS, FRAME_RATE_HZ, MAP_CLASSES, OBJECT_CLASSES, POINT_CLASSES

logger = logging.getLogger(__name__)

FORMAT = "lidarverse-sim"
FORMAT_VERSION = 1
#: What the simulator makes of a seed. Bumped whenever the same seed gives other sweeps or maps (2: window
#: rays stop at a building's rooms, trees and hedges listed in the map; 3: holes in windows, foliage and
#: fences are places, not per-ray dice), so a set simulated by an older version is recognised as stale
#: instead of silently scored against today's worlds.
SIMULATOR_VERSION = 3
MANIFEST = "manifest.json"
FRAME_KEYS = ("range", "intensity", "labels", "instances", "map_classes")


@dataclass(frozen=True)
class SequenceSpec:
    """Everything that decides one sequence; the manifest stores it so a sequence can be rebuilt alone."""

    index: int
    world_seed: int
    style: str
    action: str
    drive_seed: int
    sim_seed: int


def sequence_spec(seed: int, index: int) -> SequenceSpec:
    """What sequence `index` of a dataset with `seed` is: world, style, action and seeds (pure function)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index), 0x51A]))
    style = str(rng.choice(STYLES, p=[STYLE_PROFILES[s].dataset_weight for s in STYLES]))
    return SequenceSpec(
        index=int(index),
        world_seed=int(rng.integers(0, 2**31 - 1)),
        style=style,
        action=str(rng.choice(ACTIONS)),
        drive_seed=int(rng.integers(0, 2**31 - 1)),
        sim_seed=int(rng.integers(0, 2**31 - 1)),
    )


def generate_sequence(spec: SequenceSpec, sensor: Sensor, frames: int) -> SimSequence:
    """The one place a spec becomes a drive, shared by the writer and the on-the-fly stream so they agree."""
    world = make_world(spec.world_seed, spec.style)
    poses = plan_drive(world, spec.action, frames, seed=spec.drive_seed, mount_height=sensor.mount_height)
    return simulate_sequence(world, poses, sensor, seed=spec.sim_seed)


def sequence_arrays(seq: SimSequence, with_points: bool = False) -> dict[str, np.ndarray]:
    """The .npz content of one sequence (see the module docstring for keys)."""
    out: dict[str, np.ndarray] = {
        "range": np.stack([f.image.range for f in seq.frames]).astype(np.float32),
        "intensity": np.stack([f.image.intensity for f in seq.frames]).astype(np.float32),
        "labels": np.stack([f.label_image for f in seq.frames]).astype(np.uint8),
        "instances": np.stack([f.instance_image for f in seq.frames]).astype(np.int32),
        "map_classes": seq.map_classes.astype(np.uint8),
        "poses": seq.poses.astype(np.float64),
        "times": seq.times.astype(np.float64),
        "boxes": np.concatenate([b["boxes"] for b in seq.boxes]).astype(np.float32).reshape(-1, 7),
        "box_class": np.concatenate([b["box_class"] for b in seq.boxes]).astype(np.int16),
        "box_id": np.concatenate([b["box_id"] for b in seq.boxes]).astype(np.int32),
        "box_frame": np.concatenate([np.full(len(b["boxes"]), i, np.int32) for i, b in enumerate(seq.boxes)]),
        "sensor": np.array(json.dumps(seq.sensor.to_dict())),
        **seq.hdmap.to_dict(),
    }
    if with_points:
        out["points"] = np.concatenate([f.points for f in seq.frames]).astype(np.float32)
        out["point_offsets"] = np.concatenate([[0], np.cumsum([len(f.points) for f in seq.frames])]).astype(
            np.int64
        )
    return out


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _write_one(args: tuple[str, int, int, dict, int, bool]) -> dict[str, Any]:
    """Simulate and write one sequence; takes plain data (a sensor dict) so spawned workers can pickle it."""
    out_dir, seed, index, sensor_dict, frames, with_points = args
    spec = sequence_spec(seed, index)
    seq = generate_sequence(spec, Sensor.from_dict(sensor_dict), frames)
    name = f"seq_{index:05d}.npz"
    _write_npz(Path(out_dir) / name, sequence_arrays(seq, with_points))
    return {
        "file": name,
        "index": index,
        "world_seed": spec.world_seed,
        "style": spec.style,
        "action": spec.action,
        "drive_seed": spec.drive_seed,
        "sim_seed": spec.sim_seed,
        "frames": frames,
    }


def _writable_dir(out: Path) -> Path:
    """`out`, created if needed, once a probe file could be written there (else a ValueError naming it)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"output folder {out} is not a writable directory ({exc.strerror or exc}); expected a folder "
            "this user can create files in"
        ) from exc
    return out


def write_dataset(
    out_dir: str | Path,
    sensor: Sensor,
    sequences: int,
    frames: int,
    seed: int = 0,
    with_points: bool = False,
    workers: int = 1,
) -> Path:
    """Generate `sequences` drives of `frames` frames into `out_dir`; the manifest is written last.

    Arguments and the output folder are checked before any simulation, so a typo costs no compute.
    """
    if sequences < 1 or frames < 1:
        raise ValueError(f"need sequences >= 1 and frames >= 1, got sequences={sequences}, frames={frames}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (processes to simulate with), got {workers}")
    seed = check_seed(seed)
    out = _writable_dir(Path(out_dir))
    jobs = [
        (str(out), int(seed), i, sensor.to_dict(), int(frames), bool(with_points)) for i in range(sequences)
    ]
    t0 = time.perf_counter()
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            entries = list(pool.imap(_write_one, jobs))
    else:
        entries = []
        for job in jobs:
            entries.append(_write_one(job))
            logger.info("wrote %s (%d/%d)", entries[-1]["file"], len(entries), sequences)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "simulator": SIMULATOR_VERSION,
        "seed": int(seed),
        "frame_rate_hz": FRAME_RATE_HZ,
        "sensor": sensor.to_dict(),
        "map_classes": list(MAP_CLASSES),
        "object_classes": list(OBJECT_CLASSES),
        "point_classes": list(POINT_CLASSES),
        "frame_keys": list(FRAME_KEYS),
        "with_points": bool(with_points),
        "sequences": entries,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    logger.info(
        "dataset %s: %d sequences x %d frames in %.1f s", out, sequences, frames, time.perf_counter() - t0
    )
    return out / MANIFEST


class SimDataset:
    """The sequences of a dataset written by `write_dataset`: its manifest, its sensor, and each sequence's
    arrays (`load_sequence`, the last `cache_size` kept in memory since training revisits a sequence for
    many samples)."""

    def __init__(self, root: str | Path, cache_size: int = 4) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; expected a dataset written by `python -m lidar.sim --out DIR`"
            )
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r} is not {FORMAT!r}")
        self.sensor = Sensor.from_dict(self.manifest["sensor"])
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._cache_size = cache_size

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self.manifest["sequences"])

    def load_sequence(self, i: int) -> dict[str, np.ndarray]:
        """All arrays of sequence i (the .npz content), cached."""
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        entry = self.manifest["sequences"][i]
        t0 = time.perf_counter()
        with np.load(self.root / entry["file"], allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        logger.debug("read %s in %.3f s", entry["file"], time.perf_counter() - t0)
        self._cache[i] = arrays
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return arrays

    def hdmap(self, i: int) -> HDMap:
        """Sequence i's map, for re-casting `range_view_classes` from augmented poses."""
        return HDMap.from_dict(self.load_sequence(i))

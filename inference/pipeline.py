"""`LidarVersePipeline`: a loaded world model plus the four ways to use it, each one call with checked inputs.

The pipeline owns no generation loop: every call turns user-level inputs (a map seed and an action, real
scans from any sensor, target poses) into what `inference.rollout.rollout` takes, and returns its
`RolloutResult` (frames with points, range image and pose; the accumulated world; timings). Inputs are
checked here, before any compute, so a UI can show the message as it is.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.allocator import keep_freed_memory
from inference.cache import SpatialCache
from inference.fill_network import FillNetwork, load_fill_network
from inference.limits import LIBRARY_LIMITS, Limits
from inference.loader import Provenance, inference_device, load_model
from inference.measured import Observation, ego_body, observation, without_ego_body
from inference.network import WorldModel, WorldModelConfig
from inference.rollout import Progress, RolloutResult, cache_from_scans, frame_times, rollout
from inference.upsample import UpsampleResult, upsample
from lidar.errors import InputError, shown
from lidar.formats import Scan, detect_sensor, write_points
from lidar.formats.rings import MAX_BEAMS, scan_order
from lidar.range_image import RangeImage, grid_winners, unproject
from lidar.rows import finite_rows, take_rows
from lidar.sensors import Sensor, get_sensor
from lidar.sim import World, make_world, plan_drive
from lidar.vocabulary import ACTION_YAW_SIGN, ACTIONS, FRAME_RATE_HZ, MapSource, check_poses

logger = logging.getLogger(__name__)

#: The library's bounds (`inference.limits.LIBRARY_LIMITS`) under the names the public API has exported.
MAX_FRAMES = LIBRARY_LIMITS.max_frames
MAX_STEPS = LIBRARY_LIMITS.max_steps
#: Dead-reckoned ego motion for forecasts from real scans, which come without a map to plan on.
FORECAST_SPEED = 6.0  # m/s
FORECAST_TURN_RADIUS = 12.0  # m
#: Written beside the frame files by `write_rollout`.
POSES_NAME = "poses.json"
#: A prefix scan must leave at least this many returns on the model's beams to be worth conditioning on.
MIN_PREFIX_RETURNS = 100
#: Points per step of that count: thousands of rays in any real sweep's first chunk.
RETURNS_CHUNK = 4096

ScanLike = Scan | np.ndarray | RangeImage
Callback = Callable[[Progress], None]


class LidarVersePipeline:
    """A world model ready for inference: `generate_world`, `forecast`, `resimulate`, `sample_sweep`, `upsample`."""

    def __init__(self, model: WorldModel, provenance: Provenance, fill_network: FillNetwork | None = None) -> None:
        self.model = model
        self.provenance = provenance
        #: The release's learned fill for `upsample(method="learned")`; None where it ships none.
        self.fill_network = fill_network

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        config: WorldModelConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool | None = None,
        compile: bool = False,
    ) -> LidarVersePipeline:
        """Load any source `inference.loader` resolves; `compile=True` runs torch.compile on CUDA only.

        Loading also tells glibc's malloc to keep the memory frames free (`inference.allocator`): at native
        resolution giving it back cost page faults in every sampler step.
        """
        keep_freed_memory()
        device, dtype = inference_device(device, dtype)
        model, provenance = load_model(
            source,
            config=config,
            device=device,
            dtype=dtype,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
        if compile and next(model.parameters()).device.type == "cuda":
            model = torch.compile(model)  # type: ignore[assignment]  # attributes proxy to the module
        weight = next(model.parameters())
        fill = None if provenance.fill is None else load_fill_network(provenance.fill, weight.device, weight.dtype)
        return cls(model, provenance, fill)

    @property
    def sensor(self) -> Sensor:
        return self.model.config.sensor_obj

    @property
    def config(self) -> WorldModelConfig:
        return self.model.config

    def __call__(self, *args: Any, **kwargs: Any) -> RolloutResult:
        return self.generate_world(*args, **kwargs)

    def __repr__(self) -> str:
        p = self.provenance
        return f"LidarVersePipeline(source={p.source!r}, iteration={p.iteration}, sensor={p.sensor}, device={p.device})"

    # ------------------------------------------------------------------------------------------------------

    def generate_world(
        self,
        map: int | World | None = None,
        *,
        style: str = "urban",
        action: str | None = "straight",
        poses: np.ndarray | None = None,
        frames: int = 8,
        times: np.ndarray | None = None,
        steps: int | None = None,
        seed: int = 0,
        guidance: float | None = None,
        sensor: Sensor | str | None = None,
        callback: Callback | None = None,
    ) -> RolloutResult:
        """Roll out a drive through a procedural world: `map` is a `make_world` seed (default: `seed`) or a World.

        The ego either follows `action` along the map's lanes (`plan_drive`) or the given `poses`; every frame
        is conditioned on the world's HD map and on its actors' boxes at the frame's time (`times`, default
        10 Hz from `World.time`). The frames draw the world the map and the boxes describe: nothing stands in
        front of their surfaces by more than the snap tolerance (`inference.rollout.on_mapped_surfaces`).
        `sensor` (a `Sensor`, e.g. `HDL64.with_width(2048)`, or a preset name) is the LiDAR the frames come
        from; default the model's own.
        """
        start = time.perf_counter()
        # 1. check everything before any compute
        steps, guidance = self._check_sampling(steps, guidance, seed, callback)
        grid = self.grid(sensor)
        if poses is not None:
            poses = _check_poses(poses, "poses")
            LIBRARY_LIMITS.check_frames(len(poses), "len(poses)")
        else:
            LIBRARY_LIMITS.check_frames(frames)
            _check_action(action)
        world = _world(map, style, seed)
        # 2. plan the drive on the map's lanes, with the sensor at the model's mount height
        if poses is None:
            poses = plan_drive(world, action, frames, seed=seed, mount_height=grid.mount_height)
        # 3. roll out
        return self._rollout(
            poses, start, **_scene(world, len(poses), times), steps=steps, seed=seed, guidance=guidance,
            callback=callback, sensor=grid,
        )

    def forecast(
        self,
        prefix_scans: Sequence[ScanLike],
        *,
        prefix_poses: np.ndarray | None = None,
        prefix_times: np.ndarray | None = None,
        action: str | None = "straight",
        poses: np.ndarray | None = None,
        frames: int = 8,
        times: np.ndarray | None = None,
        steps: int | None = None,
        seed: int = 0,
        guidance: float | None = None,
        map: World | MapSource | None = None,
        feedback: bool = False,
        sensor: Sensor | str | None = None,
        callback: Callback | None = None,
    ) -> RolloutResult:
        """Continue from observed sweeps (real ones included) for `frames` more, following `action` or `poses`.

        Without `poses` the ego continues at the motion its posed prefix measured (`measured_motion`, sweeps at
        `prefix_times` s, default 10 Hz), bent by `action`; a single sweep, or scans without `prefix_poses`,
        drive on at `FORECAST_SPEED`.

        The frames come out in the geometry of the newest prefix sweep (its measured beams and columns,
        `native_sensor`) unless `sensor` names another. Scans from any sensor go into the cache as they are
        (every point, in its voxel); the model sees them z-buffered onto the frames' beams. Without `prefix_poses` the
        scans are taken to be from one place (identity poses); future `poses` share their world frame.
        Every frame is conditioned on what was observed, not on the frames generated before it: fed back,
        a 4-step model's own errors compound (the held-out Chamfer at 1.0 s doubled). `feedback=True` feeds
        them back anyway (observed points still win their voxels), so invented content stays put between
        frames, as in `generate_world`.
        """
        start = time.perf_counter()
        steps, guidance = self._check_sampling(steps, guidance, seed, callback)
        measured = prefix_poses is not None
        grid, prefix_poses, cache, observed = self._observe(prefix_scans, "prefix_scans", sensor, prefix_poses,
                                                            "prefix_poses")
        if poses is not None:
            poses = _check_poses(poses, "poses")
            LIBRARY_LIMITS.check_frames(len(poses), "len(poses)")
        else:
            LIBRARY_LIMITS.check_frames(frames)
            _check_action(action)
            if prefix_times is not None:
                prefix_times = frame_times(len(prefix_poses), prefix_times)
            motion = measured_motion(prefix_poses, prefix_times) if measured and len(prefix_poses) > 1 else None
            poses = action_poses(prefix_poses[-1], action, frames, motion=motion)
        if not isinstance(feedback, bool):
            raise InputError(f"feedback must be True or False, got {shown(feedback)}")
        scene = _scene(map, len(poses), times)
        clock = _prefix_clock(len(prefix_poses), prefix_times, scene["times"][0], times is not None)
        return self._rollout(
            poses,
            start,
            **scene,
            cache=cache,
            measured=partial(observed, times=clock),
            steps=steps,
            seed=seed,
            guidance=guidance,
            callback=callback,
            update_cache=feedback,
            sensor=grid,
        )

    def resimulate(
        self,
        scans: Sequence[ScanLike],
        poses: np.ndarray,
        target_poses: np.ndarray,
        *,
        steps: int | None = None,
        seed: int = 0,
        guidance: float | None = None,
        map: World | MapSource | None = None,
        sensor: Sensor | str | None = None,
        callback: Callback | None = None,
    ) -> RolloutResult:
        """Render observed sweeps (at `poses`) from new `target_poses`; generated frames do not feed back.

        The frames come out in the geometry of the newest sweep (`native_sensor`) unless `sensor` names another.
        """
        start = time.perf_counter()
        steps, guidance = self._check_sampling(steps, guidance, seed, callback)
        grid, poses, cache, observed = self._observe(scans, "scans", sensor, poses, "poses")
        target_poses = _check_poses(target_poses, "target_poses")
        LIBRARY_LIMITS.check_frames(len(target_poses), "len(target_poses)")
        return self._rollout(
            target_poses,
            start,
            **_scene(map, len(target_poses), None),
            cache=cache,
            measured=observed,
            steps=steps,
            seed=seed,
            guidance=guidance,
            callback=callback,
            update_cache=False,
            sensor=grid,
        )

    def sample_sweep(
        self,
        pose: np.ndarray | None = None,
        *,
        map: int | World | MapSource | None = None,
        cache_points: np.ndarray | None = None,
        steps: int | None = None,
        seed: int = 0,
        guidance: float | None = None,
        sensor: Sensor | str | None = None,
        callback: Callback | None = None,
    ) -> RolloutResult:
        """One sweep at `pose` (default: the sensor at its mount height over the origin).

        `map` is a `make_world` seed, a World or any map source, or None for free generation; `cache_points`
        (N, 4) world-frame points condition it like a rollout's cache and, with a map, hold it as the map's
        surfaces do (`inference.rollout.on_mapped_surfaces`); `sensor` as in `generate_world`.
        """
        start = time.perf_counter()
        steps, guidance = self._check_sampling(steps, guidance, seed, callback)
        grid = self.grid(sensor)
        if pose is None:
            pose = np.eye(4)
            pose[2, 3] = grid.mount_height
        poses = _check_poses(np.asarray(pose, dtype=np.float64)[None], "pose")
        if isinstance(map, int | np.integer):
            map = make_world(int(map))
        cache = None
        if cache_points is not None:
            pts = np.asarray(cache_points, dtype=np.float32)
            if pts.ndim != 2 or pts.shape[1] != 4 or not np.isfinite(pts).all():
                raise InputError(
                    f"cache_points must be finite (N, 4) world-frame points, got shape {pts.shape}"
                )
            cache = SpatialCache()
            cache.add(pts, poses[0], observed=True)
        return self._rollout(
            poses,
            start,
            **_scene(map, len(poses), None),
            cache=cache,
            steps=steps,
            seed=seed,
            guidance=guidance,
            callback=callback,
            sensor=grid,
        )

    def upsample(
        self,
        points: Scan | np.ndarray,
        factor: int | None = None,
        *,
        sensor: Sensor | str | None = None,
        mask: np.ndarray | None = None,
        method: str | None = None,
        steps: int | None = None,
        seed: int = 0,
        limits: Limits = LIBRARY_LIMITS,
        callback: Callback | None = None,
    ) -> UpsampleResult:
        """`points` (one sweep) on a denser beam table, or with its missing rays filled; every input point comes
        back bit for bit (`inference.upsample.upsample`: `factor` beams per measured gap, or `sensor`'s beam
        table; `mask` the rays to fill; `method` what fills them, "model" this pipeline's network, "learned" its
        release's fill network (the default for new beams where it ships one that learnt from the sweep's kind of
        sensor, else "edge-aware"); `limits` the target's rays, e.g. an app's stricter `APP_LIMITS`)."""
        steps, _ = self._check_sampling(steps, None, seed, callback)
        return upsample(self.model, points, factor, sensor=sensor, mask=mask, method=method, steps=steps, seed=seed,
                        limits=limits, callback=callback, fill_network=self.fill_network)

    # ------------------------------------------------------------------------------------------------------

    def _rollout(self, poses: np.ndarray, start: float, **kwargs: Any) -> RolloutResult:
        prepare = time.perf_counter() - start
        result = rollout(self.model, poses, **kwargs)
        result.timings["prepare"] = prepare
        return result

    def _check_sampling(
        self, steps: int | None, guidance: float | None, seed: Any, callback: Callback | None
    ) -> tuple[int, float]:
        steps = LIBRARY_LIMITS.check_steps(self.config.default_steps if steps is None else steps)
        guidance = LIBRARY_LIMITS.check_guidance(self.config.default_guidance if guidance is None else guidance)
        LIBRARY_LIMITS.check_seed(seed)
        if callback is not None and not callable(callback):
            raise InputError(
                f"callback must be callable (it receives a Progress), got {type(callback).__name__}"
            )
        return steps, guidance

    def grid(self, sensor: Sensor | str | None = None, scans: Sequence[ScanLike] | None = None,
             name: str = "scans", columns: int | None = None) -> Sensor:
        """The sensor a call's frames are drawn on: `sensor` (a `Sensor` or a preset name), else the newest of
        `scans`' own geometry (`native_sensor`), else the model's; at `columns` azimuth bins when given (a
        preset at its device's resolution: `grid("hdl64", columns=2048)`); always at the model's range encoding.

        The network reads each pixel's elevation and azimuth from its condition, so it draws any beam table
        and width; its log-range encoding is the model sensor's `max_range`, so returns beyond it are dropped.
        """
        if isinstance(sensor, str):
            try:
                sensor = get_sensor(sensor)
            except ValueError as exc:
                raise InputError(str(exc)) from None
        if sensor is not None and not isinstance(sensor, Sensor):
            raise InputError(f"sensor must be a lidar.sensors.Sensor or a preset name, got {type(sensor).__name__}")
        if sensor is None and scans is not None and isinstance(scans, Sequence) and scans:
            sensor = native_sensor(scans[-1], self.sensor)
        model = self.sensor
        sensor = model if sensor is None else sensor
        if columns is not None:
            try:
                sensor = sensor.with_width(columns)
            except ValueError as exc:
                raise InputError(f"columns {columns}: {exc}") from None
        LIBRARY_LIMITS.check_rays(sensor.height, sensor.width, f"sensor {sensor.name}")
        if sensor.min_range >= model.max_range:
            raise InputError(f"sensor {sensor.name}: min_range {sensor.min_range} m is beyond the model's range "
                             f"encoding ({model.max_range} m); expected a min_range below it")
        return replace(sensor, max_range=model.max_range)

    def _observe(self, scans: Sequence[ScanLike], name: str, sensor: Sensor | str | None,
                 poses: np.ndarray | None, poses_name: str,
                 ) -> tuple[Sensor, np.ndarray, SpatialCache, Callable[..., Observation]]:
        """The frames' sensor (`grid`), the scans' checked poses, their cache, and the call that builds their
        measurement (`observation`; a forecast adds the sweeps' `times`): only the frames' ends need it, and
        the rollout builds it beside the first frame's network. The car's own returns (`ego_body`, found once
        for both) are in neither's world.

        1. Each scan's points, as the cache takes them. A sensor the caller names is resolved first, and so
           is the frames' sensor when a scan is a range image, which needs it for its points.
        2. The cache, built in a worker thread beside steps 3-4, which it does not need: a single-frame
           forecast of a 124 k-point KITTI sweep spends 20-30 ms on each side. A scan that fails step 4
           is reported once that build ends.
        3. The frames' sensor: by default the newest sweep's measured geometry (`native_sensor`).
        4. Each scan checked to be a sweep the frames' beams see (`_check_returns`).
        """
        listed = isinstance(scans, Sequence) and not isinstance(scans, np.ndarray | Scan | RangeImage)
        first = sensor is not None or (listed and any(isinstance(scan, RangeImage) for scan in scans))
        grid = self.grid(sensor, scans, name) if first else None
        if not listed or not scans:
            raise InputError(
                f"{name} must be a non-empty list of lidar.formats.Scan, (N, 3+) arrays or RangeImages"
            )
        names = [f"{name}[{i}]" + (f" ({scan.path})" if isinstance(scan, Scan) else "") for i, scan in enumerate(scans)]
        points = [self._scan_points(scan, label, grid) for scan, label in zip(scans, names, strict=True)]
        poses = self._scan_poses(poses, len(points), poses_name)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="observed-cache") as beside:
            cached = beside.submit(contextvars.copy_context().run, _cache_of, points, poses)
            grid = self.grid(sensor, scans, name) if grid is None else grid
            for cloud, label in zip(points, names, strict=True):
                _check_returns(cloud, label, grid)
            cache, bodies = cached.result()
        return grid, poses, cache, partial(observation, points, poses, grid, bodies)

    @staticmethod
    def _scan_points(scan: ScanLike, name: str, sensor: Sensor | None) -> np.ndarray:
        """A scan's finite points (N, 3 or 4) float32 in its sensor frame, every one of them: seen from the next
        pose a sweep thinned to the model's beams leaves holes between its rings (coverage 0.54 vs 0.92 on
        KITTI). Read-only, and not copied when the scan holds just that. A range image is unprojected on
        `sensor`, the frames' sensor, whose shape it must have."""
        if isinstance(scan, RangeImage):
            assert sensor is not None, "a range image's frames' sensor is known before its points"
            if scan.shape != sensor.shape:
                raise InputError(
                    f"{name} is a {scan.shape[0]}x{scan.shape[1]} range image but the frames' sensor {sensor.name} is "
                    f"{sensor.height}x{sensor.width}; pass points instead and they are resampled"
                )
            points = unproject(scan, sensor)
        elif isinstance(scan, Scan):
            if not scan.sensor_frame:
                raise InputError(
                    f"{name} is not in the sensor frame (its origin is not at the LiDAR, as in "
                    "PandaSet's ego frame); forecasting needs sweeps in the sensor frame"
                )
            points = scan.points
        else:
            points = np.asarray(scan)
        if points.ndim != 2 or points.shape[1] < 3 or not np.issubdtype(points.dtype, np.number):
            raise InputError(f"{name} must be (N, 3+) points x, y, z[, intensity], got shape {points.shape}")
        finite = finite_rows(points[:, :3])
        points = np.ascontiguousarray(points[:, :4] if points.shape[1] >= 4 else points[:, :3], dtype=np.float32)
        points = points if finite.all() else take_rows(points, finite)
        points.flags.writeable = False  # it may share the caller's memory: nothing downstream writes to it
        return points

    @staticmethod
    def _scan_poses(poses: np.ndarray | None, count: int, name: str) -> np.ndarray:
        if poses is None:
            return np.tile(np.eye(4), (count, 1, 1))
        poses = _check_poses(poses, name)
        if len(poses) != count:
            raise InputError(f"{name} has {len(poses)} poses for {count} scans; expected one pose per scan")
        return poses


def native_sensor(scan: ScanLike, fallback: Sensor) -> Sensor:
    """The sensor a sweep was taken with, as measured from it (`lidar.formats.detect_sensor`: its beam table and
    columns), or `fallback` when the sweep does not tell (a range image, too few returns, not in the sensor
    frame)."""
    if isinstance(scan, RangeImage):
        return fallback
    if not isinstance(scan, Scan):
        points = np.asarray(scan)
        if points.ndim != 2 or points.shape[1] < 3 or not np.issubdtype(points.dtype, np.number):
            return fallback  # `_scan_points` names what is wrong with it
        points = points[finite_rows(points[:, :3])].astype(np.float32)
        scan = Scan.from_points(points[:, :4] if points.shape[1] >= 4 else np.pad(points[:, :3], ((0, 0), (0, 1))))
    return detect_sensor(scan) or fallback


def _cache_of(points: list[np.ndarray], poses: np.ndarray) -> tuple[SpatialCache, list[np.ndarray]]:
    """The cache of sensor-frame sweeps at their poses, without the car's own returns, and those returns'
    masks (`ego_body`), which the measurement reuses."""
    bodies = ego_body(points, poses)
    return cache_from_scans(without_ego_body(points, bodies), poses), bodies


def _check_returns(points: np.ndarray, name: str, sensor: Sensor) -> None:
    """An error unless the points return on `MIN_PREFIX_RETURNS` rays of `sensor`, enough to be a sweep worth
    conditioning on. They are counted a `RETURNS_CHUNK` at a time up to that: a sweep's first chunk settles it
    (a 124 k-point KITTI sweep's whole projection takes 13-16 ms), and only a scan that fails is projected
    whole, for its count."""
    hit = np.zeros(sensor.height * sensor.width, dtype=bool)
    returns = 0
    for start in range(0, len(points), RETURNS_CHUNK):
        hit[grid_winners(points[start:start + RETURNS_CHUNK], sensor)[1]] = True
        returns = int(np.count_nonzero(hit))
        if returns >= MIN_PREFIX_RETURNS:
            return
    raise InputError(
        f"{name} has only {returns} returns within the frames' sensor's beams ({sensor.name}: "
        f"{sensor.elevations_deg[0]:+.1f} to {sensor.elevations_deg[-1]:+.1f} deg, "
        f"{sensor.min_range}-{sensor.max_range} m); expected a LiDAR sweep in its sensor frame"
    )


def load_pipeline(
    source: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    **kwargs: Any,
) -> LidarVersePipeline:
    """`LidarVersePipeline.from_pretrained`: None -> $LIDARVERSE_MODEL, else weights/default."""
    return LidarVersePipeline.from_pretrained(source, device, dtype, **kwargs)


def write_rollout(
    folder: str | os.PathLike[str],
    result: RolloutResult,
    fmt: str = "bin",
    *,
    sensor: Sensor,
    provenance: Provenance | None = None,
    request: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write `frame_XXX.<fmt>` per frame (sensor frame, stored ring by ring with each point's ring where the
    format has a field for it: a format without one gives the beams back from the order, `lidar.formats.rings`),
    `world.<fmt>` (world frame) and `poses.json`.

    The one poses.json layout the CLI and the app's download share; returns its content. A frame without
    returns gets no file (`"file": null`), since point formats cannot hold an empty cloud. A folder that
    already holds a rollout is refused unless `overwrite`, which first removes the files its poses.json
    lists, so a shorter run never leaves stale frames beside the new ones.
    """
    folder = Path(folder)
    previous = folder / POSES_NAME
    if previous.exists():
        if not overwrite:
            raise InputError(
                f"{folder} already holds a rollout ({POSES_NAME}); choose another folder or overwrite it"
            )
        _remove_rollout(folder)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = []
    for frame in result.frames:
        name: str | None = f"frame_{frame.index:03d}.{fmt}"
        if len(frame.points):
            # ring by ring, as a sensor stores a sweep: a format without a ring field keeps them in that order
            order = scan_order(frame.points, frame.rings)
            rings = frame.rings[order] if sensor.height <= MAX_BEAMS else None  # what the ring field holds
            write_points(folder / name, frame.points[order], ring=rings)
        else:
            logger.warning("frame %d has no returns; %s not written", frame.index, name)
            name = None
        records.append(
            {
                "index": frame.index,
                "file": name,
                "points": len(frame.points),
                "pose": frame.pose.tolist(),
                "seconds": frame.seconds,
            }
        )
    world: str | None = f"world.{fmt}"
    if len(result.world):
        write_points(folder / world, result.world)
    else:
        world = None
    meta = {
        "convention": "pose = world_from_sensor (4x4 float64, metres, x fwd / y left / z up); frame files are in "
        "the sensor frame, the world file in the world frame",
        "request": request or {},
        "sensor": sensor.to_dict(),
        "model": provenance.to_dict() if provenance is not None else None,
        "frames": records,
        "world": world,
        "world_points": len(result.world),
        "timings": {**result.timings, "write": time.perf_counter() - start},
    }
    (folder / POSES_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    logger.info(
        "wrote %d frames and %s to %s in %.2fs", len(records), world, folder, meta["timings"]["write"]
    )
    return meta


def _remove_rollout(folder: Path) -> None:
    """Delete the files an earlier `write_rollout` listed in its poses.json (and nothing else)."""
    try:
        meta = json.loads((folder / POSES_NAME).read_text())
        names = [f["file"] for f in meta["frames"]] + [meta["world"], POSES_NAME]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(
            f"{folder / POSES_NAME} is not a poses.json written by write_rollout ({exc}); remove it"
        ) from None
    for name in names:
        if isinstance(name, str) and Path(name).name == name:  # plain names inside the folder only
            (folder / name).unlink(missing_ok=True)


@dataclass(frozen=True)
class EgoMotion:
    """A planar constant-velocity, constant-yaw-rate motion in the sensor's own frame (x forward, y left)."""

    #: Velocity (m/s) along the sensor's x and y axes.
    velocity: tuple[float, float] = (FORECAST_SPEED, 0.0)
    #: Yaw rate (rad/s), positive to the left.
    yaw_rate: float = 0.0

    @property
    def speed(self) -> float:
        return math.hypot(*self.velocity)


def _prefix_clock(count: int, prefix_times: np.ndarray | None, first_frame: float,
                  frame_clock: bool) -> np.ndarray | None:
    """Seconds of the prefix sweeps on the frames' clock, for carrying on what moves: `prefix_times` as given
    where the frames' times were given too (`frame_clock`: one clock), else shifted, or 10 Hz, to end one frame
    before the first frame. None where the given times do not increase: no motion is measured then."""
    if prefix_times is None:
        return first_frame - np.arange(count, 0, -1) / FRAME_RATE_HZ
    clock = frame_times(count, prefix_times)
    if (np.diff(clock) <= 0).any():
        logger.info("prefix times do not increase (%s): nothing is carried on", clock[:8])
        return None
    return clock if frame_clock else clock - clock[-1] + first_frame - 1 / FRAME_RATE_HZ


def measured_motion(poses: np.ndarray, times: np.ndarray | None = None) -> EgoMotion:
    """The motion of a posed prefix (K >= 2 world_from_sensor at `times` s, default 10 Hz), over its whole
    span, in the frame of its last pose: what a forecast from it continues with.

    The span rather than the last step: one registered step is noisy by a few centimetres, a tenth of a
    step at 10 Hz.
    """
    poses = np.asarray(poses, dtype=np.float64)
    if len(poses) < 2:
        raise InputError(f"a measured motion needs at least 2 posed sweeps, got {len(poses)}")
    span = (len(poses) - 1) / FRAME_RATE_HZ if times is None else float(times[-1] - times[0])
    if not span > 0:
        raise InputError(f"prefix times must increase, got {list(times)}")
    moved = np.linalg.inv(poses[0]) @ poses[-1]  # the last pose in the first one's frame
    yaw = math.atan2(moved[1, 0], moved[0, 0])
    yaw_rate = yaw / span
    arc = _arc(yaw_rate, span)  # position = arc @ velocity, the velocity turning with the heading
    velocity = np.linalg.solve(arc, moved[:2, 3])
    return EgoMotion((float(velocity[0]), float(velocity[1])), yaw_rate)


def _arc(yaw_rate: float, t: float) -> np.ndarray:
    """(2, 2) map from a body-frame velocity to the displacement after `t` s turning at `yaw_rate`."""
    if abs(yaw_rate) < 1e-12:
        return np.eye(2) * t
    s, c = math.sin(yaw_rate * t) / yaw_rate, (1.0 - math.cos(yaw_rate * t)) / yaw_rate
    return np.array([[s, -c], [c, s]])


def action_poses(
    start: np.ndarray,
    action: str,
    frames: int,
    speed: float = FORECAST_SPEED,
    turn_radius: float = FORECAST_TURN_RADIUS,
    motion: EgoMotion | None = None,
) -> np.ndarray:
    """(frames, 4, 4) poses continuing from `start` at 10 Hz on a flat arc.

    `plan_drive` follows a map's lanes; a forecast from real scans has no map, so the ego is dead-reckoned:
    at `motion` (a registered prefix's `measured_motion`) when given, else straight ahead at `speed`; the
    action bends that by a turn of `turn_radius` at the motion's speed.
    """
    _check_action(action)
    motion = motion or EgoMotion((speed, 0.0))
    turn = ACTION_YAW_SIGN[action] * motion.speed / turn_radius
    yaw_rate = motion.yaw_rate + turn
    out = np.empty((frames, 4, 4))
    local = np.eye(4)
    for i in range(frames):
        t = (i + 1) / FRAME_RATE_HZ
        yaw = yaw_rate * t
        local[:2, :2] = [[math.cos(yaw), -math.sin(yaw)], [math.sin(yaw), math.cos(yaw)]]
        local[:2, 3] = _arc(yaw_rate, t) @ np.asarray(motion.velocity)
        out[i] = start @ local
    return out


def _check_action(action: Any) -> None:
    if action not in ACTIONS:
        raise InputError(f"unknown action {shown(action)}; expected one of {', '.join(ACTIONS)} (or pass poses=)")


def _check_poses(poses: Any, name: str) -> np.ndarray:
    """(T, 4, 4) finite rigid world_from_sensor transforms (docs/design.md), as float64."""
    arr = np.asarray(poses, dtype=np.float64)
    if arr.ndim != 3 or arr.shape[1:] != (4, 4) or len(arr) < 1:
        raise InputError(f"{name} must be (T, 4, 4) world_from_sensor poses, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise InputError(f"{name} holds NaN or inf")
    return check_poses(arr, name)


def _world(map: int | World | None, style: str, seed: int) -> World:
    if isinstance(map, World):
        return map
    if map is None:
        return make_world(int(seed), style)
    if isinstance(map, bool) or not isinstance(map, int | np.integer) or map < 0:
        raise InputError(f"map must be a world seed (integer >= 0) or a lidar.sim World, got {shown(map)}")
    return make_world(int(map), style)


def _scene(map: Any, count: int, times: np.ndarray | None) -> dict[str, Any]:
    """Rollout keywords for a `map` argument: a World gives its HD map and actor layout, an HDMap the map only.

    A World's frames run at 10 Hz from `World.time` unless `times` says otherwise.
    """
    if map is None:
        return {"map_source": None, "layout": None, "times": frame_times(count, times)}
    if isinstance(map, World):
        return {"map_source": map.hdmap, "layout": map.boxes, "times": frame_times(count, times, map.time)}
    if hasattr(map, "range_view"):
        return {"map_source": map, "layout": None, "times": frame_times(count, times)}
    raise InputError(
        f"map must be a lidar.sim World (map and actor layout) or an HDMap (map only), got {type(map).__name__}"
    )

"""The world rollout: generate one sweep per pose, each conditioned on the cache of everything so far.

One loop serves every use (docs/design.md): free generation starts from an empty cache; forecasting seeds the
cache with observed sweeps (`cache_from_scans`); re-simulation renders target poses from such a cache with
`update_cache=False`. The HD map and the actor layout (boxes at each frame's time) condition every frame
when given. All randomness is the sampler's initial noise, drawn from one torch.Generator, so a seed fixes
the whole rollout.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from inference.cache import SpatialCache
from inference.conditioning import (
    SNAP_TOLERANCE,
    LayoutView,
    cache_view,
    decode_image,
    drop_map,
    layout_view,
    views_condition,
    with_cache,
)
from inference.flow import FlowMatchSampler, guided_velocity
from inference.measured import (
    MeasuredView,
    Observation,
    keep_measured,
    measured_points,
    measured_points_of,
    measured_view,
    settle_additions,
)
from inference.network import IMAGE_CHANNELS, PreparedCondition, WorldModel, to_encoded_image
from lidar.blind_disc import unseen_ground
from lidar.range_image import RangeImage, encode_range, nearest_beam_rows, unproject
from lidar.rows import take_rows
from lidar.sensors import Sensor
from lidar.vocabulary import FRAME_RATE_HZ, LayoutSource, MapSource, MapView, transform_points

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Voxel size of the accumulated world returned to the viewer (finer than the cache: it is only drawn).
WORLD_VOXEL = 0.1


@dataclass
class Frame:
    """One generated sweep."""

    index: int
    pose: np.ndarray
    #: (N, 4) float32 in the sensor frame of `pose`.
    points: np.ndarray
    range_image: RangeImage
    #: Wall time of this frame, from its condition to its delivery: sampling, decoding and cache update, and
    #: for a forecast's frame, finished beside the next frame's network, until that frame's first step.
    seconds: float
    #: (N,) int64 row of each point in the rollout's sensor (0 = highest beam), the beam its ray lies on: the
    #: ring a file stores (`write_rollout`).
    rings: np.ndarray


@dataclass(frozen=True)
class Progress:
    """Passed to the callback after every sampler step and once more when a frame is finished."""

    frame: int
    frames: int
    step: int
    steps: int
    frame_result: Frame | None = None

    @property
    def fraction(self) -> float:
        return (self.frame * self.steps + self.step) / (self.frames * self.steps)


class RolloutResult:
    """The frames of a rollout, its timings, its cache and the union of its frames in the world frame.

    The union is for viewers and files: it is built when first read (`world`), outside the frames' time, so an
    evaluation or a training loop that reads only the frames does not pay for it (nor for moving the frames'
    points to the world frame). Until then the result holds a copy of each frame's world points in its sensor
    frame (less the observing car's body), and of its pose.
    """

    def __init__(self, frames: list[Frame], world: np.ndarray | Callable[[], np.ndarray], timings: dict[str, Any],
                 cache: SpatialCache | None) -> None:
        self.frames = frames
        #: "per_frame" (list of seconds), "total" (seconds), "frames_per_second".
        self.timings = timings
        self.cache = cache
        self._world = world

    @property
    def world(self) -> np.ndarray:
        """(M, 4) float32 world-frame union of the generated frames, one point per `WORLD_VOXEL` voxel."""
        if callable(self._world):
            self._world = self._world()
        return self._world


def world_union(frames: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The frames' world points (oldest first; each in its sensor frame, with its world_from_sensor pose), one
    per `WORLD_VOXEL` voxel: a place seen again shows its newest frame, as the cache does, and a viewer draws
    one point where ten frames overlap. They are moved to the world frame here, when the union is first read,
    not in the frames' time."""
    world = SpatialCache(radius=np.inf, voxel_size=WORLD_VOXEL, max_points=2**31 - 1)
    world.add(np.concatenate([transform_points(points, pose) for points, pose in frames[::-1]]))
    return world.points()


def cache_from_scans(scans: list[np.ndarray], poses: np.ndarray, **cache_kwargs: Any) -> SpatialCache:
    """A cache seeded with observed sweeps (N, 3+) given in their own sensor frames at `poses`, and the ground
    each sweep's sensor stood on but could not see (`lidar.blind_disc.unseen_ground`). That ground is no
    measurement: it goes in as generated, so a measured point (and, fed back, a frame) wins its voxel. Without
    it a forecast from a pose a second on leaves the discs as holes in the road behind the car: the network
    draws little where its cache holds nothing (docs/evaluation.md has the figures)."""
    poses = np.asarray(poses, dtype=np.float64)
    if poses.shape != (len(scans), 4, 4):
        raise ValueError(f"cache_from_scans: expected {len(scans)} poses of shape (4, 4), got {poses.shape}")
    cache = SpatialCache(**cache_kwargs)
    for points, pose in zip(scans, poses, strict=True):  # one sweep at a time: the newest wins its voxels
        if np.ndim(points) != 2 or np.shape(points)[1] < 3:
            raise ValueError(f"cache_from_scans: each scan must be (N, 3+) points, got shape {np.shape(points)}")
        cache.add(measured_points([points], pose[None]), pose, observed=True)
    if len(scans):
        cache.add(measured_points([unseen_ground(points) for points in scans], poses), observed=False)
    return cache


def _queried(source: LayoutSource | None, time_s: float, pose: np.ndarray) -> dict[str, np.ndarray] | None:
    """The actor boxes `source` gives for `time_s` and `pose`, or None without a layout."""
    return None if source is None else source(time_s, pose)


@dataclass(frozen=True)
class _PoseViews:
    """What a frame's pose and time alone give: the map's and the layout's views, the condition they fill
    (`views_condition`, its cache block still empty) and the frame's guidance."""

    map_view: MapView | None
    boxes: LayoutView | None
    condition: np.ndarray
    guidance: float


@torch.inference_mode()  # the views thread does not inherit the caller's mode
def _pose_views(model: WorldModel, guidance: float, map_source: MapSource | None,
                actors: dict[str, np.ndarray] | None, pose: np.ndarray, sensor: Sensor) -> _PoseViews:
    map_view = map_source.range_view(pose, sensor) if map_source is not None else None
    boxes = None if actors is None else layout_view(actors["boxes"], actors["box_class"], pose, sensor)
    condition = views_condition(map_view, boxes, sensor, model.config.num_map_classes)
    # guidance pushes away from the map-dropped condition: without a map there is nothing to push from
    return _PoseViews(map_view, boxes, condition, guidance if map_view is not None else 1.0)


@torch.inference_mode()
def _views_stem(model: WorldModel, views: _PoseViews | Future[_PoseViews]) -> torch.Tensor:
    """The network's stem response to a frame's views (`WorldModel.views_stem`), for the frame's batch
    (`_batch`)."""
    views = views.result() if isinstance(views, Future) else views
    return model.views_stem(_batch(model, torch.from_numpy(views.condition), views.guidance))


def _row_halves(sensor: Sensor) -> tuple[Sensor, Sensor, int] | None:
    """`sensor`'s upper and lower beams, each with the other's nearest beam beyond the split (the stem's 3 x 3
    convolution reads one row across it), and the split row; None for a sensor too low to split."""
    if sensor.height < 4:
        return None
    split = sensor.height // 2
    beams = sensor.elevations_deg
    return (replace(sensor, elevations_deg=beams[: split + 1]), replace(sensor, elevations_deg=beams[split - 1:]),
            split)


def _half_views(model: WorldModel, guidance: float, map_source: MapSource | None,
                actors: dict[str, np.ndarray] | None, pose: np.ndarray,
                sensor: Sensor) -> tuple[_PoseViews, torch.Tensor]:
    views = _pose_views(model, guidance, map_source, actors, pose, sensor)
    return views, _views_stem(model, views)


def _joined(upper: tuple[_PoseViews, torch.Tensor], lower: tuple[_PoseViews, torch.Tensor],
            split: int) -> tuple[_PoseViews, torch.Tensor]:
    """The views of the upper beams (`_row_halves`) down to row `split` and the lower beams' from there, each
    drawn without the row beyond its half, which only its stem read."""
    (top, top_stem), (bottom, bottom_stem) = upper, lower

    def rows(a: Any, b: Any) -> Any:
        if a is None:
            return None
        return type(a)(**{f.name: np.concatenate([getattr(a, f.name)[:split], getattr(b, f.name)[1:]])
                          for f in fields(a)})

    views = _PoseViews(rows(top.map_view, bottom.map_view), rows(top.boxes, bottom.boxes),
                       np.concatenate([top.condition[:, :split], bottom.condition[:, 1:]], axis=1), top.guidance)
    return views, torch.cat([top_stem[:, :, :split], bottom_stem[:, :, 1:]], dim=2)


class _ViewsAhead:
    """The views of a frame that depend on its pose and time alone (the map's, the layout's, the condition they
    fill, the network's stem response to it and what the observation keeps), drawn in a second thread while the
    network samples: at 64 x 2048 they cost 30-90 ms a frame beside a network of 350-800 ms, which releases the
    GIL in its kernels, as numpy does.

    While frame i samples, the thread draws frame i's measured view, then frame i + 1's map and layout views,
    their condition and the network's stem response to it (all of the stem but the cache's and the prior's
    share, 13-15 ms of a 64 x 2048 frame on one CPU thread); frame i's cache-bound steps (the condition's
    cache, settling, cache update) stay in the caller's thread, in order. The first frame has nothing to be
    drawn beside: with a map or a layout (60-90 ms at 64 x 2048), the thread draws its upper beams and the
    caller its lower ones, once its cache is z-buffered; without, the caller works out the cache's share of the
    stem while the thread works out the rest. So a map source is queried from that thread, one frame ahead,
    and for the first frame from the caller's too at once (a map that only reads its own data serves as it
    is); a layout source is queried for the first frame by the caller, before the thread starts, and for the
    others by the thread alone. Each view runs in a copy of the caller's context, where
    `lidar.cancel.checkpoint` sees the caller's cancellation.
    """

    def __init__(self, model: WorldModel, guidance: float, map_source: MapSource | None,
                 layout: LayoutSource | None, measured: Observation | Callable[[], Observation] | None,
                 poses: np.ndarray, times: np.ndarray, sensor: Sensor) -> None:
        self._model, self._guidance = model, guidance
        self._map, self._layout, self._measured = map_source, layout, measured
        self._poses, self._times, self._sensor = poses, times, sensor
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-views")
        self._lower: Callable[[], tuple[_PoseViews, torch.Tensor]] | None = None
        actors = _queried(layout, float(times[0]), poses[0])
        halves = _row_halves(sensor) if map_source is not None or actors is not None else None
        if halves is None:
            self._next = self._submit_views(0, actors)
            return
        upper, lower, split = halves
        drawn = self._submit(_half_views, model, guidance, map_source, actors, poses[0], upper)

        def lower_half() -> tuple[_PoseViews, torch.Tensor]:
            below = _half_views(model, guidance, map_source, actors, poses[0], lower)
            return _joined(drawn.result(), below, split)

        self._lower = lower_half

    def _submit(self, function: Callable[..., T], *args: Any) -> Future[T]:
        return self._thread.submit(contextvars.copy_context().run, function, *args)

    def _submit_views(self, index: int, actors: dict[str, np.ndarray] | None = None,
                      ) -> tuple[Future[_PoseViews], Future[torch.Tensor]]:
        """Frame `index`'s pose views, and behind them the stem's response to them; the layout queried in the
        thread but for the first frame's, which the caller queried (`actors`)."""
        pose, time_s = self._poses[index], float(self._times[index])

        def draw() -> _PoseViews:
            boxes = actors if index == 0 else _queried(self._layout, time_s, pose)
            return _pose_views(self._model, self._guidance, self._map, boxes, pose, self._sensor)

        views = self._submit(draw)
        return views, self._submit(_views_stem, self._model, views)

    def views(self, index: int) -> tuple[_PoseViews, torch.Tensor | Callable[[], torch.Tensor],
                                         Future[MeasuredView] | None]:
        """Frame `index`'s pose views, waited for since its condition needs them; the stem's response to them,
        or the call that waits for it once the caller has worked out the cache's share (`WorldModel.prepare`);
        and its measured view to come (None without an observation), which only the frame's end needs. Queues
        frame `index + 1`'s views behind them, to be drawn while this frame samples."""
        stem: torch.Tensor | Callable[[], torch.Tensor]
        if self._lower is not None:  # the first frame's, drawn in halves by the thread and here
            views, stem = self._lower()
            self._lower = None
        else:
            pending, stem_ahead = self._next
            views, stem = pending.result(), stem_ahead.result
        kept = None if self._measured is None else self._submit(self._measured_view, index, views.map_view,
                                                                views.boxes)
        if index + 1 < len(self._poses):
            self._next = self._submit_views(index + 1)
        return views, stem, kept

    def _measured_view(self, index: int, map_view: MapView | None, boxes: LayoutView | None) -> MeasuredView:
        """Frame `index`'s measured view; an observation given as a callable is built here, on first use, so
        that it too is drawn beside the first frame's network rather than before it."""
        if callable(self._measured):
            self._measured = self._measured()
        view = measured_view(self._measured, self._poses[index], self._sensor, map_view, boxes,
                             float(self._times[index]))
        return view.ready_to_settle() if map_view is None and boxes is None else view

    def finish(self, x: torch.Tensor, kept: Future[MeasuredView] | None, surfaces: _Surfaces) -> Future[_Finished]:
        """`_finish` of a frame whose points no later frame's condition needs (nothing fed back to the cache),
        drawn behind the frame's measured view while the next frame samples: at 64 x 2048 a forecast's frame
        spends 40-50 ms there, most of it settling the additions."""
        return self._submit(_finish_when_kept, x, kept, self._sensor, surfaces)

    def close(self) -> None:
        """Stop: views not yet started are dropped (a cancelled rollout), the one being drawn ends first, so no
        thread outlives the rollout."""
        self._thread.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Surfaces:
    """What a frame's sample is held to at its end: the map's and the layout's views at its pose and, without a
    measurement, the cache's measured points z-buffered there (`_measured_surface`; None with a measurement,
    which holds the frame instead)."""

    map_view: MapView | None
    boxes: LayoutView | None
    measured: RangeImage | None


@dataclass(frozen=True)
class _Finished:
    """A frame once finished (`_finish`): its range image, its points and their rings (sensor frame), and its
    world points (sensor frame, less the observing car's body) for the cache and the rollout's union."""

    image: RangeImage
    points: np.ndarray
    rings: np.ndarray
    world: np.ndarray


def _measured_surface(cache: SpatialCache, pose: np.ndarray, sensor: Sensor) -> RangeImage | None:
    """The cache's measured points (a sampled sweep's `cache_points`) z-buffered at `pose` as the condition
    z-buffers the cache, or None when it holds none, as in free generation. Only these hold a generated frame
    as the map does: what earlier frames drew is the network's own, and held to it a frame keeps the occluders
    it invented (docs/evaluation.md)."""
    measured = cache.observed()
    if not measured.any():
        return None
    return cache_view(take_rows(cache.points(), measured), pose, sensor)


def _finish(x: torch.Tensor, kept: MeasuredView | None, sensor: Sensor, surfaces: _Surfaces) -> _Finished:
    """A sampled flow image -> the frame's range image, its points with their rings, and its world points, all in
    the sensor frame. Without a measurement (`kept`), what the network invented in front of the surfaces of the
    map, the layout and the cache's measured points is moved onto them (`on_mapped_surfaces`). With one, the
    measurement is written back, its points beside the grid after the image's (each on the beam nearest it),
    and for a frame without a map or a layout, on which the additions rest on nothing else, the additions are
    settled against it; the car's own body is no world point."""
    if kept is not None:
        x = keep_measured(x, kept, sensor)
    image = decode_image(to_encoded_image(x[0]), sensor)
    if kept is None:
        image = on_mapped_surfaces(image, surfaces.map_view, surfaces.boxes, sensor, surfaces.measured)
        points = unproject(image, sensor)
        # the union's own copy: a caller may change the frame's points
        return _Finished(image, points, np.flatnonzero(image.mask) // sensor.width, points.copy())
    points = measured_points_of(image, unproject(image, sensor), kept)
    if surfaces.map_view is None and surfaces.boxes is None:
        image, points = settle_additions(image, points, kept)
    world = take_rows(points, ~kept.body[image.mask])
    rings = np.concatenate([np.flatnonzero(image.mask) // sensor.width, nearest_beam_rows(kept.beside, sensor)])
    points = np.concatenate([points, kept.beside])  # the measurement's rays that share a pixel
    return _Finished(image, points, rings, np.concatenate([world, kept.beside]))


@torch.inference_mode()  # the views thread does not inherit the caller's mode
def _finish_when_kept(x: torch.Tensor, kept: Future[MeasuredView] | None, sensor: Sensor,
                      surfaces: _Surfaces) -> _Finished:
    return _finish(x, None if kept is None else kept.result(), sensor, surfaces)


@dataclass
class _Finishing:
    """A sampled frame whose finish runs in the views thread, delivered (`_Delivery.frame`) before the next
    frame reports its first step, or at the end."""

    index: int
    pose: np.ndarray
    started: float
    result: Future[_Finished]


@dataclass
class _Delivery:
    """The rollout's finished frames in order, each reported to the callback once finished."""

    frames: int
    steps: int
    callback: Callable[[Progress], None] | None
    done: list[Frame] = field(default_factory=list)
    #: Each delivered frame's world points in its sensor frame, and its pose, for the rollout's world union.
    in_world: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    waiting: _Finishing | None = None

    def frame(self, index: int, pose: np.ndarray, started: float, finished: _Finished) -> None:
        self.in_world.append((finished.world, pose.copy()))  # the caller's poses array may be reused
        frame = Frame(index, pose, finished.points, finished.image, time.perf_counter() - started, finished.rings)
        self.done.append(frame)
        if self.callback is not None:
            self.callback(Progress(index, self.frames, self.steps, self.steps, frame))

    def finishing(self, frame: _Finishing) -> None:
        """Hold `frame` until its finish is done, the frame before it delivered first."""
        self.waited()
        self.waiting = frame

    def waited(self) -> None:
        """Deliver the frame still finishing, if any."""
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self.frame(waiting.index, waiting.pose, waiting.started, waiting.result.result())

    def step_done(self, frame: int, step: int) -> None:
        self.waited()
        if self.callback is not None:
            self.callback(Progress(frame, self.frames, step, self.steps))


def on_mapped_surfaces(image: RangeImage, map_view: MapView | None, boxes: LayoutView | None,
                       sensor: Sensor, measured: RangeImage | None = None) -> RangeImage:
    """A generated frame with each occluder the network invented moved onto the surface behind it: a return in
    front of every surface the map, the layout and what was measured (`measured`, z-buffered at the frame's
    pose) put on its ray within the sensor's range (nearer by more than `SNAP_TOLERANCE` in encoded range,
    about 12 % of the range) takes the range of the nearest of them, keeping its intensity. Rays with none of
    these keep what the network drew, and so does a frame with no map and no layout: measured points alone
    describe no world to hold it to.

    Free generation draws the world the map and the layout describe, and what was measured: nothing else
    stands there. Left in front, such returns float over the road where the truth sees it (on the OS1-128's
    held-out drives, a speckled cloud 0.3-2.5 m above the ground beside the car), and cached they become the
    next frame's prior (a cached point beats the map), built on frame after frame (docs/evaluation.md has the
    figures of both)."""
    layers = [] if map_view is None else [map_view.ground, map_view.building, map_view.vegetation]
    layers += [] if boxes is None else [boxes.range]
    if not layers:
        return image
    layers += [] if measured is None else [measured.range]
    nearest = np.min([np.where((layer > 0) & (layer <= sensor.max_range), layer, np.inf) for layer in layers],
                     axis=0)
    mapped = image.mask & np.isfinite(nearest)
    invented = np.zeros_like(mapped)
    invented[mapped] = (encode_range(image.range[mapped], sensor.max_range)
                        < encode_range(nearest[mapped], sensor.max_range) - SNAP_TOLERANCE)
    return RangeImage(np.where(invented, nearest, image.range).astype(np.float32), image.intensity.copy())


def _batch(model: WorldModel, cond: torch.Tensor, guidance: float) -> torch.Tensor:
    """A frame's (C, H, W) condition as the network's batch, kept float32 (`prepare` casts it and keeps the prior
    exact); with guidance other than 1, followed by the same condition with its map dropped, the branch
    guidance pushes away from."""
    cond = cond[None].to(device=next(model.parameters()).device)
    if guidance != 1.0:
        cond = torch.cat([cond, drop_map(cond, model.config.num_map_classes)])
    return cond


def _sample(model: WorldModel, sampler: FlowMatchSampler, prepared: PreparedCondition, shape: tuple[int, int],
            generator: torch.Generator, guidance: float, after_step: Callable[[int], None]) -> torch.Tensor:
    """The sampler's steps from its initial noise to a (1, 3, H, W) flow image; `after_step(i)` after step i
    (1-based), where a progress bar moves and a cancelled request stops."""
    param = next(model.parameters())
    x = sampler.init_noise((1, IMAGE_CHANNELS, *shape), generator, device=param.device)
    for i, t in enumerate(sampler.timesteps):
        v = guided_velocity(model, x.to(param.dtype), t, prepared, guidance).float()
        x = sampler.step(v, t, x).prev_sample
        after_step(i + 1)
    return x


def frame_times(count: int, times: np.ndarray | None, start: float = 0.0) -> np.ndarray:
    """Seconds of each frame: `times` as given (checked), else 10 Hz from `start`."""
    if times is None:
        return start + np.arange(count) / FRAME_RATE_HZ
    out = np.asarray(times, dtype=np.float64).reshape(-1)
    if out.shape != (count,) or not np.isfinite(out).all():
        raise ValueError(f"times must be {count} finite seconds, one per pose; got shape {np.shape(times)}")
    return out


@torch.inference_mode()
def rollout(
    model: WorldModel,
    poses: np.ndarray,
    *,
    map_source: MapSource | None = None,
    layout: LayoutSource | None = None,
    times: np.ndarray | None = None,
    cache: SpatialCache | None = None,
    steps: int | None = None,
    seed: int | torch.Generator = 0,
    guidance: float | None = None,
    update_cache: bool = True,
    measured: Observation | Callable[[], Observation] | None = None,
    sampler: FlowMatchSampler | None = None,
    callback: Callable[[Progress], None] | None = None,
    sensor: Sensor | None = None,
) -> RolloutResult:
    """Generate a sweep at each pose (T, 4, 4) world_from_sensor, in order.

    `layout(t, pose)` gives the actor boxes at `times[i]` (default 10 Hz from 0) for the sensor at `pose`, as
    `World.boxes` does. `measured`, what observed sweeps measured: every frame keeps their ranges on
    the rays they see and leaves the rays they measured empty (`inference.measured`); a callable that builds it
    is called in the views thread, while the first frame samples. Without `measured`, a frame with a map or a
    layout has what the network invents in front of their surfaces (and of the cache's measured points) drawn
    on them (`on_mapped_surfaces`). `sensor` is the grid the
    frames are drawn on (default: the model's own); the network is fully convolutional and reads each pixel's
    elevation and azimuth from the condition, so any beam table and width serve.
    """
    config = model.config
    sensor = model.sensor if sensor is None else sensor
    poses = np.asarray(poses, dtype=np.float64)
    if poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) < 1:
        raise ValueError(f"rollout: poses must be (T, 4, 4) world_from_sensor with T >= 1, got {poses.shape}")
    times = frame_times(len(poses), times)
    if map_source is not None and not hasattr(map_source, "range_view"):
        raise TypeError(
            f"rollout: map_source must have range_view(pose, sensor) (an HDMap), got {type(map_source).__name__}; "
            "a callable is no longer a map source"
        )
    steps = config.default_steps if steps is None else int(steps)
    guidance = config.default_guidance if guidance is None else float(guidance)
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))
    sampler = sampler or FlowMatchSampler(noise_scale=config.default_noise_scale)
    cache = cache if cache is not None else SpatialCache()
    sampler.set_timesteps(steps, device=next(model.parameters()).device)
    delivery = _Delivery(len(poses), steps, callback)
    start = time.perf_counter()
    ahead = _ViewsAhead(model, guidance, map_source, layout, measured, poses, times, sensor)
    try:
        for index, pose in enumerate(poses):
            frame_start = time.perf_counter()
            # 1. condition: the cache, the map and the layout seen from the new pose (the views, the condition
            #    they fill and the stem's response to it were drawn while the network sampled the frame before;
            #    the first frame's are drawn while its cache is z-buffered here, a map's and a layout's half here)
            cached = cache_view(cache.points(), pose, sensor)
            views, views_stem, kept_view = ahead.views(index)
            map_view, boxes, scale = views.map_view, views.boxes, views.guidance
            prepared = model.prepare(_batch(model, with_cache(views.condition, cached, sensor), scale),
                                     views_stem=views_stem)
            # without a measurement but with a map or a layout, the cache's measured points are a surface the
            # frame keeps, as the map's are
            mapped = kept_view is None and (map_view is not None or boxes is not None)
            surfaces = _Surfaces(map_view, boxes, _measured_surface(cache, pose, sensor) if mapped else None)
            # 2. sample the range image; the frame before, if still finishing, is delivered at the first step
            x = _sample(model, sampler, prepared, sensor.shape, generator, scale, partial(delivery.step_done, index))
            # 3. keep the prior where the sample only jitters it, and what was measured where it was seen (or,
            #    generating, the surfaces of the map, the layout and the cache's measured points where the
            #    sample invents an occluder in front of them); decode and unproject. Unless the sweep (less the
            #    observing car's own body) is fed back into the cache, which the next frame's condition reads,
            #    that runs beside the next frame's network.
            x = model.snap_to_prior(x, prepared)
            if not update_cache:
                delivery.finishing(_Finishing(index, pose, frame_start, ahead.finish(x, kept_view, surfaces)))
                continue
            kept = None if kept_view is None else kept_view.result()
            finished = _finish(x, kept, sensor, surfaces)
            cache.add(transform_points(finished.world, pose), pose)
            delivery.frame(index, pose, frame_start, finished)
        delivery.waited()
    finally:
        ahead.close()
    total = time.perf_counter() - start
    timings = {
        "per_frame": [f.seconds for f in delivery.done],
        "total": total,
        "frames_per_second": len(delivery.done) / total if total > 0 else float("inf"),
    }
    logger.info(
        "rollout: %d frames, %d steps, %.2f frames/s", len(delivery.done), steps, timings["frames_per_second"]
    )
    return RolloutResult(delivery.done, partial(world_union, delivery.in_world), timings, cache)

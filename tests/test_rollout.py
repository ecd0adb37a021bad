"""The world rollout loop on a tiny model: determinism per seed, callbacks, cache feedback, forecast/resim."""

import threading
import time

import numpy as np
import pytest
import torch

from inference.cache import SpatialCache
from inference.conditioning import LAYOUT_CLASSES, ConditionLayout, LayoutView, build_condition, layout_view
from inference.network import WorldModel, WorldModelConfig
from inference.rollout import Progress, cache_from_scans, frame_times, on_mapped_surfaces, rollout
from lidar.boxes import box_range_view
from lidar.errors import InputError
from lidar.formats import read_points
from lidar.range_image import RangeImage, project, unproject
from lidar.real_scans import real_scans_dir
from lidar.sensors import VLP16, Sensor
from lidar.vocabulary import OBJECT_CLASSES, transform_points
from tests.helpers import FLAT, car_world, flat_hdmap

SENSOR = VLP16.with_width(64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model() -> WorldModel:
    config = WorldModelConfig(
        sensor=SENSOR.to_dict(),
        base_channels=8,
        channel_mults=(1, 2, 2),
        strides=((1, 2), (2, 2)),
        default_steps=3,
    )
    torch.manual_seed(0)
    net = WorldModel(config).eval()
    with torch.no_grad():  # the zero-initialised output layers would give a constant velocity field
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def straight_poses(frames: int, spacing: float = 1.0) -> np.ndarray:
    poses = np.repeat(np.eye(4)[None], frames, axis=0)
    poses[:, 0, 3] = spacing * np.arange(frames)
    poses[:, 2, 3] = SENSOR.mount_height
    return poses


def untrained(**overrides) -> WorldModel:
    config = WorldModelConfig(sensor=SENSOR.to_dict(), base_channels=8, channel_mults=(1, 2, 2),
                              strides=((1, 2), (2, 2)), **overrides)
    torch.manual_seed(0)
    return WorldModel(config).eval()


def test_rollout_is_deterministic_per_seed_and_differs_across_seeds(model):
    poses = straight_poses(3)
    a = rollout(model, poses, map_source=FLAT, seed=11)
    b = rollout(model, poses, map_source=FLAT, seed=11)
    c = rollout(model, poses, map_source=FLAT, seed=12)
    for fa, fb in zip(a.frames, b.frames, strict=True):
        np.testing.assert_array_equal(fa.range_image.range, fb.range_image.range)
        np.testing.assert_array_equal(fa.points, fb.points)
    np.testing.assert_array_equal(a.world, b.world)
    assert not np.array_equal(a.frames[0].range_image.range, c.frames[0].range_image.range)
    # a torch.Generator works as the seed too
    g = rollout(model, poses, map_source=FLAT, seed=torch.Generator().manual_seed(11))
    np.testing.assert_array_equal(g.frames[-1].points, a.frames[-1].points)


def test_rollout_samples_at_the_models_default_temperature(model):
    from dataclasses import replace

    from inference.flow import FlowMatchSampler

    poses = straight_poses(2)
    tempered = WorldModel(replace(model.config, default_noise_scale=0.5)).eval()
    tempered.load_state_dict(model.state_dict())
    hdmap = flat_hdmap()
    by_default = rollout(tempered, poses, map_source=hdmap, seed=1).frames[-1].range_image.range
    explicit = rollout(model, poses, map_source=hdmap, seed=1,
                       sampler=FlowMatchSampler(noise_scale=0.5)).frames[-1].range_image.range
    untempered = rollout(model, poses, map_source=hdmap, seed=1,
                         sampler=FlowMatchSampler(noise_scale=1.0)).frames[-1].range_image.range
    assert (by_default > 0).any(), "the map makes the sweep return somewhere"
    np.testing.assert_array_equal(by_default, explicit)
    assert not np.array_equal(by_default, untempered)


def test_frames_are_decoded_sweeps_in_their_own_sensor_frame(model):
    result = rollout(model, straight_poses(2), map_source=FLAT, seed=0)
    assert len(result.frames) == 2
    for i, frame in enumerate(result.frames):
        assert frame.index == i and frame.range_image.shape == SENSOR.shape
        np.testing.assert_array_equal(frame.points, unproject(frame.range_image, SENSOR))
        assert frame.points.dtype == np.float32 and frame.points.shape[1] == 4
        assert len(frame.points) > 0  # the map's ground gives the prior returns
    assert result.world.shape[1] == 4 and len(result.world) > 0
    assert set(result.timings) == {"per_frame", "total", "frames_per_second"}
    assert len(result.timings["per_frame"]) == 2 and result.timings["frames_per_second"] > 0


def test_callback_sees_every_step_and_every_finished_frame(model):
    seen: list[Progress] = []
    rollout(model, straight_poses(3), steps=2, seed=0, callback=seen.append)
    assert len(seen) == 3 * (2 + 1)
    finished = [p for p in seen if p.frame_result is not None]
    assert [p.frame for p in finished] == [0, 1, 2]
    assert [(p.frame, p.step) for p in seen if p.frame_result is None] == [
        (f, s) for f in range(3) for s in (1, 2)
    ]
    assert seen[-1].fraction == 1.0 and 0 < seen[0].fraction < 1


def test_generated_frames_feed_the_cache_unless_resimulating(model):
    poses = straight_poses(2)
    result = rollout(model, poses, map_source=FLAT, seed=0)
    assert len(result.cache) > 0
    seeded = cache_from_scans([result.frames[0].points], poses[:1])
    before = seeded.points()
    resim = rollout(model, poses[1:], cache=seeded, seed=0, update_cache=False)
    np.testing.assert_array_equal(resim.cache.points(), before)


def test_a_seeded_cache_changes_what_is_generated(model):
    """Forecasting: the same seed with observed sweeps in the cache gives a different sweep than without."""
    poses = straight_poses(1)
    ring = SENSOR.ray_directions() * 8.0
    scan = np.concatenate([ring.reshape(-1, 3), np.full((ring[..., 0].size, 1), 0.5)], 1).astype(np.float32)
    empty = rollout(model, poses, seed=3)
    forecast = rollout(model, poses, cache=cache_from_scans([scan], poses), seed=3)
    assert not np.array_equal(empty.frames[0].range_image.range, forecast.frames[0].range_image.range)


def test_guidance_uses_the_map_dropped_branch(model):
    poses = straight_poses(1)
    plain = rollout(model, poses, map_source=FLAT, seed=5, guidance=1.0)
    guided = rollout(model, poses, map_source=FLAT, seed=5, guidance=3.0)
    assert not np.array_equal(plain.frames[0].range_image.range, guided.frames[0].range_image.range)
    # without a map there is nothing to guide towards: guidance is a no-op
    a = rollout(model, poses, seed=5, guidance=1.0)
    b = rollout(model, poses, seed=5, guidance=3.0)
    np.testing.assert_array_equal(a.frames[0].range_image.range, b.frames[0].range_image.range)


def test_map_source_may_be_an_hdmap_like_object_and_a_callable_is_refused(model):
    class Map:
        calls = 0

        def range_view(self, pose, sensor):
            Map.calls += 1
            return FLAT.range_view(pose, sensor)

    via_object = rollout(model, straight_poses(2), map_source=Map(), seed=1)
    via_hdmap = rollout(model, straight_poses(2), map_source=FLAT, seed=1)
    assert Map.calls == 3  # the first frame's in two halves of its beams, drawn at once
    np.testing.assert_array_equal(via_object.frames[1].points, via_hdmap.frames[1].points)
    with pytest.raises(TypeError, match="range_view"):
        rollout(model, straight_poses(1), map_source=lambda pose, sensor: None)


class _WatchedMap:
    """FLAT, noting which thread draws each view; the views thread's second (frame 1's: it draws the upper
    beams of frame 0, the caller the lower) sets `second`."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.second = threading.Event()

    def range_view(self, pose, sensor):
        self.threads.append(threading.current_thread().name)
        if sum(name.startswith("rollout-views") for name in self.threads) == 2:
            self.second.set()
        return FLAT.range_view(pose, sensor)

    def drawn_by_the_views_thread(self, frames: int) -> bool:
        """Each frame's view drawn by the views thread, but the lower half of the first frame's, by the caller."""
        return (sorted(self.threads) == ["MainThread", *["rollout-views_0"] * frames]
                and self.threads[0].startswith("rollout-views"))


class _InOrder:
    """An executor that runs each view at once in the caller's thread: the rollout as drawn one step after
    the other, the reference the views thread must reproduce."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def submit(self, function, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(function(*args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def test_the_next_frames_views_are_drawn_while_the_network_samples(model, monkeypatch):
    import inference.rollout as rollout_module

    source = _WatchedMap()
    waited: list[bool] = []
    forward = model.forward

    def first_step_waits(*args, **kwargs):
        if not waited:  # frame 0's first network pass: only a second thread can draw frame 1's view meanwhile
            waited.append(source.second.wait(timeout=5.0))
        return forward(*args, **kwargs)

    model.forward = first_step_waits
    try:
        overlapped = rollout(model, straight_poses(3), map_source=source, seed=4)
    finally:
        del model.forward
    assert waited == [True], "frame 1's map view was not drawn while frame 0 sampled"
    assert source.drawn_by_the_views_thread(3), source.threads
    monkeypatch.setattr(rollout_module, "ThreadPoolExecutor", _InOrder)
    in_order = rollout(model, straight_poses(3), map_source=FLAT, seed=4)
    for a, b in zip(overlapped.frames, in_order.frames, strict=True):
        np.testing.assert_array_equal(a.points, b.points)


def _first_frame_observed(model, poses: np.ndarray):
    """What a sweep generated at poses[0] on the flat map measured, as a forecast's observation."""
    from inference.measured import observation

    scan = rollout(model, poses[:1], map_source=FLAT, seed=0).frames[0].points
    return observation([scan], poses[:1], SENSOR)


def test_views_drawn_ahead_give_the_same_frames_as_drawn_in_order(model, monkeypatch):
    import inference.rollout as rollout_module

    poses = straight_poses(4)
    seen = _first_frame_observed(model, poses)
    world = car_world()
    calls = {
        "generation": lambda: rollout(model, poses, map_source=world.hdmap, layout=world.boxes, seed=3),
        "forecast": lambda: rollout(model, poses, map_source=FLAT, measured=seen, update_cache=False, seed=3),
    }
    ahead = {name: call() for name, call in calls.items()}
    # each forecast frame keeps what the observation measured from that frame's own pose
    for frame, time_s in zip(ahead["forecast"].frames, frame_times(len(poses), None), strict=True):
        kept = rollout_module.measured_view(seen, frame.pose, SENSOR, FLAT.range_view(frame.pose, SENSOR), None,
                                            float(time_s))
        expected = kept.points[np.flatnonzero(kept.mask)]
        assert len(expected) and {p.tobytes() for p in expected} <= {p.tobytes() for p in frame.points}
    monkeypatch.setattr(rollout_module, "ThreadPoolExecutor", _InOrder)
    for name, call in calls.items():
        for a, b in zip(ahead[name].frames, call().frames, strict=True):
            np.testing.assert_array_equal(a.points, b.points, err_msg=name)
            np.testing.assert_array_equal(a.range_image.range, b.range_image.range, err_msg=name)


def test_a_guided_rollout_with_the_views_stem_drawn_ahead_draws_what_the_whole_stem_draws(model, monkeypatch):
    """The views thread works out the stem's response to each frame's views (and, guided, to the same views with
    the map dropped); with the cache's and the prior's share added, the frames are those of one whole-stem
    convolution, up to float32 rounding."""
    world = car_world()
    poses = straight_poses(3)
    kwargs = dict(map_source=world.hdmap, layout=world.boxes, seed=5, guidance=2.0, steps=2)
    ahead = rollout(model, poses, **kwargs)
    whole_prepare = WorldModel.prepare
    monkeypatch.setattr(WorldModel, "prepare", lambda self, cond, views_stem=None: whole_prepare(self, cond))
    whole = rollout(model, poses, **kwargs)
    for a, b in zip(ahead.frames, whole.frames, strict=True):
        np.testing.assert_array_equal(a.range_image.mask, b.range_image.mask)
        np.testing.assert_allclose(a.range_image.range, b.range_image.range, atol=1e-3)


def test_the_first_frames_views_drawn_in_two_halves_of_its_beams_are_the_whole_frames(model, monkeypatch):
    """Nothing runs beside the first frame, so its map and layout views are drawn by two threads, half the beams
    each, and joined; every view is per ray and the stem reads one row beyond the split, so the frames are
    those of views drawn whole (odd and even beam counts, guided with the map dropped too)."""
    import inference.rollout as rollout_module

    world = car_world()
    for sensor in (SENSOR, Sensor.from_angles("odd", np.linspace(8, -20, 15), width=96)):
        kwargs = dict(map_source=world.hdmap, layout=world.boxes, seed=2, guidance=2.0, steps=2, sensor=sensor)
        halves = rollout(model, straight_poses(2), **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(rollout_module, "_row_halves", lambda sensor: None)
            whole = rollout(model, straight_poses(2), **kwargs)
        for a, b in zip(halves.frames, whole.frames, strict=True):
            assert a.range_image.shape == sensor.shape
            np.testing.assert_array_equal(a.range_image.range, b.range_image.range)
            np.testing.assert_array_equal(a.points, b.points)


def test_each_frame_samples_on_the_condition_training_builds_its_views_half_drawn_beside_the_network(
        model, monkeypatch):
    import inference.rollout as rollout_module

    world = car_world()
    threads: list[str] = []
    conditions: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
    views_condition, with_cache, cache_view = (rollout_module.views_condition, rollout_module.with_cache,
                                               rollout_module.cache_view)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def watched_views(*args):
        threads.append(threading.current_thread().name)
        return views_condition(*args)

    def watched_view(cache_points, pose, sensor):
        seen.append((cache_points.copy(), np.array(pose)))
        return cache_view(cache_points, pose, sensor)

    def watched_cache(cond, cached, sensor):
        out = with_cache(cond, cached, sensor)
        conditions.append((*seen[-1], out.clone()))
        return out

    monkeypatch.setattr(rollout_module, "views_condition", watched_views)
    monkeypatch.setattr(rollout_module, "cache_view", watched_view)
    monkeypatch.setattr(rollout_module, "with_cache", watched_cache)
    poses = straight_poses(3)
    rollout(model, poses, map_source=world.hdmap, layout=world.boxes, seed=3)
    assert sorted(threads) == ["MainThread", *["rollout-views_0"] * 3], "frame 0's in halves, the others ahead"
    assert len(conditions) == 3 and len(conditions[1][0]), "frame 1's condition did not see frame 0 in the cache"
    for (cache, pose, cond), time_s in zip(conditions, frame_times(3, None), strict=True):
        actors = world.boxes(float(time_s), pose)
        expected = build_condition(cache, pose, world.hdmap.range_view(pose, SENSOR),
                                   layout_view(actors["boxes"], actors["box_class"], pose, SENSOR), SENSOR,
                                   model.config.num_map_classes)
        assert torch.equal(cond, expected)


def test_an_observation_given_as_a_call_is_built_once_in_the_views_thread(model):
    poses = straight_poses(3)
    seen = _first_frame_observed(model, poses)
    threads = []

    def build():
        threads.append(threading.current_thread().name)
        return seen

    deferred = rollout(model, poses, measured=build, update_cache=False, seed=5)
    given = rollout(model, poses, measured=seen, update_cache=False, seed=5)
    assert len(threads) == 1 and threads[0].startswith("rollout-views")
    for a, b in zip(deferred.frames, given.frames, strict=True):
        np.testing.assert_array_equal(a.points, b.points)


def test_a_forecast_frame_is_finished_beside_the_next_frames_network_and_reported_in_order(model, monkeypatch):
    import inference.rollout as rollout_module

    poses = straight_poses(3)
    seen = _first_frame_observed(model, poses)
    finish, threads, first_finished = rollout_module._finish, [], threading.Event()

    def noted_finish(*args, **kwargs):
        out = finish(*args, **kwargs)
        threads.append(threading.current_thread().name)
        first_finished.set()
        return out

    monkeypatch.setattr(rollout_module, "_finish", noted_finish)
    forward, passes, waited = model.forward, [], []

    def second_frame_waits(*args, **kwargs):
        passes.append(1)
        if len(passes) == 3:  # frame 1's first pass: only a second thread can finish frame 0 meanwhile
            waited.append(first_finished.wait(timeout=5.0))
        return forward(*args, **kwargs)

    progress: list[Progress] = []
    model.forward = second_frame_waits
    try:
        rollout(model, poses, map_source=FLAT, measured=seen, update_cache=False, steps=2, seed=0,
                callback=progress.append)
    finally:
        del model.forward
    assert waited == [True], "frame 0 was not finished while frame 1 sampled"
    assert len(threads) == 3 and all(name.startswith("rollout-views") for name in threads)
    assert [(p.frame, p.step, p.frame_result is not None) for p in progress] == [
        event for f in range(3) for event in ((f, 1, False), (f, 2, False), (f, 2, True))
    ]
    threads.clear()  # a generated frame feeds the next frame's cache: finished in the caller's thread, in turn
    rollout(model, poses[:2], map_source=FLAT, seed=0)
    assert threads == [threading.main_thread().name] * 2


def test_a_cancelled_rollout_drops_the_views_not_yet_started_and_leaves_no_thread(model, monkeypatch):
    import inference.rollout as rollout_module

    poses = straight_poses(4)
    seen = _first_frame_observed(model, poses)
    measured_view = rollout_module.measured_view

    def slow_measured_view(*args, **kwargs):  # frame 0's measured view is still drawn when the visitor leaves
        time.sleep(0.3)
        return measured_view(*args, **kwargs)

    def cancel(progress: Progress) -> None:
        raise KeyboardInterrupt("the visitor left")

    monkeypatch.setattr(rollout_module, "measured_view", slow_measured_view)
    source = _WatchedMap()
    with pytest.raises(KeyboardInterrupt):
        rollout(model, poses, map_source=source, measured=seen, update_cache=False, seed=0, callback=cancel)
    assert len(source.threads) == 2, "frame 1's views, queued behind frame 0's measured view, were still drawn"
    assert not [t for t in threading.enumerate() if t.name.startswith("rollout-views")]


def test_a_views_thread_sees_the_callers_cancellation(model):
    from lidar.cancel import Cancelled, checkpoint, stop_when

    class Checked:
        def range_view(self, pose, sensor):
            checkpoint()  # as the readers do between chunks: the app's scope is the caller's
            return FLAT.range_view(pose, sensor)

    stop = threading.Event()
    stop.set()
    with stop_when(stop), pytest.raises(Cancelled):
        rollout(model, straight_poses(2), map_source=Checked(), seed=0)


def test_an_error_in_a_views_thread_reaches_the_caller(model):
    class Broken:
        def range_view(self, pose, sensor):
            raise InputError("this map has no ground")

    with pytest.raises(InputError, match="no ground"):
        rollout(model, straight_poses(2), map_source=Broken(), seed=0)
    assert not [t for t in threading.enumerate() if t.name.startswith("rollout-views")]


def test_the_world_union_is_built_once_when_first_read(model, monkeypatch):
    import inference.rollout as rollout_module

    built = []
    union = rollout_module.world_union
    monkeypatch.setattr(rollout_module, "world_union", lambda pieces: built.append(len(pieces)) or union(pieces))
    result = rollout(model, straight_poses(3), map_source=FLAT, seed=0)
    assert built == [], "the union was built inside the frames' time"
    world = result.world
    assert built == [3] and result.world is world
    every = np.concatenate([transform_points(f.points, f.pose) for f in result.frames])
    assert len(world) <= len(every) and {tuple(p) for p in world[:50]} <= {tuple(p) for p in every}


def test_the_world_union_keeps_the_frames_as_drawn(model):
    """Built when first read, the union still shows the frames and poses of the rollout, not what a caller did
    with its poses array or the frames' points meanwhile."""
    poses = straight_poses(3)
    drawn = rollout(model, poses, map_source=FLAT, seed=0)
    expected = rollout(model, poses.copy(), map_source=FLAT, seed=0).world
    poses[:, :3, 3] += 50.0  # the caller reuses its buffer
    for frame in drawn.frames:
        frame.points[:] = 0.0
    np.testing.assert_array_equal(drawn.world, expected)


def test_bad_poses_and_scans_are_named(model):
    with pytest.raises(ValueError, match="poses"):
        rollout(model, np.eye(4))
    with pytest.raises(ValueError, match="poses"):
        cache_from_scans([np.zeros((3, 4))], np.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match=r"\(N, 3\+\)"):
        cache_from_scans([np.zeros((3, 2))], np.eye(4)[None])
    assert isinstance(cache_from_scans([], np.zeros((0, 4, 4))), SpatialCache)


REAL_SCANS = real_scans_dir()
@pytest.mark.skipif(
    not (REAL_SCANS / "kitti_patchworkpp_000000.bin").exists(), reason=f"no real scans in {REAL_SCANS}"
)
def test_forecast_from_a_real_kitti_scan_produces_frames_conditioned_on_it(model):
    scan = read_points(REAL_SCANS / "kitti_patchworkpp_000000.bin")
    poses = straight_poses(3)
    cache = cache_from_scans([scan.points], poses[:1])
    cond = build_condition(cache.points(), poses[0], None, None, SENSOR)
    assert cond[2].mean() > 0.5  # the scan covers most of the small sensor's view
    result = rollout(model, poses[1:], cache=cache, seed=0)
    assert len(result.frames) == 2 and all(len(f.points) > 0 for f in result.frames)
    assert len(result.cache) > len(scan.points) // 20


def test_an_untrained_model_re_renders_the_cache_from_a_new_pose():
    """Zero-initialised corrections: where the cache returns, the untrained model is the cache-only baseline."""
    rng = np.random.default_rng(0)
    r = rng.uniform(5, 40, SENSOR.shape)
    scan = np.concatenate(
        [(SENSOR.ray_directions() * r[..., None]).reshape(-1, 3), rng.random((r.size, 1))], 1
    ).astype(np.float32)
    poses = straight_poses(2, spacing=0.5)
    result = rollout(untrained(), poses[1:], cache=cache_from_scans([scan], poses[:1]), seed=0)
    expected = project(transform_points(transform_points(scan, poses[0]), np.linalg.inv(poses[1])), SENSOR)
    got = result.frames[0].range_image
    np.testing.assert_array_equal(got.mask, expected.mask)
    np.testing.assert_allclose(got.range, expected.range, rtol=1e-4)
    np.testing.assert_allclose(got.intensity, expected.intensity, atol=1e-4)


def test_a_worlds_layout_fills_the_condition_and_an_untrained_model_draws_the_box_ahead():
    world = car_world()
    poses = straight_poses(1)
    boxes = world.boxes(0.0)
    view = layout_view(boxes["boxes"], boxes["box_class"], poses[0], SENSOR)
    cond = build_condition(None, poses[0], None, view, SENSOR)
    lay = ConditionLayout()
    car = LAYOUT_CLASSES.index("car")
    seen = view.range > 0
    assert seen.sum() >= 4 and (cond[lay.box_range + 1 + car].numpy() == seen).all()
    assert (cond[lay.coords_start - 1] == 1).all()
    # nothing else known: the untrained model's sweep is exactly the box, at the box's range
    frame = rollout(untrained(), poses, layout=world.boxes, seed=0).frames[0].range_image
    np.testing.assert_array_equal(frame.mask, seen)
    np.testing.assert_allclose(frame.range[seen], view.range[seen], rtol=1e-4)
    near_face = 12.0 - 4.5 / 2
    assert abs(frame.range[seen].min() - near_face) < 0.3
    without = rollout(untrained(), poses, seed=0).frames[0].range_image
    assert not without.mask.any()


def test_each_frame_sees_the_layout_at_its_own_time():
    world = car_world(speed=10.0)  # 1 m per frame at 10 Hz
    poses = np.repeat(straight_poses(1), 3, axis=0)  # the ego stands still
    asked: list[float] = []

    def layout(t: float, pose: np.ndarray) -> dict:
        asked.append(t)
        return world.boxes(t, pose)

    result = rollout(untrained(), poses, layout=layout, seed=0, update_cache=False)
    np.testing.assert_allclose(asked, [0.0, 0.1, 0.2])
    nearest = [f.range_image.range[f.range_image.mask].min() for f in result.frames]
    np.testing.assert_allclose(np.diff(nearest), [1.0, 1.0], atol=0.1)  # the car drives away
    later = rollout(untrained(), poses[:1], layout=layout, times=np.array([0.5]), seed=0)
    assert asked[-1] == 0.5
    expected = box_range_view(world.boxes(0.5)["boxes"], poses[0], SENSOR).range
    np.testing.assert_allclose(later.frames[0].range_image.range, expected, rtol=1e-4)


def test_a_rollout_with_map_and_layout_is_deterministic_per_seed(model):
    world = car_world(speed=5.0)
    poses = straight_poses(2, spacing=0.5)
    a = rollout(model, poses, map_source=world.hdmap, layout=world.boxes, seed=4)
    b = rollout(model, poses, map_source=world.hdmap, layout=world.boxes, seed=4)
    c = rollout(model, poses, map_source=world.hdmap, layout=None, seed=4)
    for fa, fb in zip(a.frames, b.frames, strict=True):
        np.testing.assert_array_equal(fa.points, fb.points)
    assert not np.array_equal(a.frames[0].range_image.range, c.frames[0].range_image.range)


def test_times_must_give_one_finite_second_per_pose(model):
    with pytest.raises(ValueError, match="times must be 3"):
        rollout(model, straight_poses(3), times=np.array([0.0, 0.1]))
    with pytest.raises(ValueError, match="times"):
        rollout(model, straight_poses(2), times=np.array([0.0, np.nan]))
    np.testing.assert_allclose(frame_times(3, None, start=2.0), [2.0, 2.1, 2.2])
    assert OBJECT_CLASSES[car_world().boxes()["box_class"][0]] == "car"


def test_a_generated_return_in_front_of_every_mapped_surface_is_moved_onto_the_nearest():
    """Generating, the network's occluders that neither the map nor the layout has are drawn on the surface
    behind them; what lies on a surface (within the snap tolerance), behind it, or where none is, stays."""
    pose = straight_poses(1)[0]
    view = FLAT.range_view(pose, SENSOR)
    ground = view.ground.copy()
    below = ground > 0
    range_ = ground.copy()
    rows = np.flatnonzero(below.any(axis=1))
    invented = np.zeros_like(below)
    invented[rows[-1], :8] = True  # half way to the ground: in front of it
    range_[invented] *= 0.5
    range_[rows[-2], :8] *= 0.97  # in front of the ground but within the snap tolerance
    range_[rows[-3], :8] *= 1.5  # behind the ground: a dip the map does not know
    sky = ~below
    range_[sky] = 30.0  # rays with no mapped surface keep whatever returns there
    image = RangeImage(range_, np.full_like(range_, 0.25))
    moved = on_mapped_surfaces(image, view, None, SENSOR)
    np.testing.assert_array_equal(moved.range, np.where(invented, ground, range_))
    np.testing.assert_array_equal(moved.intensity, image.intensity)
    # a box on the invented returns' rays is a surface they stand on; one nearer than the ground, but behind
    # them, is the surface they go to
    boxes = LayoutView(np.where(invented, 0.5 * ground, 0.0).astype(np.float32), np.where(invented, 0, -1))
    np.testing.assert_array_equal(on_mapped_surfaces(image, view, boxes, SENSOR).range, range_)
    nearer = LayoutView(np.where(invented, 0.75 * ground, 0.0).astype(np.float32), np.where(invented, 0, -1))
    np.testing.assert_allclose(on_mapped_surfaces(image, view, nearer, SENSOR).range,
                               np.where(invented, 0.75 * ground, range_), rtol=1e-6)
    # a surface beyond the sensor's range is none
    far = LayoutView(np.where(invented, 2 * SENSOR.max_range, 0.0).astype(np.float32), np.where(invented, 0, -1))
    np.testing.assert_array_equal(on_mapped_surfaces(image, None, far, SENSOR).range, range_)
    assert on_mapped_surfaces(image, None, None, SENSOR) is image
    # so is what was measured there: a sample's cache of observed points keeps its objects
    cached = RangeImage(np.where(invented, 0.5 * ground, 0.0).astype(np.float32), np.zeros_like(range_))
    np.testing.assert_array_equal(on_mapped_surfaces(image, view, None, SENSOR, cached).range, range_)


def test_generation_draws_and_feeds_back_what_stands_on_the_map(model, monkeypatch):
    import inference.rollout as rollout_module

    poses = straight_poses(2)
    result = rollout(model, poses, map_source=FLAT, seed=0)
    for frame in result.frames:  # nothing left in front of the map's surfaces
        view = FLAT.range_view(frame.pose, SENSOR)
        np.testing.assert_array_equal(on_mapped_surfaces(frame.range_image, view, None, SENSOR).range,
                                      frame.range_image.range)
    expected = SpatialCache()
    for frame in result.frames:
        expected.add(transform_points(frame.points, frame.pose), frame.pose)
    np.testing.assert_array_equal(result.cache.points(), expected.points())
    unfed = rollout(model, poses, map_source=FLAT, seed=0, update_cache=False)  # finished in the views thread
    np.testing.assert_array_equal(unfed.frames[0].range_image.range, result.frames[0].range_image.range)
    monkeypatch.setattr(rollout_module, "on_mapped_surfaces", lambda image, *args: image)
    drawn = rollout(model, poses, map_source=FLAT, seed=0).frames[0].range_image.range
    assert (drawn < result.frames[0].range_image.range).sum() > 10, "the perturbed model invents occluders"


def test_a_generated_frame_keeps_what_its_cache_measured_in_front_of_the_map(model, monkeypatch):
    """Without a measurement, the cache's measured points are a surface too: a sweep given as a cache
    (`sample_sweep(cache_points=...)`) keeps its objects in front of the map. What earlier generated frames
    drew is not: free generation is held to the map alone."""
    import inference.rollout as rollout_module

    poses = straight_poses(1)
    wall = np.stack(np.meshgrid(np.full(1, 8.0), np.linspace(-3, 3, 40), np.linspace(-1.5, 1.0, 20)), -1).reshape(-1, 3)
    cache = SpatialCache()
    cache.add(np.concatenate([transform_points(wall, poses[0]), np.zeros((len(wall), 1))], axis=1)
              .astype(np.float32), poses[0], observed=True)
    seen = []
    moved = rollout_module.on_mapped_surfaces
    monkeypatch.setattr(rollout_module, "on_mapped_surfaces",
                        lambda image, *args: seen.append(args) or moved(image, *args))
    kept = rollout(model, poses, map_source=FLAT, cache=cache, seed=0).frames[0].range_image
    cached = seen[0][-1]
    assert cached is not None and cached.mask.sum() > 0 and np.median(cached.range[cached.mask]) < 9.0
    rollout(model, straight_poses(2), map_source=FLAT, seed=0)
    assert seen[-1][-1] is None and seen[-2][-1] is None, "a generated cache holds nothing measured"
    # the frame keeps more of the wall than held to the map alone
    monkeypatch.setattr(rollout_module, "_measured_surface", lambda *args: None)
    bare = rollout(model, poses, map_source=FLAT, cache=cache, seed=0).frames[0].range_image
    on_wall = cached.mask & (np.abs(cached.range - 8.0) < 1.0)
    at_wall = [int((np.abs(image.range[on_wall] - 8.0) < 1.0).sum()) for image in (kept, bare)]
    assert at_wall[0] > at_wall[1], f"returns at the measured wall with / without it: {at_wall}"
    measured = _first_frame_observed(model, poses)
    before = len(seen)
    rollout(model, poses, map_source=FLAT, cache=cache, measured=measured, seed=0)
    assert len(seen) == before, "a frame with a measurement is held by it, not by the map"

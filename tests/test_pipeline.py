"""The pipeline turns user inputs into rollouts: deterministic per seed, real scans forecast, bad inputs named.

A tiny random model stands in for the trained one: these tests check plumbing (poses, caches, callbacks,
validation), not sample quality.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from inference import MAX_FRAMES, MAX_STEPS, LidarVersePipeline, load_pipeline
from inference.loader import DEFAULT_MODEL, MODEL_ENV, WEIGHTS_NAME
from inference.pipeline import FORECAST_SPEED, MIN_PREFIX_RETURNS, RETURNS_CHUNK, action_poses, write_rollout
from inference.rollout import Frame, RolloutResult
from lidar.formats import Scan, read_points
from lidar.range_image import RangeImage
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL64
from lidar.sim import make_world, plan_drive
from tests.helpers import tiny_model, write_release

REAL_SCANS = real_scans_dir()
@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> LidarVersePipeline:
    folder = write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=3))
    return load_pipeline(folder)


@pytest.fixture(scope="module")
def world():
    return make_world(3, "urban")


def real_scan(name: str):
    path = REAL_SCANS / name
    if not path.is_file():
        pytest.skip(f"shared real scan {path} is absent")
    return read_points(path)


def test_generate_world_follows_the_planned_drive_and_reports_progress(pipe, world):
    events = []
    out = pipe.generate_world(
        map=world, action="turn_left", frames=2, steps=2, seed=0, callback=events.append
    )
    sensor = pipe.sensor
    expected = plan_drive(world, "turn_left", 2, seed=0, mount_height=sensor.mount_height)
    assert len(out.frames) == 2
    for frame, pose in zip(out.frames, expected, strict=True):
        np.testing.assert_array_equal(frame.pose, pose)
        assert frame.range_image.shape == sensor.shape
        assert frame.points.dtype == np.float32 and frame.points.shape[1] == 4
        assert len(frame.points) == int(frame.range_image.mask.sum()) > 0
        assert frame.points[:, 3].min() >= 0.0 and frame.points[:, 3].max() <= 1.0
    assert out.world.shape[1] == 4 and len(out.world) > 0
    assert set(out.timings) >= {"per_frame", "total", "frames_per_second", "prepare"}
    # one event per sampler step and one more per finished frame, in order, ending at 100 %
    assert [(e.frame, e.step) for e in events] == [(0, 1), (0, 2), (0, 2), (1, 1), (1, 2), (1, 2)]
    assert [e.frame_result is not None for e in events] == [False, False, True, False, False, True]
    assert events[-1].fraction == 1.0


def test_generation_is_deterministic_per_seed(pipe, world):
    a = pipe.generate_world(map=world, action="straight", frames=2, steps=2, seed=7)
    b = pipe.generate_world(map=world, action="straight", frames=2, steps=2, seed=7)
    c = pipe.generate_world(map=world, action="straight", frames=1, steps=2, seed=8)
    for fa, fb in zip(a.frames, b.frames, strict=True):
        np.testing.assert_array_equal(fa.points, fb.points)
        np.testing.assert_array_equal(fa.range_image.range, fb.range_image.range)
    np.testing.assert_array_equal(a.world, b.world)
    assert not np.array_equal(a.frames[0].range_image.range, c.frames[0].range_image.range)


def test_explicit_poses_replace_the_action(pipe, world):
    poses = np.tile(np.eye(4), (3, 1, 1))
    poses[:, 0, 3] = [0.0, 1.0, 2.0]
    poses[:, 2, 3] = pipe.sensor.mount_height
    out = pipe.generate_world(map=world, poses=poses, steps=1, seed=0)
    np.testing.assert_array_equal(np.stack([f.pose for f in out.frames]), poses)


def test_forecast_continues_from_a_real_kitti_scan(pipe):
    scan = real_scan("kitti_patchworkpp_000000.bin")
    out = pipe.forecast([scan], action="straight", frames=2, steps=2, seed=0)
    assert len(out.frames) == 2
    # the ego moves on from the scan's pose (identity) at the forecast speed, 10 Hz
    np.testing.assert_allclose(out.frames[0].pose[:3, 3], [FORECAST_SPEED / 10.0, 0.0, 0.0], atol=1e-9)
    # every observed point went into the cache (one per voxel), not only one per model pixel
    assert len(out.cache) > pipe.sensor.height * pipe.sensor.width
    # the frames come out in the scan's own geometry: a KITTI HDL-64E's 64 beams at its measured columns
    assert out.frames[0].range_image.shape[0] == 64 and out.frames[0].range_image.shape[1] >= 1800
    assert len(out.frames[0].points) >= 0.7 * scan.num_points
    other = pipe.forecast([scan.points[::7]], action="straight", frames=2, steps=2, seed=0)
    assert not np.array_equal(out.frames[0].range_image.range, other.frames[0].range_image.range)


@pytest.mark.parametrize("name", ["kitti_patchworkpp_000000.bin", "kitti_pointpillars_000134.bin"])
def test_an_array_is_forecast_in_the_geometry_its_file_would_be(pipe, name):
    """A sweep passed as a numpy array has its rings recovered as a reader recovers them from a file without a
    ring field, so the frames come out on the same measured beams and columns, not the nearest preset's or
    the model's."""
    scan = real_scan(name)
    from_file, from_array = pipe.grid(None, [scan]), pipe.grid(None, [scan.points])
    assert from_file.name.endswith("-measured")
    assert from_array.shape == from_file.shape and from_array.elevations_deg == from_file.elevations_deg
    np.testing.assert_array_equal(Scan.from_points(scan.points).ring, scan.ring)


def test_a_forecast_is_conditioned_on_what_was_observed_unless_asked_to_feed_back(pipe):
    world = make_world(2, "urban")
    poses = plan_drive(world, "straight", 4, seed=0, mount_height=pipe.sensor.mount_height)
    observed = pipe.generate_world(map=world, poses=poses[:1], seed=1).frames[0].points
    # with the map the frames hold more than the kept measurement: returns the model added
    plain = pipe.forecast([observed], prefix_poses=poses[:1], poses=poses[1:], seed=0, map=world)
    assert plain.cache.observed().all() and len(plain.frames) == 3, "generated frames stay out of the cache"
    fed = pipe.forecast([observed], prefix_poses=poses[:1], poses=poses[1:], seed=0, feedback=True, map=world)
    assert (~fed.cache.observed()).sum() > 100 and fed.cache.observed().sum() == len(plain.cache)
    np.testing.assert_array_equal(fed.frames[0].points, plain.frames[0].points)  # the first frame sees the same
    with pytest.raises(ValueError, match="feedback"):
        pipe.forecast([observed], prefix_poses=poses[:1], poses=poses[1:], feedback="yes")


def test_forecast_refuses_scans_not_in_the_sensor_frame(pipe):
    scan = real_scan("pandaset_bynow76_000000.bin")
    assert not scan.sensor_frame
    with pytest.raises(ValueError, match=r"prefix_scans\[0\].*not in the sensor frame"):
        pipe.forecast([scan], frames=1, steps=1)


def test_forecast_input_errors_are_named(pipe):
    far = np.zeros((500, 4), np.float32)
    far[:, 0] = 1000.0  # beyond max range: nothing lands on the model's beams
    with pytest.raises(ValueError, match=r"prefix_scans\[0\] has only 0 returns"):
        pipe.forecast([far], frames=1, steps=1)
    with pytest.raises(ValueError, match=r"must be \(N, 3\+\) points"):
        pipe.forecast([np.zeros((10, 2))], frames=1, steps=1)
    with pytest.raises(ValueError, match=r"non-empty list"):
        pipe.forecast([], frames=1, steps=1)
    h, w = pipe.sensor.shape
    with pytest.raises(ValueError, match=rf"{h + 1}x{w} range image but the frames' sensor"):
        pipe.forecast([RangeImage(np.ones((h + 1, w), np.float32), np.zeros((h + 1, w), np.float32))])
    pts = real_scan("kitti_patchworkpp_000002.bin").points
    with pytest.raises(ValueError, match=r"prefix_poses has 2 poses for 1 scans"):
        pipe.forecast([pts], prefix_poses=np.tile(np.eye(4), (2, 1, 1)), frames=1, steps=1)


def test_a_named_sensor_is_checked_before_the_scans(pipe):
    with pytest.raises(ValueError, match="bogus"):
        pipe.forecast([np.zeros((10, 2))], frames=1, steps=1, sensor="bogus")
    with pytest.raises(ValueError, match="bogus"):
        pipe.resimulate(np.zeros((10, 4)), np.eye(4)[None], np.eye(4)[None], sensor="bogus")


def test_the_cache_built_beside_the_checks_reports_its_failure_and_leaves_no_thread(pipe, monkeypatch):
    import threading

    import inference.pipeline as pipeline_module

    def broken(*args, **kwargs):
        raise RuntimeError("cache build failed")

    scan = _rays(pipe.sensor, 2 * MIN_PREFIX_RETURNS)
    monkeypatch.setattr(pipeline_module, "cache_from_scans", broken)
    with pytest.raises(RuntimeError, match="cache build failed"):
        pipe.forecast([scan], frames=1, steps=1, sensor=pipe.sensor)
    with pytest.raises(ValueError, match="has only 3 returns"):  # the check's error, once the build has ended
        pipe.forecast([_rays(pipe.sensor, 3)], frames=1, steps=1, sensor=pipe.sensor)
    assert not [t for t in threading.enumerate() if t.name.startswith("observed-cache")]


def _rays(sensor, count: int) -> np.ndarray:
    """(count, 4) points 10 m out along `count` distinct rays of `sensor`, beam after beam."""
    azimuth = 2 * np.pi * (np.arange(count) % sensor.width + 0.5) / sensor.width
    elevation = np.radians(np.asarray(sensor.elevations_deg)[np.arange(count) // sensor.width])
    return np.stack([10 * np.cos(elevation) * np.cos(azimuth), 10 * np.cos(elevation) * np.sin(azimuth),
                     np.full(count, 10 * np.sin(elevation)), np.zeros(count)], axis=1).astype(np.float32)


def test_a_scan_is_checked_for_returns_across_all_its_points(pipe):
    """The check counts rays a chunk of points at a time: a scan whose first chunks all hit one ray still
    passes on the rays its later points return on, and one a ray short fails with its whole count."""
    sensor = pipe.sensor
    one_ray = np.repeat(_rays(sensor, 1), 2 * RETURNS_CHUNK, axis=0)
    spread = np.concatenate([one_ray, _rays(sensor, MIN_PREFIX_RETURNS)])
    assert len(pipe.forecast([spread], frames=1, steps=1, sensor=sensor).frames) == 1
    short = np.concatenate([one_ray, _rays(sensor, MIN_PREFIX_RETURNS - 1)])
    with pytest.raises(ValueError, match=rf"prefix_scans\[0\] has only {MIN_PREFIX_RETURNS - 1} returns"):
        pipe.forecast([short], frames=1, steps=1, sensor=sensor)


def test_resimulate_renders_target_poses_without_feeding_frames_back(pipe):
    scan = real_scan("kitti_patchworkpp_000002.bin")
    targets = action_poses(np.eye(4), "turn_right", 2)
    out = pipe.resimulate([scan.points], np.eye(4)[None], targets, steps=1, seed=0)
    seeded = pipe.resimulate([scan.points], np.eye(4)[None], targets[:1], steps=1, seed=0)
    np.testing.assert_array_equal(np.stack([f.pose for f in out.frames]), targets)
    assert len(out.cache) == len(seeded.cache)  # only the observed sweep, however many frames


def test_sample_sweep_draws_one_frame(pipe, world):
    out = pipe.sample_sweep(map=world, steps=1, seed=1)
    assert len(out.frames) == 1
    assert out.frames[0].pose[2, 3] == pytest.approx(pipe.sensor.mount_height)


def test_action_poses_dead_reckon_straight_and_turns():
    start = np.eye(4)
    start[:3, 3] = (10.0, 5.0, 1.8)
    straight = action_poses(start, "straight", 3)
    np.testing.assert_allclose(straight[:, 0, 3] - 10.0, FORECAST_SPEED * np.array([0.1, 0.2, 0.3]))
    left, right = action_poses(start, "turn_left", 20), action_poses(start, "turn_right", 20)
    assert left[-1, 1, 3] > 5.0 > right[-1, 1, 3]
    assert np.arctan2(left[-1, 1, 0], left[-1, 0, 0]) > 0.5  # heading turned left
    np.testing.assert_allclose(
        np.linalg.norm(np.diff(left[:, :3, 3], axis=0), axis=1), FORECAST_SPEED / 10, rtol=1e-3
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames": 0}, rf"frames must be an integer in \[1, {MAX_FRAMES}\], got 0"),
        ({"frames": MAX_FRAMES + 1}, rf"frames must be an integer in \[1, {MAX_FRAMES}\]"),
        ({"steps": 0}, rf"steps must be an integer in \[1, {MAX_STEPS}\], got 0"),
        ({"steps": MAX_STEPS + 1}, r"steps must be an integer"),
        ({"steps": 2.5}, r"steps must be an integer"),
        ({"action": "fly"}, r"unknown action 'fly'; expected one of straight, turn_left, turn_right"),
        ({"guidance": -1.0}, r"guidance must be a number in \[0, 20"),
        ({"seed": -3}, r"seed must be an integer in \[0, 18446744073709551615\], got -3"),
        ({"map": "city"}, r"map must be a world seed \(integer >= 0\) or a lidar.sim World, got 'city'"),
        ({"poses": np.zeros((2, 4, 4))}, r"poses: pose 0 is not a finite rigid transform"),
        ({"poses": np.eye(4)}, r"poses must be \(T, 4, 4\)"),
        ({"sensor": HDL64.with_width(16384)}, r"sensor hdl64 has 64 x 16384 = 1,048,576 rays; expected at most"),
        ({"sensor": "hdl-65"}, r"unknown sensor 'hdl-65'"),
        ({"callback": 3}, r"callback must be callable"),
    ],
)
def test_bad_generate_inputs_fail_before_any_compute(pipe, world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe.generate_world(**{"map": world, "frames": 1, "steps": 1, **kwargs})


def test_write_rollout_writes_frames_world_and_poses_json(pipe, tmp_path):
    h, w = pipe.sensor.shape
    empty = RangeImage(np.zeros((h, w), np.float32), np.zeros((h, w), np.float32))
    pts = np.array([[1.0, 2.0, 0.5, 0.25], [3.0, -1.0, 0.0, 1.0]], np.float32)
    pose = np.eye(4)
    pose[0, 3] = 4.0
    rings = np.array([7, 3])  # stored ring by ring: the second point first
    frames = [Frame(0, np.eye(4), pts, empty, 0.1, rings), Frame(1, pose, pts[:0], empty, 0.2, rings[:0])]
    result = RolloutResult(frames, pts + np.float32([4.0, 0, 0, 0]), {"total": 0.3}, cache=None)
    meta = write_rollout(
        tmp_path, result, "ply", sensor=pipe.sensor, provenance=pipe.provenance, request={"seed": 1}
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frame_000.ply", "poses.json", "world.ply"]
    written = read_points(tmp_path / "frame_000.ply")
    np.testing.assert_allclose(written.points, pts[::-1])
    np.testing.assert_array_equal(written.ring, rings[::-1])  # a format with a ring field holds the frame's rings
    assert json.loads((tmp_path / "poses.json").read_text()) == meta
    assert [f["file"] for f in meta["frames"]] == ["frame_000.ply", None]  # no returns, no file
    assert meta["frames"][1]["pose"] == pose.tolist() and meta["request"] == {"seed": 1}
    assert meta["model"]["source"] == pipe.provenance.source and meta["world_points"] == 2

    (tmp_path / "mine.txt").write_text("not ours")
    with pytest.raises(ValueError, match=r"already holds a rollout \(poses\.json\)"):
        write_rollout(tmp_path, result, "bin", sensor=pipe.sensor)
    shorter = RolloutResult(frames[1:], pts, {"total": 0.1}, cache=None)
    write_rollout(tmp_path, shorter, "bin", sensor=pipe.sensor, overwrite=True)
    # the earlier rollout's files are gone, the user's own file stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "poses.json", "world.bin"]


def test_bf16_pipeline_returns_float32_points(tmp_path):
    """bf16 is the CUDA default; the same plumbing must hold on CPU (points stay float32 for the writers)."""
    pipe = load_pipeline(write_release(tmp_path / "r", tiny_model(seed=3)), dtype="bf16")
    assert pipe.provenance.dtype == "bfloat16"
    # v2 anchors on the prior: with nothing known a near-untrained model returns nothing, so give it a cache
    ring = (pipe.sensor.ray_directions() * 8.0).reshape(-1, 3) + np.array([0.0, 0.0, pipe.sensor.mount_height])
    cache = np.concatenate([ring, np.full((len(ring), 1), 0.5)], 1).astype(np.float32)
    out = pipe.sample_sweep(cache_points=cache, steps=1, seed=0)
    assert out.frames[0].points.dtype == np.float32 and len(out.frames[0].points) > 0


def test_embedded_default_loads_with_no_arguments(monkeypatch):
    """The laptop path: `load_pipeline()` offline, from weights/default, as shipped."""
    monkeypatch.delenv(MODEL_ENV, raising=False)
    if not (DEFAULT_MODEL / WEIGHTS_NAME).is_file():
        pytest.skip(
            f"{DEFAULT_MODEL} holds no release yet (python -m training.export JOB_DIR weights/default)"
        )
    pipe = load_pipeline()
    assert (pipe.provenance.kind, pipe.provenance.weights) == ("release", "ema")
    assert pipe.provenance.iteration is not None and pipe.provenance.resolved_path == str(
        DEFAULT_MODEL / WEIGHTS_NAME
    )
    out = pipe.sample_sweep(steps=1, seed=0)
    assert out.frames[0].range_image.shape == pipe.sensor.shape and len(out.frames[0].points) > 0


def test_map_is_a_world_or_an_hdmap_and_a_world_conditions_on_its_actor_layout(pipe, monkeypatch):
    """A World gives rollout its HD map and its boxes (10 Hz from World.time); an HDMap the map only."""
    import inference.pipeline as pipeline_module
    from tests.helpers import car_world

    seen = {}
    real = pipeline_module.rollout

    def spy(model, poses, **kwargs):
        seen.update(kwargs)
        return real(model, poses, **kwargs)

    monkeypatch.setattr(pipeline_module, "rollout", spy)
    world = car_world().at_time(2.0)
    pipe.sample_sweep(map=world, steps=1, seed=0)
    assert seen["map_source"] is world.hdmap and seen["layout"] == world.boxes
    np.testing.assert_allclose(seen["times"], [2.0])
    pipe.sample_sweep(map=world.hdmap, steps=1, seed=0)
    assert seen["map_source"] is world.hdmap and seen["layout"] is None
    with pytest.raises(ValueError, match=r"World.*HDMap"):
        pipe.sample_sweep(map=lambda pose, sensor: None, steps=1, seed=0)

"""What was measured is kept: forecasts and re-simulations return the observed ranges (and points) on every ray
the observation sees, and continue at the motion a posed prefix measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial import cKDTree

from inference import load_pipeline
from inference.measured import (
    MISS_BASELINE_M,
    keep_measured,
    measured_points,
    measured_view,
    observation,
    shadow_interior,
)
from inference.pipeline import EgoMotion, action_poses, measured_motion
from lidar.range_image import grid_winners, project
from lidar.sim import make_world, plan_drive
from lidar.vocabulary import MapView
from tests.helpers import tiny_model, write_release


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory):
    return load_pipeline(write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=5)))


@pytest.fixture(scope="module")
def observed(pipe):
    """Two sweeps of a simulated street (generated with its map) and their poses, 5 frames apart."""
    world = make_world(4, "urban")
    poses = plan_drive(world, "straight", 6, seed=0, mount_height=pipe.sensor.mount_height)[[0, 5]]
    frames = pipe.generate_world(map=world, poses=poses, seed=2).frames
    return [f.points for f in frames], poses


def test_zero_shift_resimulation_returns_the_observed_sweep_exactly(pipe, observed) -> None:
    scans, poses = observed
    out = pipe.resimulate(scans[:1], poses[:1], poses[:1], steps=2, seed=9, sensor=pipe.sensor)
    frame, truth = out.frames[0], project(scans[0], pipe.sensor)
    kept = measured_view(observation(scans[:1], poses[:1], pipe.sensor), poses[0], pipe.sensor)
    # a float32 trip through the world frame moves a few points at a column's edge into the next column
    agree = kept.mask & truth.mask & np.isclose(kept.image.range, truth.range, rtol=1e-5)
    assert agree.sum() >= 0.995 * truth.mask.sum() > 100
    np.testing.assert_allclose(frame.range_image.range[kept.mask], kept.image.range[kept.mask], rtol=1e-5)
    # the points on those rays are the measured points themselves, not moved onto the rays' centres
    on_returns = np.flatnonzero(frame.range_image.mask.reshape(-1))
    pixels = np.flatnonzero(kept.mask.reshape(-1))
    at = np.searchsorted(on_returns, pixels)
    np.testing.assert_array_equal(frame.points[at], kept.points[pixels])
    index, where = grid_winners(scans[0], pipe.sensor)
    same = np.isin(where, pixels[agree.reshape(-1)[pixels]])
    np.testing.assert_allclose(kept.points[where[same], :3], scans[0][index[same], :3], atol=1e-4)


def _moved(points: np.ndarray, pose: np.ndarray, sensor):
    return project(np.c_[(points[:, :3] - pose[:3, 3]) @ pose[:3, :3], points[:, 3]], sensor)


def test_a_forecast_keeps_the_nearest_observed_return_of_every_sweep_on_each_ray(pipe, observed) -> None:
    scans, poses = observed
    target = poses[0].copy()
    # as far from one sweep as from the other, and beyond MISS_BASELINE_M of both, where nothing the newest saw
    # past is left out (that is the next test's)
    drive = poses[1, :3, 3] - poses[0, :3, 3]
    side = np.cross([0.0, 0.0, 1.0], drive / np.linalg.norm(drive))
    target[:3, 3] = poses[:, :3, 3].mean(axis=0) + side * math.sqrt(max(MISS_BASELINE_M**2 - (drive @ drive) / 4, 0) + 1)
    out = pipe.forecast(scans, prefix_poses=poses, poses=target[None], steps=2, seed=1, sensor=pipe.sensor)
    moved = _moved(measured_points(scans, poses), target, pipe.sensor)
    np.testing.assert_allclose(out.frames[0].range_image.range[moved.mask], moved.range[moved.mask], rtol=1e-5)


def test_a_pose_next_to_one_sweep_keeps_that_sweeps_returns_and_fills_from_the_others(pipe, observed) -> None:
    from inference.measured import OWN_SWEEP_RATIO, SAME_EYES_M, own_sweep

    scans, poses = observed
    target = poses[1].copy()
    target[:3, 3] += target[:3, 0] * 3 * SAME_EYES_M  # past the near sweep's eyes
    seen = observation(scans, poses, pipe.sensor)
    gaps = np.linalg.norm(poses[:, :3, 3] - target[:3, 3], axis=1)
    assert gaps[1] < OWN_SWEEP_RATIO * gaps[0] and own_sweep(seen, target) == 1
    out = pipe.forecast(scans, prefix_poses=poses, poses=target[None], steps=2, seed=1, sensor=pipe.sensor).frames[0].range_image.range
    own = _moved(measured_points(scans[1:], poses[1:]), target, pipe.sensor)
    other = _moved(measured_points(scans[:1], poses[:1]), target, pipe.sensor)
    np.testing.assert_allclose(out[own.mask], own.range[own.mask], rtol=1e-5)
    from inference.measured import row_misses

    stale = row_misses(np.flatnonzero(own.mask.reshape(-1)), pipe.sensor)  # the near sweep saw them empty
    fill = other.mask & ~own.mask & ~stale & ~shadow_interior(seen.shadow)  # the car's body hides its shadow
    # the other sweep fills them (in the measurement the frame keeps), but where the newest saw past its point
    kept_far = measured_view(seen, target, pipe.sensor)
    filled = kept_far.mask[fill]
    np.testing.assert_allclose(kept_far.image.range[fill][filled], other.range[fill][filled], rtol=1e-5)
    assert filled.sum() >= max(2, fill.sum() // 2)
    assert (other.mask & stale).any() and (out[other.mask & stale] == 0).all()
    # where the other sweep's point lies nearer on a ray the near sweep returns on, the near sweep still wins
    assert (own.mask & other.mask & (other.range < own.range - 0.1)).any()
    # nearer still, the pose sees with the near sweep's eyes: the other fills none of its silent rays
    eyes = poses[1].copy()
    eyes[:3, 3] += eyes[:3, 0] * SAME_EYES_M / 2
    own_eyes = _moved(measured_points(scans[1:], poses[1:]), eyes, pipe.sensor)
    other_eyes = _moved(measured_points(scans[:1], poses[:1]), eyes, pipe.sensor)
    kept = measured_view(seen, eyes, pipe.sensor)
    assert (other_eyes.mask & ~own_eyes.mask).sum() >= 5
    assert not (kept.mask & ~kept.body & ~own_eyes.mask).any()
    assert (kept.mask & own_eyes.mask).sum() > 0.9 * own_eyes.mask.sum()
    # halfway between the sweeps neither sees for the pose
    middle = target.copy()
    middle[:3, 3] = poses[:, :3, 3].mean(axis=0)
    assert own_sweep(seen, middle) is None and own_sweep(observation(scans[:1], poses[:1], pipe.sensor), poses[0]) is None
    # just past the ratio, no sweep sees for the pose
    past = target.copy()
    span = poses[1][:3, 3] - poses[0][:3, 3]
    along = np.dot(span, span) ** 0.5
    # the point on the line beyond sweep 1 where its gap is just over OWN_SWEEP_RATIO times sweep 0's
    d = OWN_SWEEP_RATIO * along / (1 - OWN_SWEEP_RATIO) * 1.05
    past[:3, 3] = poses[1][:3, 3] + span / along * d
    assert own_sweep(seen, past) is None
    # a car standing still took both sweeps from one place: from there and from anywhere near, the newer
    standing = observation([scans[0], scans[1]], poses[[0, 0]], pipe.sensor)
    assert own_sweep(standing, poses[0]) == 1 and own_sweep(standing, target) == 1


def test_the_map_keeps_its_exact_surface_where_it_confirms_the_measurement(pipe, observed) -> None:
    scans, poses = observed
    world = observation(scans[:1], poses[:1], pipe.sensor)
    plain = measured_view(world, poses[0], pipe.sensor)
    ground = np.where(plain.mask, plain.image.range * 1.01, 0.0).astype(np.float32)  # 1 % off: confirmed
    ground[:, : pipe.sensor.width // 2] = 0.0  # the map says nothing about the left half
    empty = np.zeros(pipe.sensor.shape, np.float32)
    view = MapView(np.zeros(pipe.sensor.shape, np.uint8), ground, empty, empty)
    with_map = measured_view(world, poses[0], pipe.sensor, view)
    np.testing.assert_array_equal(with_map.mask, plain.mask & (ground == 0))


def test_keep_measured_sets_range_intensity_and_return_only_on_kept_rays(pipe, observed) -> None:
    import torch

    scans, poses = observed
    kept = measured_view(observation(scans[:1], poses[:1], pipe.sensor), poses[0], pipe.sensor)
    x = torch.full((1, 3, *pipe.sensor.shape), -0.5)
    out = keep_measured(x, kept, pipe.sensor)[0].numpy()
    assert (out[2][kept.mask] == 1.0).all() and (out[:, ~kept.mask & ~kept.misses] == -0.5).all()
    assert np.abs(out[1][kept.mask] - (kept.image.intensity[kept.mask] * 2 - 1)).max() < 1e-6


@pytest.mark.parametrize("motion", [EgoMotion((8.6, 0.4), 0.02), EgoMotion((5.0, 0.0), -0.5), EgoMotion((0.0, 0.0))])
def test_the_motion_of_a_posed_prefix_is_measured_back_exactly(motion: EgoMotion) -> None:
    start = np.eye(4)
    start[:3, 3] = (5.0, -2.0, 1.7)
    prefix = np.concatenate([start[None], action_poses(start, "straight", 2, motion=motion)])
    got = measured_motion(prefix)
    np.testing.assert_allclose(got.velocity, motion.velocity, atol=1e-9)
    assert math.isclose(got.yaw_rate, motion.yaw_rate, abs_tol=1e-9)


def test_a_forecast_from_a_registered_prefix_continues_at_its_velocity_and_turns_from_there(pipe, observed) -> None:
    scans, _ = observed
    motion = EgoMotion((9.0, 0.0), 0.1)
    prefix = np.concatenate([np.eye(4)[None], action_poses(np.eye(4), "straight", 1, motion=motion)])
    ahead = pipe.forecast(scans[:1] * 2, prefix_poses=prefix, frames=3, steps=1)
    steps = np.linalg.norm(np.diff([prefix[-1], *[f.pose for f in ahead.frames]], axis=0)[:, :2, 3], axis=1)
    np.testing.assert_allclose(steps, 0.9, rtol=1e-4)  # chords of the arc at 9 m/s, not the 6 m/s dead-reckoning default
    left = pipe.forecast(scans[:1] * 2, prefix_poses=prefix, frames=3, steps=1, action="turn_left")
    yaw = [math.atan2(f.pose[1, 0], f.pose[0, 0]) for f in (ahead.frames[-1], left.frames[-1])]
    assert yaw[1] > yaw[0] > 0.0  # the measured left yaw rate, bent further left by the action
    # one sweep has no measured motion: the default speed
    single = pipe.forecast(scans[:1], frames=1, steps=1)
    assert math.isclose(np.linalg.norm(single.frames[0].pose[:2, 3]), 0.6, rel_tol=1e-9)


def test_prefix_times_set_the_measured_speed(pipe, observed) -> None:
    scans, _ = observed
    prefix = np.concatenate([np.eye(4)[None], action_poses(np.eye(4), "straight", 2, motion=EgoMotion((4.0, 0.0)))])
    # the same poses recorded 0.2 s apart (every other frame kept) mean half the speed
    slow = pipe.forecast(scans[:1] * 3, prefix_poses=prefix, prefix_times=np.array([0.0, 0.2, 0.4]), frames=1, steps=1)
    assert math.isclose(slow.frames[0].pose[0, 3] - prefix[-1][0, 3], 0.2, rel_tol=1e-9)
    with pytest.raises(ValueError, match="times"):
        pipe.forecast(scans[:1] * 3, prefix_poses=prefix, prefix_times=np.array([0.0, 0.0, 0.0]), frames=1, steps=1)


REAL_SCANS = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_scans"


@pytest.mark.skipif(not REAL_SCANS.is_dir(), reason="the shared real scans are not beside the checkout")
def test_the_cli_forecasts_registered_kitti_sweeps_at_their_measured_speed(pipe, tmp_path) -> None:
    from inference.__main__ import main

    sweeps = [str(REAL_SCANS / f"kitti_patchworkpp_{i:06d}.bin") for i in (0, 2, 4)]
    out = tmp_path / "fc"
    argv = ["forecast", "--model", str(pipe.provenance.resolved_path), "--prefix", *sweeps, "--frames", "2",
            "--steps", "1", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    meta = json.loads((out / "poses.json").read_text())
    positions = [np.asarray(r["pose"])[:3, 3] for r in (*meta["prefix"][-1:], *meta["frames"])]
    steps = np.linalg.norm(np.diff(positions, axis=0), axis=1)
    # KISS-ICP puts sweeps 0, 2, 4 (0.2 s apart) 1.4 m apart: about 7 m/s, not the 6 m/s default nor twice 7
    assert np.allclose(steps, steps[0]) and 0.6 < steps[0] < 0.85


@pytest.mark.parametrize("width", [512, 2048])
def test_a_ray_silent_between_measured_returns_of_its_row_is_a_measured_miss(pipe, width) -> None:
    from inference.measured import miss_reach, row_misses

    sensor = pipe.sensor.with_width(width)
    reach = miss_reach(sensor)
    # the same azimuth on every grid: two columns of 512, eight of 2,048
    assert reach == 2 * width // 512
    # one row measured at columns 10-20 with a hole at 15; another row holds one return at the seam
    pixels = np.array([1 * width + c for c in range(10, 21) if c != 15] + [3 * width + 0])
    misses = row_misses(pixels, sensor)
    assert misses[1, 15] and misses[1, 10 - reach] and misses[1, 20 + reach]
    assert not misses[1, 10 - reach - 1] and not misses[0, 15] and not misses[1, 12]
    assert misses[3, width - 1] and misses[3, 1]  # azimuth wraps
    assert misses.sum() == 1 + 2 * reach + 2 * reach


def test_measured_misses_return_nothing_unless_the_map_puts_a_surface_there(pipe, observed) -> None:
    import torch

    scans, poses = observed
    world = observation(scans[:1], poses[:1], pipe.sensor)
    kept = measured_view(world, poses[0], pipe.sensor)
    assert kept.misses.any() and not (kept.misses & kept.mask).any()
    x = torch.ones((1, 3, *pipe.sensor.shape))
    out = keep_measured(x, kept, pipe.sensor)[0, 2].numpy()
    assert (out[kept.misses] == -1.0).all() and (out[~kept.misses] == 1.0).all()
    ground = np.full(pipe.sensor.shape, 20.0, np.float32)
    empty = np.zeros(pipe.sensor.shape, np.float32)
    on_map = measured_view(world, poses[0], pipe.sensor, MapView(np.zeros(pipe.sensor.shape, np.uint8), ground,
                                                                 empty, empty))
    assert not on_map.misses.any()


def test_the_sensors_own_shadow_stays_empty_at_every_pose(pipe, monkeypatch) -> None:
    from inference.measured import SHADOW_ELEVATION_DEG, miss_reach, sensor_shadow
    from lidar.sensors import HDL64

    sensor = pipe.grid(HDL64.with_width(512))  # a shadow some rays tall, with an inside and an edge
    # a flat ground seen from the mount height, every ray below the horizon down to -20 deg, but the 80 deg
    # behind the car (its body) hidden
    rows = np.flatnonzero((sensor.elevations < -0.02) & (sensor.elevations > np.radians(-20.0)))
    az = (np.arange(sensor.width) + 0.5) / sensor.width * 2 * np.pi - np.pi
    behind = np.abs(np.abs(az) - np.pi) < np.radians(40.0)
    el, a = np.meshgrid(sensor.elevations[rows], az[~behind], indexing="ij")
    rng = sensor.mount_height / np.tan(-el)
    scan = np.stack([rng * np.cos(el) * np.cos(a), rng * np.cos(el) * np.sin(a), rng * np.sin(el),
                     np.full_like(rng, 0.5)], -1).reshape(-1, 4).astype(np.float32)
    scan = scan[np.hypot(scan[:, 0], scan[:, 1]) < sensor.max_range * 0.9]
    shadow = sensor_shadow([scan], sensor)
    steep = np.isin(np.arange(sensor.height), rows) & (sensor.elevations > np.radians(-20.0) + 1e-3)
    steep &= sensor.elevations < np.radians(SHADOW_ELEVATION_DEG)
    cols = np.flatnonzero(shadow[np.flatnonzero(steep)[steep.sum() // 2]])
    assert len(cols) > 0 and behind[cols].all()  # only behind the car
    assert not shadow[sensor.elevations >= np.radians(SHADOW_ELEVATION_DEG)].any()  # only where ground is near
    assert not shadow[sensor.elevations < np.radians(-20.5)].any()  # nor below the sensor's field of view
    # all of it but the `miss_reach` columns at each edge, which are row misses (as a dropped return would be)
    assert (shadow[steep][:, behind].sum(axis=1) == behind.sum() - 2 * miss_reach(sensor)).all()
    lone = scan[np.abs(np.arctan2(scan[:, 1], scan[:, 0])) > np.pi / sensor.width]  # a silent column ahead: a dropped return
    assert not sensor_shadow([lone], sensor)[:, sensor.width // 2 - 2 : sensor.width // 2 + 2].any()
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    ahead = pose.copy()
    ahead[0, 3] += 5.0
    kept = measured_view(observation([scan], pose[None], sensor), ahead, sensor)
    # the body hides its shadow from every pose: points measured there from elsewhere are not kept either, but
    # for the shadow's edge, uncertain by a ray, which returns its measured point or nothing
    interior = shadow_interior(shadow)
    assert interior.sum() >= 8 and kept.misses[interior].all() and not kept.mask[interior].any()
    assert (kept.misses | kept.mask)[shadow].all()
    assert not kept.misses[kept.mask].any()
    import torch

    out = keep_measured(torch.ones((1, 3, *sensor.shape)), kept, sensor)[0, 2].numpy()
    assert (out[shadow & ~kept.mask] == -1.0).all()
    # the pipeline hands every forecast and re-simulation the shadow of its observed sweeps
    import inference.pipeline as pipeline_module

    seen = {}
    real_rollout = pipeline_module.rollout
    monkeypatch.setattr(pipeline_module, "rollout", lambda *a, **k: seen.update(k) or real_rollout(*a, **k))
    pipe.forecast([scan], prefix_poses=pose[None], poses=ahead[None], steps=1, sensor=sensor)
    np.testing.assert_array_equal(seen["measured"]().shadow, shadow)  # built beside the first frame
    seen.clear()
    pipe.resimulate([scan], pose[None], ahead[None], steps=1, sensor=sensor)
    np.testing.assert_array_equal(seen["measured"]().shadow, shadow)  # built beside the first frame


def test_a_point_measured_just_above_the_shadow_stays_on_its_edge_a_little_way_on(pipe) -> None:
    from inference.measured import sensor_shadow
    from lidar.sensors import HDL64

    sensor = pipe.grid(HDL64.with_width(512))
    # flat ground all round, but behind the car its body hides the rays steeper than -12 deg
    rows = np.flatnonzero((sensor.elevations < -0.02) & (sensor.elevations > np.radians(-20.0)))
    az = (np.arange(sensor.width) + 0.5) / sensor.width * 2 * np.pi - np.pi
    el, a = np.meshgrid(sensor.elevations[rows], az, indexing="ij")
    hidden = (np.abs(np.abs(a) - np.pi) < np.radians(40.0)) & (el < np.radians(-12.0))
    rng = sensor.mount_height / np.tan(-el[~hidden])
    scan = np.stack([rng * np.cos(el[~hidden]) * np.cos(a[~hidden]), rng * np.cos(el[~hidden]) * np.sin(a[~hidden]),
                     rng * np.sin(el[~hidden]), np.full_like(rng, 0.5)], -1).astype(np.float32)
    shadow = sensor_shadow([scan], sensor)
    interior = shadow_interior(shadow)
    assert interior.sum() > 100 and (shadow & ~interior).sum() > 100
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    back = pose.copy()
    back[0, 3] -= 0.3  # the ground behind comes nearer, and steeper: the row above the shadow lands on its edge
    kept = measured_view(observation([scan], pose[None], sensor), back, sensor)
    assert kept.mask[shadow & ~interior].sum() > 20
    assert not kept.mask[interior].any() and kept.misses[interior].all()


def test_silent_rays_count_as_misses_only_near_an_observing_sensor(pipe, observed) -> None:
    from inference.measured import MISS_BASELINE_M

    scans, poses = observed
    seen = observation(scans[:1], poses[:1], pipe.sensor)
    near, far = poses[0].copy(), poses[0].copy()
    near[:3, 3] += near[:3, 0] * (MISS_BASELINE_M - 0.5)
    far[:3, 3] += far[:3, 0] * (MISS_BASELINE_M + 0.5)
    assert (measured_view(seen, near, pipe.sensor).misses & ~seen.shadow).any()
    # from farther away the moved sweep thins out: its gaps are no longer measured emptiness
    np.testing.assert_array_equal(measured_view(seen, far, pipe.sensor).misses, seen.shadow & ~measured_view(
        seen, far, pipe.sensor).mask)


def test_the_vehicles_own_returns_travel_with_the_sensor_not_with_the_world(pipe) -> None:
    from inference.measured import ego_body, measured_view, without_ego_body

    sensor = pipe.sensor
    rng = np.random.default_rng(0)
    # the car's boot and mirrors: the same sensor-frame points in every sweep, 1.2 m above a flat road
    body = np.c_[rng.uniform(-2.0, -1.0, 40), rng.uniform(-1.0, 1.0, 40), np.full(40, -0.5), np.full(40, 0.3)]
    road = np.c_[rng.uniform(-30, 30, (4000, 2)), np.full(4000, -sensor.mount_height), np.full(4000, 0.5)]
    road = road[np.hypot(road[:, 0], road[:, 1]) > 4.0]
    wall = np.c_[rng.uniform(-20, 20, 800), np.full(800, 8.0), rng.uniform(-1.5, 2.0, 800), np.full(800, 0.7)]
    # a fence alongside, 2.2 m to the right: within 3 m it looks the same from both poses, but it stayed in
    # the world, so it is no part of the car
    fence = np.c_[np.linspace(-20, 20, 8000), np.full(8000, -2.2), np.tile([-1.0, -0.5, 0.0, 0.3], 2000),
                  np.full(8000, 0.6)]
    wall = np.concatenate([wall, fence])
    poses = np.repeat(np.eye(4)[None], 2, axis=0)
    poses[1, 0, 3] = 1.0  # one metre on
    world = np.concatenate([road, wall])
    scans = [np.concatenate([body, world - np.r_[p[:3, 3], 0.0]]).astype(np.float32) for p in poses]
    marks = ego_body(scans, poses)
    assert [m[:40].all() and not m[40:].any() for m in marks] == [True, True]
    assert not ego_body(scans[:1], poses[:1])[0].any()  # one sweep cannot tell the body from the world
    assert [len(s) for s in without_ego_body(scans, marks)] == [len(world)] * 2
    seen = observation(scans, poses, sensor)
    assert len(seen.points) == 2 * len(world) and len(seen.body) == 40
    # from 5 m on, the body is where it was on the car, not 5 m behind
    ahead = poses[1].copy()
    ahead[0, 3] += 5.0
    kept = measured_view(seen, ahead, sensor)
    where = project(body, sensor)
    np.testing.assert_allclose(kept.image.range[where.mask], where.range[where.mask], rtol=1e-5)
    assert kept.body[where.mask].all() and kept.body.sum() == where.mask.sum()
    # fed back frame by frame, the body stays on the car: neither the cache nor the world union holds it
    targets = np.repeat(poses[1:], 3, axis=0)
    targets[:, 0, 3] += [1.0, 2.0, 3.0]
    out = pipe.forecast(scans, prefix_poses=poses, poses=targets, steps=1, feedback=True)
    trail = np.concatenate([body[:, :3] + p[:3, 3] for p in np.concatenate([poses, targets])])
    for cloud in (out.cache.points(), out.world):
        assert cKDTree(cloud[:, :3]).query(trail)[0].min() > 0.05
    nearest_on_ray = body[grid_winners(body, sensor)[0], :3]
    for frame in out.frames:  # while every frame draws it where it is on the car
        assert cKDTree(frame.points[:, :3]).query(nearest_on_ray)[0].max() < 1e-4


def test_what_the_network_adds_settles_against_the_measurement(pipe) -> None:
    from inference.measured import BEHIND_RATIO, MeasuredView, settle_additions
    from lidar.range_image import RangeImage, unproject

    sensor = pipe.sensor
    row = sensor.height - 3
    measured = np.zeros(sensor.shape, np.float32)
    measured[row - 1 : row + 2, 10:21] = 10.0  # a measured wall with one column of rays through it
    measured[:, 15] = 0.0
    added = np.zeros(sensor.shape, np.float32)
    added[row - 1 : row + 2, 15] = 18.0  # the network's ground behind the wall
    added[row - 1 : row + 2, 30:36] = 15.0  # a patch of its own, beside nothing measured
    added[1, 50] = 40.0  # one lone return in the sky
    added[row - 1 : row + 2, 21] = 10.5  # the wall going on, a little farther (the same surface)
    measured[1, 58] = 30.0  # a lone measured return, which stays
    added[4, 40] = 20.0  # an added pair, each other's neighbour only by row, but 1.5 m apart in range
    added[5, 40] = 21.5
    image = RangeImage(np.maximum(measured, added), np.full(sensor.shape, 0.5, np.float32))
    points = unproject(image, sensor)
    measured[row, 45] = 2.0  # the car's own bonnet ...
    body = np.zeros(sensor.shape, bool)
    body[row, 45] = True
    added[row - 1 : row + 2, 46] = 15.0  # ... beside ground the network drew: the car hides nothing
    image = RangeImage(np.maximum(measured, added), np.full(sensor.shape, 0.5, np.float32))
    points = unproject(image, sensor)
    measured_image = RangeImage(measured, np.full(sensor.shape, 0.5, np.float32))
    measured_points = np.zeros((measured.size, 4), np.float32)
    measured_points[measured_image.mask.reshape(-1)] = unproject(measured_image, sensor)
    # seen from afar (no near-ground rule), with nothing beside the grid
    view = MeasuredView(measured_image, measured_points, np.zeros(sensor.shape, bool), body, np.zeros((0, 4)), np.inf)
    out, kept = settle_additions(image, points, view)
    np.testing.assert_allclose(out.range[row - 1 : row + 2, 15], 10.0)
    assert 18.0 * BEHIND_RATIO > 10.0
    assert out.range[1, 50] == 0.0  # the lone return is gone
    assert (out.range[row - 1 : row + 2, 30:36] == 15.0).all()
    np.testing.assert_allclose(out.range[row - 1 : row + 2, 21], 10.5)  # not behind the wall: kept as drawn
    assert out.range[1, 58] == 30.0
    assert out.range[4, 40] == 0.0 and out.range[5, 40] == 0.0
    assert (out.range[row - 1 : row + 2, 46] == 15.0).all() and out.range[row, 45] == 2.0
    np.testing.assert_array_equal(out.range[view.mask], measured[view.mask])  # the measurement is untouched
    np.testing.assert_allclose(kept, unproject(out, sensor), atol=1e-4)  # points follow their rays


def test_an_observation_far_from_the_world_origin_keeps_its_points_to_a_tenth_of_a_millimetre(pipe, observed) -> None:
    scans, poses = observed
    far = poses[:1].copy()
    far[0, :3, 3] += [60_000.0, -40_000.0, 120.0]  # UTM-sized coordinates: float32 there is 4-8 mm coarse
    kept = measured_view(observation(scans[:1], far, pipe.sensor), far[0], pipe.sensor)
    index, pixels = grid_winners(scans[0], pipe.sensor)
    same = kept.mask.reshape(-1)[pixels]
    assert same.mean() > 0.99
    np.testing.assert_allclose(kept.points[pixels[same], :3], scans[0][index[same], :3], atol=1e-4)


def test_an_actor_box_in_front_of_a_measured_point_hides_it(pipe, observed) -> None:
    from inference.conditioning import LayoutView

    scans, poses = observed
    seen = observation(scans[:1], poses[:1], pipe.sensor)
    plain = measured_view(seen, poses[0], pipe.sensor)
    half = pipe.sensor.width // 2
    box = np.where(plain.mask, plain.image.range * 0.5, 0.0).astype(np.float32)  # an actor moved in front ...
    box[:, half:] = np.where(plain.mask, plain.image.range * 2.0, 0.0)[:, half:]  # ... and one behind the wall
    box[plain.misses & ~seen.shadow] = 5.0  # and actors on rays measured empty
    boxes = LayoutView(box, np.where(box > 0, 0, -1).astype(np.int64))
    kept = measured_view(seen, poses[0], pipe.sensor, boxes=boxes)
    assert plain.mask[:, :half].any() and not kept.mask[:, :half].any()
    np.testing.assert_array_equal(kept.image.range[:, half:], plain.image.range[:, half:])
    assert plain.misses[~seen.shadow].any() and not (kept.misses & ~seen.shadow).any()


KITTI00 = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00"


@pytest.fixture(scope="module")
def kitti_resimulated(pipe):
    """A shared KITTI 00 sweep and its native zero-shift re-simulation's frame."""
    if not KITTI00.is_dir():
        pytest.skip(f"shared KITTI 00 sweeps not found at {KITTI00}")
    return _zero_shift(pipe, sorted((KITTI00 / "velodyne").glob("*.bin"))[0])


@pytest.fixture(scope="module")
def nuscenes_resimulated(pipe):
    """The nuScenes example (an HDL-32E keeping 3,580 returns stored twice over, the car's own body) and its
    native zero-shift re-simulation's frame."""
    return _zero_shift(pipe, Path(__file__).resolve().parents[1] / "examples" / "scans"
                       / "nuscenes_ff9eff4389a740848f9a56ad749a4ae8_keyframe.pcd")


def _zero_shift(pipe, path: Path):
    from lidar.formats import read_points

    sweep = read_points(path)
    pose = np.eye(4)[None]
    return sweep, pipe.resimulate([sweep], pose, pose, steps=1, seed=0).frames[0]


def test_a_native_zero_shift_resimulation_of_a_kitti_sweep_keeps_every_measured_point(kitti_resimulated) -> None:
    sweep, frame = kitti_resimulated
    points = sweep.points[np.linalg.norm(sweep.points[:, :3], axis=1) > 0]
    assert frame.range_image.shape[0] == 64 and frame.range_image.shape[1] >= 1990  # the sweep's own geometry
    assert len(points) > 100_000
    # every measured point is in the frame where it was measured, with its intensity (float32 world trip)
    dist, _ = cKDTree(frame.points[:, :3]).query(points[:, :3])
    assert (dist < 1e-4).all(), f"{(dist >= 1e-4).sum()} of {len(points)} measured points lost"


@pytest.mark.parametrize("source", ["kitti_resimulated", "nuscenes_resimulated"])
def test_a_native_frame_written_without_a_ring_field_reads_back_on_its_beams(source, request, tmp_path) -> None:
    """A frame's points each carry the beam their ray lies on, and `write_rollout` stores them ring by ring, so a
    KITTI .bin of it reads back on the sweep's beams (from the points' order) and a PCD with the rings: a
    nuScenes frame too, whose returns stored twice step nowhere in azimuth."""
    from inference import RolloutResult, write_rollout
    from lidar.formats import read_points, sweep_geometry
    from lidar.range_image import nearest_beam_rows

    sweep, frame = request.getfixturevalue(source)
    grid = sweep_geometry(sweep).sensor
    assert (nearest_beam_rows(frame.points, grid) == frame.rings).mean() > 0.999
    result = RolloutResult([frame], frame.points, {"total": 1.0}, cache=None)
    for fmt in ("bin", "pcd"):
        write_rollout(tmp_path / fmt, result, fmt, sensor=grid)
        back = read_points(tmp_path / fmt / f"frame_000.{fmt}")
        geometry = sweep_geometry(back)
        assert geometry.sensor.height == grid.height and abs(geometry.sensor.width / grid.width - 1) < 0.02
        # the same points, each on its own beam (a point stored twice is one row of the sort either way)
        order = np.lexsort((frame.rings, *frame.points.T[::-1]))
        again = np.lexsort((geometry.rows, *back.points.T[::-1]))
        np.testing.assert_array_equal(back.points[again], frame.points[order])
        np.testing.assert_array_equal(geometry.rows[again], frame.rings[order])


def test_a_second_point_on_a_pixel_that_is_a_ray_of_its_own_is_kept_beside_the_grid(pipe) -> None:
    from inference.measured import beside_grid

    sensor = pipe.sensor
    elevation = sensor.elevations[sensor.height // 2]
    col = np.deg2rad(360.0 / sensor.width)
    azimuths = np.array([0.1, 0.9]) * col  # one pixel, two directions 0.8 pixel apart (> a fine ray cell)
    ranges = np.array([10.0, 10.3])
    scan = np.c_[ranges * np.cos(elevation) * np.cos(azimuths), ranges * np.cos(elevation) * np.sin(azimuths),
                 ranges * np.sin(elevation), np.full(2, 0.5)].astype(np.float32)
    poses = np.stack([np.eye(4), np.eye(4)])
    poses[1, 0, 3] = -5.0  # a second sweep taken elsewhere, which saw only a wall far behind
    elsewhere = np.array([[-40.0, 0.0, 0.0, 0.5]], np.float32)
    seen = observation([scan, elsewhere], poses, sensor)
    target = np.eye(4)
    target[0, 3] = 0.8  # a moved pose (towards the points), farther than SAME_EYES_M: no sweep was taken here
    view = measured_view(seen, target, sensor)
    ahead = np.linalg.norm(view.points[:, :3], axis=1) < 20
    assert (view.mask.reshape(-1) & ahead).sum() == 1  # both points fall on one pixel ...
    assert len(view.beside) == 1  # ... and the farther is a ray of its own
    both = np.concatenate([view.points[view.mask.reshape(-1) & ahead], view.beside])
    np.testing.assert_allclose(np.sort(np.linalg.norm(both[:, :3], axis=1)),
                               np.sort(np.linalg.norm(seen.seen_from(target)[:2, :3], axis=1)), rtol=1e-5)
    # a nearer point on the same fine ray hides it: one point per fine ray
    hidden = scan.copy()
    hidden[1, :3] = scan[0, :3] * 1.2
    view = measured_view(observation([hidden, elsewhere], poses, sensor), target, sensor)
    assert len(view.beside) == 0 and beside_grid(seen.points[:0], seen, target, sensor, view.mask.reshape(-1),
                                                 np.zeros(0, int)).shape == (0, 4)
    # from within SAME_EYES_M of the sweep, the pose sees with its eyes: both of its points are rays of their own
    near = np.eye(4)
    near[0, 3] = 0.3
    view = measured_view(observation([hidden, elsewhere], poses, sensor), near, sensor)
    assert len(view.beside) == 1


def test_a_point_a_nearer_surface_hides_from_a_moved_pose_is_not_kept_beside_the_grid(pipe) -> None:
    """One sweep alone, seen from 1 m on (within `ALONE_REACH_M`, beyond `HIDDEN_FROM_M`): of its points on
    one fine ray of the new pose, a second firing on the nearest one's surface stays; one metres behind goes."""
    from inference.measured import ALONE_REACH_M, HIDDEN_FROM_M

    sensor = pipe.sensor
    shift = 1.0
    assert HIDDEN_FROM_M < shift < ALONE_REACH_M
    elevation = sensor.elevations[sensor.height // 2]
    col = np.deg2rad(360.0 / sensor.width)
    azimuths = np.array([0.3, 0.3, 0.31]) * col  # one fine ray of the new pose
    ranges = np.array([9.0, 11.0, 9.03])  # the surface, a point 2 m behind it, a second firing on it
    target_frame = np.c_[ranges * np.cos(elevation) * np.cos(azimuths), ranges * np.cos(elevation) *
                         np.sin(azimuths), ranges * np.sin(elevation), np.full(3, 0.5)]
    scan = (target_frame + np.array([shift, 0.0, 0.0, 0.0])).astype(np.float32)  # as the sweep at the origin took them
    target = np.eye(4)
    target[0, 3] = shift
    view = measured_view(observation([scan], np.eye(4)[None], sensor), target, sensor)
    assert view.mask.sum() == 1  # all three on one pixel, won by the surface
    np.testing.assert_allclose(np.linalg.norm(view.beside[:, :3], axis=1), [9.03], rtol=1e-4)


def test_an_addition_where_an_observing_sensor_saw_through_goes(pipe) -> None:
    from dataclasses import replace

    from inference.measured import sight_through

    sensor = replace(pipe.sensor, max_range=120.0)  # a long-range sensor: its silence tells farther
    row = sensor.height // 2
    elevation = sensor.elevations[row]
    azimuths = np.deg2rad([0.0, 90.0, 180.0])
    wall = np.c_[30.0 * np.cos(elevation) * np.cos(azimuths), 30.0 * np.cos(elevation) * np.sin(azimuths),
                 np.full(3, 30.0 * np.sin(elevation)), np.zeros(3)].astype(np.float32)
    seen = observation([wall], np.eye(4)[None], sensor)
    view = measured_view(seen, np.eye(4), sensor)

    def on_ray(rng: float, azimuth: float) -> np.ndarray:
        a = np.deg2rad(azimuth)
        return np.array([rng * np.cos(elevation) * np.cos(a), rng * np.cos(elevation) * np.sin(a),
                         rng * np.sin(elevation), 0.0], np.float32)
    additions = np.stack([on_ray(10.0, 0.0),   # before the wall the sweep saw at 30 m: it saw through
                          on_ray(40.0, 90.0),  # behind the wall: hidden from it
                          on_ray(29.9, 180.0),  # on the wall, within the tolerance
                          on_ray(5.0, 45.0),  # a ray it returned nothing on: seen empty, near
                          on_ray(80.0, 45.0),  # and far along it, where the sky was
                          on_ray(130.0, 45.0)])  # beyond the sensor's reach: its silence tells nothing there
    np.testing.assert_array_equal(sight_through(additions, view), [True, False, False, True, True, False])


def test_near_the_observation_only_the_ground_around_the_car_is_added(pipe) -> None:
    from inference.measured import NEAR_GROUND_M, NEAR_ONLY_M, MeasuredView, settle_additions
    from lidar.range_image import RangeImage, unproject

    sensor = pipe.sensor
    ground_row = sensor.height - 2  # a low beam: its rays meet the ground near the car
    ground_range = sensor.mount_height / np.sin(-sensor.elevations[ground_row])
    assert ground_range < NEAR_GROUND_M
    measured = np.zeros(sensor.shape, np.float32)
    measured[ground_row, : sensor.width // 2] = ground_range  # measured ground on half the ring
    added = np.zeros(sensor.shape, np.float32)
    added[ground_row, sensor.width // 2 :] = ground_range  # the network's ground on the other half
    wall = slice(sensor.height // 2 - 2, sensor.height // 2 + 1)
    added[wall, 40:50] = NEAR_GROUND_M * 1.2  # and a wall of its own beyond the near ground
    image = RangeImage(np.maximum(measured, added), np.full(sensor.shape, 0.5, np.float32))
    points = unproject(image, sensor)
    measured_image = RangeImage(measured, np.full(sensor.shape, 0.5, np.float32))
    measured_points = np.zeros((measured.size, 4), np.float32)
    measured_points[measured_image.mask.reshape(-1)] = unproject(measured_image, sensor)

    def settled(baseline: float) -> RangeImage:
        view = MeasuredView(measured_image, measured_points, np.zeros(sensor.shape, bool),
                            np.zeros(sensor.shape, bool), np.zeros((0, 4), np.float32), baseline)
        return settle_additions(image, points, view)[0]

    near = settled(NEAR_ONLY_M / 2)
    assert (near.range[ground_row] > 0).all()  # the ground stays, measured and added
    assert (near.range[wall] == 0).all()  # the wall goes
    # a metre or more from every observing sensor the network fills what is silent, within the reach of the
    # measured misses too
    assert 2 * NEAR_ONLY_M < MISS_BASELINE_M
    far = settled(NEAR_ONLY_M * 2)
    assert (far.range[wall, 40:50] == added[wall, 40:50]).all()


def test_an_addition_on_a_fine_ray_a_measured_point_returns_on_goes(pipe) -> None:
    from inference.measured import MeasuredView, settle_additions
    from lidar.range_image import RangeImage, unproject
    from lidar.ray_grid import ray_cells
    from lidar.sensors import HDL64

    sensor = HDL64.with_width(1024)  # pixels finer than a wall's spread, so it is no lone return
    row, col = sensor.height // 2, 100
    measured = np.zeros(sensor.shape, np.float32)
    measured[row, col - 3 : col + 1] = 20.0
    measured_image = RangeImage(measured, np.full(sensor.shape, 0.5, np.float32))
    measured_points = np.zeros((measured.size, 4), np.float32)
    measured_points[measured_image.mask.reshape(-1)] = unproject(measured_image, sensor)
    added = np.zeros(sensor.shape, np.float32)
    added[row, col + 1 : col + 4] = 18.0  # the network's surface in front, beside the measured one
    image = RangeImage(np.maximum(measured, added), np.full(sensor.shape, 0.5, np.float32))
    points = unproject(image, sensor)
    # the measured ray: a point kept beside the grid on the first added pixel's fine ray
    beside = points[np.flatnonzero(image.mask.reshape(-1)) == row * sensor.width + col + 1] * [1.1, 1.1, 1.1, 1]
    view = MeasuredView(measured_image, measured_points, np.zeros(sensor.shape, bool), np.zeros(sensor.shape, bool),
                        beside.astype(np.float32), np.inf)
    out, kept = settle_additions(image, points, view)
    assert out.range[row, col + 1] == 0.0  # on the measured fine ray: gone
    assert ray_cells(beside)[0] not in ray_cells(kept[~view.mask[out.mask]])
    assert (out.range[row, col + 2 : col + 4] == 18.0).all()  # its own rays: kept
    np.testing.assert_array_equal(out.range[view.mask], measured[view.mask])


def test_a_far_addition_behind_a_kept_surface_near_its_ray_goes() -> None:
    from inference.measured import FAR_ADDITION_M, NEAR_GROUND_M, MeasuredView, settle_additions
    from lidar.range_image import RangeImage, unproject
    from lidar.sensors import HDL64

    sensor = HDL64.with_width(1024)  # 0.35 deg columns: 2 deg is about 6 of them
    rows, col = slice(30, 33), 200
    measured = np.zeros(sensor.shape, np.float32)
    measured[rows, col : col + 6] = 10.0  # a wall the observation kept
    measured_image = RangeImage(measured, np.full(sensor.shape, 0.5, np.float32))
    measured_points = np.zeros((measured.size, 4), np.float32)
    measured_points[measured_image.mask.reshape(-1)] = unproject(measured_image, sensor)
    added = np.zeros(sensor.shape, np.float32)
    added[rows, col + 8 : col + 10] = 40.0  # drawn through a gap beside the wall, 1-1.4 deg from it
    added[rows, col + 30 : col + 32] = 40.0  # far, but nothing measured within 2 deg
    added[rows, col - 4 : col - 2] = 15.0  # behind the wall's edge, but near
    image = RangeImage(np.maximum(measured, added), np.full(sensor.shape, 0.5, np.float32))
    view = MeasuredView(measured_image, measured_points, np.zeros(sensor.shape, bool), np.zeros(sensor.shape, bool),
                        np.zeros((0, 4), np.float32), np.inf)
    out = settle_additions(image, unproject(image, sensor), view)[0]
    assert 15.0 < FAR_ADDITION_M < 40.0
    assert NEAR_GROUND_M < FAR_ADDITION_M  # near an observing sensor the near-ground rule decides alone
    assert (out.range[rows, col + 8 : col + 10] == 0.0).all()
    assert (out.range[rows, col + 30 : col + 32] == 40.0).all()
    assert (out.range[rows, col - 4 : col - 2] == 15.0).all()
    np.testing.assert_array_equal(out.range[view.mask], measured[view.mask])
    # the car's own body is no surface: the same view with the wall as its body keeps the far additions
    body_view = MeasuredView(measured_image, measured_points, np.zeros(sensor.shape, bool), measured_image.mask,
                             np.zeros((0, 4), np.float32), np.inf)
    assert (settle_additions(image, unproject(image, sensor), body_view)[0].range[rows, col + 8 : col + 10]
            == 40.0).all()


def test_an_older_point_on_a_ray_the_own_sweep_measured_empty_is_stale(pipe) -> None:
    sensor = pipe.sensor
    row = sensor.height // 2
    elevation = sensor.elevations[row]
    step = 2 * np.pi / sensor.width

    def ring(columns: np.ndarray, distance: float) -> np.ndarray:
        az = np.pi - (columns + 0.5) * step  # column centres (azimuth +180 deg at column 0)
        return np.c_[distance * np.cos(elevation) * np.cos(az), distance * np.cos(elevation) * np.sin(az),
                     np.full(len(columns), distance * np.sin(elevation)), np.full(len(columns), 0.5)]

    cols = np.arange(20, 31)
    poses = np.stack([np.eye(4), np.eye(4)])
    poses[0, 0, 3] = -3.0  # the older sweep, 3 m back
    target = np.eye(4)
    target[0, 3] = 0.1  # just ahead of the newest sweep: its eyes
    # the rays as the target sees them, each sweep's points in its own frame
    newest = ring(cols[cols != 25], 12.0) + np.array([0.1, 0, 0, 0])  # silent on column 25, between its returns
    older = ring(np.array([25]), 10.0) + np.array([3.1, 0, 0, 0])  # an older, nearer copy there
    seen = observation([older.astype(np.float32), newest.astype(np.float32)], poses, sensor)
    view = measured_view(seen, target, sensor)
    assert not view.mask[row, 25] and view.misses[row, 25]
    assert view.mask[row, 24] and view.mask[row, 26]


def test_sweeps_on_their_beams_keep_beside_the_grid_only_points_on_the_new_poses_beams(pipe) -> None:
    """A simulated VLP-16 sweep (2 deg between beams) seen from 3 m on: its points beside the grid are those on a
    beam of the new pose (a KITTI sweep, whose points scatter about its rings, keeps them all: the test below)."""
    from dataclasses import replace

    from inference.measured import ON_BEAM_SHARE
    from lidar.range_image import beam_offsets
    from lidar.sensors import VLP16
    from lidar.sim.sensor_model import LidarSimulator

    world = make_world(4, "urban")
    pose = plan_drive(world, "straight", 1, seed=0, mount_height=VLP16.mount_height)[:1]
    scan = LidarSimulator(VLP16, seed=0).scan(world, pose[0]).points
    seen = observation([scan], pose, VLP16)
    assert seen.on_beams
    target = pose[0].copy()
    target[:3, 3] += 3.0 * pose[0][:3, 0]  # 3 m ahead: farther than ALONE_REACH_M from the sweep
    view = measured_view(seen, target, VLP16)
    everything = measured_view(replace(seen, on_beams=False), target, VLP16)
    assert len(view.beside) and (beam_offsets(view.beside, VLP16) <= ON_BEAM_SHARE).all()
    off = beam_offsets(everything.beside, VLP16) > ON_BEAM_SHARE
    assert off.sum() > len(view.beside)  # most of what a 2-deg fan would otherwise keep is on no ray of its own
    # the kept points beside the grid are those of the unfiltered view that lie on a beam
    np.testing.assert_array_equal(np.sort(view.beside, axis=0), np.sort(everything.beside[~off], axis=0))


@pytest.mark.skipif(not KITTI00.is_dir(), reason=f"shared KITTI 00 sweeps not found at {KITTI00}")
def test_a_kitti_sweep_scatters_about_its_rings_and_is_not_on_its_beams() -> None:
    from inference.measured import on_beams
    from lidar.formats import read_points
    from lidar.formats.detect import sweep_geometry

    kitti = read_points(sorted((KITTI00 / "velodyne").glob("*.bin"))[0])
    assert not on_beams([kitti.points], sweep_geometry(kitti).sensor)


def test_a_forecast_near_the_newest_sweep_drops_an_older_point_it_saw_past(pipe) -> None:
    sensor = pipe.sensor
    row = sensor.height // 2
    elevation = sensor.elevations[row]
    step = 2 * np.pi / sensor.width

    def ray(column: int, distance: float) -> np.ndarray:
        az = np.pi - (column + 0.5) * step  # the column's centre (azimuth +180 deg at column 0)
        return np.array([distance * np.cos(elevation) * np.cos(az), distance * np.cos(elevation) * np.sin(az),
                         distance * np.sin(elevation), 0.5])

    poses = np.stack([np.eye(4), np.eye(4)])
    poses[0, 0, 3] = -1.0  # the older sweep, 1 m back: its points are the newest frame's plus 1 m in x
    newest = np.stack([ray(c, 20.0) for c in range(20, 31)]).astype(np.float32)  # a wall 20 m out
    gone, wall = ray(25, 8.0), ray(27, 20.0)  # what stood 8 m out on column 25's ray; the same wall
    older = (np.stack([gone, wall]) + np.array([1.0, 0, 0, 0])).astype(np.float32)

    def kept_gone(times: np.ndarray | None, x: float) -> bool:
        """Whether a pose `x` m along the drive keeps the point at 8 m on its ray."""
        target = np.eye(4)
        target[0, 3] = x
        view = measured_view(observation([older, newest], poses, sensor, times=times), target, sensor)
        local = (gone - np.array([x, 0, 0, 0]))[None].astype(np.float32)
        pixel = project(local, sensor).mask
        return bool(np.abs(view.image.range[pixel] - np.linalg.norm(local[0, :3])).min() < 1e-3)

    forecast = np.array([-0.1, 0.0])
    seen = observation([older, newest], poses, sensor, times=forecast)
    assert seen.passed.tolist() == [True, False, *([False] * len(newest))]  # the wall's second firing stands
    assert len(seen.current.points) == len(seen.points) - 1
    # a forecast between the sweeps follows the newest, whose ray passed the place
    assert not kept_gone(forecast, -0.5)
    # a re-simulation renders every sweep's own moment; far from every sweep a forecast sees it anew
    assert kept_gone(None, -0.5) and kept_gone(forecast, -7.0)


def test_from_a_moved_pose_no_measured_point_outside_the_observing_sensors_fan_is_kept(pipe) -> None:
    """The ground a sweep saw a few metres ahead lies far below the lowest beam from a pose that moved onto
    it: no ray of the sensor has it there, so neither the grid nor the points beside it keep it. From where
    the sweep was taken every point of it stays."""
    from lidar.ray_grid import field_of_view

    sensor = pipe.sensor
    lowest, highest = sensor.elevations[-1], sensor.elevations[0]
    spacing = sensor.elevations[-2] - lowest
    azimuth = np.linspace(-np.pi, np.pi, 4 * sensor.width, endpoint=False)
    mount = sensor.mount_height

    def ring(elevation: float, distance: float) -> np.ndarray:
        return np.c_[distance * np.cos(azimuth), distance * np.sin(azimuth),
                     np.full(len(azimuth), distance * np.tan(elevation)), np.full(len(azimuth), 0.4)]

    ground = mount / np.tan(-lowest)  # the lowest beam's ring on the road
    scan = np.concatenate([ring(lowest, ground), ring(lowest + 0.3 * (highest - lowest), 15.0),
                           ring(highest, 30.0)]).astype(np.float32)
    seen = observation([scan], np.eye(4)[None], sensor)
    low, high = field_of_view((lowest, highest))
    assert seen.field_of_view[0] == pytest.approx(low, abs=1e-3) and seen.field_of_view[1] == pytest.approx(high, abs=1e-3)
    for shift in (1.0, 6.0):  # alone within ALONE_REACH_M of the sweep, and farther on
        target = np.eye(4)
        target[0, 3] = shift
        view = measured_view(seen, target, sensor)
        kept = np.concatenate([view.points[view.mask.reshape(-1)], view.beside])
        elevation = np.arctan2(kept[:, 2], np.hypot(kept[:, 0], kept[:, 1]))
        below = elevation < lowest - spacing - 1e-6  # the lowest row holds what lies within a spacing of its beam
        assert len(kept) > 100 and not below.any(), f"{below.sum()} below the fan"
        # the road behind the moved pose is still on the lowest beams' rays: kept
        assert (kept[:, 0] < -ground + shift - 0.5).sum() > 100
    same = measured_view(seen, np.eye(4), sensor)
    assert len(same.beside) + same.mask.sum() == len(scan)  # from where it was taken: the whole sweep

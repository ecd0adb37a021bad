"""What moved between registered sweeps (`lidar.motion`), and a forecast that carries it on."""

from __future__ import annotations

import numpy as np

from inference.measured import observation
from lidar.motion import align_translation, moving_objects
from lidar.sensors import get_sensor

SPEED = np.array([6.0, 0.5])  # m/s: a car pulling away, drifting left
TIMES = np.arange(3) * 0.1


def _box(centre: np.ndarray, size: tuple[float, float, float], rng: np.random.Generator, count: int) -> np.ndarray:
    """Points on the faces of an axis-aligned box standing on the ground (z = -1.7)."""
    half = np.array(size) / 2
    points = rng.uniform(-half, half, size=(count, 3))
    face = rng.integers(0, 2, size=count)
    axis = rng.integers(0, 2, size=count)  # the sides (x or y faces); the roof is not seen from a car
    points[np.arange(count), axis] = np.where(face == 1, half[axis], -half[axis])
    return points + np.array([centre[0], centre[1], -1.7 + half[2]])


def _sweeps() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three sweeps 0.1 s apart (world frame = the newest sensor's): ground, a parked van, a wall, and a car
    moving at `SPEED`; with each point's sweep and whether it is the car's."""
    rng = np.random.default_rng(0)
    clouds = []
    for t in TIMES - TIMES[-1]:
        ground = np.column_stack([rng.uniform(-30, 30, (6000, 2)), np.full(6000, -1.7)])
        parked = _box(np.array([-8.0, 4.0]), (5.0, 2.0, 2.2), rng, 800)
        wall = _box(np.array([0.0, -9.0]), (30.0, 0.3, 3.0), rng, 3000)
        car = _box(np.array([10.0, 0.0]) + SPEED * t, (4.5, 1.8, 1.5), rng, 900)
        clouds.append(np.concatenate([ground, parked, wall, car]))
    sweep = np.repeat(np.arange(3), [len(c) for c in clouds])
    is_car = np.concatenate([np.arange(len(c)) >= len(c) - 900 for c in clouds])
    return np.concatenate(clouds), sweep, is_car


def test_a_moving_car_gets_its_velocity_and_its_older_copies_are_stale() -> None:
    points, sweep, is_car = _sweeps()
    moving = moving_objects(points, sweep, TIMES, np.zeros(3))
    assert moving.objects.shape == (1, 3)
    np.testing.assert_allclose(moving.objects[0, :2], SPEED, atol=0.3)
    newest_car = (sweep == 2) & is_car & (points[:, 2] > -1.6)  # the car less its points on the ground
    assert np.abs(moving.velocity[newest_car, :2] - SPEED).max() < 0.3
    assert not moving.velocity[~(is_car & (sweep == 2))].any()  # the ground, the van, the wall, older sweeps
    older_car = (sweep < 2) & is_car & (points[:, 2] > -1.6)
    assert moving.stale[older_car].mean() > 0.9
    assert not moving.stale[~is_car | (sweep == 2)].any()


def test_one_sweep_or_nothing_moving_moves_nothing() -> None:
    points, sweep, is_car = _sweeps()
    still = ~is_car
    moving = moving_objects(points[still], sweep[still], TIMES, np.zeros(3))
    assert len(moving.objects) == 0 and not moving.stale.any() and not moving.velocity.any()
    alone = sweep == 2
    assert len(moving_objects(points[alone], np.zeros(alone.sum(), int), TIMES[:1], np.zeros(3)).objects) == 0


def test_align_translation_finds_a_shift_beyond_the_nearest_points() -> None:
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(1)
    source = _box(np.zeros(2), (4.5, 1.8, 1.5), rng, 500)[:, :2]
    shift, after, before = align_translation(source, cKDTree(source + np.array([1.8, 0.2])))
    np.testing.assert_allclose(shift, [1.8, 0.2], atol=0.05)
    assert after < 0.05 < before


def test_a_forecast_observation_carries_the_moving_car_on() -> None:
    points, sweep, is_car = _sweeps()
    scans = [np.column_stack([points[sweep == k], np.zeros((sweep == k).sum())]).astype(np.float32) for k in range(3)]
    poses = np.repeat(np.eye(4)[None], 3, axis=0)
    poses[:, 0, 3] = [0.0, 0.3, 0.6]  # the car we ride in creeps on; its sweeps are given in its own frames
    scans = [s - np.array([p[0, 3], 0, 0, 0], np.float32) for s, p in zip(scans, poses, strict=True)]
    sensor = get_sensor("hdl64")
    observed = observation(scans, poses, sensor, [np.zeros(len(s), bool) for s in scans], times=TIMES)
    assert observed.velocity is not None
    car = observed.velocity.any(axis=1)
    assert car.sum() >= 0.9 * (is_car & (sweep == 2)).sum() and (observed.sweep[car] == 2).all()
    assert len(observed.points) < len(points) - 0.9 * (is_car & (sweep < 2)).sum()  # the older copies are gone
    later = observed.seen_from(poses[-1], TIMES[-1] + 0.5)
    np.testing.assert_allclose(later[car, :2] - observed.points[car, :2], np.tile(SPEED * 0.5, (car.sum(), 1)),
                               atol=0.2)
    np.testing.assert_array_equal(later[~car], observed.points[~car])
    still = observation(scans, poses, sensor, [np.zeros(len(s), bool) for s in scans])  # a re-simulation
    assert still.velocity is None and len(still.points) == sum(len(s) for s in scans)


def test_the_prefix_clock_meets_the_frames_clock() -> None:
    from inference.pipeline import _prefix_clock

    stamps = np.array([1.3e9, 1.3e9 + 0.1, 1.3e9 + 0.2])  # a recording's own stamps, frames at 0.0, 0.1, ...
    np.testing.assert_allclose(_prefix_clock(3, stamps, 0.0, frame_clock=False), [-0.3, -0.2, -0.1], atol=1e-6)
    np.testing.assert_allclose(_prefix_clock(3, stamps, 5.0, frame_clock=True), stamps)  # one clock: as given
    np.testing.assert_allclose(_prefix_clock(2, None, 1.0, frame_clock=False), [0.8, 0.9])
    for stamps in ([0.0, 0.0, 0.1], [0.2, 0.1, 0.0]):  # times that do not increase measure no motion
        assert _prefix_clock(3, np.array(stamps), 0.2, frame_clock=True) is None

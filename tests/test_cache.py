"""The rolling spatial cache: one point per voxel (observed first, then newest), bounded in radius and count."""

import numpy as np
import pytest

from inference.cache import SpatialCache
from lidar.vocabulary import transform_points


def pose_at(x: float, y: float = 0.0, yaw: float = 0.0) -> np.ndarray:
    pose = np.eye(4)
    pose[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
    pose[:3, 3] = [x, y, 1.8]
    return pose


def test_points_in_the_same_voxel_collapse_to_the_newest_one():
    cache = SpatialCache(radius=100.0, voxel_size=0.5, max_points=100)
    cache.add(np.array([[1.1, 1.1, 0.1, 0.2], [5.0, 5.0, 0.0, 0.3]], dtype=np.float32), pose_at(0))
    cache.add(np.array([[1.2, 1.3, 0.2, 0.9]], dtype=np.float32), pose_at(0))
    pts = cache.points()
    assert len(cache) == 2
    np.testing.assert_allclose(pts[0], [1.2, 1.3, 0.2, 0.9], atol=1e-6)  # newest first, and it won its voxel
    np.testing.assert_allclose(pts[1], [5.0, 5.0, 0.0, 0.3], atol=1e-6)


def test_a_generated_point_never_replaces_an_observed_one_in_its_voxel():
    cache = SpatialCache(radius=100.0, voxel_size=0.5, max_points=100)
    cache.add(np.array([[1.1, 1.1, 0.1, 0.2]], dtype=np.float32), pose_at(0), observed=True)
    cache.add(np.array([[1.2, 1.3, 0.2, 0.9], [5.0, 5.0, 0.0, 0.3]], dtype=np.float32), pose_at(0))
    pts, observed = cache.points(), cache.observed()
    assert len(cache) == 2 and observed.tolist() == [False, True]  # newest first still
    np.testing.assert_allclose(pts[1], [1.1, 1.1, 0.1, 0.2], atol=1e-6)  # the measurement kept its voxel
    np.testing.assert_allclose(pts[0], [5.0, 5.0, 0.0, 0.3], atol=1e-6)  # a new voxel takes the guess
    # a newer observation replaces an older one, and the flags survive a state round trip
    cache.add(np.array([[1.3, 1.2, 0.0, 0.5]], dtype=np.float32), pose_at(0), observed=True)
    other = SpatialCache()
    other.load_state_dict(cache.state_dict())
    assert other.observed().tolist() == [True, False]
    np.testing.assert_allclose(other.points()[0], [1.3, 1.2, 0.0, 0.5], atol=1e-6)
    state = cache.state_dict()
    del state["observed"]  # saved before the flag existed: generated, as far as anyone knows
    other.load_state_dict(state)
    assert not other.observed().any() and len(other) == 2


def test_points_farther_than_the_radius_from_the_latest_pose_are_dropped():
    cache = SpatialCache(radius=10.0, voxel_size=0.1, max_points=100)
    cache.add(np.array([[0.0, 0.0, 0, 0], [9.0, 0.0, 0, 0], [20.0, 0.0, 0, 0]], dtype=np.float32), pose_at(0))
    assert sorted(cache.points()[:, 0].tolist()) == [0.0, 9.0]
    cache.add(np.zeros((0, 4), np.float32), pose_at(15.0))  # ego moved on: the origin point falls out
    assert cache.points()[:, 0].tolist() == [9.0]


def test_point_budget_keeps_the_nearest_points():
    cache = SpatialCache(radius=1000.0, voxel_size=0.1, max_points=3)
    xs = np.array([50.0, 1.0, 30.0, 2.0, 3.0, 40.0])
    cache.add(np.stack([xs, 0 * xs, 0 * xs, 0 * xs], axis=1).astype(np.float32), pose_at(0))
    assert sorted(cache.points()[:, 0].tolist()) == [1.0, 2.0, 3.0]


def test_nonfinite_points_never_enter_the_cache_and_bad_shapes_are_named():
    cache = SpatialCache()
    cache.add(np.array([[np.nan, 0, 0, 0], [1, 0, 0, 0]], dtype=np.float32))
    assert len(cache) == 1
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        cache.add(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="radius"):
        SpatialCache(radius=0)


def test_state_dict_round_trip_restores_points_and_radius_centre():
    cache = SpatialCache(radius=10.0, voxel_size=0.2, max_points=50)
    cache.add(np.array([[5.0, 0, 0, 0.1], [1.0, 1.0, 0, 0.2]], dtype=np.float32), pose_at(0))
    other = SpatialCache()
    other.load_state_dict(cache.state_dict())
    np.testing.assert_array_equal(other.points(), cache.points())
    other.add(np.zeros((0, 4), np.float32))  # same centre -> nothing dropped
    assert len(other) == 2 and other.radius == 10.0


def test_a_full_sweep_of_points_merges_fast_and_stays_bounded():
    rng = np.random.default_rng(0)
    cache = SpatialCache(radius=60.0, voxel_size=0.2, max_points=40_000)
    for i in range(10):
        pts = np.concatenate([rng.uniform(-80, 80, size=(16_384, 3)), rng.random((16_384, 1))], axis=1)
        cache.add(transform_points(pts.astype(np.float32), pose_at(i)), pose_at(i))
        assert len(cache) <= 40_000
    assert np.hypot(cache.points()[:, 0] - 9.0, cache.points()[:, 1]).max() <= 60.0


def test_a_cache_restored_from_its_state_merges_as_the_original_does():
    rng = np.random.default_rng(0)
    original = SpatialCache(radius=30.0, voxel_size=0.5, max_points=2_000)
    for i in range(3):  # observed and generated points, moving, over the budget
        original.add(np.column_stack([rng.normal(i, 10, (1_500, 3)), rng.random(1_500)]).astype(np.float32),
                     pose_at(2.0 * i), observed=i == 1)
    restored = SpatialCache()
    restored.load_state_dict(original.state_dict())
    more = np.column_stack([rng.normal(3, 10, (1_500, 3)), rng.random(1_500)]).astype(np.float32)
    for cache in (original, restored):
        cache.add(more, pose_at(6.0))
    assert np.array_equal(original.points(), restored.points())
    assert np.array_equal(original.observed(), restored.observed())
    # a coarser voxel merges the points already held on the new voxels
    original.voxel_size = restored.voxel_size = 2.0
    for cache in (original, restored):
        cache.add(more[:10], pose_at(6.0))
    fresh = SpatialCache(radius=30.0, voxel_size=2.0, max_points=2_000)
    fresh.load_state_dict({**restored.state_dict()})
    fresh.add(np.zeros((0, 4), np.float32), pose_at(6.0))
    assert np.array_equal(original.points(), restored.points()) and np.array_equal(original.points(), fresh.points())


def test_merging_matches_the_voxel_rule_point_by_point():
    """Observed before generated, then the newest, then the first of a sweep: checked against a plain loop over
    the points, newest sweep first, through adds of both kinds with many points sharing voxels."""
    rng = np.random.default_rng(3)
    cache = SpatialCache(radius=1e6, voxel_size=1.0, max_points=10**6)
    held: list[tuple[np.ndarray, bool]] = []  # the rule's winners, newest first
    for observed in (True, False, False, True, False):
        new = np.column_stack([rng.integers(-6, 6, (400, 3)) + rng.random((400, 3)), rng.random(400)])
        new = new.astype(np.float32)
        cache.add(new, observed=observed)
        candidates = [*((p, observed) for p in new), *held]
        winner: dict[tuple[int, ...], int] = {}
        for i, (point, obs) in enumerate(candidates):
            voxel = tuple(np.floor(point[:3].astype(np.float64)).astype(int))
            if voxel not in winner or (obs and not candidates[winner[voxel]][1]):
                winner[voxel] = i
        held = [candidates[i] for i in sorted(winner.values())]
        assert len(held) < len(candidates)
        np.testing.assert_array_equal(cache.points(), np.array([p for p, _ in held]))
        np.testing.assert_array_equal(cache.observed(), [o for _, o in held])

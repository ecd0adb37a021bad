"""The ground a sensor stands on but cannot see is put where that ground would be, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.spatial import cKDTree

from inference import load_pipeline
from inference.cache import SpatialCache
from inference.measured import measured_points
from inference.rollout import cache_from_scans
from lidar.blind_disc import EDGE_BIN_M, MAX_DISC_M, SECTORS, unseen_ground
from lidar.sensors import HDL64
from lidar.sequence import open_recording

MOUNT = 1.73
#: z = SLOPE_X x + SLOPE_Y y - MOUNT in the sensor frame: a road climbing ahead, cambered to the right.
SLOPE_X, SLOPE_Y = 0.02, -0.03


def _sweep(azimuth_deg: tuple[float, float] = (-180.0, 180.0), columns: int = 1024) -> np.ndarray:
    """An HDL-64E's rays (N, 4) meeting the sloped ground plane within 60 m, over an azimuth span."""
    elevation = np.asarray(HDL64.elevations)[:, None]
    azimuth = np.deg2rad(np.linspace(*azimuth_deg, columns, endpoint=False))[None, :]
    direction = np.stack(np.broadcast_arrays(np.cos(elevation) * np.cos(azimuth),
                                             np.cos(elevation) * np.sin(azimuth), np.sin(elevation)), -1)
    direction = direction.reshape(-1, 3)
    # the ray t * d meets z = a x + b y - h where t (d_z - a d_x - b d_y) = -h
    t = -MOUNT / (direction[:, 2] - SLOPE_X * direction[:, 0] - SLOPE_Y * direction[:, 1])
    hit = (t > 0) & (t < 60.0)
    points = direction[hit] * t[hit, None]
    return np.c_[points, np.full(len(points), 0.3)].astype(np.float32)


def _distance(points: np.ndarray) -> np.ndarray:
    return np.hypot(points[:, 0], points[:, 1])


def _sector(points: np.ndarray) -> np.ndarray:
    return ((np.arctan2(points[:, 1], points[:, 0]) + np.pi) * SECTORS / (2 * np.pi)).astype(int) % SECTORS


def test_the_blind_disc_is_covered_on_the_ground_plane_up_to_where_the_sweep_sees_ground() -> None:
    sweep = _sweep()
    disc = unseen_ground(sweep)
    nearest = _distance(sweep).min()  # the lowest beam's ring: where the sensor starts to see the ground
    assert 3.0 < nearest < 5.0 and len(disc) > 1000
    # on the plane the sweep saw, to the centimetre, with the ground's intensity
    np.testing.assert_allclose(disc[:, 2], SLOPE_X * disc[:, 0] + SLOPE_Y * disc[:, 1] - MOUNT, atol=0.01)
    np.testing.assert_allclose(disc[:, 3], 0.3)
    # inside the disc, sector by sector, and nothing where the sweep itself returns
    for s in range(SECTORS):
        own = _sector(sweep) == s
        assert (_distance(disc[_sector(disc) == s]) <= _distance(sweep[own]).min() + EDGE_BIN_M).all()
    # every 0.2 m cell of the inner disc holds a point: no holes left in the road
    held = np.unique(np.floor(disc[:, :2] / 0.2).astype(int), axis=0)
    span = np.arange(-int(nearest / 0.2) - 1, int(nearest / 0.2) + 1)
    cells = np.stack(np.meshgrid(span, span), -1).reshape(-1, 2)
    inner = cells[np.hypot(*((cells + 0.5) * 0.2).T) < 0.9 * nearest]
    missing = ~(inner[:, None] == held[None]).all(-1).any(1)
    assert len(inner) > 500 and missing.mean() <= 0.01


def test_a_sector_shadowed_beyond_the_disc_stops_at_the_median_edge_and_a_cropped_one_gets_nothing() -> None:
    sweep = _sweep()
    azimuth = np.degrees(np.arctan2(sweep[:, 1], sweep[:, 0]))
    # a van parked alongside on the left hides the ground out to 8 m there
    shadowed = (azimuth > 60) & (azimuth < 120) & (_distance(sweep) < 8.0)
    disc = unseen_ground(sweep[~shadowed])
    side = np.degrees(np.arctan2(disc[:, 1], disc[:, 0]))
    under_van = disc[(side > 70) & (side < 110)]
    assert len(under_van) and _distance(under_van).max() < _distance(sweep).min() * 1.2
    # a sweep cropped to a camera's view ahead shows no ground elsewhere: nothing is put there
    ahead = unseen_ground(_sweep((-40.0, 40.0)))
    assert len(ahead) and (np.abs(np.degrees(np.arctan2(ahead[:, 1], ahead[:, 0]))) <= 50.0).all()


def test_a_sweep_without_ground_near_it_gets_nothing_and_a_bad_array_is_refused() -> None:
    rng = np.random.default_rng(0)
    sky = rng.normal(size=(5000, 4)).astype(np.float32)
    sky[:, :3] *= 30.0 / np.linalg.norm(sky[:, :3], axis=1, keepdims=True)  # a sphere 30 m away: no ground near
    assert unseen_ground(sky).shape == (0, 4)
    assert unseen_ground(np.zeros((0, 4), np.float32)).shape == (0, 4)
    far = _sweep()
    far = far[_distance(far) > MAX_DISC_M + 1.0]  # ground only beyond any disc: something stood all round
    assert unseen_ground(far).shape == (0, 4)
    with pytest.raises(ValueError, match=r"\(N, 3\+\)"):
        unseen_ground(np.zeros((10, 2)))


def test_the_cache_holds_the_disc_as_generated_so_a_measured_point_wins_its_voxel() -> None:
    sweep = _sweep()
    pose = np.eye(4)
    pose[:3, 3] = [100.0, -20.0, 5.0]
    x, y = 2.05, 0.55  # a measured return on the ground inside the disc, in the middle of its voxel
    seen = np.array([[x, y, SLOPE_X * x + SLOPE_Y * y - MOUNT, 0.9]], np.float32)
    scan = np.concatenate([sweep, seen])
    cache = cache_from_scans([scan], pose[None])
    points, observed = cache.points(), cache.observed()
    local = points[:, :3] - pose[:3, 3]
    inside = np.hypot(local[:, 0], local[:, 1]) < 0.9 * _distance(sweep).min()
    assert inside.sum() > 300 and observed[inside].sum() == 1  # the disc is generated, but for the measurement
    voxel = np.all(np.floor(local / cache.voxel_size) == np.floor(seen[0, :3] / cache.voxel_size), axis=1)
    assert voxel.sum() == 1 and observed[voxel].all() and points[voxel, 3] == pytest.approx(0.9)
    # every voxel a measured point fell in keeps a measured point
    measured = SpatialCache()
    measured.add(measured_points([scan], pose[None]), pose, observed=True)
    assert observed.sum() == len(measured)


KITTI00 = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00"


@pytest.mark.skipif(not KITTI00.is_dir(), reason=f"shared KITTI 00 sweeps not found at {KITTI00}")
def test_a_forecast_a_second_on_returns_the_road_where_the_observing_sensors_stood() -> None:
    """The shipped model on KITTI 00, three sweeps observed, 1.0 s ahead: the sweeps' blind discs, 8-10 m
    behind the car by then, hold most of the ground the sensor really took there (a quarter without them)."""
    pipe = load_pipeline()
    rec = open_recording(KITTI00)
    observed, target = [0, 1, 2], 12
    result = pipe.forecast([rec.sweep(i) for i in observed], prefix_poses=rec.poses[observed],
                           prefix_times=(np.array(observed) - observed[-1]) / 10.0, poses=rec.poses[[target]],
                           times=np.array([(target - observed[-1]) / 10.0]), steps=2, seed=0)
    stood = (np.linalg.inv(rec.poses[target]) @ rec.poses[observed])[:, :2, 3]  # the sensors, in the target's frame

    def in_discs(points: np.ndarray) -> np.ndarray:
        apart = np.linalg.norm(points[:, None, :2] - stood[None], axis=-1).min(axis=1)
        return points[(apart < 3.3) & (_distance(points) > 3.5)]

    truth, forecast = in_discs(rec.sweep(target).points), in_discs(result.frames[0].points)
    assert len(truth) > 2000
    assert len(forecast) >= 0.6 * len(truth)
    # on the road: within 15 cm of the nearest true return there
    gap, _ = cKDTree(truth[:, :3]).query(forecast[:, :3])
    assert np.median(gap) < 0.15

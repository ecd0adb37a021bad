"""The condition the world model sees: cache, map and coordinate channels in the new sensor's range view."""

import numpy as np
import pytest
import torch

from inference.cache import transform_points
from inference.conditioning import (
    CACHE_CHANNELS,
    augment_cache_points,
    build_condition,
    condition_channels,
    decode_image,
    drop_map,
    encode_image,
)
from inference.network import WorldModelConfig
from lidar.range_image import RangeImage, encode_range, project
from lidar.sensors import HDL32
from lidar.sim.hdmap import MAP_CLASSES

SENSOR = HDL32.with_width(512)
K = len(MAP_CLASSES)


def pose_at(x: float, yaw: float = 0.0) -> np.ndarray:
    pose = np.eye(4)
    pose[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
    pose[:3, 3] = [x, 0.0, 1.84]
    return pose


def test_channel_count_matches_the_model_config():
    cond = build_condition(None, np.eye(4), None, SENSOR)
    assert cond.shape == (condition_channels(K), 32, 512) == (WorldModelConfig().cond_channels, 32, 512)
    assert cond.dtype == torch.float32


def test_a_cached_point_straight_ahead_of_the_new_pose_lands_in_the_centre_column():
    pose = pose_at(5.0, yaw=np.pi / 2)  # facing +y in the world
    world_point = transform_points(np.array([[10.0, 0.0, 0.0, 0.5]], np.float32), pose)
    cond = build_condition(world_point, pose, None, SENSOR)
    rows, cols = torch.nonzero(cond[2], as_tuple=True)
    assert cols.tolist() == [256]
    assert rows.tolist() == [int(np.argmin(np.abs(SENSOR.elevations_deg)))]
    r, c = rows[0], cols[0]
    assert cond[0, r, c].item() == pytest.approx(
        float(encode_range(np.float32(10.0), SENSOR.max_range)), abs=1e-5
    )
    assert cond[1, r, c].item() == pytest.approx(0.0, abs=1e-6)  # intensity 0.5 -> 0
    assert (cond[:2][cond[2].expand(2, -1, -1) == 0] == -1).all()


def test_empty_cache_gives_minus_one_range_and_intensity_and_zero_mask():
    cond = build_condition(np.zeros((0, 4), np.float32), np.eye(4), None, SENSOR)
    assert (cond[:2] == -1).all() and (cond[2] == 0).all()
    assert torch.equal(cond, build_condition(None, np.eye(4), None, SENSOR))


def test_map_classes_become_a_one_hot_and_a_dropped_map_zeroes_all_map_channels():
    classes = np.random.default_rng(0).integers(0, K, size=SENSOR.shape).astype(np.uint8)
    cond = build_condition(None, np.eye(4), classes, SENSOR)
    onehot = cond[CACHE_CHANNELS : CACHE_CHANNELS + K]
    assert torch.equal(onehot.argmax(0), torch.from_numpy(classes.astype(np.int64)))
    assert (onehot.sum(0) == 1).all() and (cond[CACHE_CHANNELS + K] == 1).all()
    dropped = build_condition(None, np.eye(4), None, SENSOR)
    assert (dropped[CACHE_CHANNELS : CACHE_CHANNELS + K + 1] == 0).all()
    assert torch.equal(drop_map(cond), dropped)
    assert torch.equal(drop_map(cond[None])[0], dropped)  # batched too
    assert torch.equal(cond[-3:], dropped[-3:])  # coordinates never depend on inputs


def test_coordinate_channels_give_beam_elevation_and_azimuth():
    cond = build_condition(None, np.eye(4), None, SENSOR)
    elev, sin_az, cos_az = cond[-3], cond[-2], cond[-1]
    assert elev[0, 0] > elev[-1, 0] and torch.equal(elev[:, 0], elev[:, 100])
    assert cos_az[0, 256] == pytest.approx(1.0, abs=1e-3) and cos_az[0, 0] == pytest.approx(-1.0, abs=1e-3)
    assert sin_az[0, 128] == pytest.approx(1.0, abs=1e-3)  # column W/4 looks left (+y)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="map_classes"):
        build_condition(None, np.eye(4), np.zeros((4, 4), np.uint8), SENSOR)
    with pytest.raises(ValueError, match="map classes must be in"):
        build_condition(None, np.eye(4), np.full(SENSOR.shape, K, np.uint8), SENSOR)
    with pytest.raises(ValueError, match="pose"):
        build_condition(None, np.eye(3), None, SENSOR)
    with pytest.raises(ValueError, match="cache points"):
        build_condition(np.zeros((5, 3)), np.eye(4), None, SENSOR)


def test_encode_decode_image_round_trips_returns_and_drops():
    rng = np.random.default_rng(1)
    r = rng.uniform(2, 90, SENSOR.shape).astype(np.float32)
    r[rng.random(SENSOR.shape) < 0.3] = 0.0
    inten = np.where(r > 0, rng.random(SENSOR.shape), 0).astype(np.float32)
    x = encode_image(RangeImage(r, inten), SENSOR)
    assert x.shape == (2, 32, 512) and x.min() >= -1 and x.max() <= 1
    back = decode_image(torch.from_numpy(x), SENSOR)
    np.testing.assert_array_equal(back.mask, r > 0)
    np.testing.assert_allclose(back.range, r, rtol=1e-4)
    np.testing.assert_allclose(back.intensity, inten, atol=1e-6)


def test_augmentation_is_seeded_drops_points_and_moves_them_only_slightly():
    pts = transform_points(
        np.concatenate(
            [np.random.default_rng(2).uniform(-30, 30, (5000, 3)), np.full((5000, 1), 0.5)], 1
        ).astype(np.float32),
        pose_at(3.0),
    )
    a = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), dropout=0.2)
    b = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), dropout=0.2)
    c = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(6), dropout=0.2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert 0.75 * len(pts) < len(a) < 0.85 * len(pts)
    none = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), 0.0, 0.0, 0.0, 0.0)
    np.testing.assert_allclose(none, pts, atol=1e-4)
    moved = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), 0.0)
    shift = np.linalg.norm(moved[:, :3] - pts[:, :3], axis=1)
    assert 0 < np.median(shift) < 1.0


def test_condition_from_a_projected_scan_reproduces_that_scan_in_the_cache_channels():
    rng = np.random.default_rng(3)
    dirs = SENSOR.ray_directions()
    r = rng.uniform(5, 50, SENSOR.shape)
    pts = np.concatenate([(dirs * r[..., None]).reshape(-1, 3), np.full((r.size, 1), 0.25)], 1).astype(
        np.float32
    )
    pose = pose_at(7.0, yaw=0.3)
    cond = build_condition(transform_points(pts, pose), pose, None, SENSOR)
    expected = encode_image(project(pts, SENSOR), SENSOR)
    np.testing.assert_allclose(cond[:2].numpy(), expected, atol=1e-4)
    assert cond[2].mean() > 0.99

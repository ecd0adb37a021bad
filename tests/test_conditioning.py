"""The condition the world model sees: cache, map, layout and coordinate blocks in the new sensor's range view,
and the prior the network corrects."""

import numpy as np
import pytest
import torch

from inference.conditioning import (
    BUILDING_RANGE,
    CACHE_FOOTPRINT,
    CACHE_INTENSITY,
    CACHE_MASK,
    CACHE_RANGE,
    GROUND_RANGE,
    LAYOUT_CLASSES,
    VEGETATION_RANGE,
    ConditionLayout,
    LayoutView,
    augment_cache_points,
    augment_layout,
    build_condition,
    condition_channels,
    decode_image,
    drop_map,
    empty_condition,
    encode_image,
    layout_view,
    prior_image,
)
from inference.network import WorldModelConfig
from lidar.range_image import RangeImage, encode_range, project
from lidar.sensors import HDL32
from lidar.vocabulary import MAP_CLASSES, OBJECT_CLASSES, MapView, transform_points

SENSOR = HDL32.with_width(512)
K = len(MAP_CLASSES)
LAY = ConditionLayout(K)


def pose_at(x: float, yaw: float = 0.0) -> np.ndarray:
    pose = np.eye(4)
    pose[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
    pose[:3, 3] = [x, 0.0, 1.84]
    return pose


def enc(range_m) -> np.ndarray:
    return encode_range(np.asarray(range_m, dtype=np.float32), SENSOR.max_range)


def random_map_view(seed: int = 0) -> MapView:
    """Classes and ranges that differ per pixel, with each layer missing (0 m) somewhere."""
    rng = np.random.default_rng(seed)

    def layer(p_miss: float) -> np.ndarray:
        r = rng.uniform(2.0, 90.0, SENSOR.shape).astype(np.float32)
        return np.where(rng.random(SENSOR.shape) < p_miss, 0.0, r).astype(np.float32)

    return MapView(
        classes=rng.integers(0, K, size=SENSOR.shape).astype(np.uint8),
        ground=layer(0.3),
        building=layer(0.7),
        vegetation=layer(0.8),
    )


def constant_map_view(ground: float = 0.0, building: float = 0.0, vegetation: float = 0.0) -> MapView:
    full = lambda v: np.full(SENSOR.shape, v, np.float32)  # noqa: E731
    return MapView(np.ones(SENSOR.shape, np.uint8), full(ground), full(building), full(vegetation))


def constant_layout(range_m: float, layout_class: int = 0) -> LayoutView:
    hit = range_m > 0
    return LayoutView(
        np.full(SENSOR.shape, range_m, np.float32), np.full(SENSOR.shape, layout_class if hit else -1, np.int64)
    )


def wall_cache(range_m: float, pose: np.ndarray) -> np.ndarray:
    """World points that fill every pixel of the sensor at `pose` at `range_m`."""
    pts = (SENSOR.ray_directions() * range_m).reshape(-1, 3)
    return transform_points(np.concatenate([pts, np.full((len(pts), 1), 0.5)], 1).astype(np.float32), pose)


def test_channel_count_matches_the_model_config_and_the_layout_blocks_tile_it():
    cond = build_condition(None, np.eye(4), None, None, SENSOR)
    assert cond.shape == (condition_channels(K), 32, 512) == (WorldModelConfig().cond_channels, 32, 512)
    assert cond.dtype == torch.float32
    # cache | map | layout | coords, back to back and covering every channel
    assert LAY.map_block.start == CACHE_MASK + 1
    assert LAY.map_block.stop == LAY.layout_start == LAY.box_range
    assert LAY.coords_start == LAY.channels - 3
    assert LAY.map_classes.stop - LAY.map_classes.start == K
    assert LAY.coords_start - LAY.box_range == 1 + len(LAYOUT_CLASSES) + 1


def test_a_cached_point_straight_ahead_of_the_new_pose_lands_in_the_centre_column():
    pose = pose_at(5.0, yaw=np.pi / 2)  # facing +y in the world
    world_point = transform_points(np.array([[10.0, 0.0, 0.0, 0.5]], np.float32), pose)
    cond = build_condition(world_point, pose, None, None, SENSOR)
    rows, cols = torch.nonzero(cond[CACHE_MASK], as_tuple=True)
    assert cols.tolist() == [256]
    assert rows.tolist() == [int(np.argmin(np.abs(SENSOR.elevations_deg)))]
    r, c = rows[0], cols[0]
    assert cond[CACHE_RANGE, r, c].item() == pytest.approx(float(enc(10.0)), abs=1e-5)
    assert cond[CACHE_INTENSITY, r, c].item() == pytest.approx(0.0, abs=1e-6)  # intensity 0.5 -> 0
    assert (cond[:2][cond[CACHE_MASK].expand(2, -1, -1) == 0] == -1).all()


def test_nothing_known_is_the_empty_condition_with_minus_one_ranges_and_zero_flags():
    cond = build_condition(np.zeros((0, 4), np.float32), np.eye(4), None, None, SENSOR)
    assert torch.equal(cond, build_condition(None, np.eye(4), None, None, SENSOR))
    empty = torch.from_numpy(empty_condition(SENSOR))
    assert torch.equal(cond, empty)
    for channel in (CACHE_RANGE, CACHE_INTENSITY, GROUND_RANGE, BUILDING_RANGE, VEGETATION_RANGE, LAY.box_range):
        assert (empty[channel] == -1).all(), channel
    assert (empty[CACHE_MASK] == 0).all()
    assert (empty[LAY.map_classes.start : LAY.layout_start] == 0).all()  # class one-hot and map flag
    assert (empty[LAY.box_range + 1 : LAY.coords_start] == 0).all()  # class one-hot and layout flag


def test_the_map_block_holds_encoded_ground_building_vegetation_ranges_a_class_one_hot_and_a_flag():
    view = random_map_view()
    cond = build_condition(None, np.eye(4), view, None, SENSOR)
    for channel, ranges in ((GROUND_RANGE, view.ground), (BUILDING_RANGE, view.building),
                            (VEGETATION_RANGE, view.vegetation)):
        np.testing.assert_allclose(cond[channel].numpy(), enc(ranges), atol=1e-6)
        assert (cond[channel].numpy()[ranges == 0] == -1).all()  # a layer not hit reads as nothing there
    onehot = cond[LAY.map_classes]
    assert torch.equal(onehot.argmax(0), torch.from_numpy(view.classes.astype(np.int64)))
    assert (onehot.sum(0) == 1).all() and (cond[LAY.layout_start - 1] == 1).all()
    # the other blocks are untouched by the map
    empty = torch.from_numpy(empty_condition(SENSOR))
    assert torch.equal(cond[: LAY.map_block.start], empty[: LAY.map_block.start])
    assert torch.equal(cond[LAY.layout_start :], empty[LAY.layout_start :])


def test_a_dropped_map_or_layout_block_equals_the_empty_conditions_values():
    pose = pose_at(3.0)
    cache = wall_cache(12.0, pose)
    full = build_condition(cache, pose, random_map_view(), constant_layout(7.0, 2), SENSOR)
    no_map = build_condition(cache, pose, None, constant_layout(7.0, 2), SENSOR)
    no_layout = build_condition(cache, pose, random_map_view(), None, SENSOR)
    empty = torch.from_numpy(empty_condition(SENSOR))
    layout = slice(LAY.layout_start, LAY.coords_start)
    assert torch.equal(no_map[LAY.map_block], empty[LAY.map_block])
    assert torch.equal(no_layout[layout], empty[layout])
    assert not torch.equal(full[LAY.map_block], empty[LAY.map_block])
    assert not torch.equal(full[layout], empty[layout])
    # dropping one block leaves the others as they were
    outside_map = torch.cat([full[: LAY.map_block.start], full[LAY.map_block.stop :]])
    assert torch.equal(outside_map, torch.cat([no_map[: LAY.map_block.start], no_map[LAY.map_block.stop :]]))
    assert torch.equal(full[: LAY.layout_start], no_layout[: LAY.layout_start])


def test_drop_map_equals_building_the_condition_without_a_map():
    pose = pose_at(3.0, yaw=0.4)
    cache = wall_cache(20.0, pose)
    layout = constant_layout(9.0, 1)
    cond = build_condition(cache, pose, random_map_view(1), layout, SENSOR)
    without = build_condition(cache, pose, None, layout, SENSOR)
    assert torch.equal(drop_map(cond), without)
    assert torch.equal(drop_map(cond[None])[0], without)  # batched too
    assert torch.equal(drop_map(without), without)
    assert not torch.equal(cond, without)


def test_the_layout_class_one_hot_matches_each_boxs_class():
    car, pedestrian = OBJECT_CLASSES.index("car"), OBJECT_CLASSES.index("pedestrian")
    boxes = np.array([
        [12.0, 0.0, 0.0, 4.5, 1.9, 1.6, 0.0],  # a car ahead
        [0.0, 8.0, -0.9, 0.6, 0.6, 1.8, 0.0],  # a pedestrian on the left
    ])
    view = layout_view(boxes, np.array([car, pedestrian]), np.eye(4), SENSOR)
    cond = build_condition(None, np.eye(4), None, view, SENSOR)
    onehot = cond[LAY.box_range + 1 : LAY.coords_start - 1]
    assert onehot.shape[0] == len(LAYOUT_CLASSES)
    hit = view.range > 0
    assert (view.classes >= 0).sum() == hit.sum() > 0
    assert torch.equal(onehot.sum(0), torch.from_numpy(hit.astype(np.float32)))
    cols = np.nonzero(hit)[1]
    ahead, left = hit & (np.abs(np.arange(512) - 256) < 40), hit & (np.abs(np.arange(512) - 128) < 40)
    assert ahead.any() and left.any() and (ahead | left).sum() == len(cols)
    assert (onehot[LAYOUT_CLASSES.index("car")].numpy()[ahead] == 1).all()
    assert (onehot[LAYOUT_CLASSES.index("pedestrian")].numpy()[left] == 1).all()
    assert onehot.sum().item() == hit.sum()
    np.testing.assert_allclose(cond[LAY.box_range].numpy(), enc(view.range), atol=1e-6)
    assert (cond[LAY.coords_start - 1] == 1).all()  # layout present, even where no box is seen


def test_layout_boxes_and_classes_must_pair_up_and_index_object_classes():
    box = np.array([[10.0, 0.0, 0.0, 4.0, 2.0, 1.5, 0.0]])
    with pytest.raises(ValueError, match="box classes"):
        layout_view(box, np.array([0, 1]), np.eye(4), SENSOR)
    with pytest.raises(ValueError, match="OBJECT_CLASSES"):
        layout_view(box, np.array([len(OBJECT_CLASSES)]), np.eye(4), SENSOR)
    empty = layout_view(np.zeros((0, 7)), np.zeros(0, np.int16), np.eye(4), SENSOR)
    assert (empty.range == 0).all() and (empty.classes == -1).all()


def test_prior_is_the_cache_where_it_returns_even_if_the_map_is_nearer():
    pose = np.eye(4)
    cond = build_condition(wall_cache(30.0, pose), pose, constant_map_view(ground=5.0, building=8.0), None, SENSOR)
    prior, returns = prior_image(cond[None])
    cached = cond[CACHE_MASK] > 0.5
    assert cached.float().mean() > 0.99
    assert returns[0][cached].all()
    assert torch.equal(prior[0][cached], cond[CACHE_RANGE][cached])


def test_a_cached_return_on_the_maps_surface_takes_the_maps_exact_range_and_one_off_it_keeps_its_own():
    pose = np.eye(4)
    cache = wall_cache(20.0, pose)
    on = build_condition(cache, pose, constant_map_view(ground=20.5), None, SENSOR)
    off = build_condition(cache, pose, constant_map_view(ground=30.0), None, SENSOR)
    cached = (on[CACHE_MASK] > 0.5)[None]
    p_on, r_on = prior_image(on[None])
    p_off, _ = prior_image(off[None])
    assert r_on[cached].all()
    torch.testing.assert_close(p_on[cached], torch.full_like(p_on[cached], float(enc(20.5))))
    assert torch.equal(p_off[cached], off[CACHE_RANGE][None][cached])


def test_prior_without_cache_is_the_nearest_of_ground_and_building_and_ignores_vegetation():
    view = random_map_view(2)
    cond = build_condition(None, np.eye(4), view, None, SENSOR)
    prior, returns = prior_image(cond[None])
    g = np.where(view.ground > 0, view.ground, np.inf)
    b = np.where(view.building > 0, view.building, np.inf)
    nearest = np.minimum(g, b)
    np.testing.assert_array_equal(returns[0].numpy(), np.isfinite(nearest))
    known = np.isfinite(nearest)
    np.testing.assert_allclose(prior[0].numpy()[known], enc(nearest[known]), atol=1e-6)
    assert (prior[0].numpy()[~known] == -1).all()
    veg_only = build_condition(None, np.eye(4), constant_map_view(vegetation=6.0), None, SENSOR)
    assert not prior_image(veg_only[None])[1].any()  # the map knows where trees grow, not where they stand


def test_a_box_in_front_of_the_cache_wins_the_prior_and_one_behind_it_does_not():
    pose = np.eye(4)
    cache = wall_cache(20.0, pose)
    front = build_condition(cache, pose, constant_map_view(ground=25.0), constant_layout(6.0), SENSOR)
    behind = build_condition(cache, pose, constant_map_view(ground=25.0), constant_layout(40.0), SENSOR)
    cached = (front[CACHE_MASK] > 0.5)[None]
    p_front, r_front = prior_image(front[None])
    p_behind, _ = prior_image(behind[None])
    assert r_front.all()
    torch.testing.assert_close(p_front[cached], torch.full_like(p_front[cached], float(enc(6.0))))
    assert torch.equal(p_behind[cached], behind[CACHE_RANGE][None][cached])
    # a box in front of the map's ground wins too
    no_cache = build_condition(None, pose, constant_map_view(ground=25.0), constant_layout(6.0), SENSOR)
    torch.testing.assert_close(prior_image(no_cache[None])[0], torch.full((1, *SENSOR.shape), float(enc(6.0))))


def test_with_nothing_known_the_prior_returns_nowhere():
    prior, returns = prior_image(torch.from_numpy(empty_condition(SENSOR))[None])
    assert not returns.any() and (prior == -1).all()
    dropped = build_condition(None, np.eye(4), None, constant_layout(0.0), SENSOR)  # a layout with no box seen
    assert not prior_image(dropped[None])[1].any()


def test_coordinate_channels_give_beam_elevation_and_azimuth():
    cond = build_condition(None, np.eye(4), None, None, SENSOR)
    elev, sin_az, cos_az = cond[-3], cond[-2], cond[-1]
    assert elev[0, 0] > elev[-1, 0] and torch.equal(elev[:, 0], elev[:, 100])
    assert cos_az[0, 256] == pytest.approx(1.0, abs=1e-3) and cos_az[0, 0] == pytest.approx(-1.0, abs=1e-3)
    assert sin_az[0, 128] == pytest.approx(1.0, abs=1e-3)  # column W/4 looks left (+y)


def test_bad_inputs_are_named():
    good = random_map_view()
    small = MapView(np.zeros((4, 4), np.uint8), good.ground, good.building, good.vegetation)
    with pytest.raises(ValueError, match=r"map_view\.classes"):
        build_condition(None, np.eye(4), small, None, SENSOR)
    with pytest.raises(ValueError, match=r"map_view\.building"):
        build_condition(None, np.eye(4), MapView(good.classes, good.ground, np.zeros(3), good.vegetation), None,
                        SENSOR)
    bad_classes = MapView(np.full(SENSOR.shape, K, np.uint8), good.ground, good.building, good.vegetation)
    with pytest.raises(ValueError, match="map classes must be in"):
        build_condition(None, np.eye(4), bad_classes, None, SENSOR)
    with pytest.raises(ValueError, match=r"layout\.range"):
        build_condition(None, np.eye(4), None, LayoutView(np.zeros((2, 2)), np.zeros((2, 2), np.int64)), SENSOR)
    with pytest.raises(ValueError, match="pose"):
        build_condition(None, np.eye(3), None, None, SENSOR)
    with pytest.raises(ValueError, match="cache points"):
        build_condition(np.zeros((5, 3)), np.eye(4), None, None, SENSOR)


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
    from training.config import AugmentConfig

    aug = AugmentConfig()
    amounts = {"dropout": 0.2, "range_noise": aug.range_noise, "jitter_translation": aug.jitter_translation,
               "jitter_rotation_deg": aug.jitter_rotation_deg}
    a = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), **amounts)
    b = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), **amounts)
    c = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(6), **amounts)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert 0.75 * len(pts) < len(a) < 0.85 * len(pts)
    none = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), 0.0, 0.0, 0.0, 0.0)
    np.testing.assert_allclose(none, pts, atol=1e-4)
    moved = augment_cache_points(pts, pose_at(3.0), np.random.default_rng(5), **{**amounts, "dropout": 0.0})
    shift = np.linalg.norm(moved[:, :3] - pts[:, :3], axis=1)
    assert 0 < np.median(shift) < 1.0


def test_layout_augmentation_is_seeded_leaves_actors_out_and_shifts_only_box_centres_in_the_plane():
    rng = np.random.default_rng(0)
    boxes = np.column_stack([rng.uniform(-40, 40, (1000, 3)), rng.uniform(0.5, 5, (1000, 3)), rng.uniform(-3, 3, 1000)])
    classes = rng.integers(0, 5, 1000).astype(np.int16)
    a = augment_layout(boxes, classes, np.random.default_rng(4), missing=0.3, center_noise=0.2)
    b = augment_layout(boxes, classes, np.random.default_rng(4), missing=0.3, center_noise=0.2)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    kept, kept_classes = a
    assert 0.6 * len(boxes) < len(kept) < 0.8 * len(boxes) and len(kept_classes) == len(kept)
    # match each kept box to its source by its untouched z, size and yaw
    source = {tuple(row): i for i, row in enumerate(np.round(boxes[:, 2:], 9))}
    idx = np.array([source[tuple(row)] for row in np.round(kept[:, 2:], 9)])
    np.testing.assert_array_equal(kept_classes, classes[idx])
    shift = kept[:, :2] - boxes[idx, :2]
    assert 0.15 < shift.std() < 0.25
    same, same_classes = augment_layout(boxes, classes, np.random.default_rng(4), missing=0.0, center_noise=0.0)
    np.testing.assert_array_equal(same, boxes)
    np.testing.assert_array_equal(same_classes, classes)


def test_condition_from_a_projected_scan_reproduces_that_scan_in_the_cache_channels():
    rng = np.random.default_rng(3)
    dirs = SENSOR.ray_directions()
    r = rng.uniform(5, 50, SENSOR.shape)
    pts = np.concatenate([(dirs * r[..., None]).reshape(-1, 3), np.full((r.size, 1), 0.25)], 1).astype(
        np.float32
    )
    pose = pose_at(7.0, yaw=0.3)
    cond = build_condition(transform_points(pts, pose), pose, None, None, SENSOR)
    # the cache is z-buffered with each point standing for a voxel-sized patch (CACHE_FOOTPRINT)
    expected = encode_image(project(pts, SENSOR, footprint=CACHE_FOOTPRINT), SENSOR)
    np.testing.assert_allclose(cond[:2].numpy(), expected, atol=1e-4)
    assert cond[CACHE_MASK].mean() > 0.99


def test_a_gap_takes_its_nearest_neighbours_range_along_the_row_then_the_column():
    from inference.conditioning import fill_gaps

    h, w = 5, 16
    rng = torch.full((1, h, w), 0.4)
    valid = torch.ones(1, h, w, dtype=torch.bool)
    valid[0, 2, 5] = False  # a one-pixel hole in a wall
    rng[0, 2, 4], rng[0, 2, 6] = 0.5, 0.45  # of two sides at one distance, the nearer (smaller) wins
    valid[0, 1, 0] = False  # at the seam: its left neighbour is the last column
    rng[0, 1, w - 1], rng[0, 1, 1] = 0.3, 0.6
    valid[0, 3, 8:15] = False  # a gap wider than the row reach
    valid[0, 2:5, 11] = False  # ... crossed by a gap down a column
    rng[0, 2, 10] = 0.1
    filled, found = fill_gaps(rng, valid, reach=(2, 1))
    assert filled[0, 2, 5] == 0.45
    assert filled[0, 1, 0] == 0.3
    assert filled[0, 3, 8] == 0.4 and filled[0, 3, 9] == 0.4 and filled[0, 3, 14] == 0.4, "within 2 columns"
    assert filled[0, 3, 10] == 0.1, "nothing within 2 columns: the nearer of the pixels above and below"
    assert filled[0, 2, 11] == 0.1 and filled[0, 4, 11] == 0.4
    assert not found[0, 3, 11], "its row and column neighbours are gaps themselves: fills never spread"
    assert torch.equal(filled[valid], rng[valid]) and found[valid].all()


def test_with_gap_fill_a_hole_in_a_cached_wall_starts_at_the_wall_not_at_flat_ground():
    from inference.network import WorldModel

    sensor = HDL32.with_width(64)
    config = WorldModelConfig(sensor=sensor.to_dict(), base_channels=8, channel_mults=(1, 2), strides=((1, 2),),
                              norm_groups=4, gap_fill=True)
    wall = np.full(sensor.shape, 11.0, dtype=np.float32)
    wall[9, 10] = 0.0  # one ray of the wall came back empty (glass, a dark patch), 1.3 deg below the horizon
    image = RangeImage(wall, np.full(sensor.shape, 0.3, np.float32))
    cond = build_condition(None, np.eye(4), None, None, sensor)
    cond[0:2] = torch.from_numpy(encode_image(image, sensor))
    cond[2] = torch.from_numpy(image.mask.astype(np.float32))
    with_fill, _, returns = WorldModel(config).base_image(cond[None])
    without, _, _ = WorldModel(WorldModelConfig.from_dict({**config.to_dict(), "gap_fill": False})).base_image(cond[None])
    assert not returns[0, 9, 10]
    assert with_fill[0, 9, 10] == with_fill[0, 9, 11], "the wall's range"
    assert without[0, 9, 10] > with_fill[0, 9, 10] + 0.3, "flat ground, 79 m away"
    assert torch.equal(with_fill[returns], without[returns]), "pixels with a prior are untouched"

"""Range-image projection: simulated sweeps round-trip within 1 cm, the nearest return wins, rings decide rows."""

from __future__ import annotations

import numpy as np
import pytest

from lidar.range_image import (
    RangeImage,
    azimuth_columns,
    beam_offsets,
    beam_rows,
    decode_range,
    encode_range,
    grid_winners,
    nearest_per_pixel,
    off_origin,
    point_elevations,
    project,
    rows_from_ring,
    unproject,
)
from lidar.sensors import HDL32, HDL64, OS1_64, OS1_128, VLP16, Sensor


def simulated(sensor: Sensor, seed: int = 0, keep: float = 0.8) -> tuple[np.ndarray, np.ndarray]:
    """Points exactly along `sensor.ray_directions()` (as lidar.sim casts them) and their pixel mask."""
    rng = np.random.default_rng(seed)
    mask = rng.random(sensor.shape) < keep
    ranges = rng.uniform(sensor.min_range, sensor.max_range, size=sensor.shape)
    xyz = sensor.ray_directions()[mask] * ranges[mask, None]
    inten = rng.uniform(0.0, 1.0, size=(len(xyz), 1))
    return np.concatenate([xyz, inten], axis=1).astype(np.float32), mask


@pytest.mark.parametrize("sensor", [HDL64, HDL32, VLP16, OS1_64, OS1_128], ids=lambda s: s.name)
def test_simulated_sweep_round_trips_within_a_centimetre(sensor):
    sensor = sensor.with_width(512)
    points, mask = simulated(sensor)
    image = project(points, sensor)
    np.testing.assert_array_equal(image.mask, mask)  # every point kept, one per pixel
    back = unproject(image, sensor)  # row-major pixel order, as `simulated` built them
    assert back.shape == points.shape and back.dtype == np.float32
    assert np.linalg.norm(back[:, :3] - points[:, :3], axis=1).max() < 0.01
    np.testing.assert_allclose(back[:, 3], points[:, 3], atol=1e-6)


@pytest.fixture(scope="module")
def sim_world():
    from lidar.sim import make_world

    return make_world(seed=1, style="urban")


@pytest.mark.parametrize("sensor", [HDL64, HDL32, VLP16, OS1_64, OS1_128], ids=lambda s: s.name)
def test_lidar_sim_sweep_round_trips_every_point_within_a_centimetre(sim_world, sensor):
    from lidar.sim import LidarSimulator, plan_drive

    sensor = sensor.with_width(512)
    pose = plan_drive(sim_world, "straight", 1, seed=0)[0]
    points = LidarSimulator(sensor, seed=0).scan(sim_world, pose, 0.0).points
    assert len(points) > 1000
    image = project(points, sensor)
    assert image.mask.sum() == len(points), "every simulated return keeps its own pixel"
    pixel = beam_rows(points, sensor) * sensor.width + azimuth_columns(points[:, :2], sensor.width)
    back = unproject(image, sensor)  # in pixel order
    original = points[np.argsort(pixel)]
    assert np.linalg.norm(back[:, :3] - original[:, :3], axis=1).max() < 0.01
    np.testing.assert_allclose(back[:, 3], original[:, 3], atol=1e-6)


def test_ring_path_round_trips_too():
    sensor = OS1_64.with_width(256)
    points, mask = simulated(sensor, seed=1)
    ring = np.nonzero(mask)[0]
    image = project(points, sensor, ring=ring)
    np.testing.assert_array_equal(image.mask, mask)
    assert np.linalg.norm(unproject(image, sensor)[:, :3] - points[:, :3], axis=1).max() < 0.01


def test_nearest_return_wins_a_pixel_whatever_the_order():
    sensor = HDL32.with_width(64)
    ray = sensor.ray_directions()[5, 20]
    near = np.array([*(ray * 10.0), 0.2])
    far = np.array([*(ray * 20.0), 0.8])
    for pts in (np.stack([near, far]), np.stack([far, near])):
        image = project(pts, sensor)
        assert image.mask.sum() == 1
        assert image.range[5, 20] == pytest.approx(10.0, abs=1e-5)
        assert image.intensity[5, 20] == pytest.approx(0.2)


def test_grid_winners_are_the_nearest_point_of_each_pixel_left_where_it_was():
    sensor = HDL32.with_width(64)
    ray = sensor.ray_directions()[5, 20]
    off_centre = ray + np.array([0.0, 0.0, 0.004])  # same pixel, not on its centre ray
    pts = np.array([[*(ray * 20.0), 0.8], [*(off_centre * 10.0), 0.2], [0.0, 0.0, 500.0, 0.1]])
    index, pixels = grid_winners(pts, sensor)
    assert index.tolist() == [1] and pixels.tolist() == [5 * 64 + 20]
    image = project(pts, sensor)
    assert image.range[5, 20] == pytest.approx(np.linalg.norm(pts[1, :3]))


def test_a_footprint_hides_the_background_behind_the_gaps_of_a_near_surface():
    """A wall 3 m ahead sampled every 0.15 m along each beam, a background 30 m behind it."""
    sensor = HDL32.with_width(512)
    ys, zs = np.meshgrid(np.arange(-3.0, 3.0, 0.15), 3.0 * np.tan(sensor.elevations[8:20]))
    wall = np.stack([np.full(ys.size, 3.0), ys.ravel(), zs.ravel(), np.full(ys.size, 0.5)], axis=1)
    dirs = sensor.ray_directions()[10:18, 150:362].reshape(-1, 3)
    background = np.concatenate([dirs * 30.0, np.full((len(dirs), 1), 0.1)], axis=1)
    pts = np.concatenate([wall, background])
    bare, patched = project(pts, sensor), project(pts, sensor, footprint=0.2)
    behind_wall = np.abs(np.arctan2(sensor.ray_directions()[..., 1], sensor.ray_directions()[..., 0])) < np.arctan2(2.5, 3.0)
    rows = slice(10, 18)  # elevations -2 to -12 deg: the wall's lower half
    seen_through = lambda image: ((image.range[rows] > 20.0) & behind_wall[rows]).sum()  # noqa: E731
    assert seen_through(bare) > 50, "the bare z-buffer lets the background through the wall's gaps"
    assert seen_through(patched) == 0
    assert (patched.range[rows][behind_wall[rows]] < 4.0).all()
    # beside the wall nothing changes: a point 30 m away covers less than a pixel
    az = np.abs(np.arctan2(sensor.ray_directions()[..., 1], sensor.ray_directions()[..., 0]))
    outside = (az[rows] > np.arctan2(3.5, 3.0)) & bare.mask[rows]
    assert outside.sum() > 50
    np.testing.assert_array_equal(patched.range[rows][outside], bare.range[rows][outside])
    # the winners are still the nearest points, and 0 is the plain z-buffer
    index, pixels = grid_winners(pts, sensor, footprint=0.2)
    assert len(index) == len(pixels) == patched.mask.sum() and len(np.unique(pixels)) == len(pixels)
    np.testing.assert_array_equal(project(pts, sensor, footprint=0.0).range, bare.range)
    with pytest.raises(ValueError, match="footprint"):
        project(pts, sensor, footprint=-0.1)


def test_a_footprint_keeps_near_ground_where_each_beam_meets_it():
    """Flat ground 1.84 m below, every other column observed: the gaps fill at their own beam's range."""
    sensor = HDL32.with_width(512)
    dirs = sensor.ray_directions()
    down = -dirs[..., 2] > 0.25  # steep beams: ground within 7 m, where patches span several columns
    ground = dirs * (1.84 / -dirs[..., 2:3])
    pts = ground[:, ::2][down[:, ::2]]
    image = project(pts, sensor, footprint=0.2)
    expected = np.linalg.norm(ground, axis=-1)
    filled = down & image.mask
    assert filled.sum() > 1.8 * down[:, ::2].sum(), "the unobserved columns are filled"
    np.testing.assert_allclose(image.range[filled], expected[filled], rtol=0.02)


def test_ring_index_decides_the_row_over_the_elevation():
    sensor = HDL32.with_width(64)
    points, mask = simulated(sensor, seed=2)
    rows = np.nonzero(mask)[0]
    # a few points sit at another beam's elevation, but their ring says otherwise
    ring = rows.copy()
    moved = np.arange(0, len(points), 50)
    ring[moved] = (rows[moved] + 3) % sensor.height
    image = project(points, sensor, ring=ring)
    cols = azimuth_columns(points[moved, :2], sensor.width)
    assert (image.range[ring[moved], cols] > 0).all()


def test_bottom_first_ring_numbering_is_flipped_to_top_first():
    sensor = VLP16.with_width(128)
    points, mask = simulated(sensor, seed=3, keep=1.0)
    rows = np.nonzero(mask)[0]
    top_first = rows_from_ring(points, rows, sensor)
    bottom_first = rows_from_ring(points, sensor.height - 1 - rows, sensor)
    np.testing.assert_array_equal(top_first, rows)
    np.testing.assert_array_equal(bottom_first, rows)
    np.testing.assert_array_equal(project(points, sensor, ring=sensor.height - 1 - rows).range, project(points, sensor).range)


def test_ring_outside_the_sensor_beams_drops_the_point():
    sensor = VLP16.with_width(64)
    points, mask = simulated(sensor, seed=4)
    ring = np.nonzero(mask)[0]
    ring[:10] = 40  # a 16-beam sensor has no ring 40
    image = project(points, sensor, ring=ring)
    assert image.mask.sum() == len(points) - 10


def test_points_outside_range_limits_or_beams_are_dropped():
    sensor = HDL64.with_width(64)
    ray = sensor.ray_directions()[10, 10]
    pts = np.stack([ray * 0.5, ray * 500.0, ray * 30.0, [10.0, 0.0, 10.0]])  # too near, too far, kept, 45 deg up
    assert beam_rows(pts, sensor)[3] == -1
    assert project(pts, sensor).mask.sum() == 1


def test_point_elevations_are_angles_above_the_origin_horizon():
    pts = np.array([[10.0, 0.0, 0.0], [0.0, 3.0, 3.0], [-1.0, -1.0, -np.sqrt(2.0)], [0.0, 0.0, 2.0]])
    np.testing.assert_allclose(np.degrees(point_elevations(pts)), [0.0, 45.0, -45.0, 90.0])


def test_azimuth_columns_follow_the_design_formula():
    width = 1024
    xy = np.array([[1.0, 0.0], [1.0, 1e-6], [1.0, -1e-6], [-1.0, 1e-9], [-1.0, -1e-9], [0.0, 1.0]])
    np.testing.assert_array_equal(azimuth_columns(xy, width), [512, 511, 512, 0, 1023, 256])


def test_column_of_each_ray_is_its_own_column():
    sensor = OS1_64.with_width(2048)
    dirs = sensor.ray_directions()
    cols = azimuth_columns(dirs[0], sensor.width)
    np.testing.assert_array_equal(cols, np.arange(sensor.width))


def test_wrong_shapes_are_refused():
    sensor = HDL32.with_width(64)
    with pytest.raises(ValueError, match=r"\(N, 3\+\)"):
        project(np.zeros((5, 2)), sensor)
    with pytest.raises(ValueError, match=r"\(N, 3\+\)"):
        project(np.zeros(12), sensor)
    with pytest.raises(ValueError, match=r"ring has shape \(5,\) for 10 points; expected one beam index per point"):
        project(np.ones((10, 4)), sensor, ring=np.arange(5))
    with pytest.raises(ValueError, match="matching"):
        RangeImage(np.zeros((32, 64)), np.zeros((32, 65)))
    with pytest.raises(ValueError, match="sensor 'hdl32' is"):
        unproject(RangeImage(np.zeros((16, 64)), np.zeros((16, 64))), sensor)


def test_stack_holds_range_intensity_and_mask():
    sensor = VLP16.with_width(32)
    points, mask = simulated(sensor, seed=5)
    stacked = project(points, sensor).stack()
    assert stacked.shape == (3, 16, 32) and stacked.dtype == np.float32
    np.testing.assert_array_equal(stacked[2], mask.astype(np.float32))


def test_log_range_encoding_inverts_and_marks_no_return():
    r = np.array([0.0, 0.5, 1.0, 7.5, 50.0, 120.0], dtype=np.float32)
    enc = encode_range(r, max_range=120.0)
    assert enc[0] == -1.0 and enc[-1] == pytest.approx(1.0)
    assert np.all(np.diff(enc) > 0)
    dec = decode_range(enc, max_range=120.0, min_range=1.0)
    np.testing.assert_allclose(dec[2:], r[2:], rtol=1e-4)
    np.testing.assert_array_equal(dec[:2], [0.0, 0.0])  # below min_range decodes as a ray drop


def test_beam_offsets_count_in_each_beams_own_spacing():
    # VLP-16: beams every 2 deg from +15 to -15
    elevations = np.deg2rad([15.0, 14.0, 13.5, 0.0, -15.0, -15.5, -17.0])
    points = np.c_[10 * np.cos(elevations), np.zeros(7), 10 * np.sin(elevations)]
    np.testing.assert_allclose(beam_offsets(points, VLP16), [0.0, 0.5, 0.25, 0.5, 0.0, 0.25, 1.0], atol=1e-9)
    # uneven tables: an HDL-64E's upper block is twice as dense as its lower one
    on = np.deg2rad(HDL64.elevations_deg)
    rays = np.c_[np.cos(on), np.zeros(len(on)), np.sin(on)]
    assert beam_offsets(rays, HDL64).max() < 1e-9


@pytest.mark.parametrize("low", [0, 1_000_000])
def test_z_buffer_keeps_the_first_of_the_nearest_candidates_wherever_the_pixels_lie(low):
    rng = np.random.default_rng(3)
    pix = low + rng.integers(0, 500, 4000)
    distance = rng.integers(1, 6, 4000).astype(np.float64)  # many ties
    winners, pixels = nearest_per_pixel(pix, distance, 1_620_000)
    # the reference: sorted by pixel, then distance, then position
    order = np.lexsort((np.arange(len(pix)), distance, pix))
    first = order[np.r_[True, pix[order][1:] != pix[order][:-1]]]
    np.testing.assert_array_equal(pixels, pix[first])
    np.testing.assert_array_equal(winners, first)
    assert all(len(a) == 0 for a in nearest_per_pixel(np.zeros(0, np.int64), np.zeros(0), 10))


def test_off_origin_marks_the_placeholders_readers_leave_for_silent_rays():
    points = np.array([[0, 0, 0, 0.5], [0, 0, -1e-3, 0], [2, -1, 0, 0], [0, 0, 0, 0], [np.nan, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(off_origin(points), [False, True, True, False, False])

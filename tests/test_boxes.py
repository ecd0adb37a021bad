"""lidar.boxes: ray casts of yawed 3-D boxes into a range view are exact, whichever pixels the windows pick."""

from __future__ import annotations

import numpy as np
import pytest

import lidar.boxes
from lidar.boxes import box_range_view, check_boxes
from lidar.sensors import HDL32
from tests.helpers import brute_force_view

SENSOR = HDL32.with_width(256)


def yaw_pose(x: float = 0.0, y: float = 0.0, z: float = 0.0, yaw: float = 0.0, pitch_deg: float = 0.0,
             roll_deg: float = 0.0) -> np.ndarray:
    """world_from_sensor: heading `yaw`, then the sensor tilted (as on a slope) by pitch and roll."""
    from scipy.spatial.transform import Rotation

    pose = np.eye(4)
    pose[:3, :3] = Rotation.from_euler("ZYX", [yaw, np.deg2rad(pitch_deg), np.deg2rad(roll_deg)]).as_matrix()
    pose[:3, 3] = [x, y, z]
    return pose


def random_boxes(seed: int, count: int = 150) -> np.ndarray:
    """Boxes all around the sensor: near and far, tall and flat, above and below it, across the azimuth seam."""
    rng = np.random.default_rng(seed)
    centre = np.column_stack([rng.uniform(-35, 35, (count, 2)), rng.uniform(-3, 4, count)])
    size = rng.uniform(0.3, 7.0, (count, 3))
    near = rng.random(count) < 0.15  # some within a couple of metres, some straddling the sensor's height
    centre[near, :2] = rng.uniform(-3, 3, (near.sum(), 2))
    boxes = np.column_stack([centre, size, rng.uniform(-np.pi, np.pi, count)])
    far = np.array([[130.0, 5.0, 0.0, 4.0, 2.0, 2.0, 0.3], [-99.0, 0.5, 0.0, 8.0, 8.0, 4.0, 0.1]])  # out / at the edge
    return np.concatenate([boxes, far])


@pytest.mark.parametrize(("seed", "pitch", "roll"), [(0, 0.0, 0.0), (1, 0.0, 0.0), (4, 3.0, -2.0), (5, -4.0, 1.5)])
def test_box_range_view_equals_a_brute_force_slab_test_over_every_pixel(seed, pitch, roll):
    """Tilted sensors too (a drive follows the terrain): the boxes stand upright in the world, not the sensor."""
    boxes = random_boxes(seed)
    pose = yaw_pose(0.7, -1.2, 0.3, yaw=0.9 + seed, pitch_deg=pitch, roll_deg=roll)
    # boxes in the world frame, around the sensor
    boxes[:, :2] += pose[:2, 3]
    view = box_range_view(boxes, pose, SENSOR)
    expected_range, expected_index = brute_force_view(boxes, pose, SENSOR)
    assert (expected_range > 0).mean() > 0.2, "the layout must cover a good part of the view"
    np.testing.assert_array_equal(view.index, expected_index)
    np.testing.assert_allclose(view.range, expected_range, atol=1e-4)
    assert view.range.dtype == np.float32 and view.index.dtype == np.int64


def test_the_pixel_windows_never_miss_a_pixel_that_testing_every_pixel_finds(monkeypatch):
    boxes = random_boxes(2)
    pose = yaw_pose(3.0, 4.0, 1.8, yaw=-2.5, pitch_deg=2.0, roll_deg=3.0)
    boxes[:, :2] += pose[:2, 3]
    windowed = box_range_view(boxes, pose, SENSOR)
    everything = np.arange(SENSOR.height * SENSOR.width)
    monkeypatch.setattr(lidar.boxes, "_pixel_windows", lambda local, sensor: (
        np.tile(everything, len(local)), np.repeat(np.arange(len(local)), len(everything))))
    full = box_range_view(boxes, pose, SENSOR)
    np.testing.assert_array_equal(windowed.index, full.index)
    np.testing.assert_array_equal(windowed.range, full.range)


@pytest.mark.parametrize("yaw", [0.0, 0.7, -2.0])
def test_a_box_straight_ahead_shows_its_near_face_at_the_analytic_range_on_the_centre_column(yaw):
    distance, length, width, height = 10.0, 2.0, 4.0, 3.0
    pose = yaw_pose(5.0, -3.0, 1.84, yaw=yaw)
    centre = pose[:3, :3] @ [distance + length / 2, 0.0, 0.0] + pose[:3, 3]
    view = box_range_view(np.array([[*centre, length, width, height, yaw]]), pose, SENSOR)
    col = SENSOR.width // 2
    az = SENSOR.azimuths[col]
    el = SENSOR.elevations
    analytic = distance / (np.cos(el) * np.cos(az))
    on_face = np.abs(analytic * np.sin(el)) <= height / 2
    assert on_face.sum() == 13  # HDL-32E beams within +-8.5 deg of level
    np.testing.assert_allclose(view.range[on_face, col], analytic[on_face], rtol=1e-6)
    assert (view.range[~on_face, col] == 0).all() and (view.index[on_face, col] == 0).all()
    # the face is 4 m wide at 10 m: about 2 * atan(0.2) of the 2 pi around, no more
    cols = np.flatnonzero(view.range[on_face].max(axis=0) > 0)
    assert abs(len(cols) - 2 * np.arctan(0.2) / (2 * np.pi) * SENSOR.width) <= 2
    assert (np.abs(cols - col) < 10).all()


def test_a_sensor_inside_a_box_sees_out_of_it():
    around = [0.3, -0.2, 0.1, 4.0, 2.0, 2.5, 0.3]  # the ego's own box
    ahead = [15.0, 0.0, 0.0, 4.0, 2.0, 2.0, 0.0]
    inside = box_range_view(np.array([around, ahead]), np.eye(4), SENSOR)
    alone = box_range_view(np.array([ahead]), np.eye(4), SENSOR)
    assert not (inside.index == 0).any()
    np.testing.assert_array_equal(inside.range, alone.range)
    np.testing.assert_array_equal(inside.index, np.where(alone.index >= 0, 1, -1))
    assert (alone.range > 0).sum() > 10


def test_turning_a_box_by_its_yaw_symmetry_changes_nothing():
    boxes = random_boxes(3, count=80)
    pose = yaw_pose(0.0, 0.0, 1.8, yaw=0.4)
    view = box_range_view(boxes, pose, SENSOR)
    assert (view.range > 0).mean() > 0.1
    half_turn = boxes.copy()
    half_turn[:, 6] += np.pi
    turned = box_range_view(half_turn, pose, SENSOR)
    np.testing.assert_array_equal(turned.index, view.index)
    np.testing.assert_allclose(turned.range, view.range, atol=1e-4)
    square = boxes.copy()
    square[:, 4] = square[:, 3]  # square footprints are symmetric under a quarter turn too
    quarter = square.copy()
    quarter[:, 6] -= np.pi / 2
    a, b = box_range_view(square, pose, SENSOR), box_range_view(quarter, pose, SENSOR)
    np.testing.assert_array_equal(a.index, b.index)
    np.testing.assert_allclose(a.range, b.range, atol=1e-4)


def test_bad_boxes_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match=r"\(B, 7\)"):
        box_range_view(np.zeros((2, 6)), np.eye(4), SENSOR)
    with pytest.raises(ValueError, match="NaN"):
        check_boxes(np.array([[0, 0, 0, 1, 1, np.nan, 0]]))
    with pytest.raises(ValueError, match="> 0"):
        check_boxes(np.array([[0, 0, 0, 1, 0, 1, 0]]))
    with pytest.raises(ValueError, match="pose"):
        box_range_view(np.zeros((0, 7)), np.eye(3), SENSOR)
    empty = box_range_view(np.zeros((0, 7)), np.eye(4), SENSOR)
    assert (empty.range == 0).all() and (empty.index == -1).all()

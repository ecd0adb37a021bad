"""Ring recovery and a sweep's measured geometry, on sweeps synthesised here with known beams and order.

Each synthetic sweep is stored the way a real source stores it (ring by ring from a cut like KITTI, cropped
to a camera's view, in firing order, shuffled, or with a ring field numbered bottom-up or by laser id), so
the recovered rings can be checked point by point against the beams the points were made on.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from lidar.formats import (
    PointCloudError,
    Scan,
    check_sensor,
    read_points,
    sweep_geometry,
    write_points,
)
from lidar.formats.detect import _measured, closest_preset, measured_width
from lidar.formats.rings import _median, cluster_elevations, recover_rings, scan_order, unfold_scan_order
from lidar.range_image import grid_winners, project
from lidar.sensors import HDL32, HDL64, OS1_64, OS1_128, VLP16, Sensor


def _ranges(sensor: Sensor, rng: np.random.Generator, count: int, row: int) -> np.ndarray:
    """Ranges for `count` returns of beam `row`: the road for a downward beam, anything up to 60 m otherwise."""
    r = rng.uniform(3.0, 60.0, count)
    elevation = sensor.elevations[row]
    if elevation < 0:
        r = np.minimum(r, sensor.mount_height / np.sin(-elevation))
    return r


def _points(sensor: Sensor, row: np.ndarray, az: np.ndarray, r: np.ndarray, laser_height: float = 0.0) -> np.ndarray:
    """(N, 4) points of beams `row` at azimuths `az` and ranges `r`, the laser `laser_height` m above the origin."""
    el = sensor.elevations[row]
    xyz = np.stack([r * np.cos(el) * np.cos(az), r * np.cos(el) * np.sin(az), laser_height + r * np.sin(el)], axis=1)
    return np.concatenate([xyz, np.full((len(row), 1), 0.5)], axis=1).astype(np.float32)


def ring_by_ring(
    sensor: Sensor,
    cut_deg: float,
    seed: int = 0,
    skip_first_deg: float = 10.0,
    skip_last_deg: float = 20.0,
    storage: np.ndarray | None = None,
    crop_deg: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A sweep stored one beam's revolution after another, each from the azimuth `cut_deg` (KITTI: 0, straight
    ahead), the first beam without returns for its first `skip_first_deg` and the last one stopping
    `skip_last_deg` short, 8 % of returns missing and the azimuth jittered by a tenth of a column.

    `storage` is the order of the beams in the file (rows of `sensor`; default top to bottom); `crop_deg`
    keeps only the returns within that many degrees of straight ahead (KITTI's camera-view files).
    Returns (points, row of each point in `sensor`).
    """
    rng = np.random.default_rng(seed)
    step = 2.0 * np.pi / sensor.width
    order = np.arange(sensor.height) if storage is None else storage
    points, rows = [], []
    for i, row in enumerate(order):
        turn = np.arange(sensor.width) * step
        keep = rng.random(sensor.width) > 0.08
        if i == 0:
            keep &= turn >= np.radians(skip_first_deg)
        if i == len(order) - 1:
            keep &= turn < 2.0 * np.pi - np.radians(skip_last_deg)
        az = np.radians(cut_deg) + turn[keep] + rng.uniform(-0.1, 0.1, keep.sum()) * step
        if crop_deg is not None:
            az = az[np.abs(np.angle(np.exp(1j * az))) <= np.radians(crop_deg)]
        points.append(_points(sensor, np.full(len(az), row), az, _ranges(sensor, rng, len(az), row)))
        rows.append(np.full(len(az), row))
    return np.concatenate(points), np.concatenate(rows)


def firing_order(sensor: Sensor, seed: int = 0, laser_height: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """A sweep in firing order, one column of every beam after another (8 % of returns missing)."""
    rng = np.random.default_rng(seed)
    col, row = np.meshgrid(np.arange(sensor.width), np.arange(sensor.height), indexing="ij")
    col, row = col.ravel(), row.ravel()
    keep = rng.random(len(col)) > 0.08
    col, row = col[keep], row[keep]
    r = np.concatenate([_ranges(sensor, rng, 1, k) for k in row])
    return _points(sensor, row, sensor.azimuths[col], r, laser_height), row


# 1. scan order ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut_deg", [0.0, 37.0, 180.0])
def test_a_ring_by_ring_sweep_starting_mid_ring_unfolds_into_its_beams(tmp_path, cut_deg):
    sensor = HDL64.with_width(2000)
    points, rows = ring_by_ring(sensor, cut_deg)
    scan = read_points(write_points(tmp_path / "kitti.bin", points))
    assert scan.ring_source == "scan order"
    assert any("ring recovered from the scan order" in n and "64 rings" in n for n in scan.notes)
    np.testing.assert_array_equal(scan.ring, rows)
    # split at the +-180 deg wrap instead, the sweep has 65 pieces whenever the cut is elsewhere
    az = np.arctan2(points[:, 1], points[:, 0])
    assert int((np.diff(az) < -np.pi).sum()) + 1 == (64 if cut_deg == 180.0 else 65)


@pytest.mark.parametrize("silent_deg", [0.0, 60.0, 200.0])
def test_points_put_in_scan_order_read_back_on_their_rings(tmp_path, silent_deg):
    """What `write_rollout` stores: points in any order, with their rings, ring by ring; the first ring silent
    for its first `silent_deg` of the turn (the sky above a generated frame) still unfolds ring for ring."""
    sensor = HDL64.with_width(2000)
    points, rows = ring_by_ring(sensor, 0.0, seed=4, skip_first_deg=0.0, skip_last_deg=0.0)
    turned = np.degrees(np.mod(np.pi - np.arctan2(points[:, 1], points[:, 0]), 2.0 * np.pi))  # from behind
    keep = (rows > 0) | (turned >= silent_deg)
    shuffle = np.random.default_rng(0).permutation(int(keep.sum()))
    points, rows = points[keep][shuffle], rows[keep][shuffle]
    order = scan_order(points, rows)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(rows)))  # every point, once
    assert (np.diff(rows[order]) >= 0).all()  # ring by ring
    scan = read_points(write_points(tmp_path / "frame.bin", points[order]))
    assert scan.ring_source == "scan order"
    np.testing.assert_array_equal(scan.ring, rows[order])


def test_beams_stored_in_laser_order_are_numbered_by_elevation():
    sensor = HDL32.with_width(1084)
    storage = np.r_[np.arange(0, 32, 2), np.arange(1, 32, 2)]  # interleaved, as laser ids often are
    points, rows = ring_by_ring(sensor, 0.0, seed=1, storage=storage)
    rings = unfold_scan_order(points[:, :3])
    assert rings is not None and rings.count == 32
    np.testing.assert_array_equal(rings.ring, rows)


def test_a_sweep_cropped_to_a_camera_view_starts_a_ring_at_each_jump_back():
    sensor = HDL64.with_width(2000)
    points, rows = ring_by_ring(sensor, 0.0, seed=2, crop_deg=40.0)
    rings = unfold_scan_order(points[:, :3])
    assert rings is not None and "jumps over azimuths without returns" in rings.note
    np.testing.assert_array_equal(rings.ring, rows)


def test_a_sweep_in_firing_order_or_shuffled_is_not_taken_for_ring_order():
    points, _ = firing_order(VLP16)
    assert unfold_scan_order(points[:, :3]) is None
    ring_points, _ = ring_by_ring(HDL64.with_width(2000), 0.0, seed=3)
    shuffled = ring_points[np.random.default_rng(0).permutation(len(ring_points))]
    assert unfold_scan_order(shuffled[:, :3]) is None


#: Beam tables no preset has, whose full grids have a point count an organised height divides: 20 x 360 is
#: 32 x 225 points, a 40-beam unit's 40 x 1,800 (uneven: 0.33 deg in the middle, 1-6 deg at the edges, as a
#: Pandar40P) is 32 x 2,250 and 64 x 1,125.
_ODD_TABLES = {
    "20 beams": Sensor.from_angles("odd20", np.linspace(5.0, -15.0, 20), width=360),
    "40 uneven": Sensor.from_angles(
        "odd40", [15, 11, 8, 5, 3, 2, *(1.67 - 0.33 * np.arange(24)), -7, -8, -9, -10, -11, -12, -13, -14, -19, -25],
        width=1800,
    ),
}


@pytest.mark.parametrize("sensor", _ODD_TABLES.values(), ids=_ODD_TABLES.keys())
def test_a_full_grid_of_beams_no_organised_height_fits_is_measured_beam_for_beam(tmp_path, sensor):
    """Every pixel stored row by row, so an organised 32-row reading finds tight, distinct-looking rows (each
    "row" holds most of one beam), but its columns are no azimuths: the sweep is unfolded ring by ring."""
    rng = np.random.default_rng(16)
    rows = np.repeat(np.arange(sensor.height), sensor.width)
    ranges = np.concatenate([_ranges(sensor, rng, sensor.width, k) for k in range(sensor.height)])
    points = _points(sensor, rows, np.tile(sensor.azimuths, sensor.height), ranges)
    for order in (np.arange(len(points)), rng.permutation(len(points))):
        np.save(tmp_path / "grid.npy", points[order])
        scan = read_points(tmp_path / "grid.npy")
        assert not any("organised" in n for n in scan.notes)
        geometry = sweep_geometry(scan)
        assert geometry is not None and geometry.sensor.shape == sensor.shape
        np.testing.assert_allclose(geometry.sensor.elevations_deg, sensor.elevations_deg, atol=1e-3)
        np.testing.assert_array_equal(geometry.rows, rows[order])


@pytest.mark.parametrize("share", [0.3, 1.0])
@pytest.mark.parametrize("second", ["farther", "the same point"])
def test_second_returns_of_a_firing_stored_beside_the_first_keep_the_scan_order(second, share):
    """A dual-return sensor stores a firing's two returns one after the other, at one azimuth up to rounding (or
    the same point twice where both returns are one, as a forecast's frame keeps a measurement's duplicates): a
    step of zero or a rounding's back is the same firing, not a sweep out of order."""
    sensor = HDL64.with_width(2000)
    points, rows = ring_by_ring(sensor, 0.0, seed=6)
    dual = np.random.default_rng(6).random(len(points)) < share  # 1.0: every firing stores two returns
    echo = points[dual].copy()
    if second == "farther":
        echo[:, :3] *= 1.2
    slot = np.cumsum(np.r_[0, dual[:-1]]) + np.arange(len(points))  # each return, its second right after it
    stored = np.empty((len(points) + int(dual.sum()), 4), dtype=np.float32)
    stored_rows = np.empty(len(stored), dtype=np.int64)
    stored[slot], stored_rows[slot] = points, rows
    stored[slot[dual] + 1], stored_rows[slot[dual] + 1] = echo, rows[dual]
    rings = unfold_scan_order(stored[:, :3])
    assert rings is not None and rings.count == 64
    np.testing.assert_array_equal(rings.ring, stored_rows)


def test_placeholders_at_the_origin_take_their_neighbours_ring():
    sensor = VLP16.with_width(1024)
    points, rows = ring_by_ring(sensor, 0.0, seed=4)
    holes = np.arange(5, len(points), 97)
    points[holes, :3] = 0.0
    rings = unfold_scan_order(points[:, :3])
    assert rings is not None
    np.testing.assert_array_equal(rings.ring, rows)


# 2. elevation clusters ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sensor", [HDL64, HDL32, VLP16, OS1_64, OS1_128], ids=lambda s: s.name)
def test_shuffled_sweeps_of_every_preset_cluster_into_their_beams(sensor):
    points, rows = firing_order(sensor, seed=5)
    shuffle = np.random.default_rng(5).permutation(len(points))
    rings = recover_rings(points[shuffle, :3])
    assert rings is not None and rings.source == "elevation clusters"
    np.testing.assert_array_equal(rings.ring, rows[shuffle])


def test_clusters_are_read_from_the_lasers_height_above_the_optical_centre():
    """An HDL-64E's lasers sit about 0.2 m above its centre: from the centre a beam's near returns read up to
    a degree higher than its far ones, more than the 0.33 deg between beams."""
    points, rows = firing_order(HDL64.with_width(1024), seed=6, laser_height=0.2)
    rings = cluster_elevations(points[:, :3])
    assert rings is not None and "+0.20 m above the origin" in rings.note
    np.testing.assert_array_equal(rings.ring, rows)


def test_elevations_without_beams_give_no_rings(tmp_path):
    rng = np.random.default_rng(7)
    direction = rng.normal(size=(50_000, 3)) * [1.0, 1.0, 0.15]
    points = np.concatenate([direction / np.linalg.norm(direction, axis=1, keepdims=True) * rng.uniform(3, 60, (50_000, 1)),
                             np.full((50_000, 1), 0.5)], axis=1)
    assert cluster_elevations(points[:, :3]) is None
    scan = read_points(write_points(tmp_path / "fog.bin", points))
    assert scan.ring is None and scan.ring_source == ""


# 3. ring fields -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scan.pcd", "scan.ply", "scan.pcd.bin"])
def test_a_ring_field_numbered_bottom_up_gives_rows_from_the_top(tmp_path, name):
    """Velodyne's ROS driver numbers ring 0 the lowest beam; rows number the highest 0."""
    sensor = VLP16.with_width(1024)
    points, rows = firing_order(sensor, seed=8)
    scan = read_points(write_points(tmp_path / name, points, ring=sensor.height - 1 - rows))
    assert scan.ring_source == "file"
    geometry = sweep_geometry(scan)
    assert geometry is not None and geometry.source == "file"
    np.testing.assert_array_equal(geometry.rows, rows)
    np.testing.assert_allclose(geometry.sensor.elevations_deg, sensor.elevations_deg, atol=1e-3)


def test_a_ring_field_in_laser_id_order_is_sorted_by_elevation(tmp_path):
    sensor = HDL32.with_width(1084)
    points, rows = firing_order(sensor, seed=9)
    laser_id = np.r_[np.arange(0, 32, 2), np.arange(1, 32, 2)]  # laser id -> row
    id_of_row = np.argsort(laser_id)
    scan = read_points(write_points(tmp_path / "nuscenes.pcd.bin", points, ring=id_of_row[rows]))
    geometry = sweep_geometry(scan)
    assert geometry is not None
    np.testing.assert_array_equal(geometry.rows, rows)
    assert geometry.sensor.name == "hdl32-measured" and geometry.sensor.shape == (32, 1084)


def test_a_ring_with_too_few_returns_gets_no_row():
    sensor = VLP16.with_width(1024)
    points, rows = firing_order(sensor, seed=10)
    ring = rows.copy()
    ring[:3] = 40  # three stray values of a ring no beam has
    geometry = sweep_geometry(Scan(points=points, ring=ring))
    assert geometry is not None and geometry.sensor.height == 16
    assert (geometry.rows[:3] == -1).all()
    np.testing.assert_array_equal(geometry.rows[3:], rows[3:])


# 4. the measured sensor ----------------------------------------------------------------------------------------------


def test_projecting_onto_the_measured_sensor_puts_every_point_on_its_own_row_and_pixel():
    sensor = HDL64.with_width(2000)
    points, rows = ring_by_ring(sensor, 0.0, seed=11)
    rings = recover_rings(points[:, :3])
    assert rings is not None
    geometry = sweep_geometry(Scan(points=points, ring=rings.ring, ring_source=rings.source))
    assert geometry is not None and geometry.sensor.height == 64 and abs(geometry.sensor.width - 2000) <= 2
    index, pixels = grid_winners(points, geometry.sensor, ring=geometry.rows)
    np.testing.assert_array_equal(pixels // geometry.sensor.width, rows[index])  # no flip of the rows
    image = project(points, geometry.sensor, ring=geometry.rows)
    assert image.mask.sum() / len(points) > 0.95  # the rest share a pixel: azimuths jitter by 0.1 column


@pytest.mark.parametrize(("width", "measured"), [(2000, 2000), (1087, 1087), (1020, 1024), (2048, 2048), (1940, 1940)])
def test_the_width_is_the_rings_azimuth_step_snapped_only_within_half_a_percent(width, measured):
    points, rows = ring_by_ring(HDL32.with_width(width), 0.0, seed=12)
    got = measured_width(points, rows)
    assert got == measured if measured in (1024, 2048) else abs(got - measured) <= 2


def test_the_closest_preset_lends_its_name_range_and_mount_height():
    cropped = np.asarray(HDL64.elevations_deg[:47]) + 0.3  # a camera-cropped KITTI sweep's rings
    assert closest_preset(cropped).name == "hdl64"
    assert closest_preset(np.linspace(16.6, -16.6, 64)).name == "os1-64"  # OS1-64 Gen 1: no HDL-64E
    assert closest_preset(np.linspace(10.0, -30.0, 32)).name == "hdl32"
    assert closest_preset(np.linspace(21.0, -21.4, 128)).name == "os1-128"


def test_a_scan_without_rings_falls_back_to_the_nearest_preset_beams():
    points, _ = firing_order(HDL32, seed=13)
    geometry = sweep_geometry(Scan(points=points))
    assert geometry is not None and geometry.source == "preset" and geometry.sensor.name == "hdl32"


def test_a_recovered_ring_does_not_refuse_a_users_sensor_but_a_file_ring_does(tmp_path):
    points, rows = ring_by_ring(HDL64.with_width(2000), 0.0, seed=14)
    recovered = read_points(write_points(tmp_path / "kitti.bin", points))
    assert recovered.ring_source == "scan order"
    check_sensor(recovered, HDL32)  # the user knows better than a count of turns
    from_file = read_points(write_points(tmp_path / "kitti.pcd", points, ring=rows))
    with pytest.raises(PointCloudError, match="ring index reaches 63"):
        check_sensor(from_file, HDL32)


# 5. speed ---------------------------------------------------------------------------------------------------------


def _fastest(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def test_recovery_and_geometry_of_a_120k_point_sweep_take_well_under_100_ms():
    sensor = HDL64.with_width(2048)
    points, _ = ring_by_ring(sensor, 0.0, seed=15)
    assert len(points) > 115_000
    xyz = points[:, :3].astype(np.float64)
    rings = recover_rings(xyz)
    assert rings is not None
    scan = Scan(points=points, ring=rings.ring, ring_source=rings.source, path=Path("sweep.bin"))
    assert _fastest(lambda: recover_rings(xyz)) + _fastest(lambda: sweep_geometry(scan)) < 0.1
    shuffled = xyz[np.random.default_rng(0).permutation(len(xyz))]
    assert _fastest(lambda: cluster_elevations(shuffled)) < 0.1


@pytest.mark.parametrize("count", [1, 2, 3, 10, 11, 2001])
def test_the_ring_median_is_numpys(count: int):
    """The beam table's medians skip `np.median`'s checks, not its value: odd and even counts, ties included."""
    rng = np.random.default_rng(count)
    for values in (rng.normal(size=count), np.round(rng.normal(size=count), 1)):
        assert _median(values) == np.median(values)


def test_a_sweeps_geometry_is_measured_once_and_kept_read_only(monkeypatch):
    """A request asks for an upload's geometry when it sizes its grid and again when it runs."""
    import lidar.formats.detect as detect

    points, rows = ring_by_ring(HDL64.with_width(2000), 0.0, seed=5)
    scan = Scan(points=points, ring=rows, ring_source="file")
    measured = []
    monkeypatch.setattr(detect, "_measured", lambda s: measured.append(s) or _measured(s))
    first = sweep_geometry(scan)
    assert sweep_geometry(scan) is first and len(measured) == 1
    assert not first.rows.flags.writeable
    np.testing.assert_array_equal(first.rows, rows)
    assert sweep_geometry(Scan(points=points, ring=rows, ring_source="file")).sensor == first.sensor
    assert len(measured) == 2  # another Scan of the same points is measured anew

"""lidar.sim: worlds, drives, the sensor model and the dataset files behave as the issue specifies."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from lidar.range_image import project
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL32, Sensor
from lidar.sim import (
    MAP_CLASSES,
    OBJECT_CLASSES,
    LidarSimulator,
    SensorModelConfig,
    SimScan,
    make_world,
    plan_drive,
    simulate_sequence,
)
from lidar.sim.dataset import SimDataset, generate_sequence, sequence_spec
from lidar.sim.hdmap import HDMap
from lidar.sim.primitives import (
    BOX,
    CYLINDER,
    ELLIPSOID,
    Shapes,
    cast,
    intersect_boxes,
    intersect_cylinders,
    intersect_ellipsoids,
)
from lidar.sim.roads import RoadGraph, generate_road_graph
from lidar.sim.sensor_model import GROUND_REFLECTIVITY, _rotation_yaw_tilt
from lidar.sim.styles import STYLE_PROFILES, STYLES, style_profile
from lidar.sim.world import World
from lidar.vocabulary import MAP_CLASS_INDEX, OBJECT_CLASS_INDEX

NOISELESS = SensorModelConfig(range_noise=0.0, intensity_noise=0.0, drop_general=0.0, drop_zero_intensity=0.0)


def _heading(pose: np.ndarray) -> float:
    return float(np.degrees(np.arctan2(pose[1, 0], pose[0, 0])))


def _turn(poses: np.ndarray) -> float:
    return (_heading(poses[-1]) - _heading(poses[0]) + 180.0) % 360.0 - 180.0


@pytest.fixture(scope="module")
def urban():
    return make_world(7, "urban")


@pytest.fixture(scope="module")
def suburban():
    return make_world(3, "suburban")


def _flat_world(shapes: Shapes, grade: float = 0.0) -> World:
    """An all-road world holding only `shapes` on a plane rising `grade` per metre of +x: ranges are known in
    closed form (the bilinear height field reproduces a plane exactly)."""
    raster = np.full((1000, 1000), MAP_CLASS_INDEX["road"], dtype=np.uint8)
    xs = -120.0 + 8.0 * np.arange(40)
    hdmap = HDMap(
        layers={},
        raster=raster,
        origin=(-100.0, -100.0),
        resolution=0.2,
        terrain=np.tile(grade * xs, (40, 1)).astype(np.float32),
        terrain_origin=(-120.0, -120.0),
        terrain_resolution=8.0,
    )
    graph = RoadGraph(nodes=np.zeros((0, 2)), roads=[], style="test")
    return World(seed=0, style="test", hdmap=hdmap, graph=graph, actors=[], scenery=shapes)


def test_same_seed_gives_identical_world_and_scans(urban):
    again = make_world(7, "urban")
    np.testing.assert_array_equal(urban.hdmap.raster, again.hdmap.raster)
    np.testing.assert_array_equal(urban.scenery.center, again.scenery.center)
    poses = plan_drive(urban, "straight", 3, seed=2)
    np.testing.assert_array_equal(poses, plan_drive(again, "straight", 3, seed=2))
    sensor = HDL32.with_width(256)
    a = LidarSimulator(sensor, seed=3).scan(urban, poses[1], 0.1)
    b = LidarSimulator(sensor, seed=3).scan(again, poses[1], 0.1)
    np.testing.assert_array_equal(a.image.range, b.image.range)
    np.testing.assert_array_equal(a.image.intensity, b.image.intensity)
    other = make_world(8, "urban")
    assert (
        other.hdmap.raster.shape != urban.hdmap.raster.shape
        or (other.hdmap.raster != urban.hdmap.raster).any()
    )


def test_ray_hits_known_box_at_known_range():
    # A 4 m wide wall whose near face is 19 m ahead of a sensor 1.8 m above flat ground.
    box = Shapes.from_rows([(BOX, (20.0, 0.0, 2.0), (1.0, 2.0, 2.0), 0.0, 0.5, 0, -1, 0.0, 0.1)])
    sensor = Sensor.from_angles("test", [0.0, -30.0], width=64, max_range=100.0, mount_height=1.8)
    pose = np.eye(4)
    pose[2, 3] = 1.8
    scan = LidarSimulator(sensor, seed=0, config=NOISELESS).scan(_flat_world(box), pose, 0.0)
    az = sensor.azimuths
    centre_cols = np.flatnonzero((np.cos(az) > 0) & (np.abs(19.0 * np.tan(az)) < 1.9))
    assert len(centre_cols) == 2
    np.testing.assert_allclose(scan.image.range[0, centre_cols], 19.0 / np.cos(az[centre_cols]), atol=1e-4)
    # The -30 deg beam meets the flat road at h / sin(30 deg).
    ground = scan.image.range[1][scan.image.range[1] > 0]
    np.testing.assert_allclose(ground, 1.8 / np.sin(np.deg2rad(30.0)), atol=1e-3)
    assert (scan.label_image[0, centre_cols] == len(MAP_CLASSES)).all()


def test_cylinder_and_ellipsoid_intersections_at_known_range():
    origin = np.zeros(3)
    d = np.array([[1.0, 0.0, 0.0]])
    t, cos = intersect_cylinders(origin, d, np.array([[10.0, 0.0, 0.0]]), np.array([[0.5, 0.5, 2.0]]))
    assert t[0] == pytest.approx(9.5) and cos[0] == pytest.approx(1.0)
    t, _ = intersect_ellipsoids(
        origin, d, np.array([[10.0, 0.0, 0.0]]), np.array([[2.0, 1.0, 1.0]]), np.zeros(1)
    )
    assert t[0] == pytest.approx(8.0)
    # A box turned 45 degrees is met on its corner edge: half diagonal sqrt(2) before its centre.
    t, cos = intersect_boxes(
        origin, d, np.array([[10.0, 0.0, 0.0]]), np.array([[1.0, 1.0, 1.0]]), np.array([np.pi / 4])
    )
    assert t[0] == pytest.approx(10.0 - np.sqrt(2.0)) and cos[0] == pytest.approx(np.sqrt(0.5))
    t, _ = intersect_cylinders(
        origin, np.array([[0.0, 1.0, 0.0]]), np.array([[10.0, 0.0, 0.0]]), np.array([[0.5, 0.5, 2.0]])
    )
    assert np.isinf(t[0])


def _flat_scan(shapes: Shapes, sensor: Sensor, grade: float = 0.0, **config) -> SimScan:
    """One sweep from 1.8 m above the origin of `_flat_world`, noiseless and ego-free unless `config` says."""
    pose = np.eye(4)
    pose[2, 3] = 1.8
    sim = LidarSimulator(sensor, seed=0, config=replace(NOISELESS, **{"ego_boxes": (), **config}))
    return sim.scan(_flat_world(shapes, grade), pose, 0.0)


def _wall(reflectivity: float, half_width: float = 10.0) -> Shapes:
    """A box wall whose near face is the plane x = 19 m, facing the sensor."""
    return Shapes.from_rows([(BOX, (20.0, 0.0, 5.0), (1.0, half_width, 6.0), 0.0, reflectivity, 0, -1, 0.0, 0.1)])


def test_rays_meet_a_sloped_height_field_at_the_known_range():
    # Ground rising 5 % towards +x: a ray d from 1.8 m above it lands at t = 1.8 / (-d_z + 0.05 d_x).
    sensor = Sensor.from_angles("test", [-10.0], width=64, max_range=100.0, mount_height=1.8)
    scan = _flat_scan(Shapes.empty(), sensor, grade=0.05)
    d = sensor.ray_directions()
    assert scan.image.mask.all()
    np.testing.assert_allclose(scan.image.range, 1.8 / (-d[..., 2] + 0.05 * d[..., 0]), atol=1e-3)
    assert scan.image.range[0, 32] < 9.0 < 14.0 < scan.image.range[0, 0], "uphill ahead is nearer than behind"


def test_intensity_is_reflectivity_times_incidence_times_range_attenuation():
    sensor = Sensor.from_angles("test", [0.0, -30.0], width=256, max_range=100.0, mount_height=1.8)
    terms = dict(incidence_power=2.0, attenuation=0.01, intensity_gain=1.5, intensity_gamma=0.8)
    scan = _flat_scan(_wall(0.5), sensor, **terms)
    d = sensor.ray_directions()
    r = scan.image.range
    assert (r[0] > 0).sum() > 20 and (r[1] > 0).all(), "row 0 sees the wall, row 1 the road"
    # Row 0 meets the wall's x-facing front, row 1 the flat road (normal +z).
    refl = np.stack(
        [np.full(sensor.width, 0.5), np.full(sensor.width, GROUND_REFLECTIVITY[MAP_CLASS_INDEX["road"]])]
    )
    cos = np.stack([np.abs(d[0, :, 0]), np.abs(d[1, :, 2])])
    signal = refl * cos**2.0 * np.exp(-2.0 * 0.01 * r)
    expected = np.clip((1.5 * signal) ** 0.8, 0.0, 1.0)
    mask = scan.image.mask
    np.testing.assert_allclose(scan.image.intensity[mask], expected[mask], rtol=1e-5)
    # The device's least count: signals below intensity_floor read 0 (the road here), the returns stay.
    floored = _flat_scan(_wall(0.5), sensor, **terms, intensity_floor=0.1)
    np.testing.assert_array_equal(floored.image.mask, mask)
    assert (floored.image.intensity[1] == 0).all()
    np.testing.assert_array_equal(floored.image.intensity[0], scan.image.intensity[0])


def test_weak_returns_drop_carla_style_and_random_loss_scales_with_width():
    sensor = Sensor.from_angles(
        "test", np.linspace(8.0, 0.0, 16), width=1024, max_range=100.0, mount_height=1.8
    )
    dark, bright = _wall(0.004, half_width=20.0), _wall(0.5, half_width=20.0)
    carla = dict(drop_zero_intensity=0.6, drop_intensity_limit=0.01)
    # Without drop every wall ray returns; its intensity is the signal (gain 1, gamma 1).
    ref = _flat_scan(dark, sensor)
    n = int(ref.image.mask.sum())
    assert n > 3000
    p_keep = 1.0 - 0.6 * np.clip(1.0 - ref.image.intensity[ref.image.mask] / 0.01, 0.0, 1.0)
    assert 0.5 < p_keep.mean() < 0.7, (
        "the dark wall must sit inside the drop ramp for this test to mean anything"
    )
    dropped = _flat_scan(dark, sensor, **carla)
    assert not (dropped.image.mask & ~ref.image.mask).any()
    assert abs(dropped.image.mask.sum() / n - p_keep.mean()) < 4 * np.sqrt(0.25 / n)
    # A bright wall is above the limit: nothing is lost.
    np.testing.assert_array_equal(
        _flat_scan(bright, sensor, **carla).image.mask, _flat_scan(bright, sensor).image.mask
    )
    # drop_general and the width-proportional binning loss are independent random losses.
    for width in (1024, 512):
        wide = sensor.with_width(width)
        full = int(_flat_scan(bright, wide).image.mask.sum())
        kept = int(_flat_scan(bright, wide, drop_general=0.1, binning_loss=0.2).image.mask.sum())
        expect = 0.9 * (1.0 - 0.2 * width / 1024)
        assert abs(kept / full - expect) < 4 * np.sqrt(0.25 / full), (width, kept / full, expect)


def test_grazing_rays_are_dropped_and_range_noise_has_the_configured_spread():
    # Flat ground met at -2 deg has cos(incidence) = sin 2 deg = 0.035, at -4 deg 0.070.
    sensor = Sensor.from_angles("test", [-2.0, -4.0], width=64, max_range=100.0, mount_height=1.8)
    grazing = _flat_scan(Shapes.empty(), sensor, grazing_cos=0.05)
    assert not grazing.image.mask[0].any() and grazing.image.mask[1].all()
    kept = _flat_scan(Shapes.empty(), sensor, grazing_cos=0.0)
    np.testing.assert_allclose(kept.image.range[0], 1.8 / np.sin(np.deg2rad(2.0)), rtol=1e-4)
    # Range noise: Gaussian around the true range with the configured standard deviation.
    steep = Sensor.from_angles("test", [-30.0], width=4096, max_range=100.0, mount_height=1.8)
    err = _flat_scan(Shapes.empty(), steep, range_noise=0.05).image.range[0] - 3.6
    assert abs(err.mean()) < 0.005 and abs(err.std() - 0.05) < 0.005


def test_the_ego_body_hides_the_rays_that_meet_it():
    # A 2 x 2 m roof 0.5 m under the sensor: the -45 deg beam lands on it everywhere, -10 deg clears it.
    sensor = Sensor.from_angles("test", [-10.0, -45.0], width=64, max_range=100.0, mount_height=1.8)
    bare = _flat_scan(Shapes.empty(), sensor)
    assert bare.image.mask.all()
    car = _flat_scan(Shapes.empty(), sensor, ego_boxes=((-1.0, 1.0, 1.0, 0.5),))
    assert not car.image.mask[1].any()
    np.testing.assert_array_equal(car.image.range[0], bare.image.range[0])


@pytest.mark.parametrize("style", ["urban", "suburban"])
def test_turns_end_at_plus_and_minus_ninety_degrees(style, urban, suburban):
    world = urban if style == "urban" else suburban
    left = plan_drive(world, "turn_left", 60, seed=1)
    right = plan_drive(world, "turn_right", 60, seed=1)
    straight = plan_drive(world, "straight", 60, seed=1)
    assert _turn(left) == pytest.approx(90.0, abs=15.0)
    assert _turn(right) == pytest.approx(-90.0, abs=15.0)
    assert abs(_turn(straight)) < 45.0, "straight on may follow a bend, never a corner"
    # The turn is taken at the next junction: halfway through it the ego is inside a junction box, and it
    # entered no other junction before.
    graph = world.graph
    radius = np.array([graph.node_radius(n) for n in range(len(graph.nodes))])
    for poses in (left, right):
        heading = np.array([_heading(p) for p in poses])
        k = int(np.argmax(np.abs((heading - heading[0] + 180.0) % 360.0 - 180.0) > 45.0))
        dist = np.linalg.norm(poses[:, None, :2, 3] - graph.nodes[None], axis=2)  # (frames, nodes)
        junction = int(np.argmin(dist[k]))
        assert k > 0 and dist[k, junction] < radius[junction]
        inside = dist[:k] < radius
        inside[:, junction] = False
        assert not inside.any()
    for poses in (left, right, straight):
        step = np.linalg.norm(np.diff(poses[:, :2, 3], axis=0), axis=1)
        assert 0.4 <= step.mean() <= 1.3  # 4-13 m/s at 10 Hz
        ground = world.hdmap.ground_height(poses[:, 0, 3], poses[:, 1, 3])
        np.testing.assert_allclose(poses[:, 2, 3] - ground, 1.84, atol=0.05)


def test_road_networks_have_t_and_four_way_junctions_and_bends():
    graphs = [
        generate_road_graph(np.random.default_rng(seed), style) for seed in range(3) for style in STYLES
    ]
    degrees = {g.degree(n) for g in graphs for n in range(len(g.nodes))}
    assert {3, 4} <= degrees

    # A bent road leaves the chord between its junctions by more than a metre.
    def off_chord(line: np.ndarray) -> float:
        chord = (line[-1] - line[0]) / np.linalg.norm(line[-1] - line[0])
        rel = line - line[0]
        return float(np.abs(chord[0] * rel[:, 1] - chord[1] * rel[:, 0]).max())

    bends = [off_chord(r.centre) for g in graphs for r in g.roads]
    assert max(bends) > 1.0 and min(bends) < 1e-6


def test_worlds_hold_every_object_class_with_realistic_vehicles_in_their_places(urban, suburban):
    worlds = [urban, suburban, make_world(0, "highway")]
    seen = {OBJECT_CLASSES[i] for w in worlds for i in np.unique(w.scenery.label)}
    seen |= {a.cls for w in worlds for a in w.actors}
    assert seen == set(OBJECT_CLASSES)
    limits = {
        "car": ((3.6, 5.2), (1.6, 2.0)),
        "van": ((4.5, 6.0), (1.8, 2.1)),
        "truck": ((6.5, 12.0), (2.3, 2.6)),
    }
    x, y, _, _ = urban.table.poses(0.0)
    for i, a in enumerate(urban.actors):
        if a.cls in limits:
            (l0, l1), (w0, w1) = limits[a.cls]
            assert l0 <= a.size[0] <= l1 and w0 <= a.size[1] <= w1, (a.cls, a.size)
            where = MAP_CLASSES[urban.hdmap.class_at(x[i : i + 1], y[i : i + 1])[0]]
            allowed = {"road", "lane_marking", "crosswalk", "intersection"} if a.moving else {"parking"}
            assert where in allowed, (a.cls, a.moving, where)
    # Terrain slopes gently and buildings carry their heights in the vector layer.
    grade = np.gradient(urban.hdmap.terrain.astype(np.float64), urban.hdmap.terrain_resolution)
    assert 0.0 < max(np.abs(g).max() for g in grade) < 0.08
    heights = [f["properties"]["height"] for f in urban.hdmap.layers["building"]]
    assert heights and min(heights) > 2.5


def test_no_return_beyond_max_range(urban):
    sensor = Sensor.from_angles(
        "short", np.linspace(5.0, -20.0, 16), width=256, max_range=25.0, mount_height=1.8
    )
    poses = plan_drive(urban, "straight", 2, seed=0, mount_height=1.8)
    ground = urban.hdmap.ground_height(poses[:, 0, 3], poses[:, 1, 3])
    np.testing.assert_allclose(poses[:, 2, 3] - ground, 1.8, atol=0.05)
    full = LidarSimulator(replace(sensor, max_range=120.0), seed=0).scan(urban, poses[0])
    scan = LidarSimulator(sensor, seed=0).scan(urban, poses[0])
    assert (full.image.range > 25.5).any(), "the scene must reach past 25 m for this test to mean anything"
    assert scan.image.range.max() <= 25.0
    assert np.linalg.norm(scan.points[:, :3], axis=1).max() <= 25.0 + 1e-3
    classes = urban.hdmap.range_view_classes(poses[0], sensor)
    assert classes[0].max() == 0 and (classes[-1] > 0).all(), "ground beyond max range is no ground"


def test_angular_culling_finds_every_hit_brute_force_finds(urban):
    # The caster only tests the rows and columns each solid can cover; testing every ray against every
    # solid must find the same nearest hits (porosity off, so no ray passes through a hole).
    sensor = HDL32.with_width(256)
    pose = plan_drive(urban, "turn_left", 1, seed=4)[0]
    near = urban.shapes_near(pose[0, 3], pose[1, 3], 30.0)
    shapes = replace(near, porosity=np.zeros_like(near.porosity))
    origin = pose[:3, 3]
    dirs = sensor.ray_directions().reshape(-1, 3) @ pose[:3, :3].T
    yaw, tilt = _rotation_yaw_tilt(pose)
    t, _, _ = cast(shapes, origin, dirs, yaw, tilt + 0.01, sensor.elevations, sensor.width, sensor.max_range)
    brute = np.full(len(dirs), np.inf)
    for kind in (BOX, CYLINDER, ELLIPSOID):
        sel = np.flatnonzero(shapes.kind == kind)
        ray, prim = np.repeat(np.arange(len(dirs)), len(sel)), np.tile(sel, len(dirs))
        c, size, yaw_p = shapes.center[prim], shapes.size[prim], shapes.yaw[prim]
        if kind == BOX:
            tt, _ = intersect_boxes(origin, dirs[ray], c, size, yaw_p)
        elif kind == CYLINDER:
            tt, _ = intersect_cylinders(origin, dirs[ray], c, size)
        else:
            tt, _ = intersect_ellipsoids(origin, dirs[ray], c, size, yaw_p)
        np.minimum.at(brute, ray, tt)
    assert np.isfinite(brute).sum() > 1000
    np.testing.assert_array_equal(np.isfinite(t), np.isfinite(brute))
    np.testing.assert_allclose(t[np.isfinite(t)], brute[np.isfinite(brute)], atol=1e-6)


def test_scan_points_round_trip_through_the_range_image(urban):
    sensor = HDL32.with_width(512)
    pose = plan_drive(urban, "turn_left", 1, seed=4)[0]
    scan = LidarSimulator(sensor, seed=1).scan(urban, pose, 0.0)
    assert scan.points.dtype == np.float32 and len(scan.points) > 5000
    back = project(scan.points, sensor)
    np.testing.assert_array_equal(back.mask, scan.image.mask)
    np.testing.assert_allclose(back.range, scan.image.range, atol=1e-3)
    assert scan.image.intensity.min() >= 0.0 and scan.image.intensity.max() <= 1.0


def test_range_view_classes_is_fast_and_matches_the_map(urban):
    sensor = HDL32.with_width(512)
    pose = plan_drive(urban, "straight", 1, seed=0)[0]
    best = np.inf
    for _ in range(5):
        t0 = time.perf_counter()
        classes = urban.hdmap.range_view_classes(pose, sensor)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.020
    assert classes.shape == sensor.shape and classes.dtype == np.uint8
    up = sensor.elevations > 0
    assert (classes[up] == 0).all(), "rays above the horizon meet no ground on gentle terrain"
    assert (classes[-1] == MAP_CLASS_INDEX["road"]).mean() > 0.3 or (classes[-1] > 0).all()


def test_moving_actors_move_and_map_exports(urban):
    b0, b1 = urban.boxes(0.0), urban.boxes(1.0)
    moved = np.linalg.norm(b1["boxes"][:, :2] - b0["boxes"][:, :2], axis=1)
    moving = np.array(
        [a.moving for a in urban.actors if a.cls in ("car", "van", "truck", "pedestrian", "cyclist")]
    )
    assert moving.any() and (moved[moving] > 0.5).mean() > 0.8 and (moved[~moving] == 0).all()
    layers = {name for name, features in urban.hdmap.layers.items() if features}
    assert {"road", "lane_marking", "crosswalk", "sidewalk", "building", "intersection"} <= layers
    json.dumps(urban.hdmap.layers)
    bev = urban.hdmap.bev_raster(resolution=1.0, extent=40.0)
    assert bev.shape == (80, 80) and bev.max() < len(MAP_CLASSES)
    # Ego-centred: row 10, column 20 of a 1 m, +-20 m raster is 9.5 m ahead and 0.5 m to the right.
    pose = plan_drive(urban, "turn_right", 1, seed=1)[0]
    ego = urban.hdmap.bev_raster(resolution=1.0, extent=20.0, pose=pose)
    fwd = pose[:2, 0] / np.linalg.norm(pose[:2, 0])
    left = np.array([-fwd[1], fwd[0]])
    for (i, j), (ahead, side) in {
        (10, 20): (9.5, -0.5),
        (39, 0): (-19.5, 19.5),
        (0, 39): (19.5, -19.5),
    }.items():
        xy = pose[:2, 3] + ahead * fwd + side * left
        assert ego[i, j] == urban.hdmap.class_at(xy[:1], xy[1:])[0]


def test_scanned_moving_actors_lie_inside_their_boxes_at_each_frame_time(urban):
    # Boxes and the solids a sweep sees are placed by the same clock: a moving actor's returns at t = 1 s
    # fall inside its t = 1 s box, which lies elsewhere than its t = 0 box.
    sensor = HDL32.with_width(512)
    poses = plan_drive(urban, "straight", 11, seed=0)[[0, 10]]
    seq = simulate_sequence(urban, poses, sensor, seed=0, times=np.array([0.0, 1.0]))
    moving = {a.id for a in urban.actors if a.moving}
    checked = 0
    for frame, pose, boxes in zip(seq.frames, seq.poses, seq.boxes, strict=True):
        world_pts = frame.points[:, :3].astype(np.float64) @ pose[:3, :3].T + pose[:3, 3]
        inst = frame.instance_image[frame.image.mask]
        for (cx, cy, cz, length, width, height, yaw), box_id in zip(
            boxes["boxes"], boxes["box_id"], strict=True
        ):
            sel = inst == box_id
            if box_id not in moving or sel.sum() < 5:
                continue
            dx, dy = world_pts[sel, 0] - cx, world_pts[sel, 1] - cy
            along, across = np.cos(yaw) * dx + np.sin(yaw) * dy, -np.sin(yaw) * dx + np.cos(yaw) * dy
            assert (np.abs(along) <= length / 2 + 0.2).all() and (np.abs(across) <= width / 2 + 0.2).all()
            assert (np.abs(world_pts[sel, 2] - cz) <= height / 2 + 0.2).all()
            checked += 1
    assert checked >= 3, "the drive must see some moving actors for this test to mean anything"
    b0, b1 = (dict(zip(b["box_id"].tolist(), b["boxes"], strict=True)) for b in seq.boxes)
    shifts = [np.hypot(*(b1[i][:2] - b0[i][:2])) for i in b0.keys() & b1.keys() & moving]
    assert shifts and np.median(shifts) > 0.5


def test_one_profile_per_style_and_a_dataset_draws_every_style_by_its_weight():
    assert STYLES == ("urban", "suburban", "highway")  # the order seeds worlds: append only
    assert sum(STYLE_PROFILES[s].dataset_weight for s in STYLES) == pytest.approx(1.0)
    drawn = [sequence_spec(0, i).style for i in range(400)]
    for style in STYLES:
        assert drawn.count(style) / len(drawn) == pytest.approx(STYLE_PROFILES[style].dataset_weight, abs=0.08)
    with pytest.raises(ValueError, match="unknown world style 'rural'"):
        style_profile("rural")


def test_bad_inputs_are_named(urban):
    with pytest.raises(ValueError, match="style"):
        make_world(0, "rural")
    with pytest.raises(ValueError, match="action"):
        plan_drive(urban, "reverse", 10)
    with pytest.raises(ValueError, match="pose"):
        LidarSimulator(HDL32).scan(urban, np.eye(3))
    for make in (
        lambda: make_world(-1),
        lambda: plan_drive(urban, "straight", 3, seed=-2),
        lambda: LidarSimulator(HDL32, seed=1.5),
    ):
        with pytest.raises(ValueError, match="seed must be a non-negative integer"):
            make()
    with pytest.raises(ValueError, match="ego_boxes"):
        SensorModelConfig(ego_boxes=((-1.0, 1.0, 1.0, -0.2),))


def test_dataset_written_and_read_back_identical(tmp_path):
    from lidar.sim.__main__ import main

    sensor = HDL32.with_width(128)
    assert (
        main(
            [
                "--sensor",
                "hdl32",
                "--width",
                "128",
                "--sequences",
                "2",
                "--frames",
                "3",
                "--seed",
                "5",
                "--out",
                str(tmp_path),
                "--points",
            ]
        )
        == 0
    )
    ds = SimDataset(tmp_path)
    assert len(ds) == 2 and ds.sensor == sensor
    fresh = generate_sequence(sequence_spec(5, 1), sensor, 3)
    arrays = ds.load_sequence(1)
    np.testing.assert_array_equal(arrays["range"], np.stack([f.image.range for f in fresh.frames]))
    np.testing.assert_array_equal(arrays["map_classes"], fresh.map_classes)
    np.testing.assert_array_equal(arrays["poses"], fresh.poses)
    np.testing.assert_array_equal(
        arrays["points"][arrays["point_offsets"][2] : arrays["point_offsets"][3]], fresh.frames[2].points
    )
    back = HDMap.from_dict(arrays)
    np.testing.assert_array_equal(back.raster, fresh.hdmap.raster)
    np.testing.assert_array_equal(back.terrain, fresh.hdmap.terrain)
    assert back.layers == json.loads(json.dumps(fresh.hdmap.layers))
    for t, b in enumerate(fresh.boxes):
        at_t = arrays["box_frame"] == t
        np.testing.assert_array_equal(arrays["boxes"][at_t], b["boxes"])
        np.testing.assert_array_equal(arrays["box_class"][at_t], b["box_class"])
        np.testing.assert_array_equal(arrays["box_id"][at_t], b["box_id"])
    assert arrays["box_frame"].max() == 2


@pytest.mark.parametrize(
    "args,named",
    [
        (["--sensor", "hdl99"], "unknown sensor 'hdl99'"),
        (["--sequences", "-1"], "sequences=-1"),
        (["--frames", "0"], "frames=0"),
        (["--width", "0"], "width"),
        (["--workers", "0"], "workers"),
        (["--seed", "-3"], "seed"),
        (["--out", "{file}/sub"], "not a writable directory"),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_status_2(tmp_path, capsys, args, named):
    from lidar.sim.__main__ import main

    blocker = tmp_path / "file"
    blocker.write_text("a file where the output folder should go")
    out = tmp_path / "out"
    argv = ["--sequences", "1", "--frames", "1", "--width", "64", "--out", str(out)]
    argv += [a.format(file=blocker) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not (out / "manifest.json").exists()


def test_simulate_sequence_accepts_custom_poses(urban):
    sensor = HDL32.with_width(128)
    poses = plan_drive(urban, "straight", 2, seed=3)
    poses[1, :3, 3] += [0.0, 0.0, 0.5]
    seq = simulate_sequence(urban, poses, sensor, seed=0)
    assert len(seq) == 2 and seq.map_classes.shape == (2, 32, 128)
    with pytest.raises(ValueError, match="poses"):
        simulate_sequence(urban, np.eye(4), sensor)


def test_sidewalks_stand_one_curb_above_the_road_and_the_ego_body_blocks_its_rays(urban):
    from lidar.sim.hdmap import CURB_HEIGHT

    sensor = HDL32.with_width(512)
    pose = plan_drive(urban, "straight", 1, seed=5)[0]
    sim = LidarSimulator(
        sensor, seed=0, config=replace(SensorModelConfig.for_sensor(sensor), range_noise=0.0)
    )
    scan = sim.scan(urban, pose)
    world_pts = scan.points[:, :3].astype(np.float64) @ pose[:3, :3].T + pose[:3, 3]
    above = world_pts[:, 2] - urban.hdmap.terrain_height(world_pts[:, 0], world_pts[:, 1])
    road = scan.labels == MAP_CLASS_INDEX["road"]
    sidewalk = scan.labels == MAP_CLASS_INDEX["sidewalk"]
    assert road.sum() > 100 and sidewalk.sum() > 100
    np.testing.assert_allclose(np.median(above[road]), 0.0, atol=0.01)
    np.testing.assert_allclose(np.median(above[sidewalk]), CURB_HEIGHT, atol=0.01)
    assert sim._ego_mask.any() and not scan.image.mask[sim._ego_mask].any()


REAL_SCANS = real_scans_dir()
@pytest.mark.skipif(
    not (REAL_SCANS / "nuscenes_lidaraisolution_ff9eff4389a740848f9a56ad749a4ae8.bin").exists(),
    reason=f"real scans not found under {REAL_SCANS}",
)
def test_simulated_hdl32_statistics_stay_near_the_real_nuscenes_sweep():
    from lidar.sim.realism import real_images, scan_stats, sim_images

    real = scan_stats(real_images("hdl32", REAL_SCANS)[0], HDL32)
    sim = [scan_stats(im, HDL32) for im in sim_images(HDL32, worlds=2, frames=1)]
    returns = np.mean([s.returns for s in sim])
    assert abs(returns / real.returns - 1) < 0.25
    assert abs(np.mean([s.intensity_pct[1] for s in sim]) / real.intensity_pct[1] - 1) < 0.5
    assert abs(np.mean([s.ring_radius[0] for s in sim]) / real.ring_radius[0] - 1) < 0.1
    assert abs(np.mean([s.range_pct[1] for s in sim]) / real.range_pct[1] - 1) < 0.3


@pytest.mark.slow
def test_hdl32_sweeps_meet_the_speed_target_on_one_core(urban):
    # The floor is 10 HDL-32E sweeps (32x1024) per second on one core; CPU time keeps a loaded box fair.
    sim = LidarSimulator(HDL32, seed=0)
    poses = plan_drive(urban, "straight", 20, seed=0)
    sim.scan(urban, poses[0])
    times = []
    for i, pose in enumerate(poses):
        t0 = time.process_time()
        sim.scan(urban, pose, i * 0.1)
        times.append(time.process_time() - t0)
    assert np.median(times) < 0.1, f"median {np.median(times) * 1e3:.0f} ms per sweep"


# ------------------------------------------------------------------------- HDMap.range_view (conditioning v2)
def _flat_map(raised_from_x: float | None = None, layers: dict | None = None) -> HDMap:
    """A flat map at height 0: road, or sidewalk (raised) wherever x >= `raised_from_x`."""
    raster = np.full((400, 400), MAP_CLASS_INDEX["road"], dtype=np.uint8)
    if raised_from_x is not None:
        xs = -100.0 + 0.5 * (np.arange(400) + 0.5)
        raster[:, xs >= raised_from_x] = MAP_CLASS_INDEX["sidewalk"]
    return HDMap(layers=layers or {}, raster=raster, origin=(-100.0, -100.0), resolution=0.5,
                 terrain=np.zeros((3, 3), np.float32), terrain_origin=(-200.0, -200.0), terrain_resolution=200.0)


def _building(x0: float, x1: float, y0: float, y1: float, height: float) -> dict:
    ring = [[x1, y1], [x0, y1], [x0, y0], [x1, y0], [x1, y1]]
    return {"geometry": {"type": "Polygon", "coordinates": [ring]}, "properties": {"height": height}}


def test_map_ground_range_on_a_flat_map_is_mount_height_over_the_sine_of_the_beam():
    sensor = HDL32.with_width(128)
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    view = _flat_map().range_view(pose, sensor)
    analytic = sensor.mount_height / np.sin(-sensor.elevations)
    hits = (sensor.elevations < 0) & (analytic <= sensor.max_range)
    assert hits.sum() >= 20
    np.testing.assert_allclose(view.ground[hits], np.broadcast_to(analytic[hits, None], (hits.sum(), 128)), rtol=1e-4)
    assert (view.ground[~hits] == 0).all(), "no ground above the horizon or beyond max range"
    assert (view.classes[hits] == MAP_CLASS_INDEX["road"]).all() and (view.classes[~hits] == 0).all()
    assert (view.building == 0).all() and (view.vegetation == 0).all(), "a map without footprints hits none"
    assert view.ground.dtype == view.building.dtype == np.float32 and view.ground.shape == sensor.shape


def test_a_raised_class_is_met_one_curb_higher_at_a_shorter_range():
    from lidar.sim.hdmap import CURB_HEIGHT

    sensor = HDL32.with_width(128)
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    view = _flat_map(raised_from_x=0.0).range_view(pose, sensor)  # sidewalk ahead, road behind
    down = sensor.elevations < np.deg2rad(-3.0)
    ahead, behind = sensor.width // 2, 0
    np.testing.assert_allclose(
        view.ground[down, ahead], (sensor.mount_height - CURB_HEIGHT) / np.sin(-sensor.elevations[down]), rtol=1e-4
    )
    np.testing.assert_allclose(view.ground[down, behind], sensor.mount_height / np.sin(-sensor.elevations[down])
                               / np.cos(sensor.azimuths[behind] - np.pi), rtol=1e-3)
    assert (view.classes[down, ahead] == MAP_CLASS_INDEX["sidewalk"]).all()
    assert (view.classes[down, behind] == MAP_CLASS_INDEX["road"]).all()
    # range_view_classes is the same ground class the range view carries
    np.testing.assert_array_equal(_flat_map(raised_from_x=0.0).range_view_classes(pose, sensor), view.classes)


def test_a_building_footprint_straight_ahead_gives_its_walls_distance_up_to_its_height():
    sensor = HDL32.with_width(256)
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    hdmap = _flat_map(layers={"building": [_building(20.0, 30.0, -10.0, 10.0, height=4.0)]})
    boxes = hdmap.footprint_boxes["building"]
    assert boxes.shape == (1, 7)
    np.testing.assert_allclose(boxes[0, [0, 1, 3, 4]], [25.0, 0.0, 10.0, 20.0], atol=1e-6)
    view = hdmap.range_view(pose, sensor)
    col = sensor.width // 2
    el = sensor.elevations
    wall = 20.0 / (np.cos(el) * np.cos(sensor.azimuths[col]))
    z = sensor.mount_height + wall * np.sin(el)
    on_wall = (z > 0.05) & (z < 4.0 - 0.05)
    assert on_wall.sum() >= 8
    np.testing.assert_allclose(view.building[on_wall, col], wall[on_wall], rtol=1e-5)
    above = z > 4.0 + 0.05
    assert above.any() and (view.building[above, col] == 0).all(), "nothing above the roof line"
    assert (view.building[:, : sensor.width // 4] == 0).all(), "nothing behind the sensor"
    assert (view.vegetation == 0).all()


def test_a_green_area_is_a_vegetation_block_of_the_fixed_height():
    from lidar.sim.hdmap import VEGETATION_HEIGHT

    green = _building(-20.0, -10.0, -5.0, 5.0, height=1.0)
    green["properties"] = {}
    hdmap = _flat_map(layers={"vegetation": [green]})
    box = hdmap.footprint_boxes["vegetation"][0]
    assert box[2] + box[5] / 2 == pytest.approx(VEGETATION_HEIGHT)  # top of the block above the flat terrain
    sensor = HDL32.with_width(256)
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    view = hdmap.range_view(pose, sensor)
    assert (view.vegetation[:, 0] > 0).any() and (view.vegetation[:, sensor.width // 2] == 0).all()
    assert (view.building == 0).all()


def test_a_barrier_footprint_is_met_in_the_building_layer_where_it_is_nearer():
    sensor = HDL32.with_width(256)
    pose = np.eye(4)
    pose[2, 3] = sensor.mount_height
    wall = _building(10.0, 10.3, -8.0, 8.0, height=3.0)
    hdmap = _flat_map(layers={"building": [_building(20.0, 30.0, -10.0, 10.0, height=6.0)], "barrier": [wall]})
    view = hdmap.range_view(pose, sensor)
    col, el = sensor.width // 2, sensor.elevations
    at_wall = 10.0 / (np.cos(el) * np.cos(sensor.azimuths[col]))
    z = sensor.mount_height + at_wall * np.sin(el)
    low, high = (z > 0.05) & (z < 3.0 - 0.05), (z > 3.1) & (sensor.mount_height + 20.0 * np.tan(el) < 5.9)
    assert low.sum() >= 4 and high.any()
    np.testing.assert_allclose(view.building[low, col], at_wall[low], rtol=1e-5)  # the wall hides the building
    assert (view.building[high, col] > 19.9).all(), "above the wall the building behind it is met"


def test_a_worlds_walls_and_fences_are_in_its_map_as_barriers():
    from lidar.sim.actors import BARRIER_CLASSES

    world = make_world(3, "highway")
    features = world.hdmap.layers["barrier"]
    walls = world.scenery.label == OBJECT_CLASS_INDEX["wall"]
    assert len(features) == int((walls | (world.scenery.label == OBJECT_CLASS_INDEX["fence"])).sum()) > 0
    assert {f["properties"]["class"] for f in features} <= set(BARRIER_CLASSES)
    boxes = world.hdmap.footprint_boxes["barrier"]
    # each footprint matches a wall solid of the scenery: same centre and length, top at the solid's top
    centres = world.scenery.center[walls, :2]
    for box in boxes[:10]:
        k = np.argmin(np.linalg.norm(centres - box[:2], axis=1))
        assert np.linalg.norm(centres[k] - box[:2]) < 1e-2
        assert box[3] == pytest.approx(2 * world.scenery.size[walls][k, 0], abs=1e-2)
        assert box[2] + box[5] / 2 == pytest.approx(world.scenery.center[walls][k, 2] + world.scenery.size[walls][k, 2], abs=0.05)
    # and the map survives the dataset round trip with them
    again = type(world.hdmap).from_dict(world.hdmap.to_dict())
    np.testing.assert_allclose(again.footprint_boxes["barrier"], boxes)


def test_the_layout_leaves_out_the_actors_the_sweep_leaves_out(urban):
    """Traffic is not planned around the ego: an actor driving through the sensor is dropped from the scan
    (`shapes_near`), and must be dropped from the layout the model is given too, or it draws a phantom car."""
    from lidar.sim import LidarSimulator

    sensor = HDL32.with_width(256)
    tab = urban.table
    mover = int(tab.mov_index[0])
    x, y, z, _ = (a[mover] for a in tab.poses(1.0))
    pose = np.eye(4)
    pose[:3, 3] = (x, y, z + sensor.mount_height)
    everyone, seen = urban.boxes(1.0), urban.boxes(1.0, ego_pose=pose)
    assert tab.ids[mover] in everyone["box_id"] and tab.ids[mover] not in seen["box_id"]
    parked = set(tab.ids[~tab.moving]) & set(everyone["box_id"])
    assert parked and parked <= set(seen["box_id"]) <= set(everyone["box_id"]) - {tab.ids[mover]}
    scan = LidarSimulator(sensor, seed=0).scan(urban, pose, 1.0)
    left_out = set(everyone["box_id"]) - set(seen["box_id"])
    assert not left_out & set(np.unique(scan.instance_image)), "the sweep has none of the actors the layout lacks"
    far = np.eye(4)
    far[:3, 3] = (x + 40.0, y + 40.0, z + sensor.mount_height)
    assert tab.ids[mover] in urban.boxes(1.0, ego_pose=far)["box_id"]


def test_box_range_view_matches_brute_force_on_a_worlds_actor_layout(urban):
    from lidar.boxes import box_range_view
    from tests.helpers import brute_force_view

    sensor = HDL32.with_width(256)
    boxes = urban.boxes(0.0)["boxes"].astype(np.float64)
    pose = plan_drive(urban, "straight", 1, seed=0)[0]
    near = np.hypot(boxes[:, 0] - pose[0, 3], boxes[:, 1] - pose[1, 3]) < sensor.max_range + 10
    view = box_range_view(boxes, pose, sensor)
    expected_range, expected_index = brute_force_view(boxes, pose, sensor)
    assert near.sum() >= 5 and (expected_range > 0).sum() > 50, "the drive must see some actors"
    np.testing.assert_array_equal(view.index, expected_index)
    np.testing.assert_allclose(view.range, expected_range, atol=1e-4)


def test_a_window_ray_stops_in_the_rooms_behind_the_facade_not_behind_the_building(urban):
    """Buildings are not hollow: a ray through a window meets the inner core ROOM_DEPTH behind the facade.

    Before the core existed a window ray crossed the whole building and returned from whatever stood behind
    it (another building's face, the ground beyond): points no map-conditioned model could place.
    """
    from lidar.sim import LidarSimulator
    from lidar.sim.actors import ROOM_DEPTH

    sensor = HDL32.with_width(512)
    facade = len(MAP_CLASSES) + OBJECT_CLASS_INDEX["facade"]
    footprints = urban.hdmap.footprint_boxes["building"]
    depths = []
    for pose in plan_drive(urban, "straight", 3, seed=1):
        scan = LidarSimulator(sensor, seed=0, config=NOISELESS).scan(urban, pose, 0.0)
        entry = urban.hdmap.range_view(pose, sensor).building
        through = (scan.label_image == facade) & (scan.image.range > entry + 0.5) & (entry > 0)
        world = pose[:3, 3] + (sensor.ray_directions()[through] * scan.image.range[through][:, None]) @ pose[:3, :3].T
        # how far inside its building's outline each such point lies (negative: outside every building)
        dx = world[:, None, 0] - footprints[None, :, 0]
        dy = world[:, None, 1] - footprints[None, :, 1]
        c, s = np.cos(footprints[:, 6]), np.sin(footprints[:, 6])
        u, v = c * dx + s * dy, -s * dx + c * dy
        inside = np.minimum(footprints[:, 3] / 2 - np.abs(u), footprints[:, 4] / 2 - np.abs(v))
        depths.append(inside.max(axis=1))
    depth = np.concatenate(depths)
    assert len(depth) > 100, "the drive must see through some windows"
    # in the rooms: well inside a building, not on the face of one behind it
    assert np.mean(depth > ROOM_DEPTH - 0.3) > 0.9, np.mean(depth > ROOM_DEPTH - 0.3)


def test_holes_in_a_porous_wall_are_places_seen_alike_from_every_pose():
    """A window is a window from every pose: which rays pass a porous solid depends on where they meet it.

    Drawn per ray, a fifth of every facade flickered between wall and room from sweep to sweep.
    """
    porosity, grain = 0.3, 1.0
    wall = Shapes.from_rows([(BOX, (12.0, 0.0, 5.0), (0.2, 15.0, 5.0), 0.0, 0.5, 0, -1, porosity, grain)])
    solid = replace(wall, porosity=np.zeros(1, np.float32))
    sensor = HDL32.with_width(1024)
    seen: dict[tuple[int, int], set[bool]] = {}
    for y in (0.0, 0.35, 0.8):
        origin = np.array([0.0, y, 1.8])
        dirs = sensor.ray_directions().reshape(-1, 3)
        args = (origin, dirs, 0.0, 0.01, sensor.elevations, sensor.width, sensor.max_range)
        t_solid = cast(solid, *args)[0]
        t_porous = cast(wall, *args)[0]
        meets = np.isfinite(t_solid)
        face = origin + dirs[meets] * t_solid[meets, None]
        # the near face's cells, away from their edges where two neighbouring cells share a ray's footprint
        cell = np.floor(face[:, 1:] / grain).astype(int)
        inner = (np.abs(face[:, 1:] / grain - np.round(face[:, 1:] / grain)) > 0.05).all(axis=1)
        for key, passed in zip(map(tuple, cell[inner]), ~np.isfinite(t_porous[meets][inner]), strict=True):
            seen.setdefault(key, set()).add(bool(passed))
    assert len(seen) > 100
    assert all(len(answers) == 1 for answers in seen.values()), "a cell let some rays through and stopped others"
    holes = np.mean([answers == {True} for answers in seen.values()])
    assert abs(holes - porosity) < 0.1, holes


def test_a_worlds_trees_and_hedges_are_in_its_map_and_in_the_vegetation_view(urban):
    from lidar.sim.actors import PLANT_CLASSES

    crowns = (urban.scenery.kind == ELLIPSOID) & (urban.scenery.label == OBJECT_CLASS_INDEX["tree"])
    features = urban.hdmap.layers["plant"]
    assert crowns.sum() > 10 and len(features) >= crowns.sum()
    assert {f["properties"]["class"] for f in features} <= set(PLANT_CLASSES)
    # every crown is listed where it stands, its footprint's top at the crown's top
    boxes = urban.hdmap.footprint_boxes["plant"]
    tops = urban.scenery.center[crowns, 2] + urban.scenery.size[crowns, 2]
    for centre, top in zip(urban.scenery.center[crowns][:10], tops[:10], strict=True):
        k = np.argmin(np.linalg.norm(boxes[:, :2] - centre[:2], axis=1))
        assert np.linalg.norm(boxes[k, :2] - centre[:2]) < 1e-2
        assert boxes[k, 2] + boxes[k, 5] / 2 == pytest.approx(top, abs=0.2)  # footprints stand on the terrain, a curb below
    # the vegetation channel meets the plants: a tree seen from beside it is in the view
    sensor = HDL32.with_width(512)
    crown = urban.scenery.center[crowns][0]
    pose = np.eye(4)
    pose[:3, 3] = (crown[0] - 8.0, crown[1], crown[2] - 2.0)
    plain = type(urban.hdmap).from_dict({**urban.hdmap.to_dict()})
    plain.layers.pop("plant")
    with_plants, without = urban.hdmap.range_view(pose, sensor).vegetation, plain.range_view(pose, sensor).vegetation
    assert with_plants[with_plants > 0].min() < 8.0, "the crown 8 m ahead is met before its centre"
    assert (with_plants > 0).sum() > (without > 0).sum()

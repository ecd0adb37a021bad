"""Sensor presets match their datasheets; custom sensors are data that validates itself."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import re

import numpy as np
import pytest

import lidar.sensors
from lidar.sensors import HDL32, HDL64, OS1_64, OS1_128, PRESETS, VLP16, Sensor, get_sensor


@pytest.mark.parametrize(
    ("sensor", "beams", "top", "bottom", "max_range"),
    [
        (HDL64, 64, 2.0, -24.9, 120.0),
        (HDL32, 32, 10.67, -30.67, 100.0),
        (VLP16, 16, 15.0, -15.0, None),
        (OS1_64, 64, 22.5, -22.5, None),
        (OS1_128, 128, 22.5, -22.5, None),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_presets_match_the_issue_table(sensor, beams, top, bottom, max_range):
    assert sensor.height == beams
    assert sensor.elevations_deg[0] == pytest.approx(top)
    assert sensor.elevations_deg[-1] == pytest.approx(bottom)
    if max_range is not None:
        assert sensor.max_range == max_range
    assert sensor.elevations_deg == tuple(sorted(sensor.elevations_deg, reverse=True))


def test_hdl32_beams_are_spaced_1_33_degrees_and_ouster_beams_uniformly():
    np.testing.assert_allclose(np.diff(HDL32.elevations_deg), -1.333, atol=2e-3)
    for sensor in (OS1_64, OS1_128):
        steps = np.diff(sensor.elevations_deg)
        np.testing.assert_allclose(steps, steps.mean(), atol=1e-3)


def test_custom_sensor_from_unordered_angles():
    sensor = Sensor.from_angles("custom", [-5.0, 3.0, 0.0, 3.0, -10.0], width=256, max_range=80.0)
    assert sensor.elevations_deg == (3.0, 0.0, -5.0, -10.0)
    assert sensor.shape == (4, 256)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"elevations_deg": ()}, "empty"),
        ({"elevations_deg": (1.0, 2.0)}, "strictly decreasing"),
        ({"elevations_deg": (95.0, 0.0)}, r"within \(-90, 90\)"),
        ({"elevations_deg": (1.0, 0.0), "width": 4}, "width"),
        ({"elevations_deg": (1.0, 0.0), "min_range": 5.0, "max_range": 2.0}, "min_range"),
        ({"elevations_deg": (1.0, 0.0), "mount_height": -1.0}, "mount_height"),
    ],
)
def test_invalid_sensor_fields_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sensor(name="bad", **kwargs)


def test_sensor_survives_json_and_rejects_unknown_fields():
    for sensor in PRESETS.values():
        assert Sensor.from_dict(json.loads(json.dumps(sensor.to_dict()))) == sensor
    with pytest.raises(ValueError, match="unknown sensor fields"):
        Sensor.from_dict({**HDL32.to_dict(), "fov": 40})
    with pytest.raises(ValueError, match=r"\['elevations_deg'\] are missing"):
        Sensor.from_dict({"name": "no-beams", "width": 512})


def test_get_sensor_by_name_or_alias():
    assert get_sensor("KITTI") is HDL64
    assert get_sensor(" nuscenes ") is HDL32
    assert get_sensor("os1_128") is OS1_128
    with pytest.raises(ValueError, match="unknown sensor 'hdl99'"):
        get_sensor("hdl99")


def test_ray_directions_are_unit_rows_top_first_and_centre_column_ahead():
    sensor = HDL32.with_width(64)
    dirs = sensor.ray_directions()
    assert dirs.shape == (32, 64, 3)
    np.testing.assert_allclose(np.linalg.norm(dirs, axis=-1), 1.0)
    elev = np.degrees(np.arcsin(dirs[:, 0, 2]))
    np.testing.assert_allclose(elev, sensor.elevations_deg, atol=1e-9)
    centre = dirs[0, 32]
    assert centre[0] > 0 and abs(np.arctan2(centre[1], centre[0])) < np.pi / 64 + 1e-12


def test_the_ray_table_is_the_ray_directions_computed_once_and_read_only():
    sensor = HDL32.with_width(64)
    table = sensor.ray_table()
    assert table is sensor.ray_table() and table is HDL32.with_width(64).ray_table()  # one per sensor
    assert not table.flags.writeable
    dirs = sensor.ray_directions()
    assert np.array_equal(dirs, table) and dirs.flags.writeable and dirs is not table  # the caller's copy
    assert sensor.with_width(32).ray_table().shape == (32, 32, 3)


def test_with_width_keeps_the_beams():
    narrow = OS1_64.with_width(512)
    assert narrow.width == 512 and narrow.elevations_deg == OS1_64.elevations_deg and narrow.name == OS1_64.name


def test_every_preset_has_a_docstring_citing_its_sources():
    """An attribute docstring (the string right after the assignment) is what pdoc/Sphinx show for a preset."""
    body = ast.parse(inspect.getsource(lidar.sensors)).body
    docs = {}
    for stmt, after in itertools.pairwise(body):
        if isinstance(stmt, ast.Assign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[stmt.targets[0].id] = after.value.value
    for sensor in PRESETS.values():
        const = next(name for name, value in vars(lidar.sensors).items() if value is sensor)
        assert const in docs, f"preset {const} has no docstring"
        assert "Source" in docs[const] and "datasheet" in docs[const], f"{const} docstring cites no source"
        cited = {float(v) for v in re.findall(r"\d+(?:\.\d+)?", docs[const])}
        for angle in (sensor.elevations_deg[0], sensor.elevations_deg[-1]):
            assert abs(angle) in cited, f"{const}: the docstring does not cite its {angle} deg beam"

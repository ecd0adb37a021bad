"""Beam upsampling and completion (`inference.upsample`): every input point comes back bit for bit, the target
beam table, the rays filled, what fills them, and the errors for bad input; on a sweep of a known scene and on
a real KITTI sweep when the shared data is there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from rerun.chunk import RrdReader

from inference import load_pipeline
from inference.__main__ import main
from inference.limits import APP_LIMITS, LIBRARY_LIMITS
from inference.network import RETURN
from inference.upsample import (
    EDGE_AWARE,
    LINEAR,
    MAX_FACTOR,
    MODEL,
    NEAREST,
    RECORD_NAME,
    interpolate,
    largest_factor,
    planar_range,
    plane_weights,
    sample_grid,
    target_sensor,
    upsample,
    upsample_target,
)
from lidar.errors import InputError
from lidar.export4d import Sweep, Track, write_bag
from lidar.formats import Scan, read_points, sweep_geometry, write_points
from lidar.range_image import RangeImage, azimuth_columns, project
from lidar.real_scans import real_scans_dir
from lidar.recordings import open_container
from lidar.sensors import HDL64, Sensor
from tests.helpers import (
    SCENE_GROUND_M,
    ring_sweep,
    scene_ranges,
    sweep_points,
    tiny_model,
    write_release,
)

ELEVATIONS = np.linspace(10.0, -24.0, 16)
WIDTH = 256
REPO = Path(__file__).resolve().parents[1]
KITTI = real_scans_dir().parent / "real_seq" / "kitti00" / "velodyne" / "000000.bin"


def sweep(seed: int = 0, **kwargs) -> Scan:
    points, ring = ring_sweep(ELEVATIONS, WIDTH, seed, **kwargs)
    return Scan(points=points, ring=ring, ring_source="file")


def bits(points: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(points, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("method", [EDGE_AWARE, LINEAR, NEAREST])
def test_every_input_point_comes_back_bit_for_bit_and_first(method):
    scan = sweep()
    # points that share a pixel with another: the same rays a little farther, and a near one on a beam's row
    twins = scan.points[::7].copy()
    twins[:, :3] *= np.float32(1.013)
    points = np.concatenate([scan.points, twins])
    ring = np.concatenate([scan.ring, scan.ring[::7]])
    result = upsample(None, Scan(points=points, ring=ring, ring_source="file"), 4, method=method)
    n = len(points)
    assert result.input_count == n
    assert np.array_equal(bits(result.points[:n]), bits(points))
    assert not result.filled[:n].any() and result.filled[n:].all()
    assert np.array_equal(result.rings[:n], ring * 4)  # each measured beam on its own row of the target
    assert len(result.points) > 2.5 * n  # three new beams per gap, most of them returning


def test_a_float64_array_without_intensity_keeps_its_coordinates_as_float32():
    scan = sweep(seed=1)
    xyz = scan.points[:, :3].astype(np.float64)  # in scan order: its rings are recovered from the order
    result = upsample(None, xyz, 2)
    assert np.array_equal(bits(result.points[: len(xyz), :3]), bits(xyz.astype(np.float32)))
    assert (result.points[: len(xyz), 3] == 0).all()
    assert result.sensor.height == 2 * len(ELEVATIONS) - 1


def test_the_factor_puts_beams_evenly_between_the_measured_ones_at_their_columns():
    measured = Sensor.from_angles("m", [2.0, 1.0, -3.0], width=1000)
    target = target_sensor(measured, 4)
    np.testing.assert_allclose(target.elevations_deg, [2.0, 1.75, 1.5, 1.25, 1.0, 0.0, -1.0, -2.0, -3.0])
    assert target.width == 1000 and target.name == "m-x4"
    assert target_sensor(measured, 1).elevations_deg == measured.elevations_deg


def test_the_new_beams_are_filled_and_the_measured_beams_keep_their_silent_rays():
    result = upsample(None, sweep(), 4)
    new = np.ones(result.sensor.height, dtype=bool)
    new[::4] = False
    assert np.array_equal(result.mask, np.broadcast_to(new[:, None], result.mask.shape))
    measured_rows = result.image.range[::4]
    assert np.array_equal(measured_rows, result.given.range[::4])  # a measured beam's silent ray stays silent
    assert set(np.unique(result.rings[result.filled])) <= set(np.flatnonzero(new))


def test_edge_aware_is_planar_so_the_road_between_beams_is_exact_and_linear_is_not():
    elevations = np.linspace(-4.0, -24.0, 16)
    points, ring = ring_sweep(elevations, WIDTH, drop=0.0, wall=False, box=False)
    scan = Scan(points=points, ring=ring, ring_source="file")
    errors = {}
    for method in (EDGE_AWARE, LINEAR):
        result = upsample(None, scan, 4, method=method)
        truth = scene_ranges(result.sensor.elevations_deg, result.sensor.azimuths, wall=False, box=False)
        filled = result.mask
        errors[method] = np.abs(result.image.range[filled] - truth[filled]).max()
    assert errors[EDGE_AWARE] < 1e-3 * SCENE_GROUND_M * 10
    assert errors[LINEAR] > 0.1


def test_planar_range_follows_any_plane_through_two_returns():
    el = np.radians(np.array([-2.0, -9.0]))
    normal, d = np.array([-0.05, 0.0, 1.0]), -1.8  # a road rising ahead: n . p = d
    ray = np.stack([np.cos(el), np.zeros(2), np.sin(el)], axis=1)
    r = d / (ray @ normal)
    mid = np.radians(-5.0)
    expected = d / (np.array([np.cos(mid), 0.0, np.sin(mid)]) @ normal)
    weights = plane_weights(el[:1], el[1:], np.array([mid]))
    np.testing.assert_allclose(planar_range(r[:1], r[1:], weights), [expected], rtol=1e-9)


def test_the_edge_aware_fill_follows_a_slanted_edge_the_vertical_cuts_across():
    sensor = Sensor.from_angles("s", np.linspace(0.0, -8.0, 9), width=360)
    az = sensor.azimuths[None, :]
    el = sensor.elevations[:, None]
    # a near face whose edge runs at 45 degrees through the range image: near left of it, far right
    near = (np.degrees(az) - np.degrees(el)) > 0
    truth = np.where(near, 10.0, 40.0) * np.ones(sensor.shape)
    known = np.zeros(sensor.shape, dtype=bool)
    known[::4] = True
    given = RangeImage(np.where(known, truth, 0.0).astype(np.float32), np.zeros(sensor.shape, np.float32))
    fill = ~known
    errors = {m: np.abs(interpolate(given, fill, sensor, m).range - truth)[fill].mean() for m in (EDGE_AWARE, LINEAR)}
    assert errors[EDGE_AWARE] < 0.5 * errors[LINEAR]


def test_completion_fills_the_masked_rays_on_the_sweeps_own_table():
    scan = sweep(seed=2, drop=0.0)
    geometry = sweep_geometry(scan)
    truth = project(scan.points, geometry.sensor, ring=geometry.rows)
    rng = np.random.default_rng(0)
    dropped = rng.random(truth.shape) < 0.5
    pixel_of = geometry.rows * geometry.sensor.width + azimuth_columns(scan.points[:, :2], geometry.sensor.width)
    keep = ~dropped.reshape(-1)[pixel_of]
    given = Scan(points=scan.points[keep], ring=scan.ring[keep], ring_source="file")
    result = upsample(None, given, sensor=geometry.sensor, mask=dropped)
    assert result.sensor.shape == truth.shape
    assert np.array_equal(bits(result.points[: keep.sum()]), bits(scan.points[keep]))
    filled_rays = np.zeros(truth.shape, dtype=bool)
    filled_rays[result.image.mask & ~result.given.mask] = True
    assert not (filled_rays & ~dropped).any()  # nothing outside the mask is filled
    assert filled_rays.sum() > 0.9 * (dropped & truth.mask).sum()
    scored = filled_rays & truth.mask
    linear = upsample(None, given, sensor=geometry.sensor, mask=dropped, method=LINEAR)
    error, linear_error = (np.abs(r.image.range - truth.range)[scored] for r in (result, linear))
    assert np.median(error) < 0.25 * np.median(linear_error)  # the road between beams: planar, not straight
    assert error.mean() < linear_error.mean()


def test_without_a_mask_completion_fills_every_silent_ray_of_a_cut_out_sector():
    scan = sweep(seed=3, drop=0.0)
    az = np.degrees(np.arctan2(scan.points[:, 1], scan.points[:, 0]))
    keep = ~((az > 20) & (az < 50))
    result = upsample(None, Scan(points=scan.points[keep], ring=scan.ring[keep], ring_source="file"), 1)
    assert result.mask.sum() == (~result.given.mask).sum()
    filled = result.points[result.filled]
    filled_az = np.degrees(np.arctan2(filled[:, 1], filled[:, 0]))
    assert ((filled_az > 21) & (filled_az < 49)).sum() > 0.9 * (~keep).sum()


def test_a_preset_name_gives_its_beams_at_the_sweeps_columns_and_a_sensor_is_taken_as_given():
    scan = sweep()
    named = upsample(None, scan, sensor="hdl64")
    assert named.sensor.elevations_deg == HDL64.elevations_deg
    assert named.sensor.width == sweep_geometry(scan).sensor.width != HDL64.width
    given = HDL64.with_width(128)
    assert upsample(None, scan, sensor=given).sensor == given


def test_the_model_fills_the_masked_rays_with_its_sample_and_keeps_the_input(one_torch_thread):
    model = tiny_model(seed=1)
    with torch.no_grad():  # an untrained head returns nothing where the prior is silent; this one returns
        model.head[-1].bias[RETURN] += 10.0
    points, ring = ring_sweep(np.linspace(10.0, -20.0, 8), 64)
    scan = Scan(points=points, ring=ring, ring_source="file")
    first = upsample(model, scan, 2, method=MODEL, steps=2, seed=3)
    again = upsample(model, scan, 2, method=MODEL, steps=2, seed=3)
    other = upsample(model, scan, 2, method=MODEL, steps=2, seed=4)
    assert np.array_equal(bits(first.points[: len(points)]), bits(points))
    assert np.array_equal(first.points, again.points)
    assert not np.array_equal(first.image.range, other.image.range)
    changed = first.image.range != first.given.range
    assert changed.any() and not (changed & ~first.mask).any()
    sample = sample_grid(model, first.given, replace(first.sensor, max_range=model.sensor.max_range), 2, 3)
    np.testing.assert_array_equal(first.image.range[first.mask], sample.range[first.mask])
    assert first.filled.sum() == first.mask.sum()


def test_the_pipeline_delegates_and_checks_its_sampling_arguments(tmp_path, one_torch_thread):
    pipe = load_pipeline(write_release(tmp_path / "release", tiny_model(seed=2)), device="cpu")
    scan = sweep()
    result = pipe.upsample(scan, 2)
    assert result.method == EDGE_AWARE and result.sensor.height == 31
    assert pipe.upsample(scan, 2, method=MODEL, steps=1).method == MODEL
    with pytest.raises(InputError, match="steps"):
        pipe.upsample(scan, method=MODEL, steps=0)
    wide = Sensor.from_angles("wide", np.linspace(10, -20, 128), width=2560)  # within the library's, over the app's
    assert pipe.upsample(scan, sensor=wide, method=NEAREST).sensor == wide
    with pytest.raises(InputError, match="expected at most 262,144"):
        pipe.upsample(scan, sensor=wide, limits=APP_LIMITS)


def _no_rings() -> np.ndarray:
    """A cloud with no beams: points spread over every elevation in no order."""
    points = sweep_points(0)
    return points[np.random.default_rng(0).permutation(len(points))]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(factor=0), r"factor must be an integer in \[1, 8\]"),
    (dict(factor=64), r"factor must be an integer in \[1, 8\]"),
    (dict(factor=True), "factor must be an integer"),
    (dict(factor=2.5), "factor must be an integer"),
    (dict(factor=2, sensor="hdl64"), "not both"),
    (dict(sensor=Sensor.from_angles("big", np.linspace(10, -20, 128), width=8192)), "1,048,576 rays"),
    (dict(sensor=Sensor.from_angles("big", np.linspace(10, -20, 128), width=4097)), "expected at most 524,288"),
    (dict(sensor="no-such-lidar"), "no-such-lidar"),
    (dict(sensor=42), "sensor must be"),
    (dict(mask=np.ones((3, 3), dtype=bool)), "mask must be"),
    (dict(method="bicubic"), "method must be one of"),
    (dict(method=MODEL), "needs a world model"),
])
def test_bad_arguments_are_one_input_error(kwargs, message):
    with pytest.raises(InputError, match=message):
        upsample(None, sweep(), **kwargs)


@pytest.mark.parametrize(("points", "message"), [
    (_no_rings(), "no beams"),
    (np.full((500, 4), np.nan, np.float32), "NaN or inf"),
    (np.zeros((0, 4), np.float32), "non-empty"),
    (np.zeros((10, 2), np.float32), r"\(N, 3\+\)"),
    (RangeImage(np.ones((4, 8), np.float32), np.zeros((4, 8), np.float32)), "RangeImage"),
    (Scan(points=np.ones((10, 4), np.float32), sensor_frame=False), "not in the sensor frame"),
])
def test_bad_points_are_one_input_error(points, message):
    with pytest.raises(InputError, match=message):
        upsample(None, points, 4)


def test_more_beams_than_a_ring_field_holds_is_refused():
    points, ring = ring_sweep(np.linspace(10.0, -20.0, 64), 64)
    with pytest.raises(InputError, match="at most 256 beams"):
        upsample(None, Scan(points=points, ring=ring, ring_source="file"), MAX_FACTOR)


def test_limits_other_than_the_librarys_apply():
    sensor = Sensor.from_angles("s", np.linspace(10, -20, 16), width=4096)
    with pytest.raises(InputError, match="expected at most 1,024"):
        upsample(None, sweep(), sensor=sensor, limits=type(LIBRARY_LIMITS)(1, 1, 1.0, max_rays=1024))


def test_a_factor_past_the_limits_is_refused_naming_the_largest_factor_and_the_presets_that_fit():
    limits = type(LIBRARY_LIMITS)(1, 1, 1.0, max_rays=10_000)  # 16 x 255 measured: factor 2 is 7,905 rays, 3 11,730
    with pytest.raises(InputError) as refused:
        upsample(None, sweep(), 4, limits=limits)
    assert str(refused.value) == ("factor 4 puts 61 x 255 = 15,555 rays on this 16 x 255 sweep; expected at most "
                                  "10,000 rays: at most factor 2 fits it, or the presets hdl32, vlp16")
    assert largest_factor(sweep_geometry(sweep()).sensor, limits) == 2
    assert upsample(None, sweep(), 2, limits=limits).sensor.shape == (31, 255)
    with pytest.raises(InputError, match="at most factor 2 fits it"):
        upsample(None, sweep(), 3, limits=limits)
    with pytest.raises(InputError, match=r"sensor hdl64 puts 64 x 255 = 16,320 rays .* at most factor 2"):
        upsample(None, sweep(), sensor="hdl64", limits=limits)
    with pytest.raises(InputError, match=r"expected at most 256 beams: at most factor 4 fits it"):
        upsample(None, Scan(points=(d := ring_sweep(np.linspace(10.0, -20.0, 64), 64))[0], ring=d[1]), MAX_FACTOR)
    tiny = type(LIBRARY_LIMITS)(1, 1, 1.0, max_rays=1_000)
    with pytest.raises(InputError, match=r"expected at most 1,000 rays: not even the sweep's own table \(factor 1\)"):
        upsample(None, sweep(), 1, limits=tiny)


def test_the_target_worked_out_first_and_passed_back_gives_the_same_result():
    for kwargs in (dict(factor=3), dict(factor=1), dict(sensor="hdl32")):
        target = upsample_target(sweep(), **kwargs)
        asked, passed = upsample(None, sweep(), **kwargs), upsample(None, sweep(), sensor=target)
        assert target == asked.sensor
        assert np.array_equal(bits(asked.points), bits(passed.points)) and np.array_equal(asked.mask, passed.mask)
    with pytest.raises(InputError, match="at most factor"):
        upsample_target(sweep(), 4, limits=type(LIBRARY_LIMITS)(1, 1, 1.0, max_rays=10_000))


@pytest.mark.skipif(not KITTI.exists(), reason=f"shared KITTI sweep not found at {KITTI}")
def test_a_real_kitti_sweep_from_16_of_its_64_rings():
    scan = read_points(KITTI)
    geometry = sweep_geometry(scan)
    truth = project(scan.points, geometry.sensor, ring=geometry.rows)
    keep = (geometry.rows >= 0) & (geometry.rows % 4 == 0)
    given = Scan(points=scan.points[keep], ring=geometry.rows[keep], ring_source="file")
    errors, masks = {}, {}
    for method in (EDGE_AWARE, LINEAR):
        result = upsample(None, given, sensor=geometry.sensor, method=method)
        assert np.array_equal(bits(result.points[: keep.sum()]), bits(scan.points[keep]))
        assert np.array_equal(result.rings[: keep.sum()], geometry.rows[keep])
        both = result.mask & result.image.mask & truth.mask
        errors[method] = np.abs(result.image.range - truth.range)[both].mean()
        masks[method] = result.image.mask
    assert np.array_equal(masks[EDGE_AWARE], masks[LINEAR])
    assert errors[EDGE_AWARE] < 0.95 * errors[LINEAR]
    whole = upsample(None, scan, 4)  # the file's own rings, from its scan order
    assert whole.sensor.height == 4 * 63 + 1 and np.array_equal(bits(whole.points[: len(scan.points)]), bits(scan.points))


# ---------------------------------------------------------------------------------------------- the command line

REAL_SCAN = real_scans_dir() / "kitti_patchworkpp_000000.bin"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=4))


@pytest.mark.skipif(not REAL_SCAN.exists(), reason=f"shared real scan not found at {REAL_SCAN}")
def test_the_command_upsamples_a_real_scan_end_to_end(release, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "inference", "upsample", "--model", str(release), "--scan",
                           str(REAL_SCAN), "--factor", "2", "--out", str(out), "--format", "ply"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / RECORD_NAME).read_text())
    original = read_points(REAL_SCAN).points
    written = read_points(out / record["file"])
    assert record["input_points"] == len(original) and record["points"] == len(written.points)
    assert np.array_equal(bits(written.points[: len(original)]), bits(original))
    assert record["sensor"]["name"] == "hdl64-measured-x2" and written.ring_source == "file"
    assert written.ring.max() == len(record["sensor"]["elevations_deg"]) - 1
    assert "upsampled.ply" in done.stdout
    views = [chunk for chunk in RrdReader(out / "result.rrd").stream().to_chunks()
             if chunk.entity_path.endswith("/lidar/points")]  # the input beside the result, read with rerun-sdk
    assert sorted(chunk.entity_path for chunk in views) == ["/world/generated/lidar/points", "/world/observed/lidar/points"]
    shown = {chunk.entity_path: chunk.to_record_batch() for chunk in views}
    positions = next(n for n in shown["/world/generated/lidar/points"].schema.names if n.endswith("Points3D:positions"))
    assert len(shown["/world/generated/lidar/points"].column(positions).to_pylist()[0]) == record["points"]
    made = open_container(out / "result.mcap", topic="/generated/points")
    np.testing.assert_array_equal(made[0].points, written.points)
    np.testing.assert_array_equal(made[0].ring, written.ring)


HDL32_PCAP = real_scans_dir().parent / "recordings" / "velodyne_hdl32_pcap" / "hdl32_example.pcap"


@pytest.mark.skipif(not HDL32_PCAP.exists(), reason=f"shared HDL-32E capture not found at {HDL32_PCAP}")
def test_the_command_upsamples_a_chosen_sweep_of_a_real_pcap(release, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["upsample", "--model", str(release), "--scan", str(HDL32_PCAP), "--sweep", "2", "--factor", "2",
                 "--out", str(out), "--quiet"]) == 0
    record = json.loads((out / RECORD_NAME).read_text())
    recording = open_container(HDL32_PCAP)
    original = recording[2].points
    written = read_points(out / record["file"])
    assert record["request"]["sweep"] == 2 and record["request"]["name"] == recording.names[2]
    assert record["input_points"] == len(original) and not np.array_equal(original, recording[1].points)
    assert np.array_equal(bits(written.points[: len(original)]), bits(original))
    assert len(record["sensor"]["elevations_deg"]) == 2 * 32 - 1  # the HDL-32E's measured beams, one between each
    for args, message in ((["--scan", str(HDL32_PCAP), "--sweep", str(len(recording))],
                           f"holds {len(recording)} sweeps; expected 0 to {len(recording) - 1}"),
                          (["--scan", str(REAL_SCAN), "--sweep", "1"], "is one sweep file")):
        assert main(["upsample", "--model", str(release), *args, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_the_command_takes_a_sweep_of_a_bags_chosen_topic_or_of_a_zip_and_refuses_what_it_cannot_pick(
        release, tmp_path, capsys):
    sweeps = [ring_sweep(ELEVATIONS, WIDTH, seed) for seed in range(3)]
    bag = write_bag(tmp_path / "drive.mcap", [
        Track("a", [Sweep(sweeps[0][0], 1_700_000_000_000_000_000, None, sweeps[0][1])], topic="/points"),
        Track("b", [Sweep(points, 1_700_000_000_000_000_000 + 100_000_000 * k, None, ring)
                    for k, (points, ring) in enumerate(sweeps[1:])], topic="/points_raw")])
    archive = tmp_path / "sweeps.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for k, (points, ring) in enumerate(sweeps):
            zf.write(write_points(tmp_path / f"{k:06d}.pcd", points, ring=ring), f"{k:06d}.pcd")
    for source, extra, chosen in ((bag, ["--topic", "/points_raw", "--sweep", "1"], 2), (archive, ["--sweep", "1"], 1)):
        out = tmp_path / source.suffix[1:]
        assert main(["upsample", "--model", str(release), "--scan", str(source), *extra, "--out", str(out),
                     "--quiet"]) == 0
        record = json.loads((out / RECORD_NAME).read_text())
        written = read_points(out / record["file"]).points
        assert record["input_points"] == len(sweeps[chosen][0]) and record["request"]["sweep"] == 1
        assert np.allclose(written[: record["input_points"], :3], sweeps[chosen][0][:, :3], atol=1e-6)
    refusals = (([str(bag)], "2 sensor_msgs/msg/PointCloud2 topics"),
                ([str(archive), "--sweep", "3"], "holds 3 sweeps; expected 0 to 2"),
                ([str(tmp_path / "missing.pcd")], "no such file or folder"),
                ([str(tmp_path / "000000.pcd"), "--topic", "/points"], "is no recording"))
    for args, message in refusals:
        assert main(["upsample", "--model", str(release), "--scan", *args, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_the_command_fills_a_synthetic_sweep_with_the_model_in_any_format(release, tmp_path, capsys,
                                                                          one_torch_thread):
    points, ring = ring_sweep(ELEVATIONS, WIDTH)
    scan_file = write_points(tmp_path / "sweep.pcd", points, ring=ring)
    for fmt in ("npz", "las", "bin"):
        out = tmp_path / fmt
        assert main(["upsample", "--model", str(release), "--scan", str(scan_file), "--sensor", "vlp16",
                     "--method", "model", "--steps", "1", "--out", str(out), "--format", fmt, "--quiet"]) == 0
        record = json.loads((out / RECORD_NAME).read_text())
        written = read_points(out / f"upsampled.{fmt}")
        assert record["method"] == MODEL and record["request"]["sensor"] == "vlp16"
        assert len(written.points) == record["points"] >= len(points)
        assert np.allclose(written.points[: len(points), :3], points[:, :3], atol=1e-3 if fmt == "las" else 0)
    assert "wrote upsampled.bin" in capsys.readouterr().out


def test_the_command_refuses_an_earlier_result_unless_told_to_overwrite(release, tmp_path, capsys, monkeypatch):
    points, ring = ring_sweep(ELEVATIONS, WIDTH)
    scan_file = write_points(tmp_path / "sweep.pcd", points, ring=ring)
    for module in ("lidar.formats", "lidar.formats.io"):  # the sweep is read in a bounded worker, not here
        monkeypatch.setattr(f"{module}.read_points", lambda *a, **k: pytest.fail("read in the caller's process"))
    args = ["upsample", "--model", str(release), "--scan", str(scan_file), "--out", str(tmp_path / "out")]
    assert main([*args, "--format", "ply"]) == 0
    assert main(args) == 2
    assert "already holds an upsampled sweep" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([RECORD_NAME, "result.mcap", "result.rrd",
                                                                          "upsampled.pcd"])


@pytest.mark.parametrize(("extra", "message"), [
    (["--factor", "0"], r"--factor must be an integer in \[1, 8\]"),
    (["--factor", "64"], r"--factor must be an integer in \[1, 8\]"),
    (["--sensor", "no-such-lidar"], "no-such-lidar"),
])
def test_bad_arguments_on_the_command_line_are_one_error_line_and_exit_2(release, tmp_path, capsys, extra, message):
    points, ring = ring_sweep(ELEVATIONS, WIDTH)
    scan_file = write_points(tmp_path / "sweep.pcd", points, ring=ring)
    assert main(["upsample", "--model", str(release), "--scan", str(scan_file), "--out", str(tmp_path / "o"),
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0])


def test_a_cloud_without_rings_on_the_command_line_is_one_error_line(release, tmp_path, capsys):
    scan_file = write_points(tmp_path / "cloud.bin", _no_rings())
    assert main(["upsample", "--model", str(release), "--scan", str(scan_file), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no beams (rings) can be recovered" in err[0]

"""`python -m lidar info|convert|render` end to end on real files; errors are one line and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lidar.cli import main
from lidar.formats import read_points, write_points
from lidar.range_image import beam_rows
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL32, HDL64
from tests.helpers import run_cli_with_a_bug

REPO = Path(__file__).resolve().parents[1]
REAL_SCANS = real_scans_dir()
KITTI = REAL_SCANS / "kitti_patchworkpp_000000.bin"


@pytest.fixture
def hdl32_bin(tmp_path) -> Path:
    """An HDL-32E-like sweep with a road below the sensor, written as a KITTI .bin."""
    sensor = HDL32.with_width(1024)
    rng = np.random.default_rng(0)
    ranges = rng.uniform(3.0, 60.0, size=sensor.shape)
    down = sensor.elevations < 0
    ranges[down] = np.minimum(ranges[down], (sensor.mount_height / np.sin(-sensor.elevations[down]))[:, None])
    xyz = (sensor.ray_directions() * ranges[..., None]).reshape(-1, 3)
    points = np.concatenate([xyz, rng.uniform(0, 1, (len(xyz), 1))], axis=1)
    return write_points(tmp_path / "sweep.bin", points)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lidar", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_info_prints_counts_coverage_scale_and_sensor(hdl32_bin, capsys):
    assert main(["info", str(hdl32_bin)]) == 0
    out = capsys.readouterr().out
    assert "points:      32,768" in out
    assert "360 of 360" in out
    assert "file values / 1" in out
    assert "hdl32-measured (32 beams, +10.7 to -30.7 deg, 1024 columns); project keeps 100.0%" in out


@pytest.mark.skipif(not KITTI.exists(), reason=f"shared real scans not found at {REAL_SCANS}")
def test_info_json_on_a_real_kitti_scan_matches_its_readme(capsys):
    assert main(["info", str(KITTI), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["points"] == 124_668 and info["format"] == "kitti-bin"
    assert info["columns"] == ["x", "y", "z", "intensity"]
    assert info["range_m"]["min"] == pytest.approx(1.3, abs=0.1)  # data README: 1.3 / 9.8-10.1 / 80
    assert 9.8 <= info["range_m"]["median"] <= 10.1
    assert info["range_m"]["max"] == pytest.approx(80, abs=0.5)
    assert info["elevation_deg"]["min"] == pytest.approx(-25.2, abs=0.1)
    assert info["azimuth_coverage_deg"] == 360
    assert info["likely_sensor"]["name"] == "hdl64-measured" and info["kept_fraction"] > 0.78


def test_convert_to_pcd_keeps_every_point(hdl32_bin, tmp_path, capsys):
    out = tmp_path / "out" / "sweep.pcd"
    assert main(["convert", str(hdl32_bin), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    np.testing.assert_array_equal(read_points(out).points, read_points(hdl32_bin).points)


def test_convert_to_nuscenes_derives_the_ring_from_the_sensor(hdl32_bin, tmp_path):
    out = tmp_path / "sweep.pcd.bin"
    assert main(["convert", str(hdl32_bin), str(out), "--sensor", "nuscenes"]) == 0
    scan = read_points(out)
    source = read_points(hdl32_bin).points
    np.testing.assert_array_equal(scan.ring, beam_rows(source, HDL32))
    assert scan.format == "nuscenes-bin" and scan.intensity_scale == 255.0


def test_convert_to_nuscenes_without_a_detectable_sensor_asks_for_one(tmp_path, capsys):
    points = np.random.default_rng(1).uniform(-20, 20, size=(500, 4)).astype(np.float32)
    points[:, 2] = np.abs(points[:, 2])  # everything above the origin: no sensor fits
    points[:, 3] = 0.5
    src = write_points(tmp_path / "odd.bin", points)
    assert main(["convert", str(src), str(tmp_path / "odd.pcd.bin")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lidar: error:") and "--sensor" in err and len(err.splitlines()) == 1


def test_render_bev_and_range_views(hdl32_bin, tmp_path):
    bev, rng = tmp_path / "bev.png", tmp_path / "range.png"
    assert main(["render", str(hdl32_bin), "--out", str(bev)]) == 0
    assert main(["render", str(hdl32_bin), "--out", str(rng), "--view", "range"]) == 0
    with Image.open(bev) as img:
        assert img.size == (800, 800) and np.asarray(img).any()
    with Image.open(rng) as img:
        pixels = np.asarray(img)
        assert img.size == (1024, 32 * 4)
        assert (pixels.reshape(-1, 3).any(axis=1)).mean() > 0.99  # every pixel of this full sweep has a return


@pytest.mark.skipif(not REAL_SCANS.is_dir(), reason=f"shared real scans not found at {REAL_SCANS}")
def test_range_view_of_a_scan_not_in_the_sensor_frame_needs_a_sensor(tmp_path, capsys):
    pandaset = REAL_SCANS / "pandaset_bynow76_000000.bin"
    assert main(["render", str(pandaset), "--out", str(tmp_path / "p.png"), "--view", "range"]) == 2
    assert "not in the sensor frame" in capsys.readouterr().err
    assert main(["render", str(pandaset), "--out", str(tmp_path / "p.png"), "--view", "range", "--sensor", "hdl64"]) == 0
    with Image.open(tmp_path / "p.png") as img:
        assert img.size == (HDL64.width, HDL64.height * 4)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["info", "/nonexistent/scan.bin"], "no such file"),
        (["render", "x.bin"], "--out"),
        (["frobnicate"], "invalid choice"),
        (["info", "README.md"], ".md files are not read here; expected a sweep file (.bin, .pcd"),
    ],
)
def test_errors_are_one_line_on_stderr_with_exit_status_2(args, expected):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lidar: error:") and expected in lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["render", "{src}", "--out", "{tmp}/picture.bin"], r"picture\.bin: cannot save a picture as \.bin; expected --out ending in \.png"),
        (["render", "{src}", "--out", "{tmp}"], "without an extension; expected --out ending in .png"),
        (["info", "{src}", "--sensor", "hdl99"], "unknown sensor 'hdl99'; expected one of"),
        (["render", "{src}", "--out", "{tmp}/b.png", "--extent", "-5"], r"argument --extent: expected a number of metres in \(0, 256\], got '-5'"),
        (["render", "{src}", "--out", "{tmp}/b.png", "--extent", "1e9"], r"argument --extent: expected a number of metres in \(0, 256\], got '1e9'"),
        (["convert", "{src}", "{tmp}/out.xyz"], r"out\.xyz: cannot tell the format from the extension \.xyz; expected one of"),
        (["info", "{tmp}"], "not a regular file; expected a point-cloud file"),
    ],
)
def test_bad_arguments_name_what_was_wrong_and_what_was_expected(hdl32_bin, tmp_path, capsys, args, expected):
    argv = [a.format(src=hdl32_bin, tmp=tmp_path) for a in args]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's usage errors leave through SystemExit
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lidar: error:")
    assert re.search(expected, err), err
    assert not (tmp_path / "b.png").exists()


def test_module_entry_point_runs_info(hdl32_bin):
    result = run_cli("info", str(hdl32_bin), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["points"] == 32_768


def test_points_at_3e38_are_refused_by_convert_to_las_in_one_line(tmp_path):
    """Float32-finite but absurd points used to end in an OverflowError traceback inside laspy."""
    points = np.full((2000, 4), 0.5, dtype="<f4")
    points[:, :3] = np.random.default_rng(1).uniform(-3e38, 3e38, (2000, 3))
    src = tmp_path / "absurd.npy"
    np.save(src, points)
    result = run_cli("convert", str(src), str(tmp_path / "out.las"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "points lie farther than 1000 m from the sensor" in lines[0], lines
    assert not (tmp_path / "out.las").exists()


def test_a_bug_is_a_traceback_with_exit_status_1_not_a_user_error(hdl32_bin):
    """Only an InputError is the user's mistake; anything else must surface as the bug it is."""
    result = run_cli_with_a_bug("lidar.cli", "summarize", ["info", str(hdl32_bin)], timeout=60)
    assert "lidar: error:" not in result.stderr


def test_an_unwritable_picture_is_an_error_line_not_a_traceback(hdl32_bin, tmp_path):
    result = run_cli("render", str(hdl32_bin), "--out", str(hdl32_bin / "b.png"))  # a file is not a folder
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.fullmatch(r"lidar: error: .*sweep\.bin/b\.png: cannot write \(.+\)", result.stderr.strip().splitlines()[-1])


def test_render_draws_a_sweep_of_a_recording_and_refuses_one_past_its_last(tmp_path, capsys):
    pcap = REPO / "examples" / "scans" / "velodyne_vlp16.pcap"
    assert main(["render", str(pcap), "--out", str(tmp_path / "v.png"), "--view", "range"]) == 0
    with Image.open(tmp_path / "v.png") as img:
        assert img.size[1] == 16 * 4  # the recording's own 16 beams
    assert main(["render", str(pcap), "--sweep", "5", "--out", str(tmp_path / "w.png")]) == 2
    assert "--sweep 5:" in capsys.readouterr().err and not (tmp_path / "w.png").exists()

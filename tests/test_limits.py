"""The request bounds: one module, the app's stricter than the library's, the library's within a config's; the
command line refusing absurd numbers by them; timestamps out of range."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

import inference
from inference.__main__ import main
from inference.limits import APP_LIMITS, CONFIG_MAX_GUIDANCE, CONFIG_MAX_STEPS, LIBRARY_LIMITS
from lidar.errors import MAX_MESSAGE_CHARS, InputError
from lidar.formats import PointCloudError
from lidar.sequence import open_recording
from tests.helpers import sweep_points


def test_the_app_is_no_looser_than_the_library_and_the_library_no_looser_than_a_config():
    for field in dataclasses.fields(LIBRARY_LIMITS):
        assert getattr(APP_LIMITS, field.name) <= getattr(LIBRARY_LIMITS, field.name), field.name
    assert APP_LIMITS.max_guidance < LIBRARY_LIMITS.max_guidance
    assert LIBRARY_LIMITS.max_steps <= CONFIG_MAX_STEPS and LIBRARY_LIMITS.max_guidance <= CONFIG_MAX_GUIDANCE
    assert (LIBRARY_LIMITS.max_frames, LIBRARY_LIMITS.max_steps) == (inference.MAX_FRAMES, inference.MAX_STEPS)


def test_checks_return_plain_numbers_and_name_the_bounds():
    assert APP_LIMITS.check_steps(np.int64(4)) == 4 and type(APP_LIMITS.check_steps(np.int64(4))) is int
    assert APP_LIMITS.check_guidance(2) == 2.0 and APP_LIMITS.check_frames(32) == 32
    with pytest.raises(InputError, match=r"guidance must be a number in \[0, 10.0\]"):
        APP_LIMITS.check_guidance(15.0)
    assert LIBRARY_LIMITS.check_guidance(15.0) == 15.0
    for bad in (float("nan"), "1", -0.5):
        with pytest.raises(InputError, match="guidance"):
            LIBRARY_LIMITS.check_guidance(bad)
    for bad in (0, 51, True, 2.0):
        with pytest.raises(InputError, match=r"steps must be an integer in \[1, 50\]"):
            LIBRARY_LIMITS.check_steps(bad)
    with pytest.raises(InputError, match=r"len\(poses\) must be an integer in \[1, 32\], got 33"):
        LIBRARY_LIMITS.check_frames(33, "len(poses)")


def test_seeds_are_bounded_by_what_torch_takes_and_the_app_by_its_number_fields():
    assert LIBRARY_LIMITS.check_seed(np.uint64(2**64 - 1)) == 2**64 - 1
    assert APP_LIMITS.max_seed == 2**31 - 1
    for bad in (-1, 2**64, True, 1.0, "3"):
        with pytest.raises(InputError, match=r"seed must be an integer in \[0, 18446744073709551615\]"):
            LIBRARY_LIMITS.check_seed(bad)


def test_a_refusal_quotes_what_it_got_capped():
    action = "x" * 5_000_000
    with pytest.raises(InputError) as err:
        LIBRARY_LIMITS.check_frames(action)
    assert len(str(err.value)) < 300 and "(5,000,000 characters)" in str(err.value)


# The command line: absurd numbers end in one error line before anything is read or allocated ----------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["resimulate", "--frames", "1000000000000"], "--frames must be an integer in [1, 32], got 1000000000000"),
        (["generate", "--frames", "33"], "--frames must be an integer in [1, 32], got 33"),
        (["forecast", "--seed", str(10**30)], "--seed must be an integer in [0, 18446744073709551615]"),
        (["generate", "--map-seed", "-1"], "--map-seed must be an integer in [0, 18446744073709551615], got -1"),
        (["generate", "--steps", "1000000000000"], "--steps must be an integer in [1, 50], got 1000000000000"),
        (["generate", "--guidance", "1e308"], "--guidance must be a number in [0, 20.0]"),
    ],
)
def test_an_absurd_number_on_the_command_line_is_one_error_line(tmp_path, capsys, argv, message):
    command, *rest = argv
    sources = {"generate": [], "forecast": ["--prefix", str(tmp_path / "missing.bin")],
               "resimulate": ["--scan", str(tmp_path / "missing.bin")]}[command]
    started = time.perf_counter()
    assert main([command, *sources, *rest, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert time.perf_counter() - started < 1.0  # refused before the scan (missing here) or a model is touched


@pytest.mark.parametrize("option", ["--frames", "--seed", "--steps"])
def test_a_number_too_long_to_parse_is_a_usage_error_quoting_it_capped(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", option, "9" * 5000, "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected a whole number, got '999" in err and "(5,000 characters)" in err
    assert len(err) < 1000


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_a_shift_or_yaw_must_be_finite(tmp_path, capsys, value):
    with pytest.raises(SystemExit):
        main(["resimulate", "--scan", str(tmp_path / "a.bin"), "--yaw", value, "--out", str(tmp_path / "o")])
    assert "argument --yaw: expected a finite number" in capsys.readouterr().err


# Timestamps out of range -----------------------------------------------------------------------------


def _raw_drive(folder: Path, clock_times: list[str]) -> Path:
    data = folder / "velodyne_points" / "data"
    data.mkdir(parents=True)
    for k in range(len(clock_times)):
        (data / f"{k:010d}.bin").write_bytes(sweep_points(k).astype("<f4").tobytes())
    (folder / "velodyne_points" / "timestamps.txt").write_text("\n".join(clock_times) + "\n")
    return folder


def test_kitti_raw_clock_times_keep_their_nanoseconds(tmp_path):
    folder = _raw_drive(tmp_path, ["2011-09-26 13:02:25.964389445", "2011-09-26 13:02:26.064389445",
                                   "2011-09-26 13:02:26.164"])
    np.testing.assert_allclose(open_recording(folder).times, [0.0, 0.1, 0.199610555], atol=1e-9)


@pytest.mark.parametrize("clock", ["9999-09-26 13:02:25.964389445", "1200-01-01 00:00:00", "2011-13-26 13:02:25",
                                   "NaT", "2011-09-26 13:02:25.1234567890"])
def test_a_kitti_raw_clock_time_out_of_range_is_refused_not_wrapped(tmp_path, clock):
    """Year 9999 read as datetime64[ns] wraps to 1816 without a warning."""
    folder = _raw_drive(tmp_path, ["2011-09-26 13:02:25.964389445", clock])
    with pytest.raises(PointCloudError, match=r"timestamps\.txt: line 2 \(.*\) is not a clock time from 1900-01-01"):
        open_recording(folder)


def test_a_times_txt_value_past_the_bound_is_refused(tmp_path):
    folder = tmp_path / "seq"
    (folder / "velodyne").mkdir(parents=True)
    for k in range(2):
        (folder / "velodyne" / f"{k:06d}.bin").write_bytes(sweep_points(k).astype("<f4").tobytes())
    (folder / "times.txt").write_text("0.0\n1e300\n")
    with pytest.raises(PointCloudError, match=r"times\.txt: a time of 1e\+300 s; expected seconds within 1e\+10"):
        open_recording(folder)
    (folder / "times.txt").write_text("1.3e9\n1300000000.1\n")  # Unix time is fine
    np.testing.assert_allclose(open_recording(folder).times, [1.3e9, 1.3e9 + 0.1])


def test_an_input_error_keeps_the_start_and_the_end_of_a_long_message():
    message = "scan.pcd: no x/y/z field among " + "f, " * 1_000_000 + "; expected at least x, y, z"
    text = str(InputError(message))
    assert len(text) <= MAX_MESSAGE_CHARS
    assert text.startswith("scan.pcd: no x/y/z field among f, ") and text.endswith("; expected at least x, y, z")
    assert "(3,000,058 characters, cut)" in text
    assert str(InputError("short")) == "short"

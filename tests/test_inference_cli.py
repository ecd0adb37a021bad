"""`python -m inference` writes what it generated, reports provenance, and ends bad input with one line + exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference import load_pipeline
from inference.__main__ import main
from lidar.formats import read_points
from lidar.formats.rings import scan_order
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL64, Sensor
from tests.helpers import (
    patched_zip,
    run_cli_with_a_bug,
    sweep_points,
    tiny_model,
    write_hub_cache,
    write_release,
)

REPO = Path(__file__).resolve().parents[1]
REAL_SCANS = real_scans_dir()
@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=4))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inference", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_writes_one_file_per_frame_poses_and_the_world(release, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(release),
        "--map-seed",
        "3",
        "--action",
        "turn_left",
        "--frames",
        "2",
        "--steps",
        "1",
        "--seed",
        "5",
        "--out",
        str(out),
        "--format",
        "bin",
        "--quiet",
    ]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "frames/s" in stdout and "wrote 2 frames" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "frame_000.bin",
        "frame_001.bin",
        "poses.json",
        "result.mcap",
        "result.rrd",
        "world.bin",
    ]
    meta = json.loads((out / "poses.json").read_text())
    expected = load_pipeline(release).generate_world(map=3, action="turn_left", frames=2, steps=1, seed=5)
    for record, frame in zip(meta["frames"], expected.frames, strict=True):
        np.testing.assert_array_equal(np.asarray(record["pose"]), frame.pose)
        # the frame's points, stored ring by ring
        stored = frame.points[scan_order(frame.points, frame.rings)]
        np.testing.assert_array_equal(read_points(out / record["file"]).points, stored)
    np.testing.assert_array_equal(read_points(out / "world.bin").points, expected.world)
    assert Sensor.from_dict(meta["sensor"]) == load_pipeline(release).sensor  # a generated world: the model's grid
    assert meta["model"]["source"] == str(release) and meta["model"]["iteration"] == 123
    assert meta["request"]["seed"] == 5 and meta["timings"]["frames_per_second"] > 0


def test_generate_draws_a_preset_at_the_columns_asked(release, tmp_path, capsys):
    """`--sensor hdl64 --columns 2048`: every frame on the HDL-64E's 64 beams at 2048 columns, recorded as such."""
    out = tmp_path / "hdl64"
    argv = ["generate", "--model", str(release), "--frames", "1", "--steps", "1", "--sensor", "hdl64",
            "--columns", "2048", "--out", str(out), "--format", "npz", "--quiet"]
    assert main(argv) == 0
    sensor = Sensor.from_dict(json.loads((out / "poses.json").read_text())["sensor"])
    assert (sensor.name, sensor.shape) == ("hdl64", (64, 2048))
    assert sensor.elevations_deg == HDL64.elevations_deg
    points = read_points(out / "frame_000.npz").points
    assert len(points) > 64 * 2048 // 4  # a frame at the preset's density, not the tiny model's 8 x 64
    assert len(points) <= 64 * 2048


def test_forecast_from_a_real_scan_file(release, tmp_path, capsys):
    scan = REAL_SCANS / "kitti_patchworkpp_000004.bin"
    if not scan.is_file():
        pytest.skip(f"shared real scan {scan} is absent")
    out = tmp_path / "fc"
    args = [
        "forecast",
        "--model",
        str(release),
        "--prefix",
        str(scan),
        "--action",
        "straight",
        "--frames",
        "1",
        "--steps",
        "1",
        "--out",
        str(out),
        "--format",
        "npz",
        "--quiet",
    ]
    assert main(args) == 0
    assert (out / "frame_000.npz").is_file() and (out / "world.npz").is_file()
    meta = json.loads((out / "poses.json").read_text())
    assert meta["request"]["prefix"] == [str(scan)] and meta["request"]["command"] == "forecast"
    # the frames' sensor, the sweep's own 64 x ~2,012 grid, not the tiny model's 8 x 64
    sensor = Sensor.from_dict(meta["sensor"])
    assert sensor == load_pipeline(release).grid(scans=[read_points(scan)]) and sensor.name == "hdl64-measured"
    assert sensor.height == 64 and 1990 <= sensor.width <= 2030
    assert meta["request"]["feedback"] is False
    fed = tmp_path / "fed"
    assert main([*args[:-5], "--out", str(fed), "--format", "npz", "--quiet", "--feedback"]) == 0
    assert json.loads((fed / "poses.json").read_text())["request"]["feedback"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["info", "--model", "{tmp}/nope"], "does not exist; expected a release folder"),
        (
            ["generate", "--model", "{release}", "--frames", "0", "--out", "{tmp}/o"],
            "frames must be an integer in [1, 32]",
        ),
        (
            ["generate", "--model", "{release}", "--steps", "99", "--out", "{tmp}/o"],
            "--steps must be an integer in [1, 50]",
        ),
        (
            ["forecast", "--model", "{release}", "--prefix", "{tmp}/empty.bin", "--out", "{tmp}/o"],
            "the file is empty",
        ),
        (
            ["generate", "--model", "{release}", "--sensor", "hdl65", "--out", "{tmp}/o"],
            "unknown sensor 'hdl65'; expected one of",
        ),
        (
            ["generate", "--model", "{release}", "--columns", "4", "--out", "{tmp}/o"],
            "columns 4: Sensor 'tiny8': width must be an integer >= 8, got 4",
        ),
        (
            ["generate", "--model", "{release}", "--sensor", "os1-128", "--columns", "100000", "--out", "{tmp}/o"],
            "expected at most 524,288",
        ),
        (
            ["generate", "--model", "{release}", "--out", "{tmp}"],
            "already holds a rollout (poses.json); choose another --out or pass --overwrite",
        ),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(release, tmp_path, capsys, args, message):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "poses.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, release=release) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_info_resolves_a_hub_id_offline_in_a_fresh_process(release, tmp_path):
    """HF_HUB_OFFLINE and HF_HUB_CACHE set before the process starts, as a user or a Space would."""
    cache = tmp_path / "hub"
    commit = write_hub_cache(cache, "lidarverse/tiny", release)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    done = run_cli("info", "--model", "hf://lidarverse/tiny@main", "--json", env=env)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["kind"], info["revision"], info["iteration"], info["weights"]) == ("hub", commit, 123, "ema")
    assert info["sensor_shape"] == [8, 64]

    missing = run_cli("info", "--model", "lidarverse/other", env=env)
    assert missing.returncode == 2
    assert (
        missing.stderr.count("\n") == 1
        and "HF_HUB_OFFLINE" in missing.stderr
        and "Traceback" not in missing.stderr
    )


def _hostile_inputs(tmp_path: Path) -> dict[str, list[str]]:
    """Hostile inputs that used to end in a traceback, as --prefix / --poses arguments."""
    member = sweep_points(0).astype(np.float32).tobytes()
    kinds = {"encrypted": {"flag": 1}, "method": {"method": 99}, "corrupt": {"corrupt": True}}
    args = {kind: ["--prefix", str(patched_zip(tmp_path / f"{kind}.zip", member, **how))] for kind, how in kinds.items()}
    scans = []
    for i in range(2):
        scans.append(tmp_path / f"{i:06d}.bin")
        scans[-1].write_bytes(member)
    for name, text in (("bomb.json", "[" * 500_000), ("dict.json", '[{"x": 1}, {"x": 2}]')):
        (tmp_path / name).write_text(text)
        args[name] = ["--prefix", *map(str, scans), "--poses", str(tmp_path / name)]
    folder = tmp_path / "kitti"
    folder.mkdir()
    (folder / "000000.bin").write_bytes(member)
    (folder / "poses.txt").write_text("1 0 0 0 0 1 0 0 0 0 1 0\n")
    (folder / "calib.txt").write_text("Tr: " + " ".join(["0"] * 12) + "\n")  # singular
    args["singular-calib"] = ["--prefix", str(folder)]
    return args


@pytest.mark.parametrize(("kind", "message"), [
    ("encrypted", "encrypted.zip: cannot unpack 000000.bin: it is encrypted"),
    ("method", "method.zip: cannot unpack 000000.bin: its compression method is not supported"),
    ("corrupt", "corrupt.zip: cannot unpack 000000.bin: its data is corrupt"),
    ("bomb.json", "bomb.json: JSON nested too deeply"),
    ("dict.json", "dict.json: each pose must be a 4x4 list of numbers"),
    ("singular-calib", "calib.txt: Tr: pose 0 is not a finite rigid transform"),
])
def test_hostile_scene_inputs_end_in_one_error_line_and_exit_2(release, tmp_path, capsys, kind, message):
    argv = ["forecast", "--model", str(release), *_hostile_inputs(tmp_path)[kind], "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert "Singular matrix" not in err[0] and "recursion" not in err[0]
    assert not (tmp_path / "o").exists(), "a refused run leaves no output folder"


def test_an_unwritable_out_is_refused_before_the_model_loads(release, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    argv = ["generate", "--model", str(release), "--frames", "1", "--out", str(tmp_path / "file" / "o")]
    assert main(argv) == 2
    assert "is not a folder; expected a folder this user may write in" in capsys.readouterr().err


def test_a_bug_is_a_traceback_with_exit_status_1(release, tmp_path):
    result = run_cli_with_a_bug("inference.__main__", "load_pipeline", ["info", "--model", str(release)])
    assert "error: a bug" not in result.stderr

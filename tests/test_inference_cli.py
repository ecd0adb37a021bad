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
from lidar.real_scans import real_scans_dir
from tests.test_loader import tiny_model, write_hub_cache, write_release

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
        "world.bin",
    ]
    meta = json.loads((out / "poses.json").read_text())
    expected = load_pipeline(release).generate_world(map=3, action="turn_left", frames=2, steps=1, seed=5)
    for record, frame in zip(meta["frames"], expected.frames, strict=True):
        np.testing.assert_array_equal(np.asarray(record["pose"]), frame.pose)
        np.testing.assert_array_equal(read_points(out / record["file"]).points, frame.points)
    np.testing.assert_array_equal(read_points(out / "world.bin").points, expected.world)
    assert meta["model"]["source"] == str(release) and meta["model"]["iteration"] == 123
    assert meta["request"]["seed"] == 5 and meta["timings"]["frames_per_second"] > 0


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
            "steps must be an integer in [1, 50]",
        ),
        (
            ["forecast", "--model", "{release}", "--prefix", "{tmp}/empty.bin", "--out", "{tmp}/o"],
            "the file is empty",
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

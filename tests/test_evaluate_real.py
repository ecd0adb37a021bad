"""The real-sequence evaluation: baselines, common rays, kept measurement and the CLI, on a recording written
here in the KITTI odometry layout from a simulated drive (the shared KITTI 00 frames when they are present)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inference import load_pipeline
from lidar.formats import write_points
from lidar.sensors import HDL64
from lidar.sequence import NOMINAL_KITTI_TR
from lidar.sim import make_world, plan_drive
from lidar.sim.sequence import simulate_sequence
from tests.helpers import tiny_model, write_release
from training.evaluate_real import (
    LAST_MOVED,
    MODEL,
    PREFIX_MOVED,
    RealSequenceConfig,
    evaluate_recording,
    main,
    starts,
)

KITTI00 = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00"


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seven HDL-64E sweeps of a simulated street in the KITTI odometry layout, camera-frame poses.txt."""
    folder = tmp_path_factory.mktemp("rec")
    world = make_world(6, "suburban")
    poses = plan_drive(world, "straight", 7, seed=0, mount_height=HDL64.mount_height)
    seq = simulate_sequence(world, poses, HDL64, seed=0)
    (folder / "velodyne").mkdir()
    for i, frame in enumerate(seq.frames):
        write_points(folder / "velodyne" / f"{i:06d}.bin", frame.points)
    velo = np.linalg.inv(poses[0]) @ poses  # KITTI's world is the first sweep's frame
    cam = NOMINAL_KITTI_TR @ velo @ np.linalg.inv(NOMINAL_KITTI_TR)
    (folder / "poses.txt").write_text("\n".join(" ".join(f"{v:.12e}" for v in p[:3].ravel()) for p in cam) + "\n")
    return folder


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=6))


def test_starts_leave_a_full_prefix_behind_and_the_longest_horizon_ahead() -> None:
    assert starts(16, 3, 10, 0) == [2, 3, 4, 5]
    assert starts(16, 1, 10, 0) == [0, 1, 2, 3, 4, 5]
    assert starts(16, 1, 10, 3) == [0, 2, 5]
    assert starts(5, 3, 10, 0) == []


def test_the_protocol_scores_the_model_beside_both_baselines_on_the_same_rays(recording, release) -> None:
    pipe = load_pipeline(release)
    cfg = RealSequenceConfig(data=str(recording), poses="file", prefixes=(1, 2), horizons=(1, 3))
    report = evaluate_recording(pipe, cfg, seed=0)
    assert report["poses"]["source"] == "file" and report["sweeps"] == 7
    one, two = report["tables"]["K=1"], report["tables"]["K=2"]
    assert len(one["starts"]) == 4 and len(two["starts"]) == 3
    for table in (one, two):
        for horizon, rows in table["horizons"].items():
            # the model keeps what was measured: on the common rays it is the moved prefix, to float rounding;
            # but one frame after two sweeps it sees with the last sweep's eyes (`inference.measured.own_sweep`)
            eyes = LAST_MOVED if table is two and horizon == "0.1 s" else PREFIX_MOVED
            assert rows[MODEL]["l1_median"] == pytest.approx(rows[eyes]["l1_median"], abs=1e-3)
            assert rows[MODEL]["kept"] == pytest.approx(1.0) if eyes == PREFIX_MOVED else rows[MODEL]["kept"] < 1.0
            assert rows[PREFIX_MOVED]["kept"] == 1.0
            for method in (MODEL, LAST_MOVED, PREFIX_MOVED):
                assert 0.0 < rows[method]["iou"] <= 1.0 and rows[method]["chamfer"] > 0.0
    # with one sweep observed both baselines are the same cloud
    for rows in one["horizons"].values():
        assert rows[LAST_MOVED] == rows[PREFIX_MOVED]
    # with two they differ: the older sweep adds returns the last one lacks
    assert any(rows[LAST_MOVED] != rows[PREFIX_MOVED] for rows in two["horizons"].values())
    assert {b["horizon"] for b in report["bars"]} == {"0.1 s", "0.3 s"}


def test_the_cli_prints_the_tables_and_names_a_missing_recording(recording, release, tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    pictures = tmp_path / "pictures"
    args = ["--model", str(release), "--data", str(recording), "--poses", "file", "--max-starts", "1",
            "--horizons", "1", "2", "4", "--out", str(out), "--pictures", str(pictures)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| 0.4 s | model forecast |" in text and "every prefix sweep moved" in text
    assert json.loads(out.read_text())["tables"]["K=3"]["starts"] == ["000002.bin"]
    assert {p.name for p in pictures.iterdir()} == {f"real_{k}_{h}.png" for k in ("bev", "range") for h in (2, 4)}
    # the release card carries the same tables under its real-recordings heading
    from training.export import evaluation_section

    card = "\n".join(evaluation_section({"real_sequences": json.loads(out.read_text())}))
    assert card.startswith("### Real recordings") and "| 0.4 s | every prefix sweep moved |" in card
    assert main(["--model", str(release), "--data", str(recording), "--poses", "file"]) == 2  # 7 sweeps < 1 s
    assert "too few" in capsys.readouterr().err
    assert main(["--model", str(release), "--data", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.skipif(not KITTI00.is_dir(), reason="the shared KITTI 00 frames are not beside the checkout")
def test_registered_kitti00_poses_are_reported_against_the_ground_truth_file(release) -> None:
    cfg = RealSequenceConfig(data=str(KITTI00), prefixes=(3,), horizons=(5,), max_starts=1)
    report = evaluate_recording(load_pipeline(release), cfg)
    info = report["poses"]
    assert info["source"].startswith("registered") and info["fitness_min"] > 0.5
    # the shared README: KISS-ICP finds 0.69-0.85 m per frame where the file says a steady 0.86 m
    assert 0.65 < info["step_m_registered"] < info["step_m_file"] < 0.9

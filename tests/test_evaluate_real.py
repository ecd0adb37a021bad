"""The real-sequence evaluation at full resolution: rays on the fine grid, full-density baselines, the start
plan, the protocol and the CLI, on synthetic clouds and on a recording written here in the KITTI odometry
layout from a simulated drive (the shared KITTI 00 frames when they are present)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from inference import load_pipeline
from lidar.formats import write_points
from lidar.ray_grid import CELL_DEG, COLUMNS, nearest_per_ray, ray_cells, ray_errors, z_buffer
from lidar.sensors import HDL64
from lidar.sequence import NOMINAL_KITTI_TR
from lidar.sim import make_world, plan_drive
from lidar.sim.sequence import simulate_sequence
from lidar.vocabulary import transform_points
from tests.helpers import tiny_model, write_release
from training.evaluate_real import (
    LAST_MOVED,
    MODEL,
    OCC4D_SETTINGS,
    PREFIX_MOVED,
    RealSequenceConfig,
    Setting,
    baselines,
    clock_note,
    evaluate_recording,
    format_real,
    main,
    picture_names,
    start_plan,
)
from training.sweep_scores import sweep_scores

KITTI00 = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_seq" / "kitti00"
HDL32_PCAP = (Path(__file__).resolve().parents[2] / "shared" / "data" / "recordings" / "velodyne_hdl32_pcap"
              / "hdl32_example.pcap")


def one_point_per_cell(seed: int = 0) -> np.ndarray:
    """(N, 4) a sweep with one point at the centre of every cell from -20 to +2 deg, on a smooth surface
    10-30 m away (its phase set by `seed`): the finest sensor the grid resolves."""
    rng = np.random.default_rng(seed)
    elev = np.deg2rad(np.arange(-20.0, 2.0, CELL_DEG) + CELL_DEG / 2)
    azim = np.deg2rad(180.0 - (np.arange(COLUMNS) + 0.5) * CELL_DEG)
    e, a = (g.ravel() for g in np.meshgrid(elev, azim, indexing="ij"))
    r = 20.0 + 10.0 * np.sin(3 * a + seed) * np.cos(4 * e)
    xyz = np.stack([r * np.cos(e) * np.cos(a), r * np.cos(e) * np.sin(a), r * np.sin(e)], axis=1)
    return np.concatenate([xyz, rng.uniform(0, 1, (len(e), 1))], axis=1).astype(np.float32)


def test_each_point_of_a_cell_centred_sweep_is_its_own_ray() -> None:
    sweep = one_point_per_cell()
    cells = ray_cells(sweep)
    assert len(np.unique(cells)) == len(sweep)
    rays = nearest_per_ray(np.concatenate([sweep, sweep * [2.0, 2.0, 2.0, 1.0]]))  # the same rays, twice as far
    assert len(rays) == len(sweep) and np.allclose(rays.ranges, np.linalg.norm(sweep[rays.winners, :3], axis=1))
    assert rays.winners.max() < len(sweep)  # the nearer copy wins every ray


def test_a_cloud_thinned_one_in_eight_covers_an_eighth_and_a_perfect_copy_scores_zero() -> None:
    truth = one_point_per_cell()
    thinned = truth[::8]
    far = truth * np.array([1.1, 1.1, 1.1, 1.0], dtype=np.float32)  # every ray returned 10 % too far
    scores, common = sweep_scores(truth, {"copy": truth.copy(), "thinned": thinned, "far": far})
    assert scores["copy"]["coverage"] == 1.0 and scores["copy"]["points"] == 1.0
    assert scores["copy"]["l1_median"] == 0.0 and scores["copy"]["chamfer"] == 0.0
    assert scores["thinned"]["coverage"] == pytest.approx(1 / 8, abs=1e-3)
    assert scores["thinned"]["points"] == pytest.approx(1 / 8, abs=1e-3)
    assert scores["thinned"]["l1_median"] == 0.0 and scores["thinned"]["chamfer"] > 0.0
    assert common == pytest.approx(1 / 8, abs=1e-3)  # errors are taken on the rays all three return on
    assert scores["far"]["absrel"] == pytest.approx(0.1, abs=1e-4) and scores["far"]["coverage"] == 1.0
    # a method returning nothing on the truth's rays leaves no common ray
    errors, none_common = ray_errors(nearest_per_ray(truth), {"empty": nearest_per_ray(truth[:0])})
    assert errors["empty"]["coverage"] == 0.0 and np.isnan(errors["empty"]["l1_median"]) and none_common == 0.0


def test_both_baselines_keep_the_sweeps_full_density() -> None:
    sweep = one_point_per_cell()
    pose, target = np.eye(4), np.eye(4)
    target[0, 3] = 0.3  # a creeping car's step
    world = [transform_points(sweep, pose)]
    moved = baselines(world, np.linalg.inv(target))
    assert len(moved[LAST_MOVED]) == len(sweep)
    assert len(moved[PREFIX_MOVED]) > 0.9 * len(sweep)  # the z-buffer keeps one per ray, not one per model pixel
    # a second sweep from another place adds the rays the first lacks, the nearest per ray kept
    second = one_point_per_cell(seed=1)
    two = baselines([transform_points(second, target), world[0]], np.linalg.inv(target))
    assert len(two[PREFIX_MOVED]) > len(moved[PREFIX_MOVED]) and len(z_buffer(two[PREFIX_MOVED])) == len(
        two[PREFIX_MOVED])


def test_horizons_beyond_the_recording_are_skipped_with_the_reason() -> None:
    main_k3 = Setting("K=3", 3, 1, (1, 3, 5, 10, 30), 10)
    plan, skipped = start_plan(main_k3, 16, 0)
    assert plan == {h: [2, 3, 4, 5] for h in (1, 3, 5, 10)}  # the rows to 1.0 s compare on the same starts
    assert len(skipped) == 1 and "K=3 at 3.0 s" in skipped[0] and "needs 33" in skipped[0]
    plan, skipped = start_plan(main_k3, 40, 0)
    assert plan[1] == list(range(2, 30)) and plan[30] == list(range(2, 10)) and not skipped
    assert start_plan(main_k3, 40, 3)[0][1] == [2, 16, 29]
    occ_1s, occ_3s = OCC4D_SETTINGS
    assert occ_1s.observed(8) == [0, 2, 4, 6, 8]  # 5 sweeps at 5 Hz
    assert start_plan(occ_1s, 16, 0) == ({}, ["4D-Occ 1 s: 16 sweeps are too few for 5 observed 2 frames apart "
                                              "and 1.0 s ahead (needs 19)"])
    assert start_plan(occ_3s, 40, 0)[0] == {h: [8, 9] for h in occ_3s.horizons}


def test_a_recording_off_ten_hertz_says_what_its_horizons_count() -> None:
    """A Velodyne capture at 11.7 Hz: "0.1 s" is one sweep ahead, 0.086 s there; KITTI's 0.1036 s is 10 Hz."""
    note = clock_note(0.0857)
    assert note is not None and "0.086 s apart" in note and "one sweep ahead" in note
    assert clock_note(0.1036) is None and clock_note(0.1) is None and clock_note(None) is None
    assert clock_note(0.2) is not None  # a 5 Hz recording
    assert clock_note(0.0) is None and clock_note(float("nan")) is None  # no clock: stamps all alike, or none


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


def test_the_protocol_scores_the_model_beside_both_baselines_on_the_truths_rays(recording, release) -> None:
    pipe = load_pipeline(release)
    cfg = RealSequenceConfig(data=str(recording), poses="file", prefixes=(1, 2), horizons=(1, 3))
    report = evaluate_recording(pipe, cfg, seed=0)
    assert report["poses"]["source"] == "file" and report["sweeps"] == 7
    one, two = report["tables"]["K=1"], report["tables"]["K=2"]
    assert one["starts"]["0.1 s"] == [f"{i:06d}.bin" for i in range(4)] and len(two["starts"]["0.3 s"]) == 3
    for table in (one, two):
        for horizon, rows in table["horizons"].items():
            assert 0.0 < table["common_rays"][horizon] <= min(r["coverage"] for r in rows.values())
            # what the model returns on the truth's rays is the measurement it keeps: as near as the moved prefix
            assert rows[MODEL]["l1_median"] <= rows[PREFIX_MOVED]["l1_median"] + 0.02
            for method in (MODEL, LAST_MOVED, PREFIX_MOVED):
                assert rows[method]["chamfer"] > 0.0 and 0.0 < rows[method]["coverage"] <= 1.0
            # the baselines are the sweeps themselves, about the truth's count; not thinned to the model's grid
            assert rows[LAST_MOVED]["points"] > 0.8
    # with one sweep observed the z-buffered prefix is the last sweep without what it hides from the new pose
    for rows in one["horizons"].values():
        assert rows[PREFIX_MOVED]["coverage"] == rows[LAST_MOVED]["coverage"]
        assert rows[PREFIX_MOVED]["points"] <= rows[LAST_MOVED]["points"]
    # with two the older sweep adds rays the last one lacks
    assert all(rows[PREFIX_MOVED]["coverage"] > rows[LAST_MOVED]["coverage"] for rows in two["horizons"].values())
    assert {b["horizon"] for b in report["bars"]} == {"0.1 s", "0.3 s"} and not report["occ4d"]
    assert [s.split(":")[0] for s in report["skipped"]] == ["4D-Occ 1 s", "4D-Occ 3 s"]


def test_the_cli_prints_the_tables_and_names_a_missing_recording(recording, release, tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    pictures = tmp_path / "pictures"
    args = ["--model", str(release), "--data", str(recording), "--poses", "file", "--max-starts", "1",
            "--horizons", "1", "2", "4", "--out", str(out), "--pictures", str(pictures)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| 0.4 s |" in text and "| every prefix sweep moved |" in text and "Skipped: 4D-Occ 1 s" in text
    assert json.loads(out.read_text())["tables"]["K=3"]["starts"]["0.4 s"] == ["000002.bin"]
    assert {p.name for p in pictures.iterdir()} == {n for h in (2, 4) for n in picture_names(recording.name, h)}
    assert picture_names("KITTI 00", 10) == ("real_kitti-00_bev_10.png", "real_kitti-00_range_10.png")
    assert picture_names("KITTI 00", 10, "bfloat16") == ("real_kitti-00_bev_10_bfloat16.png",
                                                         "real_kitti-00_range_10_bfloat16.png")
    assert Image.open(pictures / picture_names(recording.name, 4)[1]).width == COLUMNS  # the truth's fine grid
    # the release card carries the same tables under its real-recordings heading
    from training.export import evaluation_section

    shown = sorted(p.name for p in pictures.iterdir())
    card = "\n".join(evaluation_section({"real_sequences": [json.loads(out.read_text())]}, shown))
    assert card.startswith(f"### Real recordings: `{recording.name}`") and "| every prefix sweep moved |" in card
    assert all(f"]({name})" in card for name in shown), "each of the recording's pictures under its section"
    assert main(["--model", str(release), "--data", str(recording), "--poses", "file"]) == 2  # 7 sweeps < 1 s
    assert "too few" in capsys.readouterr().err
    assert main(["--model", str(release), "--data", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.skipif(not KITTI00.is_dir(), reason="the shared KITTI 00 frames are not beside the checkout")
def test_registered_kitti00_poses_are_reported_against_the_ground_truth_file(release) -> None:
    cfg = RealSequenceConfig(data=str(KITTI00), prefixes=(3,), horizons=(5,), max_starts=1, occ4d=False)
    report = evaluate_recording(load_pipeline(release), cfg)
    info = report["poses"]
    assert info["source"].startswith("registered") and info["fitness_min"] > 0.5
    # the shared README: KISS-ICP finds 0.69-0.85 m per frame where the file says a steady 0.86 m
    assert 0.65 < info["step_m_registered"] < info["step_m_file"] < 0.9
    # scored against the full sweep: the baselines carry about the truth's points, not a model grid's
    rows = report["tables"]["K=3"]["horizons"]["0.5 s"]
    assert rows[LAST_MOVED]["points"] > 0.85


@pytest.mark.skipif(not HDL32_PCAP.is_file(), reason="the shared HDL-32E capture is not beside the checkout")
def test_a_recording_file_is_scored_on_its_own_clock(release) -> None:
    """A Velodyne pcap as it was captured (11.7 Hz), read by the container readers: registered, scored against
    its full sweeps, and its horizons' labels explained."""
    cfg = RealSequenceConfig(data=str(HDL32_PCAP), prefixes=(1,), horizons=(1,), max_starts=1, occ4d=False)
    report = evaluate_recording(load_pipeline(release), cfg)
    assert report["sweeps"] == 5 and report["poses"]["source"].startswith("registered")
    assert 0.08 < report["sweep_interval_s"] < 0.09
    assert report["tables"]["K=1"]["horizons"]["0.1 s"][LAST_MOVED]["points"] > 0.85
    assert "one sweep ahead" in format_real(report)

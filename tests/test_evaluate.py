"""Evaluation in quick mode: every method and bar is reported, and the reference figures behave."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.loader import Provenance
from inference.network import WorldModel, WorldModelConfig
from inference.pipeline import LidarVersePipeline
from lidar.formats import read_points
from lidar.range_image import RangeImage, unproject
from lidar.real_scans import real_scans_dir
from lidar.registration import register_sweeps
from lidar.sensors import HDL32
from lidar.sim.dataset import MANIFEST, SIMULATOR_VERSION, SimDataset
from lidar.sim.hdmap import HDMap
from lidar.vocabulary import transform_points
from training.evaluate import (
    BAR_SPAN,
    CACHE_ONLY,
    FLOOR,
    GROUND_TRUTH,
    HORIZONS,
    KITTI_PAIRS,
    KITTI_PICTURE,
    KITTI_SWEEPS,
    MAP_ONLY,
    MODEL_FORECAST,
    MODEL_GENERATE,
    MOVED_FIRST,
    NOISE_FLOOR,
    PER_RAY,
    PICTURE_LABEL,
    SIM_PICTURE,
    SIM_RANGE_PICTURE,
    EvalConfig,
    bars,
    cache_only,
    check_disjoint,
    evaluate,
    format_report,
    frame_scores,
    main,
    map_adherence_counts,
    real_pairs,
    reference_set,
)
from training.sweep_scores import sweep_scores

SENSOR = HDL32.with_width(64)
SIM_METHODS = [MODEL_FORECAST, MODEL_GENERATE, CACHE_ONLY, MAP_ONLY, NOISE_FLOOR]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _tiny_pipeline() -> LidarVersePipeline:
    torch.manual_seed(0)
    model = WorldModel(WorldModelConfig(sensor=SENSOR.to_dict(), base_channels=8, channel_mults=(1, 2),
                                        strides=((1, 2),), norm_groups=4, bottleneck_attention=False)).eval()
    provenance = Provenance(source="tiny", kind="test", resolved_path="", iteration=None, weights="random",
                            parameters=0, sensor=SENSOR.name, device="cpu", dtype="float32", revision=None,
                            notes=(), load_seconds=0.0)
    return LidarVersePipeline(model, provenance)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path, Path]:
    data_dir = tmp_path_factory.mktemp("eval")
    pictures = tmp_path_factory.mktemp("pictures")
    return evaluate(_tiny_pipeline(), EvalConfig.quick(str(data_dir)), pictures=pictures), data_dir, pictures


def _heldout(data_dir: Path) -> SimDataset:
    (path,) = data_dir.glob("heldout_*")
    return SimDataset(path)


def test_quick_evaluation_reports_every_method_horizon_and_bar(quick_run) -> None:
    report = quick_run[0]
    assert list(report["per_ray"]) == [*HORIZONS, BAR_SPAN]
    for table in report["per_ray"].values():
        assert list(table) == SIM_METHODS
        for scores in table.values():
            assert list(scores) == list(PER_RAY) and all(math.isfinite(v) for v in scores.values())
    for method in SIM_METHODS:  # per-frame curves: one value per target frame
        assert all(len(curve) == 10 for curve in report["per_frame"][method].values())
    assert report["per_ray"]["1.0 s"][MODEL_FORECAST]["iou"] == report["per_frame"][MODEL_FORECAST]["iou"][9]
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == [*SIM_METHODS, GROUND_TRUTH, FLOOR]
    for name in (*SIM_METHODS, FLOOR):
        assert math.isfinite(rows[name]["bev_jsd"]) and rows[name]["bev_jsd"] >= 0.0
    assert rows[GROUND_TRUTH]["temporal_chamfer_m"] > 0.0
    assert rows[FLOOR]["bev_jsd"] > 0.0, "two different sets of worlds cannot be identical"
    assert len(report["bars"]) == 6 and all(b["value"] is not None for b in report["bars"][:4])
    assert report["protocol"]["rollouts"] == 2 and report["protocol"]["frames"] == 10
    json.dumps(report, allow_nan=False)  # the CLI's --json must be able to print it, NaN-free
    table = format_report(report)
    assert "| noise floor |" in table and "| sim-vs-sim floor |" in table and "goal met" in table
    assert table.count("| method | Chamfer (m²) ↓ |") == 3
    # each drive's Chamfer: as many as drives, and their mean is the bars' mean over drives and frames
    for method, drives in report["per_drive"]["chamfer"].items():
        assert len(drives) == report["protocol"]["rollouts"]
        assert np.mean(drives) == pytest.approx(report["per_ray"][BAR_SPAN][method]["chamfer"])
    assert "| method | drive 0 | drive 1 |" in table
    many = {**report, "per_drive": {"chamfer": {m: v * 10 for m, v in report["per_drive"]["chamfer"].items()}}}
    assert "| method | drive 0 |" not in format_report(many) and "`per_drive`" in format_report(many)


def test_kitti_pairs_are_scored_for_both_methods(quick_run) -> None:
    real = quick_run[0]["real"]
    if "skipped" in real:
        pytest.skip(f"real section skipped: {real['skipped']}")
    assert [p["pair"] for p in real["pairs"]] == ["000000->000002", "000002->000004", "000000->000004"]
    assert [p["gap_s"] for p in real["pairs"]] == pytest.approx([0.2, 0.2, 0.4])
    moved = real["mean"][MOVED_FIRST]
    # KITTI 0.2-0.4 s apart: the moved sweep lies within decimetres of the truth (the registration works)
    assert moved["l1_median"] < 0.3 and moved["chamfer"] < 0.2 and 0.9 < moved["points"] < 1.1
    assert real["mean"][MODEL_FORECAST]["chamfer"] > 0.0
    assert all(r["fitness"] >= 0.5 for r in real["registration"]), "every sweep fits the ones before it"
    # the truth is the second sweep as the sensor took it, every point, and the forecast is on its own grid
    sweeps = [read_points(real_scans_dir() / name).points for name in KITTI_SWEEPS]
    poses = register_sweeps(sweeps).poses
    for pair, (a, b) in zip(real["pairs"], KITTI_PAIRS, strict=True):
        assert pair["truth_points"] == len(sweeps[b]) and pair["forecast_shape"][0] == 64
        moved = transform_points(sweeps[a], np.linalg.inv(poses[b]) @ poses[a])
        alone = sweep_scores(sweeps[b], {MOVED_FIRST: moved})[0][MOVED_FIRST]
        for key in ("chamfer", "coverage", "points"):  # a method's own scores, not the common rays'
            assert pair["methods"][MOVED_FIRST][key] == pytest.approx(alone[key])
        assert pair["methods"][MODEL_FORECAST]["points"] > 0.5  # not thinned to the 32 x 64 model grid
    assert "| pair, method | Chamfer (m², 4D-Occ region) ↓ |" in format_report(quick_run[0])


def test_noise_floor_is_close_to_the_ground_truth_but_not_identical(quick_run) -> None:
    table = quick_run[0]["per_ray"][BAR_SPAN]
    floor = table[NOISE_FLOOR]
    assert 0.0 < floor["l1_median"] < 0.1, "same world and poses: only the 2 cm range noise remains"
    assert 0.8 < floor["iou"] < 1.0, "random ray drop differs between noise seeds"
    assert 0.0 < floor["chamfer"] < table[CACHE_ONLY]["chamfer"]


def test_the_ground_truth_scored_against_itself_is_perfect(quick_run) -> None:
    arrays = _heldout(quick_run[1]).load_sequence(0)
    image = RangeImage(arrays["range"][3], arrays["intensity"][3])
    points = unproject(image, SENSOR)
    scores = frame_scores(points, image, points, SENSOR)
    expected = {"l1_mean": 0.0, "l1_median": 0.0, "absrel": 0.0, "coverage": 1.0, "iou": 1.0, "chamfer": 0.0}
    assert scores == pytest.approx(expected, abs=1e-5)  # the projection round trip is float32


def test_pictures_have_one_labelled_panel_per_method(quick_run) -> None:
    from PIL import Image

    pictures = quick_run[2]
    with Image.open(pictures / SIM_PICTURE) as im:  # truth | forecast | frame 0 moved | generate
        assert im.size == (4 * 500, 500 + PICTURE_LABEL)
        panel = np.asarray(im)[PICTURE_LABEL:, :500]
        assert panel.any(axis=2).mean() > 0.002, "the ground-truth panel shows points (32x64 is sparse)"
    with Image.open(pictures / SIM_RANGE_PICTURE) as im:  # the same four, one above the other, 4 rows a beam
        assert im.size == (SENSOR.width, 4 * (4 * SENSOR.height + PICTURE_LABEL))
        truth = np.asarray(im)[PICTURE_LABEL:PICTURE_LABEL + 4 * SENSOR.height]
        assert truth.any(axis=2).mean() > 0.5, "the ground truth's range image returns on most rays"
    if "skipped" not in quick_run[0]["real"]:
        with Image.open(pictures / KITTI_PICTURE) as im:
            assert im.size == (3 * 500, 500 + PICTURE_LABEL)


def test_drives_are_simulated_and_drawn_on_the_preset_asked(tmp_path: Path) -> None:
    """`sensor="vlp16", columns=96`: the held-out drives, every method's frames, the per-ray scores and the
    pictures are on that grid, not the model's 32 x 64."""
    from PIL import Image

    cfg = EvalConfig(rollouts=2, data_dir=str(tmp_path / "eval"), workers=1, free_generation=False, real=False,
                     sensor="vlp16", columns=96)
    report = evaluate(_tiny_pipeline(), cfg, pictures=tmp_path / "pictures")
    assert report["protocol"]["sensor"] == "vlp16" and report["protocol"]["shape"] == [16, 96]
    (heldout,) = (tmp_path / "eval").glob("heldout_*")
    assert heldout.name.endswith("vlp16x96") and SimDataset(heldout).sensor.shape == (16, 96)
    forecast = report["per_ray"][BAR_SPAN][MODEL_FORECAST]
    assert forecast["coverage"] > 0.5  # scored ray by ray on the drives' own grid
    with Image.open(tmp_path / "pictures" / "eval_sim_range_vlp16.png") as im:
        assert im.size == (96, 3 * (8 * 16 + PICTURE_LABEL))  # truth, forecast, frame 0 moved; 8 rows a beam
    assert (tmp_path / "pictures" / "eval_sim_bev_vlp16.png").is_file()
    assert not (tmp_path / "pictures" / SIM_PICTURE).exists()


def test_real_section_is_skipped_with_a_reason_when_scans_are_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LIDARVERSE_REAL_SCANS", str(tmp_path))
    result = real_pairs(_tiny_pipeline(), EvalConfig.quick(str(tmp_path)), seed=0)
    assert "kitti_patchworkpp_000000.bin" in result.report["skipped"] and str(tmp_path) in result.report["skipped"]
    assert result.picture == {}


def test_bars_compare_within_the_run_and_report_unmeasured_bars_as_unknown() -> None:
    def scores(chamfer: float, l1_median: float, iou: float) -> dict[str, float]:
        return {"chamfer": chamfer, "l1_median": l1_median, "iou": iou}

    sim = {MODEL_FORECAST: scores(0.6, 0.1, 0.75), MODEL_GENERATE: scores(1.2, 0.2, 0.7),
           CACHE_ONLY: scores(1.0, 0.2, 0.5), NOISE_FLOOR: scores(0.1, 0.02, 0.9)}
    rows = [{"name": MODEL_FORECAST, "bev_jsd": 0.12}, {"name": FLOOR, "bev_jsd": 0.1}]
    out = {b["bar"].split(" ÷")[0].split(" ≥")[0]: b for b in bars(sim, None, rows)}
    chamfer = out["sim forecast Chamfer"]
    assert chamfer["value"] == pytest.approx(0.6) and chamfer["pass"] and not chamfer["goal_met"]
    l1 = out["sim forecast L1 median"]
    assert l1["value"] == pytest.approx(0.5) and l1["pass"] and l1["goal_met"]
    iou = out["sim forecast return IoU"]
    assert iou["limit"] == pytest.approx(0.7) and iou["goal"] == pytest.approx(0.81)
    assert iou["pass"] and not iou["goal_met"]
    assert out["sim generate Chamfer"]["value"] == pytest.approx(1.2) and out["sim generate Chamfer"]["pass"] is False
    assert out["real KITTI forecast Chamfer"]["value"] is None and out["real KITTI forecast Chamfer"]["pass"] is None
    assert out["BEV JSD"]["value"] == pytest.approx(1.2) and out["BEV JSD"]["pass"] and not out["BEV JSD"]["goal_met"]


def test_frames_below_the_last_horizon_are_refused() -> None:
    with pytest.raises(ValueError, match="frames must be >= 10"):
        EvalConfig(frames=8)


def test_ground_truth_and_map_only_adhere_to_the_map(quick_run) -> None:
    rows = {r["name"]: r for r in quick_run[0]["rows"]}
    assert rows[GROUND_TRUTH]["map_adherence"] > 0.8
    assert rows[MAP_ONLY]["map_adherence"] > 0.9


def test_points_under_the_ground_do_not_adhere(quick_run) -> None:
    data = _heldout(quick_run[1])
    arrays = data.load_sequence(0)
    hdmap = HDMap.from_dict(arrays)
    points = unproject(RangeImage(arrays["range"][0], arrays["intensity"][0]), SENSOR)
    pose = arrays["poses"][0]
    on, near = map_adherence_counts([points], pose[None], hdmap)
    sunk = points.copy()
    sunk[:, 2] -= 2.0  # everything two metres too low: all near/below ground, none on it
    on_sunk, near_sunk = map_adherence_counts([sunk], pose[None], hdmap)
    assert near > 0 and on / near > 0.8
    assert near_sunk >= near and on_sunk < 0.1 * near_sunk


def test_cache_only_at_a_standing_pose_returns_the_observed_frame(quick_run) -> None:
    arrays = _heldout(quick_run[1]).load_sequence(0)
    first = unproject(RangeImage(arrays["range"][0], arrays["intensity"][0]), SENSOR)
    pose = arrays["poses"][0]
    (again,) = cache_only(first, np.stack([pose, pose]), SENSOR)
    assert again.shape == first.shape
    np.testing.assert_allclose(np.sort(again[:, 3]), np.sort(first[:, 3]))
    np.testing.assert_allclose(np.sort(np.linalg.norm(again[:, :3], axis=1)),
                               np.sort(np.linalg.norm(first[:, :3], axis=1)), atol=1e-3)


def test_cache_only_moves_frame_0_straight_to_each_target_pose(quick_run) -> None:
    arrays = _heldout(quick_run[1]).load_sequence(0)
    first = unproject(RangeImage(arrays["range"][0], arrays["intensity"][0]), SENSOR)
    poses = arrays["poses"][[0, 5, 10]]
    direct = cache_only(first, poses[[0, 2]], SENSOR)
    via = cache_only(first, poses, SENSOR)
    assert len(via) == 2
    np.testing.assert_array_equal(via[1], direct[0])  # not re-projected through frame 5 on the way


def test_a_cached_set_whose_world_no_longer_matches_the_simulator_is_refused(quick_run, monkeypatch) -> None:
    import training.evaluate as evaluate_module

    other = evaluate_module.make_world(12345, "urban")
    monkeypatch.setattr(evaluate_module, "make_world", lambda seed, style: other)
    with pytest.raises(ValueError, match="delete it to regenerate"):
        evaluate_module.load_drive(_heldout(quick_run[1]), 0, SENSOR)


def test_a_set_made_by_an_older_simulator_is_simulated_again_and_a_current_one_reused(tmp_path: Path) -> None:
    cfg = EvalConfig.quick(str(tmp_path))
    stale = tmp_path / f"heldout_s5_f{cfg.frames + 1}_{SENSOR.name}x{SENSOR.width}"
    stale.mkdir()
    (stale / MANIFEST).write_text(json.dumps({"sequences": [{}, {}], "simulator": SIMULATOR_VERSION - 1}))
    dataset = reference_set(cfg, "heldout", 5, SENSOR)
    manifest = json.loads((stale / MANIFEST).read_text())
    assert manifest["simulator"] == SIMULATOR_VERSION and len(dataset) > 0
    written = (stale / MANIFEST).stat().st_mtime_ns
    reference_set(cfg, "heldout", 5, SENSOR)
    assert (stale / MANIFEST).stat().st_mtime_ns == written


def test_heldout_worlds_seen_in_training_are_refused(quick_run, tmp_path: Path) -> None:
    heldout = _heldout(quick_run[1])
    seed = heldout.manifest["sequences"][1]["world_seed"]
    (tmp_path / MANIFEST).write_text(json.dumps({"sequences": [{"world_seed": seed}]}))
    with pytest.raises(ValueError, match=str(seed)):
        check_disjoint(heldout, str(tmp_path))
    (tmp_path / MANIFEST).write_text(json.dumps({"sequences": [{"world_seed": -1}]}))
    check_disjoint(heldout, str(tmp_path))


def test_cli_reports_a_missing_model_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["--model", str(tmp_path / "nowhere"), "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "nowhere" in err[-1]

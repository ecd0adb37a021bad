"""Evaluation in quick mode: every method and bar is reported, and the reference figures behave."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.network import WorldModel, WorldModelConfig
from lidar.range_image import RangeImage, unproject
from lidar.sensors import HDL32
from lidar.sim.dataset import MANIFEST, SimDataset
from lidar.sim.hdmap import HDMap
from training.evaluate import (
    CACHE_ONLY,
    FLOOR,
    GROUND_TRUTH,
    MAP_ONLY,
    MODEL_FORECAST,
    MODEL_GENERATE,
    EvalConfig,
    cache_only,
    check_disjoint,
    evaluate,
    format_report,
    main,
    map_adherence_counts,
)

SENSOR = HDL32.with_width(64)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path]:
    data_dir = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    model = WorldModel(WorldModelConfig(sensor=SENSOR.to_dict(), base_channels=8, channel_mults=(1, 2),
                                        strides=((1, 2),), norm_groups=4, bottleneck_attention=False)).eval()
    return evaluate(model, EvalConfig.quick(str(data_dir))), data_dir


def _heldout(data_dir: Path) -> SimDataset:
    (path,) = data_dir.glob("heldout_*")
    return SimDataset(path)


def test_quick_evaluation_reports_every_method_and_bar(quick_run) -> None:
    report, _ = quick_run
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == [MODEL_FORECAST, MODEL_GENERATE, CACHE_ONLY, MAP_ONLY, GROUND_TRUTH, FLOOR]
    for name in (MODEL_FORECAST, MODEL_GENERATE, CACHE_ONLY, MAP_ONLY, FLOOR):
        assert math.isfinite(rows[name]["bev_jsd"]) and rows[name]["bev_jsd"] >= 0.0
        assert math.isfinite(rows[name]["bev_mmd"])
    assert rows[GROUND_TRUTH]["temporal_chamfer_m"] > 0.0
    assert rows[FLOOR]["bev_jsd"] > 0.0, "two different sets of worlds cannot be identical"
    assert [b["bar"] for b in report["bars"]][-1] == "temporal Chamfer <= 1.5x ground truth"
    assert len(report["bars"]) == 6
    assert report["protocol"]["rollouts"] == 3 and report["protocol"]["frames"] == 2
    json.dumps(report)  # the CLI's --json must be able to print it
    table = format_report(report)
    assert "| cache-only |" in table and "| sim-vs-sim floor |" in table


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

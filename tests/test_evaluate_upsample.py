"""`python -m training.evaluate_upsample` on a tiny case: sweeps of a known scene written to files, a tiny
release, every setting and method scored, the bars, the pictures and the report."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from inference import load_pipeline
from inference.fill_network import FILL_WEIGHTS_NAME, FillNetwork, FillNetworkConfig, fill_network_bytes
from inference.upsample import EDGE_AWARE, LEARNED, LINEAR, MODEL, NEAREST
from lidar.errors import InputError
from lidar.formats import write_points
from tests.helpers import ring_sweep, sweep_points, tiny_model, write_release
from training.evaluate_upsample import (
    BAR_SETTING,
    SETTINGS,
    UpsampleEvalConfig,
    evaluate,
    format_report,
    main,
)

ELEVATIONS = np.linspace(8.0, -24.0, 16)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("sweeps")
    for seed in (0, 1):
        points, ring = ring_sweep(ELEVATIONS, 128, seed=seed)
        write_points(folder / f"{seed:06d}.pcd", points, ring=ring)
    shutil.copy(folder / "000001.pcd", folder / "copy.pcd")
    write_points(folder / "cloud.bin", sweep_points(0)[np.random.default_rng(0).permutation(2000)])  # no beams
    release = write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=4))
    return folder, release


@pytest.fixture(scope="module")
def report(data, tmp_path_factory, one_torch_thread):
    folder, release = data
    pictures = tmp_path_factory.mktemp("pictures")
    cfg = UpsampleEvalConfig(data=(str(folder),), steps=1, sparse_example=str(folder / "000000.pcd"))
    out = evaluate(load_pipeline(release, device="cpu"), cfg, pictures=pictures)
    return out, pictures


def test_each_sweep_is_scored_once_and_what_cannot_be_scored_says_why(report):
    out, _ = report
    protocol = out["protocol"]
    assert protocol["sweeps"] == ["000000.pcd", "000001.pcd"]
    assert protocol["duplicates"] == ["copy.pcd (= 000001.pcd)"]
    assert len(protocol["skipped"]) == 1 and protocol["skipped"][0].startswith("cloud.bin: no beams")


def test_every_setting_and_method_has_its_metrics_and_the_fills_beat_their_baselines(report):
    out, _ = report
    assert list(out["tables"]) == [s.name for s in SETTINGS]
    for table in out["tables"].values():
        assert list(table) == [NEAREST, LINEAR, EDGE_AWARE, MODEL]
        for method, row in table.items():
            # an untrained model may return on none of the rays to fill: no range error to take there
            scored = ("iou", "chamfer") if method == MODEL else ("mae", "median", "iou", "chamfer")
            assert all(row[k] is not None and np.isfinite(row[k]) for k in scored)
            assert 0.0 <= row["iou"] <= 1.0 and row["sweeps_per_s"] > 0
    rings = out["tables"][BAR_SETTING]
    assert rings[EDGE_AWARE]["median"] < rings[LINEAR]["median"] < rings[NEAREST]["median"]
    assert rings[EDGE_AWARE]["iou"] == rings[LINEAR]["iou"] == rings[NEAREST]["iou"]


def test_the_bars_are_ratios_to_linear_on_the_bar_setting(report):
    out, _ = report
    table = out["tables"][BAR_SETTING]
    by = {b["method"]: b for b in out["bars"]}
    assert set(by) == {EDGE_AWARE, MODEL}
    edge = by[EDGE_AWARE]
    assert edge["mae_ratio"] == pytest.approx(table[EDGE_AWARE]["mae"] / table[LINEAR]["mae"])
    assert edge["chamfer_ratio"] == pytest.approx(table[EDGE_AWARE]["chamfer"] / table[LINEAR]["chamfer"])
    assert edge["mae_pass"] == (edge["mae_ratio"] <= 0.8) and edge["iou_pass"] is True


def test_the_pictures_and_the_markdown(report):
    out, pictures = report
    assert sorted(p.name for p in pictures.iterdir()) == sorted(
        [f"upsample_{view}_{k}.png" for k in [*range(4), "sparse"] for view in ("bev", "range")])
    # the sparse sweep made 4x denser: given | each of the 4 methods, the settings' pictures have the truth besides
    sparse, setting = (Image.open(pictures / f"upsample_bev_{k}.png") for k in ("sparse", 0))
    assert sparse.height == setting.height and sparse.width * 6 == setting.width * 5
    strips, one = (Image.open(pictures / f"upsample_range_{k}.png") for k in ("sparse", 0))
    assert strips.height > one.height and strips.getbbox() is not None, "61-row strips against 16-row ones"
    text = format_report(out)
    assert all(s.name in text for s in SETTINGS) and "Bars on" in text and "copy.pcd" in text


def test_the_command_writes_its_json_and_refuses_a_missing_folder(data, tmp_path, capsys, one_torch_thread):
    folder, release = data
    out = tmp_path / "report.json"
    assert main(["--model", str(release), "--data", str(folder / "000000.pcd"), "--methods", "linear", "edge-aware",
                 "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["protocol"]["methods"] == [LINEAR, EDGE_AWARE] and written["model"]["iteration"] == 123
    assert main(["--model", str(release), "--data", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --data") and "no such file or folder" in err[-1]


def test_a_missing_sparse_example_skips_its_pictures_only(data, tmp_path, one_torch_thread):
    folder, release = data
    cfg = UpsampleEvalConfig(data=(str(folder / "000000.pcd"),), methods=(LINEAR,), sparse_example=str(tmp_path / "no"))
    evaluate(load_pipeline(release, device="cpu"), cfg, pictures=tmp_path / "pictures")
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == sorted(
        f"upsample_{view}_{k}.png" for k in range(4) for view in ("bev", "range"))


def test_the_learned_fill_is_scored_where_the_release_ships_it(data, tmp_path, one_torch_thread):
    folder, release = data
    cfg = UpsampleEvalConfig(data=(str(folder / "000000.pcd"),), methods=(LINEAR, EDGE_AWARE, LEARNED))
    without = evaluate(load_pipeline(release, device="cpu"), cfg)
    assert list(without["tables"][BAR_SETTING]) == [LINEAR, EDGE_AWARE] and without["protocol"]["left_out"] == [LEARNED]
    assert "Left out (the model ships no fill network): learned" in format_report(without)
    with pytest.raises(InputError, match="needs a fill network"):
        evaluate(load_pipeline(release, device="cpu"), UpsampleEvalConfig(data=cfg.data, methods=(LEARNED,)))
    shipped = tmp_path / "release"
    shutil.copytree(release, shipped)
    (shipped / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(FillNetwork(FillNetworkConfig(channels=8))))
    table = evaluate(load_pipeline(shipped, device="cpu"), cfg)["tables"][BAR_SETTING]
    assert list(table) == [LINEAR, EDGE_AWARE, LEARNED]
    assert table[LEARNED]["mae"] == pytest.approx(table[EDGE_AWARE]["mae"], rel=1e-5), "untrained: edge-aware exactly"


def test_the_report_names_the_scored_sweeps_the_fill_network_learnt_from(data: tuple[Path, Path], tmp_path: Path) -> None:
    """A figure on a sweep the network trained on is a fit: the card says which sweeps those are, by content."""
    folder, release = data
    cfg = UpsampleEvalConfig(data=(str(folder / "000000.pcd"), str(folder / "000001.pcd")), methods=(LINEAR, LEARNED))
    elsewhere = tmp_path / "other_drive"
    elsewhere.mkdir()
    (elsewhere / "a.pcd").write_bytes(b"another drive's sweep")  # matched by content, never parsed
    copy = tmp_path / "copy_of_000000.pcd"  # the same bytes under another name count as the same sweep
    copy.write_bytes((folder / "000000.pcd").read_bytes())
    for real, expected, says in (([str(elsewhere)], [], "none of the sweeps scored here"),
                                 ([str(elsewhere), str(copy)], ["000000.pcd"], "1 of the sweeps scored here were among them"),
                                 ([str(tmp_path / "gone")], None, "not here to compare")):
        shipped = tmp_path / f"release_{len(real)}_{expected is None}"
        shutil.copytree(release, shipped)
        extra = {"steps": "1", "config": json.dumps({"real": real, "every": [4]})}
        sensors = ("hdl64",) if expected == [] else None  # a file that names its sensors, and two that do not
        network = FillNetwork(FillNetworkConfig(channels=8), sensors)
        (shipped / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(network, extra))
        report = evaluate(load_pipeline(shipped, device="cpu"), cfg)
        assert report["fill_network"]["scored_in_training"] == expected
        assert ("the default fill for new beams of sweeps from sensors like hdl64" in format_report(report)) == bool(sensors)
        assert [r["in_training"] for r in report["per_sweep"]] == ([None] * 2 if expected is None else
                                                                   [bool(expected), False])
        assert says in format_report(report)
        # the bar setting on the sweeps it did not learn from, alone, where some were learnt from
        assert ("On the 1 scored sweeps it did not learn from (000001.pcd)" in format_report(report)) == bool(expected)


def test_the_pictures_show_the_first_sweep_the_fill_network_did_not_learn_from(data, tmp_path, one_torch_thread):
    """A picture of a sweep the network trained on shows a fit: the pictures take the first scored sweep it did
    not learn from, and the first sweep only where it learnt from them all."""
    folder, release = data
    methods = (LINEAR, EDGE_AWARE, LEARNED)
    scored = (str(folder / "000000.pcd"), str(folder / "000001.pcd"))
    for learnt, shown, says in (([scored[0]], "000001.pcd", "did not learn from"),
                                (list(scored), "000000.pcd", "learnt from")):
        shipped = tmp_path / f"release_{len(learnt)}"
        shutil.copytree(release, shipped)
        extra = {"steps": "1", "config": json.dumps({"real": learnt, "every": [4]})}
        (shipped / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(FillNetwork(FillNetworkConfig(channels=8)), extra))
        pipe = load_pipeline(shipped, device="cpu")
        cfg = UpsampleEvalConfig(data=scored, methods=methods, sparse_example=str(tmp_path / "none.pcap"))
        report = evaluate(pipe, cfg, pictures=tmp_path / f"pictures_{len(learnt)}")
        assert report["protocol"]["pictured"] == shown
        assert f"The pictures show {shown}, a sweep the fill network {says}." in format_report(report)
        alone = evaluate(pipe, replace(cfg, data=(str(folder / shown),)), pictures=tmp_path / f"alone_{len(learnt)}")
        assert alone["protocol"]["pictured"] == shown
        for name in ("upsample_bev_0.png", "upsample_range_0.png"):  # the ring settings draw no random mask
            assert (tmp_path / f"pictures_{len(learnt)}" / name).read_bytes() == \
                (tmp_path / f"alone_{len(learnt)}" / name).read_bytes(), name

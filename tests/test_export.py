"""Export: a job dir becomes a release that loads back to exactly the job's EMA network, carries what it takes
to train it again (training.json: the resolved config and the data spec, whose `python -m lidar.sim` line
writes the same dataset), is published only once verified, and is pushed to the Hub (a localhost stand-in)
from where it loads back by revision."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants as hf_constants  # imported before any test sets HF_HUB_OFFLINE
import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from PIL import Image
from safetensors import safe_open

import training.export as export_module
from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from inference import load_pipeline
from inference.loader import ModelSourceError, load_model
from inference.network import IMAGE_CHANNELS, WorldModel, WorldModelConfig
from lidar.formats import write_points
from lidar.sensors import HDL32, VLP16
from lidar.sim.__main__ import main as simulate
from lidar.sim.dataset import SIMULATOR_VERSION, write_dataset
from tests.hub_stand_in import HubServer, serve_hub
from training.config import TrainConfig
from training.evaluate import BAR_SPAN, bars
from training.export import ReleaseVerificationError, export, loss_curve_rows, main
from training.progress import Progress

ITERATION = 7


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, WorldModel, WorldModel]:
    """A job dir as training leaves it: resolved config, progress and one checkpoint generation."""
    job_dir = tmp_path_factory.mktemp("job")
    write_dataset(job_dir / "data", HDL32.with_width(64), sequences=1, frames=2, seed=5)
    model_cfg = WorldModelConfig(sensor=HDL32.with_width(64).to_dict(), base_channels=8, channel_mults=(1, 2),
                                 strides=((1, 2),), norm_groups=4, bottleneck_attention=False, keep_gate=True,
                                 gap_fill=True)  # the shipped architecture's switches
    cfg = TrainConfig(model=model_cfg.to_dict(), data_root=str(job_dir / "data"), max_iters=10, warmup_iters=2)
    (job_dir / "config.json").write_text(cfg.to_json())
    torch.manual_seed(0)
    model, ema = WorldModel(model_cfg), WorldModel(model_cfg)
    with torch.no_grad():  # the EMA must differ from the regular weights, or the test could not tell them apart
        for p in ema.parameters():
            p.add_(0.01 * torch.randn_like(p))
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=2), JobConfig(path_local=str(job_dir)))
    ckpt.save(ModelWithEMA(model, ema), optimizer, None, None, ITERATION, async_saving=False)
    ckpt.finalize()
    progress = Progress(job_dir, "torchrun --nproc_per_node 2 -m training.train --config c.json --job-dir j",
                        "2 CPU process(es)", 0)
    for it in range(1, ITERATION + 1):
        progress.record(it, loss=1.0 / it, samples_per_s=10.0)
    return job_dir, model, ema


def test_export_then_load_gives_the_jobs_ema_outputs_exactly(job, tmp_path: Path) -> None:
    job_dir, model, ema = job
    release = tmp_path / "release"
    export(job_dir, release)
    loaded, provenance = load_model(str(release), device="cpu")
    assert provenance.iteration == ITERATION and provenance.weights == "ema"
    g = torch.Generator().manual_seed(3)
    h, w = loaded.sensor.shape
    x = torch.randn(2, IMAGE_CHANNELS, h, w, generator=g)
    t = torch.rand(2, generator=g)
    cond = torch.randn(2, loaded.config.cond_channels, h, w, generator=g)
    with torch.no_grad():
        expected = ema.eval()(x, t, cond)
        assert torch.equal(loaded(x, t, cond), expected)
        assert not torch.equal(model.eval()(x, t, cond), expected)


def test_release_is_self_describing(job, tmp_path: Path) -> None:
    job_dir, _, _ = job
    release = tmp_path / "release"
    export(job_dir, release, notes=["data simulated at commit abc1234"])
    with safe_open(str(release / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["iteration"] == str(ITERATION)
    assert meta["weights"] == "ema"
    assert meta["source"] == f"{job_dir.name}/iter_{ITERATION:09d}_ema_model.pt"
    assert WorldModelConfig.from_dict(json.loads(meta["config"])).sensor_obj.width == 64
    config = json.loads((release / "config.json").read_text())
    assert WorldModelConfig.from_dict(config["model"]).sensor_obj == HDL32.with_width(64)
    assert config["sensor"]["width"] == 64 and "range" in config["normalisation"]
    assert config["training"]["iteration"] == ITERATION and config["training"]["world_size"] == 2
    card = (release / "README.md").read_text()
    assert "torchrun --nproc_per_node 2 -m training.train --config c.json --job-dir j" in card
    assert f"iterations: {ITERATION} of 10" in card
    assert "Not evaluated yet" in card
    assert "## Notes\n\n- data simulated at commit abc1234" in card
    assert "initialised from" not in card  # trained from scratch
    assert "A keep gate" in card and "(`gap_fill`)" in card, "the card names the sampling rules the config switches on"
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in release.iterdir()), "every release file readable by all"


def test_training_json_holds_the_resolved_config_and_the_data_its_command_rebuilds(job, tmp_path: Path) -> None:
    job_dir, _, _ = job
    release = tmp_path / "release"
    export(job_dir, release)
    record = json.loads((release / "training.json").read_text())
    assert TrainConfig.from_dict(record["config"]) == TrainConfig.from_json(job_dir / "config.json")
    assert record["commands"] == ["torchrun --nproc_per_node 2 -m training.train --config c.json --job-dir j"]
    simulated = record["data"]["simulated"]
    manifest = json.loads((job_dir / "data" / "manifest.json").read_text())
    assert (simulated["simulator"], simulated["seed"], simulated["sequences"], simulated["frames"]) == (
        SIMULATOR_VERSION, 5, 1, 2)
    assert simulated["sensor"] == manifest["sensor"]
    assert record["data"]["recordings"] == [] and record["data"]["recording_fraction"] is None
    # the card's data line, run again, writes the same drives
    command = simulated["command"]
    assert f"`{command}`" in (release / "README.md").read_text()
    assert command.startswith("python -m lidar.sim ")
    again = tmp_path / "again"
    assert simulate([*command.split()[3:-1], str(again)]) == 0
    rebuilt = json.loads((again / "manifest.json").read_text())
    assert (rebuilt["sequences"], rebuilt["sensor"], rebuilt["simulator"]) == (
        manifest["sequences"], manifest["sensor"], manifest["simulator"])
    card = (release / "README.md").read_text()
    assert f"made by simulator version {SIMULATOR_VERSION} (this checkout's)" in card
    assert "`training.json` | how to train it again" in card


def test_a_card_says_when_this_checkout_simulates_another_version(job, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(export_module, "SIMULATOR_VERSION", SIMULATOR_VERSION + 1)
    export(job[0], tmp_path / "release")
    card = (tmp_path / "release" / "README.md").read_text()
    assert f"this checkout simulates version {SIMULATOR_VERSION + 1}, so the same seeds give other drives" in card


def test_a_config_outside_the_repository_is_named_and_training_json_offered(job, tmp_path: Path) -> None:
    """The fixture's job ran `--config c.json`, which no clone holds; a config tracked in training/configs is fine."""
    export(job[0], tmp_path / "release")
    assert "The config `c.json` is not in the repository: `training.json` holds" in (
        tmp_path / "release" / "README.md").read_text()
    assert export_module.configs_outside_the_repository(
        ["torchrun --nproc_per_node 1 -m training.train --config training/configs/v10.json --job-dir jobs/v10",
         "torchrun -m training.train --config /tmp/d2/v9.json --job-dir jobs/v9",
         "torchrun -m training.train --config training/configs/missing.json --job-dir jobs/x"]
    ) == ["/tmp/d2/v9.json", "training/configs/missing.json"]


def test_training_json_and_the_card_name_the_recordings_and_the_forecast_gap(job, tmp_path: Path) -> None:
    job_dir, _, _ = job
    drive = tmp_path / "drive"
    drive.mkdir()
    points = np.random.default_rng(0).uniform(-20, 20, (500, 4)).astype(np.float32)
    for i in (0, 1, 2):
        write_points(drive / f"{i:06d}.bin", points)
    copy = tmp_path / "job"
    copy.mkdir()
    for item in job_dir.iterdir():
        (copy / item.name).symlink_to(item)
    (copy / "config.json").unlink()
    cfg = json.loads(TrainConfig.from_json(job_dir / "config.json").to_json())
    (copy / "config.json").write_text(TrainConfig.from_dict(
        {**cfg, "recordings": [str(drive), str(tmp_path / "gone")], "recording_fraction": 0.25,
         "augment": {**cfg["augment"], "forecast_gap": 0.5}}).to_json())
    export(copy, tmp_path / "release")
    card = (tmp_path / "release" / "README.md").read_text()
    assert "50% of the time (`forecast_gap`) the cache ends 1-10 frames before the target" in card
    assert f"Recorded drives (25% of the samples, no map and no layout): `{drive}`" in card
    data = json.loads((tmp_path / "release" / "training.json").read_text())["data"]
    assert data["recordings"] == [
        {"path": str(drive), "sweeps": 3, "first": "000000.bin", "last": "000002.bin", "poses": "registered (KISS-ICP)"},
        {"path": str(tmp_path / "gone")},
    ]
    assert data["recording_fraction"] == 0.25 and data["simulated"]["sequences"] == 1


def test_a_job_on_several_sensors_lists_each_with_its_data_and_figures(job, tmp_path: Path) -> None:
    """`data_roots`: the card's intro, data table and limitations name every sensor; training.json keeps each
    dataset's command; config.json the union of their world seeds; `sensors` metrics give one row each."""
    job_dir, _, _ = job
    copy = tmp_path / "job"
    copy.mkdir()
    for item in job_dir.iterdir():
        (copy / item.name).symlink_to(item)
    write_dataset(tmp_path / "vlp16", VLP16.with_width(96), sequences=1, frames=2, seed=9)
    (copy / "config.json").unlink()
    cfg = json.loads(TrainConfig.from_json(job_dir / "config.json").to_json())
    (copy / "config.json").write_text(TrainConfig.from_dict(
        {**cfg, "data_roots": [str(tmp_path / "vlp16"), str(tmp_path / "gone")], "crop_pixels": 512}).to_json())
    per_ray = {"chamfer": 0.3, "l1_mean": 0.4, "l1_median": 0.1, "absrel": 0.05, "iou": 0.8, "coverage": 0.9}
    table = {"model (forecast)": per_ray, "model (generate)": {**per_ray, "chamfer": 1.2},
             "cache-only": {**per_ray, "chamfer": 1.0, "l1_median": 0.2, "iou": 0.5}}
    sensor_report = {"protocol": {"sensor": "vlp16", "shape": [16, 96], "rollouts": 4, "bar_span": BAR_SPAN},
                     "per_ray": {BAR_SPAN: table}, "timings": {"model_frames_per_s": 2.5}}
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for name in ("eval_sim_bev_vlp16.png", "eval_sim_range_vlp16.png"):
        Image.new("RGB", (8, 4)).save(pictures / name)
    export(copy, tmp_path / "release", metrics={"sensors": [sensor_report]}, pictures=pictures)
    card = (tmp_path / "release" / "README.md").read_text()
    assert "Trained at the native grids of vlp16 (16 x 96), it draws" in card
    assert "an azimuth window of about 512 pixels" in card
    assert f"| vlp16 | 16 x 96 | 1 | 2 | `python -m lidar.sim --sensor vlp16 --width 96 --sequences 1 --frames 2 " \
           f"--seed 9 --out {tmp_path / 'vlp16'}` |" in card
    assert f"`{tmp_path / 'gone'}` (no manifest found when exporting)" in card
    assert "Trained on the beam tables of hdl32 (32 x 64), vlp16 (16 x 96): elevations -30.7° to 15.0°" in card
    alone = export_module.sensor_limitation(HDL32.to_dict(), [{"sensor": VLP16.with_width(96).to_dict()}], own_grid=False)
    assert alone.startswith("- Trained on the beam tables of vlp16 (16 x 96): elevations -15.0° to 15.0°")
    row = "| vlp16 | 16 x 96 | 4 | 0.300 yes | 1.200 NO | 0.500 | 0.800 (0.500) | 2.50 |"
    section = card[card.index("### Simulated drives, sensor by sensor"):]
    assert row in section and section.index(row) < section.index("](eval_sim_bev_vlp16.png)")
    assert "](eval_sim_range_vlp16.png)" in section
    record = json.loads((tmp_path / "release" / "training.json").read_text())["data"]
    assert record["native"][0]["command"].startswith("python -m lidar.sim --sensor vlp16 --width 96")
    assert record["native"][1] == {"root": str(tmp_path / "gone"), "manifest": "not found when exporting"}
    seeds = json.loads((tmp_path / "release" / "config.json").read_text())["training"]["world_seeds"]
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (job_dir / "data", tmp_path / "vlp16")]
    assert seeds == sorted({int(s["world_seed"]) for m in manifests for s in m["sequences"]})


def test_a_fine_tuned_jobs_card_names_the_model_it_started_from(job, tmp_path: Path) -> None:
    job_dir, _, _ = job
    copy = tmp_path / "job"
    copy.mkdir()
    for item in job_dir.iterdir():
        (copy / item.name).symlink_to(item)
    cfg = TrainConfig.from_json(job_dir / "config.json")
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(TrainConfig.from_dict({**json.loads(cfg.to_json()),
                                                             "init_from": "weights/default"}).to_json())
    export(copy, tmp_path / "release")
    assert "- initialised from `weights/default`" in (tmp_path / "release" / "README.md").read_text()


def test_a_card_names_the_folder_it_is_exported_to(job, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    export(job[0], Path("weights/candidate"))
    card = (tmp_path / "weights" / "candidate" / "README.md").read_text()
    assert 'load_pipeline("weights/candidate")`.' in card
    assert "weights/default" not in card.split("## Training data")[0]
    assert "\n# LidarVerse world model\n" in card and "default world model" not in card


def test_card_includes_the_evaluation_table_when_given(job, tmp_path: Path) -> None:
    from training.evaluate import BAR_SPAN

    rows = [{"name": n, "bev_jsd": j, "bev_mmd": m, "temporal_chamfer_m": c, "map_adherence": 0.9, "return_rate": 0.5}
            for n, j, m, c in [("model (forecast)", 0.1, 0.001, 0.5), ("cache-only", 0.3, 0.003, 0.2),
                               ("ground truth", None, None, 0.4), ("sim-vs-sim floor", 0.05, 0.0005, None)]]
    per_ray = {"chamfer": 0.5, "l1_mean": 0.4, "l1_median": 0.1, "absrel": 0.05, "iou": 0.8, "coverage": 0.9}
    table = {"model (forecast)": per_ray, "model (generate)": {**per_ray, "chamfer": 1.0},
             "cache-only": {**per_ray, "chamfer": 2.0, "l1_median": 0.2, "iou": 0.5}, "noise floor": per_ray}
    report = {"protocol": {"rollouts": 64, "frames": 10, "eval_seed": 100000, "floor_seed": 200000, "steps": 4,
                           "guidance": 1.0, "sensor": "hdl32", "shape": [32, 64], "horizons": {"1.0 s": 10},
                           "bar_span": BAR_SPAN},
              "per_ray": {"1.0 s": table, BAR_SPAN: table}, "real": {"skipped": "no scans"}, "rows": rows,
              "bars": bars(table, None, rows), "timings": {"total_s": 120.0, "model_frames_per_s": 3.0}}
    export(job[0], tmp_path / "release", metrics=report)
    card = (tmp_path / "release" / "README.md").read_text()
    assert "| model (forecast) | 0.1000 |" in card
    assert "| sim forecast Chamfer ÷ cache-only's | 0.250 | ≤ 0.700 | ≤ 0.400 | yes | yes |" in card
    assert "| BEV JSD ÷ sim-vs-sim floor | 2.000 | ≤ 1.500 | ≤ 1.100 | NO | NO |" in card



def test_release_carries_the_evaluation_pictures_and_the_card_shows_them(job, tmp_path: Path) -> None:
    from PIL import Image

    pictures = tmp_path / "pictures"
    pictures.mkdir()
    Image.new("RGB", (8, 4), (10, 20, 30)).save(pictures / "eval_sim_bev.png")
    (pictures / "unrelated.png").write_bytes(b"not copied")
    release = tmp_path / "release"
    export(job[0], release, pictures=pictures)
    assert sorted(p.name for p in release.iterdir()) == ["README.md", "config.json", "eval_sim_bev.png",
                                                          "model.safetensors", "training.json"]
    assert Image.open(release / "eval_sim_bev.png").getpixel((0, 0)) == (10, 20, 30)
    card = (release / "README.md").read_text()
    assert "](eval_sim_bev.png)" in card and "eval_kitti_bev.png" not in card
    assert export_module.picture_caption("real_kitti00_range_10.png") == (
        "real `kitti00`, 1 s ahead: truth / forecast / every prefix sweep moved (range images)")
    assert export_module.picture_caption("real_kitti00_bev_10_bfloat16.png") == (
        "real `kitti00` in bfloat16, 1 s ahead: truth | forecast | every prefix sweep moved (BEV)")
    assert export_module.picture_caption("eval_sim_bev_hdl64.png").startswith("simulated drive on hdl64, 1.0 s ahead")
    assert export_module.picture_caption("unrelated.png") is None
    export(job[0], release, pictures=pictures)  # a release with pictures can be replaced by the next export
    assert main([str(job[0]), str(tmp_path / "other"), "--pictures", str(tmp_path / "missing")]) == 2


def test_card_has_the_upsampling_section_with_its_pictures_when_given(job, tmp_path: Path) -> None:
    from PIL import Image

    from training.evaluate_upsample import BAR_SETTING, SETTINGS, bars

    row = {"mae": 0.5, "median": 0.07, "iou": 0.85, "chamfer": 0.09, "sweeps_per_s": 2.0}
    tables = {s.name: {"linear": row, "edge-aware": {**row, "mae": 0.45, "chamfer": 0.06}} for s in SETTINGS}
    report = {"protocol": {"sweeps": ["000000.bin"], "duplicates": [], "skipped": [], "steps": 2, "seed": 0,
                           "baseline": "linear", "bar_setting": BAR_SETTING},
              "tables": tables, "bars": bars(tables), "per_sweep": [{"shape": [64, 2010]}], "timings": {"total_s": 60.0}}
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for name in ("upsample_bev_0.png", "upsample_range_sparse.png"):
        Image.new("RGB", (8, 4)).save(pictures / name)
    release = tmp_path / "release"
    export(job[0], release, metrics={"upsampling": report}, pictures=pictures)
    card = (release / "README.md").read_text()
    section = card[card.index("### Upsampling and completion of real sweeps"):]
    assert "| edge-aware | 0.450 | 0.070 | 0.850 | 0.0600 | 2.000 |" in section
    assert "| edge-aware | 0.900 ✗ | 0.667 ✓ | 1.000 ✓ |" in section
    assert section.index("](upsample_bev_0.png)") < section.index("](upsample_range_sparse.png)")
    assert export_module.picture_caption("upsample_bev_0.png") == (
        f"a real KITTI sweep, {SETTINGS[0].name}: given | each fill | truth (BEV)")
    assert export_module.picture_caption("upsample_range_sparse.png").startswith("a real VLP-16 sweep made 4x denser")
    assert export_module.picture_caption("upsample_bev_x.png") is None


def test_a_release_can_ship_a_fill_network_and_a_foreign_one_is_refused(job, tmp_path: Path) -> None:
    from inference.fill_network import FILL_WEIGHTS_NAME, FillNetwork, FillNetworkConfig, fill_network_bytes

    fill = tmp_path / "fill.safetensors"
    fill.write_bytes(fill_network_bytes(FillNetwork(FillNetworkConfig(channels=8))))
    release = tmp_path / "release"
    export(job[0], release, fill=fill)
    assert (release / FILL_WEIGHTS_NAME).read_bytes() == fill.read_bytes()
    assert load_pipeline(release, device="cpu").fill_network is not None
    export(job[0], release)  # a release holding a fill network is replaced by the next export
    assert not (release / FILL_WEIGHTS_NAME).exists()
    assert main([str(job[0]), str(tmp_path / "other"), "--fill", str(release / "model.safetensors")]) == 2
    assert not (tmp_path / "other").exists()


def test_loss_curve_summary_averages_stretches_and_ends_at_the_last_iteration() -> None:
    losses = [[i, float(i)] for i in range(1, 101)]
    rows = loss_curve_rows(losses, points=4)
    assert rows == [(25, 13.0), (50, 38.0), (75, 63.0), (100, 88.0)]


def test_cli_refuses_a_folder_that_is_not_a_job(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a training job dir" in capsys.readouterr().err


# --- commit point: stage, verify by loading back, rename into place --------------------------------------------


def _previous_release(job_dir: Path, out: Path) -> dict[str, bytes]:
    """A release already at `out`, told apart from any new export by a marker in its config."""
    export(job_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "previous": True}))
    return {p.name: p.read_bytes() for p in out.iterdir()}


def _leftovers(parent: Path, out: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p != out)


def test_a_release_that_does_not_load_back_to_the_ema_is_never_published(job, tmp_path, monkeypatch) -> None:
    job_dir, _, _ = job
    out = tmp_path / "release"
    before = _previous_release(job_dir, out)
    real_save = export_module.save_file

    def save_with_a_flipped_weight(state, path, metadata):  # a writer bug the read-back must catch
        name = next(iter(state))
        real_save({**state, name: state[name] + 1.0}, path, metadata=metadata)

    monkeypatch.setattr(export_module, "save_file", save_with_a_flipped_weight)
    with pytest.raises(ReleaseVerificationError, match=r"differ from the job's EMA.*Nothing was published"):
        export(job_dir, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, out) == []


def test_an_export_interrupted_mid_write_leaves_the_previous_release_whole(job, tmp_path, monkeypatch) -> None:
    job_dir, _, _ = job
    out = tmp_path / "release"
    before = _previous_release(job_dir, out)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("interrupted after the weights and config were written")

    monkeypatch.setattr(export_module, "model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        export(job_dir, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, out) == []


def test_a_verified_export_replaces_the_previous_release_as_a_whole(job, tmp_path) -> None:
    job_dir, _, ema = job
    out = tmp_path / "release"
    _previous_release(job_dir, out)
    export(job_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "training.json"]
    assert "previous" not in json.loads((out / "config.json").read_text())
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    loaded, _ = load_model(str(out), device="cpu")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ema.state_dict().items())
    assert _leftovers(tmp_path, out) == []


def test_export_refuses_to_replace_a_folder_holding_other_files(job, tmp_path, capsys) -> None:
    out = tmp_path / "weights"
    out.mkdir()
    (out / "notes.txt").write_text("not part of a release")
    assert main([str(job[0]), str(out)]) == 2
    assert "holds files that are not part of a release (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").is_file() and _leftovers(tmp_path, out) == []


def test_card_front_matter_is_the_hubs_metadata(job, tmp_path) -> None:
    export(job[0], tmp_path / "release", base_model="lidarverse/lidarverse-default")
    card = ModelCard.load(tmp_path / "release" / "README.md")
    assert card.data.license == "apache-2.0" and card.data.library_name == "lidarverse"
    assert card.data.pipeline_tag == "robotics" and "lidar" in card.data.tags
    assert card.data.base_model == "lidarverse/lidarverse-default"
    assert card.text.lstrip().startswith("# LidarVerse")


# --- publishing to the Hub (the localhost stand-in; huggingface_hub runs unmodified) -----------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    if hf_constants.HF_HUB_OFFLINE:
        pytest.skip("this process started with HF_HUB_OFFLINE=1, so huggingface_hub refuses every request")
    HubServer.reset()
    with serve_hub(monkeypatch, tmp_path / "hub-cache"):
        yield HubServer


def test_push_to_hub_uploads_the_release_and_it_loads_back_by_revision(job, tmp_path, hub) -> None:
    job_dir, _, ema = job
    out = tmp_path / "release"
    argv = [str(job_dir), str(out), "--push-to-hub", "lidarverse/tiny-release", "--revision", "v1"]
    assert main(argv) == 0
    assert main(argv) == 0  # exporting and pushing again: the repo and the branch exist already
    assert len(hub.commits) == 2
    commit = hub.commits[-1]
    assert (commit["repo"], commit["branch"]) == ("lidarverse/tiny-release", "v1")
    assert sorted(commit["files"]) == ["README.md", "config.json", "model.safetensors", "training.json"]
    assert commit["files"]["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert f"iteration {ITERATION}" in commit["summary"]
    assert {auth for path, auth in hub.requests if path.startswith("POST")} == {"Bearer hf_from_the_environment"}
    card = ModelCard(commit["files"]["README.md"].decode())
    assert card.data.library_name == "lidarverse" and card.data.pipeline_tag == "robotics"
    assert 'load_pipeline("lidarverse/tiny-release@v1")' in card.text, "the pushed card's load line names the repo"
    assert str(out) not in card.text
    pipe = load_pipeline("lidarverse/tiny-release@v1", device="cpu", dtype=torch.float32)
    assert pipe.provenance.iteration == ITERATION and pipe.provenance.revision == hub.uploaded[
        "lidarverse/tiny-release"]["v1"][0]
    assert all(torch.equal(pipe.model.state_dict()[k], v) for k, v in ema.state_dict().items())
    with pytest.raises(ModelSourceError, match="revision 'v2' does not exist"):
        load_pipeline("lidarverse/tiny-release@v2", device="cpu")


def test_push_options_are_checked_before_any_work(job, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main([str(job[0]), str(tmp_path / "out"), "--revision", "v1"])
    assert "--revision needs --push-to-hub" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(job[0]), str(tmp_path / "out"), "--push-to-hub", "no-org"])
    assert "expects ORG/NAME" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_file_of_the_shipped_release_is_a_release_file_its_card_shows() -> None:
    """A file the exporter does not know would stop the next export into the folder (`check_replaceable`) and
    would not be pushed to a Hub repo; a picture the card does not show is dead weight."""
    release = Path(__file__).resolve().parents[1] / "weights" / "default"
    card = (release / "README.md").read_text()
    for item in release.iterdir():
        assert export_module.is_release_file(item.name), item.name
        if item.suffix == ".png":
            assert f"]({item.name})" in card, item.name

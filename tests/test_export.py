"""Export: a job dir becomes a release that loads back to exactly the job's EMA network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from inference.loader import load_model
from inference.network import WorldModel, WorldModelConfig
from lidar.sensors import HDL32
from training.config import TrainConfig
from training.export import export, loss_curve_rows, main
from training.progress import Progress

ITERATION = 7


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, WorldModel, WorldModel]:
    """A job dir as training leaves it: resolved config, progress and one checkpoint generation."""
    job_dir = tmp_path_factory.mktemp("job")
    model_cfg = WorldModelConfig(sensor=HDL32.with_width(64).to_dict(), base_channels=8, channel_mults=(1, 2),
                                 strides=((1, 2),), norm_groups=4, bottleneck_attention=False)
    cfg = TrainConfig(model=model_cfg.to_dict(), data_root=str(job_dir / "no-data"), max_iters=10, warmup_iters=2)
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
    x = torch.randn(2, 2, h, w, generator=g)
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


def test_card_includes_the_evaluation_table_when_given(job, tmp_path: Path) -> None:
    from training.evaluate import bars

    rows = [{"name": n, "bev_jsd": j, "bev_mmd": m, "temporal_chamfer_m": c, "map_adherence": 0.9, "return_rate": 0.5}
            for n, j, m, c in [("model (forecast)", 0.1, 0.001, 0.5), ("model (generate)", 0.2, 0.002, 0.6),
                               ("cache-only", 0.3, 0.003, 0.2), ("map-only", 0.4, 0.004, 0.3),
                               ("ground truth", None, None, 0.4), ("sim-vs-sim floor", 0.05, 0.0005, None)]]
    report = {"protocol": {"rollouts": 64, "frames": 8, "eval_seed": 100000, "floor_seed": 200000, "steps": 4,
                           "guidance": 1.0, "sensor": "hdl32", "shape": [32, 64]},
              "rows": rows, "bars": bars(rows), "timings": {"total_s": 120.0, "model_frames_per_s": 3.0}}
    export(job[0], tmp_path / "release", metrics=report)
    card = (tmp_path / "release" / "README.md").read_text()
    assert "| model (forecast) | 0.1000 |" in card
    assert "| bev_jsd <= 3x floor (goal 1.5x) | 2.0000 | 3.0000 | yes |" in card
    assert "| temporal Chamfer <= 1.5x ground truth | 1.2500 | 1.5000 | yes |" in card


def test_loss_curve_summary_averages_stretches_and_ends_at_the_last_iteration() -> None:
    losses = [[i, float(i)] for i in range(1, 101)]
    rows = loss_curve_rows(losses, points=4)
    assert rows == [(25, 13.0), (50, 38.0), (75, 63.0), (100, 88.0)]


def test_cli_refuses_a_folder_that_is_not_a_job(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a training job dir" in capsys.readouterr().err

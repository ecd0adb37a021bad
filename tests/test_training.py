"""Training: a tiny model trains on 2 gloo ranks, is SIGKILLed, resumes by itself and continues.

Everything is real: torchrun, gloo, FSDP2, the checkpointer's files and a simulated dataset (at a narrow
32 x 64 sensor so it takes seconds).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig
from checkpointing.generations import list_generations
from inference.network import WorldModelConfig
from lidar.sensors import HDL32
from lidar.sim.dataset import write_dataset
from tests.helpers import TRAIN_MAX_ITERS, TRAIN_SENSOR, tiny_train_config
from training.config import TrainConfig
from training.config_record import MARKER_KEY, ConfigChangeError, check_resume_config
from training.data import StepBatches, WorldModelSamples, load_drives
from training.train import checkpoint_layout, lr_lambda

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sim") / "data"
    write_dataset(root, TRAIN_SENSOR, sequences=2, frames=4, seed=7)
    return root


def _launch(config: Path, job: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "training.train", "--config", str(config), "--job-dir", str(job)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _pointer_iteration(job: Path) -> int | None:
    pointer = job / "checkpoints" / "latest_checkpoint.txt"
    if not pointer.is_file():
        return None
    return int(pointer.read_text().strip().removeprefix("iter_").removesuffix(".pt"))


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_data: Path, tmp_path_factory) -> dict:
    """Train, SIGKILL the whole torchrun group after the first checkpoint, relaunch to the end."""
    tmp = tmp_path_factory.mktemp("train")
    config, job = tmp / "tiny.json", tmp / "job"
    config.write_text(json.dumps(tiny_train_config(tiny_data)))
    first = _launch(config, job, tmp / "first.log")
    deadline = time.monotonic() + 240
    while _pointer_iteration(job) is None and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # torchrun starts its workers in sessions of their own: kill the launcher and every worker it started.
    launcher = psutil.Process(first.pid)
    workers = launcher.children(recursive=True)
    for proc in [launcher, *workers]:
        proc.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    psutil.wait_procs(workers, timeout=30)
    killed_at = _pointer_iteration(job)
    assert killed_at is not None, (tmp / "first.log").read_text()[-3000:]
    second = _launch(config, job, tmp / "second.log")
    assert second.wait(timeout=300) == 0, (tmp / "second.log").read_text()[-3000:]
    return {"job": job, "killed_at": killed_at, "log": (job / "train.log").read_text(), "config": config}


@pytest.mark.multiprocess
def test_training_resumes_from_the_saved_iteration_after_sigkill(killed_and_resumed: dict) -> None:
    job, killed_at = killed_and_resumed["job"], killed_and_resumed["killed_at"]
    assert 0 < killed_at < TRAIN_MAX_ITERS, "the kill must land mid-run for the test to mean anything"
    log = killed_and_resumed["log"]
    assert f"continuing from iteration {killed_at}" in log
    assert f"starting at iteration {killed_at} of {TRAIN_MAX_ITERS}" in log
    assert f"finished {TRAIN_MAX_ITERS} iterations" in log
    assert _pointer_iteration(job) == TRAIN_MAX_ITERS
    progress = json.loads((job / "progress.json").read_text())
    assert [launch["start_iter"] for launch in progress["launches"]] == [0, killed_at]
    assert progress["launches"][-1]["end_iter"] == TRAIN_MAX_ITERS
    iterations = [it for it, _ in progress["losses"]]
    assert iterations == sorted(set(iterations)), "resumed steps must not be logged twice"
    assert iterations[-1] == TRAIN_MAX_ITERS
    assert all(np.isfinite(loss) for _, loss in progress["losses"])
    resolved = TrainConfig.from_json(job / "config.json")
    assert resolved == TrainConfig.from_json(killed_and_resumed["config"])


@pytest.mark.multiprocess
def test_ema_differs_from_the_trained_weights_and_both_are_saved(killed_and_resumed: dict) -> None:
    """Two ranks save the sharded layout by default; one plain process reads either part."""
    from checkpointing import FSDPInferenceCheckpointer, resolve_generation
    from inference.network import WorldModel

    generation = resolve_generation(killed_and_resumed["job"]).generation
    assert generation.manifest.state_layout == "sharded" and generation.manifest.world_size == 2
    marker = killed_and_resumed["job"] / "checkpoints" / f"iter_{TRAIN_MAX_ITERS:09d}.pt"
    config = WorldModelConfig.from_dict(TrainConfig.from_json(killed_and_resumed["config"]).model)
    reg, ema = WorldModel(config), WorldModel(config)
    FSDPInferenceCheckpointer(marker).load_model_during_init(reg)
    FSDPInferenceCheckpointer(marker).load_model_during_init(ema, is_ema=True)
    reg_state, ema_state = reg.state_dict(), ema.state_dict()
    assert reg_state.keys() == ema_state.keys()
    assert any(not torch.equal(reg_state[k], ema_state[k]) for k in reg_state)


def test_the_checkpoint_layout_is_sharded_above_one_rank_unless_the_config_names_one(tiny_data: Path) -> None:
    auto = TrainConfig.from_dict(tiny_train_config(tiny_data))
    assert (checkpoint_layout(auto, 1), checkpoint_layout(auto, 2)) == ("full", "sharded")
    full = TrainConfig.from_dict(tiny_train_config(tiny_data, checkpoint_layout="full"))
    assert checkpoint_layout(full, 4) == "full"
    with pytest.raises(ValueError, match="checkpoint_layout must be one of"):
        TrainConfig.from_dict(tiny_train_config(tiny_data, checkpoint_layout="zero3"))


@pytest.mark.multiprocess
def test_a_sharded_training_job_exports_a_release_of_its_ema(killed_and_resumed: dict, tmp_path) -> None:
    """training.export reads the 2-rank job's sharded generation and verifies the release against its EMA."""
    from inference.loader import load_model
    from training.export import export

    weights = export(killed_and_resumed["job"], tmp_path / "release")
    release, provenance = load_model(str(weights.parent))
    job_model, job_provenance = load_model(str(killed_and_resumed["job"]))
    assert (provenance.iteration, provenance.weights) == (TRAIN_MAX_ITERS, "ema")
    assert job_provenance.resolved_path.endswith(f"iter_{TRAIN_MAX_ITERS:09d}_ema_model.metadata")
    for (name, a), b in zip(release.state_dict().items(), job_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_schedule_warms_up_linearly_then_decays_to_the_floor(tiny_data: Path) -> None:
    cfg = TrainConfig.from_dict(tiny_train_config(tiny_data, warmup_iters=10, max_iters=110, min_lr_ratio=0.1))
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(values))


def test_samples_are_a_pure_function_of_seed_iteration_and_rank(tiny_data: Path) -> None:
    cfg = TrainConfig.from_dict(tiny_train_config(tiny_data))
    samples = WorldModelSamples(load_drives(cfg.data_root, TRAIN_SENSOR), cfg)
    a, again = samples[(3, 0, 1)], samples[(3, 0, 1)]
    assert torch.equal(a["x"], again["x"]) and torch.equal(a["cond"], again["cond"])
    assert a["x"].shape == (2, *TRAIN_SENSOR.shape)
    assert a["cond"].shape == (WorldModelConfig.from_dict(cfg.model).cond_channels, *TRAIN_SENSOR.shape)
    others = [samples[(3, rank, 1)]["cond"] for rank in range(1, 6)]
    assert any(not torch.equal(a["cond"], o) for o in others), "ranks must not share a random stream"
    reseeded = WorldModelSamples(samples.drives, TrainConfig.from_dict(tiny_train_config(tiny_data, seed=1)))
    assert any(not torch.equal(samples[(k, 0, 0)]["cond"], reseeded[(k, 0, 0)]["cond"]) for k in range(5))


def _samples_with(tiny_data: Path, p_drop_layout: float = 0.15, **augment) -> WorldModelSamples:
    base = tiny_train_config(tiny_data)
    cfg = TrainConfig.from_dict({**base, "model": {**base["model"], "p_drop_layout": p_drop_layout},
                                 "augment": augment})
    return WorldModelSamples(load_drives(cfg.data_root, TRAIN_SENSOR), cfg)


def test_a_samples_layout_block_is_sometimes_dropped_and_otherwise_holds_the_frames_boxes(tiny_data: Path) -> None:
    from inference.conditioning import ConditionLayout, empty_condition

    samples = _samples_with(tiny_data, p_drop_layout=0.5)
    lay = ConditionLayout(WorldModelConfig.from_dict(samples.cfg.model).num_map_classes)
    layout = slice(lay.layout_start, lay.coords_start)
    empty = torch.from_numpy(empty_condition(TRAIN_SENSOR))[layout]
    conds = [samples[(k, 0, 0)]["cond"] for k in range(16)]
    dropped = [torch.equal(c[layout], empty) for c in conds]
    kept = [c for c, d in zip(conds, dropped, strict=True) if not d]
    assert 3 <= sum(dropped) <= 13
    assert all((c[lay.coords_start - 1] == 1).all() for c in kept), "a kept layout raises its flag"
    assert any((c[lay.box_range] > -1).any() for c in kept), "the drives' actors show in some kept layouts"
    for c in kept:  # every pixel with a box range has exactly one class, and only those
        has_box = c[lay.box_range] > -1
        assert torch.equal(c[lay.box_range + 1 : lay.coords_start - 1].sum(0), has_box.float())


def test_the_layout_is_the_frames_boxes_unless_augmented_and_missing_actors_drop_out(tiny_data: Path) -> None:
    from inference.conditioning import layout_view

    exact = _samples_with(tiny_data, layout_missing=0.0, layout_stale=0.0, layout_center_noise=0.0)
    drive = exact.drives[0]
    frames = [t for t in range(len(drive)) if (layout_view(*drive.frame_boxes(t), drive.poses[t], TRAIN_SENSOR)
                                               .range > 0).any()]
    assert frames, "the tiny drive must see an actor"
    t = frames[-1]
    want = layout_view(*drive.frame_boxes(t), drive.poses[t], TRAIN_SENSOR)
    got = exact.layout_at(drive, t, np.random.default_rng(0))
    np.testing.assert_array_equal(got.range, want.range)
    np.testing.assert_array_equal(got.classes, want.classes)
    missing = _samples_with(tiny_data, layout_missing=0.99, layout_stale=0.0, layout_center_noise=0.0)
    assert (missing.layout_at(drive, t, np.random.default_rng(0)).range > 0).sum() < (want.range > 0).sum()
    a = missing.layout_at(drive, t, np.random.default_rng(5))
    b = missing.layout_at(drive, t, np.random.default_rng(5))
    np.testing.assert_array_equal(a.range, b.range)


def test_a_cropped_cache_holds_only_what_a_narrower_sensor_would_have_seen(tiny_data: Path) -> None:
    from lidar.range_image import beam_rows
    from lidar.vocabulary import transform_points
    from training.data import FOV_BOTTOM_DEG, FOV_TOP_DEG, WorldModelSamples, load_drives

    exact = {"dropout": 0.0, "range_noise": 0.0, "jitter_translation": 0.0, "jitter_rotation_deg": 0.0}
    base = tiny_train_config(tiny_data)
    elevations = np.degrees(TRAIN_SENSOR.elevations)
    samples = {}
    for crop in (0.0, 0.99):
        cfg = TrainConfig.from_dict({**base, "cache_frames": 1, "augment": {**exact, "fov_crop": crop}})
        samples[crop] = WorldModelSamples(load_drives(cfg.data_root, TRAIN_SENSOR), cfg)
    drive = samples[0.0].drives[0]
    t = len(drive) - 1
    narrower = 0
    for seed in range(4):
        # one cached frame, t - 1, without noise: each point lies on one of that sensor's beams
        full, cropped = (np.unique(beam_rows(transform_points(s.cache_before(drive, t, np.random.default_rng(seed)),
                                                              np.linalg.inv(drive.poses[t - 1])), TRAIN_SENSOR))
                         for s in (samples[0.0], samples[0.99]))
        assert set(cropped) <= set(full)
        assert (np.diff(cropped) == 1).all(), "a narrower sensor's beams are one band"
        # every sensor drawn covers FOV_BOTTOM_DEG[1]..FOV_TOP_DEG[0]; what it leaves out lies beyond its limits
        always = full[(elevations[full] >= FOV_BOTTOM_DEG[1]) & (elevations[full] <= FOV_TOP_DEG[0])]
        assert set(always) <= set(cropped)
        dropped = np.setdiff1d(full, cropped)
        assert ((elevations[dropped] > FOV_TOP_DEG[0]) | (elevations[dropped] < FOV_BOTTOM_DEG[1])).all()
        narrower += len(cropped) < len(full)
    assert narrower >= 3


def test_a_resumed_sampler_yields_exactly_the_remaining_batches() -> None:
    full = list(StepBatches(0, 10, 3, rank=1))
    assert list(StepBatches(4, 10, 3, rank=1)) == full[4:]
    assert full[4] == [(4, 1, 0), (4, 1, 1), (4, 1, 2)]


def test_dataset_for_another_sensor_is_refused_with_both_shapes(tiny_data: Path) -> None:
    with pytest.raises(ValueError, match=r"\(32, 64\).*\(32, 512\)"):
        load_drives(str(tiny_data), HDL32.with_width(512))


# --- a resume keeps the config its checkpoint was made with ------------------------------------------------------


def _launch_once(config: dict, job: Path, tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    """One plain-python launch (world size 1) on a free port, so parallel test runs never collide."""
    path = tmp / "launch.json"
    path.write_text(json.dumps(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "training.train", "--config", str(path), "--job-dir", str(job), *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess
def test_a_resume_with_another_config_is_refused_naming_the_fields(killed_and_resumed: dict, tmp_path) -> None:
    job = tmp_path / "job"
    shutil.copytree(killed_and_resumed["job"], job)
    before = (job / "config.json").read_text()
    original = json.loads(killed_and_resumed["config"].read_text())
    result = _launch_once({**original, "max_iters": TRAIN_MAX_ITERS + 5, "lr": 2e-3}, job, tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"max_iters: {TRAIN_MAX_ITERS} -> {TRAIN_MAX_ITERS + 5}" in result.stderr
    assert "lr: 0.001 -> 0.002" in result.stderr and "--allow-config-change" in result.stderr
    assert (job / "config.json").read_text() == before
    assert _pointer_iteration(job) == TRAIN_MAX_ITERS
    assert not (job / "config_history.jsonl").exists()


@pytest.mark.multiprocess
def test_allow_config_change_extends_the_schedule_and_keeps_the_original_config(
    killed_and_resumed: dict, tmp_path
) -> None:
    job = tmp_path / "job"
    shutil.copytree(killed_and_resumed["job"], job)
    original = json.loads(killed_and_resumed["config"].read_text())
    longer = TRAIN_MAX_ITERS + 4
    result = _launch_once({**original, "max_iters": longer}, job, tmp_path, "--allow-config-change")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _pointer_iteration(job) == longer
    assert f"continuing from iteration {TRAIN_MAX_ITERS}" in (job / "train.log").read_text()
    assert TrainConfig.from_json(job / "config.json").max_iters == longer
    (entry,) = [json.loads(line) for line in (job / "config_history.jsonl").read_text().splitlines()]
    assert entry["from_iteration"] == TRAIN_MAX_ITERS
    assert entry["changed"] == [f"max_iters: {TRAIN_MAX_ITERS} -> {longer}"]
    assert TrainConfig.from_dict(entry["config"]) == TrainConfig.from_dict(original)
    marker = torch.load(job / "checkpoints" / f"iter_{longer:09d}.pt", weights_only=True)
    assert json.loads(marker[MARKER_KEY])["max_iters"] == longer  # each checkpoint says how it was made
    # one rank resumed the two ranks' sharded generation and saves the full layout from there on
    layouts = {g.iteration: g.manifest.state_layout for g in list_generations(job / "checkpoints")}
    assert (layouts[TRAIN_MAX_ITERS], layouts[longer]) == ("sharded", "full")


def test_checkpoints_with_no_record_of_their_config_need_the_explicit_flag(tiny_data: Path, tmp_path) -> None:
    job = tmp_path / "copied"  # checkpoints copied from elsewhere, saved before markers carried the config
    FSDPCheckpointer(CheckpointConfig(), JobConfig(path_local=str(job))).save(
        torch.nn.Linear(2, 2), None, None, None, 5, async_saving=False
    )
    cfg = TrainConfig.from_dict(tiny_train_config(tiny_data))
    with pytest.raises(ConfigChangeError, match=r"iteration 5, made with another config: \(no record"):
        check_resume_config(job, cfg, allow_change=False)
    assert check_resume_config(job, cfg, allow_change=True)[0] == 5
    assert check_resume_config(tmp_path / "fresh", cfg, allow_change=False) == (0, [])


@pytest.mark.multiprocess
def test_a_job_with_init_from_starts_from_that_models_weights(killed_and_resumed: dict, tiny_data: Path, tmp_path) -> None:
    """Fine-tuning: a fresh job dir whose config names a trained model starts from its (EMA) weights."""
    from inference.loader import load_model

    source = str(killed_and_resumed["job"])
    config, job = tmp_path / "finetune.json", tmp_path / "job"
    # one step at a vanishing learning rate: what the job saves is what it started from
    config.write_text(json.dumps(tiny_train_config(tiny_data, init_from=source, max_iters=1, warmup_iters=0, lr=1e-9,
                                             weight_decay=0.0, save_iter=1)))
    run = _launch(config, job, tmp_path / "run.log")
    assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert f"initialised from {source}" in (job / "train.log").read_text()
    started, _ = load_model(str(job))
    trained, _ = load_model(source)
    for (name, a), b in zip(started.state_dict().items(), trained.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_init_from_a_model_without_the_keep_gate_grows_its_head_and_drops_or_adds_the_attention(
    killed_and_resumed: dict, caplog
) -> None:
    """A v6-style source (no gate) fine-tunes into a gated network: every shared weight carries over, the head's
    first outputs are the source's, and what the source lacks (the gate, the attention) keeps its own init."""
    from inference.loader import load_model
    from inference.network import IMAGE_CHANNELS, KEEP, WorldModel
    from training.train import load_init_weights

    source, _ = load_model(str(killed_and_resumed["job"]))
    assert not source.config.keep_gate and not source.config.bottleneck_attention
    config = WorldModelConfig.from_dict({**source.config.to_dict(), "keep_gate": True, "bottleneck_attention": True})
    torch.manual_seed(1)
    model = WorldModel(config)
    fresh_attention = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mid_attn")}
    with torch.no_grad():
        model.head[-1].weight.fill_(7.0)  # marks what the source does not overwrite
    with caplog.at_level(logging.INFO, logger="training.train"):
        load_init_weights(model, str(killed_and_resumed["job"]))
    mine, theirs = model.state_dict(), source.state_dict()
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name][: value.shape[0]], value, atol=0, rtol=0, msg=name)
    assert mine["head.2.weight"].shape[0] == IMAGE_CHANNELS + 1
    assert (mine["head.2.weight"][KEEP] == 7.0).all(), "the gate's row is the network's own"
    assert torch.count_nonzero(WorldModel(config).head[-1].weight) == 0, "and a fresh network's is zero"
    for name, value in fresh_attention.items():
        assert torch.equal(mine[name], value), f"{name}: no source weight, so it keeps its own initialisation"
    assert "new: ['mid_attn." in caplog.text


def test_init_from_a_gated_release_into_a_job_without_the_gate_keeps_the_heads_first_outputs(tmp_path, caplog) -> None:
    """The other direction: the shipped release has the gate; a job that turns it off starts from the rest."""
    from inference.network import IMAGE_CHANNELS, WorldModel
    from tests.helpers import write_release
    from training.train import load_init_weights

    gated = WorldModelConfig(sensor=TRAIN_SENSOR.to_dict(), base_channels=8, channel_mults=(1, 2), strides=((1, 2),),
                             norm_groups=4, bottleneck_attention=False, keep_gate=True, gap_fill=True)
    torch.manual_seed(2)
    source = WorldModel(gated)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    release = write_release(tmp_path / "gated", source)
    model = WorldModel(WorldModelConfig.from_dict({**gated.to_dict(), "keep_gate": False, "gap_fill": False}))
    with caplog.at_level(logging.INFO, logger="training.train"):
        load_init_weights(model, str(release))
    mine, theirs = model.state_dict(), source.state_dict()
    assert mine["head.2.weight"].shape[0] == IMAGE_CHANNELS
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name][: value.shape[0]], atol=0, rtol=0, msg=name)
    assert "first outputs only: ['head.2.weight', 'head.2.bias']" in caplog.text


def test_init_from_a_model_of_another_architecture_is_refused_naming_the_fields(killed_and_resumed: dict) -> None:
    from inference.network import WorldModel
    from training.train import load_init_weights

    other = WorldModelConfig(sensor=TRAIN_SENSOR.to_dict(), base_channels=4, channel_mults=(1, 2), strides=((1, 2),),
                             norm_groups=4, bottleneck_attention=False)
    with pytest.raises(ValueError, match=r"differs from config.model in \['base_channels'\]"):
        load_init_weights(WorldModel(other), str(killed_and_resumed["job"]))

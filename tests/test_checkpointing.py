"""Checkpointing in one process: layout, resume completeness, the seed's defects, faults, CLI.

Each test that names a seed defect (one of the seed's eight, 1 to 8) asserts the behaviour the seed got wrong.
Multi-process and SIGKILL tests live in test_checkpointing_dist.py and, for the sharded layout,
test_checkpointing_sharded.py; the single-process tests of both layouts live here.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import checkpointing.atomic
from checkpointing import (
    AsyncSaveError,
    CheckpointConfig,
    CheckpointError,
    CheckpointPointerError,
    CheckpointWriteError,
    FSDPCheckpointer,
    FSDPInferenceCheckpointer,
    JobConfig,
    ModelWithEMA,
    NoValidCheckpointError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    atomic_torch_save,
    atomic_write_text,
    read_weights,
    resolve_generation,
    resolve_weights,
)
from checkpointing.__main__ import main as cli
from checkpointing.generations import generation_problems, list_generations, prune_plan

REPO = Path(__file__).resolve().parents[1]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def make_training(seed: int = 0):
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    return model, optimizer, scheduler, scaler


def train(model, optimizer, scheduler, scaler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(5, 4) + random.random() + float(np.random.rand())
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def make_ckpt(job: Path, **config) -> FSDPCheckpointer:
    return FSDPCheckpointer(CheckpointConfig(**config), JobConfig(path_local=str(job)))


def save_generations(job: Path, iterations, **config) -> dict[int, dict[str, torch.Tensor]]:
    """Save a model whose weights are filled with the iteration number; return each saved state."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = make_ckpt(job, keep_last_checkpoints=config.pop("keep_last_checkpoints", 5), **config)
    saved = {}
    for it in iterations:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(it))
        ckpt.save(model, optimizer, None, None, it, async_saving=False)
        saved[it] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def load_fresh(job: Path, **config) -> tuple[int, nn.Module]:
    model = make_model(seed=123)
    return make_ckpt(job, **config).load(model), model


def ckdir(job: Path) -> Path:
    return job / "checkpoints"


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"verify": "md5"}, "verify"),
        ({"keep_last_checkpoints": -1}, "keep_last_checkpoints"),
        ({"save_at_iters": 5}, "save_at_iters"),
        ({"save_iter": 0}, "save_iter"),
        ({"disk_headroom": 0.5}, "disk_headroom"),
        ({"async_saving": "yes"}, "async_saving"),
        ({"state_layout": "zero3"}, "state_layout"),
    ],
)
def test_bad_config_fields_fail_at_construction_naming_field_and_value(kwargs, named):
    with pytest.raises((ValueError, TypeError)) as info:
        CheckpointConfig(**kwargs)
    assert named in str(info.value) and repr(next(iter(kwargs.values()))) in str(info.value)


def test_job_config_derives_path_and_rejects_bad_names():
    assert JobConfig(project="p", group="g", name="n").path_local == os.path.join("jobs", "p", "g", "n")
    assert JobConfig(path_local="/x/y").path_local == "/x/y"
    with pytest.raises(ValueError, match=r"JobConfig\.name"):
        JobConfig(name="a/b")


# ---------------------------------------------------------------- layout


def test_layout_matches_the_seed_names(tmp_path):
    job = tmp_path / "job"
    model, optimizer, scheduler, scaler = make_training()
    ckpt = make_ckpt(job, keep_last_checkpoints=0, save_at_iters=(20,))
    ckpt.save(ModelWithEMA(model, make_model(1)), optimizer, scheduler, scaler, 10, async_saving=False)
    files = set(os.listdir(ckdir(job)))
    assert {"ckpt_.pt", "ckpt__reg_model.pt", "ckpt__ema_model.pt", "ckpt__optim.pt"} <= files
    assert (ckdir(job) / "latest_checkpoint.txt").read_text() == "ckpt_.pt\n"
    ckpt.save(ModelWithEMA(model, make_model(1)), optimizer, scheduler, scaler, 20, async_saving=True)
    ckpt.finalize()
    assert (ckdir(job) / "latest_checkpoint.txt").read_text() == "iter_000000020.pt\n"
    marker = torch.load(ckdir(job) / "iter_000000020.pt", weights_only=True)
    assert marker["iteration"] == 20
    optim = torch.load(ckdir(job) / "iter_000000020_optim.pt", weights_only=True)
    assert {"optimizer", "scheduler"} <= set(optim)
    assert not [n for n in os.listdir(ckdir(job)) if ".tmp." in n]


def test_retention_keeps_newest_n_plus_pinned_iterations(tmp_path):
    job = tmp_path / "job"
    save_generations(job, [1, 2, 3, 4, 5], keep_last_checkpoints=2, save_at_iters=(2,))
    markers = [g.marker for g in list_generations(ckdir(job))]
    assert markers == ["iter_000000002.pt", "iter_000000004.pt", "iter_000000005.pt"]


def test_defect5_sibling_names_never_rewrite_directories_containing_dot_pt(tmp_path):
    job = tmp_path / "runs.pt" / "exp.pt_v2"
    saved = save_generations(job, [1, 2])
    assert sorted(os.listdir(job)) == ["checkpoints"]
    iteration, model = load_fresh(job)
    assert iteration == 2 and torch.equal(model.state_dict()["0.weight"], saved[2]["0.weight"])
    # load_path in such a directory (weights-only start)
    weights = tmp_path / "w.pt" / "release.pt"
    weights.parent.mkdir()
    torch.save(saved[1], weights)
    fresh = make_model(7)
    assert make_ckpt(tmp_path / "other", load_path=str(weights)).load(fresh) == 0
    assert torch.equal(fresh.state_dict()["2.bias"], saved[1]["2.bias"])


def test_a_pruning_failure_never_fails_the_save(tmp_path, caplog):
    job = tmp_path / "job"
    save_generations(job, [1])
    (ckdir(job) / "iter_000000001_optim.pt").unlink()
    (ckdir(job) / "iter_000000001_optim.pt").mkdir()  # unlink() of this name fails
    (ckdir(job) / "iter_000000001_optim.pt" / "keep").touch()
    save_generations(job, [2, 3], keep_last_checkpoints=1)
    assert "pruning old checkpoints" in caplog.text and "the save itself succeeded" in caplog.text
    assert (ckdir(job) / "latest_checkpoint.txt").read_text() == "iter_000000003.pt\n"
    assert load_fresh(job)[0] == 3


def test_load_path_problems_name_the_config_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CheckpointConfig\.load_path='/nonexistent/x\.pt'"):
        make_ckpt(tmp_path / "job", load_path="/nonexistent/x.pt").load(make_model())
    torch.save(make_model().state_dict(), tmp_path / "weights.pt")
    with pytest.raises(
        ValueError, match="load_training_state=True needs load_path to name a checkpoint marker"
    ):
        make_ckpt(tmp_path / "job", load_path=str(tmp_path / "weights.pt"), load_training_state=True).load(
            make_model()
        )


# ---------------------------------------------------------------- defect 1: complete resume


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_defect1_resume_restores_scheduler_grad_scaler_and_rng_streams(tmp_path, layout):
    job = tmp_path / "job"
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    model, optimizer, scheduler, scaler = make_training()
    ckpt = make_ckpt(job, keep_last_checkpoints=3, state_layout=layout)
    train(model, optimizer, scheduler, scaler, 3)
    ckpt.save(model, optimizer, scheduler, scaler, 3, async_saving=True)
    expected_scheduler, expected_scale = scheduler.state_dict(), scaler.get_scale()
    expected_losses = train(model, optimizer, scheduler, scaler, 4)
    ckpt.finalize()

    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    model2, optimizer2, scheduler2, scaler2 = make_training(seed=5)
    assert make_ckpt(job, keep_last_checkpoints=3).load(model2, optimizer2, scheduler2, scaler2) == 3
    assert scheduler2.state_dict() == expected_scheduler
    assert scheduler2.get_last_lr() == expected_scheduler["_last_lr"] != [0.05]
    assert scaler2.get_scale() == expected_scale != 4.0
    assert train(model2, optimizer2, scheduler2, scaler2, 4) == expected_losses
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_defect1_load_optim_scheduler_during_init_restores_the_scheduler(tmp_path):
    job = tmp_path / "job"
    model, optimizer, scheduler, scaler = make_training()
    train(model, optimizer, scheduler, scaler, 4)
    make_ckpt(job).save(model, optimizer, scheduler, scaler, 4, async_saving=False)
    model2, optimizer2, scheduler2, _ = make_training(seed=3)
    ckpt = make_ckpt(job)
    ckpt.load_model_during_init(model2)
    ckpt.load_optim_scheduler_during_init(model2, optimizer2, scheduler2)
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert torch.equal(model2[0].weight, model[0].weight)
    assert ckpt.load(model2, optimizer2, scheduler2) == 4


# ---------------------------------------------------------------- defects 2 and 8, ENOSPC


def test_defect2_async_failure_is_raised_by_the_next_save_and_by_finalize(tmp_path):
    job = tmp_path / "job"
    model = make_model()
    ckpt = make_ckpt(job, keep_last_checkpoints=5)
    ckpt.save(model, None, None, None, 1)
    ckpt.finalize()
    (ckdir(job) / "iter_000000002_reg_model.pt").mkdir()  # a real fault: the name is taken by a directory
    ckpt.save(model, None, None, None, 2)
    with pytest.raises(AsyncSaveError, match="iteration 2"):
        ckpt.save(model, None, None, None, 3)
    (ckdir(job) / "iter_000000004_reg_model.pt").mkdir()
    ckpt.save(model, None, None, None, 4)
    with pytest.raises(AsyncSaveError, match="iteration 4"):
        ckpt.finalize()
    assert (ckdir(job) / "latest_checkpoint.txt").read_text() == "iter_000000001.pt\n"
    ckpt.save(model, None, None, None, 5)
    ckpt.finalize()  # the checkpointer keeps working after a reported failure
    assert load_fresh(job)[0] == 5


def _fail_fsync_on_files(monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(checkpointing.atomic.os, "fsync", fsync)


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_disk_full_during_write_fails_clearly_and_keeps_the_previous_generation(tmp_path, monkeypatch, layout):
    job = tmp_path / "job"
    saved = save_generations(job, [1], state_layout=layout)
    model = make_model()
    ckpt = make_ckpt(job, keep_last_checkpoints=5, state_layout=layout)
    _fail_fsync_on_files(monkeypatch)
    with pytest.raises(CheckpointWriteError) as info:
        ckpt.save(model, None, None, None, 2, async_saving=False)
    assert info.value.errno == errno.ENOSPC and "disk is full" in str(info.value)
    ckpt.save(model, None, None, None, 3, async_saving=True)
    with pytest.raises(AsyncSaveError) as info:
        ckpt.finalize()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not [n for n in os.listdir(ckdir(job)) if ".tmp." in n]
    assert (ckdir(job) / "latest_checkpoint.txt").read_text() == "iter_000000001.pt\n"
    iteration, loaded = load_fresh(job)
    assert iteration == 1 and torch.equal(loaded.state_dict()["0.weight"], saved[1]["0.weight"])


def test_free_space_is_checked_before_writing_anything(tmp_path):
    job = tmp_path / "job"
    ckpt = make_ckpt(job, keep_last_checkpoints=2, disk_headroom=1e15)
    with pytest.raises(CheckpointWriteError, match="not enough free disk space") as info:
        ckpt.save(make_model(), None, None, None, 1, async_saving=True)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(ckdir(job)) == []


def test_defect8_files_are_closed_and_the_directory_is_fsynced_after_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        checkpointing.atomic.os,
        "fsync",
        lambda fd: events.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file") or real_fsync(fd),
    )
    monkeypatch.setattr(
        checkpointing.atomic.os, "replace", lambda a, b: events.append("rename") or real_replace(a, b)
    )
    open_before = len(os.listdir("/proc/self/fd"))
    record = atomic_torch_save({"w": torch.ones(3)}, tmp_path / "a.pt")
    atomic_write_text(tmp_path / "latest_checkpoint.txt", "a.pt\n")
    assert events == ["file", "rename", "dir", "file", "rename", "dir"]
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert record.size == (tmp_path / "a.pt").stat().st_size and len(record.sha256) == 64


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    directory = ckdir(tmp_path / "job")
    directory.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = directory / f"iter_000000001_reg_model.pt.tmp.{dead.pid}"
    live = directory / f"iter_000000001_optim.pt.tmp.{os.getppid()}"
    stale.write_bytes(b"partial"), live.write_bytes(b"being written")
    make_ckpt(tmp_path / "job")
    assert not stale.exists() and live.exists()


# ---------------------------------------------------------------- defect 3 (single process part)


def test_defect3_success_callback_gets_the_iteration(tmp_path):
    from checkpointing import CallBackGroup

    class Recorder:
        def __init__(self):
            self.events = []

        def on_save_checkpoint_success(self, iteration):
            self.events.append(iteration)

    recorder = Recorder()
    ckpt = FSDPCheckpointer(
        CheckpointConfig(keep_last_checkpoints=0),
        JobConfig(path_local=str(tmp_path)),
        CallBackGroup([recorder]),
    )
    ckpt.save(make_model(), None, None, None, 7, async_saving=True)
    ckpt.save(make_model(), None, None, None, 8, async_saving=True)
    ckpt.finalize()
    assert recorder.events == [7, 8]


# ---------------------------------------------------------------- defect 4: pointer


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("iter_\x00\x01\x02.pt\n", "garbled"),
        ("/etc/passwd\n", "absolute"),
        ("../../outside/iter_000000001.pt\n", "leaves the checkpoints directory"),
        ("sub/iter_000000001.pt\n", "leaves the checkpoints directory"),
        ("iter_1.pt\n", "not a checkpoint marker"),
        ("iter_000000001_reg_model.pt\n", "not a checkpoint marker"),
        ("model.safetensors\n", "not a checkpoint marker"),
    ],
)
def test_defect4_bad_pointer_content_is_rejected_with_a_clear_error(tmp_path, content, reason):
    job = tmp_path / "job"
    save_generations(job, [1])
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"iteration": 999}, outside / "iter_000000001.pt")
    (ckdir(job) / "latest_checkpoint.txt").write_text(content)
    with pytest.raises(CheckpointPointerError, match=reason) as info:
        load_fresh(job)
    assert "latest_checkpoint.txt" in str(info.value)


# ---------------------------------------------------------------- defect 6: unsafe pickles


class Payload:
    """Pickles to os.system: loading it with weights_only=False would run a shell command."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


class LegacyMeta:
    """A harmless custom class, as old trusted checkpoints pickled."""

    def __init__(self, note: str):
        self.note = note


def test_defect6_malicious_pickle_is_refused_naming_the_global_and_never_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    job = tmp_path / "job"
    save_generations(job, [1])
    torch.save({"iteration": 1, "x": Payload(sentinel)}, ckdir(job) / "iter_000000001.pt")
    weights = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": Payload(sentinel)}, weights)
    with pytest.raises(UnsafeCheckpointError, match="system") as info:
        make_ckpt(job, verify="none").load(make_model())
    assert "trust_legacy_pickle" in str(info.value)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        read_weights(weights)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        FSDPInferenceCheckpointer(weights).load_model_during_init(make_model())
    assert not sentinel.exists()


def test_defect6_trusted_legacy_files_load_only_with_the_explicit_opt_in(tmp_path):
    job = tmp_path / "job"
    save_generations(job, [1])
    torch.save({"iteration": 1, "meta": LegacyMeta("old")}, ckdir(job) / "iter_000000001.pt")
    with pytest.raises(UnsafeCheckpointError, match="LegacyMeta"):
        make_ckpt(job, verify="none").load(make_model())
    assert make_ckpt(job, verify="none", trust_legacy_pickle=True).load(make_model()) == 1


# ---------------------------------------------------------------- defect 7: torn / corrupt generations


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("layout", "damaged"),
    [
        ("full", "iter_000000003_reg_model.pt"),
        ("sharded", "iter_000000003_reg_model_rank0.distcp"),
        ("sharded", "iter_000000003_reg_model.metadata"),
        ("sharded", "iter_000000003_optim_rank0.distcp"),
    ],
)
@pytest.mark.parametrize(
    ("damage", "verify"),
    [
        (_truncate, "size"),
        (lambda p: p.unlink(), "size"),
        (_flip_bit, "sha256"),
    ],
    ids=["truncated", "missing-sibling", "bit-flip"],
)
def test_defect7_broken_latest_generation_falls_back_to_the_newest_valid_one(
    tmp_path, caplog, damage, verify, layout, damaged
):
    job = tmp_path / "job"
    saved = save_generations(job, [1, 2, 3], state_layout=layout)
    damage(ckdir(job) / damaged)
    iteration, model = load_fresh(job, verify=verify)
    assert iteration == 2
    assert torch.equal(model.state_dict()["0.weight"], saved[2]["0.weight"])
    assert "falling back to iter_000000002.pt" in caplog.text
    # retention never deletes that fallback, even when asked to keep a single generation
    kept = {g.marker for g in list_generations(ckdir(job))} - {g.marker for g in prune_plan(ckdir(job), 1)}
    assert {"iter_000000002.pt", "iter_000000003.pt"} <= kept


def test_defect7_no_valid_generation_left_is_a_clear_error(tmp_path):
    job = tmp_path / "job"
    save_generations(job, [1, 2])
    _truncate(ckdir(job) / "iter_000000001_reg_model.pt")
    _truncate(ckdir(job) / "iter_000000002.pt")
    with pytest.raises(NoValidCheckpointError, match=r"iter_000000001\.pt: .*truncated"):
        load_fresh(job)


def test_a_generation_whose_save_never_committed_is_not_taken_for_a_seed_folder(tmp_path, caplog):
    """Our marker without its manifest (a peer rank failed before the commit) never counts."""
    job = tmp_path / "job"
    saved = save_generations(job, [1, 2, 3])
    (ckdir(job) / "iter_000000002_manifest.json").unlink()
    _truncate(ckdir(job) / "iter_000000003_reg_model.pt")
    iteration, model = load_fresh(job)
    assert iteration == 1
    assert torch.equal(model.state_dict()["0.weight"], saved[1]["0.weight"])
    assert "falling back to iter_000000001.pt" in caplog.text
    uncommitted = next(g for g in list_generations(ckdir(job)) if g.iteration == 2)
    for verify in ("none", "size", "sha256"):
        assert "never committed" in " ".join(generation_problems(ckdir(job), uncommitted, verify))


def _torn_ckpt_overwrite(job: Path, monkeypatch, layout: str, iteration: int) -> nn.Module:
    """Save `iteration` over ckpt_.pt and crash after its weights, before its optimizer: ckpt_ is torn."""
    real_replace, calls = os.replace, []

    def crash_at_the_optimizer(a, b):
        calls.append(Path(b).name)
        if Path(b).name.startswith("ckpt__optim"):
            raise KeyboardInterrupt("simulated crash between two renames")
        real_replace(a, b)

    monkeypatch.setattr(checkpointing.atomic.os, "replace", crash_at_the_optimizer)
    model = make_model()
    with torch.no_grad():
        model[0].weight.fill_(float(iteration))
    ckpt = make_ckpt(job, keep_last_checkpoints=0, state_layout=layout)
    with pytest.raises((KeyboardInterrupt, CheckpointError)):  # DCP reports the interrupt as its failure
        ckpt.save(model, None, None, None, iteration, async_saving=False)
    monkeypatch.undo()
    assert any(name.startswith("ckpt__reg_model") for name in calls), calls  # new weights are in place
    return model


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_interrupted_overwrite_of_ckpt_falls_back_to_its_hard_linked_backup(tmp_path, monkeypatch, layout):
    """The sharded backup reads its own (linked) shards although its metadata names ckpt_'s files."""
    job = tmp_path / "job"
    saved = save_generations(job, [1], keep_last_checkpoints=0, state_layout=layout)
    model = _torn_ckpt_overwrite(job, monkeypatch, layout, 2)
    # ckpt_.pt is now half old, half new; its manifest says so, and the backup is whole
    iteration, loaded = load_fresh(job)
    assert iteration == 1 and torch.equal(loaded.state_dict()["0.weight"], saved[1]["0.weight"])
    # the next successful save commits ckpt_.pt again and drops the backup
    make_ckpt(job, keep_last_checkpoints=0, state_layout=layout).save(model, None, None, None, 3, async_saving=False)
    assert [g.marker for g in list_generations(ckdir(job))] == ["ckpt_.pt"]
    assert load_fresh(job)[0] == 3


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_the_leftover_of_a_killed_numbered_save_does_not_block_the_ckpt_backup(tmp_path, monkeypatch, layout):
    """Found by the 200-trial crash loop: files of iter_000000002 from a save killed before its commit made
    the backup of ckpt_.pt (then at iteration 2) be skipped, so a torn overwrite fell back past iteration 2."""
    job = tmp_path / "job"
    save_generations(job, [1, 2], keep_last_checkpoints=2, state_layout=layout)
    (ckdir(job) / "iter_000000002_manifest.json").unlink()  # killed between its marker and its manifest
    (ckdir(job) / "latest_checkpoint.txt").write_text("iter_000000001.pt\n")
    saved = save_generations(job, [2], keep_last_checkpoints=0, state_layout=layout)  # ckpt_.pt, published
    _torn_ckpt_overwrite(job, monkeypatch, layout, 3)
    iteration, loaded = load_fresh(job)
    assert iteration == 2 and torch.equal(loaded.state_dict()["0.weight"], saved[2]["0.weight"])


# ---------------------------------------------------------------- seed compatibility


def test_folder_written_by_the_seed_resumes(tmp_path):
    """The seed wrote plain torch.save files, an integer-keyed optimizer state and the pointer."""
    directory = ckdir(tmp_path / "job")
    directory.mkdir(parents=True)
    model, optimizer, scheduler, scaler = make_training()
    train(model, optimizer, scheduler, scaler, 2)
    torch.save(model.state_dict(), directory / "iter_000000002_reg_model.pt")
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        directory / "iter_000000002_optim.pt",
    )
    torch.save({"iteration": 2}, directory / "iter_000000002.pt")
    (directory / "latest_checkpoint.txt").write_text("iter_000000002.pt\n")
    model2, optimizer2, scheduler2, _ = make_training(seed=4)
    assert make_ckpt(tmp_path / "job").load(model2, optimizer2, scheduler2) == 2
    assert torch.equal(model2[2].weight, model[2].weight)
    assert scheduler2.state_dict() == scheduler.state_dict()
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], exp_avg)


def test_folder_written_by_this_package_loads_with_the_seed_loading_logic(tmp_path):
    job = tmp_path / "job"
    model, optimizer, scheduler, scaler = make_training()
    train(model, optimizer, scheduler, scaler, 2)
    make_ckpt(job, keep_last_checkpoints=1).save(model, optimizer, scheduler, scaler, 2, async_saving=False)
    # the seed: read the pointer, derive siblings with str.replace, torch.load, load_state_dict(strict)
    checkpoint_path = os.path.join(ckdir(job), (ckdir(job) / "latest_checkpoint.txt").read_text().strip())
    fresh = make_model(9)
    fresh.load_state_dict(
        torch.load(checkpoint_path.replace(".pt", "_reg_model.pt"), weights_only=False), strict=True
    )
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert torch.load(checkpoint_path, weights_only=False)["iteration"] == 2
    optim = torch.load(checkpoint_path.replace(".pt", "_optim.pt"), weights_only=False)
    assert optim["scheduler"] == scheduler.state_dict() and "state" in optim["optimizer"]


# ---------------------------------------------------------------- inference / weights helpers


def test_inference_checkpointer_reads_safetensors_with_wrapper_prefixes(tmp_path):
    source = make_model(3)
    prefixed = {f"module._orig_mod.{k}": v.contiguous() for k, v in source.state_dict().items()}
    save_file(prefixed, tmp_path / "model.safetensors")
    target = make_model(4)
    loader = FSDPInferenceCheckpointer(tmp_path / "model.safetensors")
    loader.load_model_during_init(target)
    assert torch.equal(target[0].weight, source[0].weight)
    assert loader.load(target) == 0 and loader.save(target) is None
    assert loader.load_optim_scheduler_during_init(target, None, None) is None


def test_strict_loading_lists_missing_unexpected_and_shape_mismatches(tmp_path):
    state = dict(make_model().state_dict())
    state.pop("2.bias")
    state["0.weight"] = torch.zeros(3, 4)
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(StateDictMismatchError) as info:
        FSDPInferenceCheckpointer(tmp_path / "w.pt").load_model_during_init(make_model())
    message = str(info.value)
    assert "missing keys (1): 2.bias" in message
    assert "unexpected keys (1): extra.weight" in message
    assert "0.weight: file (3, 4) vs model (8, 4)" in message
    target = make_model(5)
    FSDPInferenceCheckpointer(tmp_path / "w.pt", strict_resume=False).load_model_during_init(target)
    assert torch.equal(target[0].bias, state["0.bias"]) and not torch.equal(
        target[0].weight[:3], state["0.weight"]
    )


def test_job_directory_resolves_to_newest_valid_generation_and_prefers_ema(tmp_path, caplog):
    job = tmp_path / "job"
    model = make_model()
    ema = make_model(2)
    ckpt = make_ckpt(job, keep_last_checkpoints=3)
    ckpt.save(ModelWithEMA(model, ema), None, None, None, 1, async_saving=False)
    ckpt.save(model, None, None, None, 2, async_saving=False)  # no EMA in this one
    _truncate(ckdir(job) / "iter_000000002_reg_model.pt")
    resolved = resolve_weights(job)
    assert resolved.kind == "ema" and resolved.iteration == 1
    assert resolved.path.name == "iter_000000001_ema_model.pt"
    assert any("falling back" in n for n in resolved.notices)
    target = make_model(8)
    FSDPInferenceCheckpointer(ckdir(job)).load_model_during_init(target, is_ema=True)
    assert torch.equal(target[0].weight, ema[0].weight)
    assert resolve_generation(job).generation.marker == "iter_000000001.pt"
    reg = resolve_weights(job, prefer_ema=False)
    assert reg.kind == "reg" and torch.equal(read_weights(reg.path)["0.weight"], model[0].weight)


def test_read_weights_rejects_files_that_are_not_weights(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(Exception, match="expected model weights"):
        read_weights(tmp_path / "list.pt")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"expected a weights file ending in \.safetensors or \.pt"):
        read_weights(tmp_path / "w.npz")


# ---------------------------------------------------------------- command line


def test_cli_inspect_verify_and_prune(tmp_path, capsys):
    job = tmp_path / "job"
    save_generations(job, [1, 2, 3])
    assert cli(["inspect", str(job), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [g["iteration"] for g in report["generations"]] == [1, 2, 3]
    assert [g["latest"] for g in report["generations"]] == [False, False, True]
    assert all(g["valid"] and g["files"] for g in report["generations"])
    assert cli(["verify", str(job)]) == 0
    _flip_bit(ckdir(job) / "iter_000000003_reg_model.pt")
    assert cli(["verify", str(job)]) == 1
    assert "sha256" in capsys.readouterr().out
    assert cli(["inspect", str(job), "--verify", "sha256"]) == 0
    assert "INVALID" in capsys.readouterr().out
    assert cli(["prune", str(job), "--keep", "1"]) == 0
    assert "would delete iter_000000001.pt" in capsys.readouterr().out
    assert len(list_generations(ckdir(job))) == 3
    assert cli(["prune", str(job), "--keep", "1", "--yes"]) == 0
    # keeps the pointer's generation (corrupt) and the newest valid one, the resume fallback
    assert [g.iteration for g in list_generations(ckdir(job))] == [2, 3]


def test_cli_runs_as_a_module_and_fails_on_a_bad_pointer(tmp_path):
    job = tmp_path / "job"
    save_generations(job, [1])
    (ckdir(job) / "latest_checkpoint.txt").write_text("../x.pt\n")
    result = subprocess.run(
        [sys.executable, "-m", "checkpointing", "verify", str(job)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 1 and "leaves the checkpoints directory" in result.stdout


def test_loading_weights_into_a_plain_module_never_imports_distributed_checkpoint(tmp_path) -> None:
    """Inference start-up must not pay for torch.distributed.checkpoint (it imports torch._dynamo)."""
    import subprocess
    import sys

    weights = str(tmp_path / "w.safetensors")
    code = f"""
import sys, torch
from safetensors.torch import save_file
from checkpointing import FSDPInferenceCheckpointer
saved = {{"weight": torch.full((2, 3), 7.0), "bias": torch.full((2,), -1.0)}}
save_file(saved, {weights!r})
model = torch.nn.Linear(3, 2)
FSDPInferenceCheckpointer({weights!r}).load_model_during_init(model)
assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items()), "weights not loaded"
print("dcp" if "torch.distributed.checkpoint" in sys.modules else "plain")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["plain"]


# ---------------------------------------------------------------- nothing in a checkpoints folder is trusted unchecked


def _rewrite_manifest(job: Path, marker_stem: str, edit) -> None:
    path = ckdir(job) / f"{marker_stem}_manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _problems(job: Path, iteration: int, verify: str = "sha256") -> str:
    (generation,) = [g for g in list_generations(ckdir(job)) if g.iteration == iteration]
    return "; ".join(generation_problems(ckdir(job), generation, verify))


def test_a_manifest_listing_no_files_beside_a_garbage_weights_file_is_invalid(tmp_path, capsys):
    job = tmp_path / "job"
    save_generations(job, [1])
    (ckdir(job) / "iter_000000001_ema_model.pt").write_bytes(b"garbage")
    _rewrite_manifest(job, "iter_000000001", lambda m: m.update(files={}))
    assert cli(["verify", str(job)]) == 1
    out = capsys.readouterr().out
    assert "iter_000000001_reg_model.pt is required but the manifest does not list it" in out
    assert "iter_000000001_ema_model.pt is on disk but the manifest does not list it" in out
    assert prune_plan(ckdir(job), 1) == []  # the pointer's generation is kept, never counted as valid


@pytest.mark.parametrize(
    ("listed", "reason"),
    [
        ("/etc/hostname", "absolute path"),
        ("../secret", "leaves the checkpoints folder"),
        ("sub/iter_000000001_reg_model.pt", "leaves the checkpoints folder"),
        ("iter_000000002_reg_model.pt", "another generation's name"),
    ],
)
def test_a_manifest_naming_files_outside_its_generation_is_invalid_and_they_are_never_examined(
    tmp_path, capsys, listed, reason
):
    job = tmp_path / "job"
    save_generations(job, [1])
    (job / "secret").write_bytes(b"s" * 12345)

    def add_outside(manifest: dict) -> None:
        manifest["files"][listed] = {"size": 1, "sha256": "0" * 64}

    _rewrite_manifest(job, "iter_000000001", add_outside)
    assert reason in _problems(job, 1)
    assert cli(["verify", str(job)]) == 1
    out = capsys.readouterr().out
    assert f"{listed!r}, which is not a file of iter_000000001.pt" in out
    assert "bytes" not in out and "12345" not in out  # no size of a file outside is ever reported


def test_a_weights_file_linked_out_of_the_folder_is_invalid_even_with_matching_size_and_hash(tmp_path):
    job = tmp_path / "job"
    save_generations(job, [1, 2])
    weights = ckdir(job) / "iter_000000002_reg_model.pt"
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(weights.read_bytes())
    weights.unlink()
    weights.symlink_to(outside)
    assert "symbolic link that leads out of the checkpoints folder" in _problems(job, 2)
    assert load_fresh(job)[0] == 1
    # a link to a sibling inside the folder is no escape, and is accepted
    inside = ckdir(job) / "copy.bin"
    inside.write_bytes(outside.read_bytes())
    weights.unlink()
    weights.symlink_to(inside)
    assert _problems(job, 2) == ""


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '{"iteration": 1}',
        '{"iteration": 1, "complete": true, "files": []}',
        '{"iteration": 1, "complete": true, "files": {"iter_000000001.pt": {"size": "9", "sha256": "x"}}}',
        '{"iteration": true, "complete": true}',
        '{"iteration": 1, "complete": true, "evil": 1}',
        "[" * 200_000,
        "{" + " " * (9 << 20) + "}",
    ],
    ids=["list", "no-complete", "files-list", "bad-entry", "bool-iteration", "unknown-key", "nesting-bomb", "huge"],
)
def test_a_malformed_manifest_is_invalid_and_prune_refuses_with_one_error_line(tmp_path, content):
    job = tmp_path / "job"
    save_generations(job, [1, 2])
    (ckdir(job) / "iter_000000001_manifest.json").write_text(content)
    assert "manifest" in _problems(job, 1)
    assert load_fresh(job)[0] == 2
    result = subprocess.run(
        [sys.executable, "-m", "checkpointing", "prune", str(job), "--keep", "1", "--yes"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "nothing was pruned" in result.stderr
    assert len(list_generations(ckdir(job))) == 2


def _special_pointer(job: Path, kind: str) -> None:
    pointer = ckdir(job) / "latest_checkpoint.txt"
    pointer.unlink()
    if kind == "dev-zero":
        pointer.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(pointer)
    else:
        pointer.write_text("iter_000000001.pt\n" + " " * (1 << 20))


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "oversized"])
def test_pointers_are_read_only_from_small_regular_files(tmp_path, kind):
    """A pointer linked to /dev/zero filled memory, a FIFO pointer hung every reader."""
    job = tmp_path / "job"
    save_generations(job, [1])
    _special_pointer(job, kind)
    code = f"""
import sys
from checkpointing import CheckpointPointerError, resolve_generation
from inference.loader import ModelSourceError, load_model
try:
    resolve_generation({str(job)!r})
except CheckpointPointerError as e:
    print("checkpointing:", e)
try:
    load_model({str(job)!r})
except ModelSourceError as e:
    print("loader:", e)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = "more than the 4096 allowed" if kind == "oversized" else "latest_checkpoint.txt"
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["checkpointing", "loader"]
    assert all(expected in line for line in lines), lines
    for command in (["prune", str(job), "--keep", "1"], ["verify", str(job)]):
        result = subprocess.run(
            [sys.executable, "-m", "checkpointing", *command], capture_output=True, text=True, cwd=REPO, timeout=120
        )
        assert "Traceback" not in result.stderr
        assert result.returncode == (2 if command[0] == "prune" else 1)


def test_saving_an_iteration_again_leaves_exactly_the_new_files(tmp_path):
    """The manifest lists exactly a generation's files, so a repeated save removes what it no longer writes."""
    job = tmp_path / "job"
    for keep in (1, 0):
        ckpt = make_ckpt(job / str(keep), keep_last_checkpoints=keep)
        ckpt.save(ModelWithEMA(make_model(), make_model(1)), None, None, None, 3, async_saving=False)
        again = 3 if keep else 4  # iter_000000003 twice, or ckpt_ overwritten
        ckpt.save(make_model(2), None, None, None, again, async_saving=False)  # no EMA this time
        assert not [n for n in os.listdir(ckdir(job / str(keep))) if "ema_model" in n]
        assert _problems(job / str(keep), again) == ""
        assert load_fresh(job / str(keep))[0] == again


# ---------------------------------------------------------------- the sharded layout in one process
# (multi-rank saves, resharding, crash loops: test_checkpointing_sharded.py)


def _replace_metadata(job: Path, data: bytes) -> None:
    """Swap in other metadata and record it in the manifest, as an attacker who controls the folder would."""
    path = ckdir(job) / "iter_000000001_reg_model.metadata"
    path.write_bytes(data)
    record = {"size": len(data), "sha256": checkpointing.atomic.sha256_file(path)}
    _rewrite_manifest(job, "iter_000000001", lambda m: m["files"].update({path.name: record}))


@pytest.mark.parametrize("attack", ["code", "non-tensor-entry", "shard-outside"])
def test_sharded_metadata_is_unpickled_through_an_allow_list_and_checked(tmp_path, attack):
    """DCP reads `.metadata` with pickle.load and non-tensor entries with a code-running torch.load."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    job, sentinel = tmp_path / "job", tmp_path / "pwned"
    save_generations(job, [1], state_layout="sharded")
    metadata = pickle.loads((ckdir(job) / "iter_000000001_reg_model.metadata").read_bytes())
    if attack == "code":
        data = pickle.dumps({"metadata": metadata, "x": Payload(sentinel)})
    elif attack == "non-tensor-entry":
        metadata.state_dict_metadata["0.weight"] = BytesStorageMetadata()
        data = pickle.dumps(metadata)
    else:
        metadata.storage_data = {
            k: dataclasses.replace(v, relative_path="../secret") for k, v in metadata.storage_data.items()
        }
        data = pickle.dumps(metadata)
    _replace_metadata(job, data)
    assert _problems(job, 1) == ""  # the manifest vouches for the bytes; their content is what is refused
    expected = {"code": "could run code", "non-tensor-entry": "BytesStorageMetadata", "shard-outside": "not a shard"}
    with pytest.raises(CheckpointError, match=expected[attack]):
        FSDPInferenceCheckpointer(ckdir(job) / "iter_000000001.pt").load_model_during_init(make_model())
    with pytest.raises(CheckpointError, match=expected[attack]):
        make_ckpt(job).load(make_model())
    assert not sentinel.exists()


def test_a_sharded_async_save_returns_before_writing_and_writes_what_it_staged(tmp_path, monkeypatch):
    """save() blocks only while this rank's shards are copied: the write waits until save() has returned
    and the live weights have moved on, and the generation holds the weights of the save."""
    from checkpointing import sharded

    returned = threading.Event()
    write = sharded.save_parts

    def write_after_save_returned(*args, **kwargs):
        assert returned.wait(timeout=20), "save() waited for the shards to be written"
        return write(*args, **kwargs)

    monkeypatch.setattr(sharded, "save_parts", write_after_save_returned)
    job = tmp_path / "job"
    model, optimizer, scheduler, scaler = make_training()
    train(model, optimizer, scheduler, scaler, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = make_ckpt(job, keep_last_checkpoints=2, state_layout="sharded")
    ckpt.save(model, optimizer, scheduler, scaler, 2, async_saving=True)
    assert not (ckdir(job) / "iter_000000002.pt").exists()
    train(model, optimizer, scheduler, scaler, 3)  # training goes on and changes every weight
    returned.set()
    ckpt.finalize()
    iteration, loaded = load_fresh(job)
    assert iteration == 2
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


def test_the_seed_model_protocol_is_refused_by_the_sharded_layout(tmp_path):
    class SeedModel:
        def __init__(self):
            self.model = make_model()

        def state_dict_model(self):
            return {"model": self.model.state_dict(), "ema": None}

        def get_ckpt_postfix(self):
            return "", 0, 0, 1

    with pytest.raises(ValueError, match="state_layout='full'"):
        make_ckpt(tmp_path / "job", state_layout="sharded").save(SeedModel(), None, None, None, 1, False)

"""Checkpointing with real processes: 2 gloo ranks training FSDP2, SIGKILL, resume on 1/2/3 ranks,
EMA replicas and async failures across ranks, a peer killed before the commit, and a crash loop killed at random moments.

Ranks are forked from one server process (`checkpointing.crashtest`, serving tests/ckpt_worker.py's
scenarios; the `ranks` fixture in conftest.py) so torch is imported once, not once per rank: on two busy
cores an import costs several seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointing import FSDPInferenceCheckpointer, resolve_generation, resolve_weights
from checkpointing.crashtest import crash_trials
from checkpointing.generations import generation_problems, list_generations
from tests.helpers import assert_crash_trials, assert_same_tree, rank_outputs

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def killed_fsdp2_job(ranks, tmp_path_factory):
    """2 FSDP2 ranks train 8 steps, save asynchronously at step 4, finish, and are SIGKILLed."""
    root = tmp_path_factory.mktemp("fsdp2")
    out = root / "train"
    out.mkdir()
    reply = ranks.run(
        ["train", "--job", str(root / "job"), "--out", str(out), "--save-at", "4"], world_size=2
    )
    assert reply["codes"] == [-9, -9]
    return root, rank_outputs(out, 2)


def _resume(ranks, root: Path, world_size: int) -> list[dict]:
    out = root / f"resume{world_size}"
    out.mkdir()
    reply = ranks.run(["resume", "--job", str(root / "job"), "--out", str(out)], world_size=world_size)
    assert reply["codes"] == [0] * world_size
    return rank_outputs(out, world_size)


def test_fsdp2_resume_on_two_ranks_is_bit_exact(ranks, killed_fsdp2_job):
    root, trained = killed_fsdp2_job
    resumed = _resume(ranks, root, 2)
    for rank in range(2):
        assert resumed[rank]["start"] == 4
        # restored state: parameters, optimizer moments, scheduler (LR included) and this rank's RNG streams
        assert_same_tree(
            resumed[rank]["at_load"]["scheduler"], trained[rank]["at_save"][4]["scheduler"], "scheduler"
        )
        assert_same_tree(resumed[rank]["at_load"]["rng"], trained[rank]["at_save"][4]["rng"], "rng")
        # next-step loss and every later loss equal the uninterrupted run's
        assert resumed[rank]["losses"] == {s: trained[rank]["losses"][s] for s in range(5, 9)}
    for part in ("model", "ema", "optim"):
        assert_same_tree(resumed[0]["at_load"][part], trained[0]["at_save"][4][part], part)
    assert_same_tree(resumed[0]["final"], trained[0]["final"], "final")
    assert resumed[0]["final"]["model"]["0.weight"].abs().sum() > 0


@pytest.mark.parametrize("world_size", [1, 3])
def test_fsdp2_resume_on_other_world_sizes_restores_full_state(ranks, killed_fsdp2_job, world_size):
    root, trained = killed_fsdp2_job
    resumed = _resume(ranks, root, world_size)
    assert all(r["start"] == 4 for r in resumed)
    for part in ("model", "ema", "optim"):
        assert_same_tree(resumed[0]["at_load"][part], trained[0]["at_save"][4][part], part)
    for rank in range(world_size):
        assert_same_tree(
            resumed[rank]["at_load"]["scheduler"], trained[0]["at_save"][4]["scheduler"], "scheduler"
        )
    # ranks that existed at save time get their own RNG streams back
    for rank in range(min(world_size, 2)):
        assert_same_tree(resumed[rank]["at_load"]["rng"], trained[rank]["at_save"][4]["rng"], "rng")
    # training goes on from the restored state
    assert set(resumed[0]["losses"]) == {5, 6, 7, 8}
    assert all(torch.isfinite(torch.tensor(list(resumed[0]["losses"].values()))))


def test_ema_replicas_and_async_failures_across_ranks(ranks, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    reply = ranks.run(["replica", "--job", str(tmp_path / "job"), "--out", str(out)], world_size=2)
    assert reply["codes"] == [0, 0]
    results = rank_outputs(out, 2)
    for rank, result in enumerate(results):
        # defect 3: the replica rank reports success for iteration 1 instead of logging a false failure
        assert result["successes_after_1"] == [1]
        assert "iter_000000001_RANK1_ema_model.pt" in result["files_after_1"]
        # defect 2: a failure on rank 1 is raised at the next save() on every rank, and by finalize()
        assert result["next_save_error"] is not None and "iteration 2" in result["next_save_error"]
        assert "rank 1" in result["next_save_error"]
        assert result["finalize_error"] is not None and "iteration 4" in result["finalize_error"]
        # the pointer never moved to the generation whose replica file is missing
        assert result["pointer_after_failure"] == "iter_000000001.pt\n"
        # each rank's EMA replica comes back from its own _RANK file (rank 0 from _ema_model.pt)
        assert torch.equal(result["loaded_ema_weight"], torch.full((4, 4), float(rank + 1)))
        assert result["successes"] == [1]  # the saves that raised never ran
    manifest = list_generations(tmp_path / "job" / "checkpoints")[0].manifest
    assert "iter_000000001_RANK1_ema_model.pt" in manifest.files


def test_a_peer_killed_before_the_commit_leaves_no_marker_and_no_valid_generation(ranks, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    reply = ranks.run(["peerdies", "--job", str(tmp_path / "job"), "--out", str(out)], world_size=2)
    assert reply["codes"] == [0, -9]
    result = torch.load(out / "rank0.pt", weights_only=False)
    assert result["save_error"] is not None
    # rank 1's replica reached the disk and rank 0 wrote its own files, but the marker never appeared
    assert {"iter_000000002_RANK1_ema_model.pt", "iter_000000002_reg_model.pt"} <= set(result["files"])
    assert "iter_000000002.pt" not in result["files"]
    directory = tmp_path / "job" / "checkpoints"
    (uncommitted,) = [g for g in list_generations(directory) if g.iteration == 2]
    assert generation_problems(directory, uncommitted, "none")
    assert resolve_generation(tmp_path / "job").generation.iteration == 1


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_ddp_goes_through_the_same_api(ranks, tmp_path, layout):
    out = tmp_path / "out"
    out.mkdir()
    argv = ["ddp", "--job", str(tmp_path / "job"), "--out", str(out), "--layout", layout]
    assert ranks.run(argv, world_size=2)["codes"] == [0, 0]
    for result in rank_outputs(out, 2):
        assert result["start"] == 3
        assert_same_tree(result["loaded"], result["saved"], "ddp")
    resolved = resolve_weights(tmp_path / "job", prefer_ema=False)
    weights = FSDPInferenceCheckpointer(resolved.path)  # one plain process, either layout
    plain = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    weights.load_model_during_init(plain)  # strict: the names are bare (no `module.`)
    assert_same_tree(plain.state_dict(), rank_outputs(out, 2)[0]["saved"]["model"], "plain")


def test_sigkill_at_random_moments_always_resumes_a_whole_generation(ranks, tmp_path):
    assert_crash_trials(crash_trials(ranks, tmp_path, trials=20, seed=0), trials=20)


@pytest.mark.slow
def test_sigkill_crash_loop_many_trials(ranks, tmp_path):
    assert_crash_trials(crash_trials(ranks, tmp_path, trials=200, seed=1), trials=200)

"""The sharded layout with real processes: 4 and 2 FSDP2 gloo ranks each write their own shards,
the generation resumes exactly on 2, 4 and 1 ranks, a truncated shard falls back to the older generation, a
plain process with no process group loads the weights without opening an optimizer shard, a failure on one
rank reaches every rank, and SIGKILLs at random moments never leave a torn generation trusted.

Ranks are forked from the `ranks` fixture's server (tests/ckpt_worker.py's scenarios), as in
test_checkpointing_dist.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpointing import FSDPInferenceCheckpointer, resolve_generation
from checkpointing.__main__ import main as cli
from checkpointing.crashtest import crash_trials
from checkpointing.generations import list_generations
from tests.helpers import assert_crash_trials, assert_same_tree, rank_outputs

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SAVES = (4, 6)


def _train(ranks, root: Path, world_size: int) -> list[dict]:
    """Train on `world_size` ranks, saving sharded generations at SAVES asynchronously; the ranks are SIGKILLed."""
    out = root / "train"
    out.mkdir(parents=True)
    argv = ["train", "--job", str(root / "job"), "--out", str(out), "--layout", "sharded"]
    reply = ranks.run([*argv, "--save-at", ",".join(map(str, SAVES))], world_size=world_size)
    assert reply["codes"] == [-9] * world_size
    return rank_outputs(out, world_size)


def _resume(ranks, job: Path, out: Path, world_size: int) -> list[dict]:
    out.mkdir(parents=True)
    reply = ranks.run(["resume", "--job", str(job), "--out", str(out)], world_size=world_size)
    assert reply["codes"] == [0] * world_size
    return rank_outputs(out, world_size)


@pytest.fixture(scope="module")
def four_rank_job(ranks, tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("sharded4")
    return root / "job", _train(ranks, root, 4)


def _assert_restored(resumed: list[dict], trained: list[dict], step: int) -> None:
    """Parameters, EMA and optimizer moments exact; the scheduler on every rank; each saved rank's RNG."""
    assert all(r["start"] == step for r in resumed)
    for part in ("model", "ema", "optim"):
        assert_same_tree(resumed[0]["at_load"][part], trained[0]["at_save"][step][part], part)
    for rank, result in enumerate(resumed):
        assert_same_tree(result["at_load"]["scheduler"], trained[0]["at_save"][step]["scheduler"], "scheduler")
        if rank < len(trained):
            assert_same_tree(result["at_load"]["rng"], trained[rank]["at_save"][step]["rng"], "rng")


def test_every_rank_writes_its_own_shards_into_one_committed_generation(four_rank_job, capsys):
    job, _ = four_rank_job
    directory = job / "checkpoints"
    generation = list_generations(directory)[-1]
    manifest = generation.manifest
    assert manifest.state_layout == "sharded" and manifest.world_size == 4 and manifest.iteration == SAVES[-1]
    for kind in ("reg_model", "ema_model", "optim"):
        assert f"iter_000000006_{kind}.metadata" in manifest.files
        for rank in range(4):
            entry = manifest.files[f"iter_000000006_{kind}_rank{rank}.distcp"]
            assert entry["size"] == (directory / f"iter_000000006_{kind}_rank{rank}.distcp").stat().st_size > 0
    assert not [name for name in generation.files if name.endswith("_reg_model.pt")]  # nothing gathered
    assert cli(["verify", str(job)]) == 0
    assert cli(["inspect", str(job), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert [g["layout"] for g in report["generations"]] == ["sharded", "sharded"]


def test_a_four_rank_generation_resumes_exactly_on_two_ranks(ranks, four_rank_job, tmp_path):
    job, trained = four_rank_job
    _assert_restored(_resume(ranks, job, tmp_path / "out", 2), trained, SAVES[-1])


def test_a_four_rank_generation_resumes_on_four_ranks_bit_exact(ranks, four_rank_job, tmp_path):
    """Same world size: the rest of the run, every loss included, equals the uninterrupted run."""
    job, trained = four_rank_job
    resumed = _resume(ranks, job, tmp_path / "out", 4)
    _assert_restored(resumed, trained, SAVES[-1])
    for rank in range(4):
        assert resumed[rank]["losses"] == {s: trained[rank]["losses"][s] for s in range(SAVES[-1] + 1, 9)}
    assert_same_tree(resumed[0]["final"], trained[0]["final"], "final")


def test_a_four_rank_generation_resumes_on_one_rank(ranks, four_rank_job, tmp_path):
    job, trained = four_rank_job
    resumed = _resume(ranks, job, tmp_path / "out", 1)
    _assert_restored(resumed, trained, SAVES[-1])
    assert all(torch.isfinite(torch.tensor(list(resumed[0]["losses"].values()))))


def test_a_two_rank_generation_resumes_exactly_on_four_ranks(ranks, tmp_path):
    trained = _train(ranks, tmp_path, 2)
    _assert_restored(_resume(ranks, tmp_path / "job", tmp_path / "out", 4), trained, SAVES[-1])


def test_a_truncated_shard_falls_back_to_the_older_generation(ranks, four_rank_job, tmp_path):
    job, trained = four_rank_job
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    shard = copy / "checkpoints" / "iter_000000006_optim_rank2.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert resolve_generation(copy).generation.iteration == SAVES[0]
    _assert_restored(_resume(ranks, copy, tmp_path / "out", 2), trained, SAVES[0])


def _plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 3))


def test_a_plain_process_loads_the_weights_without_reading_optimizer_shards(four_rank_job):
    """No process group, no FSDP: the EMA (and the regular weights) equal what the 4 ranks saved, and the
    files opened are the weights part's, never an optimizer shard (an audit hook sees every open)."""
    job, trained = four_rank_job
    marker = job / "checkpoints" / "iter_000000006.pt"
    code = f"""
import sys, torch
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
import torch.distributed as dist
from torch import nn
from checkpointing import FSDPInferenceCheckpointer
model = nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 3))
FSDPInferenceCheckpointer({str(marker)!r}).load_model_during_init(model, is_ema=True)
assert not dist.is_initialized()
torch.save(model.state_dict(), {str(job.parent / "plain_ema.pt")!r})
print("\\n".join(path for path in opened if "checkpoints" in path))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_tree(torch.load(job.parent / "plain_ema.pt"), trained[0]["at_save"][6]["ema"], "ema")
    opened = {Path(p).name for p in run.stdout.split()}
    assert {f"iter_000000006_ema_model_rank{r}.distcp" for r in range(4)} <= opened
    assert not [name for name in opened if "optim" in name or "reg_model" in name], opened
    regular = _plain_model()
    FSDPInferenceCheckpointer(marker).load_model_during_init(regular)  # in this process, also with no group
    assert_same_tree(regular.state_dict(), trained[0]["at_save"][6]["model"], "model")


def test_fsdp1_goes_through_the_same_api_in_the_sharded_layout(ranks, tmp_path):
    """FSDP1's sharded state (ShardedTensor) saves asynchronously and resumes into a fresh FSDP1 model."""
    out = tmp_path / "out"
    out.mkdir()
    assert ranks.run(["fsdp1", "--job", str(tmp_path / "job"), "--out", str(out)], world_size=2)["codes"] == [0, 0]
    for result in rank_outputs(out, 2):
        assert result["start"] == 3
        assert_same_tree(result["loaded"], result["saved"], "fsdp1")
    assert list_generations(tmp_path / "job" / "checkpoints")[-1].manifest.state_layout == "sharded"


def test_a_shard_failing_on_one_rank_fails_the_save_on_every_rank(ranks, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    reply = ranks.run(["shardfails", "--job", str(tmp_path / "job"), "--out", str(out)], world_size=2)
    assert reply["codes"] == [0, 0]
    for result in rank_outputs(out, 2):
        assert "iteration 2 failed" in result["next_save_error"] and "rank 1" in result["next_save_error"]
        assert result["pointer_after_failure"] == "iter_000000001.pt\n"
        assert result["pointer_after_next_save"] == "iter_000000004.pt\n"
    assert resolve_generation(tmp_path / "job").generation.iteration == 4


def _sharded_crash_trials(ranks, tmp_path: Path, trials: int, seed: int) -> dict:
    """Both ranks of a sharded FSDP2 job killed together; a wider window than one process's, since a
    sharded save's collectives take longer than a single process's torch.save at this size."""
    return crash_trials(ranks, tmp_path, trials, seed, layout="sharded", world_size=2, window_s=1.0)


def test_sigkill_of_a_sharded_job_at_random_moments_never_resumes_a_torn_generation(ranks, tmp_path):
    assert_crash_trials(_sharded_crash_trials(ranks, tmp_path, trials=10, seed=3), trials=10)


@pytest.mark.slow
def test_sigkill_crash_loop_of_a_sharded_job_many_trials(ranks, tmp_path):
    assert_crash_trials(_sharded_crash_trials(ranks, tmp_path, trials=100, seed=4), trials=100)

"""The test suite's scenarios for real multi-process checkpointing runs (gloo on CPU), served by
`checkpointing.crashtest` (`RankServer("tests.ckpt_worker")`) beside its crash loop.

Scenarios:
  train    FSDP2 model and EMA: train, save asynchronously (--layout) at each --save-at step, keep training
           (the uninterrupted reference), finalize, then SIGKILL itself.
  resume   FSDP2 model and EMA on any world size: load either layout, report the restored state, keep training.
  replica  seed-protocol model with an EMA replica on rank 1: replica success callbacks, replica files
           gating the pointer, and an injected write failure surfacing on every rank.
  peerdies rank 1 is SIGKILLed after writing its files, before rank 0 commits the generation.
  ddp      DDP-wrapped model: save on 2 ranks (--layout), resume into a fresh DDP model.
  shardfails  sharded layout: rank 1's shard cannot be put in place; the failure reaches every rank.
  fsdp1    FSDP1 on CPU in the sharded layout: save asynchronously, resume into a fresh FSDP1 model.
  crash    checkpointing.crashtest's: a job (one process, or FSDP2 ranks) resuming and saving in a loop until
           SIGKILLed at a random moment.
Each rank writes what it observed to <out>/rank<k>.pt.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import checkpointing.checkpointer as checkpointer_module
from checkpointing import (
    AsyncSaveError,
    CallBackGroup,
    CheckpointConfig,
    FSDPCheckpointer,
    JobConfig,
    ModelWithEMA,
    crashtest,
)
from checkpointing.state import rng_state

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build_fsdp_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and every run
    model = nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 3))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def build_training() -> tuple[ModelWithEMA, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """An FSDP2 model, its EMA twin (sharded alike), AdamW and a OneCycle schedule."""
    model, ema = build_fsdp_model(), build_fsdp_model()
    ema.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=40)
    return ModelWithEMA(model, ema), optimizer, scheduler


def seed_rank_streams(rank: int) -> None:
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    torch.manual_seed(3000 + rank)


def train_step(state: ModelWithEMA, optimizer: torch.optim.Optimizer, scheduler) -> float:
    """Data and noise come from the global python/numpy/torch RNGs, so a resume is exact only if they are restored."""
    x = torch.randn(6, 8)
    target = torch.randn(6, 3) * (0.5 + random.random()) + float(np.random.rand())
    loss = nn.functional.mse_loss(state.model(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    with torch.no_grad():
        torch._foreach_lerp_(list(state.ema.parameters()), list(state.model.parameters()), 0.3)
    return loss.item()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None = None) -> dict:
    """A private copy: on one rank the gathered tensors alias the live parameters."""
    gathered = {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL),
    }
    if ema is not None:
        gathered["ema"] = get_model_state_dict(ema, options=FULL)
    return copy.deepcopy(gathered)


def run_train(args: argparse.Namespace, rank: int, out: dict) -> str:
    state, optimizer, scheduler = build_training()
    seed_rank_streams(rank)
    config = CheckpointConfig(keep_last_checkpoints=2, state_layout=args.layout)
    ckpt = FSDPCheckpointer(config, JobConfig(path_local=args.job))
    assert ckpt.load(state, optimizer, scheduler) == 0
    out["losses"], out["at_save"] = {}, {}
    saves = [int(step) for step in args.save_at.split(",")]
    for step in range(1, args.steps + 1):
        out["losses"][step] = train_step(state, optimizer, scheduler)
        if step in saves:
            ckpt.save(state, optimizer, scheduler, None, step, async_saving=True)
            # what a resume must restore, captured before training mutates anything again
            out["at_save"][step] = {
                **full_state(state.model, optimizer, state.ema),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
            }
    out["final"] = full_state(state.model, optimizer, state.ema)
    ckpt.finalize()
    return crashtest.SIGKILL  # then die like a preempted job


def run_resume(args: argparse.Namespace, rank: int, out: dict) -> None:
    state, optimizer, scheduler = build_training()
    seed_rank_streams(rank + 77)  # deliberately different: the checkpoint must override them
    ckpt = FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=2), JobConfig(path_local=args.job))
    start = ckpt.load(state, optimizer, scheduler)
    out["start"] = start
    out["at_load"] = {**full_state(state.model, optimizer, state.ema), "scheduler": scheduler.state_dict(), "rng": rng_state()}
    out["losses"] = {step: train_step(state, optimizer, scheduler) for step in range(start + 1, args.steps + 1)}
    out["final"] = full_state(state.model, optimizer, state.ema)
    ckpt.finalize()


class SeedStyleModel:
    """The seed's model protocol; rank 1 holds an EMA replica with its own decay."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 4)
        self.ema = nn.Linear(4, 4)
        with torch.no_grad():
            self.ema.weight.fill_(float(rank + 1))
        self.rank, self.world_size = rank, world_size

    def state_dict_model(self) -> dict:
        return {"model": get_model_state_dict(self.model, options=FULL), "ema": self.ema.state_dict()}

    def get_ckpt_postfix(self) -> tuple[str, int, int, int]:
        if self.rank == 0:
            return "", 0, 0, self.world_size
        return f"_RANK{self.rank}", self.rank, 0, self.world_size


class Recorder(CallBackGroup):
    def __init__(self) -> None:
        super().__init__()
        self.successes: list[int] = []

    def on_save_checkpoint_success(self, iteration: int) -> None:
        self.successes.append(iteration)


def run_replica(args: argparse.Namespace, rank: int, out: dict) -> None:
    world_size = dist.get_world_size()
    model = SeedStyleModel(rank, world_size)
    optimizer = torch.optim.SGD(model.model.parameters(), lr=0.1)
    recorder = Recorder()
    ckpt = FSDPCheckpointer(
        CheckpointConfig(keep_last_checkpoints=5), JobConfig(path_local=args.job), recorder
    )
    checkpoints = Path(args.job) / "checkpoints"
    # 1. a clean save: every rank reports success for iteration 1 (the seed logged a failure on replicas)
    ckpt.save(model, optimizer, None, None, 1, async_saving=True)
    ckpt.finalize()
    out["successes_after_1"] = list(recorder.successes)
    out["files_after_1"] = sorted(os.listdir(checkpoints))
    # 2. rank 1's replica file cannot be renamed into place (a directory occupies its name)
    if rank == 1:
        (checkpoints / "iter_000000002_RANK1_ema_model.pt").mkdir()
    dist.barrier()
    ckpt.save(model, optimizer, None, None, 2, async_saving=True)
    try:
        ckpt.save(model, optimizer, None, None, 3, async_saving=True)
        out["next_save_error"] = None
    except AsyncSaveError as e:
        out["next_save_error"] = str(e)
    out["pointer_after_failure"] = (checkpoints / "latest_checkpoint.txt").read_text()
    # 3. the same failure surfaces from finalize() too
    if rank == 1:
        (checkpoints / "iter_000000004_RANK1_ema_model.pt").mkdir()
    dist.barrier()
    ckpt.save(model, optimizer, None, None, 4, async_saving=True)
    try:
        ckpt.finalize()
        out["finalize_error"] = None
    except AsyncSaveError as e:
        out["finalize_error"] = str(e)
    out["successes"] = list(recorder.successes)
    # 4. a fresh model loads this rank's EMA replica during init
    fresh = SeedStyleModel(rank + 10, world_size)
    loader = FSDPCheckpointer(CheckpointConfig(), JobConfig(path_local=args.job))
    loader.load_model_during_init(fresh.ema, is_ema=True, ema_id=rank)
    out["loaded_ema_weight"] = fresh.ema.weight.detach().clone()


def run_peer_dies(args: argparse.Namespace, rank: int, out: dict) -> str:
    """Rank 1 writes its EMA replica for iteration 2, then is SIGKILLed before the commit.

    Rank 0 records what its save raised and which files the generation left on disk.
    """
    model = SeedStyleModel(rank, dist.get_world_size())
    optimizer = torch.optim.SGD(model.model.parameters(), lr=0.1)
    config = CheckpointConfig(keep_last_checkpoints=5, replica_timeout_s=60)
    ckpt = FSDPCheckpointer(config, JobConfig(path_local=args.job))
    ckpt.save(model, optimizer, None, None, 1, async_saving=False)
    if rank == 1:
        write_files = checkpointer_module.atomic_torch_save_all

        def write_then_die(items):
            records = write_files(items)
            os.kill(os.getpid(), signal.SIGKILL)  # its files are durable; the commit never hears of them
            return records

        checkpointer_module.atomic_torch_save_all = write_then_die
    try:
        ckpt.save(model, optimizer, None, None, 2, async_saving=False)
        out["save_error"] = None
    except Exception as e:
        out["save_error"] = f"{type(e).__name__}: {e}"
    out["files"] = sorted(os.listdir(Path(args.job) / "checkpoints"))
    return crashtest.KEEP_GROUP


def run_ddp(args: argparse.Namespace, rank: int, out: dict) -> None:
    """DDP through the same API: files hold bare names (no `module.`), a fresh DDP model resumes from them."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)))
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    model, optimizer = build()
    torch.manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    job = JobConfig(path_local=args.job)
    FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=1, state_layout=args.layout), job).save(
        model, optimizer, None, None, 3, False
    )
    fresh, fresh_optimizer = build()
    out["start"] = FSDPCheckpointer(CheckpointConfig(), job).load(fresh, fresh_optimizer)
    out["saved"] = full_state(model, optimizer)
    out["loaded"] = full_state(fresh, fresh_optimizer)


def run_shard_fails(args: argparse.Namespace, rank: int, out: dict) -> None:
    """Sharded layout: rank 1 cannot put its optimizer shard of iteration 2 in place (a directory holds the
    name); every rank must hear of it at the next save, the pointer must stay, and saving must go on."""
    state, optimizer, _ = build_training()
    train_step(state, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    config = CheckpointConfig(keep_last_checkpoints=5, state_layout="sharded", replica_timeout_s=120)
    ckpt = FSDPCheckpointer(config, JobConfig(path_local=args.job))
    checkpoints = Path(args.job) / "checkpoints"
    ckpt.save(state, optimizer, None, None, 1, async_saving=True)
    ckpt.finalize()
    if rank == 1:
        (checkpoints / "iter_000000002_optim_rank1.distcp").mkdir()
    dist.barrier()
    ckpt.save(state, optimizer, None, None, 2, async_saving=True)
    try:
        ckpt.save(state, optimizer, None, None, 3, async_saving=True)
        out["next_save_error"] = None
    except AsyncSaveError as e:
        out["next_save_error"] = str(e)
    out["pointer_after_failure"] = (checkpoints / "latest_checkpoint.txt").read_text()
    ckpt.save(state, optimizer, None, None, 4, async_saving=True)
    ckpt.finalize()
    out["pointer_after_next_save"] = (checkpoints / "latest_checkpoint.txt").read_text()


def _local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of the model and optimizer state (FSDP1 hands out ShardedTensors), as plain tensors."""

    def local(tree):
        if hasattr(tree, "local_shards"):
            return [shard.tensor.clone() for shard in tree.local_shards()]
        if isinstance(tree, dict):
            return {k: local(v) for k, v in tree.items()}
        return tree.clone() if isinstance(tree, torch.Tensor) else tree

    return local({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)})


def run_fsdp1(args: argparse.Namespace, rank: int, out: dict) -> None:
    """FSDP1 through the same API on CPU, in the sharded layout (its ShardedTensor state, staged for an async
    save); gathering FSDP1's full optimizer state crashes on CPU/gloo in torch 2.13, so the full layout's FSDP1
    test needs a GPU (test_checkpointing_gpu.py)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 3))
        model = FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)
        return model, torch.optim.AdamW(model.parameters(), lr=0.02)

    model, optimizer = build()
    torch.manual_seed(10 + rank)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    job = JobConfig(path_local=args.job)
    ckpt = FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=1, state_layout="sharded"), job)
    ckpt.save(model, optimizer, None, None, 3, async_saving=True)
    out["saved"] = _local_shards(model, optimizer)
    model(torch.randn(4, 8)).pow(2).mean().backward()  # training goes on while the staged copy is written
    optimizer.step()
    ckpt.finalize()
    fresh, fresh_optimizer = build()
    out["start"] = FSDPCheckpointer(CheckpointConfig(), job).load(fresh, fresh_optimizer)
    out["loaded"] = _local_shards(fresh, fresh_optimizer)


SCENARIOS = {
    "train": run_train,
    "resume": run_resume,
    "replica": run_replica,
    "peerdies": run_peer_dies,
    "ddp": run_ddp,
    "shardfails": run_shard_fails,
    "fsdp1": run_fsdp1,
    **crashtest.SCENARIOS,
}


if __name__ == "__main__":
    crashtest.serve(SCENARIOS)

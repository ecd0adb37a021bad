"""One rank of a real multi-process checkpointing run (gloo on CPU), launched by tests/test_checkpointing_dist.py.

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
  crash    a job (one process, or FSDP2 ranks) resuming and saving in a loop until SIGKILLed at a random moment.
Each rank writes what it observed to <out>/rank<k>.pt. Run as a server (see serve()).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpointing.checkpointer as checkpointer_module
from checkpointing import (
    AsyncSaveError,
    CallBackGroup,
    CheckpointConfig,
    FSDPCheckpointer,
    JobConfig,
    ModelWithEMA,
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


def run_train(args: argparse.Namespace, rank: int, out: dict) -> None:
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


def run_peer_dies(args: argparse.Namespace, rank: int, out: dict) -> None:
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


def _crash_model(world_size: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 512))
    if world_size > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model


def _holds_only(model: nn.Module, value: float) -> bool:
    """Whether every parameter on every rank equals `value` (each rank checks its own shards)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    whole = torch.tensor([float(all(bool((t == value).all()) for t in local))])
    if dist.is_initialized():
        dist.all_reduce(whole, op=dist.ReduceOp.MIN)
    return bool(whole.item())


def run_crash(args: argparse.Namespace, rank: int, out: dict) -> None:
    """Resume, check the generation is whole, then save in a loop until SIGKILLed by the server.

    Weights are filled with the iteration number before each save, so a torn generation (marker of
    one save, weights of another, or shards of two saves) shows up as a mismatch. Rank 0 logs progress
    to a line log (O_APPEND).
    """
    model = _crash_model(dist.get_world_size() if dist.is_initialized() else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = CheckpointConfig(keep_last_checkpoints=args.keep, save_at_iters=(5,), state_layout=args.layout)
    log = open(Path(args.out) / "progress.log", "a", buffering=1)  # noqa: SIM115 (lives until the kill)

    class Published(CallBackGroup):
        def on_save_checkpoint_success(self, iteration: int) -> None:
            if rank == 0:
                log.write(f"published {iteration}\n")

    ckpt = FSDPCheckpointer(config, JobConfig(path_local=args.job), Published())
    start = ckpt.load(model, optimizer)
    whole = _holds_only(model, float(start)) if start else True
    if rank == 0:
        log.write(f"resumed {start} {'whole' if whole else 'TORN'}\n")
    os.write(args.ready_fd, b"r")
    iteration = start
    while True:
        iteration += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(iteration))
        ckpt.save(model, optimizer, None, None, iteration, async_saving=iteration % 2 == 0)


SCENARIOS = {
    "train": run_train,
    "resume": run_resume,
    "replica": run_replica,
    "peerdies": run_peer_dies,
    "ddp": run_ddp,
    "shardfails": run_shard_fails,
    "fsdp1": run_fsdp1,
    "crash": run_crash,
}


def run_rank(argv: list[str], rank: int, world_size: int, ready_fd: int) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=tuple(SCENARIOS))
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", default="4", help="comma-separated steps at which `train` saves")
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--layout", choices=("full", "sharded"), default="full")
    parser.add_argument("--store", default="store", help="file name of the process group's store in --out")
    args = parser.parse_args(argv)
    args.ready_fd = ready_fd
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if world_size > 1 or args.scenario != "crash":
        store = Path(args.out) / args.store
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    out: dict = {"world_size": world_size}
    SCENARIOS[args.scenario](args, rank, out)
    torch.save(out, Path(args.out) / f"rank{rank}.pt")
    if args.scenario == "train":
        os.kill(os.getpid(), signal.SIGKILL)  # die like a preempted job: no cleanup, no destroy_process_group
    if args.scenario != "peerdies":  # the group lost a rank: tearing it down could wait on the dead peer
        dist.destroy_process_group()


def warm_up() -> None:
    """Pay torch's one-time lazy initialisation (seconds on a busy machine) once, before forking.

    Single-threaded, so no OpenMP pool exists that a forked child could inherit half-initialised.
    """
    torch.set_num_threads(1)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def serve() -> None:
    """Fork rank processes on request, so torch is imported once per test session, not once per rank.

    Requests are JSON lines on stdin: {"argv": [...], "world_size": N, "kill_after": seconds | null}.
    The reply is a JSON line with each rank's exit status (negative: killed by that signal). With
    kill_after, every rank is SIGKILLed that long after all of them signal they have resumed.
    """
    warm_up()
    for line in sys.stdin:
        request = json.loads(line)
        ready_r, ready_w = os.pipe()
        pids = []
        for rank in range(request["world_size"]):
            pid = os.fork()
            if pid == 0:  # the rank: never returns into the server loop
                os.close(ready_r)
                os.dup2(2, 1)  # keep stdout for the protocol
                code = 0
                try:
                    run_rank(request["argv"], rank, request["world_size"], ready_w)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        os.close(ready_w)
        if request.get("kill_after") is not None:
            ready = all(os.read(ready_r, 1) == b"r" for _ in pids)
            time.sleep(request["kill_after"])
            for pid in pids:  # the whole job dies at once, like a preempted one
                os.kill(pid, signal.SIGKILL)
        os.close(ready_r)
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        reply = {"codes": codes}
        if request.get("kill_after") is not None:
            reply["ready"] = ready
        print(json.dumps(reply), flush=True)


class RankServer:
    """Client side: starts `python tests/ckpt_worker.py` and sends it requests."""

    def __init__(self) -> None:
        repo = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=repo,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        )

    def run(self, argv: list[str], world_size: int, kill_after: float | None = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(
            json.dumps({"argv": argv, "world_size": world_size, "kill_after": kill_after}) + "\n"
        )
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the rank server died; see its stderr")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def crash_trials(
    server: RankServer,
    root: Path,
    trials: int,
    seed: int,
    layout: str = "full",
    world_size: int = 1,
    window_s: float = 0.4,
) -> dict:
    """SIGKILL a saving job (every rank at once) `trials` times at a random moment within `window_s` of its
    resume; summarise what each resume found.

    Every third run overwrites ckpt_.pt in place (no retention), the others keep numbered generations. Each
    run gets a fresh process-group store: a killed job leaves its store behind.
    """
    rng = random.Random(seed)
    job, out = root / "job", root / "out"
    out.mkdir(parents=True)
    died_early = 0
    for trial in range(trials):
        keep = 2 if trial % 3 else 0
        argv = ["crash", "--job", str(job), "--out", str(out), "--keep", str(keep), "--layout", layout]
        reply = server.run([*argv, "--store", f"store{trial}"], world_size, kill_after=rng.uniform(0.0, window_s))
        died_early += not reply["ready"] or reply["codes"] != [-9] * world_size
    published, resumes, torn, went_back = 0, 0, [], []
    for line in (out / "progress.log").read_text().splitlines():
        event, iteration, *rest = line.split()
        if event == "published":
            published = max(published, int(iteration))
        elif event == "resumed":
            resumes += 1
            if rest != ["whole"]:
                torn.append(line)
            if int(iteration) < published:
                went_back.append(f"resumed at {iteration} after {published} was published")
    return {
        "trials": trials,
        "died_before_resuming": died_early,
        "resumes": resumes,
        "torn": torn,
        "went_back": went_back,
        "last_published": published,
        "job": job,
    }


if __name__ == "__main__":
    serve()

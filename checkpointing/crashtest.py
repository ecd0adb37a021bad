"""Crash trials of the checkpointer with real processes: a saving job (one process, or FSDP2 gloo ranks) is
SIGKILLed at random moments, and every resume must find a whole generation no older than the last one
published. The test suite and `bench/checkpoint_bench.py` run them; they also tell whether a filesystem a
job writes to (a network mount, say) keeps the commit protocol's promises.

Ranks are forked from one server process (`serve`, `python -m checkpointing.crashtest`), so torch is
imported once, not once per rank. A module with more scenarios (the tests' `tests/ckpt_worker.py`) serves
them with `serve({**SCENARIOS, ...})` and is started with `RankServer("its.module")`.

    from checkpointing.crashtest import RankServer, crash_trials
    server = RankServer()
    summary = crash_trials(server, Path("/mnt/shared/trial"), trials=20, seed=0)  # torn, went_back: []
    server.close()
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpointing import CallBackGroup, CheckpointConfig, FSDPCheckpointer, JobConfig

#: A scenario runs on every rank with the parsed request, the rank and a dict it fills with what it observed
#: (saved as <out>/rank<k>.pt). It returns how the rank ends: None tears the process group down, SIGKILL dies
#: like a preempted job (no cleanup at all), KEEP_GROUP leaves a group that lost a rank (tearing it down could
#: wait on the dead peer).
Scenario = Callable[[argparse.Namespace, int, dict], str | None]
SIGKILL, KEEP_GROUP = "sigkill", "keep_group"


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


#: What this module serves: the crash loop.
SCENARIOS: dict[str, Scenario] = {"crash": run_crash}


def run_rank(argv: list[str], rank: int, world_size: int, ready_fd: int, scenarios: dict[str, Scenario]) -> None:
    """One rank: parse the request, join the process group, run the scenario, save what it observed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=tuple(scenarios))
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
    if world_size > 1 or args.scenario != "crash":  # a one-process crash loop is a plain job, as in training
        store = Path(args.out) / args.store
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    out: dict = {"world_size": world_size}
    ending = scenarios[args.scenario](args, rank, out)
    torch.save(out, Path(args.out) / f"rank{rank}.pt")
    if ending == SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    if ending != KEEP_GROUP and dist.is_initialized():
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


def serve(scenarios: dict[str, Scenario]) -> None:
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
                    run_rank(request["argv"], rank, request["world_size"], ready_w, scenarios)
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
    """Client side: starts `python -m MODULE` (a module that calls `serve`) and sends it requests."""

    def __init__(self, module: str = "checkpointing.crashtest") -> None:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"rank server module {module!r} not found")
        root = Path(spec.origin).resolve().parents[module.count(".")]  # the folder the module imports from
        path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
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
    serve(SCENARIOS)

"""Checkpoint throughput against the disk's own speed, measured in the same run.

    nice python bench/checkpoint_bench.py [--mb 512] [--repeats 3] [--dir DIR]

Ratios (issue 2):
  sync save throughput / `dd conv=fsync` throughput for the same bytes   goal >= 0.9
  time save() blocks with async_saving / sync save time                  goal <= 0.1
  load time / raw read time of the same files                            goal <= 1.5
Then --crash-trials runs of a saving process are SIGKILLed at random moments (the test suite runs 20)
and every resume is checked for a whole generation that is not older than the last published one.
State: a model and its EMA (each mb/4) plus AdamW moments (mb/2). Each figure is the median over
repeats, the measurements interleaved so that disk and machine load hit all of them alike. Files are
read back from the page cache for both load and raw read (dropping caches needs root).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from checkpointing.atomic import sha256_file
from tests.ckpt_worker import RankServer, crash_trials


def build_state(megabytes: int) -> tuple[ModelWithEMA, torch.optim.Optimizer]:
    """Model + EMA + AdamW moments totalling `megabytes` of float32."""
    side = int((megabytes * 2**20 / 4 / 4 / 2) ** 0.5)  # two square layers per model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(side, side, bias=False), nn.Linear(side, side, bias=False))
    ema = nn.Sequential(nn.Linear(side, side, bias=False), nn.Linear(side, side, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return ModelWithEMA(model, ema), optimizer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd_fsync(path: Path, nbytes: int) -> float:
    """dd over the previous run's file, so it frees old blocks like a save that replaces a generation."""
    block = 4 << 20
    count = -(-nbytes // block)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    return elapsed * nbytes / (count * block)  # scale to exactly the checkpoint's bytes


def raw_read(paths: list[Path]) -> float:
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


def generation_files(directory: Path, iteration: int) -> list[Path]:
    return sorted(
        p for p in directory.iterdir() if p.name.startswith(f"iter_{iteration:09d}") and p.suffix == ".pt"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir in /tmp)")
    parser.add_argument("--crash-trials", type=int, default=100, help="SIGKILL trials (0: skip)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        model, optimizer = build_state(args.mb)
        job = JobConfig(path_local=str(root / "job"))
        ckpt = FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=1), job)
        directory = root / "job" / "checkpoints"
        ckpt.save(model, optimizer, None, None, 1, async_saving=False)  # warm-up: page cache, allocator
        nbytes = sum(p.stat().st_size for p in generation_files(directory, 1))
        ckpt.save(model, optimizer, None, None, 2, async_saving=True)  # warm-up: staging buffers
        ckpt.finalize()
        dd, sync, blocked, load, read, hashed = [], [], [], [], [], []
        iteration = 2
        for _ in range(args.repeats):
            dd.append(dd_fsync(root / "dd.bin", nbytes))
            iteration += 1
            sync.append(
                timed(lambda it=iteration: ckpt.save(model, optimizer, None, None, it, async_saving=False))
            )
            iteration += 1
            blocked.append(
                timed(lambda it=iteration: ckpt.save(model, optimizer, None, None, it, async_saving=True))
            )
            ckpt.finalize()
            loader = FSDPCheckpointer(CheckpointConfig(), job)  # a resume: restores into the live objects
            load.append(timed(lambda c=loader: c.load(model, optimizer)))
            read.append(raw_read(generation_files(directory, iteration)))
            hashed.append(
                timed(lambda it=iteration: [sha256_file(p) for p in generation_files(directory, it)])
            )
        med = statistics.median
        mb = nbytes / 2**20
        print(
            f"\nstate: {mb:.0f} MiB in {len(generation_files(directory, iteration))} files, {args.repeats} repeats, median"
        )
        print(
            f"  dd conv=fsync {med(dd):.2f} s ({mb / med(dd):.0f} MiB/s)   sync save {med(sync):.2f} s ({mb / med(sync):.0f} MiB/s)"
        )
        print(
            f"  async save() blocked {med(blocked):.3f} s   load {med(load):.2f} s   raw read {med(read):.2f} s"
        )
        print(
            f"  sha256 of the same files alone {med(hashed):.2f} s (the manifest needs it; dd does not hash)\n"
        )
        rows = [
            (
                "sync save throughput / dd conv=fsync throughput",
                med(dd) / med(sync),
                ">= 0.9",
                med(dd) / med(sync) >= 0.9,
            ),
            (
                "async save() blocking time / sync save time",
                med(blocked) / med(sync),
                "<= 0.1",
                med(blocked) / med(sync) <= 0.1,
            ),
            ("load time / raw read time", med(load) / med(read), "<= 1.5", med(load) / med(read) <= 1.5),
        ]
        print("| ratio | measured | goal | met |")
        print("|---|---|---|---|")
        for name, value, goal, met in rows:
            print(f"| {name} | {value:.2f} | {goal} | {'yes' if met else 'no'} |")
        if args.crash_trials:
            server = RankServer()
            try:
                start = time.perf_counter()
                summary = crash_trials(server, root / "crash", args.crash_trials, seed=2)
            finally:
                server.close()
            ok = not (summary["torn"] or summary["went_back"] or summary["died_before_resuming"])
            print(
                f"\ncrash test: {summary['trials']} SIGKILLs in {time.perf_counter() - start:.0f} s, "
                f"{summary['resumes']} resumes, {len(summary['torn'])} torn, {len(summary['went_back'])} went back "
                f"past a published iteration, last published iteration {summary['last_published']}: "
                f"{'PASS' if ok else 'FAIL'}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

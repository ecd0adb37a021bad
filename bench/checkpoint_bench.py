"""Checkpoint cost, measured in one run: the two state layouts across world sizes, and the single-process
save against the disk's own speed.

    nice python -m bench.checkpoint_bench [--sections layouts,throughput,crash] [--mb 128] [--ranks 1,2,4]

layouts: FSDP2 gloo ranks hold a model of --mb MiB, its EMA and AdamW moments (4x --mb of state,
sharded); for 1, 2 and 4 ranks x the full and the sharded layout: rank 0's extra memory during a synchronous
save (peak RSS above the RSS before it, with the allocator's retained free memory returned and the kernel's
peak counter reset first), the save's wall time (the slowest rank) and how long an asynchronous save() blocks
(the slowest rank; the staging buffers it copies into are kept between saves, as in training). Ratios sharded / full at each world size:
  rank-0 extra memory   goal <= 0.5 at 4 ranks (stretch 0.3)
  save time             goal <= 1.0 at 4 ranks (stretch 0.5)
throughput, one process, --throughput-mb of state:
  sync save throughput / `dd conv=fsync` throughput for the same bytes   goal >= 0.9
  time save() blocks with async_saving / sync save time                  goal <= 0.1
  load time / raw read time of the same files                            goal <= 1.5
crash: --crash-trials runs of a saving process (full layout) and of a 2-rank sharded job are SIGKILLed at
random moments, and every resume is checked for a whole generation not older than the last published one.
Each figure is a median over --repeats; files are read back from the page cache (dropping caches needs root).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from checkpointing.atomic import sha256_file
from checkpointing.crashtest import RankServer, crash_trials


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


# ------------------------------------------------------------------ layouts across world sizes

LAYOUTS = ("full", "sharded")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Return memory the allocator kept from earlier saves to the system (malloc_trim), then reset VmHWM to the
    current RSS (Linux >= 4.0): the next peak is then this save's alone, not hidden in reused free memory.
    Returns the RSS the peak is measured from, in KiB."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _fsdp_training(megabytes: int) -> tuple[ModelWithEMA, torch.optim.Optimizer]:
    """A model of `megabytes` MiB (four square layers), its EMA and AdamW moments after one step, all FSDP2-sharded."""
    side = int((megabytes * 2**20 / 4 / 4) ** 0.5)

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(4)))
        for layer in model:
            fully_shard(layer)
        return fully_shard(model)

    model, ema = build(), build()
    ema.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, side)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return ModelWithEMA(model, ema), optimizer


def _layout_rank(rank: int, world_size: int, layout: str, megabytes: int, repeats: int, root: str) -> None:
    """One rank: warm up, then per repeat a sync save (rank 0's peak extra RSS, time) and an async save."""
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    state, optimizer = _fsdp_training(megabytes)
    config = CheckpointConfig(keep_last_checkpoints=1, state_layout=layout)
    ckpt = FSDPCheckpointer(config, JobConfig(path_local=f"{root}/job"))

    def save(iteration: int, asynchronous: bool) -> float:
        start = time.perf_counter()
        ckpt.save(state, optimizer, None, None, iteration, async_saving=asynchronous)
        return time.perf_counter() - start

    save(1, False)  # warm-up: imports, allocator, page cache
    save(2, True)  # warm-up: staging buffers
    ckpt.finalize()
    rows = []
    for repeat in range(repeats):
        dist.barrier()
        before = _reset_peak_rss()
        seconds = save(3 + 2 * repeat, False)
        extra = (_status_kib("VmHWM") - before) * 1024
        dist.barrier()
        blocked = save(4 + 2 * repeat, True)
        ckpt.finalize()
        rows.append({"save_s": seconds, "extra_bytes": extra, "blocked_s": blocked})
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(root, "result.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure_layout(world_size: int, layout: str, megabytes: int, repeats: int, parent: Path) -> dict[str, float]:
    """Median over repeats of rank 0's extra memory and the slowest rank's save time and async blocking time."""
    root = Path(tempfile.mkdtemp(prefix=f"{layout}{world_size}_", dir=parent))
    try:
        mp.start_processes(
            _layout_rank, args=(world_size, layout, megabytes, repeats, str(root)), nprocs=world_size,
            start_method="spawn",
        )
        ranks = json.loads((root / "result.json").read_text())
        state_bytes = sum(p.stat().st_size for p in (root / "job" / "checkpoints").iterdir() if ".tmp." not in p.name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    return {
        "extra_mb": med(r["extra_bytes"] for r in ranks[0]) / 1e6,
        "save_s": med(max(rank[i]["save_s"] for rank in ranks) for i in range(repeats)),
        "blocked_s": med(max(rank[i]["blocked_s"] for rank in ranks) for i in range(repeats)),
        "files_mb": state_bytes / 1e6,
    }


def layouts_section(args: argparse.Namespace, root: Path) -> None:
    results = {}
    for world_size in args.ranks:
        for layout in LAYOUTS:  # both layouts of a world size back to back: the machine's load hits them alike
            results[world_size, layout] = measure_layout(world_size, layout, args.mb, args.repeats, root)
            print(f"  {world_size} rank(s), {layout}: {results[world_size, layout]}", flush=True)
    print(f"\nstate: model {args.mb} MiB + EMA + AdamW moments (4x), FSDP2 over gloo, median of {args.repeats}\n")
    print("| ranks | layout | rank-0 extra memory during a save (MB) | save time (s) | async save() blocked (s) |")
    print("|---|---|---|---|---|")
    for (world_size, layout), r in results.items():
        print(f"| {world_size} | {layout} | {r['extra_mb']:.0f} | {r['save_s']:.2f} | {r['blocked_s']:.3f} |")
    print("\n| ranks | sharded / full: rank-0 extra memory | save time | async blocking |")
    print("|---|---|---|---|")
    for world_size in args.ranks:
        full, sharded = results[world_size, "full"], results[world_size, "sharded"]
        print(
            f"| {world_size} | {sharded['extra_mb'] / full['extra_mb']:.2f} | {sharded['save_s'] / full['save_s']:.2f} "
            f"| {sharded['blocked_s'] / full['blocked_s']:.2f} |"
        )


# ------------------------------------------------------------------ one process against the disk


def throughput_section(args: argparse.Namespace, root: Path) -> None:
    model, optimizer = build_state(args.throughput_mb)
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
        sync.append(timed(lambda it=iteration: ckpt.save(model, optimizer, None, None, it, async_saving=False)))
        iteration += 1
        blocked.append(timed(lambda it=iteration: ckpt.save(model, optimizer, None, None, it, async_saving=True)))
        ckpt.finalize()
        loader = FSDPCheckpointer(CheckpointConfig(), job)  # a resume: restores into the live objects
        load.append(timed(lambda c=loader: c.load(model, optimizer)))
        read.append(raw_read(generation_files(directory, iteration)))
        hashed.append(timed(lambda it=iteration: [sha256_file(p) for p in generation_files(directory, it)]))
    med = statistics.median
    mb = nbytes / 2**20
    print(f"\nstate: {mb:.0f} MiB in {len(generation_files(directory, iteration))} files, {args.repeats} repeats, median")
    print(f"  dd conv=fsync {med(dd):.2f} s ({mb / med(dd):.0f} MiB/s)   sync save {med(sync):.2f} s ({mb / med(sync):.0f} MiB/s)")
    print(f"  async save() blocked {med(blocked):.3f} s   load {med(load):.2f} s   raw read {med(read):.2f} s")
    print(f"  sha256 of the same files alone {med(hashed):.2f} s (the manifest needs it; dd does not hash)\n")
    rows = [
        ("sync save throughput / dd conv=fsync throughput", med(dd) / med(sync), ">= 0.9", med(dd) / med(sync) >= 0.9),
        ("async save() blocking time / sync save time", med(blocked) / med(sync), "<= 0.1", med(blocked) / med(sync) <= 0.1),
        ("load time / raw read time", med(load) / med(read), "<= 1.5", med(load) / med(read) <= 1.5),
    ]
    print("| ratio | measured | goal | met |")
    print("|---|---|---|---|")
    for name, value, goal, met in rows:
        print(f"| {name} | {value:.2f} | {goal} | {'yes' if met else 'no'} |")


# ------------------------------------------------------------------ SIGKILL at random moments


def crash_section(args: argparse.Namespace, root: Path) -> None:
    server = RankServer()
    try:
        for layout, world_size, window_s in (("full", 1, 0.4), ("sharded", 2, 1.0)):
            start = time.perf_counter()
            summary = crash_trials(
                server, root / f"crash_{layout}", args.crash_trials, 2, layout, world_size, window_s
            )
            ok = not (summary["torn"] or summary["went_back"] or summary["died_before_resuming"])
            print(
                f"\ncrash test, {layout} layout on {world_size} rank(s): {summary['trials']} SIGKILLs in "
                f"{time.perf_counter() - start:.0f} s, {summary['resumes']} resumes, {len(summary['torn'])} torn, "
                f"{len(summary['went_back'])} went back past a published iteration, last published iteration "
                f"{summary['last_published']}: {'PASS' if ok else 'FAIL'}"
            )
    finally:
        server.close()


SECTIONS = {"layouts": layouts_section, "throughput": throughput_section, "crash": crash_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="layouts", help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--mb", type=int, default=128, help="layouts: model size in MiB (state is 4x)")
    parser.add_argument("--ranks", default="1,2,4", help="layouts: world sizes")
    parser.add_argument("--throughput-mb", type=int, default=512, help="throughput: state size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir in /tmp)")
    parser.add_argument("--crash-trials", type=int, default=100, help="crash: SIGKILL trials per layout")
    args = parser.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; expected some of {sorted(SECTIONS)}")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        for name in sections:
            SECTIONS[name](args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

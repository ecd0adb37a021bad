"""Loading and generating through the pipeline: time to a ready pipeline, and frames/s, against baselines.

Time to ready is measured in fresh processes, from process start (psutil create_time) to the moment
`load_pipeline` returns, for each source form. Baselines timed in the same run: reading the weight file's
bytes (warm page cache, what any loader must at least do) and a process that only imports torch (the floor
no torch program gets under). Generation compares `pipe.generate_world` and the `python -m inference
generate` process with team model's `rollout` called directly on the same poses.

    python -m bench.load_bench [--model SRC] [--repeats 3] [--frames 8] [--steps 4]

Without --model it uses weights/default when present, else a randomly initialised default-config model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from inference import load_pipeline
from inference.loader import CONFIG_NAME, DEFAULT_MODEL, WEIGHTS_NAME, load_model
from inference.network import WorldModel, WorldModelConfig
from inference.rollout import rollout
from lidar.sim import make_world, plan_drive

#: The checkout the fresh processes import from (they run `python -c` in it).
REPO = Path(__file__).resolve().parents[1]

_READY = """
import json, time, psutil
from inference import load_pipeline
pipe = load_pipeline({source!r}, device="cpu", dtype="float32")
ready = time.time() - psutil.Process().create_time()
print(json.dumps({{"ready": ready, "load": pipe.provenance.load_seconds}}))
"""
_TORCH_ONLY = "import time, psutil, torch; print(time.time() - psutil.Process().create_time())"


def fresh_process(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise SystemExit(f"benchmark process failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def write_release(folder: Path, model: WorldModel) -> Path:
    """The smallest release the loader takes: config.json and model.safetensors."""
    folder.mkdir(parents=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_dict()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / WEIGHTS_NAME))
    return folder


def write_hub_cache(cache: Path, repo: str, release: Path) -> str:
    """`release` laid out as huggingface_hub's cache holds a download of `repo` (blobs, one snapshot, refs/main),
    so the Hub id loads offline; returns the snapshot's commit name."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        data = (release / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        os.symlink(Path("..") / ".." / "blobs" / blob, snapshot / name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return commit


def raw_read_seconds(path: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first read warms the page cache, as loading does for the others
        start = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def sources(workdir: Path, model_source: str | None) -> tuple[dict[str, tuple[str, dict, Path]], WorldModel]:
    """The same weights as a release folder, a Hub cache entry (offline) and a training job dir."""
    if model_source is None and not (DEFAULT_MODEL / WEIGHTS_NAME).is_file():
        torch.manual_seed(0)
        model = WorldModel(WorldModelConfig()).eval()
    else:
        model, _ = load_model(model_source, device="cpu", dtype=torch.float32)
    release = write_release(workdir / "release", model)
    cache = workdir / "hub"
    commit = write_hub_cache(cache, "lidarverse/bench", release)
    job = workdir / "job"
    job.mkdir()
    (job / CONFIG_NAME).write_text(json.dumps({"model": model.config.to_dict()}))
    ckpt = FSDPCheckpointer(
        CheckpointConfig(keep_last_checkpoints=2, async_saving=False), JobConfig(path_local=str(job))
    )
    ckpt.save(ModelWithEMA(model, model), None, None, None, 100, async_saving=False)
    ckpt.finalize()
    hub_env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    forms = {
        "release folder": (str(release), {}, release / WEIGHTS_NAME),
        "Hub id (offline cache)": (
            "lidarverse/bench",
            hub_env,
            cache / "models--lidarverse--bench" / "snapshots" / commit / WEIGHTS_NAME,
        ),
        "job dir (EMA)": (str(job), {}, job / "checkpoints" / "iter_000000100_ema_model.pt"),
    }
    return forms, model


def bench_ready(forms: dict[str, tuple[str, dict, Path]], repeats: int) -> None:
    floor = statistics.median(float(fresh_process(_TORCH_ONLY)) for _ in range(repeats))
    print(
        f"\n## Time to a ready pipeline (fresh process, median of {repeats}; import-torch-only process: {floor:.2f} s)\n"
    )
    print(
        "| source | weights MB | raw read s | load_model s | process -> ready s | load ÷ raw read | ready ÷ (torch floor + raw read) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (source, env, weights) in forms.items():
        runs = [json.loads(fresh_process(_READY.format(source=source), env)) for _ in range(repeats)]
        ready = statistics.median(r["ready"] for r in runs)
        load = statistics.median(r["load"] for r in runs)
        raw = raw_read_seconds(weights.resolve(), repeats)
        print(
            f"| {name} | {weights.stat().st_size / 1e6:.1f} | {raw:.4f} | {load:.3f} | {ready:.2f} | {load / raw:.0f} | "
            f"{ready / (floor + raw):.2f} |"
        )


def bench_generate(release: Path, frames: int, steps: int, repeats: int) -> None:
    pipe = load_pipeline(release, device="cpu", dtype=torch.float32)
    world = make_world(3, "urban")
    poses = plan_drive(world, "turn_left", frames, seed=0, mount_height=pipe.sensor.mount_height)
    scene = {"map_source": world.hdmap, "layout": world.boxes}  # what generate_world(map=World) conditions on
    rollout(pipe.model, poses[:1], **scene, steps=steps)  # warm-up
    direct, piped = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout(pipe.model, poses, **scene, steps=steps, seed=0)
        direct.append(time.perf_counter() - start)
        start = time.perf_counter()
        pipe.generate_world(map=world, action="turn_left", frames=frames, steps=steps, seed=0)
        piped.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "inference",
                "generate",
                "--model",
                str(release),
                "--map-seed",
                "3",
                "--action",
                "turn_left",
                "--frames",
                str(frames),
                "--steps",
                str(steps),
                "--out",
                out,
                "--quiet",
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        cli = time.perf_counter() - start
    base = statistics.median(direct)
    print(
        f"\n## generate: {frames} frames x {steps} steps, {pipe.provenance.parameters / 1e6:.2f} M params, "
        f"sensor {pipe.sensor.name} {pipe.sensor.height}x{pipe.sensor.width}, CPU threads {torch.get_num_threads()}\n"
    )
    print("| path | seconds | frames/s | ÷ rollout direct |")
    print("|---|---|---|---|")
    for name, seconds in (
        ("rollout() direct (baseline)", base),
        ("pipe.generate_world(map=World)", statistics.median(piped)),
        ("python -m inference generate (process: imports, load, map, write)", cli),
    ):
        print(f"| {name} | {seconds:.2f} | {frames / seconds:.2f} | {seconds / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        forms, _ = sources(Path(tmp), args.model)
        bench_ready(forms, args.repeats)
        bench_generate(Path(forms["release folder"][0]), args.frames, args.steps, args.repeats)


if __name__ == "__main__":
    main()

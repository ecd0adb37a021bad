"""World-generation speed: frames/s against sampler steps, end to end (condition, sampling, reprojection, cache).

Two references are printed beside each figure: the product target (2 frames/s at the default steps on the
2-core CPU) and the bare network, timed in the same run (steps x one forward pass), which shows how much of
a frame is spent outside the network.

    python -m bench.generate_bench [--frames 8] [--steps 1 2 4 8 16] [--model SRC] [--device cpu] [--threads N]

Without --model it uses the trained release in weights/default when it and the loader exist, else a
randomly initialised model of the default config (same cost per frame; only the point count differs).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from inference import load_pipeline
from inference.loader import DEFAULT_MODEL, WEIGHTS_NAME
from inference.network import IMAGE_CHANNELS, WorldModel, WorldModelConfig
from inference.rollout import frame_times, rollout
from lidar.sim import make_world, plan_drive

TARGET_FPS = 2.0


def load_model(source: str | None, device: str) -> tuple[WorldModel, str]:
    """The released model through the loader when there is one, else a random default model (same cost per
    frame; only the point count differs)."""
    if source is None and not (DEFAULT_MODEL / WEIGHTS_NAME).exists():
        torch.manual_seed(0)
        return WorldModel(WorldModelConfig()).to(device).eval(), "random init (default config)"
    pipe = load_pipeline(source, device=device, dtype=torch.float32)
    return pipe.model, f"{pipe.provenance.source} ({pipe.provenance.weights} weights)"


def time_forward(model: WorldModel, repeats: int = 10) -> float:
    """Median seconds of one batch-1 forward pass as the sampler runs it (the condition prepared once, outside
    the timing): the irreducible cost of a sampler step."""
    config, param = model.config, next(model.parameters())
    h, w = config.sensor_obj.shape
    x = torch.randn(1, IMAGE_CHANNELS, h, w, device=param.device)
    cond = torch.randn(1, config.cond_channels, h, w, device=param.device)
    t = torch.full((1,), 0.5, device=param.device)
    times = []
    with torch.inference_mode():
        cond = model.prepare(cond)
        for _ in range(repeats + 2):
            start = time.perf_counter()
            model(x, t, cond)
            if param.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=8, help="frames per rollout (after one warm-up frame)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--model", default=None, help="a model source for inference.load_pipeline")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--map-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, origin = load_model(args.model, args.device)
    world = make_world(args.map_seed, "urban")
    poses = plan_drive(world, "straight", args.frames + 1, seed=0, mount_height=model.sensor.mount_height)
    times = frame_times(len(poses), None, world.time)  # 10 Hz: the actors are where each frame sees them
    scene = {"map_source": world.hdmap, "layout": world.boxes}  # the full v2 condition: map + actor layout
    rollout(model, poses[:1], **scene, times=times[:1], steps=1, seed=0)  # warm-up: allocator, kernels
    forward_s = time_forward(model)
    default_steps = model.config.default_steps

    print(
        f"model: {origin}; {model.num_parameters() / 1e6:.2f} M params; sensor {model.sensor.name} "
        f"{model.sensor.shape[0]}x{model.sensor.shape[1]}; device {args.device}; torch threads "
        f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"rollout of {args.frames} frames on map seed {args.map_seed} (map + layout ray-casts, condition, sampling, "
        f"decode, unproject, cache update); one forward pass = {1000 * forward_s:.1f} ms\n"
    )
    print(
        "| steps | s/frame | frames/s | vs 2 fps target | bare network frames/s | end-to-end / bare | points/frame |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for steps in args.steps:
        result = rollout(model, poses[1:], **scene, times=times[1:], steps=steps, seed=0)
        fps = result.timings["frames_per_second"]
        bare_fps = 1.0 / (steps * forward_s)
        points = np.mean([len(f.points) for f in result.frames])
        mark = " (default)" if steps == default_steps else ""
        print(
            f"| {steps}{mark} | {1.0 / fps:.3f} | {fps:.2f} | {fps / TARGET_FPS:.2f}x | {bare_fps:.2f} | "
            f"{fps / bare_fps:.2f} | {points:.0f} |"
        )


if __name__ == "__main__":
    main()

"""Train the LiDAR world model: `torchrun --nproc_per_node N -m training.train --config C --job-dir D`.

One loop you can read in one sitting (nanoGPT). FSDP2 shards the network across ranks (gloo on CPU, nccl on
GPU; world size 1 too), AdamW follows a linear warm-up and a cosine decay, an EMA copy of the weights is
what gets released, and `checkpointing.FSDPCheckpointer` makes the job resumable: launched again with the
same job dir after a kill, it picks up from `checkpoints/latest_checkpoint.txt` by itself.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from checkpointing import CallBackGroup, CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA, layout
from inference.flow import flow_matching_loss
from inference.loader import load_model
from inference.network import ARCHITECTURE_FIELDS, WorldModel, WorldModelConfig
from training.config import AUTO_LAYOUT, TrainConfig
from training.config_record import ConfigChangeError, ConfigRecorder, check_resume_config, record_config
from training.data import make_loader
from training.progress import Progress, hardware_description

logger = logging.getLogger(__name__)


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the peak LR at a step: linear warm-up, then cosine down to `min_lr_ratio`."""

    def schedule(step: int) -> float:
        if step < cfg.warmup_iters:
            return (step + 1) / cfg.warmup_iters
        progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """Both modules are sharded alike, so each rank blends only its own shards; no communication."""
    ema_params = [p for p in ema.parameters()]
    params = [p.detach() for p in model.parameters()]
    torch._foreach_lerp_(ema_params, params, 1.0 - decay)


#: Architecture fields an `init_from` source may differ in: the bottleneck attention is a residual branch, the
#: keep gate one more output of the head, and the gap fill moves the residual base at a few pixels (fine-tuning
#: relearns those). What the source lacks keeps the network's own initialisation (zero for the attention's
#: output and the head, so both start as no-ops); what it has beyond the network is left out.
TRANSFERABLE_FIELDS = ("bottleneck_attention", "keep_gate", "gap_fill")


def load_init_weights(model: WorldModel, source: str) -> None:
    """Start from a trained model's weights (fine-tuning); a resume then overwrites them with its checkpoint.

    The source's own config must describe the same network and sensor as the job's, or its weights would
    mean something else here, except for `TRANSFERABLE_FIELDS`.
    """
    init, provenance = load_model(source, device="cpu", dtype=torch.float32)
    mine, theirs = model.config.to_dict(), init.config.to_dict()
    differ = sorted(k for k in ARCHITECTURE_FIELDS if mine[k] != theirs[k] and k not in TRANSFERABLE_FIELDS)
    if differ:
        raise ValueError(f"init_from {source!r}: its network differs from config.model in {differ}; "
                         f"expected the same architecture and sensor (only {list(TRANSFERABLE_FIELDS)} may differ)")
    own, given, resized = model.state_dict(), init.state_dict(), []
    for name, value in given.items():
        if name not in own:
            continue
        if own[name].shape == value.shape:
            own[name] = value
        else:  # the head with or without the keep gate: the outputs both have are the source's
            shared = min(own[name].shape[0], value.shape[0])
            own[name][:shared] = value[:shared]
            resized.append(name)
    model.load_state_dict(own)
    dropped, fresh = sorted(set(given) - set(own)), sorted(set(own) - set(given))
    logger.info("initialised from %s (%s weights, iteration %s)%s%s%s", provenance.source, provenance.weights,
                provenance.iteration, f"; not used: {dropped}" if dropped else "",
                f"; new: {fresh}" if fresh else "", f"; first outputs only: {resized}" if resized else "")


def checkpoint_layout(cfg: TrainConfig, world_size: int) -> str:
    """The layout saves use: the config's, or for "auto" the sharded one above one rank (every rank writes its
    own shards instead of rank 0 gathering and writing the whole state) and the full one on a single rank."""
    if cfg.checkpoint_layout != AUTO_LAYOUT:
        return cfg.checkpoint_layout
    return layout.SHARDED if world_size > 1 else layout.FULL


def setup_logging(job_dir: Path, rank: int) -> None:
    """Rank 0 logs to stdout and `<job>/train.log`; other ranks only report warnings."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(job_dir / "train.log"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun group (or make a one-process group when launched with plain python)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), device


def train(cfg: TrainConfig, job_dir: Path, max_minutes: float | None = None, command: str = "",
          allow_config_change: bool = False) -> int:
    """Run (or resume) the job; return the iteration it stopped at.

    A resume under a config other than its checkpoint's raises ConfigChangeError before any process group
    exists, unless `allow_config_change` (training.config_record).
    """
    t_start = time.monotonic()
    resumed_at, config_changes = check_resume_config(job_dir, cfg, allow_config_change)
    rank, world_size, device = setup_distributed()
    job_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(job_dir, rank)
    if device.type == "cpu":
        torch.set_num_threads(cfg.torch_threads)
    if rank == 0:
        record_config(job_dir, cfg, resumed_at, config_changes)
    logger.info("job %s: world size %d on %s; resolved config in %s", job_dir, world_size, device,
                job_dir / "config.json")

    # 1. Model and its EMA twin, initialised identically on every rank, then sharded alike.
    torch.manual_seed(cfg.seed)
    model_cfg = WorldModelConfig.from_dict(cfg.model)
    model = WorldModel(model_cfg).to(device)
    if cfg.init_from and not resumed_at:  # a resume loads its own checkpoint: no second download
        load_init_weights(model, cfg.init_from)
    ema = WorldModel(model_cfg).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %.2fM parameters", n_params / 1e6)
    fully_shard(model)
    fully_shard(ema)

    # 2. Optimiser, schedule, checkpointer; resume if the job dir has a checkpoint.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ckpt_cfg = CheckpointConfig(
        save_iter=cfg.save_iter, keep_last_checkpoints=cfg.keep_last_checkpoints, save_at_iters=cfg.save_at_iters,
        state_layout=checkpoint_layout(cfg, world_size),
    )
    logger.info("checkpoints: %s layout (a resume reads either)", ckpt_cfg.state_layout)
    checkpointer = FSDPCheckpointer(ckpt_cfg, JobConfig(path_local=str(job_dir)), CallBackGroup([ConfigRecorder(cfg)]))
    state = ModelWithEMA(model, ema)  # the EMA is saved beside the model and is what a release ships
    iteration = checkpointer.load(state, optimizer, scheduler, None)
    logger.info("starting at iteration %d of %d", iteration, cfg.max_iters)
    progress = Progress(job_dir, command, hardware_description(device, world_size), iteration) if rank == 0 else None

    # 3. The loop. Batches are a pure function of (seed, iteration, rank), so a resume sees the same data.
    loader = make_loader(cfg, rank=rank, start_iter=iteration)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    noise_gen = torch.Generator(device=device)
    model.train()
    t_log, samples_since_log, loss_sum = time.monotonic(), 0, 0.0
    for batch in loader:
        noise_gen.manual_seed(cfg.seed * 1_000_003 + iteration * 1009 + rank)
        x0, cond = batch["x"].to(device, non_blocking=True), batch["cond"].to(device, non_blocking=True)
        with autocast:
            loss = flow_matching_loss(model, x0, cond, generator=noise_gen, seen=batch["seen"].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        iteration += 1
        update_ema(ema, model, 0.0 if iteration <= cfg.ema_start_iter else cfg.ema_decay)

        loss_sum += loss.item()
        samples_since_log += x0.shape[0] * world_size
        if iteration % cfg.log_iter == 0 or iteration == cfg.max_iters:
            elapsed = time.monotonic() - t_log
            n_steps = (iteration - 1) % cfg.log_iter + 1
            logger.info(
                "iter %d loss %.4f lr %.2e %.1f samples/s",
                iteration, loss_sum / n_steps, scheduler.get_last_lr()[0], samples_since_log / max(elapsed, 1e-9),
            )
            if progress is not None:
                progress.record(iteration, loss_sum / n_steps, samples_since_log / max(elapsed, 1e-9))
            t_log, samples_since_log, loss_sum = time.monotonic(), 0, 0.0

        # Every rank must agree to stop at the same step, or the collective save would hang.
        out_of_time = max_minutes is not None and (time.monotonic() - t_start) / 60.0 >= max_minutes
        stop = torch.tensor([float(out_of_time)], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        done = iteration >= cfg.max_iters or bool(stop.item())
        if ckpt_cfg.should_save(iteration) or done:
            checkpointer.save(state, optimizer, scheduler, None, iteration, async_saving=not done)
        if done:
            break
    checkpointer.finalize()
    if progress is not None:
        progress.record(iteration)
    if iteration < cfg.max_iters:
        logger.info("stopped at iteration %d: --max-minutes %.1f reached; launch again to resume", iteration, max_minutes)
    else:
        logger.info("finished %d iterations in %.1f min", iteration, (time.monotonic() - t_start) / 60.0)
    dist.barrier()
    dist.destroy_process_group()
    return iteration


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="training config JSON (see training/configs/)")
    parser.add_argument("--job-dir", required=True, help="folder for checkpoints, logs and the resolved config")
    parser.add_argument("--max-minutes", type=float, default=None, help="save and exit cleanly after this long")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config differs from the checkpoint's (e.g. a longer schedule)")
    args = parser.parse_args(argv)
    if args.max_minutes is not None and args.max_minutes <= 0:
        parser.error(f"--max-minutes must be positive, got {args.max_minutes}")
    cfg = TrainConfig.from_json(args.config)
    world_size = os.environ.get("WORLD_SIZE", "1")
    command = f"torchrun --nproc_per_node {world_size} -m training.train --config {args.config} --job-dir {args.job_dir}"
    if args.max_minutes is not None:
        command += f" --max-minutes {args.max_minutes:g}"
    if args.allow_config_change:
        command += " --allow-config-change"
    try:
        train(cfg, Path(args.job_dir), args.max_minutes, command, args.allow_config_change)
    except ConfigChangeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

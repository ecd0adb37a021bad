"""FSDP1 in the full layout, on a GPU only: on CPU/gloo, torch 2.13's FSDP1 crashes while gathering
optimizer state, so FSDP2 carries the CPU tests (test_checkpointing_dist.py); FSDP1's sharded state, which
gathers nothing, is tested on CPU (test_checkpointing_sharded.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="FSDP1 checkpointing is tested on a CUDA device only"
    ),
]

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fsdp1_training(seed: int):
    torch.manual_seed(seed)
    model = FSDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)).cuda(), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def test_fsdp1_save_and_resume_restores_weights_optimizer_and_scheduler(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, optimizer, scheduler = _fsdp1_training(0)
        for _ in range(3):
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        job = JobConfig(path_local=str(tmp_path / "job"))
        ckpt = FSDPCheckpointer(CheckpointConfig(keep_last_checkpoints=2), job)
        ckpt.save(model, optimizer, scheduler, None, 3, async_saving=True)
        ckpt.finalize()

        model2, optimizer2, scheduler2 = _fsdp1_training(1)
        assert FSDPCheckpointer(CheckpointConfig(), job).load(model2, optimizer2, scheduler2) == 3
        saved, loaded = get_model_state_dict(model, options=FULL), get_model_state_dict(model2, options=FULL)
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
        saved_opt = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
        loaded_opt = get_optimizer_state_dict(model2, optimizer2, options=FULL)["state"]
        assert all(torch.equal(saved_opt[k]["exp_avg"], loaded_opt[k]["exp_avg"]) for k in saved_opt)
        assert scheduler2.state_dict() == scheduler.state_dict()
    finally:
        dist.destroy_process_group()

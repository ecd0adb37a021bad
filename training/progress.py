"""What a job has done so far, across every launch: the facts a model card states.

A job is killed and relaunched, so neither one process's clock nor one log tells its wall time or its
loss curve. Rank 0 keeps `<job>/progress.json` (written atomically at every log step): one entry per launch
(command, hardware, start and end, iterations) and the loss curve, cut back to the resumed iteration on
each launch so repeated steps are not counted twice.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from checkpointing import atomic_write_text

PROGRESS_NAME = "progress.json"


def hardware_description(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        return f"{world_size} x {torch.cuda.get_device_name(device)}"
    return (f"{world_size} CPU process(es) x {torch.get_num_threads()} torch thread(s) on {_cpu_model()} "
            f"({os.cpu_count()} logical CPUs, shared)")


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class Progress:
    """Launch records and the loss curve of one job dir; `record` is cheap enough for every log step."""

    def __init__(self, job_dir: Path, command: str, hardware: str, start_iter: int) -> None:
        self.path = job_dir / PROGRESS_NAME
        self.data: dict[str, Any] = read_progress(job_dir)
        self.data["losses"] = [p for p in self.data["losses"] if p[0] <= start_iter]
        now = time.time()
        self.launch = {"command": command, "hardware": hardware, "start_time": now, "end_time": now,
                       "start_iter": start_iter, "end_iter": start_iter, "torch": torch.__version__}
        self.data["launches"].append(self.launch)
        self.save()

    def record(self, iteration: int, loss: float | None = None, samples_per_s: float | None = None) -> None:
        self.launch["end_time"] = time.time()
        self.launch["end_iter"] = iteration
        if samples_per_s is not None:
            self.launch["samples_per_s"] = samples_per_s
        if loss is not None:
            self.data["losses"].append([iteration, loss])
        self.save()

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data) + "\n")


def read_progress(job_dir: Path) -> dict[str, Any]:
    path = Path(job_dir) / PROGRESS_NAME
    if not path.is_file():
        return {"launches": [], "losses": []}
    return json.loads(path.read_text())


def wall_seconds(progress: dict[str, Any]) -> float:
    """Time spent training, summed over launches (the gaps between a kill and a relaunch excluded)."""
    return sum(launch["end_time"] - launch["start_time"] for launch in progress["launches"])

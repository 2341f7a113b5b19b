"""The run record (DESIGN.md: ``execute --out DIR`` writes ``DIR/run.json``) and what it summarises.

Contract keys: plan, world_size, steps, losses (global mean per step), step_time_s (per step),
peak_memory_gib (per rank; null where the device cannot tell), backend, device, restarts (how often
torchrun restarted the job after a failure) and resumed_from_step (the checkpoint step the last
attempt started from; null when it started from step 0). ``losses`` and ``step_time_s`` cover every
step of the run, those before a resume included (they travel in the checkpoint). A few more keys help
calibration: the mean step time without the first (warm-up) step, the throughput it implies, the
plan's prediction beside it, and each rank's optimizer state (what ZeRO shards); ``data`` names the
token file (null: the bundled corpus). After a resume that mean covers only the steps this attempt ran (the
checkpoint's steps may have run another plan, another batch: execute --resume under a new plan), again without
its first.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import dataclass

import torch

from .job import Job


def peak_memory_gib(device: torch.device) -> float | None:
    """This process's peak memory: CUDA's allocator peak, or the peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


@dataclass
class RunSummary:
    job: Job
    losses: list[float]
    step_time_s: list[float]
    peak_memory_gib: list[float | None]
    optimizer_state_gib: list[float]
    backend: str
    device: str
    nnodes: int
    restarts: int = 0
    resumed_from_step: int | None = None
    data: dict | None = None

    @property
    def timed_steps(self) -> tuple[int, int]:
        """(first, last) step numbers, from 1, that the mean step time covers: this attempt's, less its first (the
        warm-up) when it ran more than one."""
        start = self.resumed_from_step or 0
        first = start + 1 if len(self.step_time_s) - start <= 1 else start + 2
        return first, len(self.step_time_s)

    @property
    def mean_step_time_s(self) -> float:
        first, last = self.timed_steps
        timed = self.step_time_s[first - 1:last]
        return sum(timed) / len(timed)

    @property
    def samples_per_s(self) -> float:
        return self.job.layout.global_batch / self.mean_step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.job.tokens_per_sample

    @property
    def predicted_iteration_time_s(self) -> float | None:
        pred = self.job.plan.prediction or {}
        value = pred.get("iteration_time_s")
        return float(value) if isinstance(value, int | float) else None

    def to_dict(self) -> dict:
        return {
            "plan": self.job.plan.to_dict(),
            "world_size": self.job.world_size,
            "steps": len(self.losses),
            "losses": self.losses,
            "step_time_s": self.step_time_s,
            "peak_memory_gib": self.peak_memory_gib,
            "optimizer_state_gib": self.optimizer_state_gib,
            "backend": self.backend,
            "device": self.device,
            "nnodes": self.nnodes,
            "restarts": self.restarts,
            "resumed_from_step": self.resumed_from_step,
            "data": self.data,
            "mean_step_time_s": self.mean_step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "predicted_iteration_time_s": self.predicted_iteration_time_s,
            "torch_version": torch.__version__,
        }

    def write(self, folder: str) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "run.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path

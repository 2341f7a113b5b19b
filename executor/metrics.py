"""Per-step metrics of a run, written while it trains: ``metrics.jsonl`` beside ``run.json``, and
TensorBoard event files (``tensorboard/``) when the ``tensorboard`` package is installed.

One JSON object per line and step, flushed as soon as the step ends (``tail -f`` works)::

    {"step": 12, "loss": 6.91, "step_time_s": 0.41, "tokens_per_s": 19980, "mfu": 0.012,
     "peak_memory_gib": 1.3, "restart": 0}

``mfu`` is the model FLOPs of a step (forward and backward once, as the planner counts them:
3 x the profiler's forward FLOPs per sample x the global batch) over the step time and the plan's
GPUs' dense peak for the dtype trained in (null when the cluster spec does not give one);
``peak_memory_gib`` is rank 0's. A run resumed from step N (``--resume``, or a restart) keeps the
lines of steps 1..N and appends from N+1, so the file has one line per step of the run.
"""

from __future__ import annotations

import json
import os

import torch

from .job import Job
from .record import peak_memory_gib

METRICS_FILE = "metrics.jsonl"


def model_flops_per_step(job: Job) -> float | None:
    """Model FLOPs of one training step (forward + backward of the global batch), or None if unknown:
    from the plan's prediction when it has one (the planner's own count), else from a meta profile."""
    pred = job.plan.prediction or {}
    tflops, seconds = pred.get("model_tflops_per_gpu"), pred.get("iteration_time_s")
    if isinstance(tflops, int | float) and isinstance(seconds, int | float) and tflops > 0:
        return tflops * 1e12 * seconds * job.layout.num_gpus
    try:
        from paraplan.profiler import profile_model

        prof = profile_model(job.spec, "meta", micro_batch=1, seq_length=job.seq_length)
    except Exception:  # noqa: BLE001 - the metric is optional; training goes on without it
        return None
    return 3.0 * prof.total_fwd_flops * job.layout.global_batch


def peak_flops_total(job: Job, device: torch.device) -> float | None:
    """Dense peak FLOP/s of the plan's trainer GPUs together, for the dtype the executor trains in."""
    from paraplan.hardware_specs import HardwareSpecError

    from .machine import plan_cluster

    cluster = plan_cluster(job.plan)
    if cluster is None:
        return None
    dtype = "fp32" if device.type == "cpu" else job.layout.dtype
    from paraplan.planner.cpu_share import CpuShare
    from paraplan.planner.placement import layout_placement

    try:  # on a CPU a rank's share of this machine's cores, as the prediction's MFU counts it
        peak = CpuShare(cluster).rank_peak_flops(dtype, layout_placement(cluster, job.layout).gpus_per_node_busy)
    except HardwareSpecError:
        return None
    return peak * job.layout.num_gpus


class MetricsLog:
    """Rank 0's metrics writer (a no-op without an output folder)."""

    def __init__(self, job: Job, out: str | None, device: torch.device, start_step: int = 0, restart: int = 0):
        self.job, self.device, self.restart = job, device, restart
        self.file = None
        self.tb = None
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, METRICS_FILE)
        kept = _lines_up_to(path, start_step)
        self.file = open(path, "w")  # noqa: SIM115 - held open for the whole run
        self.file.writelines(kept)
        self.file.flush()
        self.flops = model_flops_per_step(job)
        self.peak = peak_flops_total(job, device)
        self.tokens = job.layout.global_batch * job.tokens_per_sample
        self.tb = _tensorboard(os.path.join(out, "tensorboard"))

    def log(self, step: int, loss: float, time_s: float) -> None:
        """Step ``step`` (0-based) ended with the global mean ``loss`` after ``time_s`` seconds."""
        if self.file is None:
            return
        mfu = self.flops / (time_s * self.peak) if self.flops and self.peak and time_s > 0 else None
        row = {"step": step + 1, "loss": loss, "step_time_s": time_s,
               "tokens_per_s": self.tokens / time_s if time_s > 0 else None, "mfu": mfu,
               "peak_memory_gib": peak_memory_gib(self.device), "restart": self.restart}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key in ("loss", "step_time_s", "tokens_per_s", "mfu", "peak_memory_gib"):
                if row[key] is not None:
                    self.tb.add_scalar(key, row[key], step + 1)
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _lines_up_to(path: str, step: int) -> list[str]:
    """The lines of an existing metrics file for steps 1..``step`` (those a resumed run keeps)."""
    if step <= 0 or not os.path.exists(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    return kept


def _tensorboard(folder: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=folder)

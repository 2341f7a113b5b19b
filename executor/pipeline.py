"""Pipeline parallelism with torch.distributed.pipelining: one PipelineStage per local chunk and the
plan's schedule over the plan's micro-batches.

Schedules: ``gpipe`` -> ScheduleGPipe, ``1f1b`` -> Schedule1F1B (one stage per rank),
``interleaved-1f1b`` -> ScheduleInterleaved1F1B (``virtual_stages`` chunks per rank, round-robin),
``zb-v`` -> ScheduleZBVZeroBubble (two chunks per rank in a V, backward split into input and weight
gradients). The loss function returns each micro-batch's mean loss and the schedule divides the
accumulated gradients by the number of micro-batches (``scale_grads=True``), so a step's gradient is
that of the mean loss over the replica's whole batch, as without a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble}


def build_schedule(modules: list[tuple[int, nn.Module]], num_stages: int, schedule: str, num_micro_batches: int,
                   pp_mesh: DeviceMesh, device: torch.device, loss_fn: Callable):
    """The schedule that runs this rank's ``(stage index, module)`` pairs (ascending stage order)."""
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in modules]
    if schedule in SINGLE:
        assert len(stages) == 1, f"{schedule} runs one stage per rank"
        return SINGLE[schedule](stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    return MULTI[schedule](stages, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=True)

"""What one rank trains, whichever way it was built (parallelize.py for all-reduce data, tensor and
pipeline parallelism; ps_worker.py for a parameter-server worker; hybrid.py for a class-sharded
classifier): its chunks, how to run them, how to sync and update them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .chunks import Chunk
from .job import Job


class GradSync(Protocol):
    """Runs after a step's backward, before the update (tied copies, a sharded classifier's replicas)."""

    def sync_grads(self) -> None: ...


@dataclass
class RankModel:
    job: Job
    rank: int
    device: torch.device
    mesh: object | None  # DeviceMesh (None for a parameter-server worker)
    chunks: list[Chunk]
    trained: list[nn.Module]  # the chunks' modules as wrapped for data parallelism
    optimizer: object  # torch.optim.Optimizer, ShardedOptimizer or PSClient: step() and zero_grad()
    schedule: object | None  # a torch pipelining schedule when pp > 1
    grad_syncs: list[GradSync] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    # (outputs, targets) -> the micro-batch's mean loss; None: the family's loss (models.loss_function)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    loss_group: object | None = None  # the ranks whose loss shares make the global mean (None: all)
    deferred_loss: bool = False  # reduce the losses once after the last step (async parameter servers)

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.job.dims.coords(self.rank)

    @property
    def has_first_stage(self) -> bool:
        return any(c.stage == 0 for c in self.chunks)

    @property
    def has_last_stage(self) -> bool:
        return any(c.stage == self.job.num_stages - 1 for c in self.chunks)


def mixed_precision_dtype(job: Job, device_type: str) -> torch.dtype | None:
    """bf16 mixed precision (FSDP2's policy, or autocast) on GPUs when the plan trains in bf16; fp32 on CPU.

    ``device_type`` is the kind of device the plan runs on: the dry run passes "cuda" while its fake
    tensors live on the CPU, so that it traces what a GPU run allocates."""
    if device_type == "cuda" and job.layout.dtype == "bf16":
        return torch.bfloat16
    return None

"""Build one rank's share of a plan, in one fixed order (torchtitan's parallelize, one function per
dimension):

1. DeviceMesh ("pp", "dp", "tp") from the plan's degrees;
2. the model on the meta device, cut to this rank's stage(s) by the plan's module lists;
3. tensor parallelism (still on meta: shards are allocated, never the full weights);
4. ``to_empty`` + reference initialisation: every weight drawn in full from (seed, FQN), each rank
   keeping its shard, so the values do not depend on the layout;
5. activation checkpointing per the plan (per stage, when the plan chose it per stage);
6. data parallelism by ZeRO stage (DDP / replicate, or FSDP2);
7. the pipeline schedule over the local chunks (pp > 1);
8. AdamW (ZeRO-1: sharded over the data-parallel ranks), and the tied-weight gradient sync.

TP is applied before the weights are materialised (torchtitan's order) so that no rank ever holds a
full copy of a sharded weight; the values are exactly those reference initialisation gives the
whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from paraplan.models import loss_function
from paraplan.planner.schedules import stage_rank

from .checkpointing import apply_ac
from .chunks import Chunk, build_chunks, materialize
from .data_parallel import apply_dp
from .job import Job
from .optim import ShardedOptimizer, adamw
from .pipeline import build_schedule
from .tensor_parallel import apply_tp
from .tied import TiedSync, build_tied_syncs


@dataclass
class RankModel:
    """What one rank trains: its chunks, how to run them and how to update them."""

    job: Job
    rank: int
    device: torch.device
    mesh: object  # DeviceMesh
    chunks: list[Chunk]
    trained: list[nn.Module]  # the chunks' modules as wrapped for data parallelism
    optimizer: object  # torch.optim.Optimizer or ShardedOptimizer
    schedule: object | None  # a torch pipelining schedule when pp > 1
    tied: list[TiedSync] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.job.dims.coords(self.rank)

    @property
    def has_first_stage(self) -> bool:
        return any(c.stage == 0 for c in self.chunks)

    @property
    def has_last_stage(self) -> bool:
        return any(c.stage == self.job.num_stages - 1 for c in self.chunks)


def mixed_precision_dtype(job: Job, device: torch.device) -> torch.dtype | None:
    """bf16 autocast/FSDP mixed precision on GPUs when the plan trains in bf16; fp32 on CPU."""
    if device.type == "cuda" and job.layout.dtype == "bf16":
        return torch.bfloat16
    return None


def build_rank_model(job: Job, rank: int, device: torch.device, timeout: timedelta | None,
                     on_phase=lambda phase: None) -> RankModel:
    lay, dims, spec = job.layout, job.dims, job.spec
    on_phase("mesh")
    mesh = dims.build_mesh(device.type, timeout)
    pp_rank, _, _ = dims.coords(rank)
    mp_dtype = mixed_precision_dtype(job, device)

    on_phase("model")
    chunks = build_chunks(spec, job.plan.stages, lay.schedule, pp_rank, lay.pp)
    trained = []
    for chunk in chunks:
        if lay.tp > 1:
            apply_tp(chunk.module, spec, mesh["tp"], lay.sequence_parallel)
        materialize(chunk.module, spec, job.plan.seed, device)
        apply_ac(chunk.module, job.recompute_of(chunk.stage))
        trained.append(apply_dp(chunk.module, lay.zero, mesh["dp"], device, mp_dtype, pipelined=lay.pp > 1))

    on_phase("optimizer")
    params = list({id(p): p for m in trained for p in m.parameters()}.values())
    if lay.zero == 1 and lay.dp > 1:
        optimizer = ShardedOptimizer(params, mesh["dp"].get_group())
    else:
        optimizer = adamw(params)
    tied = build_tied_syncs(chunks, spec, dims, job.plan.stages, lambda s: stage_rank(lay.schedule, s, lay.pp),
                            rank, timeout)

    schedule = None
    if lay.pp > 1:
        on_phase("pipeline")
        schedule = build_schedule([(c.stage, m) for c, m in zip(chunks, trained, strict=True)], job.num_stages,
                                  lay.schedule, lay.num_micro_batches, mesh["pp"], device, loss_function(spec))
    autocast = mp_dtype if mp_dtype is not None and not _all_fsdp(trained) else None
    return RankModel(job=job, rank=rank, device=device, mesh=mesh, chunks=chunks, trained=trained,
                     optimizer=optimizer, schedule=schedule, tied=tied, autocast_dtype=autocast)


def _all_fsdp(modules: list[nn.Module]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return all(isinstance(m, FSDPModule) for m in modules)

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

from datetime import timedelta

import torch
from torch import nn

from paraplan.models import loss_function
from paraplan.planner.schedules import stage_rank

from .checkpointing import apply_ac
from .chunks import build_chunks, materialize
from .data_parallel import apply_dp
from .job import Job
from .optim import ShardedOptimizer, adamw
from .pipeline import build_schedule
from .rank_model import RankModel, mixed_precision_dtype
from .tensor_parallel import apply_tp
from .tied import build_tied_syncs


def build_rank_model(job: Job, rank: int, device: torch.device, timeout: timedelta | None,
                     on_phase=lambda phase: None) -> RankModel:
    lay, dims, spec = job.layout, job.dims, job.spec
    if lay.dp_mode == "ps":
        from .ps_worker import build_ps_worker

        return build_ps_worker(job, rank, device, timeout, on_phase)
    if lay.head_parallel > 1:
        from .hybrid import build_hybrid_rank_model

        return build_hybrid_rank_model(job, rank, device, timeout, on_phase)
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
                     optimizer=optimizer, schedule=schedule, grad_syncs=list(tied), autocast_dtype=autocast)


def _all_fsdp(modules: list[nn.Module]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return all(isinstance(m, FSDPModule) for m in modules)

"""Build one rank's share of a plan, in one fixed order (torchtitan's parallelize, one function per
dimension):

1. DeviceMesh ("pp", "dp", "tp") from the plan's degrees;
2. the model on the meta device, cut to this rank's stage(s) by the plan's module lists;
3. tensor parallelism (on meta);
4. activation checkpointing per the plan (per stage, when the plan chose it per stage);
5. data parallelism by ZeRO stage with FSDP2 (still on meta: weights are sharded before they exist);
6. ``to_empty`` + reference initialisation of each rank's shards: every weight drawn in full from
   (seed, FQN) one at a time, each rank keeping its shard, so values do not depend on the layout and
   no rank ever holds a whole chunk it is meant to shard (a 70B ZeRO-3 plan can start);
7. DDP, for fp32 training without tensor or pipeline parallelism (it needs real weights);
8. the pipeline schedule over the local chunks (pp > 1);
9. AdamW (ZeRO-1: sharded over the data-parallel ranks), and the tied-weight gradient sync.

Steps 6 onwards allocate memory; ``allocate`` wraps them, so the dry run (dry_run.py) can run them
under a fake tensor mode on a fake process group while steps 1-5 stay the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta

import torch

from paraplan.models import loss_function
from paraplan.planner.schedules import stage_rank

from .checkpointing import apply_ac
from .chunks import build_chunks, materialize
from .data_parallel import apply_ddp, shard_dp, uses_ddp
from .job import Job
from .optim import ShardedOptimizer, adamw
from .pipeline import build_schedule
from .rank_model import RankModel, mixed_precision_dtype
from .tensor_parallel import apply_tp, tp_loss
from .tied import build_tied_syncs


def build_rank_model(job: Job, rank: int, device: torch.device, timeout: timedelta | None,
                     on_phase=lambda phase: None, mesh=None, device_type: str | None = None,
                     allocate: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> RankModel:
    """This rank's model, optimizer and schedule. ``mesh``: a mesh built already (the dry run builds it
    outside its fake tensor mode); ``device_type``: the device kind the plan runs on, when it differs
    from ``device`` (the dry run traces a GPU run on CPU fake tensors)."""
    lay, dims, spec = job.layout, job.dims, job.spec
    if lay.dp_mode == "ps":
        from .ps_worker import build_ps_worker

        return build_ps_worker(job, rank, device, timeout, on_phase)
    if lay.head_parallel > 1:
        from .hybrid import build_hybrid_rank_model

        return build_hybrid_rank_model(job, rank, device, timeout, on_phase)
    on_phase("mesh")
    if mesh is None:
        mesh = dims.build_mesh(device.type, timeout)
    pp_rank, _, _ = dims.coords(rank)
    mp_dtype = mixed_precision_dtype(job, device_type or device.type)
    pipelined, tensor_parallel = lay.pp > 1, lay.tp > 1
    ddp = uses_ddp(lay.zero, lay.dp, mp_dtype, pipelined, tensor_parallel)

    on_phase("model")
    chunks = build_chunks(spec, job.plan.stages, lay.schedule, pp_rank, lay.pp)
    trained = []
    for chunk in chunks:  # on the meta device: nothing allocated yet
        if tensor_parallel:
            apply_tp(chunk.module, spec, mesh["tp"], lay.sequence_parallel)
        apply_ac(chunk.module, job.recompute_of(chunk.stage))
        trained.append(shard_dp(chunk.module, lay.zero, mesh["dp"], mp_dtype, pipelined, tensor_parallel))

    with allocate():
        for chunk in chunks:
            materialize(chunk.module, spec, job.plan.seed, device)
        if ddp:
            trained = [apply_ddp(m, mesh["dp"], device) for m in trained]

        on_phase("optimizer")
        params = list({id(p): p for m in trained for p in m.parameters()}.values())
        if lay.zero == 1 and lay.dp > 1:
            optimizer = ShardedOptimizer(params, mesh["dp"].get_group())
        else:
            optimizer = adamw(params)
    tied = build_tied_syncs(chunks, spec, dims, job.plan.stages, lambda s: stage_rank(lay.schedule, s, lay.pp),
                            rank, timeout)
    loss_fn = tp_loss(loss_function(spec)) if tensor_parallel else loss_function(spec)

    schedule = None
    if pipelined:
        on_phase("pipeline")
        with allocate():
            schedule = build_schedule([(c.stage, m) for c, m in zip(chunks, trained, strict=True)], job,
                                      mesh["pp"], device, loss_fn, compute_dtype=mp_dtype or torch.float32)
    autocast = mp_dtype if ddp else None  # FSDP2's policy casts otherwise
    return RankModel(job=job, rank=rank, device=device, mesh=mesh, chunks=chunks, trained=trained,
                     optimizer=optimizer, schedule=schedule, grad_syncs=list(tied), autocast_dtype=autocast,
                     loss_fn=loss_fn)

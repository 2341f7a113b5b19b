"""Build one rank's share of a plan, in one fixed order (torchtitan's parallelize, one function per
dimension):

1. DeviceMesh ("pp", "dp", "cp", "tp") from the plan's degrees, and the expert mesh ("edp", "ep", "etp")
   folded onto the same ranks (parallel_dims.py);
2. the model on the meta device, cut to this rank's stage(s) by the plan's module lists; under context
   parallelism its embedding and attention told which positions this rank holds (context_parallel.py);
3. tensor parallelism (on meta), then the MoE blocks' rules: experts sharded over ep with an all-to-all
   dispatch, each tensor-parallel rank routing its own share of the tokens (expert_parallel.py);
4. activation checkpointing per the plan (per stage, when the plan chose it per stage);
5. data parallelism by ZeRO stage with FSDP2 (still on meta: weights are sharded before they exist),
   expert-parallel experts over the expert-data-parallel mesh;
6. ``to_empty`` + reference initialisation of each rank's shards: every weight drawn in full from
   (seed, FQN) one at a time, each rank keeping its shard, so values do not depend on the layout and
   no rank ever holds a whole chunk it is meant to shard (a 70B ZeRO-3 plan can start);
7. DDP, for fp32 training without tensor or pipeline parallelism (it needs real weights);
8. the pipeline schedule over the local chunks (pp > 1);
9. AdamW (ZeRO-1: sharded over the data-parallel ranks), and the gradient syncs: tied weights, weights
   replicated over tensor-parallel ranks that each saw part of the tokens or heads (summed), expert
   gradients (scaled).

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
from .chunks import build_chunks, canonical_fqn, materialize
from .context_parallel import ContextShard, apply_cp
from .data_parallel import apply_ddp, shard_dp, uses_ddp
from .expert_parallel import (
    ScaleGrads,
    SequenceSplit,
    SumGrads,
    expert_modules,
    shard_experts,
    split_moe_tokens,
    tp_partial_moe_params,
)
from .job import Job
from .optim import ShardedOptimizer, adamw
from .pipeline import build_schedule
from .rank_model import RankModel, mixed_precision_dtype
from .tensor_parallel import apply_tp, tp_loss, tp_partial_params
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
    data_mesh = dims.data_mesh(mesh, timeout)
    expert_mesh = dims.expert_mesh(mesh, timeout) if lay.ep > 1 else None
    pp_rank, _, _ = dims.coords(rank)
    mp_dtype = mixed_precision_dtype(job, device_type or device.type)
    pipelined, tensor_parallel, expert_parallel = lay.pp > 1, lay.tp > 1, lay.ep > 1
    ddp = uses_ddp(lay.zero, data_mesh.size(), mp_dtype, pipelined, tensor_parallel, expert_parallel)

    moe = bool(getattr(spec, "num_experts", 0))
    moe_split = _moe_split(mesh, lay.tp, lay.cp) if moe else None

    on_phase("model")
    chunks = build_chunks(spec, job.plan.stages, lay.schedule, pp_rank, lay.pp)
    shard = ContextShard(mesh["cp"].get_group(), lay.cp, dims.cp_rank(rank), job.seq_length, spec.causal) \
        if lay.cp > 1 else None
    trained, tp_partial = [], []
    for chunk in chunks:  # on the meta device: nothing allocated yet
        if shard is not None:
            apply_cp(chunk.module, shard)
        if tensor_parallel:
            apply_tp(chunk.module, spec, mesh["tp"], lay.sequence_parallel)
            tp_partial += tp_partial_params(chunk.module) + tp_partial_moe_params(chunk.module, expert_parallel)
        if expert_parallel:
            shard_experts(chunk.module, expert_mesh["ep"], dims.expert_coords(rank)[1])
        if moe:
            split_moe_tokens(chunk.module, mesh["tp"], lay.sequence_parallel, moe_split)
        apply_ac(chunk.module, job.recompute_of(chunk.stage))
        trained.append(shard_dp(chunk.module, lay.zero, data_mesh, mp_dtype, pipelined, tensor_parallel,
                                expert_mesh["edp"] if expert_parallel else None))

    with allocate():
        for chunk in chunks:
            materialize(chunk.module, spec, job.plan.seed, device)
        if ddp:
            trained = [apply_ddp(m, data_mesh, device) for m in trained]

        on_phase("optimizer")
        params = list({id(p): p for m in trained for p in m.parameters()}.values())
        experts = [p for c in chunks for m in expert_modules(c.module) for p in m.parameters()] \
            if expert_parallel else []
        if lay.zero == 1 and (data_mesh.size() > 1 or (experts and expert_mesh["edp"].size() > 1)):
            optimizer = ShardedOptimizer(params, data_mesh.get_group(), experts,
                                         expert_mesh["edp"].get_group() if experts else None)
        else:
            optimizer = adamw(params)
    syncs = list(build_tied_syncs(chunks, spec, dims, job.plan.stages,
                                  lambda s: stage_rank(lay.schedule, s, lay.pp), rank, timeout))
    if tp_partial:
        syncs.append(SumGrads(_params_named(chunks, tp_partial), mesh["tp"].get_group()))
    if experts and lay.tp != lay.ep:
        syncs.append(ScaleGrads(experts, lay.tp / lay.ep))
    loss_fn = tp_loss(loss_function(spec)) if tensor_parallel else loss_function(spec)

    schedule = None
    if pipelined:
        on_phase("pipeline")
        with allocate():
            schedule = build_schedule([(c.stage, m) for c, m in zip(chunks, trained, strict=True)], job,
                                      mesh["pp"], device, loss_fn, compute_dtype=mp_dtype or torch.float32)
    autocast = mp_dtype if ddp else None  # FSDP2's policy casts otherwise
    return RankModel(job=job, rank=rank, device=device, mesh=mesh, chunks=chunks, trained=trained,
                     optimizer=optimizer, schedule=schedule, grad_syncs=syncs, autocast_dtype=autocast,
                     loss_fn=loss_fn)


def _moe_split(mesh, tp: int, cp: int) -> SequenceSplit | None:
    """How the MoE blocks' sequences are split over ranks: tensor-parallel token shares (summed gradients)
    within context-parallel chunks (averaged gradients). Collective the first time (flattens cp x tp)."""
    if tp * cp == 1:
        return None
    if cp == 1:
        return SequenceSplit(mesh["tp"].get_group(), tp)
    group = mesh["cp"].get_group() if tp == 1 else mesh["cp", "tp"]._flatten("cp_tp").get_group()
    return SequenceSplit(group, tp * cp, averaged=cp)


def _params_named(chunks, names: list[str]) -> list:
    """The parameters (as materialised and wrapped) of the chunks called ``names`` in the chunk modules."""
    wanted, out = set(names), {}
    for chunk in chunks:
        for name, p in chunk.module.named_parameters():
            if canonical_fqn(name) in wanted:
                out[id(p)] = p
    return list(out.values())

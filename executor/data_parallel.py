"""Data parallelism by ZeRO stage (Rajbhandari et al. 2020), applied to each chunk after TP and AC.

What each stage allocates, per parameter of the chunk, when training in bf16 (FSDP2's mixed precision:
fp32 master weights, a bf16 copy for compute, gradients reduced and kept in fp32) — the cost model's
``paraplan`` framework prices exactly this (planner/memory.py, ``executor_state_bytes``):

- ZeRO 0 and 1: FSDP2's ``replicate`` (each transformer layer its own unit, so its gradient
  all-reduce overlaps the backward of the layers before it, then the rest of the chunk): fp32
  weights (4 B), the bf16 compute copy (2 B, from the forward until the end of the step's backward),
  fp32 gradients (4 B), accumulated over the micro-batches and all-reduced once, after the last one.
  ZeRO 1 adds the sharded optimizer of :mod:`.optim` (Adam's moments over dp). Training in fp32
  without tensor or pipeline parallelism uses DistributedDataParallel instead (bucketed, overlapped;
  the gradients are views of its buckets, so they are not held twice).
- ZeRO 2: ``fully_shard`` with ``reshard_after_forward=False``: fp32 weights sharded (4/dp B); the
  bf16 copy gathered once per step and kept until the last micro-batch's backward (2 B); gradients
  reduce-scattered after *every* micro-batch's backward into fp32 shards (4/dp B) — the choice that
  makes gradient memory shrink with dp under gradient accumulation (FSDP2's no-sync accumulation
  would keep unsharded fp32 gradients, 4 B per parameter, on every rank).
- ZeRO 3: ``fully_shard``: as ZeRO 2, but the bf16 copy is gathered for every micro-batch's forward
  and again for its backward, and freed after each, layer by layer (FSDP2 prefetches one layer ahead).

Sharding happens on the meta device (torchtitan's order): no rank ever allocates a whole chunk
before it is sharded; :func:`paraplan.executor.chunks.materialize` then allocates each shard and
draws its values.

Under context parallelism ``dp_mesh`` is dp x cp flattened (torchtitan's dp_shard_cp): the cp ranks train
other tokens of the same samples, so every gradient is averaged over both. Expert-parallel experts are
units of their own over the expert-data-parallel mesh (torchtitan's ``fully_shard(experts, mesh=edp)``),
wrapped before their layer so the layer's unit leaves them out (expert_parallel.py scales their gradient).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# False: never DistributedDataParallel, FSDP2's replicate instead (the same weights, gradients and traffic).
# The dry run sets it: DDP's reducer needs real collectives, which a fake process group does not give.
DDP_ALLOWED = True


def uses_ddp(zero: int, dp: int, mp_dtype: torch.dtype | None, pipelined: bool, tensor_parallel: bool,
             expert_parallel: bool = False) -> bool:
    """DistributedDataParallel (applied after materialising) rather than an FSDP2 wrapper (applied on meta)."""
    return DDP_ALLOWED and dp > 1 and zero <= 1 and mp_dtype is None and not pipelined and not tensor_parallel \
        and not expert_parallel


def shard_dp(module: nn.Module, zero: int, dp_mesh: DeviceMesh, mp_dtype: torch.dtype | None,
             pipelined: bool, tensor_parallel: bool, edp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Wrap ``module`` (still on meta) for data parallelism with FSDP2; DDP's case is left for :func:`apply_ddp`.

    A single data-parallel rank training in bf16 is wrapped too (``replicate`` over one rank): FSDP2's
    mixed precision is what gives every layout the same weights, gradients and activations in memory.
    ``edp_mesh``: the expert-data-parallel mesh under expert parallelism (None without).
    """
    from .expert_parallel import expert_modules

    dp = dp_mesh.size()
    units = expert_modules(module)
    stacked = {id(p) for unit in units for p in unit.parameters()}  # the routed experts' weights
    experts = units if edp_mesh is not None else []
    if uses_ddp(zero, dp, mp_dtype, pipelined, tensor_parallel, bool(experts)) or (dp == 1 and mp_dtype is None):
        if experts and edp_mesh.size() > 1:  # only the experts have replicas
            for unit in experts:
                _wrap(unit, zero, edp_mesh, mp_dtype, stacked)
        return module
    return _per_layer(module, lambda m: _wrap(m, zero, dp_mesh, mp_dtype, stacked),
                      lambda m: _wrap(m, zero, edp_mesh, mp_dtype, stacked) if edp_mesh is not None else None)


def _wrap(module: nn.Module, zero: int, mesh: DeviceMesh, mp_dtype: torch.dtype | None,
          stacked: set[int] | frozenset[int] = frozenset()) -> nn.Module:
    """ZeRO 0/1 (or one rank): replicate; ZeRO 2/3: fully_shard, resharding after forward for ZeRO 3.
    ``stacked``: the ids of the routed experts' stacked weights, sharded on :func:`expert_shard_dim`."""
    if zero <= 1 or mesh.size() == 1:
        return _replicate(module, mesh, mp_dtype)
    return _fully_shard(module, mesh, zero == 3, mp_dtype, _expert_placement(mesh.size(), stacked))


def expert_shard_dim(local_shape: tuple[int, ...], ranks: int) -> int:
    """The dimension FSDP2 shards a rank's stacked expert weight (E/ep experts, in, out) on, over ``ranks``
    expert-data-parallel ranks. FSDP2 pads the dimension it shards to a multiple of the ranks, so on dim 0 a rank
    with fewer experts than ranks (or not a multiple of them) would hold whole padded experts: Mixtral at dp64
    ep8, one expert over 8 ranks, kept 8 times its share of the expert weights, gradients and optimizer states
    (the executor's dry run traced 147 GiB per GPU where the cost model, sharding evenly, said 68). Dim 0 where it
    divides, else the first that does (torchtitan too shards experts on dim 1 when ep x edp exceeds the experts);
    dim 0 padded where none does. At ep 1 the experts are their layer's parameters, sharded over dp likewise."""
    return next((d for d, size in enumerate(local_shape) if size % ranks == 0), 0)


def _expert_placement(ranks: int, stacked: set[int] | frozenset[int]):
    """FSDP2's shard_placement_fn: :func:`expert_shard_dim` of the local shard of each routed experts' weight (ids in
    ``stacked``: in an expert-parallel unit of their own, or in their layer's unit at ep 1); FSDP2's own (dim 0)
    for every other parameter. None where there are no experts."""
    if not stacked:
        return None
    from torch.distributed.tensor import DTensor, Shard

    def place(param: nn.Parameter):
        if id(param) not in stacked:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(tuple(local.shape), ranks))

    return place


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """DistributedDataParallel over ``dp_mesh`` (a materialised module)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # every rank initialised its weights identically (chunks.materialize: from the seed and each weight's
    # name), so DDP's start-up check and broadcast of them are skipped (init_sync=False)
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group(),
                                   gradient_as_bucket_view=True, init_sync=False)


def _per_layer(module: nn.Module, wrap, wrap_experts=lambda m: None) -> nn.Module:
    """Each transformer layer its own unit (its collective overlaps its neighbours' compute), then the
    chunk's remaining parameters (embedding, head: one unit, so a tied pair inside it is one parameter).
    A layer's expert-parallel experts are a unit of their own, wrapped first (``wrap_experts``)."""
    from .expert_parallel import expert_modules

    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        for layer in layers.values():
            for experts in expert_modules(layer):
                wrap_experts(experts)
            wrap(layer)
    return wrap(module)


def _mp_policy(mp_dtype: torch.dtype | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)


def _replicate(module: nn.Module, dp_mesh: DeviceMesh, mp_dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(module, mesh=dp_mesh, mp_policy=_mp_policy(mp_dtype))


def _fully_shard(module: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool,
                 mp_dtype: torch.dtype | None, placement=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=_mp_policy(mp_dtype), shard_placement_fn=placement)


def syncs_every_micro_batch(zero: int) -> bool:
    """ZeRO 2 and 3 reduce-scatter each micro-batch's gradients (sharded fp32 accumulation); ZeRO 0 and 1
    accumulate full gradients and reduce once per step."""
    return zero >= 2

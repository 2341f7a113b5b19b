"""Data-parallel gradient sync, ZeRO's gathers, the tied embedding and parameter servers: what each
pipeline rank sends and waits for per iteration, as :class:`~paraplan.planner.concerns.Exposure` items.

By framework (planner/framework.py):

- ``executor`` states (this project's executor, data_parallel.py; per rank of P parameters, fp32
  gradients, bf16 weights gathered):
  - ZeRO 0/1: all-reduce of 4·P bytes once per step. Without a pipeline it overlaps the last micro-batch's
    backward layer by layer (FSDP2's replicate units; DDP's 25 MiB buckets when training in fp32) and the
    last unit — the chunk's embedding and head — cannot hide; with one, torch's schedule reduces after
    its last backward, exposed. ZeRO 1 then broadcasts each owner's updated fp32 weights: 4·P bytes,
    priced as the all-gather they add up to.
  - ZeRO 2/3: a reduce-scatter of 4·P bytes after every micro-batch's backward, hidden behind the rank's
    backward compute; ZeRO 2 gathers the bf16 weights (2·P) once per step before the first forward, ZeRO 3
    for every forward and again for every backward, each hidden behind that pass's compute. Under ZB-V
    the gradients are reduced once, after the last backward (pipeline.py), exposed. Each gather is then
    copied out of FSDP2's all-gather buffer into the unsharded weights on the compute stream (torch
    fsdp/_fully_shard: FSDPParamGroup.wait_for_unshard -> foreach_all_gather_copy_out ->
    split_with_sizes_copy): 2·(2·P) bytes of GPU memory read and written per gather, which nothing hides
    (:func:`copy_out`). The same for every FSDP2 stack (torchtitan, NeMo Automodel).
- ``zero`` states (Megatron-LM, DeepSpeed): ZeRO 0 all-reduces, ZeRO 1-3 reduce-scatter, the gradients
  (``Framework.grad_bytes`` per element) once per step, overlapping the last backward when the stack
  overlaps (in buckets, the last of which cannot hide: :func:`bucket_bytes`); ZeRO 1/2 all-gather the updated
  16-bit weights after the step (or bucket by bucket under the next forward), ZeRO 3 before each micro-batch's
  forward and backward.
- A tied embedding split over the first and last pipeline stage: its gradient (V·h/t elements)
  all-reduced between the two end ranks, exposed (Megatron's embedding group; executor/tied.py).
- Parameter servers: push and pull through k servers and their optimizer updates (comm.parameter_server_sync),
  overlapping ``staleness`` iterations when asynchronous.
"""

from __future__ import annotations

from . import comm
from .concerns import Affine, Exposure, Sync
from .layout import Layout
from .memory import sums_unsharded
from .placement import Placement, consecutive_group, layout_placement
from .schedules import runtime_unshards

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def copy_out(gpu):
    """Seconds for FSDP2's copy-out of n gathered bytes on ``gpu``: read and written once each through its
    memory at the memory-bound efficiency (an element-wise copy)."""
    rate = gpu.memory_bound_Bps
    return lambda n: n / rate


def bucket_bytes(fw, lay: Layout, elem: float) -> float:
    """Bytes of one bucket of a "zero"-states stack's data-parallel reduce (or overlapped weight gather) of
    ``elem``-byte elements (Framework.dp_buckets): torch DDP's 25 MiB, or Megatron-Core's default bucket_size of
    max(40,000,000, 1,000,000 x dp) parameters over the data-parallel ranks (context-parallel ones included:
    megatron/core/distributed/distributed_data_parallel.py, core_r0.9.0 on)."""
    if fw.dp_buckets == "megatron":
        return max(40_000_000, 1_000_000 * lay.data_ranks) * elem
    return DDP_BUCKET_BYTES


# Optimizer step traffic per parameter of the shard a rank updates (Adam):
# - "zero" states (Megatron): master weights, momentum and variance read and written (2 x 12 B in fp32,
#   Framework.master_bytes + moment_bytes), the fp32 gradient read (4 B), the 16-bit weights written (2 B), the
#   gradient-norm clip reading the gradient again and zeroing writing it (8 B);
# - "executor" states (torch AdamW on fp32 weights, no clipping, gradients freed): weights, momentum and
#   variance read and written (24 B), the gradient read (4 B).
ADAM_BYTES_PER_PARAM = {"zero": 38, "executor": 28}


def adam_bytes_per_param(framework) -> float:
    """Optimizer step traffic per updated parameter (ADAM_BYTES_PER_PARAM, with the stack's state sizes)."""
    if framework.states == "executor":  # torch's Adam keeps its moments in the weights' dtype
        return ADAM_BYTES_PER_PARAM["executor"] - 2 * (12 - framework.master_bytes - framework.moment_bytes)
    return ADAM_BYTES_PER_PARAM["zero"] - 2 * (12 - framework.master_bytes - framework.moment_bytes)


def grad_bytes(work, lay: Layout) -> int:
    """Bytes per gradient element reduced across data-parallel ranks."""
    if lay.dtype == "fp32":
        return 4
    return 4 if work.framework.states == "executor" else work.framework.grad_bytes


def weight_bytes(lay: Layout) -> int:
    """Bytes per weight element gathered (ZeRO 2/3) in the training dtype."""
    return 4 if lay.dtype == "fp32" else 2


def executor_uses_ddp(lay: Layout) -> bool:
    """The executor's DistributedDataParallel case (data_parallel.uses_ddp): fp32, ZeRO 0/1, no tp or pp."""
    return lay.dtype == "fp32" and lay.zero <= 1 and lay.pp == 1 and lay.tp == 1


def dp_exposures(model, lay: Layout, place: Placement, root_params: float, tied_elements: float,
                 head_params: float = 0.0) -> list[Exposure]:
    """What a pipeline rank sends and waits for per iteration for data parallelism.

    ``root_params``: the rank's parameters outside transformer layers (the embedding/head unit);
    ``tied_elements``: the tied embedding's elements on this rank when it is split across the pipeline's
    ends (0 otherwise); ``head_params``: a class-sharded classifier's parameters on this rank (hybrid).
    """
    work = model.work
    fw, cluster, busy = work.framework, work.cluster, place.gpus_per_node_busy
    ge, wb = grad_bytes(work, lay), weight_bytes(lay)
    m = lay.num_micro_batches
    items: list[Exposure] = []
    if tied_elements and lay.pp > 1:
        link = comm.network_share(cluster, busy) if place.crosses(lay.pp - 1, 0) else cluster.intra_node
        items.append(Exposure(Sync("all_reduce", lambda n: comm.ring_all_reduce(n, 2, link),
                                   const_bytes=tied_elements * ge)))
    if lay.dp_mode == "ps":
        return items + [_parameter_servers(model, lay, place, ge)]
    if lay.data_ranks == 1:
        return items
    all_reduce = lambda n: comm.all_reduce(n, place.dp, cluster, busy)  # noqa: E731
    gather = lambda n: comm.gather(n, place.dp, cluster, busy)  # noqa: E731
    window = Affine(window=1.0) if work.overlap_dp else Affine()
    if lay.head_parallel > 1:  # trunk over every dp rank, each classifier shard over its dp/k holders
        shard = consecutive_group(cluster, lay.dp // lay.head_parallel, lay.head_parallel, lay.num_gpus)
        head = head_params * ge
        both = lambda n: comm.all_reduce(n - head, place.dp, cluster, busy) + comm.all_reduce(  # noqa: E731
            head, shard, cluster, busy)
        return items + [Exposure(Sync("all_reduce", both, per_param=ge), hidden=window, floor="bucket",
                                 bucket_bytes=DDP_BUCKET_BYTES, bucket_time=all_reduce)]
    if fw.states == "executor":
        return items + _executor(lay, fw, all_reduce, gather, window, ge, wb, m, root_params, copy_out(cluster.gpu))
    return items + _zero_accounting(lay, fw, all_reduce, gather, window, ge, wb, m)


def _executor(lay: Layout, fw, all_reduce, gather, window: Affine, ge: int, wb: int, m: int,
              root_params: float, copy) -> list[Exposure]:
    if lay.zero <= 1:
        if lay.pp == 1:
            last = DDP_BUCKET_BYTES if executor_uses_ddp(lay) else root_params * ge
            items = [Exposure(Sync("all_reduce", all_reduce, per_param=ge), hidden=window, floor="bucket",
                              bucket_bytes=last)]
        else:  # torch pipelining reduces after the step's last backward
            items = [Exposure(Sync("all_reduce", all_reduce, per_param=ge))]
        if lay.zero == 1:  # owners broadcast their updated fp32 weights
            items.append(Exposure(Sync("all_gather", gather, per_param=4)))
        return items
    return executor_sharded(lay, fw, gather, ge, wb, m, "per_param", copy)


def reduces_once(fw, lay: Layout) -> bool:
    """memory.sums_unsharded for ``lay``: once per step (after summing unsharded), not every micro-batch."""
    return sums_unsharded(fw, lay.pp, lay.schedule)


def executor_sharded(lay: Layout, fw, gather, ge: int, wb: int, m: int, per: str, copy=None) -> list[Exposure]:
    """FSDP2's ZeRO-2/3 ("executor" states): a gradient reduce-scatter per micro-batch under its backward, or
    once (:func:`reduces_once`: after a pipeline's last backward, exposed; without a pipeline under the last
    micro-batch's backward), the weights gathered once (ZeRO-2) or before every micro-batch's forward
    and backward (ZeRO-3) — under ZeRO-2 again each time torch's pipeline runtime unshards a chunk anew
    (schedules.runtime_unshards: interleaved ranks of more than three chunks), each such gather hidden by one
    micro-batch's forward at most. ``per``: the load the bytes scale with (``per_param``; ``per_expert`` for the
    expert-parallel experts over their edp group, planner/moe.py). Under ZeRO-3 a backward both gathers the
    weights and reduce-scatters the gradients, over one network: the two share its window (Exposure.also).
    ``copy``: seconds of n bytes of FSDP2's copy-out (:func:`copy_out`), once per gather on the compute stream,
    exposed: 2·wb bytes a parameter (the gathered buffer read, the unsharded weights written)."""
    gathers = Sync("all_gather", gather, **{per: wb})
    scatter = Sync("reduce_scatter", gather, **{per: ge})
    fwd, bwd = Affine(fwd=1.0), Affine(bwd=1.0)

    def copied(count: float) -> list[Exposure]:  # a ZeRO-3 step gathers 2m times (each forward, each backward)
        return [Exposure(Sync("copy", copy, **{per: 2 * wb}), count=count)] if copy is not None and count else []

    if lay.zero == 2:
        if reduces_once(fw, lay):
            items = [Exposure(scatter)] if lay.pp > 1 else [Exposure(scatter, hidden=bwd, floor="zero")]
        else:
            items = [Exposure(scatter, count=m, hidden=bwd, floor="zero")]
        unshards = runtime_unshards(lay.schedule, lay.pp, lay.virtual_stages, m)
        return items + [Exposure(gathers, count=unshards, hidden=fwd, floor="zero")] + copied(unshards)
    items = [Exposure(gathers, count=m, hidden=fwd, floor="zero")] + copied(2 * m)
    if not reduces_once(fw, lay):  # every micro-batch's backward gathers and reduce-scatters
        return items + [Exposure(scatter, count=m, hidden=bwd, floor="zero", also=(gathers,))]
    if lay.pp > 1:  # after the pipeline's last backward, exposed
        return items + [Exposure(gathers, count=m, hidden=bwd, floor="zero"), Exposure(scatter)]
    # once, under the last micro-batch's backward, beside that backward's gathers
    return items + [Exposure(gathers, count=m - 1, hidden=bwd, floor="zero"),
                    Exposure(scatter, hidden=bwd, floor="zero", also=(gathers,))]


def _zero_accounting(lay: Layout, fw, all_reduce, gather, window: Affine, ge: int, wb: int,
                     m: int) -> list[Exposure]:
    """Megatron-LM / DeepSpeed data parallelism, by the framework's switches: ``dp_sync_pipelined`` (with a
    pipeline, reduce after the flush, exposed, or under the last backward), ``zero1`` (ZeRO 1 as an all-reduce
    plus the owners' broadcast, or a reduce-scatter plus an all-gather), ``zero23_every_micro_batch`` (ZeRO 2/3
    reduce-scatter each micro-batch's gradients under its backward, or once per step). Under ZeRO-3 reducing every
    micro-batch, each backward's gathers and reduce-scatter share its window (Exposure.also); reducing once per
    step, the bucketed reduce-scatter and the last backward's gathers are still each hidden by that backward (not
    shared: a bucketed floor is one collective's), which can price a slow network's ZeRO-3 step a little short."""
    if lay.pp > 1 and fw.dp_sync_pipelined == "end":
        window = Affine()  # reduced after the pipeline's last backward: nothing left to hide behind
    if lay.zero == 0 or (lay.zero == 1 and fw.zero1 == "allreduce+broadcast"):
        items = [Exposure(Sync("all_reduce", all_reduce, per_param=ge), hidden=window, floor="bucket",
                          bucket_bytes=bucket_bytes(fw, lay, ge))]
        if lay.zero == 1:  # each owner broadcasts its updated 16-bit weights
            items.append(Exposure(Sync("all_gather", gather, per_param=wb)))
        return items
    gathers = Sync("all_gather", gather, per_param=wb)
    scatter = Sync("reduce_scatter", gather, per_param=ge)
    every = lay.zero >= 2 and fw.zero23_every_micro_batch
    if every and lay.zero == 3:  # each backward gathers the weights and reduce-scatters, sharing its window
        return [Exposure(gathers, count=m, hidden=Affine(fwd=1.0), floor="zero"),
                Exposure(scatter, count=m, hidden=Affine(bwd=1.0), floor="zero", also=(gathers,))]
    if every:
        items = [Exposure(scatter, count=m, hidden=Affine(bwd=1.0), floor="zero")]
    else:
        items = [Exposure(scatter, hidden=window, floor="bucket", bucket_bytes=bucket_bytes(fw, lay, ge))]
    if lay.zero == 3:  # weights gathered for every micro-batch's forward and backward
        items += [Exposure(gathers, count=m, hidden=Affine(fwd=1.0), floor="zero"),
                  Exposure(gathers, count=m, hidden=Affine(bwd=1.0), floor="zero")]
    elif fw.overlap_param_gather:  # bucket by bucket under the next step's first forward (Megatron-Core)
        items.append(Exposure(gathers, hidden=Affine(fwd=1.0), floor="bucket", bucket_bytes=bucket_bytes(fw, lay, wb)))
    else:
        items.append(Exposure(gathers))  # updated weight shards gathered after the step
    return items


def _parameter_servers(model, lay: Layout, place: Placement, ge: int) -> Exposure:
    """Push and pull through ``ps_servers`` servers, and the servers' optimizer updates: once per round
    when synchronous, once per worker's push when asynchronous (executor/ps_protocol.py)."""
    work = model.work
    cluster, gpu = work.cluster, work.cluster.gpu
    in_node = lay.world_size <= cluster.gpus_per_node
    steps = 1 if lay.ps_staleness == 0 else lay.dp
    hbm = gpu.memory_bound_Bps
    update = Affine(params=steps * adam_bytes_per_param(work.framework) / lay.ps_servers / hbm)
    sync = Sync("send_recv", lambda n: comm.parameter_server_sync(n, lay.num_gpus, lay.ps_servers, cluster, in_node,
                                                                   place.gpus_per_node_busy),
                per_param=ge, extra=update)
    if lay.ps_staleness:
        return Exposure(sync, hidden=Affine(makespan=float(lay.ps_staleness)), floor="zero")
    return Exposure(sync)


def optimizer_step(model, lay: Layout) -> Affine:
    """Seconds of one rank's optimizer step, affine in its parameters: Adam's memory traffic over the shard
    it updates (all of them, 1/dp with ZeRO, none when parameter servers update), plus the framework's
    per-step host cost."""
    work = model.work
    gpu = work.cluster.gpu
    if lay.dp_mode == "ps":
        share = 0.0
    else:
        share = 1.0 / lay.data_ranks if lay.zero >= 1 else 1.0
    busy = layout_placement(work.cluster, lay).gpus_per_node_busy if model.cpu_share.cpu else 0
    key = ("optimizer", share, busy)  # all it depends on: one object for thousands of layouts (its terms cached)
    got = model.step_affines.get(key)
    if got is None:
        per_param = share * adam_bytes_per_param(work.framework) / gpu.memory_bound_Bps
        const = gpu.efficiency.framework("step")
        if model.cpu_share.cpu:  # a CPU rank's share of the machine's cores (cpu_share.py)
            per_param, const = per_param * model.cpu_share.compute(busy), const * model.cpu_share.host(busy)
        got = model.step_affines[key] = Affine(const=const, params=per_param)
    return got


def sequence_parallel_weight_sync(model, lay: Layout, place: Placement) -> Exposure:
    """Under sequence parallelism each tensor-parallel rank computes the gradient of the weights it keeps
    whole (norms, row-parallel biases) from its own tokens only, and DTensor all-reduces it over the
    tensor-parallel group: once per step in fp32 — or, in a pipeline whose ZeRO 2/3 stages reduce every
    micro-batch (executor/pipeline.py), after each micro-batch's backward, in the 16-bit compute dtype
    (both traced by the dry run)."""
    cluster = model.work.cluster
    sync = lambda n: comm.all_reduce(n, place.tp, cluster, place.gpus_per_node_busy)  # noqa: E731
    every = lay.pp > 1 and lay.zero >= 2 and lay.data_ranks > 1 and not reduces_once(model.work.framework, lay)
    if every:
        return Exposure(Sync("all_reduce", sync, per_replicated=weight_bytes(lay)), count=lay.num_micro_batches)
    return Exposure(Sync("all_reduce", sync, per_replicated=4.0))

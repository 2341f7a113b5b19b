"""The cost model: one layout + stage boundaries -> iteration time, its breakdown, memory per GPU.

Composition (each piece is its own module, each formula tested against its source):
- per block and micro-batch: compute time (:mod:`compute`), tensor-parallel collectives (the
  profiler's TP view, timed by :mod:`comm`), recomputation, saved activations (:mod:`memory`);
- per pipeline stage: the sums, plus the point-to-point send of its boundary tensor (1/t of it per
  rank: Megatron's scatter/gather optimisation, or the sequence-parallel shard);
- the pipeline: closed forms for the search, or the event simulator (:mod:`simulator`);
- data parallelism, ZeRO's gathers, the tied embedding, parameter servers and the optimizer step:
  one definition each (dp_sync.py over concerns.py), shared with the ILP;
- memory per rank: the framework's model states (memory.state_bytes), its stages' activations x the
  micro-batches each holds, at the most of every moment of the schedule that may be the peak
  (schedules.peak_holdings), the framework allowance;
- per rank the bytes each kind of collective and the pipeline's sends carry per iteration, which the
  executor's dry run traces (executor/dry_run.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from paraplan.hardware_specs import FRAMEWORK_EVENTS
from paraplan.models import latent_down_params
from paraplan.profiler.tp_view import region_collectives

from . import comm, context_parallel, fp8, moe, op_sac
from .compute import estimate_pass_times, gemm_dtype, gemm_seconds, measured_pass_times, softmax_falls_back
from .concerns import RankLoad, exposed_seconds, sync_summary, traffic
from .cpu_share import CpuShare
from .dp_sync import dp_exposures, optimizer_step, sequence_parallel_weight_sync
from .errors import InvalidLayout
from .fused_activations import fused_layer_bytes
from .layout import Layout, recomputes_core, recomputes_mlp, recomputes_norm_act
from .memory import (
    FRAGMENTATION,
    GiB,
    StateBytes,
    ddp_buckets,
    layer_activation_bytes,
    loss_bytes,
    pending_weight_grad_bytes,
    rank_memory,
    staged_unit_params,
    start_bytes,
    state_bytes,
    step_bytes,
    untracked_bytes,
)
from .placement import Placement, consecutive_group, layout_placement
from .schedules import (
    closed_form_makespan,
    in_flight,
    linear_makespan,
    peak_matrices,
    rank_stages,
    rounds_excess,
    rounds_priced,
    stage_rank,
)
from .simulator import SimResult, simulate_pipeline
from .workload import Workload

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class BlockCost:
    """One block, one micro-batch, one rank of a layout."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float  # forward work repeated in backward
    recompute_flops: float
    tp_fwd: float
    tp_bwd: float
    act_bytes: float  # kept from forward to backward
    act_working: float  # live while this block's backward runs under full recomputation
    params: float  # parameters held by one rank (tensor-parallel shard)
    output_bytes: float  # the boundary tensor a pipeline sends after this block (per rank)
    tp_traffic: tuple[float, float, float] = (0.0, 0.0, 0.0)  # TP collective bytes per micro-batch (TP_KINDS)
    root: bool = False  # outside the transformer layers: the data-parallel wrapper's root unit (embedding, head)
    replicated: float = 0.0  # parameters tensor parallelism leaves whole, whose gradients SP all-reduces
    cp_time: float = 0.0  # of tp_fwd + tp_bwd, the context-parallel K/V exchange (planner/context_parallel.py)
    cp_send_recv: float = 0.0  # bytes per micro-batch of a ring's K/V exchange (sent and received)
    # mixture of experts (planner/moe.py): of params, the expert-parallel experts (synced over edp) and the MoE
    # weights summed over tp; of tp_fwd + tp_bwd, the token all-to-alls (and etp gathers); their bytes
    experts: float = 0.0
    moe_shared: float = 0.0
    ep_time: float = 0.0
    a2a_bytes: float = 0.0
    host: float = 0.0  # of tp_fwd + tp_bwd, host-side framework seconds (calibrated per event; 0 on GPUs)
    # elements of its largest parameter tensor on a rank, outside the expert-parallel experts and among them
    # (moe.largest_tensors_on_rank): what torch's AdamW allocates for at the step (memory.step_bytes)
    largest_param: float = 0.0
    largest_expert: float = 0.0
    dw_pending: float = 0.0  # kept from a zero-bubble input backward to its weight backward (pending_weight_grad_bytes)

    @property
    def reduce_unit(self) -> float:
        """Parameters of the largest FSDP unit of this block that reduces its gradients alone: the layer's own, or its
        expert-parallel experts', a unit of their own over edp (executor/data_parallel.py); both are gathered at
        once, so ZeRO-3's gathered unit stays ``params``."""
        return max(self.params - self.experts, self.experts)


# BlockCost fields summed over a stage (prefix sums per block table), in this order
SUMMED = ("fwd", "bwd_input", "bwd_weight", "recompute", "tp_fwd", "tp_bwd", "act_bytes", "params",
          "recompute_flops", "root_params", "replicated", "tp_all_reduce", "tp_all_gather", "tp_reduce_scatter",
          "cp_time", "cp_send_recv", "experts", "moe_shared", "ep_time", "a2a_bytes", "host", "dw_pending")


def _field(cost: BlockCost, name: str) -> float:
    if name == "root_params":
        return cost.params if cost.root else 0.0
    if name.startswith("tp_") and name[3:] in TP_KINDS:
        return cost.tp_traffic[TP_KINDS.index(name[3:])]
    return getattr(cost, name)


def _summed_row(cost: BlockCost) -> tuple[float, ...]:
    """A block's SUMMED fields in order, computed once per BlockCost (blocks are cached: identical layers
    share one object, so a table of 80 layers reads one row)."""
    row = cost.__dict__.get("_row")
    if row is None:
        row = tuple(_field(cost, f) for f in SUMMED)
        cost.__dict__["_row"] = row
    return row


@dataclass
class _BlockTable:
    """A layout's blocks in one recomputation mode. The prefix sums and weights are computed when first read: the
    search's lower bounds read only the whole-model sums (:meth:`sums`, from the few distinct blocks) of hundreds
    of tables whose stages it never prices."""

    working: list[float]
    costs: list[BlockCost]  # each block's own (identical layers share one object)
    whole: dict[str, float] | None = None  # CostModel.totals, computed once
    _fullest: dict[int, float] = field(default_factory=dict)  # fullest_rank per rank count

    @cached_property
    def rows(self) -> list[list[float]]:
        """Prefix sums of the SUMMED fields (in that order) at each block boundary: n + 1 rows."""
        own = [_summed_row(c) for c in self.costs]  # (n, len(SUMMED))
        cum = np.zeros((len(own) + 1, len(SUMMED)))  # (n + 1, len(SUMMED)): row i sums blocks 0..i-1, in order
        np.cumsum(own, axis=0, out=cum[1:])
        return cum.tolist()

    @cached_property
    def weights(self) -> tuple[float, ...]:
        """Each block's time (compute, recompute and TP communication): what balances stages."""
        weight: dict[int, float] = {}
        for c in self.costs:
            if id(c) not in weight:
                weight[id(c)] = sum(_summed_row(c)[:6]) + 1e-12
        return tuple(weight[id(c)] for c in self.costs)

    def sums(self) -> list[float]:
        """Every SUMMED field over all blocks, in SUMMED order (span(0, n), from each distinct block x its count)."""
        count: dict[int, list] = {}
        for c in self.costs:
            got = count.get(id(c))
            if got is None:
                count[id(c)] = [c, 1]
            else:
                got[1] += 1
        out = [0.0] * len(SUMMED)
        for c, k in count.values():
            for j, x in enumerate(_summed_row(c)):
                out[j] += k * x
        return out

    @cached_property
    def smallest_output(self) -> float:
        """The smallest boundary tensor a stage can send: any block's output but the last block's."""
        return min(c.output_bytes for c in self.costs[:-1])

    @cached_property
    def largest_output(self) -> float:
        """The largest boundary tensor a block sends (bytes per rank and micro-batch)."""
        return max(c.output_bytes for c in self.costs)

    def fullest_rank(self, ranks: int) -> float:
        """A lower bound on the heaviest of ``ranks`` ranks' summed weights, however the (whole) blocks are
        dealt: of the j heaviest blocks some rank holds at least ceil(j/ranks), so at least the lightest
        ceil(j/ranks) of them — the largest of these over j (pigeonhole; cached per rank count)."""
        got = self._fullest.get(ranks)
        if got is None:
            heavy = sorted(self.weights, reverse=True)
            prefix = [0.0]
            for w in heavy:
                prefix.append(prefix[-1] + w)
            got = max(prefix[j] - prefix[j - -(-j // ranks)] for j in range(1, len(heavy) + 1))
            self._fullest[ranks] = got
        return got

    def span(self, lo: int, hi: int) -> list[float]:
        """Every SUMMED field over blocks lo..hi-1, in SUMMED order (one pass: a stage priced in O(fields))."""
        return [h - low for h, low in zip(self.rows[hi], self.rows[lo], strict=True)]


@dataclass
class StageCost:
    index: int
    rank: int
    blocks: list[int]
    recompute: str
    fwd: float = 0.0
    bwd_input: float = 0.0
    bwd_weight: float = 0.0
    recompute_time: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    p2p_fwd: float = 0.0
    p2p_bwd: float = 0.0
    act_bytes: float = 0.0
    act_working: float = 0.0
    loss_working: float = 0.0  # of act_working's candidates, the loss's (the head block's), where the stage holds it
    layer_working: float = 0.0  # the largest working set of its other blocks
    loss_held: float = 0.0  # of act_bytes, the head block's (where the stage holds it): freed by its backward
    params: float = 0.0
    recompute_flops: float = 0.0
    root_params: float = 0.0  # of params, those outside transformer layers
    replicated_params: float = 0.0  # of params, those kept whole under tensor parallelism (SP syncs them)
    tp_traffic: tuple[float, float, float] = (0.0, 0.0, 0.0)  # per micro-batch (TP_KINDS)
    p2p_bytes: float = 0.0  # bytes this stage sends and receives per micro-batch across ranks
    cp_time: float = 0.0  # of tp_fwd + tp_bwd, the context-parallel exchange
    experts: float = 0.0  # of params, the expert-parallel experts (planner/moe.py)
    moe_shared: float = 0.0  # of params, MoE weights whose gradients are summed over tp
    ep_time: float = 0.0  # of tp_fwd + tp_bwd, the MoE token all-to-alls
    a2a_bytes: float = 0.0  # all-to-all bytes per micro-batch
    host_time: float = 0.0  # of tp_fwd + tp_bwd, host-side framework seconds (its blocks' and the stage's own)
    largest_unit: float = 0.0  # parameters of its largest non-root block on a rank (an FSDP unit)
    largest_reduce_unit: float = 0.0  # of its non-root blocks, the largest BlockCost.reduce_unit
    largest_param: float = 0.0  # of its blocks, the largest BlockCost.largest_param (and largest_expert)
    largest_expert: float = 0.0
    # bytes per micro-batch kept from a zero-bubble input backward to its weight backward: its blocks' output
    # gradients (BlockCost.dw_pending; none on the first stage, whose input backward does nothing: torch runs its
    # whole backward at W; on the last only their excess over the loss backward's working set) and, but on the last
    # stage, the gradient received for its output (the stage's backward_state)
    dw_pending: float = 0.0

    @property
    def t_f(self) -> float:
        return self.fwd + self.tp_fwd + self.p2p_fwd

    @property
    def t_b(self) -> float:
        """Input-gradient part of the backward (with recomputation, TP collectives, the send)."""
        return self.bwd_input + self.recompute_time + self.tp_bwd + self.p2p_bwd

    @property
    def t_w(self) -> float:
        return self.bwd_weight

    @property
    def total(self) -> float:
        return self.t_f + self.t_b + self.t_w


@dataclass
class Prediction:
    layout: Layout
    num_parameters: int
    iteration_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    fits: bool
    peak_memory_gib: float
    memory_capacity_gib: float
    memory_limit_gib: float  # what the plan may fill: the capacity less the planner's margin (Workload.memory_margin)
    memory_gib: dict[str, float]
    time_s: dict[str, float]
    bubble_fraction: float
    stages: list[StageCost]
    rank_memory_gib: list[float]
    rank_finish_s: list[float]  # when each pipeline rank ends its last backward
    rank_dp_exposed_s: list[float]  # the data-parallel sync each rank waits for after that
    in_flight: list[dict[int, int]]
    method: str
    sim: SimResult | None = None
    notes: list[str] = field(default_factory=list)
    rank_memory_breakdown_gib: list[dict[str, float]] = field(default_factory=list)  # per pipeline rank
    # per pipeline rank and iteration: bytes by kind, computed when first read (the search never reads it)
    traffic_of: Callable[[], list[dict[str, float]]] | None = field(default=None, repr=False, compare=False)
    # per pipeline rank: its data-parallel sync (concerns.sync_summary), computed when first read (compare's table)
    dp_sync_of: Callable[[], list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)
    # per pipeline rank: the FLOPs it computes an iteration (CostModel.rank_flops), computed when first read (dry run)
    flops_of: Callable[[], list[float]] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def rank_comm_bytes(self) -> list[dict[str, float]]:
        return self.traffic_of() if self.traffic_of is not None else []

    @cached_property
    def rank_dp_sync(self) -> list[dict[str, Any]]:
        return self.dp_sync_of() if self.dp_sync_of is not None else []

    @cached_property
    def rank_flops(self) -> list[float]:
        return self.flops_of() if self.flops_of is not None else []

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the scaling chart's forked re-plans send their best back) with the traffic computed."""
        state = dict(self.__dict__)
        state["rank_comm_bytes"], state["traffic_of"] = self.rank_comm_bytes, None
        state["rank_dp_sync"], state["dp_sync_of"] = self.rank_dp_sync, None
        state["rank_flops"], state["flops_of"] = self.rank_flops, None
        return state

    def limit_text(self) -> str:
        """The memory a plan may fill, in words: "80 GiB", or with a planning margin "78.4 GiB (80 GiB less the
        planner's 2% margin)"."""
        if self.memory_limit_gib >= self.memory_capacity_gib:
            return f"{self.memory_capacity_gib:g} GiB"
        share = 100 * (1 - self.memory_limit_gib / self.memory_capacity_gib)
        return (f"{self.memory_limit_gib:.1f} GiB ({self.memory_capacity_gib:g} GiB less the planner's {share:.3g}% "
                "margin)")

    @property
    def oom_by_gib(self) -> float:
        return max(0.0, self.peak_memory_gib - self.memory_limit_gib)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_parameters": self.num_parameters, "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s, "samples_per_s": self.samples_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu, "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu, "fits": self.fits, "peak_memory_gib": self.peak_memory_gib,
            "memory_capacity_gib": self.memory_capacity_gib, "memory_limit_gib": self.memory_limit_gib,
            "memory_gib": self.memory_gib, "time_s": self.time_s,
            "bubble_fraction": self.bubble_fraction, "num_gpus": self.layout.num_gpus,
            "world_size": self.layout.world_size, "method": self.method,
            "stages": [{"index": s.index, "rank": s.rank, "num_blocks": len(s.blocks), "recompute": s.recompute,
                        "fwd_ms": s.t_f * 1e3, "bwd_ms": (s.t_b + s.t_w) * 1e3,
                        "activations_per_micro_batch_gib": s.act_bytes / GiB, "params": s.params}
                       for s in self.stages],
            "rank_memory_gib": self.rank_memory_gib, "rank_memory_breakdown_gib": self.rank_memory_breakdown_gib,
            "rank_comm_bytes": self.rank_comm_bytes, "notes": self.notes,
        }


def _rerun_collectives(layer, mode: str, colls: list, sp: bool, fw, early_stop: bool, per_op: bool = False) -> list:
    """The forward collectives of a layer under tensor parallelism that recomputation ``mode`` reruns in
    backward: all of them (full; a dense MLP region's come last, as it runs last) or the MLP region's (mlp: a
    dense layer's second TP region, attention's popping first; an MoE block has none, each rank routing its own
    sequence shard), less the MLP's output reduce under an early-stopping checkpoint; and under selective
    recomputation of MLA's up-projections (Megatron-Core's mla_up_proj) the latents' all-gather their
    column-parallel linears run first with sequence parallelism (CostModel._tp_collectives). ``per_op``: torchtitan's
    per-op policy (planner/op_sac.py) keeps the reduce-scatters' outputs and reruns the rest (the gathers wk's and
    w3's inputs come from)."""
    if per_op:
        return [c for c in colls if c.phase == "fwd" and c.op != "reduce_scatter"]
    mla_up = recomputes_core(mode) and fw.selective_extra == "mla"
    up_proj = [c for c in colls if c.what == "latents"] if mla_up else []
    if mode == "full":
        again = [c for c in colls if c.phase == "fwd"]
    elif recomputes_mlp(mode):
        regions = [r for r in layer.region_io if r[0] == "region"]
        again = [c for c in region_collectives(*regions[-1], sp, fw.embedding_sp_reduce)
                 if c.phase == "fwd"] if len(regions) >= 2 else []
    else:
        return up_proj
    return up_proj + (again[:-1] if early_stop and again else again)


class _LayoutStages:
    """What pricing a stage of one layout needs, looked up once (CostModel.stage_costs), and its stages priced."""

    def __init__(self, model: CostModel, lay: Layout, place: Placement, key: tuple, fixed: float):
        self.model, self.lay, self.place, self.key, self.fixed = model, lay, place, key, fixed
        prof = model.work.profile(lay.dtype)
        self.n_blocks, self.last_layer = len(prof.layers), prof.layers[-1]
        self.tables: dict[str, _BlockTable] = {}
        self.stages: dict[tuple, StageCost] = {}

    @staticmethod
    def of(model: CostModel, lay: Layout) -> _LayoutStages:
        """The stages of ``lay``, shared with every layout whose stages cost the same: the same block tables
        (CostModel._table_key), stage-to-rank map, sends across nodes or not, and host cost per stage — what
        stage() reads of a layout — so layouts apart only in ZeRO stage or data-parallel degree (where neither
        moves those) price each stage once."""
        place = layout_placement(model.work.cluster, lay)
        key = model._table_key(lay, place)
        fixed = model.stage_host_overhead(lay)
        group = (key, lay.schedule, lay.pp, lay.num_stages, place.pp_crossings, place.pp_senders_per_node, fixed)
        got = model._stage_groups.get(group)
        if got is None:
            got = model._stage_groups[group] = _LayoutStages(model, lay, place, key, fixed)
        return got

    def priced(self, s: int, blocks: list[int], mode: str, sends: bool) -> StageCost:
        """:meth:`stage`, priced once per index, mode and first and last block (what it depends on)."""
        key = (s, mode, blocks[0], blocks[-1])
        st = self.stages.get(key)
        if st is None:
            st = self.stages[key] = self.stage(s, list(blocks), mode, sends)
        return st

    def stage(self, s: int, blocks: list[int], mode: str, sends: bool) -> StageCost:
        """Stage ``s`` holding ``blocks`` (contiguous: stage s - 1 ends at the block before) in recomputation
        ``mode``; ``sends``: a stage follows it."""
        lay, place = self.lay, self.place
        st = StageCost(index=s, rank=stage_rank(lay.schedule, s, lay.pp), blocks=blocks, recompute=mode)
        table = self.tables.get(mode)
        if table is None:
            table = self.tables[mode] = self.model.block_table(lay, place, mode, self.key)
        lo, hi = blocks[0], blocks[-1] + 1
        (st.fwd, st.bwd_input, st.bwd_weight, st.recompute_time, st.tp_fwd, st.tp_bwd, st.act_bytes, st.params,
         st.recompute_flops, st.root_params, st.replicated_params, ar, ag, rs, st.cp_time, st.p2p_bytes,
         st.experts, st.moe_shared, st.ep_time, st.a2a_bytes, st.host_time, st.dw_pending) = table.span(lo, hi)
        st.tp_traffic = (ar, ag, rs)
        st.act_working = max(table.working[lo:hi])
        holds_loss = hi == self.n_blocks
        st.loss_working = table.working[-1] if holds_loss else 0.0
        st.layer_working = max(table.working[lo:hi - 1], default=0.0) if holds_loss else st.act_working
        st.loss_held = table.costs[-1].act_bytes if holds_loss else 0.0
        st.largest_unit = max((c.params for c in table.costs[lo:hi] if not c.root), default=0.0)
        st.largest_reduce_unit = max((c.reduce_unit for c in table.costs[lo:hi] if not c.root), default=0.0)
        st.largest_param = max(c.largest_param for c in table.costs[lo:hi])
        st.largest_expert = max(c.largest_expert for c in table.costs[lo:hi])
        if not s:  # torch's first stage runs its whole backward at W: its input backward keeps no gradients
            st.dw_pending = 0.0
        elif not sends:  # the last stage runs its W right after its B (zb-v's rank 0): what that B leaves adds to
            # the rank's peak only its excess over the loss backward's working set (which held the logits' gradient)
            st.dw_pending = max(0.0, st.dw_pending - table.costs[-1].act_working)
        st.dw_pending += table.costs[blocks[-1]].output_bytes if sends else 0.0
        tied = self.last_layer.tied_params
        if tied and lo == 0 and hi == self.n_blocks:  # one copy of a tied weight on this rank
            shared = tied * (table.costs[-1].params / self.last_layer.params)
            st.params -= shared
            st.root_params -= shared
        st.tp_fwd += self.fixed / 2
        st.tp_bwd += self.fixed / 2
        st.host_time += self.fixed
        # Point-to-point: the stage sends its output forward and receives its gradient back, and receives the
        # previous stage's output and sends back its gradient (a block's output size is the same in every mode).
        for other, boundary, outgoing in ((s + 1, table.costs[blocks[-1]].output_bytes, True),
                                          (s - 1, table.costs[lo - 1].output_bytes if s else 0.0, False)):
            if not (sends if outgoing else s):
                continue
            other_rank = stage_rank(lay.schedule, other, lay.pp)
            if other_rank == st.rank:
                continue
            cross = place.crosses(st.rank, other_rank)
            t = self.model.p2p_seconds(lay, boundary, cross, place)
            if outgoing:
                st.p2p_fwd += t
            else:
                st.p2p_bwd += t
            st.p2p_bytes += 2 * boundary
        return st


def _replicated_on_shard(work, lay: Layout, layer) -> bool:
    """Whether a block's replicated GEMMs run on each tensor-parallel rank's sequence shard: MLA's down-projections
    in Megatron-Core under sequence parallelism (duplicated linears before the latents' gather: Framework.mla_tp_input
    "latent"). This executor and torchtitan gather the hidden first and run them whole."""
    return lay.sequence_parallel and work.framework.mla_tp_input == "latent" and getattr(work.spec, "mla", False) \
        and layer.kind == "transformer_layer"


def _tp_flops_share(ops, t: int) -> float:
    """The share of a block's FLOPs one of ``t`` tensor-parallel ranks computes, weighed as the pricing weighs its
    GEMMs: the sharded ones' 1/t, the replicated ones' whole (profiler/tp_view.py), and the whole MoE block's 1/t —
    router, shared and routed experts, each rank running the block on its own 1/t of the tokens (moe.rank_view;
    executor/expert_parallel.py); 1/t for a block without GEMMs listed."""
    total = sum(ops.gemm_flops)
    if t == 1:
        return 1.0
    if not total:
        return 1.0 / t
    in_moe = ops.gemm_moe or [0] * len(ops.gemm_flops)
    divided = sum(f for f, s, m in zip(ops.gemm_flops, ops.gemm_sharded, in_moe, strict=True) if s or m > 0)
    return (divided / t + (total - divided)) / total


def held_activations(costs: list[StageCost], stages: tuple[int, ...], flights: dict[int, int], holding,
                     unfolded: dict[int, float] | None = None) -> float:
    """A pipeline rank's saved activations at its peak: the most any of its peak moments holds (``holding``:
    schedules.peak_matrices' entry for it; in zb-v with the gradients its input backwards keep for the weight
    backwards, StageCost.dw_pending), else at ``flights``' one moment. ``unfolded``: per stage the bytes of 16-bit
    gradients it holds while its last backward task was a W (zb-v: StateBytes.unfolded), counted in the moment's
    bytes too."""
    return sum(peak_parts(costs, stages, flights, holding, unfolded))


def unfolded_bytes(costs: list[StageCost], stages: tuple[int, ...], states: tuple) -> dict[int, float] | None:
    """Per stage the bytes of 16-bit gradients its weight backward leaves until its next input backward (zb-v:
    StateBytes.unfolded of ``states``, the layout's (state_bytes, moe.expert_states)); None where there are none.
    0 on the first stage: torch runs its whole backward at W, whose FSDP2 post-backward folds them at once
    (llama2-70b dp8 tp4 pp2 zb-v: priced there too, rank 0's gradients came 8.7 GB above its trace)."""
    plain, experts = states[0].unfolded, states[1].unfolded
    if not plain and not experts:
        return None
    return {s: plain * (costs[s].params - costs[s].experts) + experts * costs[s].experts if s else 0.0
            for s in stages}


def gathered_bytes(costs: list[StageCost], stages: tuple[int, ...], states: tuple):
    """(stages,) array: per stage of ``stages`` the bytes its chunk's whole-chunk gathers hold while pending (ZeRO-3
    interleaved of more chunks a rank than torch's runtime keeps active: StateBytes.chunk_gather of ``states``, the
    layout's (state_bytes, moe.expert_states)), its root unit left out (StateBytes.root_weights prices it)."""
    plain, experts = states[0].chunk_gather, states[1].chunk_gather
    return np.array([plain * (costs[s].params - costs[s].experts - costs[s].root_params) + experts * costs[s].experts
                     for s in stages])


def reduce_buffer_bytes(costs: list[StageCost], stages: tuple[int, ...], states: tuple):
    """(stages,) array: per stage of ``stages`` the bytes of the reduce buffer its chunk keeps between backwards
    (memory.staged_unit_params: its last unit reduced, its root unit where it has one — embedding, final norm and
    head — else its first layer): peak_matrices' ``buffer_key`` columns (ZeRO-3 interleaved of more chunks a rank
    than torch's runtime keeps active), priced at each op's start (the unit a backward reduces meanwhile is its
    working set's share). Traced, llama2-70b dp16 tp2 pp2 v = 4, rank 0 at the start of a cool-down backward: three
    buffers, the embedding's 0.5 GB one of them, its last chunk's gone after its last backward (four of a layer
    unit or more were priced: 6.3% over). Priced also as the unit a backward reduces at its start (its largest),
    an 8-layer Mixtral-style model's dp2 pp2 ep2 v = 4 came 3.2% and 4.3% over its trace, against 0.3% and 1.4%."""
    per = states[0].unit_grads
    layer = max(costs[s].largest_reduce_unit for s in stages)
    return np.array([per * (costs[s].root_params or layer) for s in stages])


def _unfolded_list(framework, lay: Layout, costs: list[StageCost]) -> list[float] | None:
    """unfolded_bytes of every stage, in order (the event simulation's)."""
    states = layout_states(framework, lay)
    got = unfolded_bytes(costs, tuple(range(len(costs))), states)
    return None if got is None else [got[s] for s in range(len(costs))]


def layout_states(framework, lay: Layout) -> tuple[StateBytes, StateBytes]:
    """The layout's model-state bytes per parameter: its own (memory.state_bytes) and its experts'
    (moe.expert_states)."""
    return state_bytes(framework, lay), moe.expert_states(framework, lay)


@lru_cache(maxsize=1024)
def _without_gradients(states: tuple) -> tuple[StateBytes, StateBytes]:
    """``states`` (state_bytes, moe.expert_states) before a rank's first backward: no gradient, no reduce buffer.
    Kept per ``states`` (frozen: a few kinds serve thousands of fit tests)."""
    return tuple(dataclasses.replace(x, grads=0.0, unit_grads=0.0, unit_wgrads=0.0) for x in states)


def _loss_moments(costs: list[StageCost] | dict[int, StageCost], stages: tuple[int, ...], states: tuple,
                  grads_at_peak: bool) -> list[tuple[tuple, float, float | None]] | None:
    """The two moments that may be the peak of a rank whose one stage holds the loss (the whole model without a
    pipeline, or a 1F1B or GPipe pipeline's last rank), each as (the layout's states then, the working set beside
    the saved activations, the reduce buffers' bytes then or None for memory.staged_unit_params'); None elsewhere
    (a rank of several stages, a stage without the loss, no loss working set to tell them apart).

    - The loss's backward (its working set: memory.loss_bytes): no FSDP unit is gathered then (this executor sets
      ZeRO-3's reshard_after_forward itself, so FSDP2 reshards even the root unit after the forward, and gathers it
      again only when the backward reaches it) and no layer has written a gradient yet: the states without those
      transients (StateBytes' unit_weights, root_weights, unit_wgrads). Without a pipeline no reduce buffer is held
      either (the trainer's every backward is FSDP2's last: its final callback frees them); a pipeline's stage that
      reduces every micro-batch (StateBytes.staging_held) still holds its root unit's, the last it reduced. Where
      the rank's activation peak comes before its first backward has produced gradients (``grads_at_peak`` False:
      GPipe, one micro-batch; CostModel.grads_at_activation_peak), the loss's backward has none and no buffer.
    - A layer's backward: every transient, with the layers' largest working set; the head block's saved
      activations freed by its backward before (the one micro-batch whose backward runs).
    Traced (executor/trace.py, the live tensors at the peak), llama3-8b dp16 ZeRO-3 at 8,192 tokens: the peak in the
    loss's log-softmax backward, the fp32 shards and the activations alone; priced with the transients beside the
    loss it came 4.2 GiB (6.4%) over. llama2-7b dp8 (a 32,000 vocabulary): ZeRO-3's peak in a layer's backward, the
    root and two layer units gathered, the head's activations gone (priced with the loss's working set and the
    head's: 5.6% over); ZeRO-1's at the loss's, its weight gradients and reduce buffer not yet there. The demo's pick
    (llama2-70b dp8 tp2 pp4 1F1B ZeRO-3 sp, 64 ranks), its last stage: at the loss 31.65 GiB of tensors, the 20
    layers' activations, the loss's, the fp32 shards and the head's 0.49 GiB reduce buffer alone; the peak 33.84 GiB
    in a layer's backward (its unit gathered, its fp32 reduce buffer, its 16-bit gradients); priced with every
    transient beside the loss, 35.55 GiB (+4.9% of the rank's traced peak with the allowance)."""
    if len(stages) != 1 or not costs[stages[0]].loss_working:  # (the loss's stage: the head's working set)
        return None
    c = costs[stages[0]]
    if grads_at_peak:
        at_loss = _without_transients(states)
        held = states[0].unit_grads * c.root_params if states[0].staging_held else 0.0  # (pipelines alone hold one)
    else:
        at_loss, held = _without_gradients(_without_transients(states)), 0.0
    return [(at_loss, c.loss_working, held), (states, c.layer_working - c.loss_held, None)]


@lru_cache(maxsize=256)
def _without_transients(states: tuple) -> tuple:
    """``states`` (a layout's: memory.state_bytes, moe.expert_states) without what only a layer's backward holds:
    gathered units (the root's too), its 16-bit weight gradients, its reduce buffer (_loss_moments gives a
    pipeline's held one as bytes)."""
    return tuple(dataclasses.replace(x, unit_weights=0.0, root_weights=0.0, unit_wgrads=0.0, unit_grads=0.0)
                 for x in states)


def prices_chunk_gathers(states: tuple) -> bool:
    """Do the layout's states (state_bytes, moe.expert_states) price pending whole-chunk gathers per moment
    (peak_matrices' ``gathers``)?"""
    return bool(states[0].chunk_gather or states[1].chunk_gather)


def _gather_moments(holding) -> bool:
    """Is ``holding`` (a rank's schedules.peak_matrices entry) one with whole-chunk gathers: (moments, 3 x stages +
    1), priced by :func:`gather_peaks`?"""
    return holding is not None and holding[1].shape[1] == 3 * len(holding[0]) + 1


def moment_state_bytes(costs: list[StageCost], stages: tuple[int, ...], states: tuple):
    """(2 x stages,) array: what a gather moment (schedules.peak_matrices with ``gathers``) holds per flag beside its
    activations: each chunk's pending gathers (gathered_bytes), then its reduce buffers (reduce_buffer_bytes). No
    recomputation mode changes them."""
    return np.concatenate([gathered_bytes(costs, stages, states), reduce_buffer_bytes(costs, stages, states)])


def gather_peaks(costs: list[StageCost], holding, flagged, parts: bool = True) -> tuple:
    """A rank's peaks under ZeRO-3 interleaved with whole-chunk gathers (``holding``: schedules.peak_matrices' entry
    with ``gathers``, its moments after the rank's first backward first; ``flagged``: moment_state_bytes of its
    stages), among the moments after its first backward, and among those before (None: none), which hold no
    gradient yet (the last step's reduce buffers were freed by its last backwards): each (activations, pending
    gathers' bytes, reduce buffers' bytes), or with ``parts`` False their sum (least_recompute asks thousands of
    times)."""
    order, held = holding
    k = len(order)
    acts = np.array([costs[s].act_bytes for s in order])
    totals = held[:, :3 * k] @ np.concatenate([acts, flagged])  # (moments,)
    late = int(held[:, 3 * k].sum())  # the first ``late`` moments
    out = []
    for lo, hi in ((0, late), (late, len(held))):
        if lo == hi:
            out.append(None)
            continue
        i = lo + int(totals[lo:hi].argmax())
        if parts:
            activations = float(held[i, :k] @ acts)
            buffers = float(held[i, 2 * k:3 * k] @ flagged[k:])
            out.append((activations, float(totals[i]) - activations - buffers, buffers))
        else:
            out.append(float(totals[i]))
    return tuple(out)


def peak_parts(costs: list[StageCost], stages: tuple[int, ...], flights: dict[int, int], holding,
               unfolded: dict[int, float] | None = None) -> tuple[float, float]:
    """:func:`held_activations` in two parts at the rank's peak moment: (activations, unfolded gradients). Holdings
    with whole-chunk gathers take :func:`gather_peaks` instead."""
    if holding is not None and (len(holding[1]) > 1 or holding[1].shape[1] > len(holding[0])):
        order, held = holding
        k = len(order)
        per = [costs[s].act_bytes for s in order]
        assert not _gather_moments(holding), "whole-chunk gathers: gather_peaks prices their moments"
        if held.shape[1] > k:  # zb-v: then per stage its micro-batches between B and W, and its unfolded gradients
            per += [costs[s].dw_pending for s in order]
            if unfolded:
                grads = held[:, 2 * k:] @ np.array([unfolded.get(s, 0.0) for s in order])  # (moments,)
                acts = held[:, :2 * k] @ np.array(per)  # (moments,)
                i = int((acts + grads).argmax())
                return float(acts[i]), float(grads[i])
            held = held[:, :2 * k]
        return float((held @ np.array(per)).max()), 0.0  # (moments,) -> peak
    return sum(flights.get(s, 0) * costs[s].act_bytes for s in stages), 0.0


class CostModel:
    """Prices layouts of one workload; caches per-block costs across calls (the search calls it a lot)."""

    def __init__(self, work: Workload):
        self.work = work
        self._blocks: dict[tuple, BlockCost] = {}
        self._tables: dict[tuple, _BlockTable] = {}
        self._block_flops: dict[tuple, list[float]] = {}  # (dtype, tp): per block, its FLOPs per sample and rank
        self._block_bases: dict[tuple, tuple] = {}  # block_cost's parts every recomputation mode shares
        self._fwd_flops: dict[str, int] = {}  # per dtype: the model's forward FLOPs per sample
        self._core_share: dict[str, float] = {}  # per dtype: the attention scores' share of them
        self._repeated: dict[str, bool] = {}  # per dtype: repeated_blocks
        self._dp_items: dict[tuple, list] = {}  # rank_dp_items per (layout, placement, tied end, root params)
        self._p2p: dict[tuple, float] = {}  # p2p_seconds by what it depends on
        self._stage_memo: dict[Layout, _LayoutStages] = {}  # stage_costs' stages, per layout
        self._stage_groups: dict[tuple, _LayoutStages] = {}  # the same, per kind of layout (_LayoutStages.of)
        self.bound_parts: dict[tuple, Any] = {}  # the search's lower bound of a layout, in parts (search.py)
        self.bound_classes: dict[tuple, Any] = {}  # what layouts sharing a block table share in it (search.py)
        self._rank_views: dict[tuple, Any] = {}  # (layer signature, ep, dtype): the MoE layer one rank runs
        self.step_affines: dict[tuple, Any] = {}  # the optimizer steps' Affines, by what they depend on (dp_sync.py)
        fw = work.cluster.gpu.efficiency
        self._framework = {event: fw.framework(event) for event in FRAMEWORK_EVENTS}  # seconds per event
        self.cpu_share = CpuShare(work.cluster)  # a CPU cluster's ranks share this machine's cores (cpu_share.py)
        self._experts_in: dict[str, bool] = {}  # per dtype: has the profile MoE blocks (has_experts)

    # ---- per block ----
    def block_cost(self, i: int, lay: Layout, place: Placement, recompute: str) -> BlockCost:
        work = self.work
        prof = work.profile(lay.dtype)
        layer = prof.layers[i]
        n = len(prof.layers)
        mode = recompute if 0 < i < n - 1 else "none"  # embeddings and the head are never recomputed
        # expert parallelism touches MoE blocks alone: the others' costs are shared by every (ep, etp) of a layout
        # (DeepSeek-V3 on 1024 GPUs: the non-MoE blocks took 1.9 of its search's 4.3 s of block costs, now 0.1 s)
        experts = (lay.ep, lay.etp, moe.paired_share(work.framework, lay)) if moe.is_moe(layer) else (1, 1, 0.0)
        # the job's size only where a group of consecutive ranks is placed within it (cp, ep, classifier shards):
        # the scaling chart's re-plans at fewer GPUs, on one cost model, share the other blocks' costs
        world = lay.num_gpus if lay.cp > 1 or moe.is_moe(layer) or (i == n - 1 and lay.head_parallel > 1) else 0
        key = (layer.signature, i == n - 1, i == 0, lay.micro_batch, lay.tp, lay.sequence_parallel, lay.dtype, mode,
               place.tp, place.gpus_per_node_busy, lay.head_parallel if i == n - 1 else 1, self._fsdp_units(lay),
               lay.pp > 1 and i == n - 1, lay.cp, world, *experts)
        hit = self._blocks.get(key)
        if hit is not None:
            return hit
        if i == n - 1 and lay.head_parallel > 1:
            if moe.is_moe(layer):  # the MoE block as one rank of the layout runs it (planner/moe.py)
                layer = self._rank_view(layer, lay)
            cost = self._sharded_head_cost(layer, lay, place)
            self._blocks[key] = cost
            return cost
        # what every recomputation mode of the block shares (its pass times, its collectives): once per block
        base_key = key[:7] + key[8:]
        shared = self._block_bases.get(base_key)
        if shared is None:
            shared = self._block_bases[base_key] = self._block_base(i, lay, place)
        layer, times, colls, tp_fwd, tp_bwd, softmax_fallback = shared
        cluster, b, t, sp = work.cluster, lay.micro_batch / lay.cp, lay.tp, lay.sequence_parallel
        fw = work.framework
        busy = place.gpus_per_node_busy
        sharded_ratio = (layer.param_bytes_sharded / t + layer.param_bytes - layer.param_bytes_sharded) / \
            layer.param_bytes if layer.param_bytes else 1.0
        tokens = b * work.tokens_per_sample  # this rank's tokens of the micro-batch
        moe_layer = moe.is_moe(layer)
        # what selective recomputation reruns of the attention's prologue (Framework.selective_extra)
        prologue = (fw.selective_extra == "prologue" and lay.cp == 1) or (
            fw.selective_extra == "mla" and bool(getattr(work.spec, "mla", False)))
        # What recomputation reruns in backward. An early-stopping checkpoint (Framework.recompute_early_stop)
        # stops once backward's tensors are rebuilt: nothing saves a dense MLP's down-projection output inside a
        # recomputed MLP, nor after it in a pre-norm layer, so neither that GEMM nor its output reduce reruns; an
        # MoE block's output is a weighted sum that keeps its experts' outputs: nothing skipped there.
        early_stop = fw.recompute_early_stop and not moe_layer and any(layer.fwd_ops.gemm_mlp) and (
            recomputes_mlp(mode) or (mode == "full" and work.spec.family != "bert"))
        # torchtitan's per-op selective checkpoint, where it describes the block (planner/op_sac.py)
        per_op = mode == "selective" and op_sac.applies(fw, work.spec, layer, lay.dtype, moe_layer)
        again = _rerun_collectives(layer, mode, colls, sp, fw, early_stop, per_op) if t > 1 else []
        # the MLP's GEMMs as FLOPs computed: a rank view's routed experts at the mean rank's load (moe.routed_work),
        # not the most loaded rank's its times carry
        routed = moe.routed_work(fw) / moe.routed_load(fw) if moe_layer else 1.0
        mlp_gemms = [f * (routed if m == 2 else 1.0) for f, x, m in zip(
            layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_mlp, layer.fwd_ops.gemm_moe or [0] * len(
                layer.fwd_ops.gemm_flops), strict=False) if x] if recomputes_mlp(mode) or early_stop else []
        recompute_time, rflops = 0.0, 0.0
        if mode == "full":  # its collectives join tp_bwd below
            # the tensor-parallel group's FLOPs: what each rank reruns (replicated GEMMs whole, unless on its
            # sequence shard) times t
            share = 1.0 if _replicated_on_shard(work, lay, layer) else \
                t * _tp_flops_share(work.profile(lay.dtype).layers[i].fwd_ops, t)
            recompute_time, rflops = times.fwd, layer.fwd_flops * b * share
        if per_op:  # every second matmul (wk, wo, w3) and all the element-wise work; SDPA's output kept
            rerun = op_sac.rerun_gemm_flops(work.spec, tokens)
            gemm_type = gemm_dtype(lay.dtype, layer.kind, False)
            recompute_time = times.elementwise_fwd + sum(gemm_seconds(f / t, cluster.gpu, gemm_type) for f in rerun)
            rflops = sum(rerun)
        elif recomputes_core(mode):  # the attention core, and its prologue where it has one (MLA's up-projection)
            core_flops = sum(f for f, c in zip(layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_core, strict=True) if c)
            recompute_time = times.core_fwd
            if prologue:
                core_flops += sum(layer.fwd_ops.prologue_gemm_flops)
                recompute_time += times.prologue_fwd
            rflops = core_flops * b
        if recomputes_mlp(mode):  # the MLP sublayer (alone, or beside the attention core: "selective+mlp")
            recompute_time, rflops = recompute_time + times.mlp_fwd, rflops + sum(mlp_gemms) * b
        if recomputes_norm_act(mode) and layer.kind == "transformer_layer":  # the separate norms, the experts' act
            why = norm_act_refusal(work, lay.dtype)
            if why:
                raise InvalidLayout(why, "recompute")
            eff = cluster.gpu.efficiency
            recompute_time += moe.norm_act_recompute_seconds(work.spec, lay, fw, tokens, moe_layer,
                                                             cluster.gpu.memory_bound_Bps,
                                                             eff.op_overhead_us * 1e-6)
        if early_stop:
            recompute_time -= times.mlp_last_gemm
            rflops -= mlp_gemms[-1] * b
        if work.overlap_tp:  # Megatron's async all-reduce of input gradients runs under the weight-gradient GEMMs
            tp_bwd = max(0.0, tp_bwd - times.bwd_weight)
        tp_bwd += sum(comm.collective(c.op, c.bytes * b, place.tp, cluster, busy) for c in again)
        # context parallelism's K/V exchange (context_parallel.py), never hidden by the TP overlap above
        cpc = context_parallel.layer_cost(self, lay, place, mode, 4 if lay.dtype == "fp32" else 2,
                                          times.core_fwd) if layer.kind == "transformer_layer" else None
        if cpc is not None:
            tp_fwd, tp_bwd = tp_fwd + cpc.fwd, tp_bwd + cpc.bwd
        epc = moe.layer_cost(self, layer, lay, place, b, mode, times)  # MoE token all-to-alls (planner/moe.py)
        tp_fwd, tp_bwd = tp_fwd + epc.fwd, tp_bwd + epc.bwd
        # Host-side framework costs of this block per micro-batch (measured per event by calibrate; zero on
        # GPUs unless measured): its tensor-parallel module calls, and its FSDP unit (ZeRO-2/3 shard each layer).
        host_costs = self._framework
        host = 0.0
        if t > 1 and host_costs["tp_module"] > 0:  # a recomputed forward calls its modules again
            rerun = 0.5 if mode == "full" else 0.25 if recomputes_mlp(mode) else 0.0
            host += work.tp_module_calls(i, sp) * host_costs["tp_module"] * (1 + rerun)
        if self._fsdp_units(lay) and layer.kind == "transformer_layer":
            host += host_costs["fsdp_unit"]
        host *= self.cpu_share.host(busy)
        tp_fwd += host / 2
        tp_bwd += host / 2
        tp_traffic = tuple(sum(c.bytes * b for c in colls + again if c.op == kind)
                           + (cpc.traffic.get(kind, 0.0) if cpc else 0.0) + epc.traffic.get(kind, 0.0)
                           for kind in TP_KINDS)
        # A pipeline send carries 1/t of the boundary with sequence parallelism (each rank its sequence
        # shard) or Megatron's scatter/gather; DTensor without SP sends the whole tensor from every TP rank.
        split = t if sp or fw.p2p_scatter_gather else 1

        def saved(u: str) -> float:
            """Bytes the block keeps per micro-batch until its backward, in recomputation mode ``u``."""
            if per_op and u == "selective":
                kept = op_sac.saved_bytes(work.spec, tokens, t, sp, 4 if lay.dtype == "fp32" else 2)
                return kept + (cpc.saved_bytes if cpc is not None else 0.0)
            kept = layer_activation_bytes(layer, b, t, sp, u, work.attention, fw.sp_saves_gathered_input, prologue,
                                          softmax_fallback, whole_latents=not _replicated_on_shard(work, lay, layer))
            if fw.saved_activations == "fused" and work.attention == "flash" and layer.kind == "transformer_layer":
                kept = fused_layer_bytes(work.spec, tokens, t, sp, u, moe_layer,  # Transformer Engine's modules
                                         moe.padded_copies(fw))
            if cpc is not None and u != "full":  # the whole sequence's K/V an attention kernel saves (all-gather)
                kept += cpc.saved_bytes
            if lay.dtype == "fp8" and layer.kind == "transformer_layer":  # TE keeps FP8 copies of linear inputs
                kept -= fp8.saved_bytes_saving(work.spec, fw, tokens, t, sp, u, moe_layer)
            return kept

        acts = saved(mode)
        # while a block's backward runs, what its recomputation rebuilt: the whole forward's (full) or the MLP
        # sublayer's (mlp; with selective, the MLP's: the attention core's are rebuilt in turn, after it)
        working = saved("none") if mode == "full" else \
            saved("selective" if recomputes_core(mode) else "none") - acts if recomputes_mlp(mode) else \
            saved("none") - acts if recomputes_norm_act(mode) or per_op else 0.0
        if layer.kind == "lm_head":
            kept, loss_working = loss_bytes(b * work.tokens_per_sample, work.spec.vocab_size, t, fw, lay.pp > 1)
            acts, working = acts + kept, working + loss_working
        largest_param, largest_expert = moe.largest_tensors_on_rank(layer, lay, fw, t)
        cost = BlockCost(
            fwd=times.fwd, bwd_input=times.bwd_input, bwd_weight=times.bwd_weight, recompute=recompute_time,
            recompute_flops=rflops, tp_fwd=tp_fwd, tp_bwd=tp_bwd, act_bytes=acts, act_working=working,
            params=moe.params_on_rank(layer, lay, sharded_ratio, fw), output_bytes=layer.output_bytes * b / split,
            tp_traffic=tp_traffic, root=layer.kind != "transformer_layer",
            replicated=_replicated_params(layer) - layer.moe_params - _whole_latent_params(work, lay, layer)
            if t > 1 and layer.kind != "embedding" else 0.0,
            cp_time=cpc.fwd + cpc.bwd if cpc else 0.0, cp_send_recv=cpc.traffic.get("send_recv", 0.0) if cpc else 0.0,
            experts=moe.experts_on_rank(layer, lay, fw), moe_shared=moe.tp_summed_on_rank(layer, lay, fw),
            ep_time=epc.seconds, a2a_bytes=epc.traffic.get("all_to_all", 0.0), host=host,
            dw_pending=pending_weight_grad_bytes(layer, b, t, sp), largest_param=largest_param,
            largest_expert=largest_expert)
        self._blocks[key] = cost
        return cost

    def _block_base(self, i: int, lay: Layout, place: Placement) -> tuple:
        """What block ``i``'s costs share across recomputation modes (block_cost's key less the mode): the layer as
        one rank runs it, its pass times (measured where this machine's were), its tensor-parallel collectives and
        their forward and backward seconds, and whether its softmax falls back to PyTorch's path."""
        work = self.work
        layer = work.profile(lay.dtype).layers[i]
        if moe.is_moe(layer):  # the MoE block as one rank of the layout runs it (planner/moe.py)
            layer = self._rank_view(layer, lay)
        # context parallelism: each rank computes and keeps what b/cp whole sequences would (context_parallel.py)
        gpu, b, t, sp = work.cluster.gpu, lay.micro_batch / lay.cp, lay.tp, lay.sequence_parallel
        fw = work.framework
        causal = context_parallel.attention_work_fraction(work, lay)

        def falls_back(tp: int) -> bool:  # the unfused attention's softmax on PyTorch's path (compute.py)
            return work.attention == "unfused" and layer.kind == "transformer_layer" and softmax_falls_back(
                fw.fused_softmax, work.spec.num_attention_heads // tp, lay.micro_batch,
                work.tokens_per_sample // lay.cp, lay.dtype)

        softmax_fallback = falls_back(t)
        times = estimate_pass_times(layer, b, t, sp, gpu, lay.dtype, work.attention, fw.elementwise_traffic, causal,
                                    fw.fp8_experts, softmax_fallback, _replicated_on_shard(work, lay, layer))
        measured = work.measurement(lay.micro_batch, lay.dtype) if lay.cp == 1 else None
        ref = None  # the share of a CPU's cores the times below were taken with (None: the cluster's figures')
        if measured is not None and i < len(measured["layers"]) and measured["layers"][i].get("fwd_ms") is not None:
            m = measured["layers"][i]
            base = estimate_pass_times(layer, b, 1, False, gpu, lay.dtype, work.attention, fw.elementwise_traffic,
                                       causal, fw.fp8_experts, falls_back(1))
            times = measured_pass_times(m["fwd_ms"], m["bwd_ms"], base, times)
            ref = self.cpu_share.measured_ref(measured)
        if self.cpu_share.cpu:  # the cores this rank gets beside the others on the machine, against its figures'
            times = times.scaled(self.cpu_share.compute(place.gpus_per_node_busy, ref))
        tokens = b * work.tokens_per_sample  # this rank's tokens of the micro-batch
        moe_layer = moe.is_moe(layer)
        hbm_Bps = gpu.memory_bound_Bps
        if lay.dtype == "fp8" and layer.kind == "transformer_layer":  # quantising the FP8 GEMMs' operands (fp8.py)
            cast_f, cast_b = fp8.cast_seconds(work.spec, fw, tokens, t, sp, hbm_Bps,
                                              gpu.efficiency.op_overhead_us * 1e-6, moe_layer,
                                              moe.local_experts(work.spec, lay) if moe_layer else 1)
            times = dataclasses.replace(times, fwd=times.fwd + cast_f, bwd_input=times.bwd_input + cast_b)
        if moe_layer and fw.moe_kernels == "fused":  # the fused MoE kernels' traffic (fused_moe.py via moe.py)
            moe_f, moe_b = moe.fused_kernel_seconds(work.spec, lay, fw, tokens, hbm_Bps,
                                                    gpu.efficiency.op_overhead_us * 1e-6)
            times = dataclasses.replace(times, fwd=times.fwd + moe_f, bwd_input=times.bwd_input + moe_b,
                                        mlp_fwd=times.mlp_fwd + moe_f)
        colls = self._tp_collectives(layer, sp) if t > 1 else []
        busy = place.gpus_per_node_busy
        tp_fwd = sum(comm.collective(c.op, c.bytes * b, place.tp, work.cluster, busy) for c in colls
                     if c.phase == "fwd")
        tp_bwd = sum(comm.collective(c.op, c.bytes * b, place.tp, work.cluster, busy) for c in colls
                     if c.phase == "bwd")
        return layer, times, colls, tp_fwd, tp_bwd, softmax_fallback

    def _tp_collectives(self, layer, sp: bool) -> list:
        """A block's tensor-parallel collectives per sample (profiler/tp_view.region_collectives), an MLA
        attention region's input side at its latents' width where the framework reduces them there."""
        fw, spec = self.work.framework, self.work.spec
        latent_width = 0
        if getattr(spec, "mla", False) and layer.kind == "transformer_layer":
            latent_width = (spec.q_lora_rank or spec.hidden_size) + spec.kv_lora_rank + spec.qk_rope_head_dim
        out, attention_seen = [], False
        for style, ib, ob, tok in layer.region_io:
            latent = None
            if latent_width and style == "region" and not attention_seen:  # a layer's attention region comes first
                latent, attention_seen = ib * latent_width / spec.hidden_size, True  # ib: tokens x h elements
            out += region_collectives(style, ib, ob, tok, sp, fw.embedding_sp_reduce, latent, fw.mla_tp_input)
        return out

    def _rank_view(self, layer, lay: Layout):
        """moe.rank_view of an MoE ``layer``, once per expert-parallel degree and dtype (all it depends on besides
        the model): the search prices thousands of layouts that share one."""
        key = (layer.signature, lay.ep, lay.dtype)
        got = self._rank_views.get(key)
        if got is None:
            got = self._rank_views[key] = moe.rank_view(layer, lay, self.work.framework, self.work.spec)
        return got

    def host_cost(self, event: str) -> float:
        """Seconds the framework costs on the host per ``event`` (calibrated; 0 where not measured)."""
        return self._framework[event]

    def _fsdp_units(self, lay: Layout) -> bool:
        """Does each transformer layer pay an FSDP unit's host cost (ZeRO-2/3 shard layer by layer)?"""
        return lay.data_ranks > 1 and lay.zero >= 2 and self._framework["fsdp_unit"] > 0

    def stage_host_overhead(self, lay: Layout) -> float:
        """Host-side framework seconds a stage pays per micro-batch beyond its blocks: the micro-batch's own
        handling, one forward and one backward action of the pipeline schedule, and the data-parallel
        wrapper's root unit (FSDP2 for ZeRO-2/3; FSDP2's replicate when ZeRO-0/1 runs with a pipeline or
        tensor parallelism)."""
        fw = self._framework
        # pp = 1: the trainer's own gradient-accumulation loop handles each micro-batch; pp > 1: the schedule
        t = 2 * fw["pp_action"] if lay.pp > 1 else fw["micro_batch"]
        if lay.data_ranks > 1 and (lay.zero >= 2 or lay.pp > 1 or lay.tp > 1) and lay.head_parallel == 1:
            t += fw["fsdp_unit"]
        if self.cpu_share.cpu and t:
            t *= self.cpu_share.host(layout_placement(self.work.cluster, lay).gpus_per_node_busy)
        return t

    def _sharded_head_cost(self, layer, lay: Layout, place: Placement) -> BlockCost:
        """The classifier sharded by class over k data-parallel ranks (hybrid parallelism, Krizhevsky 2014's
        "one weird trick": data-parallel trunk, model-parallel classifier).

        Each rank all-gathers the k ranks' features (k·b samples), computes the logits of its C/k classes
        for all of them — the same FLOPs as the whole classifier on its own b samples — and the softmax
        cross-entropy reduces three numbers per sample over the group (max, sum of exponentials, target
        logit), so the logits are never gathered; in backward the feature gradients are reduce-scattered
        back. Its weights and their gradients are 1/k of the classifier's.
        """
        work, k, b = self.work, lay.head_parallel, lay.micro_batch
        gpu, cluster = work.cluster.gpu, work.cluster
        times = estimate_pass_times(layer, b * k, k, False, gpu, lay.dtype, work.attention)
        times = times.scaled(self.cpu_share.compute(place.gpus_per_node_busy))  # 1 but on a CPU (cpu_share.py)
        group = consecutive_group(cluster, k, world=lay.num_gpus)
        busy = place.gpus_per_node_busy
        feats = sum(ib for style, ib, _, _ in layer.region_io if style == "class_sharded") * b * k
        samples = sum(tok for style, _, _, tok in layer.region_io if style == "class_sharded") * b * k
        tp_fwd = comm.gather(feats, group, cluster, busy) + comm.all_reduce(3 * 4 * samples, group, cluster, busy)
        tp_bwd = comm.gather(feats, group, cluster, busy)
        sharded = (layer.param_bytes_sharded / k + layer.param_bytes - layer.param_bytes_sharded) / layer.param_bytes
        acts = layer_activation_bytes(layer, b * k, k, False, "none", work.attention) + feats
        return BlockCost(fwd=times.fwd, bwd_input=times.bwd_input, bwd_weight=times.bwd_weight, recompute=0.0,
                         recompute_flops=0.0, tp_fwd=tp_fwd, tp_bwd=tp_bwd, act_bytes=acts, act_working=0.0,
                         params=layer.params * sharded, output_bytes=layer.output_bytes * b, root=True,
                         largest_param=moe.largest_tensors_on_rank(layer, lay, work.framework, k)[0])

    def repeated_blocks(self, lay: Layout) -> bool:
        """Is the model embedding + identical layers + head (the ILP's integer-count form)? (Cached per dtype: the
        polish asks it of every neighbouring split.)"""
        got = self._repeated.get(lay.dtype)
        if got is None:
            layers = self.work.profile(lay.dtype).layers
            got = self._repeated[lay.dtype] = (self.work.spec.is_transformer and len(layers) >= 3
                                               and layers[0].kind == "embedding"
                                               and len({x.signature for x in layers[1:-1]}) == 1)
        return got

    def has_experts(self, dtype: str) -> bool:
        """Does the model's profile in ``dtype`` hold MoE blocks (moe.is_moe: what block_cost prices per ep)?"""
        got = self._experts_in.get(dtype)
        if got is None:
            got = self._experts_in[dtype] = any(moe.is_moe(x) for x in self.work.profile(dtype).layers)
        return got

    def _table_key(self, lay: Layout, place: Placement) -> tuple:
        """What a layout's block table depends on besides the recomputation mode (block_cost's key)."""
        # the job's size too where its consecutive groups (cp, ep, classifier shards) are placed within its own ranks
        world = lay.num_gpus if lay.cp > 1 or lay.head_parallel > 1 or self.has_experts(lay.dtype) else 0
        return (lay.micro_batch, lay.tp, lay.sequence_parallel, lay.dtype, place.tp, place.gpus_per_node_busy,
                lay.head_parallel, self._fsdp_units(lay), lay.pp > 1, lay.cp, lay.ep, lay.etp, world,
                moe.paired_share(self.work.framework, lay))

    def block_table(self, lay: Layout, place: Placement, mode: str, key: tuple | None = None) -> _BlockTable:
        """Prefix sums of every block's costs, so a stage of contiguous blocks is priced in O(1). ``key``:
        ``_table_key(lay, place)`` when the caller has it already."""
        key = (key or self._table_key(lay, place), mode)
        table = self._tables.get(key)
        if table is None:
            layers = self.work.profile(lay.dtype).layers
            n = len(layers)
            costs: list[BlockCost] = []
            for i in range(n):  # a middle layer like the one before it costs the same (block_cost's key)
                same = 1 < i < n - 1 and layers[i].signature == layers[i - 1].signature
                costs.append(costs[-1] if same else self.block_cost(i, lay, place, mode))
            table = _BlockTable(working=[c.act_working for c in costs], costs=costs)
            self._tables[key] = table
        return table

    def totals(self, lay: Layout, mode: str, place: Placement | None = None, key: tuple | None = None
               ) -> dict[str, float]:
        """Whole-model sums of the per-block costs (SUMMED fields) in recomputation ``mode``, the largest
        working set of a block (``working``) and the last block's parameters on a rank (``head_params``):
        what the search's lower bound needs. ``place``, ``key``: the layout's placement and table key when
        the caller has them (the search asks for every mode of thousands of layouts)."""
        table = self.block_table(lay, place or layout_placement(self.work.cluster, lay), mode, key)
        if table.whole is None:
            out = dict(zip(SUMMED, table.sums(), strict=True))
            out["working"] = max(table.working)
            out["head_params"] = table.costs[-1].params
            table.whole = out
        return table.whole

    # ---- per stage ----
    def stage_costs(self, lay: Layout, stages: list[list[int]], stage_recompute: list[str] | None = None
                    ) -> list[StageCost]:
        """Each stage's costs (its blocks' sums from the block tables, the framework's per-stage overhead, the
        point-to-point sends to its pipeline neighbours). A stage's costs depend only on the layout, its index, its
        mode and its first and last block (stages are contiguous: what it receives is the block before its
        first): priced once per layout and reused — the search's polish and its least-recomputation fits price
        thousands of splits that differ from one another in one or two stages. The objects returned are shared:
        read-only to every caller."""
        priced = self._layout_stages(lay).priced
        last = len(stages) - 1
        return [priced(s, blocks, stage_recompute[s] if stage_recompute else lay.recompute, s < last)
                for s, blocks in enumerate(stages)]

    def stage_cost(self, lay: Layout, stages: list[list[int]], s: int, mode: str) -> StageCost:
        """Stage ``s`` of ``stages`` in recomputation ``mode``, alone: the object :meth:`stage_costs` gives for it
        (least_recompute prices the stages it tries in a dearer mode one at a time)."""
        return self._layout_stages(lay).priced(s, stages[s], mode, s < len(stages) - 1)

    def _layout_stages(self, lay: Layout) -> _LayoutStages:
        memo = self._stage_memo.get(lay)
        if memo is None:
            memo = self._stage_memo[lay] = _LayoutStages.of(self, lay)
        return memo

    def p2p_seconds(self, lay: Layout, nbytes: float, cross_node: bool, place: Placement) -> float:
        """What a stage waits for to send (or receive) one micro-batch's boundary of ``nbytes`` bytes: the
        transfer, or — where the framework overlaps an interleaved pipeline's sends with the next chunk's
        compute (Megatron-Core's overlap_p2p_comm) — only its latency (the stage and the ILP both use this)."""
        overlapped = self.work.framework.overlap_p2p and lay.virtual_stages > 1 and nbytes > 0
        # across nodes, the node's network is shared by the ranks sending out of it at once (placement.py)
        senders = max(1, place.pp_senders_per_node)
        key = (nbytes, cross_node, senders, overlapped)  # all it depends on: thousands of layouts
        t = self._p2p.get(key)
        if t is None:
            t = comm.p2p(nbytes, cross_node, self.work.cluster, senders)
            if overlapped:
                link = comm.network_share(self.work.cluster, senders) if cross_node else \
                    self.work.cluster.intra_node
                t = min(t, link.latency_s)
            self._p2p[key] = t
        return t

    # ---- what a pipeline rank holds, sends and waits for (concerns.py, dp_sync.py) ----
    def rank_load(self, lay: Layout, costs: list[StageCost], stages: tuple[int, ...], makespan: float) -> RankLoad:
        return RankLoad(params=sum(costs[s].params - costs[s].experts for s in stages),
                        fwd=sum(costs[s].fwd for s in stages),
                        bwd=sum(costs[s].bwd_input + costs[s].bwd_weight for s in stages),
                        window=sum(costs[s].t_b + costs[s].t_w for s in stages), makespan=makespan,
                        replicated=sum(costs[s].replicated_params for s in stages),
                        experts=sum(costs[s].experts for s in stages),
                        moe_shared=sum(costs[s].moe_shared for s in stages))

    def dp_items(self, lay: Layout, place: Placement, costs: list[StageCost], stages: tuple[int, ...], rank: int):
        """The data-parallel sync, ZeRO gathers and tied-embedding sync of pipeline rank ``rank``."""
        return self.rank_dp_items(lay, place, rank, sum(costs[s].root_params for s in stages))

    def rank_dp_items(self, lay: Layout, place: Placement, rank: int, root: float):
        """:meth:`dp_items` from the rank's index and its root-unit parameters (the only part of it that
        depends on the stage split, and only without a pipeline); the stage ILP prices these too. Ranks
        alike (holding the tied weight's ends or not, the same root parameters) share one list."""
        ends = {stage_rank(lay.schedule if lay.pp > 1 else "1f1b", s, lay.pp) for s in (0, lay.num_stages - 1)}
        return self.dp_items_of(lay, place, rank in ends and len(ends) == 2, root)

    def dp_items_of(self, lay: Layout, place: Placement, tied_end: bool, root: float):
        """:meth:`rank_dp_items` of a rank that holds an end of a split tied weight (``tied_end``) or not."""
        key = (lay, place, tied_end, root)
        hit = self._dp_items.get(key)
        if hit is None:
            hit = self._dp_items[key] = self._rank_dp_items(lay, place, tied_end, root)
        return hit

    def _rank_dp_items(self, lay: Layout, place: Placement, tied_end: bool, root: float):
        prof = self.work.profile(lay.dtype)
        n_blocks = len(prof.layers)
        tied = prof.layers[-1].tied_params
        tied_elements = tied / lay.tp if tied and tied_end else 0.0
        head = self.block_cost(n_blocks - 1, lay, place, "none").params if lay.head_parallel > 1 else 0.0
        items = dp_exposures(self, lay, place, root, tied_elements, head)
        if lay.sequence_parallel and self.work.framework.states == "executor":
            items.append(sequence_parallel_weight_sync(self, lay, place))
        if self.work.spec.is_transformer and self.work.spec.is_moe:  # experts over edp, MoE weights over tp (moe.py)
            last = max(moe.experts_on_rank(x, lay, self.work.framework) for x in prof.layers)
            items += moe.expert_exposures(self, lay, place, last)
            summed = moe.tp_summed_exposure(self, lay, place)
            items += [summed] if summed is not None else []
        return items

    def rank_memory_breakdowns(self, lay: Layout, costs: list[StageCost], ranks: list[tuple[int, ...]],
                               flights: list[dict[int, int]], sim: SimResult | None = None,
                               holdings: list[tuple[tuple[int, ...], Any]] | None = None) -> list[dict[str, float]]:
        """GiB by kind on each pipeline rank (memory.rank_memory): its model states, its stages' activations at
        the rank's peak — the most over ``holdings`` (schedules.peak_matrices, per rank its stages and the
        micro-batches each holds at every moment that may be the peak; default: ``flights``' one moment), or the
        simulated peak — and the largest working set. A rank's memory depends only on its own stages."""
        states = layout_states(self.work.framework, lay)
        out = []
        for r, stages in enumerate(ranks):
            simulated = (sim.peak_activation_bytes[r], sim.peak_unfolded_bytes[r] if sim.peak_unfolded_bytes else 0.0) \
                if sim is not None and sim.peak_activation_bytes else None
            held = holdings[r] if holdings is not None else None
            breakdown = self._rank_bytes(costs, stages, flights[r], held, states,
                                         self.grads_at_activation_peak(lay, stages, flights[r]), simulated)
            out.append({k: x / GiB for k, x in breakdown.items()})
        return out

    def _rank_bytes(self, costs: list[StageCost], stages: tuple[int, ...], flights: dict[int, int], holding,
                    states: tuple, grads_at_peak: bool, simulated: tuple[float, float] | None = None
                    ) -> dict[str, float]:
        """Bytes by kind on one pipeline rank (rank_memory_breakdowns' per rank): ``holding`` its peak moments
        (schedules.peak_matrices' entry, or None for ``flights``' one), ``states`` the layout's (state_bytes,
        moe.expert_states), ``grads_at_peak`` grads_at_activation_peak of the rank, ``simulated`` its simulated
        peak where there is one (activations, unfolded gradients: SimResult's). With whole-chunk gathers (ZeRO-3
        interleaved: gather_peaks) the larger of the peaks after the rank's first backward and before it, the latter
        without gradients."""
        moments = _loss_moments(costs, stages, states, grads_at_peak)
        if moments is not None:  # the loss's stage alone on the rank: the loss's moment and the layers' backward
            acts, unfolded = simulated if simulated is not None else \
                peak_parts(costs, stages, flights, holding, unfolded_bytes(costs, stages, states))
            got = [self._rank_bytes_at(costs, stages, acts + extra, held, grads_at_peak, unfolded, buffers=buffers)
                   for held, extra, buffers in moments]
            return max(got, key=lambda out: sum(out.values()))
        working = max(costs[s].act_working for s in stages)
        if _gather_moments(holding):
            # the moments are exact walks of the rank's order (the event simulation's peak is one of them)
            late, early = gather_peaks(costs, holding, moment_state_bytes(costs, holding[0], states))
            out = self._rank_bytes_at(costs, stages, late[0] + working, states, True, gathered=late[1],
                                      buffers=late[2])
            if early is not None:
                before = self._rank_bytes_at(costs, stages, early[0] + working, _without_gradients(states), True,
                                             gathered=early[1], buffers=early[2])
                out = before if sum(before.values()) > sum(out.values()) else out
            return out
        acts, unfolded = simulated if simulated is not None else \
            peak_parts(costs, stages, flights, holding, unfolded_bytes(costs, stages, states))
        return self._rank_bytes_at(costs, stages, acts + working, states, grads_at_peak, unfolded)

    def _rank_bytes_at(self, costs: list[StageCost], stages: tuple[int, ...], activations: float, states: tuple,
                       grads_at_peak: bool, unfolded: float = 0.0, start_moment: bool = True, gathered: float = 0.0,
                       buffers: float | None = None) -> dict[str, float]:
        """:meth:`_rank_bytes` with the rank's ``activations`` at its peak given (working sets included), and the
        ``unfolded`` 16-bit gradients then (zb-v: peak_parts'), the ``gathered`` chunks' bytes and the reduce
        ``buffers``' (ZeRO-3 interleaved: gather_peaks'; None: memory.staged_unit_params' per chunk);
        ``start_moment``: memory.rank_memory's."""
        unit = max(costs[s].largest_unit for s in stages)
        first_freed = None if grads_at_peak else sum(costs[s].act_bytes for s in stages)
        experts = sum(costs[s].experts for s in stages)
        staged = 0.0 if buffers is not None else staged_unit_params(
            states[0], max(costs[s].largest_reduce_unit for s in stages), [costs[s].root_params for s in stages])
        return rank_memory(states[0], sum(costs[s].params for s in stages) - experts, unit, activations,
                           self.work.cluster.gpu, first_freed, experts=experts, expert_states=states[1],
                           root_params=sum(costs[s].root_params for s in stages), staged_params=staged,
                           unfolded_grads=unfolded, start_moment=start_moment, gathered_weights=gathered,
                           staged_bytes=buffers or 0.0, largest_param=max(costs[s].largest_param for s in stages),
                           largest_expert=max(costs[s].largest_expert for s in stages))

    def _fit_by_activations(self, costs: list[StageCost], stages: tuple[int, ...], flights: dict[int, int],
                            holding, states: tuple, cap_gib: float) -> Callable[[], bool]:
        """:meth:`least_recompute`'s test of one rank whose gradients meet its activation peak: does it fit ``cap_gib``
        with its stages' costs as ``costs`` has them when asked (the caller changes their modes in it)? The rank's
        bytes are then rank_memory's without activations, which no recomputation mode changes (parameters and
        states), priced once, plus 1 + FRAGMENTATION times its activations, priced at each test (the allocator's
        share of every tensor byte: memory.untracked_bytes); tests/test_planner.py checks it against
        :meth:`_rank_bytes`."""
        room = cap_gib * GiB
        per_byte = 1 + FRAGMENTATION
        if states[0].start_weights or states[1].start_weights:  # the step's first moment: no mode changes it
            experts = sum(costs[s].experts for s in stages)
            first = sum(start_bytes(states[0], sum(costs[s].params for s in stages) - experts, experts,
                                    states[1]).values())
            if first + untracked_bytes(self.work.cluster.gpu, first) > room:
                return lambda: False
        if states[0].step_allocates or states[1].step_allocates:  # the optimizer step: no mode changes it either
            experts = sum(costs[s].experts for s in stages)
            last = sum(step_bytes(states[0], sum(costs[s].params for s in stages) - experts,
                                  max(costs[s].largest_param for s in stages), experts,
                                  max(costs[s].largest_expert for s in stages), states[1]).values())
            if last + untracked_bytes(self.work.cluster.gpu, last) > room:
                return lambda: False

        if _gather_moments(holding):
            flagged = moment_state_bytes(costs, holding[0], states)  # no recomputation mode changes them
            # the reduce buffers are the moments' (gather_peaks)
            base = sum(self._rank_bytes_at(costs, stages, 0.0, states, True, start_moment=False, buffers=0.0).values())
            early_base = sum(self._rank_bytes_at(costs, stages, 0.0, _without_gradients(states), True,
                                                 start_moment=False, buffers=0.0).values())

            def fits_gathers() -> bool:  # each peak's pending gathers and reduce buffers priced as tensors alike
                late, early = gather_peaks(costs, holding, flagged, parts=False)
                working = max(costs[s].act_working for s in stages)
                return base + per_byte * (late + working) <= room and \
                    (early is None or early_base + per_byte * (early + working) <= room)

            return fits_gathers

        unfolded = unfolded_bytes(costs, stages, states)  # what recomputation does not change
        moments = _loss_moments(costs, stages, states, True)
        if moments is not None:  # the loss's stage alone: the loss's moment and the layers' backward (_rank_bytes)
            bases = [sum(self._rank_bytes_at(costs, stages, 0.0, held, True, start_moment=False,
                                             buffers=buffers).values()) for held, _, buffers in moments]

            def fits_both() -> bool:  # the stage's mode changes its working sets: read at each test
                acts = held_activations(costs, stages, flights, holding, unfolded)
                extras = [x for _, x, _ in _loss_moments(costs, stages, states, True)]
                return all(b + per_byte * (acts + x) <= room for b, x in zip(bases, extras, strict=True))

            return fits_both
        base = sum(self._rank_bytes_at(costs, stages, 0.0, states, True, start_moment=False).values())

        def fits() -> bool:  # (unfolded gradients, when held at the peak, priced as tensors alike)
            acts = held_activations(costs, stages, flights, holding, unfolded) + \
                max(costs[s].act_working for s in stages)
            return base + per_byte * acts <= room

        return fits

    def least_recompute(self, lay: Layout, stages: list[list[int]], modes: tuple[str, ...] | list[str]
                        ) -> tuple[list[str], list[StageCost]] | None:
        """Per stage, the least recomputation with which every pipeline rank fits its GPU on these stages (None:
        some rank fits in no mode). ``modes``: fastest first. A rank's memory depends only on its own stages, so
        each rank is fitted alone: where the fastest mode does not fit, its stages move to the next mode one at a
        time, those holding the most micro-batches at the rank's peak first (each frees the most activations per
        block recomputed), then on to the mode after. Stages of one rank may differ (the ILP's space too).
        Returns the modes and the stages' costs in them (for :meth:`evaluate`)."""
        p, v = lay.pp, lay.virtual_stages
        schedule = lay.schedule if p > 1 else "1f1b"
        ranks = [rank_stages(lay.schedule, r, p, v) for r in range(p)]
        flights = in_flight(schedule, p, v, lay.num_micro_batches)
        states = layout_states(self.work.framework, lay)
        holdings = peak_matrices(schedule, p, v, lay.num_micro_batches, prices_chunk_gathers(states))
        chosen, current = [modes[0]] * len(stages), self.stage_costs(lay, stages, [modes[0]] * len(stages))
        cap = self.work.memory_limit_GiB
        grads_at_peak = [self.grads_at_activation_peak(lay, ranks[r], flights[r]) for r in range(p)]

        def fits_by_breakdown(r: int) -> Callable[[], bool]:  # where its first backward frees activations
            def fits() -> bool:  # a rank's memory depends on its own stages alone: only they are priced again
                got = self._rank_bytes(current, ranks[r], flights[r], holdings[r], states, False)
                return sum(x / GiB for x in got.values()) <= cap
            return fits

        for r in range(p):
            fits = self._fit_by_activations(current, ranks[r], flights[r], holdings[r], states, cap) \
                if grads_at_peak[r] else fits_by_breakdown(r)
            if fits():
                continue
            order = sorted(ranks[r], key=lambda s: (-flights[r].get(s, 0), s))
            for u in modes[1:]:
                for s in order:
                    chosen[s], current[s] = u, self.stage_cost(lay, stages, s, u)
                    if fits():
                        break
                else:
                    continue
                break
            else:
                return None
        return chosen, current

    def closed_form_floor(self, lay: Layout, costs: list[StageCost]) -> float:
        """A lower bound on :meth:`evaluate`'s closed-form iteration time for these stage costs, never above it even
        in floating point: evaluate ends at the latest rank's end (its closed-form finish plus its exposed
        data-parallel wait) plus the slowest rank's optimizer step, and pipeline rank 0 finishes at the makespan;
        this is rank 0's end plus that step, by the same operations. The polish tries hundreds of neighbouring
        splits whose pipeline is no slower than the best's but whose price is the same (the demo: 156 of its 202
        full prices); this rejects them without their memory breakdowns and the other ranks' waits.
        Interleaved 1F1B's rounds (schedules.rounds_excess) only lengthen the makespan, and of what evaluate adds to
        it only an asynchronous parameter server's wait depends on it (its staleness hides the wait behind the
        makespan): elsewhere the ranks' sums' makespan keeps this a bound, without simulating the rounds."""
        p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
        ranks, rank_fwd, _, rank_w, rank_time = _rank_times(lay, costs)
        schedule = lay.schedule if p > 1 else "1f1b"
        makespan = _closed_form_pipeline(schedule, p, v, m, costs, rank_time, rank_fwd, rank_w) \
            if lay.dp_mode == "ps" else closed_form_makespan(schedule, p, v, m, rank_time, rank_fwd, rank_w)
        loads = [self.rank_load(lay, costs, ranks[r], makespan) for r in range(p)]
        step, expert_step = optimizer_step(self, lay), moe.expert_optimizer_step(self, lay)
        items = self.dp_items(lay, layout_placement(self.work.cluster, lay), costs, ranks[0], 0)
        return (makespan - 0.0 + exposed_seconds(items, loads[0])) + max(step.at(ld) + expert_step.at(ld)
                                                                         for ld in loads)

    def ranks_fit(self, lay: Layout, stages: list[list[int]], stage_recompute: list[str] | None = None,
                  costs: list[StageCost] | None = None, only: list[int] | None = None) -> list[bool]:
        """Does each pipeline rank fit its GPU with these stages (closed-form in-flight counts)? The memory
        part of :meth:`evaluate` alone, for trying recomputation modes without pricing time. ``costs``: the
        stages' costs where the caller has them; ``only``: these ranks' answers alone (a rank's memory depends only
        on its own stages)."""
        p, v = lay.pp, lay.virtual_stages
        schedule = lay.schedule if p > 1 else "1f1b"
        asked = list(range(p)) if only is None else only
        ranks = [rank_stages(lay.schedule, r, p, v) for r in asked]
        costs = costs if costs is not None else self.stage_costs(lay, stages, stage_recompute)
        flights = in_flight(schedule, p, v, lay.num_micro_batches)
        cap = self.work.memory_limit_GiB
        held = peak_matrices(schedule, p, v, lay.num_micro_batches,
                             prices_chunk_gathers(layout_states(self.work.framework, lay)))
        return [sum(b.values()) <= cap for b in self.rank_memory_breakdowns(
            lay, costs, ranks, [flights[r] for r in asked], holdings=[held[r] for r in asked])]

    def grads_at_activation_peak(self, lay: Layout, stages: tuple[int, ...], flights: dict[int, int]) -> bool:
        """Does a rank's activation peak already hold gradients — a later backward at the same number of
        micro-batches in flight, after an earlier one produced (accumulated) gradients, or DistributedDataParallel's
        buckets, allocated with it (memory.ddp_buckets)? Without (one micro-batch; GPipe; a pipeline rank that
        reaches its peak only once) the first backward frees one micro-batch's activations as the gradients appear
        (memory.rank_memory). The search's bound asks grads_meet_peak alone (never more memory than this)."""
        fw = self.work.framework
        return fw.grad_buffer_at_wrap or ddp_buckets(fw, lay) or grads_meet_peak(
            lay.schedule, lay.pp, lay.virtual_stages, lay.num_micro_batches, stages, flights)

    def rank_traffic(self, lay: Layout, costs: list[StageCost], stages: tuple[int, ...], dp_items,
                     load: RankLoad) -> dict[str, float]:
        """Bytes per iteration by kind (COMM_KINDS) of one pipeline rank: tensor-parallel collectives,
        pipeline sends and receives, and the data-parallel items."""
        m = lay.num_micro_batches
        out = dict.fromkeys(COMM_KINDS, 0.0)
        for s in stages:
            for kind, nbytes in zip(TP_KINDS, costs[s].tp_traffic, strict=True):
                out[kind] += m * nbytes
            out["send_recv"] += m * costs[s].p2p_bytes
            out["all_to_all"] += m * costs[s].a2a_bytes
        for kind, nbytes in traffic(dp_items, load).items():
            out[kind] += nbytes
        return out

    def rank_flops(self, lay: Layout, costs: list[StageCost], stages: tuple[int, ...]) -> float:
        """The FLOPs one rank of a pipeline rank holding ``stages`` computes an iteration, as the dry run's trace
        counts them (matmuls and attention): each of its blocks' forward and backward FLOPs (the profile's, per
        sample) for every sample of its micro-batches, over context parallelism (each rank its slice of the
        sequence) and tensor parallelism as the pricing weighs them (_tp_flops_share) — and its recomputation's
        (StageCost's is the tensor-parallel group's per micro-batch). The flash attention kernels' backward
        recomputes the scores, a fifth matmul the model's 3x forward leaves out: the trace counts ~2% more on
        gpt-tiny. MLA's down-projections count whole on every tensor-parallel rank, as this executor runs them."""
        m, t = lay.num_micro_batches, lay.tp
        key = (lay.dtype, t)
        per_sample = self._block_flops.get(key)
        if per_sample is None:
            per_sample = self._block_flops[key] = [(x.fwd_flops + x.bwd_flops) * _tp_flops_share(x.fwd_ops, t)
                                                   for x in self.work.profile(lay.dtype).layers]
        samples = m * lay.micro_batch / lay.cp
        return sum(samples * sum(per_sample[b] for b in costs[s].blocks) + m * costs[s].recompute_flops / t
                   for s in stages)

    # ---- the whole iteration ----
    def evaluate(self, lay: Layout, stages: list[list[int]], stage_recompute: list[str] | None = None,
                 simulate: bool = False, keep_timeline: bool = False, costs: list[StageCost] | None = None
                 ) -> Prediction:
        """Price ``lay`` with these stages (and per-stage recomputation). ``costs``: their stage_costs, where the
        caller has them already (least_recompute)."""
        work = self.work
        cluster, gpu = work.cluster, work.cluster.gpu
        prof = work.profile(lay.dtype)
        _check_stages(stages, len(prof.layers), lay)
        place = layout_placement(cluster, lay)
        costs = costs if costs is not None else self.stage_costs(lay, stages, stage_recompute)
        p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
        ranks, rank_fwd, rank_b, rank_w, rank_time = _rank_times(lay, costs)
        sim = None
        schedule = lay.schedule if p > 1 else "1f1b"
        if simulate:
            sim = simulate_pipeline(schedule, p, v, m, [c.t_f for c in costs], [c.t_b for c in costs],
                                    [c.t_w for c in costs], act_bytes=[c.act_bytes for c in costs],
                                    keep_timeline=keep_timeline, dw_pending=[c.dw_pending for c in costs],
                                    unfolded=_unfolded_list(self.work.framework, lay, costs))
            makespan, finish = sim.makespan, sim.rank_finish
            method = "event simulation"
        else:
            # as closed_form_floor
            makespan = _closed_form_pipeline(schedule, p, v, m, costs, rank_time, rank_fwd, rank_w)
            drain = 0.0
            finish = []
            for r in range(p):  # backwards drain from the last rank to rank 0, which finishes last
                finish.append(makespan - drain)
                drain += 0.0 if schedule == "zb-v" else (rank_b[r] + rank_w[r]) / v
            method = "closed form"
        # ---- data parallelism, ZeRO's gathers, the tied embedding, the optimizer: once per iteration ----
        notes: list[str] = []
        loads = [self.rank_load(lay, costs, ranks[r], makespan) for r in range(p)]
        dp_items = [self.dp_items(lay, place, costs, ranks[r], r) for r in range(p)]
        step, expert_step = optimizer_step(self, lay), moe.expert_optimizer_step(self, lay)
        alike: dict[tuple, tuple[float, float]] = {}  # ranks with the same items and load wait alike
        dp_exposed, opt_time = [], []
        for r in range(p):
            ld = loads[r]
            key = (id(dp_items[r]), ld.params, ld.fwd, ld.bwd, ld.window, ld.makespan, ld.replicated, ld.experts,
                   ld.moe_shared)
            hit = alike.get(key)
            if hit is None:
                hit = alike[key] = (exposed_seconds(dp_items[r], loads[r]),
                                    step.at(loads[r]) + expert_step.at(loads[r]))
            dp_exposed.append(hit[0])
            opt_time.append(hit[1])
        end = [finish[r] + dp_exposed[r] for r in range(p)]
        iteration = max(end) + max(opt_time)
        # ---- breakdown on the bottleneck rank ----
        rb = max(range(p), key=lambda r: rank_time[r])
        rs = ranks[rb]
        compute = m * sum(costs[s].fwd + costs[s].bwd_input + costs[s].bwd_weight for s in rs)
        recompute = m * sum(costs[s].recompute_time for s in rs)
        cp_comm = m * sum(costs[s].cp_time for s in rs)
        ep_comm = m * sum(costs[s].ep_time for s in rs)
        host = m * sum(costs[s].host_time for s in rs)
        tp_comm = m * sum(costs[s].tp_fwd + costs[s].tp_bwd for s in rs) - cp_comm - ep_comm - host
        tp_comm = tp_comm if tp_comm > 1e-12 * makespan else 0.0  # float residue where only cp/ep/host count
        pp_comm = m * sum(costs[s].p2p_fwd + costs[s].p2p_bwd for s in rs)
        bubble = max(0.0, makespan - m * rank_time[rb])
        bubble = bubble if bubble > 1e-12 * makespan else 0.0  # the event simulation's float residue without a bubble
        dp_comm = iteration - makespan - max(opt_time)
        dp_comm = dp_comm if dp_comm > 1e-12 * iteration else 0.0  # float residue when nothing is exposed
        time_s = {"compute": compute, "recompute": recompute, "tp_comm": tp_comm, "pp_comm": pp_comm,
                  "dp_comm": dp_comm, "bubble": bubble, "optimizer": max(opt_time), "cp_comm": cp_comm,
                  "ep_comm": ep_comm, "host": host}
        # ---- memory and traffic per rank ----
        flights = list(in_flight(schedule, p, v, m))
        gathers = prices_chunk_gathers(layout_states(work.framework, lay))
        breakdowns = self.rank_memory_breakdowns(lay, costs, ranks, flights, sim,
                                                 holdings=list(peak_matrices(schedule, p, v, m, gathers)))
        rank_mem = [sum(b.values()) for b in breakdowns]
        worst = max(range(p), key=lambda r: rank_mem[r])
        peak = rank_mem[worst]
        # ---- throughput and FLOP utilisation ----
        fwd_flops_per_sample = self._fwd_flops.get(lay.dtype)
        if fwd_flops_per_sample is None:  # a sum over every layer: once per dtype, not once per evaluation
            fwd_flops_per_sample = self._fwd_flops[lay.dtype] = _model_fwd_flops(prof, work.framework)
        model_flops = 3 * fwd_flops_per_sample * lay.global_batch
        recompute_flops = sum(c.recompute_flops for c in costs) * lay.cp / lay.micro_batch  # per sample
        hw_flops = model_flops + recompute_flops * lay.global_batch
        n_gpus = lay.num_gpus
        # a CPU rank's peak is its share of the machine's cores (one rank alone runs every core: cpu_share.py)
        peak_flops = self.cpu_share.rank_peak_flops(lay.dtype, place.gpus_per_node_busy)
        model_tflops = model_flops / iteration / n_gpus / 1e12
        hw_tflops = hw_flops / iteration / n_gpus / 1e12
        tokens = lay.global_batch * work.tokens_per_sample
        if lay.dtype == "fp32" and not gpu.is_cpu:
            notes.append("fp32 matmuls priced at the fp32 (not TF32) peak, as PyTorch runs them by default")
        if hw_tflops * 1e12 > peak_flops and gpu.is_cpu:  # measured blocks ran faster than the calibrated peak
            notes.append(f"{hw_tflops * 1e12 / peak_flops:.0%} of the calibrated peak ({peak_flops / 1e12:.3g} TFLOP/s "
                         "per rank): the measured blocks ran faster than the machine's calibration (taken while "
                         "it was busy?); run paraplan calibrate again on an idle machine")
        if gpu.is_cpu and work.cluster.calibrated and lay.cp == 1 and \
                work.measurement(lay.micro_batch, lay.dtype) is None:  # block_cost's figures: not this model's own
            notes.append(f"{work.spec.name}'s blocks at micro-batch {lay.micro_batch} ({lay.dtype}) have not been "
                         "timed on this machine: priced from their FLOPs and bytes at the calibrated rates (paraplan "
                         f"validate times them, as does profile --micro-batch {lay.micro_batch} --device cpu "
                         "--save-measurements cpu; their times then replace these)")
        core_share = self._core_share.get(lay.dtype)
        if core_share is None:
            core_share = self._core_share[lay.dtype] = _attention_core_share(prof)
        if core_share >= CORE_SHARE_NOTE and context_parallel.attention_work_fraction(work, lay) < 1:
            causal_mfu = model_tflops * 1e12 / peak_flops * (1 - core_share / 2)
            notes.append(f"MFU counts the attention scores' full s x s FLOPs ({core_share:.0%} of this model's at "
                         f"sequence {work.tokens_per_sample:,}), as Narayanan et al. 2021's and PaLM's MFU formulas "
                         f"do; a causal kernel computes about half of them: {causal_mfu:.1%} MFU counted that way")
        if place.tp.crosses_nodes:  # priced so (placement.py), and rarely meant: Megatron keeps tp inside a node
            notes.append(f"tensor-parallel groups of {lay.tp} span {place.tp.nodes} nodes ({cluster.gpus_per_node} "
                         "GPUs per node): their collectives cross the network on every layer; a tp dividing the GPUs "
                         "per node keeps them inside one")
        if not self.grads_at_activation_peak(lay, ranks[worst], flights[worst]):  # "grads 0.0" must not read as a bug
            notes.append(f"grads {breakdowns[worst]['grads']:.1f} GiB counts only the gradients beyond the activations "
                         "the worst rank's first backward frees: its memory peaks before that backward, when no "
                         "gradient exists yet")
        if lay.etp > 1 and work.framework.name == "paraplan":  # its search leaves etp out (moe.expert_degrees)
            notes.append(f"paraplan execute does not run expert tensor parallelism yet (etp {lay.etp}): priced, but "
                         "not executable; --framework megatron-core runs it")
        return Prediction(
            layout=lay, num_parameters=prof.num_parameters, iteration_time_s=iteration,
            tokens_per_s=tokens / iteration, samples_per_s=lay.global_batch / iteration,
            model_tflops_per_gpu=model_tflops, hardware_tflops_per_gpu=hw_tflops,
            mfu=model_tflops * 1e12 / peak_flops, hfu=hw_tflops * 1e12 / peak_flops,
            fits=peak <= work.memory_limit_GiB, peak_memory_gib=peak, memory_capacity_gib=gpu.memory_GiB,
            memory_limit_gib=work.memory_limit_GiB,
            memory_gib=breakdowns[worst], time_s=time_s, bubble_fraction=bubble / iteration if iteration else 0.0,
            stages=costs, rank_memory_gib=rank_mem, rank_finish_s=list(finish), rank_dp_exposed_s=dp_exposed,
            in_flight=flights, method=method, sim=sim, notes=notes, rank_memory_breakdown_gib=breakdowns,
            traffic_of=lambda: [self.rank_traffic(lay, costs, ranks[r], dp_items[r], loads[r]) for r in range(p)],
            dp_sync_of=lambda: [sync_summary(dp_items[r], loads[r]) for r in range(p)],
            flops_of=lambda: [self.rank_flops(lay, costs, ranks[r]) for r in range(p)])


def _closed_form_pipeline(schedule: str, p: int, v: int, m: int, costs: list[StageCost], rank_time: list[float],
                          rank_fwd: list[float], rank_w: list[float]) -> float:
    """evaluate's closed-form pipeline makespan: closed_form_makespan from the ranks' sums, and for interleaved 1F1B
    what its lock-step rounds add where their chunks differ (schedules.rounds_excess)."""
    makespan = closed_form_makespan(schedule, p, v, m, rank_time, rank_fwd, rank_w)
    if rounds_priced(schedule, p, v, m):  # (the stage times' lists only where they are read)
        makespan += rounds_excess(p, v, m, [c.t_f for c in costs], [c.t_b for c in costs], [c.t_w for c in costs],
                                  max(rank_time), makespan)
    return makespan


def _rank_times(lay: Layout, costs: list[StageCost]) -> tuple[list, list[float], list[float], list[float], list[float]]:
    """Each pipeline rank's stages, then its forward, input-gradient, weight-gradient and whole time per micro-batch."""
    p, v = lay.pp, lay.virtual_stages
    ranks = [rank_stages(lay.schedule, r, p, v) for r in range(p)]
    rank_fwd, rank_b, rank_w = _rank_phase_times(costs, ranks, v)
    return ranks, rank_fwd, rank_b, rank_w, [f + b + w for f, b, w in zip(rank_fwd, rank_b, rank_w, strict=True)]


def _rank_phase_times(costs: list[StageCost], ranks: list[tuple[int, ...]], v: int
                      ) -> tuple[list[float], list[float], list[float]]:
    """Each pipeline rank's forward, input-gradient and weight-gradient time per micro-batch (its stages summed)."""
    if v == 1:  # one stage per rank: its own times
        return [c.t_f for c in costs], [c.t_b for c in costs], [c.t_w for c in costs]
    return ([sum(costs[s].t_f for s in rs) for rs in ranks], [sum(costs[s].t_b for s in rs) for rs in ranks],
            [sum(costs[s].t_w for s in rs) for rs in ranks])


def pipeline_makespan(lay: Layout, costs: list[StageCost]) -> float:
    """The closed-form pipeline makespan of these stage costs from the ranks' sums alone: what
    :meth:`CostModel.evaluate` (closed form) adds interleaved 1F1B's rounds (schedules.rounds_excess), the exposed
    data-parallel waits and the optimizer step to, so a lower bound on its iteration time (rank 0 finishes at the
    makespan). Cheap: the polish skips neighbours it shows cannot improve."""
    p, v = lay.pp, lay.virtual_stages
    schedule = lay.schedule if p > 1 else "1f1b"
    linear = linear_makespan(schedule, p, v, lay.num_micro_batches)
    if linear is not None:  # a·slowest rank + b·all ranks (closed_form_makespan's linear forms, summed per stage)
        totals = [c.total for c in costs]
        per_rank = totals if v == 1 else [sum(totals[s] for s in rank_stages(lay.schedule, r, p, v)) for r in range(p)]
        return linear[0] * max(per_rank) + linear[1] * sum(per_rank)
    ranks = [rank_stages(lay.schedule, r, p, v) for r in range(p)]
    rank_fwd, rank_b, rank_w = _rank_phase_times(costs, ranks, v)
    rank_time = [f + b + w for f, b, w in zip(rank_fwd, rank_b, rank_w, strict=True)]
    return closed_form_makespan(schedule, p, v, lay.num_micro_batches, rank_time, rank_fwd, rank_w)


def grads_meet_peak(schedule: str, pp: int, v: int, m: int, stages: tuple[int, ...], flights: dict[int, int]) -> bool:
    """CostModel.grads_at_activation_peak from the schedule's numbers (the search's memory bound asks it too)."""
    if pp == 1:
        return m >= 2
    return schedule != "gpipe" and v * m > sum(flights.get(s, 0) for s in stages)


def _replicated_params(layer) -> float:
    """Parameters of a block that tensor parallelism leaves whole on every rank (norms, row-parallel biases)."""
    if not layer.params or not layer.param_bytes:
        return 0.0
    return (layer.param_bytes - layer.param_bytes_sharded) * layer.params / layer.param_bytes


def _whole_latent_params(work, lay: Layout, layer) -> float:
    """Of a block's replicated parameters, those every tensor-parallel rank trains on the whole sequence, so whose
    gradients need no all-reduce over tp under sequence parallelism (dp_sync.sequence_parallel_weight_sync): MLA's
    down-projections and latent norms (models.latent_down_params; DeepSeek-V2 Sec. 2.1) where the hidden is gathered
    before them and the latents' gradients all-reduced (this executor, torchtitan), not where they run on each rank's
    sequence shard (_replicated_on_shard: Megatron-Core)."""
    if not getattr(work.spec, "mla", False) or layer.kind != "transformer_layer" or \
            _replicated_on_shard(work, lay, layer):
        return 0.0
    return float(latent_down_params(work.spec))


def _check_stages(stages: list[list[int]], n_blocks: int, lay: Layout) -> None:
    if len(stages) != lay.num_stages:
        raise InvalidLayout(f"{len(stages)} stages given, pp x virtual stages = {lay.num_stages}", "stage count")
    flat = [i for s in stages for i in s]
    if flat != list(range(n_blocks)) or any(not s for s in stages):
        raise InvalidLayout("stages must split the blocks into contiguous, non-empty groups in order",
                            "bad stage boundaries")


def balanced_stages(weights: list[float], k: int) -> list[list[int]]:
    """Contiguous split of blocks into k non-empty stages minimising the heaviest: binary search on the
    heaviest stage's weight, each trial packing stages greedily (by bisection on the running sums)."""
    n = len(weights)
    assert 1 <= k <= n
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)

    def split(limit: float) -> list[int] | None:
        """Stage starts packing each stage up to ``limit`` (leaving a block for every later stage), or None."""
        starts, lo = [], 0
        for j in range(k - 1):
            starts.append(lo)
            end = bisect.bisect_right(cum, cum[lo] + limit, lo + 1) - 1  # the most blocks within the limit
            lo = min(max(end, lo + 1), n - (k - 1 - j))
        starts.append(lo)
        return starts if cum[n] - cum[lo] <= limit else None

    lo, hi = max(max(weights), cum[n] / k), cum[n]
    best = split(hi * (1 + 1e-12))
    for _ in range(60):
        if hi - lo <= 1e-6 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        got = split(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid
    got = split(lo)  # the bound itself may be reached (equal blocks)
    best = got if got is not None else best
    assert best is not None
    bounds = [*best, n]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(k)]


def default_stages(model: CostModel, lay: Layout) -> list[list[int]]:
    """Stage boundaries balancing each stage's time (used when the user gives none)."""
    place = layout_placement(model.work.cluster, lay)
    n = len(model.work.profile(lay.dtype).layers)
    if lay.num_stages > n:
        raise InvalidLayout(f"pp x virtual stages = {lay.num_stages} exceeds the model's {n} blocks",
                            "more stages than blocks")
    weights = model.block_table(lay, place, lay.recompute).weights
    return [list(s) for s in _balanced_cached(weights, lay.num_stages)]


def even_stages(model: CostModel, lay: Layout) -> list[list[int]] | None:
    """The identical layers dealt evenly over the stages (what the ILP's chunk-balance rows accept), the embedding
    riding with the first stage and the head with the last. With v > 1 the stages holding a layer more are, rank
    after rank, the inner chunks that hold the fewest micro-batches at the rank's peak (the ILP's symmetry
    order), then the end stages; with one stage per rank, the first. None: the model is not embedding + identical
    layers + head (CostModel.repeated_blocks), or has fewer layers than inner stages."""
    got = _even_counts(model, lay)
    return None if got is None else stages_from_counts(got[0], len(model.work.profile(lay.dtype).layers))


def _even_counts(model: CostModel, lay: Layout) -> tuple[list[int], list[int]] | None:
    """even_stages' layers per stage, and the order in which stages take a layer more (v > 1: the inner chunks'
    turns, rank after rank, then the end stages)."""
    if not model.repeated_blocks(lay):
        return None
    n, k = len(model.work.profile(lay.dtype).layers), lay.num_stages
    layers = n - 2
    if lay.virtual_stages > 1:
        orders = [inner_chunk_order(lay, r) for r in range(lay.pp)]
        turns = [orders[r][j] for j in range(max(map(len, orders), default=0)) for r in range(lay.pp)
                 if j < len(orders[r])] + [0, k - 1]
    else:
        turns = list(range(k))
    plus = set(turns[:layers % k])
    counts = [layers // k + (1 if s in plus else 0) for s in range(k)]
    if min(counts[1:-1] or [1]) < 1:
        return None
    return counts, turns


def lighter_end_stages(model: CostModel, lay: Layout) -> list[list[list[int]]]:
    """For an interleaved schedule: even_stages with the first stage, the last, or both holding a layer fewer (the
    planner's rule lets the end chunks, which carry the embedding and the head, hold one layer less), each layer
    given to the next inner chunk in even_stages' turn order (on the donor's rank, a chunk holding fewer
    micro-batches), or to the next on another rank. The first stage holds the most micro-batches of its rank at the
    peak: a layer off it can spare its rank the recomputation the even split needs (the demo's dp2 tp2 pp8 cp2
    interleaved x4 z3, by the ranks' sums: 35.38 s with the even split, 33.77 s with one layer moved off stage 0
    and none recomputed; with its lock-step rounds priced, schedules.rounds_excess, 37.54 and 37.07 s, simulated
    37.54 and 37.50 s).
    Not for ZB-V, whose first rank holds both end chunks beside its other work: on the 1T GPT's V layouts it
    never helped, and where chunks hold one layer each it doubles one."""
    got = _even_counts(model, lay) if lay.virtual_stages > 1 and lay.schedule == "interleaved-1f1b" else None
    if got is None:
        return []
    counts, turns = got
    n, k = len(model.work.profile(lay.dtype).layers), lay.num_stages
    low = min(counts[1:-1])
    out = []
    seen = set()
    for ends, elsewhere in itertools.product(((0,), (k - 1,), (0, k - 1)), (False, True)):
        moved = list(counts)
        ok = True
        for e in ends:  # the next in turn, or the next on another rank than the donor's
            r = next((s for s in turns if 0 < s < k - 1 and moved[s] == low and not (
                elsewhere and stage_rank(lay.schedule, s, lay.pp) == stage_rank(lay.schedule, e, lay.pp))), None)
            if r is None or moved[e] < low:
                ok = False
                break
            moved[e] -= 1
            moved[r] += 1
        if ok and tuple(moved) not in seen:  # (a donor held low or more: it keeps low - 1, as the rule allows)
            seen.add(tuple(moved))
            out.append(stages_from_counts(moved, n))
    return out


@dataclass(frozen=True)
class QuickFloor:
    """:func:`least_recompute_prediction`'s answer, given a time to beat, for a split whose closed-form floor
    (:meth:`CostModel.closed_form_floor`) already reaches it: that floor, the split never priced whole (the search's
    quick prices read its time, its stages' costs and its recomputation as a Prediction's)."""

    iteration_time_s: float  # the split's price is at least this
    layout: Layout  # priced with its heaviest recomputation mode as its label (as a Prediction's)
    stages: list[StageCost]  # the stages' costs in their least recomputation that fits
    time_s: dict[str, float]  # its recomputation seconds alone (what quick_price reads of a Prediction)


def least_recompute_prediction(model: CostModel, lay: Layout, stages: list[list[int]] | None,
                               tried: tuple[str, ...], got: tuple[list[str], list[StageCost]] | None = None,
                               beat: float | None = None) -> Prediction | QuickFloor | None:
    """``stages`` priced exactly with the least recomputation per stage that fits (None: some rank fits in no mode).
    ``got``: ``model.least_recompute(lay, stages, tried)`` where the caller has it. ``beat``: a time the caller
    keeps the price only below; where :meth:`CostModel.closed_form_floor` shows the price is not, that floor alone
    (:class:`QuickFloor`, its time ``beat`` or more)."""
    if stages is None:
        return None
    got = got or model.least_recompute(lay, stages, tried)
    if got is None:
        return None
    chosen, costs = got
    priced = lay.replace(recompute=max(chosen, key=tried.index))
    if beat is not None:
        floor = model.closed_form_floor(priced, costs)
        if floor >= beat:
            return QuickFloor(floor, priced, costs, {"recompute": sum(c.recompute_time for c in costs)})
    return model.evaluate(priced, stages, chosen if len(set(chosen)) > 1 else None, costs=costs)


def levelled_stages(model: CostModel, lay: Layout, mode: str) -> list[list[int]] | None:
    """One stage per pipeline rank of an embedding, identical layers and a head (CostModel.repeated_blocks): the
    layers counted so that every rank fits its GPU in recomputation ``mode`` and the slowest rank, by the block
    table's times, is as fast as that allows. 1F1B's first ranks hold the most micro-batches at their peaks, so a
    split balanced by time alone overflows them and recomputes there; fewer layers on them and more on the later
    ranks, none recomputed, is often faster (what the stage ILP finds; the demo's dp8 tp2 pp4 1f1b z3 sp: 40.35 s
    balanced, recomputing, 33.25 s levelled, as by the ILP). Each rank's most layers come from its own memory alone
    (it depends on its own stage only), then the least per-rank time under which those caps hold every layer
    (water-filling).
    None: not such a layout, or some rank fits not even its fewest layers."""
    if lay.virtual_stages != 1 or lay.pp < 2 or not model.repeated_blocks(lay):
        return None
    n, p = len(model.work.profile(lay.dtype).layers), lay.pp
    layers = n - 2
    if layers < p - 2:
        return None
    weights = model.block_table(lay, layout_placement(model.work.cluster, lay), mode).weights
    per_layer, extra = weights[1], [weights[0]] + [0.0] * (p - 2) + [weights[-1]]
    caps = [_most_layers(model, lay, r, mode, layers // p, layers) for r in range(p)]
    if min(caps) < 0 or sum(caps) < layers:
        return None

    def counts_within(tau: float) -> list[int]:
        return [min(c, max(0, int((tau - e) / per_layer + 1e-9))) for c, e in zip(caps, extra, strict=True)]

    lo, hi = 0.0, max(extra) + layers * per_layer
    for _ in range(60):  # the least tau whose counts hold every layer (counts_within only grows with tau)
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if sum(counts_within(mid)) >= layers else (mid, hi)
    counts = counts_within(hi)
    for _ in range(sum(counts) - layers):  # too many at tau: one fewer on the slowest ranks, the earliest first
        r = max((r for r in range(p) if counts[r] > (1 if 0 < r < p - 1 else 0)),
                key=lambda r: (extra[r] + counts[r] * per_layer, -r))
        counts[r] -= 1
    return stages_from_counts(counts, n)


def _most_layers(model: CostModel, lay: Layout, r: int, mode: str, start: int, most: int) -> int:
    """The most identical layers (up to ``most``) pipeline rank ``r`` of a one-stage-per-rank layout holds in
    ``mode`` and still fits its GPU (with the embedding on the first rank, the head on the last); -1 where it fits
    not even the fewest (none on an end rank, one on an inner one). Searched from ``start``, galloping then halving
    (a rank's memory grows with its layers): a few memory checks a rank, where the last ranks of a long pipeline
    may hold many times their share."""
    n, p = len(model.work.profile(lay.dtype).layers), lay.pp

    def fits(c: int) -> bool:  # rank r alone (CostModel.ranks_fit), its one stage priced in ``mode``
        blocks = list(range(1, c + 1)) if 0 < r < p - 1 else [0, *range(1, c + 1)] if r == 0 \
            else [*range(n - 1 - c, n - 1), n - 1]
        stages = [blocks if s == r else [] for s in range(p)]
        return model.ranks_fit(lay, stages, costs={r: model.stage_cost(lay, stages, r, mode)}, only=[r])[0]

    low = 1 if 0 < r < p - 1 else 0  # an inner stage holds a layer at least
    c = max(low, min(start, most))
    if fits(c):  # galloping up from what fits, then halving down to the last count that fits
        good, step, bad = c, 1, most + 1
        while good < most:
            nxt = min(most, good + step)
            if not fits(nxt):
                bad = nxt
                break
            good, step = nxt, 2 * step
    else:  # galloping down to a count that fits, then halving up
        bad, step, good = c, 1, low - 1
        while bad > low:
            nxt = max(low, bad - step)
            if fits(nxt):
                good = nxt
                break
            bad, step = nxt, 2 * step
        if good < low:
            return -1
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def memory_repaired_stages(model: CostModel, lay: Layout, stages: list[list[int]], mode: str
                           ) -> list[list[int]] | None:
    """``stages`` (one stage per pipeline rank) with blocks moved off the ranks that do not fit in recomputation
    ``mode`` (the least-memory mode allowed), one at a time, until every rank fits: None where that fails. A 1F1B
    rank early in the pipeline holds more micro-batches at its peak, so a balanced-by-time split can overflow its
    first ranks where a split with fewer blocks there fits: a block moves from a rank that does not fit to the
    next rank (the last rank's to the one before, and on down while the ranks it reaches overflow in turn), never
    emptying a stage. What the search prices where the balanced split fits in no allowed mode (search.quick_price):
    an uneven split that fits, for the ILP to start from and the pruning to rank by."""
    if lay.virtual_stages != 1 or lay.pp < 2:
        return None
    stages = [list(x) for x in stages]
    modes = [mode] * len(stages)
    came_from: dict[int, int] = {}  # rank -> the neighbour its last block came from: a block never goes back
    for _ in range(2 * (len(stages) + sum(len(x) for x in stages))):  # enough for a few blocks down the pipeline
        fit = model.ranks_fit(lay, stages, modes)
        if all(fit):
            return stages
        r = fit.index(False)
        # onwards, in the direction the rank's last block came (a cascade); else to the next rank, the last to the one
        # before (the head's rank overflowing passes blocks back down the pipeline)
        to = r - 1 if came_from.get(r) == r + 1 or r + 1 == len(stages) else r + 1
        if len(stages[r]) < 2 or not 0 <= to < len(stages):
            return None
        if to > r:
            stages[to].insert(0, stages[r].pop())
        else:
            stages[to].append(stages[r].pop(0))
        came_from[to] = r
    return None


def count_balanced_stages(model: CostModel, lay: Layout) -> list[list[int]] | None:
    """For v > 1 and a model that is not embedding + identical layers + head: the blocks dealt in contiguous stages
    whose counts differ by one at most (the planner's chunk rule for such models, ilp.chunks_balanced), the extra
    blocks on the last stages (the first hold the most micro-batches at their rank's peak). A split the ILP accepts
    as its start, which the time-balanced one (default_stages) often is not. None where even_stages applies or there
    are fewer blocks than stages."""
    n, k = len(model.work.profile(lay.dtype).layers), lay.num_stages
    if lay.virtual_stages == 1 or model.repeated_blocks(lay) or n < k:
        return None
    base, extra = divmod(n, k)
    bounds = [0]
    for s in range(k):
        bounds.append(bounds[-1] + base + (1 if s >= k - extra else 0))
    return [list(range(bounds[s], bounds[s + 1])) for s in range(k)]


def stages_from_counts(counts: list[int], n_blocks: int) -> list[list[int]]:
    """Stages holding ``counts`` layers each, in order, the embedding (block 0) with the first and the head (the
    last block) with the last."""
    stages, nxt = [], 1
    for c in counts:
        stages.append(list(range(nxt, nxt + c)))
        nxt += c
    stages[0].insert(0, 0)
    stages[-1].append(n_blocks - 1)
    return stages


def inner_chunk_order(lay: Layout, r: int) -> list[int]:
    """Pipeline rank r's chunks other than the first and last stage (those carry the embedding and the head),
    fewest micro-batches in flight at the rank's peak first, ties by index."""
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    flights = in_flight(schedule, lay.pp, lay.virtual_stages, lay.num_micro_batches)[r]
    inner = [s for s in rank_stages(schedule, r, lay.pp, lay.virtual_stages) if 0 < s < lay.num_stages - 1]
    return sorted(inner, key=lambda s: (flights.get(s, 0), s))


def framework_stages(model: CostModel, lay: Layout) -> list[list[int]]:
    """Stage boundaries as the priced stack cuts the model when told only pp and vp: Megatron (and Megatron-
    DeepSpeed's ``type:transformer`` partition) gives each of the pp·vp chunks the same number of transformer
    layers, the embedding riding with the first chunk and the head with the last (Megatron-LM's
    get_num_layers_to_build: num_layers / (pp·vp)). This executor, or layers that do not divide evenly (or
    blocks other than transformer layers between the ends): the balanced split (:func:`default_stages`)."""
    layers = model.work.profile(lay.dtype).layers
    n, k = len(layers), lay.num_stages
    middle = layers[1:-1]
    if model.work.framework.runs_on_executor or k == 1 or len(middle) % k or \
            any(x.kind != "transformer_layer" for x in middle):
        return default_stages(model, lay)
    return stages_from_counts([len(middle) // k] * k, n)


@lru_cache(maxsize=8192)
def _balanced_cached(weights: tuple[float, ...], k: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in balanced_stages(list(weights), k))


def norm_act_refusal(work: Workload, dtype: str) -> str | None:
    """Why ``--recompute norm+act`` (Megatron-Core's recompute_modules layernorm and moe_act) cannot be priced for
    ``work`` in ``dtype``, or None. It is Megatron-Core's, on Transformer Engine's modules; moe_act needs the
    grouped GEMM and experts, and Megatron-Core refuses both modules under FP8 delayed scaling
    (TransformerConfig.__post_init__: "Delayed scaling does not support moe_act and layernorm recompute for fp8")."""
    fw, spec = work.framework, work.spec
    if fw.saved_activations != "fused" or not fw.moe_grouped_gemm:
        return (f"--recompute norm+act is Megatron-Core's recompute_modules layernorm and moe_act, which the {fw.name} "
                "stack does not run; price --framework megatron-core")
    if not getattr(spec, "num_experts", 0):
        return f"--recompute norm+act recomputes the routed experts' activation (moe_act): {spec.name} has no experts"
    if dtype == "fp8" and fw.fp8_scaling == "delayed":
        return ("--recompute norm+act under FP8 needs a recipe other than delayed scaling (Megatron-Core refuses "
                "moe_act and layernorm recompute with it): add --fp8-recipe tensorwise")
    return None


# The attention core's share of the model's FLOPs above which a prediction says how MFU counts it (at 4,096 tokens
# Llama-2 7B's is about 15%)
CORE_SHARE_NOTE = 0.25


def _attention_core_share(prof) -> float:
    """The share of the model's forward FLOPs in the attention core (QK^T and the scores times V: the profile's
    gemm_core GEMMs), which a causal flash kernel computes only half of."""
    total = prof.total_fwd_flops
    core = sum(f for layer in prof.layers for f, c in zip(layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_core or [],
                                                          strict=False) if c)
    return core / total if total else 0.0


def _model_fwd_flops(prof, framework) -> float:
    """The model's forward FLOPs per sample that count as useful work: with token dropping (a capacity factor c < 1)
    the routed experts compute only the tokens they keep, c of their share at most, so their FLOPs count that
    share (else a run dropping most tokens showed an MFU above 100%: Mixtral at c = 0.1, 128%)."""
    total = prof.total_fwd_flops
    c = framework.moe_capacity_factor
    if c is None or c >= 1:
        return total
    routed = sum(f for layer in prof.layers for f, m in zip(layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_moe or [],
                                                            strict=False) if m == 2)
    return total - routed * (1 - c)


def validate_layout(model: CostModel, lay: Layout) -> None:
    """Raise InvalidLayout (with the reason) for a layout this model and cluster cannot run."""
    work = model.work
    lay.validate(work.spec, len(work.profile(lay.dtype).layers), work.cluster.num_gpus)
    if lay.recompute == "norm+act":
        why = norm_act_refusal(work, lay.dtype)
        if why:
            raise InvalidLayout(why, "recompute")
    try:
        work.cluster.gpu.peak_flops(lay.dtype)
    except ValueError as e:
        raise InvalidLayout(str(e), f"{lay.dtype} unsupported") from None
    if lay.pp > 1 and lay.schedule not in work.framework.schedules:
        raise InvalidLayout(f"the {work.framework.name} stack runs the {' or '.join(work.framework.schedules)} "
                            f"pipeline schedule{'s' if len(work.framework.schedules) > 1 else ''}, not {lay.schedule}",
                            f"{lay.schedule} not run by the stack")
    if work.framework.moe_tp_needs_sp and lay.experts_beside_tp_without_sp:
        raise InvalidLayout(f"the {work.framework.name} stack runs expert parallelism (ep {lay.ep}) beside tensor "
                            f"parallelism (tp {lay.tp}) only with sequence parallelism (--sequence-parallel)",
                            "ep with tp needs sequence parallelism")
    if work.framework.tp_always_sp and lay.tp > 1 and not lay.sequence_parallel:
        raise InvalidLayout(f"the {work.framework.name} stack runs tensor parallelism (tp {lay.tp}) with sequence "
                            "parallelism always (--sequence-parallel)", "tp without sequence parallelism")
    if work.framework.tp_always_sp and lay.etp not in (1, lay.tp):
        raise InvalidLayout(f"the {work.framework.name} stack's expert tensor parallelism is 1 or tp ({lay.tp}), "
                            f"not {lay.etp}", "etp other than 1 or tp")
    stages = work.framework.zero_stages
    if lay.dp > 1 and lay.dp_mode != "ps" and lay.zero not in stages:  # over dp, as the search enumerates them
        raise InvalidLayout(f"the {work.framework.name} stack runs ZeRO {' or '.join(map(str, stages))} over data "
                            f"parallelism, not {lay.zero}", f"zero {lay.zero} not run by the stack")

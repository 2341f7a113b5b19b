"""The planner's search: every layout, pruned by lower bounds, stage boundaries by ILP, exact pricing.

1. Enumerate layouts: every dp x tp x pp factorisation of the GPU count, micro-batch sizes dividing
   the per-replica batch, schedules (GPipe, 1F1B, interleaved with v chunks, ZB-V), ZeRO 0-3 (with dp > 1),
   sequence parallelism on/off (with tp > 1). Recomputation is not enumerated: the ILP picks it per stage
   (uniform settings are among its choices). Invalid layouts are kept with their reason.
2. Bound each layout from below in O(1): the pipeline with perfectly divided work and the least-work
   recomputation, the point-to-point sends every split has (_send_floor), plus the optimizer step; and from
   memory: model states alone over pp ranks. Lazily: every layout first gets the pipeline's time alone
   (time_bound, one block table per class of layouts), the rest only when it comes up, then a tighter second
   bound (the recomputation memory forces, the slowest rank, the data-parallel wait) when it comes up again.
3. Visit layouts in order of their lower bound; stop when the bound reaches the k-th best time found.
   Each visited layout gets the ILP's stage split (see :mod:`ilp`), priced exactly by the cost model — except,
   in the default (heuristic) mode, interleaved and V layouts of transformer layers, whose chunk rule leaves
   little to choose: their quick split, polished on the exact model (ilp.polished_quick_split); one that enters
   the k best quick prices is polished at once, so that its polished price is the one later layouts must beat.
   The ILPs solve beside the polishing (HiGHS in worker threads, letting go of the GIL while it solves; CBC, the
   fallback, in its own process).
Every layout the search considered is returned with its status for the report.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from paraplan.models import TransformerSpec

from . import moe
from .concerns import RankLoad
from .context_parallel import search_degrees as cp_degrees
from .costmodel import CostModel, Prediction, QuickFloor, grads_meet_peak, least_recompute_prediction
from .dp_sync import optimizer_step
from .errors import InvalidLayout, PlanError
from .gc_pause import without_gc_pauses
from .ilp import (
    EXHAUSTIVE_TIME_LIMIT_S,
    OPTIMAL_BY_RANK_SUMS,
    SOLVER_TIME_LIMIT_S,
    best_partition,
    layout_modes,
    modes_for,
    no_mode_reason,
    polished_quick_split,
)
from .layout import Layout
from .memory import FRAGMENTATION, state_bytes, untracked_bytes
from .placement import layout_placement
from .schedules import in_flight, rank_stages, stage_rank
from .workload import Workload

VIRTUAL_STAGES = (2, 3, 4, 6, 8)
# The ILP's cutoff sits this far above the k-th best time (heuristic mode only; see search()).
CUTOFF_MARGIN = 0.02


@dataclass
class Candidate:
    layout: Layout
    status: str  # ok | priced | pruned | dominated | oom | invalid
    reason: str = ""
    lower_bound_s: float = float("inf")
    prediction: Prediction | None = None
    stages: list[list[int]] | None = None
    stage_recompute: list[str] | None = None
    no_fit: frozenset[str] = frozenset()  # recomputation modes whose memory lower bound exceeds the GPU
    solver: str = ""  # how the ILP ended for this layout (optimal, time limit, or why no solver ran)
    traced_peak_gib: float | None = None  # the executor's dry run of its plan (plan --verify), where run
    memory_checked: bool = True  # False: pruned on its pipeline's time alone (search.time_bound), memory unknown
    quick_floor_s: float | None = None  # status "priced" unpriced: its quick split's closed-form floor (QuickFloor)

    @property
    def time_s(self) -> float:
        return self.prediction.iteration_time_s if self.prediction is not None else float("inf")

    @property
    def moved_bytes(self) -> float:
        """Bytes the plan's ranks send a step (its prediction's traffic, computed when first read)."""
        return sum(sum(r.values()) for r in self.prediction.rank_comm_bytes) if self.prediction is not None else 0.0

    def status_text(self) -> str:
        if self.status == "ok":
            return f"ok ({self.solver})" if self.solver.startswith("solver failed") else "ok"
        if self.status == "oom":
            return self.reason
        if self.status == "traced oom":
            return f"out of memory by the executor's dry run: traced peak {self.traced_peak_gib:.1f} GiB"
        if self.status == "pruned" and not self.memory_checked:
            return (f"not solved: its pipeline's time alone ({self.lower_bound_s:.4g} s at least) cannot beat the top "
                    f"{self.reason}; its memory was not checked")
        if self.status == "pruned":
            return f"ok (not solved: its lower bound {self.lower_bound_s:.4g} s cannot beat the top {self.reason})"
        if self.status == "priced" and self.quick_floor_s is not None:
            return (f"ok (not priced: its balanced split's closed form alone, {self.quick_floor_s:.4g} s at least, is "
                    "more than 5% slower than the top plans)")
        if self.status == "priced" and self.reason == "bound":
            return "ok (balanced split only: the ILP's bound shows no split of it beats the top plans)"
        if self.status == "priced":
            return "ok (balanced split only: more than 5% slower than the top plans)"
        if self.status == "dominated":
            return f"ok (dominated: the same layout with {self.reason} is as fast with less memory)"
        return f"invalid: {self.reason}"


def ranked(candidates) -> list[Candidate]:
    """Fastest first; at the same predicted time, the plan that moves fewer bytes a step (its time depends less on how
    well its communication overlaps: the demo's model under Megatron-Core, dp32 tp2 before dp16 tp2 cp2). Only tied
    candidates have their traffic computed."""
    out = sorted(candidates, key=lambda c: c.time_s)
    i = 0
    while i < len(out):
        j = i + 1
        while j < len(out) and out[j].time_s == out[i].time_s:
            j += 1
        if j - i > 1 and out[i].prediction is not None:
            out[i:j] = sorted(out[i:j], key=lambda c: c.moved_bytes)
        i = j
    return out


@dataclass
class SearchResult:
    work: Workload
    gpus: int
    ranked: list[Candidate]  # best first (status ok)
    candidates: list[Candidate]
    search_time_s: float
    ilp_solves: int
    dtype: str
    notes: list[str] = field(default_factory=list)
    model: CostModel | None = None  # its per-block caches serve later searches of the same workload
    top_k: int = 0  # the plans asked for
    options: dict = field(default_factory=dict)  # search()'s allowed_modes and refine_slack: to search more alike

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def reject_traced(self, cand: Candidate, traced_peak_gib: float) -> None:
        """The executor's dry run found ``cand`` over the GPU's memory: it leaves the ranking."""
        cand.status, cand.traced_peak_gib = "traced oom", traced_peak_gib
        self.ranked = [c for c in self.ranked if c is not cand]

    @property
    def num_feasible(self) -> int:
        """Candidates that are valid and not known to run out of memory."""
        return sum(1 for c in self.candidates if c.status not in ("oom", "invalid"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(work: Workload, gpus: int, dtype: str, schedules: tuple[str, ...] | None = None,
                      zero_stages: tuple[int, ...] | None = None, context_parallel: bool = True,
                      cp: int = 1) -> list[Layout]:
    """Every layout of ``work`` on ``gpus`` GPUs (see the module docstring), in a fixed order; ``cp``: the
    context-parallel degree they all get (the call for cp > 1 enumerates gpus / cp GPUs so); ``schedules`` and
    ``zero_stages``: by default those the stack runs (Framework.schedules, Framework.zero_stages)."""
    zero_stages = zero_stages or work.framework.zero_stages
    schedules = schedules or work.framework.schedules
    B = work.global_batch
    n_blocks = len(work.profile(dtype).layers)
    transformer = isinstance(work.spec, TransformerSpec)
    make = Layout.maker(global_batch=B, dtype=dtype, cp=cp)  # Layout(global_batch=B, dtype=dtype, cp=cp, ...)
    out = []
    if not transformer:  # resnet / vgg / mlp: a data-parallel trunk, the classifier replicated or class-sharded
        for pp in _divisors(gpus):
            dp = gpus // pp
            per_replica = B // dp if B % dp == 0 else 0
            for mb in (_divisors(per_replica) if per_replica else [max(1, B // dp)]):
                scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + [
                    ("interleaved-1f1b", v) for v in VIRTUAL_STAGES if pp * v <= n_blocks]
                scheds = [s for s in scheds if s[0] in schedules or pp == 1]
                for sched, v in scheds:
                    for zero in (zero_stages if dp > 1 else (0,)):
                        heads = [k for k in _divisors(dp) if pp == 1 and zero == 0
                                 and work.spec.num_classes % k == 0] if dp > 1 else [1]
                        for k in heads or [1]:
                            out.append(make(dp=dp, tp=1, pp=pp, micro_batch=mb, schedule=sched, virtual_stages=v,
                                            zero=zero, head_parallel=k))
        return out
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            experts = moe.expert_degrees(work.spec, work.framework, dp * tp)  # [(1, 1)] for dense models
            per_replica = B // dp if B % dp == 0 else 0
            micro = _divisors(per_replica) if per_replica else [max(1, B // dp)]
            scheds: list[tuple[str, int]] = [("1f1b", 1)] if pp == 1 else (
                [("gpipe", 1), ("1f1b", 1)] + [("interleaved-1f1b", v) for v in VIRTUAL_STAGES
                                               if pp * v <= n_blocks] + ([("zb-v", 2)] if 2 * pp <= n_blocks else []))
            scheds = [s for s in scheds if s[0] in schedules or pp == 1]
            for mb in micro:
                for sched, v in scheds:
                    for zero in (zero_stages if dp > 1 else (0,)):
                        for sp in ((False, True) if tp > 1 and transformer else (False,)):
                            for ep, etp in experts:
                                lay = make(dp=dp, tp=tp, pp=pp, micro_batch=mb, schedule=sched, virtual_stages=v,
                                           zero=zero, sequence_parallel=sp, ep=ep, etp=etp)
                                if not (work.framework.moe_tp_needs_sp and lay.experts_beside_tp_without_sp):
                                    out.append(lay)  # (the stack refuses the others: costmodel.validate_layout)
    if context_parallel:  # a layout with cp > 1 is one of gpus/cp GPUs with each sequence split over cp ranks
        for degree in cp_degrees(work.spec, gpus):
            out += enumerate_layouts(work, gpus // degree, dtype, schedules, zero_stages, context_parallel=False,
                                     cp=degree)
    return out


@dataclass
class _BoundParts:
    """What a layout's lower bound is made of (computed once per layout and set of modes; the search asks
    for the bound twice, the second time with the recomputation memory forces)."""

    total: float  # all ranks' time per micro-batch, every block in its cheapest mode
    fullest: float  # the slowest rank's time per micro-batch at least, blocks being whole
    bwd_weight: float
    opt: float  # the optimizer step
    memory: dict[str, float]  # per mode, bytes on the most loaded rank at least
    forcing: tuple | None  # recomputation_bound's arguments where memory forces recomputation
    coupling: tuple  # slowest_rank_bound's arguments (time and memory per mode and kind of rank)
    waiting: tuple | None  # least_dp_wait's arguments (None: not bounded for this schedule)
    sends: float = 0.0  # of total, the point-to-point time no split avoids (_send_floor)
    least_sends: float = 0.0  # of fullest, the least of it any one rank pays
    forced_total: float | None = None
    coupled: float | None = None  # slowest_rank_bound, once asked for
    wait: float | None = None  # the ranks' mean data-parallel wait at least, once asked for
    memory_only: bool = False  # over the memory asked for: the time parts above left out (_bound_parts)
    states_alone: bool = False  # memory_only, known from the model states alone (every mode's memory their bytes)


def lower_bound(model: CostModel, lay: Layout, modes: tuple[str, ...], forced_recomputation: bool = True,
                data_parallel_wait: bool = True, beat: float = float("inf"),
                capacity: float | None = None) -> tuple[float, dict[str, float]]:
    """The time no stage split of ``lay`` can beat, and per recomputation mode the memory (bytes) its
    most loaded rank needs at least (see the module docstring). ``forced_recomputation``: charge the
    recomputation memory forces (see recomputation_bound; tighter, and dearer to compute);
    ``data_parallel_wait``: charge the ranks' least data-parallel wait (least_dp_wait; dearer too). Each part is
    computed once per layout (CostModel.bound_parts); the dearest (the slowest rank's, then the data-parallel
    wait: it decides only 52 of the demo's 1,479 second bounds) only while the bound stays below ``beat``.
    ``capacity``: GPU bytes; where even the least memory exceeds them the time is only the whole model's
    pipeline time (no sends, no optimizer step, none of the tighter parts): the caller rejects the layout.

    Time: the pipeline's closed form with perfectly divided work (or the slowest rank's whole blocks) and the
    sends between stages that every split has, the ranks' mean data-parallel wait after their own work, the
    optimizer step.
    Memory: the most loaded rank holds at least the average of all ranks: model states over pp ranks,
    plus activations with the least-memory recomputation, each stage holding at least as many
    micro-batches as the schedule's least-loaded stage, plus the framework allowance.
    """
    key = (lay, modes)
    parts = model.bound_parts.get(key)
    if parts is None or (parts.memory_only and capacity is None):
        parts = model.bound_parts[key] = _bound_parts(model, lay, modes, capacity)
    if parts.memory_only:
        return _pipeline_time(lay, parts.total, max(parts.total / lay.pp, parts.fullest), parts.bwd_weight), \
            parts.memory
    total, p = parts.total, lay.pp
    slowest = parts.fullest
    if forced_recomputation and parts.forcing is not None:
        if parts.forced_total is None:
            times, acts, states, least, room, counts = parts.forcing
            parts.forced_total = max(total, parts.sends + _shared_recomputation_bound(
                tuple(times.items()), tuple(acts.items()), states, tuple(least), room, tuple(counts)))
        total = parts.forced_total
    per_rank = total / p
    slowest = max(per_rank, slowest)
    if forced_recomputation and (parts.coupled is not None or beat == float("inf") or _pipeline_bound(
            model, lay, parts, total, slowest, False) < beat):
        if parts.coupled is None:  # identical layers: whole layers and stages of one mode (tighter, as cheap)
            parts.coupled = parts.least_sends + (whole_stage_bound(model, lay, modes) if model.repeated_blocks(lay)
                                                 else slowest_rank_bound(*parts.coupling) if p > 1 else 0.0)
        slowest = max(slowest, parts.coupled)
        if p == 1:  # one rank: its time is the whole model's
            total = max(total, slowest)
    bound = _pipeline_bound(model, lay, parts, total, slowest, False)
    if data_parallel_wait and (bound < beat or parts.wait is not None):  # the wait is dearer: only where it may tell
        bound = _pipeline_bound(model, lay, parts, total, slowest, True)
    return bound, parts.memory


def time_bound(model: CostModel, lay: Layout) -> float:
    """The search's cheap first bound: :func:`lower_bound`'s first-pass time less the optimizer step, from the
    whole model's costs without recomputation alone (one block table per class of layouts: not the other modes',
    not the memory bound), so never above it. A layout whose time_bound cannot beat the k-th best needs neither."""
    place = layout_placement(model.work.cluster, lay)
    key = model._table_key(lay, place)
    # all it reads of the layout besides its table (thousands of layouts apart in ZeRO stage alone share it)
    memo = (key, "time", lay.schedule, lay.pp, lay.virtual_stages, lay.num_micro_batches)
    got = model.bound_classes.get(memo)
    if got is None:
        base = model.totals(lay, "none", place, key)
        total = base["fwd"] + base["bwd_input"] + base["bwd_weight"] + base["tp_fwd"] + base["tp_bwd"]
        slowest = max(total / lay.pp, model.block_table(lay, place, "none", key).fullest_rank(lay.pp))
        got = model.bound_classes[memo] = _pipeline_time(lay, total, slowest, base["bwd_weight"])
    return got


def _pipeline_bound(model: CostModel, lay: Layout, parts: _BoundParts, total: float, slowest: float,
                    data_parallel_wait: bool) -> float:
    """lower_bound's time from the ranks' summed and the slowest rank's time per micro-batch."""
    p, m = lay.pp, lay.num_micro_batches
    per_rank = total / p
    pipe = _pipeline_time(lay, total, slowest, parts.bwd_weight)
    if data_parallel_wait and parts.waiting is not None:
        if parts.wait is None:
            parts.wait = least_dp_wait(model, lay, *parts.waiting)
        # The data-parallel waits come after a rank's own m micro-batches, so the ranks' mean end is at least
        # m·total/p plus their mean wait (least_dp_wait). Without it ZeRO-3's per-micro-batch gathers went unbounded.
        pipe = max(pipe, m * per_rank + parts.wait)
    return pipe + parts.opt


def _pipeline_time(lay: Layout, total: float, slowest: float, bwd_weight: float) -> float:
    """The pipeline's least time from all ranks' summed (``total``) and the slowest rank's time per micro-batch;
    ``bwd_weight``: the summed weight-gradient part of ``total`` (what ZB-V may defer)."""
    p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
    if p == 1 or lay.schedule in ("gpipe", "1f1b"):
        return (m - 1) * slowest + total
    if lay.schedule == "interleaved-1f1b" and m >= p:
        return m * slowest + (p - 1) / v * (total / p)
    # Any schedule: the first micro-batch's forward through every stage, then its backward back through
    # them, one after another (ZB-V may leave the weight gradients for later): with few micro-batches
    # per pipeline rank this chain, not the ranks' work, is what bounds the step.
    return max(m * slowest, total - (bwd_weight if lay.schedule == "zb-v" else 0.0))


@dataclass
class _BlockClass:
    """What _bound_parts needs of the layouts that share a block table (CostModel._table_key: micro-batch, tp, cp,
    sequence parallelism, ...): the whole model's costs per mode. Thousands of layouts (dp, pp, schedule, ZeRO)
    share a few hundred of these."""

    totals: dict[str, dict[str, float]]  # per mode (and "none"): CostModel.totals
    params: float  # one replica's non-expert parameters on its ranks (a tied weight counted once)
    experts: float  # its expert-parallel parameters
    acts: dict[str, float]  # per mode: activation bytes per micro-batch, whole model
    working: dict[str, float]  # per mode: the largest block working set
    working_alone: dict[str, float]  # per mode: what the loss's rank adds to all its activations at its peak (least)
    times: dict[str, float]  # per mode: all ranks' time per micro-batch
    total: float  # all ranks' time per micro-batch without recomputation
    table: Any  # the block table without recomputation (fullest_rank, largest_output)


@dataclass
class _StateClass:
    """What the layouts sharing a block table without recomputation hold and take whatever the modes: the whole
    model's parameters and its time per micro-batch (_block_class's, from the one table; its memory-only bound)."""

    params: float  # one replica's non-expert parameters on its ranks (a tied weight counted once)
    experts: float  # its expert-parallel parameters
    total: float  # all ranks' time per micro-batch without recomputation
    bwd_weight: float  # of total, the weight gradients'
    table: Any  # the block table without recomputation


def _state_class(model: CostModel, lay: Layout, place) -> _StateClass:
    key = model._table_key(lay, place)
    got = model.bound_classes.get((key, "states"))
    if got is None:
        base = model.totals(lay, "none", place, key)
        params = base["params"]
        head = model.work.profile(lay.dtype).layers[-1]
        if head.tied_params:  # a tied embedding/head weight: one copy where both ends share a rank (the least)
            params -= head.tied_params * base["head_params"] / head.params
        got = model.bound_classes[(key, "states")] = _StateClass(
            params=params - base["experts"], experts=base["experts"],
            total=sum(base[k] for k in ("fwd", "bwd_input", "bwd_weight", "tp_fwd", "tp_bwd")),
            bwd_weight=base["bwd_weight"], table=model.block_table(lay, place, "none", key))
    return got


def _block_class(model: CostModel, lay: Layout, place, modes: tuple[str, ...]) -> _BlockClass:
    key = (model._table_key(lay, place), modes)
    got = model.bound_classes.get(key)
    if got is not None:
        return got
    totals = {u: model.totals(lay, u, place, key[0]) for u in {*modes, "none"}}
    base = _state_class(model, lay, place)
    timed = ("fwd", "bwd_input", "bwd_weight", "recompute", "tp_fwd", "tp_bwd")
    got = model.bound_classes[key] = _BlockClass(
        totals=totals, params=base.params, experts=base.experts,
        acts={u: totals[u]["act_bytes"] for u in modes}, working={u: totals[u]["working"] for u in modes},
        working_alone={u: _working_alone(model.block_table(lay, place, u, key[0])) for u in modes},
        times={u: sum(totals[u][k] for k in timed) for u in modes}, total=base.total, table=base.table)
    return got


def _working_alone(table) -> float:
    """What the rank holding the loss's stage alone (every block at pp 1; a 1F1B or GPipe pipeline's last) adds at its
    peak to its model states and all its activations, at least (costmodel._loss_moments): the loss's working set (the
    head block's), or a layer's less the head's saved activations its backward has freed by then; the largest block
    working set where the head has none. Charging the largest working set on top of every activation (the rule ranks
    of several chunks keep) came up to 9% over the price of llama-small with a 512 vocabulary, fp32, full recomputation
    at pp 1: the bound was no bound."""
    loss = table.working[-1]
    if not loss:
        return max(table.working)
    return max(loss, max(table.working[:-1], default=0.0) - table.costs[-1].act_bytes)


def _bound_parts(model: CostModel, lay: Layout, modes: tuple[str, ...], capacity: float | None = None) -> _BoundParts:
    """:func:`lower_bound`'s parts of ``lay``; where even the least memory (over the modes) exceeds ``capacity``
    bytes, the memory alone with the time from the whole model's costs, without sends and optimizer step (cheaper
    and still a bound: the search rejects such a layout at once). Where the model states alone (no activations, no
    working set) exceed ``capacity``, every mode's memory is theirs, found from the block table without recomputation
    alone: the modes' tables are never priced (llama2-70b's re-plan on 8 GPUs, where nothing fits: 0.13 -> 0.09 s)."""
    work = model.work
    place = layout_placement(work.cluster, lay)
    p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
    gpu = work.cluster.gpu
    schedule = lay.schedule if p > 1 else "1f1b"
    # model states over the whole model, per rank (memory.state_bytes): gradients only where they are sure to
    # meet the activation peak (CostModel.grads_at_activation_peak), the rest always; ranks alike counted once
    per = state_bytes(work.framework, lay)
    # sharded over edp (planner/moe.py); a model without MoE blocks has no experts: the other parameters' bytes
    per_e = moe.expert_states(work.framework, lay) if model.has_experts(lay.dtype) else per
    kinds = _rank_kinds(schedule, p, v, m)  # ((gradients at the peak, fewest micro-batches held), ranks)
    least = [f for (_, f), _ in kinds]
    counts = [c for _, c in kinds]
    held, held_e = per.weights + per.optimizer, per_e.weights + per_e.optimizer

    def states_of(params: float, experts: float) -> list[float]:
        return [params * (held + per.grads if g else held) + experts * (held_e + per_e.grads if g else held_e)
                for (g, _), _ in kinds]

    first = per.start_weights or per_e.start_weights  # chunks gathered at the step's first moment (memory.start_bytes)
    if capacity is not None:  # the model states alone (no activations, no working set) over the GPU: every mode
        base = _state_class(model, lay, place)  # is out of memory, known without pricing the modes' block tables
        held_alone = states_of(base.params, base.experts)
        alone = _equalised_bytes(held_alone, least, counts, [0.0])[0] if min(held_alone) > 0 else 0.0
        if first:
            alone = max(alone, _start_floor(per, per_e, base.params, base.experts, p))
        alone += untracked_bytes(gpu, alone)
        if alone > capacity:
            return _BoundParts(total=base.total, fullest=base.table.fullest_rank(p), bwd_weight=base.bwd_weight,
                               opt=0.0, memory=dict.fromkeys(modes, alone), forcing=None, coupling=(), waiting=None,
                               memory_only=True, states_alone=True)
    cls = _block_class(model, lay, place, modes)
    params, experts, acts, times = cls.params, cls.experts, cls.acts, cls.times
    states = states_of(params, experts)
    allowance = untracked_bytes(gpu, 0.0)
    room = (work.memory_limit_bytes - allowance) / (1 + FRAGMENTATION)
    # Memory: relax the split to fractions phi_r of every block on rank r. Rank r then needs
    # phi_r·(states_r + f_r·acts) with f_r the fewest micro-batches any of its stages holds at its peak;
    # the best split equalises the ranks, so max_r >= 1 / sum_r 1/(states_r + f_r·acts).
    equalised = _equalised_bytes(states, least, counts, [acts[u] for u in modes])
    floor = _start_floor(per, per_e, params, experts, p) if first else 0.0
    memory = {}
    # the rank of the loss's stage alone (pp 1; 1F1B's and GPipe's last: costmodel._loss_moments) adds at least
    # working_alone; a rank of several chunks, the largest of its blocks' working sets
    working = cls.working_alone if v == 1 else cls.working
    for u, held_bytes in zip(modes, equalised, strict=True):
        tensors = max(held_bytes + working[u], floor)
        memory[u] = tensors + untracked_bytes(gpu, tensors)
    if capacity is not None and min(memory.values()) > capacity:  # out of memory on any split: time parts left out
        return _BoundParts(total=cls.total, fullest=cls.table.fullest_rank(p), bwd_weight=cls.totals["none"][
            "bwd_weight"], opt=0.0, memory=memory, forcing=None, coupling=(), waiting=None, memory_only=True)
    # all ranks' time per micro-batch: every block in its cheapest mode, unless memory forces recomputation
    cheapest = min(times, key=times.get)
    forcing = (times, acts, min(states), least, room, counts) \
        if len(modes) > 1 and equalised[modes.index(cheapest)] > room else None
    coupling = (times, acts, states, least, counts, room, p)
    # the mean wait after the ranks' own work bounds the closed forms' drain and the simulator alike (not where
    # the interleaved warm-up is simulated)
    waiting = (cls.totals, modes, params, experts) \
        if lay.head_parallel == 1 and not (p > 1 and schedule == "interleaved-1f1b" and m < p) else None
    opt = optimizer_step(model, lay).at(RankLoad(params=params / p))
    if experts:
        opt += moe.expert_optimizer_step(model, lay).at(RankLoad(experts=experts / p))
    sends, least_sends = _send_floor(model, lay, place, cls.table)
    # blocks are whole: with few layers per rank the slowest rank, not total/p, binds (on the cheapest costs)
    return _BoundParts(total=cls.total + sends, fullest=cls.table.fullest_rank(p) + least_sends,
                       bwd_weight=cls.totals["none"]["bwd_weight"], opt=opt, memory=memory, forcing=forcing,
                       coupling=coupling, waiting=waiting, sends=sends, least_sends=least_sends)


def _start_floor(per, per_e, params: float, experts: float, p: int) -> float:
    """The tensor bytes of the step's first moment (memory.start_bytes) on the most loaded of ``p`` ranks, at least:
    their mean."""
    return (params * per.start_per_param + experts * per_e.start_per_param) / p


def _send_floor(model: CostModel, lay: Layout, place, table) -> tuple[float, float]:
    """The point-to-point time per micro-batch that no split avoids: (all ranks', the least any rank pays). Every
    boundary between consecutive stages on different ranks exists whatever the split (CostModel.stage_costs: the
    sender waits for its output to go, the receiver for the gradient to come back), and moves at least the smallest
    output any block but the last can send."""
    if lay.pp == 1:
        return 0.0, 0.0
    smallest = table.smallest_output
    near, far = (model.p2p_seconds(lay, smallest, cross, place) for cross in (False, True))
    per_rank = [a * near + b * far for a, b in _boundary_counts(lay.schedule, lay.pp, lay.virtual_stages, place)]
    return sum(per_rank), min(per_rank)


@lru_cache(maxsize=1024)
def _boundaries(schedule: str, p: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per pipeline rank, the stage boundaries it sends or receives across, as (sending rank, receiving rank)."""
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    for s in range(p * v - 1):
        a, b = stage_rank(schedule, s, p), stage_rank(schedule, s + 1, p)
        if a != b:
            pairs[a].append((a, b))
            pairs[b].append((a, b))
    return tuple(tuple(x) for x in pairs)


@lru_cache(maxsize=4096)
def _boundary_counts(schedule: str, p: int, v: int, place) -> tuple[tuple[int, int], ...]:
    """Per pipeline rank, its boundaries (:func:`_boundaries`) inside a node and across nodes (Placement.crosses)."""
    out = []
    for pairs in _boundaries(schedule, p, v):
        across = sum(place.crosses(a, b) for a, b in pairs)
        out.append((len(pairs) - across, across))
    return tuple(out)


def _equalised_bytes(states: list[float], least: list[int], counts: list[int], acts: list[float]) -> list[float]:
    """Per activation size a_u: 1 / sum_k counts_k / (states_k + least_k·a_u), the bytes every rank holds when a
    relaxed split equalises the ranks (_bound_parts' memory bound)."""
    if len(states) * len(acts) <= 40:  # few kinds of rank, or one size: plain Python is quicker than numpy's set-up
        return [1.0 / sum(c / (st + f * a) for st, f, c in zip(states, least, counts, strict=True)) for a in acts]
    den = np.array(states)[None, :] + np.multiply.outer(acts, least)  # (U, K): a rank of kind k's bytes per model
    return (1.0 / (np.array(counts, dtype=float) / den).sum(axis=1)).tolist()


def least_dp_wait(model: CostModel, lay: Layout, totals: dict[str, dict[str, float]], modes: tuple[str, ...],
                  params: float, experts: float) -> float:
    """A lower bound on the pipeline ranks' mean data-parallel wait (dp_sync.py, moe.expert_exposures) over
    every stage split and per-stage recomputation: each wait is convex in the rank's load from below
    (Exposure.least_seconds) and falls as its overlap window grows, so the wait at the ranks' mean load — with
    the window at most the dearest mode's backward, the stages' host overheads and every boundary's send —
    bounds their mean. ``params``, ``experts``: the whole model's on one replica (a tied weight counted once)."""
    work, p = model.work, lay.pp
    place = layout_placement(work.cluster, lay)
    base = totals["none"]
    window = max(sum(totals[u][k] for k in ("bwd_input", "bwd_weight", "recompute", "tp_bwd")) for u in modes)
    window += lay.num_stages * model.stage_host_overhead(lay) / 2
    if p > 1:
        boundary = model.block_table(lay, place, "none").largest_output
        window += (lay.num_stages - 1) * max(model.p2p_seconds(lay, boundary, cross, place) for cross in (True, False))
    load = RankLoad(params=params / p, fwd=base["fwd"] / p, bwd=(base["bwd_input"] + base["bwd_weight"]) / p,
                    window=window / p, replicated=base["replicated"] / p, experts=experts / p,
                    moe_shared=base["moe_shared"] / p)
    return sum(e.least_seconds(load) for e in model.dp_items_of(lay, place, False, 0.0))


@lru_cache(maxsize=4096)
def _rank_kinds(schedule: str, p: int, v: int, m: int) -> tuple[tuple[tuple[bool, int], int], ...]:
    """The pipeline ranks grouped by what the memory bound needs of each: whether gradients meet its activation
    peak (CostModel.grads_at_activation_peak) and the fewest micro-batches any of its stages holds at it;
    with how many ranks share each."""
    kinds: dict[tuple[bool, int], int] = {}
    for r, d in enumerate(in_flight(schedule, p, v, m)):
        stages = rank_stages(schedule, r, p, v)
        key = (grads_meet_peak(schedule, p, v, m, stages, d), min(d.values()) if d else 1)
        kinds[key] = kinds.get(key, 0) + 1
    return tuple(kinds.items())


def recomputation_bound(times: dict[str, float], acts: dict[str, float], states: float, least: list[int],
                        room: float, counts: list[int] | None = None) -> float:
    """A lower bound on the ranks' summed time per micro-batch when memory forces recomputation.

    The relaxation of the memory bound above, with modes: rank r holds fractions phi[r,u] of the model's
    blocks in mode u (whole-model time T_u, activations a_u), within its memory,
    sum_u phi[r,u]·(states + f_r·a_u) <= room, and sum phi = 1. Minimising sum phi[r,u]·T_u is a linear
    program; any point of its dual bounds it from below:
    D(mu) = mu - room·sum_r max_u (mu - T_u)^+ / (states + f_r·a_u), for every mu.
    D is concave and piecewise linear, so its maximum lies on a breakpoint: some T_u, or where two
    modes' pieces of one rank cross. Evaluated at all of them at once (numpy).
    """
    import numpy as np

    t = np.array(list(times.values()))  # (U,)
    a = np.array([acts[u] for u in times])  # (U,)
    den = states + np.outer(np.array(least, dtype=float), a)  # (P, U): rank r's bytes per model in mode u
    # crossings of mode pieces within a rank: (mu - t_i)/d_i = (mu - t_j)/d_j
    i, j = _mode_pairs(len(t))
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (t[j] * den[:, i] - t[i] * den[:, j]) / (den[:, i] - den[:, j])  # (P, pairs)
    mu = np.concatenate([t, cross[np.isfinite(cross)]])
    mu = mu[mu >= t.min()]  # (M,)
    pieces = np.maximum(mu[:, None, None] - t[None, None, :], 0.0) / den[None, :, :]  # (M, P, U)
    weight = np.ones(len(least)) if counts is None else np.array(counts, dtype=float)  # (P,) ranks per kind
    dual = mu - room * (pieces.max(axis=2) * weight[None, :]).sum(axis=1)  # (M,)
    return float(dual.max())


@lru_cache(maxsize=16)
def _mode_pairs(modes: int) -> tuple[np.ndarray, np.ndarray]:
    """np.triu_indices(modes, 1): every pair of modes once (i < j), for recomputation_bound's crossings (made once:
    a third of that bound's time in a fresh process). Shared: read-only."""
    return np.triu_indices(modes, 1)


@lru_cache(maxsize=4096)
def _shared_recomputation_bound(times: tuple, acts: tuple, states: float, least: tuple, room: float, counts: tuple
                                ) -> float:
    """recomputation_bound of hashable arguments: layouts of one block class whose ranks hold alike share it (the
    demo asks 1,212 times for 368 distinct ones)."""
    return recomputation_bound(dict(times), dict(acts), states, list(least), room, list(counts))


def slowest_rank_bound(times: dict[str, float], acts: dict[str, float], states: list[float], least: list[int],
                       counts: list[int], room: float, p: int) -> float:
    """A lower bound on the slowest pipeline rank's time per micro-batch, time and memory together.

    The relaxation of lower_bound's memory bound, with each rank's time: rank kind k (``counts[k]`` ranks,
    holding at least ``least[k]`` micro-batches, ``states[k]`` bytes of model states per whole model) holds
    fractions phi_u of the model's blocks in mode u (whole-model time T_u, activations a_u). Within a time tau
    and its memory it holds at most cap_k(tau) = max sum phi_u s.t. sum phi_u T_u <= tau and
    sum phi_u (states_k + least_k a_u) <= room — a two-row LP, whose optimum uses one mode or two with both rows
    tight. Every block must be held: the slowest rank needs a tau with sum_k counts_k cap_k(tau) >= 1, and cap
    grows with tau, so the least such tau is found on refined grids (numpy), kept at the grid point below it.
    Where memory alone forces the first ranks (which hold the most micro-batches) to take less than 1/p of the
    model, the others must take more: with few micro-batches this, not total/p, is the slowest rank's time.
    """
    import numpy as np

    T = np.array(list(times.values()))  # (U,)
    D = np.array(states)[:, None] + np.outer(np.array(least, dtype=float), [acts[u] for u in times])  # (K, U)
    C = np.array(counts, dtype=float)  # (K,)
    pairs = [(i, j) for i in range(len(T)) for j in range(i + 1, len(T))]

    def capacity(tau):  # (G,) -> (G,): sum_k counts_k cap_k(tau)
        best = np.minimum(tau[:, None, None] / T[None, None, :], room / D[None, :, :]).max(axis=2)  # (G, K)
        for i, j in pairs:
            det = T[i] * D[:, j] - T[j] * D[:, i]  # (K,)
            with np.errstate(divide="ignore", invalid="ignore"):
                phi_i = (tau[:, None] * D[None, :, j] - T[j] * room) / det[None, :]  # (G, K)
                phi_j = (T[i] * room - tau[:, None] * D[None, :, i]) / det[None, :]
            both = (det[None, :] != 0) & (phi_i >= 0) & (phi_j >= 0)
            best = np.where(both, np.maximum(best, phi_i + phi_j), best)
        return best @ C

    lo, hi = float(T.min()) / p, float(T.max())
    if capacity(np.array([hi]))[0] < 1:  # not even the slowest mode fits: the memory bound says so
        return lo
    for _ in range(2):
        grid = np.linspace(lo, hi, 41)
        ok = capacity(grid) >= 1
        first = int(np.argmax(ok))  # ok[-1] holds: hi is feasible
        if first == 0:
            return float(grid[0])
        lo, hi = float(grid[first - 1]), float(grid[first])
    return lo


@lru_cache(maxsize=4096)
def _rank_profiles(schedule: str, p: int, v: int, m: int) -> tuple[tuple[bool, int, bool, bool, int, int], ...]:
    """Per pipeline rank: whether gradients meet its activation peak, the fewest micro-batches any of its stages
    holds at that peak (as _rank_kinds), whether it holds the pipeline's first stage (the embedding's) and its last
    (the head's), and the micro-batches each of those holds at the peak (0 where the rank does not hold it)."""
    last = p * v - 1
    out = []
    for r, d in enumerate(in_flight(schedule, p, v, m)):
        stages = rank_stages(schedule, r, p, v)
        first_held, last_held = 0 in stages, last in stages
        out.append((grads_meet_peak(schedule, p, v, m, stages, d), min(d.values()) if d else 1, first_held,
                    last_held, d.get(0, 0) if first_held else 0, d.get(last, 0) if last_held else 0))
    return tuple(out)


@lru_cache(maxsize=4096)
def _rank_arrays(schedule: str, p: int, v: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """_rank_profiles as whole_stage_bound's arrays: per rank 1.0 where gradients meet its peak (R,), the fewest
    micro-batches a stage holds then (R,), whether it holds the first and the last stage (R, 2), and their
    micro-batches at the peak (R, 2). Shared: read-only."""
    ranks = _rank_profiles(schedule, p, v, m)
    return (np.array([float(g) for g, *_ in ranks]), np.array([f for _, f, *_ in ranks]),
            np.array([[first, last] for _, _, first, last, _, _ in ranks], dtype=float),
            np.array([[f, g] for *_, f, g in ranks], dtype=float))


def _layer_class(model: CostModel, lay: Layout, modes: tuple[str, ...]) -> tuple:
    """What whole_stage_bound needs of a layout's block tables, shared by every layout with the same ones
    (CostModel._table_key): per mode a layer's time T and activation bytes A (U,), its parameters without and with
    experts, the embedding's and the head's least time and activation bytes over the modes (2,) each, and the modes'
    frontier (_Frontier)."""
    place = layout_placement(model.work.cluster, lay)
    key = ("whole layers", model._table_key(lay, place), modes)
    got = model.bound_classes.get(key)
    if got is None:
        tables = [model.block_table(lay, place, u, key[1]).costs for u in modes]  # per mode: every block's costs
        layer = [c[1] for c in tables]
        T, A = np.array([_busy_seconds(c) for c in layer]), np.array([c.act_bytes for c in layer])
        got = model.bound_classes[key] = (
            T, A, layer[0].params - layer[0].experts, layer[0].experts,
            np.array([min(_busy_seconds(c[j]) for c in tables) for j in (0, -1)]),
            np.array([min(c[j].act_bytes for c in tables) for j in (0, -1)]), _Frontier.of(T, A))
    return got


def _busy_seconds(cost) -> float:
    """A block's seconds per micro-batch on its rank: both passes, its recomputation, its tensor-parallel sends."""
    return cost.fwd + cost.bwd_input + cost.bwd_weight + cost.recompute + cost.tp_fwd + cost.tp_bwd


def whole_stage_bound(model: CostModel, lay: Layout, modes: tuple[str, ...]) -> float:
    """A lower bound on the slowest pipeline rank's time per micro-batch for a model of identical layers (between
    an embedding and a head), from what slowest_rank_bound relaxes away: layers are whole and a stage has one
    recomputation mode (the ILP's and the quick split's space; Partition.recompute is per stage).

    Each layer costs T_u seconds per micro-batch in mode u and, on rank r, s_r + f·a_u bytes at the rank's peak (its
    model states, and its activations times the f micro-batches its stage holds then, in_flight's moment); the
    rank's room is the GPU's memory less the framework allowance, as in _bound_parts. The working set and every send
    are left out (each only adds), but for the embedding and the head: the rank holding the first stage holds the
    embedding, the one holding the last the head, each at its least time over the modes and its activations' least
    bytes times its stage's micro-batches (its parameters left out). Rank r holds n whole layers in time t_r(n) at
    least: with one stage (v = 1) in a single mode, the least n·T_u whose bytes fit; with v stages, by the chunk
    rule (ilp.chunks_balanced: chunks within a layer of each other, an end chunk one fewer), each chunk at its own
    micro-batches with at least ceil(L/S) - 1 layers (an end chunk one fewer), S stages in all, modes mixed per
    chunk (_chunk_hold_times); a single rank (pp 1) holds all L. Every layer is held, each t_r grows with n, so the
    slowest rank's time is at least the L-th smallest of all t_r(n), n = 1..L, and at least each rank's time for
    its least layers: exact for this relaxation, no grid. 0.0: not such a model."""
    if not model.repeated_blocks(lay):
        return 0.0
    work = model.work
    p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
    T, A, plain, experts, end_time, end_acts, frontier = _layer_class(model, lay, modes)
    per = state_bytes(work.framework, lay)
    per_e = moe.expert_states(work.framework, lay) if model.has_experts(lay.dtype) else per
    held = plain * (per.weights + per.optimizer) + experts * (per_e.weights + per_e.optimizer)
    grads = plain * per.grads + experts * per_e.grads
    schedule = lay.schedule if p > 1 else "1f1b"
    with_grads, fewest, holds, end_flights = _rank_arrays(schedule, p, v, m)
    states = held + grads * with_grads  # (R,)
    gpu = work.cluster.gpu
    room = (work.memory_limit_bytes - untracked_bytes(gpu, 0.0)) / (1 + FRAGMENTATION)
    # the embedding (first stage) and the head (last stage) on the ranks that hold them: least time and bytes,
    # the activations as many times as their stage holds micro-batches at the rank's peak
    offset = holds @ end_time  # (R,)
    room = room - end_flights @ end_acts  # (R,): what the rank's layers may use
    L = len(work.profile(lay.dtype).layers) - 2
    if p > 1 and v > 1:  # each chunk's layers at its own micro-batches in flight
        # only the counts the chunk rule allows a rank (each holds at least its least: below, that time)
        held_at_peak, base, spare, least, lo, hi = _chunk_shape(schedule, p, v, m, L)
        times = np.full((p, L + 1), np.inf)
        times[:, lo:hi + 1] = _chunk_hold_times(np.arange(lo, hi + 1), T, A, states, held_at_peak, base, spare, room,
                                                shape_key=(schedule, p, v, m, L), frontier=frontier)
        times[:, :lo] = times[:, lo:lo + 1]
    else:  # one stage per rank; a single rank (pp 1) holds every layer
        least = np.array([L]) if p == 1 else np.zeros(len(states), dtype=int)
        D = states[:, None] + np.outer(fewest, A)  # (R, U)
        times = _hold_times(np.arange(L + 1), T, D, room)
    times = times + offset[:, None]  # (R, L + 1): rank r holding n layers
    need = float(times[np.arange(len(states)), least].max())
    if not np.isfinite(need):
        return 0.0  # some rank cannot hold its least layers: the memory bound's business, not this one's
    # each rank's times grow with its layers, so the least slowest time that holds all L is the L-th smallest of
    # the ranks' times to hold one more layer (1..L each)
    steps = times[:, 1:].ravel()
    if np.isfinite(steps).sum() < L:
        return need
    return max(need, float(np.partition(steps, L - 1)[L - 1]))


@lru_cache(maxsize=4096)
def _chunk_shape(schedule: str, p: int, v: int, m: int, L: int) -> tuple:
    """Per pipeline rank, its chunks ordered by the micro-batches they hold at the rank's peak (in_flight's moment),
    fewest first: those counts (R, v), and by the chunk rule with L layers over S stages each chunk's least layers
    (some low has inner chunks of low or low + 1, end chunks one fewer at least, so S·(low + 1) >= L: low >=
    ceil(L/S) - 1) and how many more it may take (S·low - 2 <= L: at most floor((L + 2)/S) + 1 in all), (R, v)
    each; then each rank's least layers (R,), and the fewest and the most layers the rule lets any rank hold:
    (held, base, spare, least, lo, hi).
    Shared: read-only."""
    S = p * v
    low, top = -(-L // S) - 1, (L + 2) // S + 1
    held, base = [], []
    for r, d in enumerate(in_flight(schedule, p, v, m)):
        chunks = sorted((d.get(s, 0), max(0, low - (s in (0, S - 1)))) for s in rank_stages(schedule, r, p, v))
        held.append([h for h, _ in chunks])
        base.append([b for _, b in chunks])
    held_a, base_a = np.array(held, dtype=float), np.array(base)
    spare = np.maximum(top - base_a, 0)
    least = base_a.sum(axis=1)
    return held_a, base_a, spare, least, int(least.min()), min(L, int((base_a + spare).sum(axis=1).max()))


def _frontier(T: np.ndarray, A: np.ndarray) -> list[int]:
    """The modes on the lower convex hull of (activation bytes, time) from the fastest: those a least-time mix
    within a memory budget uses (any other is beaten by a mix of two of them). Along it the bytes fall and the
    time per byte saved grows."""
    order = sorted(range(len(T)), key=lambda u: (T[u], A[u]))
    hull = [order[0]]
    for u in order[1:]:
        if A[u] >= A[hull[-1]]:
            continue  # slower and no smaller
        while len(hull) >= 2 and (T[hull[-1]] - T[hull[-2]]) * (A[hull[-1]] - A[u]) >= \
                (T[u] - T[hull[-1]]) * (A[hull[-2]] - A[hull[-1]]):
            hull.pop()  # above the chord from the one before to u
        hull.append(u)
    return hull


@dataclass(frozen=True, eq=False)
class _Frontier:
    """The modes' frontier (_frontier) of a layer's times T and bytes A, as _chunk_hold_times steps down it:
    computed once per layer class (_layer_class)."""

    hull: list[int]
    t0: float  # the fastest mode's time
    a0: float  # and bytes
    dT: np.ndarray  # (K,): time each step down the frontier adds per layer
    dA: np.ndarray  # (K,): bytes per micro-batch it saves per layer
    slope: np.ndarray  # (K,): dT / dA, seconds per byte saved

    @classmethod
    def of(cls, T: np.ndarray, A: np.ndarray) -> _Frontier:
        hull = _frontier(T, A)
        dT, dA = np.diff(T[hull]), -np.diff(A[hull])
        return cls(hull, T[hull[0]], A[hull[0]], dT, dA, dT / dA)


def _chunk_hold_times(counts: np.ndarray, T: np.ndarray, A: np.ndarray, states: np.ndarray, held: np.ndarray,
                      base: np.ndarray, spare: np.ndarray, room: np.ndarray, shape_key: tuple | None = None,
                      frontier: _Frontier | None = None) -> np.ndarray:
    """(N,) -> (R, N): each rank's least time per micro-batch to hold ``counts[n]`` layers over its v chunks within
    its memory ``room`` (R,) (whole_stage_bound, v > 1). A layer costs T_u seconds in mode u and, in chunk c of rank
    r, states[r] + held[r, c]·A_u bytes; by the chunk rule chunk c holds at least base[r, c] layers and at most
    ``spare[r, c]`` more. Chunks come fewest micro-batches first (_chunk_shape), and the layers beyond the least fill
    them in that order (relaxed: the rule would also keep them within a layer of each other); inf beyond what the
    rule allows. Each chunk may mix modes (relaxed: the ILP gives a stage one): the least time is then a fractional
    knapsack, solved greedily — every chunk in the fastest mode, then steps down the modes' frontier (_frontier),
    cheapest time per byte saved first (a step's rate in chunk c is its frontier slope over held[r, c]), until the
    rank fits; inf where even the smallest modes do not. Never falling as the count grows.
    ``shape_key``: what ``counts``, ``held``, ``base`` and ``spare`` are made from (whole_stage_bound's), so that
    their share of the work (_ChunkFill) is done once for every layout of that pipeline; ``frontier``: T and A's
    (_Frontier.of(T, A)), where the caller has it."""
    fill = _chunk_fill(shape_key, counts, held, base, spare) if shape_key is not None \
        else _ChunkFill.of(counts, held, base, spare)
    R, V = held.shape
    N = len(counts)
    front = frontier if frontier is not None else _Frontier.of(T, A)
    t0, a0 = front.t0, front.a0
    n = fill.n
    over = n * states[:, None] + fill.held_layers * a0 - room[:, None]  # (R, N): bytes to save
    over[fill.beyond] = np.inf  # more than the chunk rule lets the rank hold
    fastest = n * t0
    K = len(front.hull) - 1
    if K == 0 or not (over > 0).any():  # one mode, or the fastest fits everywhere
        return np.where(over <= 0, fastest, np.inf)
    dT, dA = front.dT, front.dA  # (K,) each
    rows = np.arange(R)[:, None]
    if K == 1:  # one step per chunk: its order (by held alone) and the layers it takes are the pipeline's (_ChunkFill)
        chunk, layers = fill.order, fill.layers
        # a chunk holding none saves nothing (inf seconds a byte); np.errstate only then (its set-up is not free)
        with nullcontext() if fill.held_all else np.errstate(divide="ignore"):
            rate = front.slope[0] / fill.held_sorted  # (R, S = V): seconds per byte saved, cheapest first
        step_saves, step_adds = fill.held_sorted * dA[0], dT[0]
    else:
        with np.errstate(divide="ignore"):
            rate = (front.slope[None, None, :] / held[:, :, None]).reshape(R, V * K)  # (R, S): seconds per byte saved
        order = np.argsort(rate, axis=1, kind="stable")  # (R, S): the steps, cheapest first
        rate = rate[rows, order]
        chunk, step = np.divmod(order, K)  # (R, S)
        layers = fill.k[rows[:, :, None], np.arange(N)[None, :, None], chunk[:, None, :]]  # (R, N, S)
        step_saves, step_adds = held[rows, chunk] * dA[step], dT[step][:, None, :]
    saved = np.zeros((R, N, V * K + 1))
    added = np.zeros((R, N, V * K + 1))
    np.cumsum(layers * step_saves[:, None, :], axis=2, out=saved[:, :, 1:])
    np.cumsum(layers * step_adds, axis=2, out=added[:, :, 1:])
    whole = (saved[:, :, 1:] < over[:, :, None]).sum(axis=2)  # (R, N): steps taken whole before one taken in part
    ri, ni = rows, np.arange(N)[None, :]  # (R, 1), (1, N): what np.ogrid gives, without its slower set-up
    part = rate[ri, np.minimum(whole, V * K - 1)]  # (R, N)
    with np.errstate(invalid="ignore"):
        mixed = fastest + added[ri, ni, whole] + (over - saved[ri, ni, whole]) * part
    return np.where(over <= 0, fastest, np.where(whole < V * K, mixed, np.inf))


@dataclass
class _ChunkFill:
    """_chunk_hold_times' arrays that depend on the pipeline alone (the counts and the chunks' held, least and spare
    layers), not on the layer's costs or the rank's memory: computed once per pipeline shape (_chunk_fill)."""

    n: np.ndarray  # (R, N): layers a rank holds at each count (its chunks' least at least)
    k: np.ndarray  # (R, N, V): layers per chunk, the least first, the rest to the chunks in order up to their spare
    held_layers: np.ndarray  # (R, N): sum over chunks of k·held (micro-batches' layers at the peak)
    beyond: np.ndarray  # (R, N): more layers than the chunk rule lets the rank hold
    order: np.ndarray  # (R, V): the chunks by held[r, c], most first (a one-step frontier's cheapest steps first)
    held_sorted: np.ndarray  # (R, V): held in that order
    layers: np.ndarray  # (R, N, V): k in that order
    held_all: bool  # every chunk holds a micro-batch at its rank's peak (no division by zero in its rates)

    @classmethod
    def of(cls, counts: np.ndarray, held: np.ndarray, base: np.ndarray, spare: np.ndarray) -> _ChunkFill:
        R, V = held.shape
        N = len(counts)
        least = base.sum(axis=1)  # (R,)
        n = np.maximum(counts[None, :], least[:, None])  # (R, N): a rank holds its chunks' least at the least
        extra = n - least[:, None]  # (R, N): layers beyond those, to the chunks in order, each up to its spare
        before = np.cumsum(spare, axis=1) - spare  # (R, V)
        taken = np.minimum(np.maximum(extra[:, :, None] - before[:, None, :], 0), spare[:, None, :])  # (R, N, V)
        k = base[:, None, :] + taken  # (R, N, V): layers per chunk (np.clip's checks cost more than the rest)
        rows = np.arange(R)[:, None]
        with np.errstate(divide="ignore"):
            order = np.argsort(1.0 / held, axis=1, kind="stable")  # as a one-step rate, slope / held, orders them
        return cls(n=n, k=k, held_layers=(k * held[:, None, :]).sum(axis=2),
                   beyond=extra > spare.sum(axis=1)[:, None], order=order, held_sorted=held[rows, order],
                   layers=k[rows[:, :, None], np.arange(N)[None, :, None], order[:, None, :]],
                   held_all=bool(held.all()))


_CHUNK_FILLS: dict[tuple, _ChunkFill] = {}


def _chunk_fill(key: tuple, counts: np.ndarray, held: np.ndarray, base: np.ndarray, spare: np.ndarray) -> _ChunkFill:
    """_ChunkFill.of, once per ``key`` (whole_stage_bound's pipeline: schedule, p, v, m, L). Shared: read-only."""
    got = _CHUNK_FILLS.get(key)
    if got is None:
        if len(_CHUNK_FILLS) >= 4096:
            _CHUNK_FILLS.clear()
        got = _CHUNK_FILLS[key] = _ChunkFill.of(counts, held, base, spare)
    return got


def _hold_times(counts: np.ndarray, T: np.ndarray, D: np.ndarray, room: np.ndarray) -> np.ndarray:
    """(N,) -> (R, N): each rank's least time per micro-batch to hold ``counts[n]`` layers of one stage in one mode
    within its memory ``room`` (R,) (whole_stage_bound, v = 1: a layer costs T_u seconds and D[r, u] bytes); inf
    where it cannot. Never falling as the count grows (what whole_stage_bound's L-th smallest needs)."""
    n = counts[None, :, None]  # (1, N, 1)
    room = np.asarray(room, dtype=float).reshape(-1, 1, 1)  # (R, 1, 1)
    return np.where(n * D[:, None, :] <= room * (1 + 1e-12), n * T, np.inf).min(axis=2)  # (R, N)


def _layout_key(x: Layout) -> tuple:
    """What tells enumerated layouts apart (recomputation is the ILP's choice, not the layout's). _twins
    edits its fields by position: schedule 4, zero 6, sequence parallelism 7."""
    return (x.dp, x.tp, x.pp, x.micro_batch, x.schedule, x.virtual_stages, x.zero, x.sequence_parallel,
            x.head_parallel, x.cp, x.ep, x.etp)


def _pruning_rules(model: CostModel) -> tuple[bool, bool]:
    """Do sequence parallelism on, and ZeRO-2 over ZeRO-1, dominate under this cost model (see :func:`_twins`)?"""
    free = model.work.framework.states == "zero"
    return free and not model.host_cost("tp_module"), free and not model.host_cost("fsdp_unit")


def _twins(lay: Layout, rules: tuple[bool, bool], key: tuple | None = None) -> list[tuple[tuple, str]]:
    """The layouts that would dominate ``lay`` where valid — another layout matching it in time with less memory,
    under this cost model, only where the two cost exactly the same time (sound pruning) — as (key, what differs),
    in the order :func:`_dominated_by` tries them (``key``: ``lay``'s own, where the caller has it):
    - sequence parallelism on, and ZeRO-2 over ZeRO-1, only under ZeRO's accounting (Megatron-style stacks)
      without measured per-call host costs (``rules``, :func:`_pruning_rules`): there the collective volumes are
      equal (all-reduce = reduce-scatter + all-gather) and only memory differs. This executor's SP adds a
      per-step sync of the weights TP keeps whole and its ZeRO-2 reduce-scatters every micro-batch, and a
      calibrated machine charges each SP module call and FSDP unit: then both variants are priced, never pruned;
    - 1F1B over GPipe: the same bubble, fewer micro-batches in flight, the same everything else.
    Each twin differs from ``lay`` in one field, and only adds to what the layout must satisfy (the sequence split
    over tp, 1F1B's pp micro-batches at least): a layout one of whose twins is valid is valid itself
    (tests/test_planner.py checks it over the enumerated layouts)."""
    sp, zero, gpipe = _twin_kinds(lay, rules)
    if not (sp or zero or gpipe):
        return []
    key = key or _layout_key(lay)  # a twin's key differs in one field (no Layout built: a million of these)
    twins = []
    if sp:
        twins.append((key[:7] + (True,) + key[8:], "sequence parallelism on"))
    if zero:
        twins.append((key[:6] + (2,) + key[7:], "ZeRO-2"))
    if gpipe:
        twins.append((key[:4] + ("1f1b",) + key[5:], "1f1b"))
    return twins


def _twin_kinds(lay: Layout, rules: tuple[bool, bool]) -> tuple[bool, bool, bool]:
    """Which twins ``lay`` has (:func:`_twins`): with sequence parallelism on, with ZeRO-2, with 1F1B."""
    sp_rule, zero_rule = rules
    return sp_rule and lay.tp > 1 and not lay.sequence_parallel, zero_rule and lay.zero == 1, lay.schedule == "gpipe"


def _dominated_by(lay: Layout, valid: set[tuple], model: CostModel) -> str | None:
    """What differs in the first of ``lay``'s twins (:func:`_twins`) whose key is in ``valid``; None: no valid
    layout dominates it."""
    return next((why for key, why in _twins(lay, _pruning_rules(model)) if key in valid), None)


def _validated(model: CostModel, layouts: list[Layout]) -> list[Candidate]:
    """A candidate per layout, in their order: "invalid" (why), "dominated" (by what), or "pruned" until the search
    says more. A layout with a valid twin is marked dominated without validating it (valid itself, :func:`_twins`):
    the twins are settled first (each has fewer twins of its own), the other layouts before them. DeepSeek-V3 on
    1024 GPUs enumerates ~950,000 layouts, 510,000 of them dominated."""
    from .costmodel import validate_layout

    out: list[Candidate | None] = [None] * len(layouts)
    valid: set[tuple] = set()
    later: list[tuple[int, int]] = []

    def validated(lay: Layout) -> Candidate:
        try:
            validate_layout(model, lay)
        except InvalidLayout as e:
            return Candidate(lay, "invalid", e.reason if e.reason != str(e) else str(e))
        valid.add(_layout_key(lay))
        return Candidate(lay, "pruned")

    rules = _pruning_rules(model)
    for i, lay in enumerate(layouts):
        twins = sum(_twin_kinds(lay, rules))
        if twins:
            later.append((twins, i))
        else:
            out[i] = validated(lay)
    later.sort()
    for _, i in later:
        lay = layouts[i]
        key = _layout_key(lay)
        better = next((why for twin, why in _twins(lay, rules, key) if twin in valid), None)
        if better:
            valid.add(key)
            out[i] = Candidate(lay, "dominated", better)
        else:
            out[i] = validated(lay)
    return out


def quick_price(model: CostModel, lay: Layout, modes: tuple[str, ...],
                skip: frozenset[str] = frozenset(), beat: float | None = None) -> Prediction | QuickFloor | None:
    """Exact price of a simple split with the least recomputation per stage that fits (CostModel.least_recompute:
    a rank's memory depends only on its own stages, so the ranks holding fewer micro-batches — 1F1B's later ones,
    an interleaved rank's later chunks — need not recompute what the first must). The split: the layers dealt
    evenly where the ILP requires it (chunks of an interleaved or V schedule within a layer of each other:
    costmodel.even_stages), else balanced by time in the fastest mode (for chunks of unlike layers also with the
    blocks dealt evenly, costmodel.count_balanced_stages, which the ILP accepts as its start: the faster of the two).
    ``modes``: fastest first; those in ``skip`` are already known not to fit anywhere. None: some rank fits in no
    mode on this split. ``beat``: a time the caller needs the price only below (the search's heuristic mode drops a
    layout whose quick price is more than 5% behind the k-th best): where no split tried can beat it by its
    closed-form floor, a :class:`QuickFloor`, its splits never priced whole (the demo: 160 of 181 quick prices end
    more than 5% behind); below it, the same Prediction as without."""
    from .costmodel import (
        count_balanced_stages,
        default_stages,
        even_stages,
        levelled_stages,
        lighter_end_stages,
        memory_repaired_stages,
    )

    tried = tuple(u for u in modes if u not in skip)
    if not tried:
        return None
    priced: dict[tuple | None, Prediction | None] = {}  # a split asked for twice (below) is priced once

    def price(stages: list[list[int]] | None) -> Prediction | QuickFloor | None:
        key = None if stages is None else tuple(map(tuple, stages))
        if key not in priced:
            priced[key] = least_recompute_prediction(model, lay, stages, tried, beat=beat)
        return priced[key]

    if lay.virtual_stages > 1:
        even = even_stages(model, lay)
        got = price(even)
        k = lay.num_stages
        # The first chunk holds the most micro-batches of its rank: where it recomputes much (a quarter of its forward
        # or more: whole layers, the MLP), a layer off it (or off the last, the head's) may spare that
        # (costmodel.lighter_end_stages; the demo's dp4 tp4 pp4 interleaved x2 z2 sp with 5% of each GPU kept free:
        # 38.36 s with its first chunk recomputed whole, 33.69 s with a layer off it and the attention core alone
        # recomputed there).
        ends = {s for s in (0, k - 1) if got is not None and got.stages[s].recompute_time >= got.stages[s].t_f / 4}
        # (each end, or both, once: its layer to the next chunk in turn, lighter_end_stages' first of each)
        lightened: set[frozenset[int]] = set()
        for stages in lighter_end_stages(model, lay) if ends else []:
            lighter = frozenset(s for s in (0, k - 1) if len(stages[s]) < len(even[s]))
            if lighter <= ends and lighter not in lightened:
                lightened.add(lighter)
                got = _less_recomputed(model, lay, stages, tried, got, beat)
        if got is not None:
            return got
    split = default_stages(model, lay.replace(recompute=tried[0]))
    balanced = price(split)  # (an interleaved layout whose even split fits nowhere: that split again, often)
    # chunks of unlike layers: also the blocks dealt evenly (what the ILP can start from), the faster of the two
    counted = price(count_balanced_stages(model, lay))
    if balanced is None and counted is None:  # fits in no mode: blocks moved off the ranks that overflow, if any
        balanced = price(memory_repaired_stages(model, lay, split, tried[-1]))
    least = min((p for p in (balanced, counted) if p is not None), key=lambda p: p.iteration_time_s, default=None)
    if least is not None and least.time_s["recompute"] > 0:
        # the balanced split recomputes where a rank overflows (1F1B's first ranks hold the most micro-batches):
        # the blocks moved off those ranks until each fits in a lighter mode may be faster (what the ILP finds)
        for u in tried[:tried.index(least.layout.recompute)]:
            levelled = levelled_stages(model, lay, u) if model.repeated_blocks(lay) \
                else memory_repaired_stages(model, lay, split, u)
            least = _less_recomputed(model, lay, levelled, tried, least, beat)
    return least


def _less_recomputed(model: CostModel, lay: Layout, stages: list[list[int]] | None, tried: tuple[str, ...],
                     than: Prediction | QuickFloor, beat: float | None = None) -> Prediction | QuickFloor:
    """``stages`` priced with the least recomputation that fits (least_recompute_prediction) where that
    recomputes less than ``than`` does and comes out faster; else ``than``. (The recomputation is what these
    other splits are for: where they do not save any, they are not priced.) ``beat``: as quick_price's (where
    ``stages``' floor reaches it, that floor stands in for its price)."""
    got = model.least_recompute(lay, stages, tried) if stages is not None else None
    if got is None or sum(c.recompute_time for c in got[1]) >= sum(c.recompute_time for c in than.stages):
        return than
    limit = than.iteration_time_s if beat is None else min(than.iteration_time_s, beat)
    other = least_recompute_prediction(model, lay, stages, tried, got=got, beat=limit)
    return other if other is not None and other.iteration_time_s < than.iteration_time_s else than


@without_gc_pauses
def search(work: Workload, gpus: int, top_k: int = 5, dtype: str | None = None,
           progress: Callable[[int, int], None] | None = None, layouts: list[Layout] | None = None,
           allowed_modes: tuple[str, ...] | None = None, refine_slack: float | None = 0.05,
           model: CostModel | None = None, beat_s: float | None = None) -> SearchResult:
    """Find the ``top_k`` fastest layouts of ``work`` on ``gpus`` GPUs that fit, with every candidate's status.

    Pruning: a layout is dropped without an ILP when its lower bound cannot beat the k-th best time
    found (proven), or — unless ``refine_slack`` is None (exhaustive) — when even its balanced split,
    priced exactly, is more than ``refine_slack`` slower than that k-th best, or when the ILP, given that
    time (plus ``CUTOFF_MARGIN``) as a cutoff, proves no split beats it. In that heuristic mode, interleaved and V
    layouts of transformer layers take their quick split polished, without an ILP (ilp.polished_quick_split).
    ``model``: a cost model of ``work`` from an earlier search (e.g. ``result.model``), whose cached block costs
    are reused. ``beat_s``: a time the plans must beat, as if ``top_k`` plans of that price were found already
    (refine.py searches again so the layouts an earlier search pruned: only those that may beat its shown plans).
    """
    t0 = time.perf_counter()
    dtype = dtype or work.default_dtype()
    if gpus <= 0:
        raise PlanError(f"--gpus must be positive, got {gpus}")
    if gpus > work.cluster.num_gpus:
        raise PlanError(f"--gpus {gpus} is more than {work.cluster.name}'s {work.cluster.num_gpus} GPUs "
                        f"({work.cluster.nodes} nodes x {work.cluster.gpus_per_node}); use --nodes")
    try:
        work.cluster.gpu.peak_flops(dtype)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if model is None or model.work is not work:
        model = CostModel(work)
    if allowed_modes and "norm+act" in allowed_modes:  # asked for by name: say why it cannot be, not drop it
        from .costmodel import norm_act_refusal

        why = norm_act_refusal(work, dtype)
        if why:
            raise PlanError(why)
    modes = modes_for(model, allowed_modes, dtype)
    layouts = layouts if layouts is not None else enumerate_layouts(work, gpus, dtype)
    candidates = _validated(model, layouts)
    for cand in candidates:  # zb-v refuses some recomputation modes (layout_modes): all those allowed, here
        if cand.status != "invalid" and cand.layout.schedule == "zb-v" and not layout_modes(model, cand.layout, modes):
            cand.status, cand.reason = "invalid", no_mode_reason(model, cand.layout, allowed_modes)
    valid = [c for c in candidates if c.status != "invalid"]
    capacity = work.memory_limit_bytes  # what a plan may fill (Workload.memory_margin)
    # Every layout gets a cheap bound (its pipeline's time alone, time_bound) and waits in a heap; the full first-pass
    # bound (time and memory, lower_bound) only when it reaches the heap's top, the second (the recomputation memory
    # forces, the slowest rank, the data-parallel wait) when it reaches the top again, the quick price when it does
    # a third time. Each bound is never below the one before, so layouts come out in the order of their tightest
    # bounds as if every one had been computed; those still waiting when the k-th price is reached keep the bound
    # they have (with the cheap one, their memory never checked).
    waiting: list[tuple[float, int, int, Candidate]] = []  # (bound, index, bounds computed: 0 cheap, 1, 2, cand)
    for idx, cand in enumerate(valid):
        if cand.status == "dominated":
            continue
        cand.lower_bound_s, cand.memory_checked = time_bound(model, cand.layout), False
        waiting.append((cand.lower_bound_s, idx, 0, cand))
    heapq.heapify(waiting)
    # Quick exact prices (balanced split) in lower-bound order, until the bound passes the k-th price.
    alive: list[Candidate] = []
    quick: list[tuple[float, int]] = []
    kth: list[float] = []  # the k best prices so far (a max-heap of -t): quick prices, or polished ones
    best_times: list[float] = []  # the k best refined prices (polished or by ILP; a max-heap of -t)
    if beat_s is not None:
        kth, best_times = [-beat_s] * top_k, [-beat_s] * top_k
    early = refine_slack is not None  # heuristic mode: a polish-only layout entering the k best is polished at once
    while waiting:
        _, idx, stage, cand = waiting[0]
        if len(kth) >= top_k and cand.lower_bound_s >= -kth[0]:
            break
        heapq.heappop(waiting)
        mine = layout_modes(model, cand.layout, modes)
        if stage == 0:
            bound, mem_by_mode = lower_bound(model, cand.layout, mine, forced_recomputation=False,
                                             data_parallel_wait=False, capacity=capacity)
            cand.lower_bound_s, cand.memory_checked = max(bound, cand.lower_bound_s), True
            cand.no_fit = frozenset(u for u in mine if mem_by_mode[u] > capacity)
            lb_mem = min(mem_by_mode.values())
            if lb_mem > capacity:
                cand.status = "oom"
                alone = model.bound_parts[(cand.layout, mine)].states_alone
                cand.reason = (f"out of memory by at least {(lb_mem - capacity) / 2**30:.1f} GiB "
                               f"(needs {lb_mem / 2**30:.1f} GiB per GPU "
                               + ("for its model states alone)" if alone else "with the least-memory split)"))
            else:
                heapq.heappush(waiting, (cand.lower_bound_s, idx, 1, cand))
            continue
        if stage == 1 and len(kth) >= top_k:  # the tighter bound, for layouts the first one let through
            cand.lower_bound_s = max(cand.lower_bound_s, lower_bound(model, cand.layout, mine, beat=-kth[0])[0])
            heapq.heappush(waiting, (cand.lower_bound_s, idx, 2, cand))
            continue
        # heuristic mode: a quick price over the k-th best's drop line needs no more than its floor (QuickFloor)
        drop_line = -kth[0] * (1 + refine_slack) if early and len(kth) >= top_k else None
        pred = quick_price(model, cand.layout, mine, cand.no_fit, drop_line)
        if isinstance(pred, QuickFloor):  # dropped as a quick price over the line would be (below), unpriced
            cand.status, cand.quick_floor_s = "priced", pred.iteration_time_s
            continue
        alive.append(cand)
        if pred is None:
            quick.append((float("inf"), len(alive) - 1))
            continue
        cand.prediction = pred
        quick.append((pred.iteration_time_s, len(alive) - 1))
        price = pred.iteration_time_s
        if early and (len(kth) < top_k or price < -kth[0]) and _quick_split_suffices(model, cand.layout):
            # it would be polished later anyway if it stays among the k best; polished now, its (lower) price
            # prunes the layouts after it: the quick prices of interleaved splits run a few % above the polished
            _accept(cand, polished_quick_split(model, cand.layout, pred, allowed_modes), best_times, top_k)
            price = cand.prediction.iteration_time_s
        heapq.heappush(kth, -price)
        if len(kth) > top_k:
            heapq.heappop(kth)
    quick.sort()
    solves = 0
    pending = [alive[idx] for _, idx in quick]
    qtime = {id(alive[idx]): q for q, idx in quick}
    workers = max(2, min(8, 2 * (os.cpu_count() or 1)))  # the solvers run outside the GIL: overlap with Python
    time_limit = SOLVER_TIME_LIMIT_S if refine_slack is not None else EXHAUSTIVE_TIME_LIMIT_S  # per ILP
    done = unsolved = unfit = 0
    started: list[tuple[Candidate, Any]] = []  # ILPs under way, oldest first
    ahead: dict[int, Any] = {}  # polished while waiting for an ILP, before their turn (_polish_ahead)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while pending or started:
            # The next layouts worth an ILP under the current k-th best time, up to ``workers`` solving at once (outside
            # the GIL); the polish-only layouts are polished here while they solve.
            threshold = -best_times[0] if len(best_times) >= top_k else float("inf")
            while pending and len(started) < workers:
                cand = pending.pop(0)
                done += 1
                if cand.status == "ok":  # polished already, in the quick prices' loop
                    unsolved += 1
                    continue
                if cand.lower_bound_s >= threshold:
                    continue
                if refine_slack is not None and qtime[id(cand)] > threshold * (1 + refine_slack):
                    cand.status = "priced"
                    # no quick split of it fits (quick_price repairs one-stage-per-rank splits; not interleaved ones)
                    unfit += qtime[id(cand)] == float("inf")
                    continue
                if refine_slack is not None and cand.prediction is not None \
                        and _quick_split_suffices(model, cand.layout):
                    part = ahead.pop(id(cand), None) or polished_quick_split(model, cand.layout, cand.prediction,
                                                                              allowed_modes)
                    _accept(cand, part, best_times, top_k)
                    unsolved += 1
                    threshold = -best_times[0] if len(best_times) >= top_k else float("inf")
                    continue
                # Heuristic mode: the solver is told the time to beat (with a margin for what the exact model and the
                # polish may gain over the ILP's linear pieces), so it proves a layout hopeless early.
                cutoff = threshold * (1 + CUTOFF_MARGIN) if refine_slack is not None and threshold < float("inf") \
                    else None
                hopeless = threshold * (1 + refine_slack) if refine_slack is not None else None
                started.append((cand, pool.submit(best_partition, model, cand.layout, allowed_modes,
                                                  start=cand.prediction, cutoff_s=cutoff, refine_below_s=hopeless,
                                                  time_limit_s=time_limit)))
            if progress is not None:
                progress(done, len(quick))
            if not started:
                continue
            cand, fut = started.pop(0)
            if refine_slack is not None:
                _polish_ahead(model, fut, pending, ahead, threshold, refine_slack, qtime, allowed_modes)
            solves += 1
            try:
                part = fut.result()
            except InvalidLayout as e:
                cand.status, cand.reason, cand.prediction = "oom", str(e), None
                continue
            if part is None:
                cand.status, cand.reason = "priced", "bound"
                continue
            _accept(cand, part, best_times, top_k)
    final = -best_times[0] if len(best_times) >= top_k else None
    for cand in valid:
        if cand.status == "pruned":
            cand.reason = f"{top_k} ({final:.4g} s)" if final else ""
    order = ranked(c for c in candidates if c.status == "ok")
    failed = [c for c in candidates if c.solver.startswith("solver failed")]
    notes = [f"{len(failed)} layout{'s' if len(failed) > 1 else ''} priced without an ILP solver (it failed to "
             f"run: {failed[0].solver.split('(', 1)[1].rsplit(')', 1)[0]}); each keeps its balanced split, "
             "polished by local search"] if failed else []
    limited = sum(c.solver.startswith("time limit") for c in candidates)
    if limited:
        notes.append(f"{limited} of {solves} ILPs stopped at their time limit ({time_limit:g} s each): those "
                     "layouts' splits are the best found, not proven the best")
    by_sums = sum(c.solver == OPTIMAL_BY_RANK_SUMS for c in candidates)
    if by_sums:
        notes.append(f"{by_sums} interleaved layout{'s' if by_sums > 1 else ''}' splits are the ILP's best by the "
                     "ranks' sums: the wait of unequal chunks in the schedule's rounds, priced after, is not in the "
                     "ILP (the best found by the price, not proven)")
    if unfit:
        notes.append(f"{unfit} layout{'s' if unfit > 1 else ''} whose quick splits fit in no allowed "
                     "recomputation mode got no ILP (another split might fit: plan --exhaustive gives each one)")
    if unsolved:
        notes.append(f"{unsolved} layout{'s' if unsolved > 1 else ''} with interleaved or V chunks of transformer "
                     "layers kept the quick split, polished, without an ILP (the best found, not proven; plan "
                     "--exhaustive runs one for each)")
    return SearchResult(work=work, gpus=gpus, ranked=order[:top_k], candidates=candidates,
                        search_time_s=time.perf_counter() - t0, ilp_solves=solves, dtype=dtype, model=model,
                        notes=notes, top_k=top_k,
                        options={"allowed_modes": allowed_modes, "refine_slack": refine_slack})


def _polish_ahead(model: CostModel, fut, pending: list[Candidate], ahead: dict[int, Any], threshold: float,
                  refine_slack: float, qtime: dict[int, float], allowed_modes: tuple[str, ...] | None) -> None:
    """While the ILP ``fut`` solves (outside the GIL), polish the next polish-only layouts of ``pending`` that
    may still be polished at their turn, into ``ahead`` (by id): their turn takes the polish from there. Only their
    turn decides, with the k-th best time then, whether they are polished, priced or pruned, so the search's
    outcome is the same as without; what this saves is the wait (the demo's first ILPs: ~0.05 s)."""
    for cand in pending:
        if fut.done():
            return
        if id(cand) in ahead or cand.status == "ok" or cand.prediction is None \
                or not _quick_split_suffices(model, cand.layout):
            continue
        # the k-th best only falls: a layout that fails these now would fail them at its turn
        if cand.lower_bound_s >= threshold or qtime[id(cand)] > threshold * (1 + refine_slack):
            continue
        ahead[id(cand)] = polished_quick_split(model, cand.layout, cand.prediction, allowed_modes)


def _quick_split_suffices(model: CostModel, lay: Layout) -> bool:
    """Heuristic mode: does an interleaved or V layout (never one of one stage per rank) keep its quick split, polished,
    without an ILP? Where its blocks are an embedding, transformer layers and a head: the chunk rule (every chunk within
    a layer of the others) leaves it little to choose, identical layers or not (dense and MoE ones: DeepSeek-V3's first
    three, Llama 4's alternate). Measured (search and re-pricing, one run each, megatron-core): DeepSeek-V3 on 256 H100s
    went from 50 ILPs (their problems built in Python: ~1 s each) and 19.5 s to 4 ILPs and 5.3 s, the same two best
    plans, the third faster; on 1024 H100s 6.9 -> 5.9 s, Llama 4 Maverick on 512 10.1 -> 7.5 s, the same top three, as
    for Qwen3-235B and Mixtral 8x22B. Other models' blocks (convolutions) differ too much for an even split: they keep
    their ILP."""
    if lay.virtual_stages == 1:
        return False
    layers = model.work.profile(lay.dtype).layers
    return model.repeated_blocks(lay) or (model.work.spec.is_transformer and layers[0].kind == "embedding" and all(
        x.kind == "transformer_layer" for x in layers[1:-1]))


def _accept(cand: Candidate, part, best_times: list[float], top_k: int) -> None:
    """``cand`` priced at ``part``'s split (an ilp.Partition), its time pushed on the k best (a max-heap of -t)."""
    cand.status, cand.prediction = "ok", part.prediction
    cand.stages, cand.stage_recompute = part.stages, part.recompute
    cand.solver = part.ilp_status
    cand.layout = cand.layout.replace(recompute=summary_mode(part.recompute))
    heapq.heappush(best_times, -part.prediction.iteration_time_s)
    if len(best_times) > top_k:
        heapq.heappop(best_times)


def summary_mode(modes: list[str]) -> str:
    """The layout's recompute label: the heaviest mode any stage uses (the plan lists each stage's)."""
    return next((u for u in ("full", "selective+mlp", "mlp", "selective", "norm+act") if u in modes), "none")


__all__ = ["Candidate", "SearchResult", "enumerate_layouts", "lower_bound", "modes_for", "search"]

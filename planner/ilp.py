"""Stage boundaries and per-stage recomputation for one layout, by integer linear programming (PuLP: HiGHS, or CBC).

Formulation (data first, then variables, objective, constraints; all constraints named with their
index). For a layout with S = pp x v stages on pp ranks and m micro-batches per replica:

Data, per block i and recomputation mode u (none / selective / full): forward F[i,u], input-gradient
backward B[i,u] (recomputation and TP collectives included), weight gradient W[i], forward compute only
Fc[i], backward compute only Bc[i], activations kept per micro-batch A[i,u], live working set
K[i,u] (full recomputation), parameters on one rank P[i]; per stage boundary the point-to-point time c[s];
per rank r its stages St(r) and the micro-batches each of them holds at the rank's peak, inflight[r,s].

Variables:
- assignment: for a transformer (embed, L identical layers, head) integer counts n[s,u] of layers of
  stage s run in mode u (the repeated blocks make this a handful of integers whatever L is); otherwise
  binaries x[i,s,u] (with chunks, v > 1, only for the stages a balanced split lets block i reach), with
  the stage index of block i, sum_s s·x[i,s,u], rising by 0 or 1 from block to
  block (contiguous, non-empty stages) — plus q[i,s] >= x[i,s] + e[i] - 1 marking block i as the last of
  stage s (e[i] = 1 where the next block starts a new stage), which charges c for the boundary.
- y[s,u] in {0,1}: the recomputation mode of stage s (n[s,u] <= L·y[s,u]); the chunks of one rank may differ.
- T[r] the rank's time per micro-batch, Tmax >= T[r]; exposed[r] the data-parallel sync rank r waits
  for; z >= finish[r] + exposed[r]; o >= optimizer step of rank r.

Objective: minimise z + o, the cost model's closed form (see CostModel.evaluate):
- gpipe / 1f1b: makespan = (m - 1)·Tmax + sum_r T[r]; interleaved-1f1b (m >= pp): m·Tmax + (pp-1)/v·mean T;
  zb-v and interleaved with m < pp: (m + beta)·Tmax, beta the schedule's bubble in stage times measured
  at the balanced split (iterated to a fixed point);
- finish[r] = makespan - drain[r], drain[r] = sum over ranks j < r of their backward (1/v of it);
- exposed[r] >= each linear piece of the sync time: all-reduce (or ZeRO's reduce-scatter + all-gather)
  minus the last micro-batch's backward it overlaps, ZeRO-3's per-micro-batch gathers beyond compute,
  the parameter servers' busier side. Collective times are linear in bytes for a fixed group (α-β).

Constraints: memory of every rank <= GPU memory: model states (ZeRO's bytes per parameter) +
sum_s inflight[r,s]·A[s] + working set + the framework allowance and fragmentation.

The solution is then priced exactly by the cost model, and a local search (moving each boundary by one
block, changing one stage's mode) removes what the linear pieces approximate.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import dataclass

import pulp

from . import moe
from .concerns import Exposure, RankLoad
from .costmodel import (
    CostModel,
    Prediction,
    count_balanced_stages,
    even_stages,
    inner_chunk_order,
    least_recompute_prediction,
    lighter_end_stages,
    norm_act_refusal,
    pipeline_makespan,
    prices_chunk_gathers,
    stages_from_counts,
)
from .dp_sync import optimizer_step
from .errors import InvalidLayout
from .layout import RECOMPUTE, Layout
from .memory import state_bytes, untracked_bytes
from .placement import layout_placement
from .schedules import (
    buffer_key,
    closed_form_makespan,
    gathered_key,
    in_flight,
    late_key,
    linear_makespan,
    peak_holdings,
    pending_key,
    rank_stages,
    rounds_priced,
    stage_rank,
    unfolded_key,
)

# The recomputation modes the search tries by default: MLP recomputation (Megatron-Core's recompute_modules
# mlp/moe) for mixtures of experts, whose MoE blocks hold most of a layer's activations; for dense models it
# added 16% and 39% to the search's function calls (llama2-70b on 64 H100s, the 1T GPT) without changing their
# plans, so it is tried on request (plan --recompute-modes). Every mode: planner/layout.py's RECOMPUTE.
MODES_TRANSFORMER = ("none", "selective", "full")
MODES_MOE = ("none", "selective", "mlp", "selective+mlp", "full")
MODES_OTHER = ("none",)  # recomputation is modelled and executed for transformer layers only
# The solver's time per layout (HiGHS: wall-clock; CBC: CPU). Beyond it the solver returns its best split so far
# (CBC is warm-started from the quick price's split; best_partition keeps that split where it is faster than the
# answer, whichever solver gave it); the exact pricing and local search then take over,
# and the plan records that optimality was not proven. 0.2 s (was 0.3): the demo's and the 1T GPT's searches
# 0.5 s and 0.4 s faster, the same best plans (the demo's third 0.6% slower). `plan --exhaustive` gives each
# ILP longer, to prove more of them.
SOLVER_TIME_LIMIT_S = 0.2
EXHAUSTIVE_TIME_LIMIT_S = 2.0
# Solvers tried in this order for each ILP; the next takes over when one fails to run (benchmarks/bench_plan.py
# --solvers compares them on the benchmark workloads). SOLVER_ORDER for models of identical layers (a handful of
# integer counts per stage); BLOCK_SOLVER_ORDER for the others (a binary per block, stage and mode: thousands), where
# CBC's root LP ignores its time limit: one of DeepSeek-V3's on 1024 H100s (pp4 v8, ~10,000 binaries) ran 35 s
# before its first branch under a 0.2 s limit, HiGHS 0.75 s; that plan's search 76-88 s with CBC first, 21-30 s with
# HiGHS, the same top-5. HiGHS goes first for the counts too: it solves in this process (no solver process to start;
# it lets go of the GIL while it solves), the demo's 1F1B split in 17-19 ms against CBC's 59 ms; the demo's search
# 0.61 s against 0.64 s with CBC first, the 1T GPT's the same, and every candidate of 13 default searches identical
# (status, bound, split, prices). Under --exhaustive the two differ on some time-limited interleaved ILPs (better on
# about as many as worse; the same top 5 on llama2-13b/16 and llama2-70b/64). `plan --solver` puts its choice first
# in both.
SOLVER_ORDER = ("highs", "cbc")
HIGHS_SMALL_MATRIX_VALUE = 1e-12  # HiGHS's least (see _run_solver)
BLOCK_SOLVER_ORDER = ("highs", "cbc")


class SolverFailed(Exception):
    """No solver could solve an ILP (each one's reason, joined)."""


def _run_solver(prob: pulp.LpProblem, name: str, warm: bool, cutoff: float | None, cbc_options: list[str],
                time_limit_s: float = SOLVER_TIME_LIMIT_S) -> None:
    """Solve ``prob`` with CBC (PuLP's bundled binary, in a process of its own; warm-started, ``cutoff`` on the
    scaled objective) or HiGHS (highspy, in this process; ``cutoff`` as its objective bound)."""
    if name == "cbc":
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm, gapRel=1e-9,
                                     gapAbs=0.0, options=cbc_options))
        return
    if name == "highs":
        if not pulp.HiGHS().available():
            raise pulp.PulpSolverError("highspy is not installed")
        _swallow_highs_banner()
        params = {"objective_bound": cutoff} if cutoff is not None else {}
        # HiGHS drops matrix entries below small_matrix_value (1e-9 by default): the memory rows' coefficients on
        # byte- and parameter-counting variables (a unit's parameters, the working set: ~1e-9 GiB a byte) went,
        # and a split over the GPU's memory came back optimal (gpt-small on 8 tight GPUs: 2.1 of 2 GiB)
        prob.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=1e-9, gapAbs=0.0, threads=1,
                              small_matrix_value=HIGHS_SMALL_MATRIX_VALUE, **params))
        return
    raise AssertionError(f"unknown solver {name}")


_BANNER_LOCK = threading.Lock()
_banner_swallowed = False


def _swallow_highs_banner() -> None:
    """highspy prints a banner on the process's stdout (from C) when the process makes its first solver, even
    with output off: make that first one with stdout on /dev/null, so `--json` prints one JSON object only."""
    global _banner_swallowed
    with _BANNER_LOCK:
        if _banner_swallowed:
            return
        import highspy

        sys.stdout.flush()
        saved = os.dup(1)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
            highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _banner_swallowed = True


@dataclass
class Partition:
    stages: list[list[int]]
    recompute: list[str]
    prediction: Prediction
    ilp_status: str
    ilp_objective: float | None


def modes_for(model: CostModel, allowed: tuple[str, ...] | None = None, dtype: str = "bf16",
              lay: Layout | None = None) -> tuple[str, ...]:
    """The recomputation modes a layout's stages may use: ``allowed`` (any of RECOMPUTE) where given, else the
    defaults above; only "none" for models without transformer layers. "norm+act" (searched on request only)
    where the stack runs it in ``dtype`` (costmodel.norm_act_refusal). With ``lay``, those its schedule runs
    (layout_modes)."""
    spec = model.work.spec
    if not spec.is_transformer:
        modes = MODES_OTHER
    elif allowed is not None:
        modes = RECOMPUTE
    else:
        modes = MODES_MOE if getattr(spec, "num_experts", 0) else MODES_TRANSFORMER
    modes = tuple(u for u in modes if (allowed is None or u in allowed)
                  and (u != "norm+act" or norm_act_refusal(model.work, dtype) is None))
    return modes if lay is None else layout_modes(model, lay, modes)


def layout_modes(model: CostModel, lay: Layout, modes: tuple[str, ...]) -> tuple[str, ...]:
    """Of ``modes``, those ``lay``'s stages may use: all but where zb-v cannot recompute
    (layout.zero_bubble_recompute_refusal: torch's weight pass recomputes a region holding weights once per
    parameter group). Possibly none (every allowed mode refused)."""
    if lay.schedule != "zb-v":  # the search asks for every layout it pops: the others at once
        return modes
    return tuple(u for u in modes if lay.recompute_refusal(model.work.spec, u) is None)


def no_mode_reason(model: CostModel, lay: Layout, allowed: tuple[str, ...] | None) -> str:
    """Why ``lay`` has no recomputation mode among ``allowed`` (layout_modes refused each): the first refusal."""
    spec = model.work.spec
    why = next((r for u in modes_for(model, allowed, lay.dtype) if (r := lay.recompute_refusal(spec, u))), None)
    return why or f"no recomputation mode of {', '.join(allowed or ())} can run {lay.short()}"


def _exposure_expression(prob: pulp.LpProblem, items: list[Exposure], load: RankLoad, guess: RankLoad, p: int,
                         name: str):
    """The waited-for seconds of ``items`` (concerns.Exposure) as LP rows over ``load``: each collective's
    time by its secant at the balanced split's message size (exact for α-β links), each max by an
    auxiliary variable, a bucketed floor min(message, bucket) by a binary that picks its regime."""
    total = 0
    for j, e in enumerate(items):
        piece = sum(s.secant(s.nbytes(guess)).at(load) for s in e.syncs) - e.hidden.at(load)
        if e.floor == "none":
            total += e.count * piece
            continue
        aux = pulp.LpVariable(f"exposed_{name}_{j}", lowBound=0 if e.floor == "zero" else None)
        prob += aux >= piece, f"exposed_{name}_{j}_piece"
        if e.floor == "bucket":
            nbytes = e.sync.bytes_affine().at(load)
            most = max(e.sync.nbytes(guess) * p, e.bucket_bytes) * 2  # above any rank's message
            x0 = max(min(e.sync.nbytes(guess), e.bucket_bytes), 1.0)  # the last bucket's time, by its secant
            y0, y1 = e.last_bucket_time(x0), e.last_bucket_time(2 * x0)
            slope = (y1 - y0) / x0
            big = pulp.LpVariable(f"exceeds_bucket_{name}_{j}", cat="Binary")
            mb = 1 / 2**20  # rows in MiB, for CBC's numerics
            prob += nbytes * mb <= (e.bucket_bytes + most * big) * mb, f"bucket_regime_up_{name}_{j}"
            prob += nbytes * mb >= e.bucket_bytes * mb * big, f"bucket_regime_down_{name}_{j}"
            whole = y0 - slope * x0 + slope * nbytes  # a message under one bucket: all of it is last
            prob += aux >= whole - (y0 + slope * most) * big, f"small_message_{name}_{j}"
            prob += aux >= e.last_bucket_time(e.bucket_bytes) * big, f"last_bucket_{name}_{j}"
        total += e.count * aux
    return total


class StageILP:
    """Builds and solves the ILP for one layout."""

    def __init__(self, model: CostModel, lay: Layout, modes: tuple[str, ...],
                 time_limit_s: float = SOLVER_TIME_LIMIT_S):
        self.model, self.lay, self.modes, self.time_limit_s = model, lay, modes, time_limit_s
        self.work = model.work
        self.prof = self.work.profile(lay.dtype)
        self.n = len(self.prof.layers)
        self.place = layout_placement(self.work.cluster, lay)
        self.S = lay.num_stages
        self.p, self.v, self.m = lay.pp, lay.virtual_stages, lay.num_micro_batches
        self.schedule = lay.schedule if lay.pp > 1 else "1f1b"
        self._rank_stages = [rank_stages(self.schedule, r, self.p, self.v) for r in range(self.p)]
        # "none" too: embeddings and the head are never recomputed, whatever the stage's mode
        self.cost = {(i, u): model.block_cost(i, lay, self.place, u) for i in range(self.n)
                     for u in {*modes, "none"}}
        self.repeated = model.repeated_blocks(lay)

    # ---- data helpers ----
    def boundary(self, s: int, last_block: int) -> float:
        """Point-to-point time of the boundary after stage s whose last block is ``last_block``."""
        a, b = stage_rank(self.schedule, s, self.p), stage_rank(self.schedule, s + 1, self.p)
        if a == b:
            return 0.0
        cross = self.place.crosses(a, b)
        nbytes = self.cost[(last_block, self.modes[0])].output_bytes
        return self.model.p2p_seconds(self.lay, nbytes, cross, self.place)

    def solve(self, beta: float = 0.0, start: tuple[list[list[int]], list[str]] | None = None,
              cutoff_s: float | None = None) -> tuple[list[list[int]], list[str], str, float | None]:
        """(stages, modes, status, objective in seconds). With ``cutoff_s`` only splits faster than it count: CBC
        looks for none other and reports "infeasible" when its bound proves there is none; HiGHS, told it as its
        objective bound, may stop on a split above it, which is reported so too (no stages)."""
        lay, work, S, p, v, m = self.lay, self.work, self.S, self.p, self.v, self.m
        prob = pulp.LpProblem(f"stages_{lay.short().replace(' ', '_')}", pulp.LpMinimize)
        # One recomputation mode per stage: the chunks of one rank may differ (recomputing only the chunks that
        # hold the most micro-batches at the rank's peak frees the most memory per recomputed layer).
        self._low = None
        y = {(s, u): pulp.LpVariable(f"mode_stage_{s}_{u}", cat="Binary") for s in range(S) for u in self.modes}
        for s in range(S):
            prob += pulp.lpSum(y[s, u] for u in self.modes) == 1, f"one_mode_stage_{s}"
        # Within a rank, a stage holding more micro-batches at the rank's peak recomputes at least as much (modes
        # ordered fastest first, each keeping less): recomputing there frees more memory for the same time, so
        # with chunks of equal size some best split has this staircase (an exchange; chunks differ by a layer at
        # most, and the brute-force tests check small models), and CBC need not branch over the others.
        strength = {s: pulp.lpSum(k * y[s, u] for k, u in enumerate(self.modes)) for s in range(S)}
        for r in range(p):
            flights = in_flight(self.schedule, p, v, m)[r]
            by_flights = sorted(self._rank_stages[r], key=lambda s: flights.get(s, 0))
            for a, b in zip(by_flights, by_flights[1:], strict=False):
                if flights.get(a, 0) < flights.get(b, 0):
                    prob += strength[b] >= strength[a], f"mode_staircase_rank_{r}_{a}_{b}"
        # Per-stage linear expressions: F, B, W, compute-only fwd/bwd, activations, params, p2p.
        F, B, W, Fc, Bc, A, P, C, R = ({s: 0 for s in range(S)} for _ in range(9))
        X, M = ({s: 0 for s in range(S)} for _ in range(2))  # expert-parallel experts, MoE weights summed over tp
        # zb-v: what a stage's input backward keeps until its weight backward, per micro-batch (StageCost.dw_pending:
        # its blocks' output gradients but on the first stage, and the gradient received for its output)
        G = {s: 0 for s in range(S)}
        zero_bubble = self.schedule == "zb-v"
        work_vars = {s: pulp.LpVariable(f"working_{s}", lowBound=0) for s in range(S)}
        # a rank holding the loss's stage alone (1F1B, GPipe) peaks at the loss or in a layer's backward, priced apart
        # (costmodel._loss_moments): that stage's layers' working set alone, for the latter (set below)
        head = self.cost[(self.n - 1, "none")]  # embeddings and the head are never recomputed
        loss_working = head.act_working
        loss_alone = S > 1 and v == 1 and bool(loss_working)
        layer_work = 0
        big_params = pulp.LpVariable("largest_layer_params", lowBound=0)  # the largest transformer-layer unit
        # the largest unit reducing alone (BlockCost.reduce_unit): the layer's without its experts, or the experts'
        split_units = any(c.experts for c in self.cost.values())
        big_reduce = pulp.LpVariable("largest_reduce_unit", lowBound=0) if split_units else big_params
        Root = {s: 0 for s in range(S)}  # parameters of each stage's root unit (memory.StateBytes)
        if self.repeated:
            L = self.n - 2
            # the most layers a stage can hold: with v > 1 the chunk-balance rows below keep every chunk within a
            # layer of the others (sum L, the end chunks one fewer at most), so (L + 2) // S + 1; a tight gate
            # keeps the LP relaxation close to the integer problem
            # and the fewest: every chunk at least low - 1 (inner) or low - 2 (ends), low >= ceil(L / S) - 1. With
            # both gates a stage's layers in its mode lie in [least, most]·y: nearly the integer problem's own
            most = min(L, (L + 2) // S + 1) if v > 1 else L - max(0, S - 3)  # (v = 1: the other inner stages >= 1)
            fewest = max(0, -(-L // S) - 2) if v > 1 else 0
            cnt = {(s, u): pulp.LpVariable(f"layers_{s}_{u}", lowBound=0, upBound=most, cat="Integer")
                   for s in range(S) for u in self.modes}
            prob += pulp.lpSum(cnt.values()) == L, "all_layers_placed"
            for s in range(S):
                least = fewest + (1 if 0 < s < S - 1 and fewest else 0)
                for u in self.modes:
                    prob += cnt[s, u] <= most * y[s, u], f"mode_gate_{s}_{u}"
                    if least:
                        prob += cnt[s, u] >= least * y[s, u], f"mode_floor_{s}_{u}"
                if 0 < s < S - 1:
                    prob += pulp.lpSum(cnt[s, u] for u in self.modes) >= 1, f"non_empty_stage_{s}"
            ends: dict[int, list[int]] = {0: [0]}
            ends.setdefault(S - 1, []).append(self.n - 1)  # S == 1: one stage holds both
            for s in range(S):
                for u in self.modes:
                    c = self.cost[(1, u)]
                    F[s] += c.fwd * cnt[s, u] + c.tp_fwd * cnt[s, u]
                    B[s] += (c.bwd_input + c.recompute + c.tp_bwd) * cnt[s, u]
                    W[s] += c.bwd_weight * cnt[s, u]
                    Fc[s] += c.fwd * cnt[s, u]
                    Bc[s] += (c.bwd_input + c.bwd_weight) * cnt[s, u]
                    A[s] += c.act_bytes * cnt[s, u]
                    P[s] += c.params * cnt[s, u]
                    R[s] += c.replicated * cnt[s, u]
                    X[s] += c.experts * cnt[s, u]
                    M[s] += c.moe_shared * cnt[s, u]
                    G[s] += c.dw_pending * cnt[s, u] if zero_bubble and s else 0
                    prob += work_vars[s] >= c.act_working * y[s, u], f"working_{s}_{u}"
                for i in ends.get(s, []):
                    c = self.cost[(i, "none")]  # embeddings and the head are never recomputed
                    F[s] += c.fwd + c.tp_fwd
                    B[s] += c.bwd_input + c.tp_bwd
                    W[s] += c.bwd_weight
                    Fc[s] += c.fwd
                    Bc[s] += c.bwd_input + c.bwd_weight
                    A[s] += c.act_bytes
                    P[s] += c.params
                    Root[s] += c.params
                    R[s] += c.replicated
                    G[s] += c.dw_pending if zero_bubble and s else 0
                    if c.act_working:  # the loss's backward (head), the embedding's whole-vocabulary gradient
                        prob += work_vars[s] >= c.act_working, f"working_{s}_end_{i}"
                if s < S - 1:  # every stage but the last ends in a layer (or the embedding): same tensor
                    C[s] = self.boundary(s, 1)
                    G[s] += self.cost[(1, self.modes[0])].output_bytes if zero_bubble else 0
            tied = self.prof.layers[-1].tied_params
            if S == 1 and tied:  # one copy of a tied embedding/head weight (the cost model's rule)
                P[0] -= tied * head.params / self.prof.layers[-1].params
            prob += big_params >= self.cost[(1, self.modes[0])].params, "largest_block_layer"
            if split_units:
                prob += big_reduce >= self.cost[(1, self.modes[0])].reduce_unit, "largest_reduce_unit_layer"
            if loss_alone:  # the last stage's layers' working set: its mode's (charged where it holds none too)
                layer_work = pulp.lpSum(self.cost[(1, u)].act_working * y[S - 1, u] for u in self.modes)
            assign = ("counts", cnt)
        else:
            window = self._block_windows()  # the stages each block can be in (all but with chunks, v > 1)
            if loss_alone:
                layer_work = pulp.LpVariable(f"layer_working_{S - 1}", lowBound=0)
            x = {(i, s, u): pulp.LpVariable(f"block_{i}_stage_{s}_{u}", cat="Binary")
                 for i in range(self.n) for s in window[i] for u in self.modes}
            for i in range(self.n):
                prob += pulp.lpSum(x[i, s, u] for s in window[i] for u in self.modes) == 1, f"block_placed_{i}"
            stage_of = {i: pulp.lpSum(s * x[i, s, u] for s in window[i] for u in self.modes) for i in range(self.n)}
            prob += stage_of[0] == 0, "first_block_first_stage"
            prob += stage_of[self.n - 1] == S - 1, "last_block_last_stage"
            e = {}
            for i in range(self.n - 1):
                e[i] = pulp.LpVariable(f"boundary_after_{i}", cat="Binary")
                prob += stage_of[i + 1] - stage_of[i] == e[i], f"contiguous_{i}"
            # Each stage's sums as (variable, coefficient) terms, made expressions once: thousands of binaries'
            # `expr += coef * var` (a temporary expression each) were most of the ILP's time (DeepSeek-V3's
            # interleaved layouts: ~0.9 s of Python per ILP beside HiGHS's 0.25 s)
            terms: dict[str, dict[int, list]] = {k: {s: [] for s in range(S)} for k in "FBWfbAPRXMrG"}
            for i in range(self.n):
                for s in window[i]:
                    for u in self.modes:
                        xv = x[i, s, u]
                        prob += xv <= y[s, u], f"mode_gate_{i}_{s}_{u}"
                        c = self.cost[(i, u)]
                        for k, coef in (("F", c.fwd + c.tp_fwd), ("B", c.bwd_input + c.recompute + c.tp_bwd),
                                        ("W", c.bwd_weight), ("f", c.fwd), ("b", c.bwd_input + c.bwd_weight),
                                        ("A", c.act_bytes), ("P", c.params), ("R", c.replicated),
                                        ("X", c.experts), ("M", c.moe_shared), ("r", c.params if c.root else 0.0),
                                        ("G", c.dw_pending if zero_bubble and s else 0.0)):
                            if coef:
                                terms[k][s].append((xv, coef))
                        prob += work_vars[s] >= c.act_working * xv, f"working_{i}_{s}_{u}"
                        if loss_alone and s == S - 1 and i < self.n - 1:
                            prob += layer_work >= c.act_working * xv, f"layer_working_{i}_{s}_{u}"
                        if not c.root:
                            prob += big_params >= c.params * xv, f"largest_block_{i}_{s}_{u}"
                            if split_units:
                                prob += big_reduce >= c.reduce_unit * xv, f"largest_reduce_unit_{i}_{s}_{u}"
            for k, sums in zip("FBWfbAPRXMrG", (F, B, W, Fc, Bc, A, P, R, X, M, Root, G), strict=True):
                for st in range(S):
                    sums[st] = pulp.LpAffineExpression(terms[k][st])
            for i in range(self.n - 1):
                for s in window[i]:
                    if s == S - 1:
                        continue
                    q = pulp.LpVariable(f"last_of_stage_{i}_{s}", lowBound=0)
                    prob += q >= pulp.lpSum(x[i, s, u] for u in self.modes) + e[i] - 1, f"last_mark_{i}_{s}"
                    C[s] += self.boundary(s, i) * q
                    G[s] += self.cost[(i, self.modes[0])].output_bytes * q if zero_bubble else 0
            assign = ("binary", x)
        if v > 1:  # interleaved / V schedules: chunks within one block of each other (lock-step rounds punish
            # uneven chunks far beyond what rank totals show; the event simulator confirms it)
            sizes = {s: (pulp.lpSum(assign[1][s, u] for u in self.modes) if assign[0] == "counts" else
                         pulp.lpSum(assign[1][i, s, u] for i in range(self.n) for u in self.modes
                                    if (i, s, u) in assign[1])) for s in range(S)}
            low = pulp.LpVariable("chunk_blocks_low", lowBound=0, cat="Integer")
            self._low = low
            for s in range(S):
                ends = 1 if assign[0] == "counts" and s in (0, S - 1) else 0  # embedding/head ride along
                prob += sizes[s] >= low - ends, f"chunk_balance_low_{s}"
                prob += sizes[s] <= low + 1, f"chunk_balance_high_{s}"
            if assign[0] == "counts":
                # Symmetry: swapping the layer counts of two inner chunks of one rank changes nothing but
                # that rank's activation memory, which is least with the bigger chunk where fewer
                # micro-batches are in flight. Fixing that order (ties by index) removes the equivalent
                # solutions CBC would otherwise branch over.
                for r in range(p):
                    for a, b in _pairs_by_flight(inner_chunk_order(lay, r)):
                        prob += sizes[a] >= sizes[b], f"chunk_order_rank_{r}_{a}_{b}"
        # Point-to-point: stage s pays its send forward, stage s+1 the gradient back; every stage its
        # schedule actions and data-parallel root unit (the cost model's stage_host_overhead).
        for s in range(S - 1):
            F[s] += C[s]
            B[s + 1] += C[s]
        host = self.model.stage_host_overhead(lay)
        for s in range(S):
            F[s] += host / 2
            B[s] += host / 2
        if zero_bubble and S > 1:  # the last stage's: its excess over the loss's working set (the cost model's rule)
            excess = pulp.LpVariable("pending_over_loss_working", lowBound=0)
            prob += excess >= G[S - 1] - loss_working, "pending_over_loss_working"
            G[S - 1] = excess
        ranks = self._rank_stages
        T = {r: pulp.lpSum(F[s] + B[s] + W[s] for s in ranks[r]) for r in range(p)}
        Tmax = pulp.LpVariable("slowest_rank_time", lowBound=0)
        for r in range(p):
            prob += Tmax >= T[r], f"slowest_rank_{r}"
        linear = linear_makespan(self.schedule, p, v, m)  # the cost model's closed form (schedules.py)
        if linear is not None:
            makespan = linear[0] * Tmax + linear[1] * pulp.lpSum(T.values())
        else:
            makespan = (m + beta) * Tmax
        z = pulp.LpVariable("iteration_before_optimizer", lowBound=0)
        o = pulp.LpVariable("optimizer_step", lowBound=0)
        gpu, limit = work.cluster.gpu, work.memory_limit_GiB
        # where the collectives' secants are taken: every rank with 1/p of the model (the balanced split)
        first = [self.cost[(i, self.modes[0])] for i in range(self.n)]
        guess = RankLoad(params=max(sum(c.params - c.experts for c in first) / p, 1.0),
                         replicated=sum(c.replicated for c in first) / p, experts=sum(c.experts for c in first) / p,
                         moe_shared=sum(c.moe_shared for c in first) / p)
        step = optimizer_step(self.model, lay)
        expert_step = moe.expert_optimizer_step(self.model, lay)
        states, expert_states = state_bytes(work.framework, lay), moe.expert_states(work.framework, lay)
        # the optimizer step's moment (memory.step_bytes): per parameter, its states and foreach copies; and per rank
        # the one-tensor temporaries of its largest tensor
        step_moment = states.step_allocates or expert_states.step_allocates

        def step_per(x) -> float:
            return x.step_weights + x.step_grads + x.optimizer + x.step_all

        temporaries = self._step_temporaries(prob, assign, states, expert_states) if step_moment else {}
        # zb-v's moments also count, per stage, what its input backward keeps for W (pending_key) and its unfolded
        # 16-bit gradients (unfolded_key; none on the first stage: costmodel.unfolded_bytes): their bytes by key
        extra: dict[int, object] = {}
        if zero_bubble:
            for s in range(S):
                extra[pending_key(s, p, v)] = G[s]
                if s and (states.unfolded or expert_states.unfolded):
                    extra[unfolded_key(s, p, v)] = states.unfolded * (P[s] - X[s]) + expert_states.unfolded * X[s]
        # ZeRO-3 interleaved of more chunks a rank than torch's runtime keeps active: whether each stage's chunk has
        # whole-chunk gathers pending (gathered_key; costmodel.gathered_bytes)
        gathers = prices_chunk_gathers((states, expert_states))
        if gathers:
            for s in range(S):
                extra[gathered_key(s, p, v)] = states.chunk_gather * (P[s] - X[s] - Root[s]) \
                    + expert_states.chunk_gather * X[s]
        drain = 0
        for r in range(p):
            rank_b = pulp.lpSum(B[s] for s in ranks[r])
            rank_w = pulp.lpSum(W[s] for s in ranks[r])
            load = RankLoad(params=pulp.lpSum(P[s] - X[s] for s in ranks[r]), fwd=pulp.lpSum(Fc[s] for s in ranks[r]),
                            bwd=pulp.lpSum(Bc[s] for s in ranks[r]), window=rank_b + rank_w, makespan=makespan,
                            replicated=pulp.lpSum(R[s] for s in ranks[r]), experts=pulp.lpSum(X[s] for s in ranks[r]),
                            moe_shared=pulp.lpSum(M[s] for s in ranks[r]))
            # the stages' split changes only the root unit's size without a pipeline, which has no ILP
            items = self.model.rank_dp_items(lay, self.place, r, root=0.0)
            exposed = _exposure_expression(prob, items, load, guess, p, f"rank_{r}")
            prob += z >= makespan - drain + exposed, f"rank_end_{r}"
            drain = drain + (0 if self.schedule == "zb-v" else (rank_b + rank_w) / v)
            prob += o >= step.at(load) + expert_step.at(load), f"optimizer_{r}"
            # memory of rank r (memory.rank_memory, linear)
            flights = in_flight(self.schedule, p, v, m)[r]
            # activations at the rank's peak: the most over every moment that may be it (schedules.peak_holdings)
            held = peak_holdings(self.schedule, p, v, m, gathers)[r]
            # with whole-chunk gathers, the moments before the rank's first backward (no gradient yet) apart
            early = [h for h in held if not h.get(late_key(p, v))] if gathers else []
            held = [h for h in held if h.get(late_key(p, v))] if gathers else held

            def at(h: dict[int, int], r: int = r):  # a moment's bytes: its activations, and zb-v's extra keys
                return pulp.lpSum([h.get(s, 0) * A[s] for s in ranks[r]]
                                  + [n * extra[key] for key, n in h.items() if key in extra])

            def peak_of(moments: list[dict[int, int]], name: str, prob: pulp.LpProblem = prob):
                if len(moments) == 1:
                    return at(moments[0])
                # in GiB, as the memory rows (bytes beside the other rows' units leave the solvers badly scaled)
                peak_gib = pulp.LpVariable(f"{name}_GiB", lowBound=0)
                for k, h in enumerate(moments):
                    prob.addConstraint(peak_gib >= at(h) * (1 / 2**30), f"{name}_moment_{k}")
                return peak_gib * 2**30

            staged = big_reduce  # the reduce buffers' units (memory.staged_unit_params): per chunk where held
            if states.staging_held and states.unit_grads:
                staged = 0
                for s in ranks[r]:
                    unit_s = pulp.LpVariable(f"staged_unit_stage_{s}", lowBound=0)
                    prob += unit_s >= big_reduce, f"staged_unit_stage_{s}_layers"
                    prob += unit_s >= Root[s], f"staged_unit_stage_{s}_root"
                    if gathers:  # each moment's own (costmodel.reduce_buffer_bytes), priced in the moments (peak_of):
                        # the root unit's, else a layer's; a stage's root unit is a number in the repeated-layers
                        # form (the ends'), otherwise the larger
                        kept = (Root[s] or big_reduce) if isinstance(Root[s], (int, float)) else unit_s
                        extra[buffer_key(s, p, v)] = states.unit_grads * kept
                    else:
                        staged += unit_s
            acts = peak_of(held, f"activations_at_peak_rank_{r}")
            working = pulp.LpVariable(f"working_rank_{r}", lowBound=0)
            for s in ranks[r]:
                prob += working >= work_vars[s], f"working_rank_{r}_stage_{s}"
            grads = states.grads * load.params + expert_states.grads * load.experts
            grads_at_peak = self.model.grads_at_activation_peak(lay, ranks[r], flights)
            if not gathers and not grads_at_peak:  # gathers: late
                # in GiB, as the memory rows: in bytes beside them, HiGHS's presolve returned as optimal a split 31%
                # slower than one that fits (gpt-small dp2 tp2 pp2 GPipe ZeRO-3 on 2 GiB GPUs, once the loss's moment
                # was a row of its own)
                arriving = pulp.LpVariable(f"grads_at_peak_rank_{r}_GiB", lowBound=0)
                prob += arriving >= (grads - pulp.lpSum(A[s] for s in ranks[r])) * (1 / 2**30), \
                    f"grads_after_first_backward_{r}"
                grads = arriving * 2**30
            units = (states.unit_weights + states.unit_wgrads) * big_params + states.unit_grads * staged \
                + states.root_weights * pulp.lpSum(Root[s] for s in ranks[r])
            kept = (states.weights + states.optimizer) * load.params \
                + (expert_states.weights + expert_states.optimizer) * load.experts + acts
            if loss_alone and not gathers and ranks[r] == (S - 1,):  # costmodel._loss_moments
                # the loss's backward: no unit gathered, no layer gradient, the root unit's reduce buffer where held;
                # before the rank's first backward has produced gradients, none and no buffer
                at_loss = kept + loss_working
                if grads_at_peak:
                    at_loss += grads + (states.unit_grads * Root[S - 1] if states.staging_held else 0)
                prob += (at_loss + untracked_bytes(gpu, at_loss)) * (1 / 2**30) <= limit, f"mem_loss_rank_{r}"
                tensors = kept + grads + units - head.act_bytes + layer_work  # a layer's backward
            else:
                tensors = kept + grads + units + working
            # in GiB: bytes (1e9) beside seconds (1e-4) would leave CBC badly scaled rows
            prob += (tensors + untracked_bytes(gpu, tensors)) * (1 / 2**30) <= limit, f"mem_cap_rank_{r}"
            if early:  # before the first backward: no gradient (costmodel.gather_peaks)
                before = tensors - acts - grads + peak_of(early, f"early_peak_rank_{r}")
                prob += (before + untracked_bytes(gpu, before)) * (1 / 2**30) <= limit, \
                    f"mem_early_rank_{r}"
            if states.start_weights or expert_states.start_weights:  # the step's first moment (memory.start_bytes)
                first = states.start_per_param * load.params + expert_states.start_per_param * load.experts
                prob += (first + untracked_bytes(gpu, first)) * (1 / 2**30) <= limit, f"mem_start_rank_{r}"
            if step_moment:  # the optimizer step (memory.step_bytes)
                last = step_per(states) * load.params + step_per(expert_states) * load.experts + temporaries[r]
                prob += (last + untracked_bytes(gpu, last)) * (1 / 2**30) <= limit, f"mem_step_rank_{r}"
        # Objective in units of a rough iteration time, so CBC's tolerances (absolute ~1e-6) are relative
        scale = 1.0 / max(self._rough_time(), 1e-12)
        prob += (z + o) * scale
        if start is not None:
            self._warm_start(assign, y, start)
        options = [f"cutoff {cutoff_s * scale:.12g}"] if cutoff_s is not None else []
        if assign[0] == "counts":
            # A handful of integers with tight LP bounds: CBC's cut rounds and primal heuristics cost more
            # than the few nodes they save (llama2-70b on 64 GPUs: the search's ILPs ~30% less CPU, same plans;
            # benchmarks/bench_plan.py)
            options += ["cuts off", "heuristics off"]
        failures = []
        for name in SOLVER_ORDER if assign[0] == "counts" else BLOCK_SOLVER_ORDER:
            try:
                _run_solver(prob, name, warm=start is not None, cutoff=cutoff_s * scale if cutoff_s else None,
                            cbc_options=options, time_limit_s=self.time_limit_s)
                break
            except (pulp.PulpSolverError, OSError, RuntimeError) as e:  # a solver that could not run, or crashed
                failures.append(f"{name}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
        else:
            raise SolverFailed("; ".join(failures))
        self.solver = name
        if prob.sol_status == pulp.LpSolutionOptimal:
            status_name = "optimal"
        elif prob.sol_status == pulp.LpSolutionIntegerFeasible:
            status_name = "time limit (best found)"
        else:
            return [], [], pulp.LpStatus[prob.status].lower(), None
        objective = pulp.value(prob.objective) / scale
        if cutoff_s is not None and objective > cutoff_s * (1 + 1e-9):  # none faster than the cutoff was found
            return [], [], "infeasible", None
        stages, modes = self._extract(assign, y)
        return stages, modes, status_name, objective

    def _rough_time(self) -> float:
        """The iteration time of an ideal split (total work spread evenly), to scale the objective."""
        total = sum(c.fwd + c.bwd_input + c.bwd_weight for (i, u), c in self.cost.items() if u == "none")
        return total * self.m / self.p

    def _block_windows(self) -> list[range]:
        """The stages each block can be in, where the binary form places blocks one by one. With chunks (v > 1) the
        chunk-balance rows keep every stage within one block of the others, so with n blocks over S stages each holds
        a = floor(n/S) or b = ceil(n/S): block i lies in a stage s with s·a <= i < (s+1)·b, two or three of the S
        (DeepSeek-V3 and Llama 4 at pp2 v4: 2 of 8). The other variables would be zero in every feasible split and
        are never made: the ILP is that much smaller to build and to solve. Without chunks, every stage."""
        if self.v == 1:
            return [range(self.S)] * self.n
        a, b = self.n // self.S, -(-self.n // self.S)
        return [range(i // b, min(self.S - 1, i // a) + 1) for i in range(self.n)]

    def _step_temporaries(self, prob: pulp.LpProblem, assign: tuple, states, expert_states) -> dict[int, object]:
        """Per rank, the bytes torch's one-tensor AdamW allocates for the largest tensor it updates (memory.step_bytes:
        StateBytes.step_largest per element of BlockCost.largest_param, largest_expert): at least the least any
        block has (every rank holds one), more where its stages hold a block with more, as a variable bounded by
        each such block's placement (the binary form), or the largest of a layer's and its end blocks' (the counts
        form: every stage is taken to hold a layer, as every split worth having does)."""
        S = self.p * self.v

        def temp(c) -> float:
            return max(c.largest_param * states.step_largest, c.largest_expert * expert_states.step_largest)

        temps = {key: temp(c) for key, c in self.cost.items()}
        least = min(temps.values())
        out: dict[int, object] = {}
        if assign[0] == "binary":
            rank_of = {s: r for r, stages in enumerate(self._rank_stages) for s in stages}
            above: dict[int, list] = {r: [] for r in range(self.p)}
            for (i, s, u), xv in assign[1].items():
                if temps[(i, u)] > least:
                    above[rank_of[s]].append((temps[(i, u)], xv))
            for r, terms in above.items():
                if not terms:
                    out[r] = least
                    continue
                var = out[r] = pulp.LpVariable(f"step_temporaries_rank_{r}", lowBound=least)
                for k, (bytes_, xv) in enumerate(terms):
                    prob += var >= bytes_ * xv, f"step_temporaries_rank_{r}_{k}"
            return out
        layer = max(temps[(1, u)] for u in self.modes)  # charged on every rank: a stage without layers is no split
        for r, stages in enumerate(self._rank_stages):  # worth having (its end block alone)
            out[r] = max([layer] + [temps[(0, "none")] for s in stages if s == 0]
                         + [temps[(self.n - 1, "none")] for s in stages if s == S - 1])
        return out

    def _warm_start(self, assign, y, start: tuple[list[list[int]], list[str]]) -> None:
        """Give CBC a feasible split to start from (only the assignment; it derives the rest)."""
        stages, modes = start
        kind, var = assign
        if getattr(self, "_low", None) is not None:
            sizes = [sum(1 for i in b if kind != "counts" or 0 < i < self.n - 1) for b in stages]
            self._low.setInitialValue(min(sizes[1:-1]) if kind == "counts" and len(sizes) > 2 else min(sizes))
        for (s, u), v in y.items():
            v.setInitialValue(1 if modes[s] == u else 0)
        if kind == "counts":
            for s, blocks in enumerate(stages):
                layers = sum(1 for i in blocks if 0 < i < self.n - 1)
                for u in self.modes:
                    var[s, u].setInitialValue(layers if modes[s] == u else 0)
        else:
            where = {i: s for s, blocks in enumerate(stages) for i in blocks}
            for (i, s, u), v in var.items():
                v.setInitialValue(1 if where[i] == s and modes[s] == u else 0)

    def _extract(self, assign, y) -> tuple[list[list[int]], list[str]]:
        modes = [max(self.modes, key=lambda u: y[s, u].value() or 0) for s in range(self.S)]
        kind, var = assign
        if kind == "counts":
            counts = [round(sum(var[s, u].value() or 0 for u in self.modes)) for s in range(self.S)]
            return stages_from_counts(counts, self.n), modes
        stages = [[] for _ in range(self.S)]
        for i in range(self.n):
            s = max(range(self.S), key=lambda s: sum(var[i, s, u].value() or 0 for u in self.modes if (i, s, u) in var))
            stages[s].append(i)
        return stages, modes


def _pairs_by_flight(order: list[int]):
    return zip(order, order[1:], strict=False)


def chunks_balanced(stages: list[list[int]], n_blocks: int, ends_ride_along: bool) -> bool:
    """The planner's rule for v > 1 (the ILP's chunk-balance rows): every chunk holds within one block
    of the others. With ``ends_ride_along`` (a transformer) only layers count, and the end chunks may
    hold one layer fewer, as they carry the embedding and the head."""
    if ends_ride_along:  # contiguous stages: the embedding (block 0) is the first's first, the head the last's last
        sizes = [len(s) - (s[0] == 0) - (s[-1] == n_blocks - 1) if s else 0 for s in stages]
    else:
        sizes = [len(s) for s in stages]
    return _sizes_balanced(sizes, ends_ride_along)


def _sizes_balanced(sizes: list[int], ends_ride_along: bool) -> bool:
    """:func:`chunks_balanced` of the chunks' counted sizes (layers only, where the ends ride along): is there a floor
    f with every chunk within [f - slack, f + 1], the slack 1 for the two end chunks where the ends ride along, else
    0? Each chunk bounds f from both sides, so one exists when the largest bound from below, max(c) - 1, is at most
    the smallest from above, min(c + slack): min and max in C, no scan per floor (the polish asks it of every move of
    a deep interleaved split)."""
    if ends_ride_along and len(sizes) > 1:
        first, last = sizes[0], sizes[-1]
        inner = sizes[1:-1]
        top = max(first, last, *inner) if inner else max(first, last)
        return top - 1 <= min(min(inner), first + 1, last + 1) if inner else top - 1 <= min(first, last) + 1
    return max(sizes) - 1 <= min(sizes)


def _neighbours(stages: list[list[int]], modes: list[str], allowed: tuple[str, ...], rank_of: list[int],
                with_modes: bool = True, balanced: bool | None = None):
    """Partitions one boundary move, or (``with_modes``) one stage's mode change or one pipeline rank's (all its
    stages at once), away (the ILP's own space). ``balanced``: only those that keep :func:`chunks_balanced`'s rule
    (True: where the ends ride along), checked on the stages' sizes before any is built (a polish of an
    interleaved split rejects about 7 in 10 boundary moves)."""
    S = len(stages)
    cuts = [sum(len(s) for s in stages[:k + 1]) for k in range(S - 1)]
    n = sum(len(s) for s in stages)
    counted = None
    if balanced is not None:  # the sizes chunks_balanced counts (stages are contiguous, none empty)
        counted = [len(s) for s in stages]
        if balanced:
            counted[0] -= 1
            counted[-1] -= 1
    for k in range(S - 1):
        for d in (-1, 1):
            new = list(cuts)
            new[k] += d
            lo = new[k - 1] if k else 0
            hi = new[k + 1] if k + 1 < len(new) else n
            if lo < new[k] < hi:
                if counted is not None:
                    counted[k] += d
                    counted[k + 1] -= d
                    keep = _sizes_balanced(counted, balanced)
                    counted[k] -= d
                    counted[k + 1] += d
                    if not keep:
                        continue
                moved = list(stages)  # the other stages' lists shared (read-only, as every caller keeps them)
                moved[k], moved[k + 1] = list(range(lo, new[k])), list(range(new[k], hi))
                yield moved, modes
    if not with_modes or (counted is not None and not _sizes_balanced(counted, balanced)):
        return
    for s in range(S):
        for u in allowed:
            if modes[s] != u:
                yield stages, [u if k == s else modes[k] for k in range(S)]
    for r in sorted(set(rank_of)):
        mine = [s for s in range(S) if rank_of[s] == r]
        for u in allowed:
            if len(mine) > 1 and sum(modes[s] != u for s in mine) > 1:
                yield stages, [u if rank_of[s] == r else modes[s] for s in range(S)]


def best_partition(model: CostModel, lay: Layout, allowed_modes: tuple[str, ...] | None = None,
                   local_search: bool = True, start: Prediction | None = None,
                   cutoff_s: float | None = None, refine_below_s: float | None = None,
                   time_limit_s: float = SOLVER_TIME_LIMIT_S) -> Partition | None:
    """The ILP's stage boundaries and per-stage recomputation for ``lay``, priced exactly and polished.

    ``cutoff_s``: only a split faster than this is of interest (the search's k-th best time, with a
    margin for what the exact model and the polish may gain over the ILP's linear pieces); returns
    None when CBC proves there is none. ``refine_below_s``: a first answer priced above this is kept as it
    is — no bubble refinement, no local search (the search's heuristic mode: it cannot reach the top plans).
    Raises InvalidLayout("out of memory by X GiB") when no split fits.
    """
    modes = modes_for(model, allowed_modes, lay.dtype, lay)
    if not modes:
        raise InvalidLayout(no_mode_reason(model, lay, allowed_modes))
    if lay.num_stages == 1:  # one stage: no boundary to choose, only the recomputation mode
        return _single_stage(model, lay, modes)
    ilp = StageILP(model, lay, modes, time_limit_s)
    beta = 0.0
    needs_beta = (lay.pp > 1 and lay.schedule == "zb-v") or (lay.schedule == "interleaved-1f1b"
                                                           and lay.num_micro_batches < lay.pp)
    best: Partition | None = None
    last_status, last_obj = "Not Solved", None
    warm = _warm_split(model, lay, modes, start)
    warm_s = float("inf")
    if needs_beta and warm is not None:  # start from the bubble of the split CBC starts from
        warm_pred = model.evaluate(lay, warm[0], warm[1])
        beta, warm_s = _bubble_beta(model, lay, warm_pred), warm_pred.iteration_time_s
    for _ in range(3 if needs_beta else 1):
        try:
            stages, st_modes, status, obj = ilp.solve(beta, warm, cutoff_s)
        except SolverFailed as e:
            if best is not None:
                break  # a later refinement failed: keep the split already found
            return _without_solver(model, lay, modes, warm, str(e), local_search)
        last_status, last_obj = status, obj
        if not stages:
            if cutoff_s is not None and best is None:
                if start is not None and start.fits and start.iteration_time_s < cutoff_s:
                    return _from_start(model, lay, modes, start, status.lower(), local_search)
                return None  # nothing beats the cutoff, or nothing found in time: either way, not a top plan
            break
        pred = model.evaluate(lay, stages, st_modes)
        if not pred.fits:  # the ILP's linear memory rows passed what the exact model does not: refit the modes
            refit = model.least_recompute(lay, stages, modes)
            if refit is None:
                if best is None and warm is not None:
                    stages, st_modes = warm
                    pred = model.evaluate(lay, stages, st_modes)
                else:
                    break
            else:
                st_modes = refit[0]
                pred = model.evaluate(lay, stages, st_modes, costs=refit[1])
        if best is None or pred.iteration_time_s < best.prediction.iteration_time_s:
            best = Partition(stages, st_modes, pred, status, obj)
        if refine_below_s is not None and best.prediction.iteration_time_s > refine_below_s:
            best.ilp_status, best.ilp_objective = status, obj
            return best
        if not needs_beta or (status != "optimal" and pred.iteration_time_s >= warm_s * (1 - 1e-9)):
            break  # (time-limited without beating its start: another bubble estimate would not help it either)
        new_beta = _bubble_beta(model, lay, pred)
        if math.isclose(new_beta, beta, rel_tol=1e-3, abs_tol=1e-6):
            break
        beta = new_beta
    if best is None:
        if start is not None and start.fits:  # nothing found in time, but the search's quick split fits: keep it
            return _from_start(model, lay, modes, start, last_status.lower(), local_search)
        raise InvalidLayout(_oom_message(model, lay, modes, last_status), "out of memory")
    exact = best.ilp_objective is not None and math.isclose(best.ilp_objective, best.prediction.iteration_time_s,
                                                             rel_tol=1e-6)
    if local_search and (lay.num_stages <= 16 or not (exact and best.ilp_status == "optimal")):
        # Linear pieces (ring vs tree collectives, the secant of a collective's time) or the time limit may
        # leave a gap between the ILP and the exact model: climb on the exact model (cheap for few stages).
        best = _polish(model, lay, best, modes, max_rounds=50 if lay.num_stages <= 16 else 3)
    if start is not None and start.fits and start.iteration_time_s < best.prediction.iteration_time_s * (1 - 1e-9):
        return _from_start(model, lay, modes, start, last_status.lower(), local_search)  # (a time-limited ILP)
    best.ilp_status, best.ilp_objective = last_status, last_obj
    if last_status == "optimal" and rounds_priced_after(lay):
        best.ilp_status = OPTIMAL_BY_RANK_SUMS
    return best


# An interleaved split's ILP status where the ILP proved its split the best by the ranks' sums (rounds_priced_after)
OPTIMAL_BY_RANK_SUMS = "optimal by the ranks' sums, the rounds' wait priced after"


def rounds_priced_after(lay: Layout) -> bool:
    """Does ``lay``'s price hold what the ILP's objective leaves out: interleaved 1F1B's wait for the unequal chunks
    of its lock-step rounds (schedules.rounds_excess)? The ILP minimises the closed form of the ranks' sums, a lower
    bound on that price (so its cutoffs stay proofs); its split, polished on the price, is then the best the ILP
    proves by the ranks' sums, not the best by the price (on a 6-layer model's 70 interleaved layouts, 13 came out
    0.04-7.0% above the brute force's)."""
    return rounds_priced(lay.schedule, lay.pp, lay.virtual_stages, lay.num_micro_batches)


def _without_solver(model: CostModel, lay: Layout, modes: tuple[str, ...], warm, reason: str,
                    local_search: bool) -> Partition:
    """When no solver ran: the split the solver would have started from (or the time-balanced one in the
    fastest uniform mode that fits), polished on the exact model; its status says why."""
    from .costmodel import default_stages

    tried = [warm] if warm is not None else []
    for u in modes:
        tried.append((default_stages(model, lay.replace(recompute=u)), [u] * lay.num_stages))
    fitting = [(split, pred) for split in tried if (pred := model.evaluate(lay, split[0], split[1])).fits]
    if not fitting:
        raise InvalidLayout(_oom_message(model, lay, modes, "no solver ran"), "out of memory")
    (stages, st_modes), pred = min(fitting, key=lambda item: item[1].iteration_time_s)
    status = f"solver failed ({reason}): balanced split, polished"
    best = Partition(stages, st_modes, pred, status, None)
    if local_search:
        best = _polish(model, lay, best, modes, max_rounds=50 if lay.num_stages <= 16 else 3)
    best.ilp_status = status
    return best


def _single_stage(model: CostModel, lay: Layout, modes: tuple[str, ...]) -> Partition:
    stages = [list(range(len(model.work.profile(lay.dtype).layers)))]
    priced = [model.evaluate(lay, stages, [u]) for u in modes]
    fitting = [p for p in priced if p.fits]
    if not fitting:
        raise InvalidLayout(_oom_message(model, lay, modes, "single stage"), "out of memory")
    best = min(fitting, key=lambda p: p.iteration_time_s)
    return Partition(stages, [best.stages[0].recompute], best, "single stage: every mode priced", None)


def _warm_split(model: CostModel, lay: Layout, modes: tuple[str, ...], start: Prediction | None
                ) -> tuple[list[list[int]], list[str]] | None:
    """A split that satisfies the ILP's constraints, for CBC to start from: the faster of the layers spread evenly
    (what the chunk-balance rows accept) with the least recomputation per stage that fits, and the given split (the
    search's quick price, which may move a layer off an end chunk) where the ILP's rows accept it."""
    options = []
    stages = even_stages(model, lay) or count_balanced_stages(model, lay)
    if stages is not None:
        got = model.least_recompute(lay, stages, modes)
        if got is not None:
            options.append((model.evaluate(lay, stages, got[0], costs=got[1]).iteration_time_s, stages, got[0]))
    if _start_accepted(model, lay, modes, start):
        options.append((start.iteration_time_s, [c.blocks for c in start.stages], [c.recompute for c in start.stages]))
    if not options:
        return None
    _, stages, chosen = min(options, key=lambda o: o[0])
    return stages, chosen


def _start_accepted(model: CostModel, lay: Layout, modes: tuple[str, ...], start: Prediction | None) -> bool:
    """Does the ILP's space hold ``start``'s split: as many stages, its modes, chunks balanced (and, for identical
    layers, the larger inner chunks of a rank where it holds fewer micro-batches: the ILP's symmetry rows)?"""
    if start is None or not start.fits or len(start.stages) != lay.num_stages or \
            any(c.recompute not in modes for c in start.stages):
        return False
    if lay.virtual_stages == 1:
        return True
    stages = [c.blocks for c in start.stages]
    n_blocks = sum(map(len, stages))
    repeated = model.repeated_blocks(lay)
    if not chunks_balanced(stages, n_blocks, repeated):
        return False
    if repeated:
        sizes = [sum(1 for i in b if 0 < i < n_blocks - 1) for b in stages]
        return all(sizes[a] >= sizes[b] for r in range(lay.pp) for a, b in _pairs_by_flight(inner_chunk_order(lay, r)))
    return True


def polished_quick_split(model: CostModel, lay: Layout, start: Prediction, allowed_modes: tuple[str, ...] | None = None
                         ) -> Partition:
    """The search's heuristic answer for interleaved and V layouts of transformer layers: the quick price's split
    (layers dealt evenly, or a layer off an end chunk; the least recomputation per stage that fits) polished on the
    exact model, without an ILP. The planner's chunk rule leaves such a layout little to choose (which chunks hold a
    layer more, and each one's mode). Against the 0.2 s ILP started from the same quick split, on the demo's 30
    such layouts: equal on 17, faster on 12 (up to 3.1%: the ILP does not start from a layer moved off an end
    chunk), slower on 1 (1.0%); on the 1T GPT's 4, equal; the ILPs time-limited on 28 of the 30, at 0.3 s each.
    ``plan --exhaustive`` runs the ILP."""
    modes = modes_for(model, allowed_modes, lay.dtype, lay)
    if not modes:
        raise InvalidLayout(no_mode_reason(model, lay, allowed_modes))
    if lay.virtual_stages > 1 and len({c.recompute for c in start.stages}) > 1:
        # memory forces recomputation on some stages, not all: a layer off an end chunk may spare it (where every
        # stage needs the same mode, one layer moved spares none)
        # every stage without recomputation, the fastest: where even that pipeline is no faster, no fit is (the linear
        # closed form grows with every stage's time), and the fit is the dearer test (about half the demo's moves)
        pretest = modes[0] == "none" and linear_makespan(lay.schedule, lay.pp, lay.virtual_stages,
                                                           lay.num_micro_batches) is not None
        for stages in lighter_end_stages(model, lay):
            if pretest and pipeline_makespan(lay, model.stage_costs(lay, stages, ["none"] * len(stages))) \
                    >= start.iteration_time_s:
                continue
            got = model.least_recompute(lay, stages, modes)
            if got is None or pipeline_makespan(lay, got[1]) >= start.iteration_time_s:
                continue  # does not fit, or its pipeline alone is no faster: no need to price it whole
            pred = least_recompute_prediction(model, lay, stages, modes, got, beat=start.iteration_time_s)
            if pred is not None and pred.iteration_time_s < start.iteration_time_s:  # (a floor never is)
                start = pred
    return _from_start(model, lay, modes, start, "chunks of transformer layers, no ILP", True)


def _from_start(model: CostModel, lay: Layout, modes: tuple[str, ...], start: Prediction, status: str,
                local_search: bool) -> Partition:
    """``start`` (the search's quick split) as the answer, polished like an ILP's: where no ILP ran, or where the
    ILP found nothing faster in its time."""
    best = Partition([c.blocks for c in start.stages], [c.recompute for c in start.stages], start,
                     f"{status}: the quick split kept", None)
    if local_search:
        best = _polish(model, lay, best, modes, max_rounds=50 if lay.num_stages <= 16 else 3)
    return best


def _bubble_beta(model: CostModel, lay: Layout, pred: Prediction) -> float:
    """The schedule's bubble in units of the slowest rank's time, at this split."""
    p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
    ranks = [rank_stages(lay.schedule, r, p, v) for r in range(p)]
    rt = [sum(pred.stages[s].total for s in rs) for rs in ranks]
    rf = [sum(pred.stages[s].t_f for s in rs) for rs in ranks]
    rw = [sum(pred.stages[s].t_w for s in rs) for rs in ranks]
    slow = max(rt)
    return closed_form_makespan(lay.schedule, p, v, m, rt, rf, rw) / slow - m if slow else 0.0


def _polish(model: CostModel, lay: Layout, part: Partition, modes: tuple[str, ...], max_rounds: int) -> Partition:
    """Hill-climb on the exact cost model from the ILP's answer (fits required)."""
    best = part
    improved = True
    rounds = 0
    balanced = model.repeated_blocks(lay) if lay.virtual_stages > 1 else None
    while improved and rounds < max_rounds:
        rounds += 1
        improved = False
        rank_of = [stage_rank(lay.schedule if lay.pp > 1 else "1f1b", s, lay.pp) for s in range(lay.num_stages)]
        # modes too only for few stages: a deep pipeline's (64+ stages, 4-5 ms a price) would cost seconds a
        # round, and the ILP chose them on the same costs; chunks kept balanced where v > 1
        for stages, st_modes in _neighbours(best.stages, best.recompute, modes, rank_of, lay.num_stages <= 16,
                                            balanced):
            costs = model.stage_costs(lay, stages, st_modes)
            beat = best.prediction.iteration_time_s * (1 - 1e-9)
            if pipeline_makespan(lay, costs) >= beat:
                continue  # its pipeline alone is as slow: the exact price (makespan + waits + step) cannot improve
            changed = {rank_of[s] for s in range(lay.num_stages)
                       if stages[s] != best.stages[s] or st_modes[s] != best.recompute[s]}
            if not all(model.ranks_fit(lay, stages, costs=costs, only=sorted(changed))):
                continue  # the other ranks fit already (the current split does): evaluate would find it too big
            if model.closed_form_floor(lay, costs) >= beat:
                continue  # with rank 0's wait and the slowest optimizer step after its pipeline, no faster either
            pred = model.evaluate(lay, stages, st_modes, costs=costs)
            if pred.fits and pred.iteration_time_s < beat:
                best = Partition(stages, st_modes, pred, best.ilp_status, best.ilp_objective)
                improved = True
                break
    return best


def _oom_message(model: CostModel, lay: Layout, modes: tuple[str, ...], status: str) -> str:
    """How far the least-memory split is from fitting (priced with full recomputation, balanced)."""
    from .costmodel import default_stages

    least = "full" if "full" in modes else modes[0]
    pred = model.evaluate(lay.replace(recompute=least), default_stages(model, lay.replace(recompute=least)))
    if pred.oom_by_gib > 0:
        return f"out of memory by {pred.oom_by_gib:.1f} GiB ({pred.peak_memory_gib:.1f} of {pred.limit_text()})"
    return f"no stage split fits in memory (ILP {status.lower()})"

"""Event simulation of one pipeline iteration as a task graph (networkx).

Tasks are the schedule's ops (forward F, backward B, and in zero-bubble schedules the deferred
weight-gradient W) of every stage and micro-batch. Edges: the data dependencies (F of stage s after F
of s-1; B of s after B of s+1, the last stage's B after its F; W after B), plus each rank running its
ops in the schedule's order. A task starts when its predecessors finish; the makespan, each
rank's busy intervals and its activation memory's peak come out. Uneven stages and per-stage
differences that closed forms cannot express are handled exactly. Point-to-point transfers are
charged to the sending stage's task durations (blocking sends, as Megatron's schedules issue them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from .schedules import rank_order_arrays, rank_orders

if TYPE_CHECKING:  # the task graph is built only to check the direct walk against it (tests)
    import networkx as nx


@dataclass
class TimelineEntry:
    rank: int
    kind: str
    stage: int
    micro_batch: int
    start: float
    end: float


@dataclass
class SimResult:
    makespan: float
    rank_finish: list[float]  # when each pipeline rank ends its last task
    timeline: list[TimelineEntry] = field(default_factory=list)
    peak_activation_bytes: list[float] = field(default_factory=list)  # per rank
    peak_unfolded_bytes: list[float] = field(default_factory=list)  # per rank: 16-bit gradients held then (zb-v)


def build_graph(schedule: str, pp: int, v: int, m: int, t_f: list[float], t_b: list[float],
                t_w: list[float]) -> nx.DiGraph:
    """The iteration's task DAG. Non-zero-bubble schedules run B as the full backward (B + W)."""
    import networkx as nx

    split = schedule == "zb-v"
    n_stages = pp * v
    g = nx.DiGraph()
    orders = rank_orders(schedule, pp, v, m)
    for r, order in enumerate(orders):
        prev = None
        for op in order:
            kind, s, i = op
            dur = t_f[s] if kind == "F" else (t_b[s] if split else t_b[s] + t_w[s]) if kind == "B" else t_w[s]
            g.add_node(op, rank=r, duration=dur)
            if prev is not None:
                g.add_edge(prev, op)
            prev = op
    for order in orders:
        for kind, s, i in order:
            if kind == "F" and s > 0:
                g.add_edge(("F", s - 1, i), ("F", s, i))
            elif kind == "B":
                g.add_edge(("B", s + 1, i) if s < n_stages - 1 else ("F", s, i), ("B", s, i))
            elif kind == "W":
                g.add_edge(("B", s, i), ("W", s, i))
    return g


def simulate_pipeline(schedule: str, pp: int, v: int, m: int, t_f: list[float], t_b: list[float],
                      t_w: list[float], act_bytes: list[float] | None = None,
                      keep_timeline: bool = False, dw_pending: list[float] | None = None,
                      unfolded: list[float] | None = None) -> SimResult:
    """Run the task graph: every task starts when its data dependency and its rank's previous task end.

    Walks the ranks' orders directly (each task once, in the form :func:`_walk_orders` caches) instead of sorting the
    networkx graph, which :func:`build_graph` builds for inspection; the two give the same times (tests).
    ``act_bytes`` (and in zb-v ``dw_pending`` and ``unfolded``) per stage: the ranks' activation peaks too
    (_peak_activations).
    """
    split = schedule == "zb-v"
    walks = _walk_orders(schedule, pp, v, m).tasks
    n = pp * v
    # Finish times in one flat list: forwards at stage·m + micro-batch, backwards after them, one slot for the
    # weight gradients (nothing waits on one but its own rank's next task), and last a 0.0 that the tasks waiting
    # for nothing read (index -1); -1: not run yet. The planner runs this for thousands of layouts, so no per-task
    # tuples or dicts on the hot path: a rank's tasks are three lists (each one's duration's index in ``durations``,
    # the slot it waits for, its own slot).
    done = [-1.0] * (2 * n * m + 2)
    done[-1] = 0.0
    durations = [*t_f, *(t_b if split else [b + w for b, w in zip(t_b, t_w, strict=True)]), *t_w]  # non-zb: B whole
    begins = [[0.0] * len(w[0]) for w in walks]  # each task's start, per rank
    ptr, clock = [0] * pp, [0.0] * pp
    remaining = sum(len(w[0]) for w in walks)
    while remaining:
        progressed = False
        for r in range(pp):
            (which, waits, slots), k, now = walks[r], ptr[r], clock[r]
            first, end, starts = k, len(which), begins[r]
            while k < end:
                ready = done[waits[k]]
                if ready < 0:
                    break
                if ready > now:
                    now = ready
                starts[k] = now  # for the timeline
                now += durations[which[k]]
                done[slots[k]] = now
                k += 1
            if k > first:
                remaining -= k - first
                ptr[r], clock[r] = k, now
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (p={pp}, v={v}, m={m})"
    result = SimResult(makespan=max(clock), rank_finish=list(clock))
    if keep_timeline:
        orders = rank_orders(schedule, pp, v, m)
        result.timeline = [TimelineEntry(r, op[0], op[1], op[2], start, start + durations[d])
                           for r in range(pp) for op, start, d in zip(orders[r], begins[r], walks[r][0], strict=True)]
    if act_bytes is not None:
        result.peak_activation_bytes, result.peak_unfolded_bytes = _peak_activations(schedule, pp, v, m, act_bytes,
                                                                                     dw_pending, unfolded)
    return result


def _peak_activations(schedule: str, pp: int, v: int, m: int, act_bytes: list[float],
                      dw_pending: list[float] | None = None,
                      unfolded: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Per rank, the peak of the activation bytes it keeps as it runs its tasks: a forward's start allocates its
    stage's ``act_bytes``, the task that frees them (W in zero-bubble schedules, else B) releases them at its end.
    A rank runs its tasks one after another, so its level is the running sum over its own order, whatever the
    tasks' times (a release at the instant of an allocation comes first: the forward reuses what the backward
    released); summed one task after another, as a walk would. In zb-v, per stage: ``dw_pending``, what its input
    backward (B) keeps until its weight backward (W) frees it with the activations (StageCost.dw_pending);
    ``unfolded``, the 16-bit gradients a W leaves until the stage's next B folds them (memory.StateBytes.unfolded).
    Returns per rank, at its peak, the activations (with what B keeps) and the unfolded gradients apart.
    """
    import numpy as np

    walk = _walk_orders(schedule, pp, v, m)
    if not walk.stages.size:
        return [0.0] * pp, [0.0] * pp
    moved = walk.signs * np.asarray(act_bytes, dtype=float)[walk.stages]  # (pp, ops): x + -a is x - a
    zero_bubble = schedule == "zb-v"
    if dw_pending is not None and zero_bubble:
        kinds = walk.kinds
        pending = np.asarray(dw_pending, dtype=float)[walk.stages]  # (pp, ops)
        moved = moved + np.where(kinds == 1, pending, np.where(kinds == 2, -pending, 0.0))
    grads = np.zeros_like(moved)
    if unfolded is not None and zero_bubble:
        grads = np.cumsum(walk.unfolding * np.asarray(unfolded, dtype=float)[walk.stages], axis=1)  # (pp, ops)
    level = np.cumsum(moved, axis=1) + grads
    at = level.argmax(axis=1)  # (pp,)
    rows = np.arange(len(at))
    peak, folded_out = np.maximum(level[rows, at], 0.0), grads[rows, at]  # (pp,) each
    return (peak - folded_out).tolist(), folded_out.tolist()


class _Walk(NamedTuple):
    """A schedule shape's rank orders in the forms the simulation reads (_walk_orders). Shared: read-only."""

    tasks: tuple[tuple[list[int], list[int], list[int]], ...]  # per rank: durations' indices, waits, own slots
    signs: Any  # (pp, ops): +1 a forward (it allocates its stage's activations), -1 the task that frees them, else 0
    stages: Any  # (pp, ops): each task's stage
    kinds: Any  # (pp, ops): each task's kind, 0 F, 1 B, 2 W
    unfolding: Any  # (pp, ops): zb-v, +1 a W leaving its stage's 16-bit gradients unfolded, -1 a B folding them


@lru_cache(maxsize=64)
def _walk_orders(schedule: str, pp: int, v: int, m: int) -> _Walk:
    """rank_orders as simulate_pipeline walks them: per rank, of its tasks in order, (their durations' indices:
    stage for F, pp·v + stage for B, 2·pp·v + stage for W; the slots of the tasks they wait for, -1 for none; their
    own slots) in simulate_pipeline's flat list of finish times; and for the activation peak each task's sign (the
    freeing task is W in zero-bubble schedules, else B) and stage, every rank running as many tasks (v·m of each
    kind)."""
    import numpy as np

    n = pp * v * m
    last = pp * v - 1
    orders = rank_order_arrays(schedule, pp, v, m)
    tasks = []
    for kind, s, i in orders:  # each (ops,)
        own = s * m + i  # a forward's slot; a backward's is n after
        fwd, bwd = kind == 0, kind == 1
        # F after the stage before's F; B after the next stage's B (the last stage's after its own F); W after its B
        after = np.where(fwd, np.where(s > 0, own - m, -1),
                         np.where(bwd, np.where(s < last, n + own + m, own), n + own))
        slot = np.where(fwd, own, np.where(bwd, n + own, 2 * n))  # every W in one slot: nothing waits on one
        tasks.append(((kind * (last + 1) + s).tolist(), after.tolist(), slot.tolist()))
    kinds = np.array([kind for kind, _, _ in orders])
    frees = 2 if schedule == "zb-v" else 1
    stages = np.array([stage for _, stage, _ in orders])
    unfolding = np.zeros(kinds.shape)
    if schedule == "zb-v":
        for r in range(kinds.shape[0]):
            held: set[int] = set()  # stages whose last backward task was a W
            for j, (kind, s) in enumerate(zip(kinds[r].tolist(), stages[r].tolist(), strict=True)):
                if kind == 2 and s not in held:
                    held.add(s)
                    unfolding[r, j] = 1.0
                elif kind == 1 and s in held:
                    held.discard(s)
                    unfolding[r, j] = -1.0
    return _Walk(tuple(tasks), np.where(kinds == 0, 1.0, np.where(kinds == frees, -1.0, 0.0)), stages, kinds,
                 unfolding)


def graph_makespan(g: nx.DiGraph) -> float:
    """Longest path through the task graph (task durations on the nodes)."""
    import networkx as nx

    finish: dict = {}
    for node in nx.topological_sort(g):
        start = max((finish[p] for p in g.predecessors(node)), default=0.0)
        finish[node] = start + g.nodes[node]["duration"]
    return max(finish.values())

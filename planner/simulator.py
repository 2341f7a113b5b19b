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
from typing import TYPE_CHECKING

from .schedules import rank_order_arrays, rank_orders, stage_rank

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
                      keep_timeline: bool = False) -> SimResult:
    """Run the task graph: every task starts when its data dependency and its rank's previous task end.

    Walks the ranks' orders directly (each task once, in the form :func:`_walk_orders` caches) instead of sorting the
    networkx graph, which :func:`build_graph` builds for inspection; the two give the same times (tests).
    """
    split = schedule == "zb-v"
    walks = _walk_orders(schedule, pp, v, m)
    # Finish times in one flat list: forwards at stage·m + micro-batch, backwards after them, one slot for the
    # weight gradients (nothing waits on one but its own rank's next task); -1: not run yet. The planner runs this
    # for thousands of layouts, so no per-task tuples or dicts on the hot path.
    done = [-1.0] * (2 * pp * v * m + 1)
    durations = (t_f, t_b if split else [b + w for b, w in zip(t_b, t_w, strict=True)], t_w)  # non-zb: B is whole
    starts: dict[tuple[str, int, int], float] = {}  # only for the timeline
    finish: dict[tuple[str, int, int], float] = {}
    # Activation memory, kept as the ranks run: a rank runs its tasks one after another, so the events
    # (a forward's start allocates, the freeing task's end releases) come in time order, and at one instant a
    # release (a task that ends) comes before an allocation (the next task that starts then): the forward
    # reuses what the backward released, so the two never count at once.
    frees = 2 if split else 1  # W, else B
    memory = act_bytes is not None
    level, peak = [0.0] * pp, [0.0] * pp
    ptr, clock = [0] * pp, [0.0] * pp
    orders = rank_orders(schedule, pp, v, m) if keep_timeline else None
    remaining = sum(len(w) for w in walks)
    while remaining:
        progressed = False
        for r in range(pp):
            walk, k, now = walks[r], ptr[r], clock[r]
            held, top = level[r], peak[r]
            while k < len(walk):
                kind, s, after, slot = walk[k]
                ready = done[after] if after >= 0 else 0.0
                if ready < 0:
                    break
                begin = now if now > ready else ready
                now = begin + durations[kind][s]
                done[slot] = now
                if memory:
                    if kind == 0:
                        held += act_bytes[s]
                        if held > top:
                            top = held
                    elif kind == frees:
                        held -= act_bytes[s]
                if keep_timeline:
                    starts[orders[r][k]], finish[orders[r][k]] = begin, now
                k += 1
            if k > ptr[r]:
                remaining -= k - ptr[r]
                ptr[r], clock[r], level[r], peak[r] = k, now, held, top
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (p={pp}, v={v}, m={m})"
    result = SimResult(makespan=max(clock), rank_finish=list(clock))
    if keep_timeline:
        result.timeline = sorted((TimelineEntry(stage_rank(schedule, op[1], pp), op[0], op[1], op[2], starts[op],
                                                finish[op]) for op in starts), key=lambda e: (e.rank, e.start))
    if memory:
        result.peak_activation_bytes = peak
    return result


@lru_cache(maxsize=64)
def _walk_orders(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """rank_orders as simulate_pipeline walks them: per task (kind: 0 F, 1 B, 2 W; its stage; the slot of the task
    it waits for, -1 for none; its own slot) in simulate_pipeline's flat list of finish times. Shared: read-only."""
    import numpy as np

    n = pp * v * m
    last = pp * v - 1
    out = []
    for kind, s, i in rank_order_arrays(schedule, pp, v, m):  # each (ops,)
        own = s * m + i  # a forward's slot; a backward's is n after
        fwd, bwd = kind == 0, kind == 1
        # F after the stage before's F; B after the next stage's B (the last stage's after its own F); W after its B
        after = np.where(fwd, np.where(s > 0, own - m, -1),
                         np.where(bwd, np.where(s < last, n + own + m, own), n + own))
        slot = np.where(fwd, own, np.where(bwd, n + own, 2 * n))  # every W in one slot: nothing waits on one
        out.append(tuple(zip(kind.tolist(), s.tolist(), after.tolist(), slot.tolist(), strict=True)))
    return tuple(out)


def graph_makespan(g: nx.DiGraph) -> float:
    """Longest path through the task graph (task durations on the nodes)."""
    import networkx as nx

    finish: dict = {}
    for node in nx.topological_sort(g):
        start = max((finish[p] for p in g.predecessors(node)), default=0.0)
        finish[node] = start + g.nodes[node]["duration"]
    return max(finish.values())

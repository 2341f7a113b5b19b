"""Event simulation of one pipeline iteration as a task graph (networkx).

Tasks are the schedule's ops (forward F, backward B, and in zero-bubble schedules the deferred
weight-gradient W) of every stage and micro-batch. Edges: the data dependencies (F of stage s after F
of s-1; B of s after B of s+1, the last stage's B after its F; W after B), plus each rank running its
ops in the schedule's order. A task starts when its predecessors finish; the makespan and each
rank's busy intervals and activation memory over time come out. Uneven stages and per-stage
differences that closed forms cannot express are handled exactly. Point-to-point transfers are
charged to the sending stage's task durations (blocking sends, as Megatron's schedules issue them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from .schedules import rank_orders, stage_rank


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
    memory_curve: list[list[tuple[float, float]]] = field(default_factory=list)  # per rank: (time, bytes)


def build_graph(schedule: str, pp: int, v: int, m: int, t_f: list[float], t_b: list[float],
                t_w: list[float]) -> nx.DiGraph:
    """The iteration's task DAG. Non-zero-bubble schedules run B as the full backward (B + W)."""
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


def _dependency(op: tuple[str, int, int], n_stages: int) -> tuple[str, int, int] | None:
    kind, s, i = op
    if kind == "F":
        return ("F", s - 1, i) if s > 0 else None
    if kind == "B":
        return ("B", s + 1, i) if s < n_stages - 1 else ("F", s, i)
    return ("B", s, i)


def simulate_pipeline(schedule: str, pp: int, v: int, m: int, t_f: list[float], t_b: list[float],
                      t_w: list[float], act_bytes: list[float] | None = None,
                      keep_timeline: bool = False) -> SimResult:
    """Run the task graph: every task starts when its data dependency and its rank's previous task end.

    Walks the ranks' orders directly (each task once) instead of sorting the networkx graph, which
    :func:`build_graph` builds for inspection; the two give the same times (tests).
    """
    split = schedule == "zb-v"
    n_stages = pp * v
    orders = rank_orders(schedule, pp, v, m)
    finish: dict[tuple[str, int, int], float] = {}
    starts: dict[tuple[str, int, int], float] = {}
    ptr, clock = [0] * pp, [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            while ptr[r] < len(order):
                op = order[ptr[r]]
                dep = _dependency(op, n_stages)
                if dep is not None and dep not in finish:
                    break
                kind, s, _ = op
                dur = t_f[s] if kind == "F" else t_w[s] if kind == "W" else t_b[s] + (0.0 if split else t_w[s])
                start = max(clock[r], finish[dep]) if dep is not None else clock[r]
                starts[op], finish[op] = start, start + dur
                clock[r] = start + dur
                ptr[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (p={pp}, v={v}, m={m})"
    result = SimResult(makespan=max(clock), rank_finish=list(clock))
    if keep_timeline:
        result.timeline = sorted((TimelineEntry(stage_rank(schedule, op[1], pp), op[0], op[1], op[2], starts[op],
                                                finish[op]) for op in starts), key=lambda e: (e.rank, e.start))
    if act_bytes is not None:
        frees = "W" if split else "B"
        events: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
        for (kind, s, i), start in starts.items():
            r = stage_rank(schedule, s, pp)
            if kind == "F":
                events[r].append((start, act_bytes[s]))
            elif kind == frees:
                events[r].append((finish[(kind, s, i)], -act_bytes[s]))
        for r in range(pp):
            level, peak, curve = 0.0, 0.0, []
            for t, delta in sorted(events[r], key=lambda e: (e[0], e[1] < 0)):
                level += delta
                peak = max(peak, level)
                curve.append((t, level))
            result.peak_activation_bytes.append(peak)
            result.memory_curve.append(curve)
    return result


def graph_makespan(g: nx.DiGraph) -> float:
    """Longest path through the task graph (task durations on the nodes)."""
    finish: dict = {}
    for node in nx.topological_sort(g):
        start = max((finish[p] for p in g.predecessors(node)), default=0.0)
        finish[node] = start + g.nodes[node]["duration"]
    return max(finish.values())

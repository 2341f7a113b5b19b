"""Throughput against GPU count for the report: the best plan searched again at smaller GPU counts.

The re-plans are independent of the report's other charts, so they run in forked processes, one per
count, while the parent draws. Each child inherits the search's cost model, with its cached per-block
costs, through the fork and sends back only its count's best candidate (benchmarks/bench_plan.py
measures the whole command). Where fork is unavailable, on one core, or if a child fails, the re-plans
run in line: the answer is the same either way.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .search import Candidate, SearchResult, search

# The finished search the forked child re-plans from: inherited through fork, never pickled.
_PARENT: SearchResult | None = None


@dataclass
class ScalingPoint:
    gpus: int
    best: Candidate | None


def scaling_counts(gpus: int, per_node: int) -> list[int]:
    """``gpus`` and up to three halvings of it (down to an eighth of a node), smallest first."""
    counts = [gpus]
    g = gpus
    while len(counts) < 4 and g % 2 == 0 and g // 2 >= max(1, per_node // 8):
        g //= 2
        counts.append(g)
    return sorted(counts)


def _replan(result: SearchResult, counts: list[int]) -> dict[int, Candidate | None]:
    return {g: search(result.work, g, top_k=1, dtype=result.dtype, model=result.model).best for g in counts}


def _child(conn, counts: list[int]) -> None:
    """Forked worker: re-plan from the inherited search and send {gpus: best}. On any failure it sends
    nothing and prints nothing: the parent then re-plans in line and reports an error itself, once."""
    try:
        assert _PARENT is not None
        conn.send_bytes(pickle.dumps(_replan(_PARENT, counts)))
    except BaseException:  # interrupts too: the parent sees the closed pipe
        pass
    finally:
        conn.close()


def start_scaling(result: SearchResult) -> Callable[[], list[ScalingPoint]]:
    """Start re-planning ``result``'s workload at the scaling counts; returns the call that waits for
    the points (``result.gpus`` itself included, from ``result``)."""
    global _PARENT
    counts = scaling_counts(result.gpus, result.work.cluster.gpus_per_node)
    others = [g for g in counts if g != result.gpus]

    def points(found: dict[int, Candidate | None]) -> list[ScalingPoint]:
        return [ScalingPoint(g, result.best if g == result.gpus else found[g]) for g in counts]

    if not others:
        return lambda: points({})
    if (os.cpu_count() or 1) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        found = _replan(result, others)
        return lambda: points(found)
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush()  # a child flushes its copy of the buffers when it ends: nothing may be in them twice
    sys.stderr.flush()
    # one child per count: a search alternates single-threaded pricing with CBC processes, so several
    # side by side keep both cores busy where one leaves one idle half the time
    jobs = []
    _PARENT = result
    try:
        for g in others:
            receive, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_child, args=(send, [g]), daemon=True)
            child.start()
            send.close()
            jobs.append((g, receive, child))
    finally:
        _PARENT = None

    def wait() -> list[ScalingPoint]:
        found: dict[int, Candidate | None] = {}
        for g, receive, child in jobs:
            try:
                # our own child's pickle of our own dataclasses, over a private pipe (nothing a user handed us)
                found.update(pickle.loads(receive.recv_bytes()))
            except (EOFError, OSError):  # the child died: re-plan here
                found.update(_replan(result, [g]))
            finally:
                receive.close()
                child.join()
        return points(found)

    return wait


__all__ = ["ScalingPoint", "scaling_counts", "start_scaling"]

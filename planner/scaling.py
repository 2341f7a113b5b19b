"""Throughput against GPU count for the report: the best plan searched again at smaller GPU counts.

The re-plans do not depend on the main search, so they start before it, in forked processes at the lowest CPU
priority: they run on what the main search leaves idle (its pricing is single-threaded, its ILPs come in bursts)
and on what the drawing of the report leaves, and never delay either. There are as many children as the machine
has cores beside the main search's (one on two cores); each re-plans its counts one after another, smallest
first, with one cost model (the block costs of one count serve the next), and sends each count's best candidate
as soon as it has it, so a re-plan cut short by the report's deadline still gives the counts it finished. Where
fork is unavailable, on one core, or if a child fails, the re-plans run in line, in the parent: the answer is
the same either way. benchmarks/bench_plan.py measures the whole command.

A count whose re-plan was cut short gets a stand-in instead: the chosen plan's layout at that count by its data
parallelism alone (its stage split and recomputation kept), priced exactly — a large model's re-plans can take longer
than the search (DeepSeek-V3 at 256 GPUs searches ~20 s), and a scaling chart of one point says nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import time
from dataclasses import dataclass

from .costmodel import CostModel, validate_layout
from .errors import InvalidLayout
from .search import Candidate, search
from .workload import Workload

# What a forked child re-plans: inherited through fork, never pickled.
_JOB: tuple[Workload, str, CostModel] | None = None


@dataclass
class ScalingPoint:
    gpus: int
    best: Candidate | None
    cut_short: str = ""  # why this count has no answer although plans may fit (its re-plan ran out of time)
    stand_in: Candidate | None = None  # where cut short: the chosen layout at this count by dp alone (same_shape)

    @property
    def shown(self) -> Candidate | None:
        """What the chart draws at this count: the re-plan's best, else a stand-in that fits."""
        if self.best is not None:
            return self.best
        return self.stand_in if self.stand_in is not None and self.stand_in.prediction.fits else None


def scaling_counts(gpus: int, per_node: int) -> list[int]:
    """``gpus`` and up to three halvings of it (down to an eighth of a node), smallest first."""
    counts = [gpus]
    g = gpus
    while len(counts) < 4 and g % 2 == 0 and g // 2 >= max(1, per_node // 8):
        g //= 2
        counts.append(g)
    return sorted(counts)


def same_shape(model: CostModel, chosen: Candidate, gpus: int) -> Candidate | None:
    """``chosen``'s layout on ``gpus`` GPUs by its data parallelism alone — tensor, pipeline, context and expert
    parallelism, micro-batch, schedule, ZeRO, stage split and recomputation kept; the gradient accumulation grows as
    dp shrinks — priced exactly (status "oom" where it no longer fits). None where dp cannot take the count or the
    layout is then invalid (ep no longer divides its ranks, ...)."""
    from .api import EVENT_SIM_MAX_TASKS, event_sim_tasks

    lay = chosen.layout
    others = lay.num_gpus // lay.dp
    if gpus % others or chosen.stages is None:
        return None
    lay = lay.replace(dp=gpus // others)
    try:
        validate_layout(model, lay)
    except InvalidLayout:
        return None
    simulated = event_sim_tasks(lay) <= EVENT_SIM_MAX_TASKS  # as refine.py prices the chosen plan
    pred = model.evaluate(lay, chosen.stages, chosen.stage_recompute, simulate=simulated)
    return Candidate(lay, "ok" if pred.fits else "oom", prediction=pred, stages=chosen.stages,
                     stage_recompute=chosen.stage_recompute)


def _replan(work: Workload, dtype: str, model: CostModel, gpus: int) -> Candidate | None:
    return search(work, gpus, top_k=1, dtype=dtype, model=model).best


def _child(conn, counts: list[int]) -> None:
    """Forked worker: re-plan at each of ``counts`` in turn, at the lowest priority, sending (count, best candidate)
    for each as it is found. On any failure it stops sending and prints nothing: the parent re-plans the rest in
    line and reports any error once."""
    try:
        assert _JOB is not None
        os.nice(19)
        for gpus in counts:
            conn.send_bytes(pickle.dumps((gpus, _replan(*_JOB, gpus))))
    except BaseException:  # interrupts too: the parent sees the closed pipe
        pass
    finally:
        conn.close()


def _shares(counts: list[int], workers: int) -> list[list[int]]:
    """``counts`` dealt over ``workers`` children, each share smallest first (round robin: similar work each)."""
    return [share for share in (counts[i::workers] for i in range(workers)) if share]


class ScalingReplans:
    """The re-plans at the scaling counts below ``gpus``, started in the background at construction."""

    def __init__(self, work: Workload, gpus: int, dtype: str, model: CostModel):
        global _JOB
        self.work, self.gpus, self.dtype, self.model = work, gpus, dtype, model
        self.counts = scaling_counts(gpus, work.cluster.gpus_per_node)
        self._started = time.monotonic()
        self._jobs: list[tuple[list[int], object, object]] = []
        others = [g for g in self.counts if g != gpus]
        cores = os.cpu_count() or 1
        if not others or cores < 2 or "fork" not in multiprocessing.get_all_start_methods():
            return  # points() re-plans in line
        ctx = multiprocessing.get_context("fork")
        sys.stdout.flush()  # a child flushes its copy of the buffers when it ends: nothing may be in them twice
        sys.stderr.flush()
        _JOB = (work, dtype, model)
        try:
            for share in _shares(others, cores - 1):
                receive, send = ctx.Pipe(duplex=False)
                child = ctx.Process(target=_child, args=(send, share), daemon=True)
                child.start()
                send.close()
                self._jobs.append((share, receive, child))
        finally:
            _JOB = None

    def points(self, best: Candidate | None, wait_s: float | None = None) -> list[ScalingPoint]:
        """Every count's point, ``best`` (the main search's) at ``gpus``; waits for the children, at most
        ``wait_s`` seconds from their start when given: a re-plan still running then is stopped and its
        point says so (the chart is a side view; it never holds up the plan for long)."""
        found: dict[int, Candidate | None] = {}
        late: dict[int, str] = {}
        for share, receive, child in self._jobs:
            try:
                for _ in share:
                    left = None if wait_s is None else max(0.0, self._started + wait_s - time.monotonic())
                    if left is not None and not receive.poll(left):
                        child.kill()
                        late.update({g: f"re-plan stopped after {wait_s:.0f} s" for g in share if g not in found})
                        break
                    # our own child's pickle of our own dataclass, over a private pipe (nothing a user handed us)
                    g, cand = pickle.loads(receive.recv_bytes())
                    found[g] = cand
            except (EOFError, OSError):  # the child died: the counts it did not send are re-planned here
                pass
            finally:
                receive.close()
                child.join()
        self._jobs = []
        for g in self.counts:  # no child, or one died: re-planned here, smallest first, while the time lasts
            if g != self.gpus and g not in found and g not in late:
                if wait_s is not None and time.monotonic() >= self._started + wait_s:
                    late[g] = f"re-plan stopped after {wait_s:.0f} s"
                else:
                    found[g] = _replan(self.work, self.dtype, self.model, g)
        return [ScalingPoint(g, best if g == self.gpus else found.get(g), late.get(g, ""),
                             same_shape(self.model, best, g) if g in late and best is not None else None)
                for g in self.counts]

    def cancel(self) -> None:
        """Stop the children (the main search failed: no report will need them)."""
        for _, receive, child in self._jobs:
            child.kill()
            child.join()
            receive.close()
        self._jobs = []


__all__ = ["ScalingPoint", "ScalingReplans", "same_shape", "scaling_counts"]

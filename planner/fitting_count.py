"""Where nothing fits: the fewest GPUs (whole nodes) at which some layout does, found by searching larger counts.

A linear hint ("the least layout needs 1.3x the GPU's memory: try 1.3x the GPUs") chases itself: a count's layouts
depend on what divides it, and what no GPU count shrinks (the framework allowance, the head's logits, a stage's
embedding) stays. Found by a QA pass: llama3-405b, batch 8, on 8 H100s said "about 60 GPUs"; on 60 "about 61"; on 64
"about 66"; on 72 and 80 nothing fitted either. So the hint is searched: the same search as ``plan`` (closed-form
prices, top 1) on the same cluster grown to each count, smallest first, until one fits or the time is spent.
"""

from __future__ import annotations

import dataclasses
import math
import time

from paraplan.hardware_specs import HardwareSpecError

from .costmodel import CostModel
from .errors import PlanError
from .search import Candidate, search
from .workload import Workload

# growth factors over the GPU count tried (each rounded up to a count the cluster's nodes allow), smallest first
FACTORS = (1.5, 2, 3, 4, 6, 8, 12, 16)
MOST_GPUS = 16384  # no count above this is searched: a search grows with the count (the 1T GPT on 3072: ~3 s)


def counts_to_try(gpus: int, per_node: int, estimate: int) -> list[int]:
    """Larger GPU counts worth a search, smallest first: ``estimate`` (the linear hint) and ``gpus`` grown by
    FACTORS, each rounded up to a power of two within one node or to whole nodes beyond it, MOST_GPUS at most."""

    def allowed(x: float) -> int:
        if x <= per_node:
            return min(per_node, 1 << max(0, math.ceil(math.log2(x))))
        return per_node * math.ceil(x / per_node)

    return sorted(g for g in {allowed(x) for x in (estimate, *(gpus * f for f in FACTORS))} if gpus < g <= MOST_GPUS)


def smallest_fitting_count(work: Workload, gpus: int, estimate: int, dtype: str | None,
                           allowed_modes: tuple[str, ...] | None, budget_s: float = 20.0
                           ) -> tuple[int | None, Candidate | None, list[int]]:
    """(the smallest count of :func:`counts_to_try` at which a layout fits, its best layout, the counts searched). A
    count's search starts only while less than ``budget_s`` seconds have passed; a cluster that cannot grow (one node
    without a network) searches nothing."""
    t0 = time.monotonic()
    per_node = work.cluster.gpus_per_node
    searched: list[int] = []
    for count in counts_to_try(gpus, per_node, estimate):
        if time.monotonic() - t0 > budget_s:
            break
        nodes = max(work.cluster.nodes, -(-count // per_node))
        try:
            cluster = work.cluster.with_nodes(nodes)
        except HardwareSpecError:
            break
        # the same model and GPUs (the profiles computed already serve), more of them
        grown = dataclasses.replace(work, cluster=cluster, _profiles=work._profiles, _measurements=work._measurements,
                                    _tp_calls=work._tp_calls, notes=[])
        try:
            result = search(grown, count, top_k=1, dtype=dtype, model=CostModel(grown), allowed_modes=allowed_modes)
        except PlanError:  # a count this workload cannot take: the next may
            continue
        searched.append(count)
        if result.best is not None:
            return count, result.best, searched
    return None, None, searched

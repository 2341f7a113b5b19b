"""The plans a reader sees are priced as their schedule runs: by the event simulation.

The search ranks thousands of layouts with the closed-form pipeline makespan (schedules.py), which
prices a schedule's warm-up and cool-down on uniform stages. For the few plans it reports, the event
simulator (simulator.py) runs each schedule's own order on the plan's real stage times; that is the
figure `paraplan simulate` prints for the same layout and the figure the timeline chart draws. So the
ranked plans are re-priced by it (and re-ranked), and the table, the report, the JSON and the charts
all show one number (issue 13: a zero-bubble plan's chart said 28.4 s and bubble 0.0% beside the
report's 28.51 s and 0.3%, the closed form's uniform-stage bubble).

Re-pricing can move a plan down: the demo's two interleaved 4-chunk layouts, 33.9 s by the closed form, simulate at
37.5 s, behind layouts the search priced at 33.95-34.3 s that the top five had left out. So the search's other
priced layouts come in, fastest first by their closed form, each re-priced the same way, until the next one's closed
form cannot beat the k-th simulated time. (The stop assumes a plan's simulation is not faster than its closed form:
the simulation runs the real stage times where the closed form takes them uniform.)
"""

from __future__ import annotations

from .api import EVENT_SIM_MAX_TASKS, event_sim_tasks  # beyond it (as in `simulate`) the closed form stands
from .costmodel import CostModel
from .gc_pause import without_gc_pauses
from .search import SearchResult, ranked


@without_gc_pauses
def simulate_ranked(result: SearchResult, model: CostModel | None = None) -> None:
    """Re-price ``result.ranked`` with the event simulation, in place, and re-rank; a plan whose simulated
    memory no longer fits leaves the ranking (status ``oom``, reason given)."""
    if not result.ranked:
        return
    model = model or result.model or CostModel(result.work)
    k = len(result.ranked)
    shown = {id(c) for c in result.ranked}
    waiting = sorted((c for c in result.candidates if c.status == "ok" and id(c) not in shown), key=lambda c: c.time_s)
    kept: list = []
    for cand in result.ranked:
        _simulate(model, cand, kept)
    for cand in waiting:  # the next fastest by the closed form, while one may beat (or tie) the k-th simulated plan
        kept.sort(key=lambda c: c.time_s)
        if len(kept) >= k and cand.time_s > kept[k - 1].time_s:
            break
        _simulate(model, cand, kept)
    result.ranked[:] = ranked(kept)[:k]


def _simulate(model: CostModel, cand, kept: list) -> None:
    """``cand`` re-priced by the event simulation, into ``kept`` if it still fits (else status ``oom``, why)."""
    lay = cand.layout
    if event_sim_tasks(lay) <= EVENT_SIM_MAX_TASKS:
        cand.prediction = model.evaluate(lay, cand.stages, cand.stage_recompute, simulate=True)
    if cand.prediction.fits:
        kept.append(cand)
    else:
        cand.status = "oom"
        cand.reason = (f"the event simulation's peak is {cand.prediction.peak_memory_gib:.1f} of "
                       f"{cand.prediction.memory_capacity_gib:g} GiB")

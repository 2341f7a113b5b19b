"""The plans a reader sees are priced as their schedule runs: by the event simulation.

The search ranks thousands of layouts with the closed-form pipeline makespan (schedules.py), which
prices a schedule's warm-up and cool-down on uniform stages. For the few plans it reports, the event
simulator (simulator.py) runs each schedule's own order on the plan's real stage times; that is the
figure `paraplan simulate` prints for the same layout and the figure the timeline chart draws. So the
ranked plans are re-priced by it (and re-ranked), and the table, the report, the JSON and the charts
all show one number (issue 13: a zero-bubble plan's chart said 28.4 s and bubble 0.0% beside the
report's 28.51 s and 0.3%, the closed form's uniform-stage bubble).

Re-pricing can move a plan down: the demo's two interleaved 4-chunk layouts, 33.9 s by the closed form, simulated at
37.5 s, behind layouts the search priced at 33.95-34.3 s that the top five had left out. (Their chunks of 2 and 3
layers leave the schedule's lock-step rounds unequal; the closed form now prices that, schedules.rounds_excess, and
puts their splits at 37.1-37.5 s: on the demo's 13 priced interleaved plans the simulation is now 0.6% under to 0.8%
over it.) So the search's other
priced layouts come in, fastest first by their closed form, each re-priced the same way, until the next one's closed
form cannot beat the k-th simulated time. (The simulation runs the real stage times where the closed form takes them
uniform, and it may also come out faster: the closed form charges every interleaved pipeline the uniform warm-up
bubble, (p-1)/v of a rank's time a micro-batch, which a less loaded rank partly absorbs. Measured with
benchmarks/interleaved_rounds.py over the priced interleaved plans of seven searches (llama2-70b on 64, 128 and 256
H100s and on 128 A100s, llama2-13b on 16, llama2-7b on 32, gpt3-175b on 256): mostly within 0.3%, the demo's
dp32 pp2 x8 0.6% below, and on 256 H100s dp128 pp2 x6/x8 1.0-2.0% below (m = 4 micro-batches; the bubble 0.19 s
simulated against 0.54 s). So the stop and the search again below allow SIMULATED_BELOW, 0.5%: without it the
demo's top five missed an interleaved ZeRO-3 plan whose
closed form was 0.02% above the fifth's simulated time and whose simulation beat it by 0.09%.)

The search pruned layouts on a bound against its k-th closed-form price; where the simulation raised the k-th time
above it, a layout pruned so may beat the plans shown (the demo's top five once left out one at 34.24 s, pruned on its
34.18 s bound against 34.02 s, and showed 34.58 s fifth: its top ten had it third). Those layouts are searched again
(the same search, on them alone) and their plans come in the same way, until no layout pruned below the k-th
simulated time is left unsearched.
"""

from __future__ import annotations

from .api import EVENT_SIM_MAX_TASKS, event_sim_tasks  # beyond it (as in `simulate`) the closed form stands
from .costmodel import CostModel
from .gc_pause import without_gc_pauses
from .search import SearchResult, ranked, search

# How much faster than its closed form a plan's simulation is let come out, as a fraction (above: up to 2.0% measured;
# at 2% the same top fives in three searches, but 4x the layouts searched again, 93 -> 361 on the demo): only
# plans of several chunks a rank (interleaved, ZB-V); one chunk a rank simulated at its closed form or above
SIMULATED_BELOW = 0.005


def _slack(lay) -> float:
    """The factor on the k-th simulated time under which a plan of ``lay`` may still beat it (SIMULATED_BELOW)."""
    return 1 + SIMULATED_BELOW if lay.virtual_stages > 1 else 1.0


@without_gc_pauses
def simulate_ranked(result: SearchResult, model: CostModel | None = None) -> None:
    """Re-price ``result.ranked`` with the event simulation, in place, and re-rank; a plan whose simulated
    memory no longer fits leaves the ranking (status ``oom``, reason given)."""
    if not result.ranked:
        return
    model = model or result.model or CostModel(result.work)
    k = result.top_k or len(result.ranked)
    shown = {id(c) for c in result.ranked}
    kept: list = []
    for cand in result.ranked:
        _simulate(model, cand, kept)
    waiting = [c for c in result.candidates if c.status == "ok" and id(c) not in shown]
    searched_again: set = set()
    while True:
        _admit(model, waiting, kept, k)
        bar = kept[k - 1].time_s if len(kept) >= k else float("inf")
        # each round prices k more layouts or leaves none pruned below the bar (which only falls): it ends
        again = [c for c in result.candidates if c.status == "pruned" and c.lower_bound_s < bar * _slack(c.layout)]
        if not again:
            break
        searched_again.update(c.layout for c in again)
        waiting = _search_again(result, model, again, k, bar * (1 + SIMULATED_BELOW))
    if searched_again:
        n = len(searched_again)
        result.notes.append(f"{n} layout{'s' if n > 1 else ''} pruned against the search's closed-form prices searched "
                            "again once the event simulation had re-priced the top plans")
    result.ranked[:] = ranked(kept)[:k]


def _admit(model: CostModel, waiting: list, kept: list, k: int) -> None:
    """The next fastest of ``waiting`` by the closed form, re-priced into ``kept``, while one may beat (or tie) the
    k-th simulated plan (its simulation up to SIMULATED_BELOW under its closed form)."""
    for cand in sorted(waiting, key=lambda c: c.time_s):
        kept.sort(key=lambda c: c.time_s)
        if len(kept) >= k and cand.time_s > kept[k - 1].time_s * _slack(cand.layout):
            if cand.time_s > kept[k - 1].time_s * (1 + SIMULATED_BELOW):
                break  # none after it may beat the k-th
            continue  # one chunk a rank: not below its closed form
        _simulate(model, cand, kept)
    kept.sort(key=lambda c: c.time_s)


def _search_again(result: SearchResult, model: CostModel, again: list, k: int, bar: float) -> list:
    """The layouts of ``again`` (pruned on a bound below ``bar``: the k-th simulated time, less what a simulation may
    gain on its closed form) searched again, alone, with the first search's options, for plans that beat ``bar``;
    their candidates take the old ones' places in ``result``.
    Returns those priced."""
    sub = search(result.work, result.gpus, top_k=k, dtype=result.dtype, layouts=[c.layout for c in again],
                 model=model, beat_s=bar if bar < float("inf") else None, **result.options)
    where = {id(c): i for i, c in enumerate(result.candidates)}
    for old, new in zip(again, sub.candidates, strict=True):
        result.candidates[where[id(old)]] = new
    result.ilp_solves += sub.ilp_solves
    result.search_time_s += sub.search_time_s
    result.notes.extend(n for n in sub.notes if "solver" in n and n not in result.notes)
    return [c for c in sub.candidates if c.status == "ok"]


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
                       f"{cand.prediction.limit_text()}")

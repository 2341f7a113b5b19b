"""How far the search's closed form is from the event simulation on interleaved plans, and what it misses.

The search prices thousands of layouts with the closed-form makespan of their schedule (schedules.py): for
interleaved 1F1B, m x the slowest rank's time per micro-batch plus the bubble, a rank's time the sum of its chunks.
The event simulation (simulator.py) runs the schedule's own order: its micro-batches go round the ranks chunk after
chunk in lock-step rounds, so a round of chunks of unequal time (80 layers over 32 chunks leave chunks of 2 and 3
layers) waits for its slowest chunk. The closed form adds that from a short simulation (schedules.rounds_excess;
before it, the ranks' sums alone were up to 26% under on the demo). refine.py re-prices the plans shown by the
simulation; every other priced row of candidates.csv keeps its closed form.

For every priced interleaved candidate this prints its closed form against its simulation, and the same layout
with a split the search does not try: the layers dealt so that every round of chunks holds equal counts (the
extra layers to whole rounds, the first rounds or the last ones), priced with the least recomputation that fits,
simulated as it is and after the search's polish (one layer or mode at a time, as its price leads it).
The same plan options as `paraplan plan` (default: its demo).
Run: .venv/bin/python benchmarks/interleaved_rounds.py [plan options]
"""

from __future__ import annotations

import statistics
import sys

from paraplan.cli import build_parser, user_error_types
from paraplan.commands.common import workload_from_args
from paraplan.commands.plan import DEFAULT
from paraplan.planner.costmodel import CostModel, least_recompute_prediction, stages_from_counts
from paraplan.planner.ilp import layout_modes, modes_for, polished_quick_split
from paraplan.planner.refine import simulate_ranked
from paraplan.planner.search import search


def round_counts(layers: int, pp: int, v: int, first_rounds: bool) -> list[int]:
    """Layers per chunk (chunk c on rank c mod pp, round c // pp), each round's chunks equal where the layers allow:
    layers // (pp·v) each, the rest one more to whole rounds, the first or the last rounds first (a partial round
    only for what is left)."""
    base, extra = divmod(layers, pp * v)
    counts = [base] * (pp * v)
    for j in (range(v) if first_rounds else range(v - 1, -1, -1)):
        take = min(extra, pp)
        for r in range(take):
            counts[j * pp + r] += 1
        extra -= take
    return counts


def main() -> int:
    args = build_parser().parse_args(["plan", *sys.argv[1:]])
    for field in ("model", "cluster", "global_batch"):
        if getattr(args, field) is None:
            setattr(args, field, DEFAULT[field])
    try:
        report(args)
    except user_error_types() as e:  # a bad model, cluster or option: one line, as `paraplan plan` says it
        sys.stderr.write(f"interleaved_rounds.py: error: {e}\n")
        return 2
    return 0


def report(args) -> None:
    """The comparison for ``args`` (`paraplan plan`'s options, parsed)."""
    work = workload_from_args(args)
    gpus = args.gpus or work.cluster.num_gpus
    model = CostModel(work)
    result = search(work, gpus, top_k=args.top, model=model)
    dtype = result.dtype
    n_blocks = len(work.profile(dtype).layers)
    modes = modes_for(model, None, dtype)
    gaps, better = [], []
    print(f"{work.spec.name} on {gpus} GPUs: priced interleaved candidates, closed form vs event simulation (s)")
    priced = sorted((c for c in result.candidates if c.status == "ok" and c.layout.virtual_stages > 1
                     and c.layout.schedule == "interleaved-1f1b"), key=lambda c: c.time_s)
    for cand in priced:
        lay = cand.layout
        closed = cand.time_s
        sim = model.evaluate(lay, cand.stages, cand.stage_recompute, simulate=True)
        gaps.append(sim.iteration_time_s / closed - 1)
        line = f"  {lay.short():44s} closed {closed:7.3f}  simulated {sim.iteration_time_s:7.3f} ({gaps[-1]:+6.1%})"
        if model.repeated_blocks(lay):
            for first in (True, False):
                counts = round_counts(n_blocks - 2, lay.pp, lay.virtual_stages, first)
                if min(counts) < 1:
                    continue
                start = least_recompute_prediction(model, lay, stages_from_counts(counts, n_blocks),
                                                   layout_modes(model, lay, modes))
                if start is None:
                    continue
                part = polished_quick_split(model, lay, start)  # the polish may unequal the rounds again
                sims = [model.evaluate(lay, [c.blocks for c in start.stages], [c.recompute for c in start.stages],
                                       simulate=True), model.evaluate(lay, part.stages, part.recompute, simulate=True)]
                line += f" | {'first' if first else 'last'}: " + " ".join(
                    f"{s.iteration_time_s:6.2f}" if s.fits else "oom" for s in sims)
                better += [(s.iteration_time_s, lay.short(), s.peak_memory_gib) for s in sims if s.fits]
        print(line)
    if not gaps:
        print("  none")
        return
    print(f"simulation over closed form: median {statistics.median(gaps):+.1%}, max {max(gaps):+.1%} "
          f"({len(gaps)} plans)")
    simulate_ranked(result, model)
    chosen = result.best
    print(f"the planner's best (simulated): {chosen.layout.short()} {chosen.time_s:.3f} s")
    if better:
        t, name, peak = min(better)
        print(f"best with equal rounds: {name} {t:.3f} s ({t / chosen.time_s - 1:+.1%}), peak {peak:.1f} GiB")


if __name__ == "__main__":
    sys.exit(main())

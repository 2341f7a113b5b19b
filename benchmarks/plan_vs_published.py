"""Is the plan really the best? The planner's pick against NVIDIA's published H100 recipes.

For each model and dtype of dgxc-benchmarking's v25.02 tables (and v24.11.1 for Nemotron-4 340B) at the
smallest published scale — the rows benchmarks/fit_h100.py fits the H100 to, so that the cost model is at its
most trustworthy there — ``paraplan plan`` is asked the same question the recipe's author answered: the model,
the GPU count, the global batch, the sequence length and the dtype, ``--framework megatron-core``. Printed:
the published layout and its measured step time, the cost model's time for that layout, the planner's pick
and its predicted time, and how much faster the planner claims to be than the recipe (by the cost model, and
against the measurement).

A pick claimed much faster than a tuned recipe is a warning sign: either the cost model misses a cost of that
layout, or the recipe left speed on the table; only running both tells which. The planner searches the layouts
its executor and Megatron-Core share (dp, tp, pp, cp, micro-batch, schedule, ZeRO, recomputation, sequence
parallelism); recipes may also use settings it does not model (TP communication overlap variants, CUDA
graphs). Takes ~2 minutes.

Run: .venv/bin/python benchmarks/plan_vs_published.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_h100  # noqa: E402
import published  # noqa: E402

from paraplan.planner.search import search  # noqa: E402
from paraplan.planner.workload import Workload  # noqa: E402


def main() -> int:
    runs, _ = published.h100_runs()
    rows = [r for r in runs if r.id in fit_h100.FIT_ROWS and r.measured == "step_time_s"]
    print(f"{'run':44s} {'published layout':40s} {'meas s':>7s} {'pred s':>7s}   {'planner pick':44s} "
          f"{'pred s':>7s} {'vs recipe':>9s} {'vs meas':>8s} {'search':>6s}")
    gains = []
    for run in rows:
        theirs = published.predict(run)
        lay = theirs.layout
        work = Workload.create(run.spec, "dgx-h100", lay.global_batch, nodes=max(1, run.gpus // 8),
                               framework="megatron-core", **run.switches)
        t = time.perf_counter()
        result = search(work, run.gpus, top_k=1, dtype=lay.dtype)
        took = time.perf_counter() - t
        best = result.best
        if best is None:
            print(f"{run.id:44s} {lay.short():40s} {run.value:7.2f} {theirs.prediction.iteration_time_s:7.2f}   "
                  "no plan fits")
            continue
        mine = best.prediction.iteration_time_s
        vs_recipe = mine / theirs.prediction.iteration_time_s - 1
        gains.append(vs_recipe)
        print(f"{run.id:44s} {lay.short():40s} {run.value:7.2f} {theirs.prediction.iteration_time_s:7.2f}   "
              f"{best.layout.short():44s} {mine:7.2f} {100 * vs_recipe:+8.1f}% {100 * (mine / run.value - 1):+7.1f}% "
              f"{took:5.1f}s")
    if gains:
        print(f"planner's pick vs the recipe, by the cost model: median {100 * statistics.median(gains):+.1f}%, "
              f"best {100 * min(gains):+.1f}%, worst {100 * max(gains):+.1f}% ({len(gains)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

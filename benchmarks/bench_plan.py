"""Planner search times (issue 5: a 1T GPT on 3072 A100s under 10 s, llama2-70b on 64 GPUs under 2 s),
and the whole `paraplan plan` command with its report and charts.

`search_time_s` is the search itself (enumeration, bounds, ILPs); `wall` is the command as a user runs
it, process start, profiling, the scaling re-plans and the charts included.
Run: .venv/bin/python benchmarks/bench_plan.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ONE_T = str(Path(__file__).with_name("data") / "gpt-1t.yaml")
CASES = {
    "llama2-70b on 64 H100s (8 DGX nodes), batch 512": ["--model", "llama2-70b", "--cluster", "dgx-h100",
                                                         "--global-batch", "512"],
    "1T GPT on 3072 A100s (384 DGX nodes), batch 3072": ["--model", ONE_T, "--cluster", "dgx-a100-80gb", "--nodes",
                                                        "384", "--global-batch", "3072"],
}


def main() -> None:
    env = {**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}
    for name, args in CASES.items():
        out = tempfile.mkdtemp(prefix="paraplan-report-")
        for label, extra in (("search only", ["--no-charts"]), ("report + charts", [])):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "paraplan", "plan", *args, "--out", out, "--json", *extra],
                               capture_output=True, text=True, check=True, env=env)
            wall = time.perf_counter() - t0
            r = json.loads(p.stdout)
            print(f"{name} [{label}]: search {r['search_time_s']:.2f} s, wall {wall:.2f} s; "
                  f"{r['num_candidates']:,} candidates, {r['ilp_solves']} ILPs; best "
                  f"dp{r['best']['plan']['dp']} tp{r['best']['plan']['tp']} pp{r['best']['plan']['pp']} "
                  f"{r['best']['plan']['schedule']} -> {r['best']['tokens_per_s']:,.0f} tokens/s, "
                  f"MFU {100 * r['best']['mfu']:.1f}%")


if __name__ == "__main__":
    main()

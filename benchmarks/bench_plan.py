"""Planner search times (issue 5: a 1T GPT on 3072 A100s under 10 s, llama2-70b on 64 GPUs under 2 s),
and the whole `paraplan plan` command with its report and charts.

`search_time_s` is the search itself (enumeration, bounds, ILPs); `wall` is the command as a user runs
it, process start, profiling, the scaling re-plans and the charts included. The first run of a case
fills the profile cache (a fresh one: cold start); the repeats show the spread on this noisy machine.
Run: .venv/bin/python benchmarks/bench_plan.py [--repeats N] [--solvers] [--moe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ONE_T = str(Path(__file__).with_name("data") / "gpt-1t.yaml")
# mixtures of experts multiply the layouts by their (ep, etp) choices (--moe: once each, search only)
MOE_CASES = {
    "DeepSeek-V3 on 1024 H100s, batch 4096, megatron-core": ["--model", "deepseek-v3", "--cluster", "dgx-h100",
                                                             "--nodes", "128", "--global-batch", "4096",
                                                             "--framework", "megatron-core"],
    "Llama 4 Maverick on 512 H100s, batch 1024, megatron-core": ["--model", "llama4-maverick", "--cluster", "dgx-h100",
                                                                 "--nodes", "64", "--global-batch", "1024",
                                                                 "--framework", "megatron-core"],
}
CASES = {
    "llama2-70b on 64 H100s (8 DGX nodes), batch 512": ["--model", "llama2-70b", "--cluster", "dgx-h100",
                                                         "--global-batch", "512"],
    "1T GPT on 3072 A100s (384 DGX nodes), batch 3072": ["--model", ONE_T, "--cluster", "dgx-a100-80gb", "--nodes",
                                                        "384", "--global-batch", "3072"],
}


def _run(args: list[str], env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "paraplan", "plan", *args, "--json"], capture_output=True, text=True,
                       check=True, env=env)
    return time.perf_counter() - t0, json.loads(p.stdout)


def compare_solvers(env: dict, repeats: int) -> None:
    """CBC against HiGHS as the first solver (``plan --solver``), search only: time, ILPs, the plan found, and
    layouts priced without a solver (a failure falls back to the other solver first)."""
    for name, args in CASES.items():
        out = ["--out", tempfile.mkdtemp(prefix="paraplan-report-"), "--no-charts"]
        _run([*args, *out], env)  # the profile cache warm for both
        for solver in ("cbc", "highs"):
            searches, failed = [], 0
            for _ in range(repeats):
                _, r = _run([*args, *out, "--solver", solver], env)
                searches.append(r["search_time_s"])
                failed += sum("without an ILP solver" in n for n in r["notes"])
            b = r["best"]
            print(f"{name}, {solver} first: search median {statistics.median(searches):.2f} s "
                  f"(min {min(searches):.2f}, max {max(searches):.2f}), {r['ilp_solves']} ILPs, "
                  f"best {b['iteration_time_s']:.4g} s ({_layout(b['plan'])}), runs with solver failures: {failed}")


def _layout(plan: dict) -> str:
    extra = "".join(f" {k}{plan[k]}" for k in ("cp", "ep") if plan.get(k, 1) > 1)
    return (f"dp{plan['dp']} tp{plan['tp']} pp{plan['pp']}{extra} mb{plan['micro_batch']} {plan['schedule']} "
            f"z{plan['zero']}")


def reference_loop_s() -> float:
    """Seconds for a fixed pure-Python loop (10 million integer additions, best of 3): the planner is pure Python
    and numpy, so this says how fast the machine is for it, and lets figures taken on two machines of "the same
    kind" (which differ) be compared."""
    best = float("inf")
    for _ in range(3):
        t0, total = time.perf_counter(), 0
        for i in range(10_000_000):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case with report and charts")
    ap.add_argument("--solvers", action="store_true", help="compare CBC and HiGHS as the first ILP solver")
    ap.add_argument("--moe", action="store_true", help="time the two large mixture-of-experts searches instead")
    opts = ap.parse_args()
    repeats = opts.repeats
    if opts.moe:
        env = {**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}
        for name, args in MOE_CASES.items():
            out = ["--out", tempfile.mkdtemp(prefix="paraplan-report-"), "--no-charts"]
            _run([*args, *out], env)  # the profile cache warm
            wall, r = _run([*args, *out], env)
            print(f"{name}: search {r['search_time_s']:.1f} s, wall {wall:.1f} s; {r['num_candidates']:,} candidates, "
                  f"{r['ilp_solves']} ILPs; best {_layout(r['best']['plan'])} {r['best']['iteration_time_s']:.4g} s")
        return
    if opts.solvers:
        compare_solvers({**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}, repeats)
        return
    env = {**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}
    print(f"this machine: {os.cpu_count()} cores; reference pure-Python loop {reference_loop_s():.2f} s "
          "(10M additions; a slower machine scales every figure below)")
    for name, args in CASES.items():
        out = ["--out", tempfile.mkdtemp(prefix="paraplan-report-")]
        cold, r = _run([*args, *out, "--no-charts"], env)
        print(f"{name}\n  search only, cold profile cache: search {r['search_time_s']:.2f} s, wall {cold:.2f} s; "
              f"{r['num_candidates']:,} candidates, {r['ilp_solves']} ILPs")
        walls, searches = [], []
        for _ in range(repeats):
            wall, r = _run([*args, *out], env)
            walls.append(wall)
            searches.append(r["search_time_s"])
        b = r["best"]["plan"]
        print(f"  report + charts, {repeats} runs: search median {statistics.median(searches):.2f} s; wall median "
              f"{statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}); best "
              f"{_layout(b)} -> {r['best']['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {100 * r['best']['mfu']:.1f}%")


if __name__ == "__main__":
    main()

"""Regenerate the example reports committed under reports/examples/ (run from the repository root).

- the planner's report for the built-in default (what `make demo` plans), with time-to-train and cost;
- a strategy comparison for the same workload.
Run: .venv/bin/python benchmarks/make_example_reports.py
"""

from __future__ import annotations

import subprocess
import sys

EXAMPLES = [
    ["plan", "--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "512", "--train-tokens", "2e12",
     "--out", "reports/examples/plan-llama2-70b-dgx-h100-64gpus"],
    ["compare", "--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "512",
     "--strategy", "dp=64,zero=3,recompute=full", "--strategy", "tp=8,pp=8", "--strategy", "tp=8,pp=4,dp=2,zero=1",
     "--out", "reports/examples/compare-llama2-70b-dgx-h100-64gpus"],
]


def main() -> None:
    for args in EXAMPLES:
        print("paraplan", " ".join(args), flush=True)
        subprocess.run([sys.executable, "-m", "paraplan", *args], check=True)


if __name__ == "__main__":
    main()

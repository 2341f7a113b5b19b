"""How long `paraplan profile --device meta` takes on big models, as a user runs it (process start included).

Issue 3 asks for gpt3-175b in under 10 s on the 2-core dev machine. Run: .venv/bin/python benchmarks/bench_profile.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

MODELS = ["gpt3-175b", "llama3-405b", "llama2-70b"]


def main() -> None:
    for model in MODELS:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "paraplan", "profile", "--model", model, "--device", "meta",
                            "--json"], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        data = json.loads(p.stdout)
        print(f"{model:12s} {wall:6.2f} s wall  {len(data['layers'])} blocks  "
              f"{data['num_parameters'] / 1e9:7.1f} B params  {data['total_fwd_flops'] / 1e12:8.1f} TFLOP fwd/sample")


if __name__ == "__main__":
    main()

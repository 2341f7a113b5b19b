"""How long `paraplan profile --device meta` takes on big models, as a user runs it (process start included).

Issue 3 asks for gpt3-175b in under 10 s on the 2-core dev machine. Each model runs twice on a fresh
profile cache: cold (traced on the meta device) and warm (read back from the cache).
Run: .venv/bin/python benchmarks/bench_profile.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = ["gpt3-175b", "llama3-405b", "llama2-70b"]


def main() -> None:
    env = {**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}
    for model in MODELS:
        walls = []
        for _ in ("cold", "warm"):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "paraplan", "profile", "--model", model, "--device", "meta",
                                "--json"], capture_output=True, text=True, check=True, env=env)
            walls.append(time.perf_counter() - t0)
        data = json.loads(p.stdout)
        print(f"{model:12s} {walls[0]:6.2f} s cold, {walls[1]:5.2f} s warm  {len(data['layers'])} blocks  "
              f"{data['num_parameters'] / 1e9:7.1f} B params  {data['total_fwd_flops'] / 1e12:8.1f} TFLOP fwd/sample")


if __name__ == "__main__":
    main()

"""How long `paraplan simulate` takes for a 1T-parameter GPT layout on 3072 GPUs (issue 4: under 2 s).

Times the whole command as a user runs it (process start, meta-device profile, event simulation),
first with an empty profile cache (cold: the meta-device trace imports part of torch's compiler
stack, ~1 s), then again (warm: the profile comes from the cache, as on every later run).
Run: .venv/bin/python benchmarks/bench_simulate.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = Path(__file__).with_name("data") / "gpt-1t.yaml"
CASES = {
    "1T GPT, 3072 A100s, dp6 tp8 pp64 interleaved x2 (Narayanan et al. 2021)": [
        "--model", str(SPEC), "--cluster", "dgx-a100-80gb", "--nodes", "384", "--global-batch", "3072", "--dp", "6",
        "--tp", "8", "--pp", "64", "--micro-batch", "1", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
        "--recompute", "full"],
    "llama2-70b, 64 H100s, dp2 tp8 pp4 1f1b": [
        "--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "512", "--dp", "2", "--tp", "8",
        "--pp", "4", "--micro-batch", "1", "--recompute", "selective", "--sequence-parallel"],
}


def main() -> None:
    env = {**os.environ, "PARAPLAN_CACHE": tempfile.mkdtemp(prefix="paraplan-bench-")}
    for name, args in CASES.items():
        walls = []
        for _ in ("cold", "warm"):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "paraplan", "simulate", *args, "--json"], capture_output=True,
                               text=True, check=True, env=env)
            walls.append(time.perf_counter() - t0)
        r = json.loads(p.stdout)
        print(f"{name}: {walls[0]:.2f} s cold, {walls[1]:.2f} s warm ({r['method']}); predicted "
              f"{r['iteration_time_s']:.2f} s/iteration, {r['model_tflops_per_gpu']:.0f} model TFLOP/s per GPU, "
              f"{r['peak_memory_gib']:.1f} GiB")


if __name__ == "__main__":
    main()

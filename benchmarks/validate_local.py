"""Regenerate the closed-loop example in reports/examples/validate-gpt-tiny-local-2gpus/ (issues 8, 13).

From a machine with no calibration (a fresh, empty $PARAPLAN_MEASUREMENTS), as a new user runs it:
`paraplan validate --model gpt-tiny --cluster local --gpus 2 --global-batch 16` first calibrates this
machine by itself (GEMM rates, memory bandwidth, per-kernel overhead, gloo collectives on 2 processes,
the framework's costs per event), then times gpt-tiny's blocks, runs the default spread of layouts plus
the planner's top 3 on 2 processes and compares measured with predicted step times. The calibrated spec
is copied beside the report, so the figures can be traced to what was measured.

Prints the MAPE, Kendall's tau, how the planner's pick fared against the measured-fastest layout, what
the calibration cost, and the machine's load before and after (others' work skews every timing: run it
on an otherwise idle machine). Takes ~10 minutes on 2 cores (every layout runs twice).
Run: .venv/bin/python benchmarks/validate_local.py [--use-existing-calibration]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path("reports/examples/validate-gpt-tiny-local-2gpus")
COMMAND = ["validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "16",
           "--out", str(OUT), "--json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--use-existing-calibration", action="store_true",
                        help="keep $PARAPLAN_MEASUREMENTS (or hardware_specs/measurements/) as it is")
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("PARAPLAN_NO_CALIBRATE", None)
    if not args.use_existing_calibration:
        env["PARAPLAN_MEASUREMENTS"] = tempfile.mkdtemp(prefix="paraplan-uncalibrated-")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    print("paraplan", " ".join(COMMAND), flush=True)
    p = subprocess.run([sys.executable, "-m", "paraplan", *COMMAND], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"paraplan validate failed (exit {p.returncode}): {p.stderr.strip()}")
    sys.stderr.write(p.stderr)
    result = json.loads(p.stdout)
    measurements = Path(env.get("PARAPLAN_MEASUREMENTS") or "hardware_specs/measurements")
    if (measurements / "local.yaml").exists():
        shutil.copy(measurements / "local.yaml", OUT / "calibrated-local.yaml")
    shutil.rmtree(OUT / "runs", ignore_errors=True)  # per-rank logs; the table holds what they measured
    print(f"layouts {result['layouts']}: MAPE {100 * result['mape']:.1f}%, Kendall tau {result['kendall_tau']:.2f}; "
          f"measured fastest {result['measured_fastest']}, planner's pick {result['recommended']} "
          f"({100 * result['recommended_vs_fastest']:+.1f}%); calibrated {result['calibrated']}; "
          f"{time.perf_counter() - started:.0f} s in all; load {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    for note in result.get("notes", []):
        print(f"note: {note}")


if __name__ == "__main__":
    main()

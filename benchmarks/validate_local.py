"""Regenerate the closed-loop example in reports/examples/validate-gpt-tiny-local-2gpus/ (issue 8).

1. `paraplan calibrate` measures this machine (GEMM rates, memory bandwidth, per-kernel overhead,
   gloo collectives on 2 processes, framework costs per event) and writes the calibrated `local`
   cluster to hardware_specs/measurements/local.yaml (or $PARAPLAN_MEASUREMENTS/local.yaml);
2. `paraplan validate` runs gpt-tiny in the default spread of layouts plus the planner's top 3 on
   2 processes and compares measured with predicted step times;
3. the calibrated spec is copied beside the report, so the figures can be traced to what was measured.

Prints the MAPE, Kendall's tau and how the planner's pick fared against the measured-fastest layout.
Takes ~5 minutes on 2 cores; run it on an otherwise idle machine (the step times are the measurement).
Run: .venv/bin/python benchmarks/validate_local.py [--skip-calibrate]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

OUT = Path("reports/examples/validate-gpt-tiny-local-2gpus")


def paraplan(*args: str) -> str:
    print("paraplan", " ".join(args), flush=True)
    p = subprocess.run([sys.executable, "-m", "paraplan", *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"paraplan {args[0]} failed (exit {p.returncode}): {p.stderr.strip()}")
    return p.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-calibrate", action="store_true", help="reuse the calibrated local spec")
    args = parser.parse_args()
    if not args.skip_calibrate:
        cal = json.loads(paraplan("calibrate", "--json"))
        print(f"calibrated: {cal['spec_file']}; framework costs (µs): {cal['framework_us']}")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(paraplan("validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2",
                                 "--global-batch", "8", "--steps", "16", "--top", "3", "--out", str(OUT), "--json"))
    from paraplan.hardware_specs import measurements_dir

    calibrated = measurements_dir() / "local.yaml"
    if calibrated.exists():
        shutil.copy(calibrated, OUT / "calibrated-local.yaml")
    shutil.rmtree(OUT / "runs", ignore_errors=True)  # per-rank logs; the table holds what they measured
    print(f"layouts {result['layouts']}: MAPE {100 * result['mape']:.1f}%, Kendall tau {result['kendall_tau']:.2f}; "
          f"measured fastest {result['measured_fastest']}, planner's pick {result['recommended']} "
          f"({100 * result['recommended_vs_fastest']:+.1f}%)")


if __name__ == "__main__":
    main()

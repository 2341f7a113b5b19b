"""Fit the H100's efficiency (and Megatron-Core's fused element-wise traffic) to a few published runs.

Physically meaningful parameters only (no per-model factors):
- a GEMM of F FLOPs in dtype d takes F / (e_d · peak_d) + t_d: an asymptotic fraction e_d of the dense peak and a
  fixed cost t_d per GEMM (launch, tile fill and drain, wave quantisation on average), for bf16 and for FP8 —
  stored as the efficiency curve eff_d(F) = 1 / (1/e_d + t_d · peak_d / F) at each decade of F;
- the fraction of eager PyTorch's element-wise traffic that Megatron-Core's fused kernels still move
  (Framework.elementwise_traffic), HBM efficiency and per-kernel overhead held at their datasheet-like values.

Fitting set (FIT_ROWS): the smallest published scale of each model and dtype in NVIDIA's dgxc-benchmarking
v25.02 tables (measured step times, exact layouts; v24.11.1 for Nemotron-4 340B, whose v25.02 table repeats
it) — 12 rows. Every other H100 row of benchmarks/data/published_h100.yaml is held out (other releases, every
larger scale, NeMo and Megatron-Bridge tables, Megatron-LM's README): benchmarks/fidelity.py reports both.
Objective: the mean squared log error of the step time; derivative-free (Nelder-Mead).

Run: .venv/bin/python benchmarks/fit_h100.py [--write]  (--write puts the curves into
hardware_specs/gpus/h100-sxm-80gb.yaml and h200-141gb.yaml, the same chip).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published  # noqa: E402

from paraplan.hardware_specs import load_cluster  # noqa: E402
from paraplan.planner import framework as framework_module  # noqa: E402

FIT_ROWS = (
    "dgxc-v25.02-llama3.1-8b-bf16-8gpu", "dgxc-v25.02-llama3.1-8b-fp8-8gpu",
    "dgxc-v25.02-llama3.1-70b-bf16-64gpu", "dgxc-v25.02-llama3.1-70b-fp8-64gpu",
    "dgxc-v25.02-llama3.1-405b-bf16-32gpu", "dgxc-v25.02-llama3.1-405b-fp8-32gpu",
    "dgxc-v25.02-gpt3-175b-bf16-128gpu", "dgxc-v25.02-gpt3-175b-fp8-128gpu",
    "dgxc-v25.02-nemotron4-15b-bf16-16gpu", "dgxc-v25.02-nemotron4-15b-fp8-16gpu",
    "dgxc-v24.11.1-nemotron4-340b-bf16-128gpu", "dgxc-v24.11.1-nemotron4-340b-fp8-128gpu",
)
DECADES = (1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13)
# starting point and names: bf16 e, bf16 t (us), fp8 e, fp8 t (us), Megatron-Core element-wise traffic
START = np.array([0.75, 10.0, 0.60, 10.0, 0.5])
NAMES = ("bf16 asymptotic efficiency", "bf16 per-GEMM cost (us)", "fp8 asymptotic efficiency",
         "fp8 per-GEMM cost (us)", "megatron-core element-wise traffic")


def curve(e: float, t_us: float, peak: float) -> tuple[tuple[float, float], ...]:
    """eff(F) = 1 / (1/e + t·peak/F) at each decade of GEMM FLOPs."""
    return tuple((f, float(f"{1.0 / (1.0 / e + t_us * 1e-6 * peak / f):.4g}")) for f in DECADES)


def efficiency(x, gpu):
    e16, t16, e8, t8 = x[:4]
    return dataclasses.replace(gpu.efficiency, matmul={
        "default": curve(e16, t16, gpu.peak_flops("bf16")), "fp8": curve(e8, t8, gpu.peak_flops("fp8"))},
        source="fitted: benchmarks/fit_h100.py")


def with_framework(x):
    """Megatron-Core's profile with the fitted element-wise traffic (restored by the caller)."""
    fw = framework_module.FRAMEWORKS["megatron-core"].replace(elementwise_traffic=round(float(x[4]), 2))
    framework_module.FRAMEWORKS["megatron-core"] = fw
    published._workload.cache_clear()


def errors(x, runs, gpu) -> list[float]:
    with_framework(x)
    eff = efficiency(x, gpu)
    return [published.predict(r, efficiency=eff).error for r in runs]


def loss(x, runs, gpu) -> float:
    if not (0.2 < x[0] < 1 and 0 <= x[1] < 200 and 0.2 < x[2] < 1 and 0 <= x[3] < 200 and 0.1 <= x[4] <= 1):
        return 1e9
    return float(np.mean([math.log1p(e) ** 2 for e in errors(x, runs, gpu)]))


def nelder_mead(f, x0, steps, iterations=250, tol=1e-7):
    n = len(x0)
    simplex = [np.array(x0, float)] + [np.array(x0, float) + np.eye(n)[i] * steps[i] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (p - simplex[0]) for p in simplex]
                values = [f(p) for p in simplex]
    best = int(np.argmin(values))
    return simplex[best], values[best]


def fit_runs():
    runs, _ = published.h100_runs()
    by_id = {r.id: r for r in runs}
    return [by_id[i] for i in FIT_ROWS]


def write(x) -> None:
    root = Path(__file__).resolve().parents[1] / "hardware_specs" / "gpus"
    for name in ("h100-sxm-80gb.yaml", "h200-141gb.yaml"):
        path = root / name
        text = path.read_text()
        head, _, _ = text.partition("efficiency:")
        gpu = load_cluster("dgx-h100").gpu
        e16, e8 = curve(x[0], x[1], gpu.peak_flops("bf16")), curve(x[2], x[3], gpu.peak_flops("fp8"))
        fmt = lambda c: "[" + ", ".join(f"[{f:.1e}, {v:.4g}]" for f, v in c) + "]"  # noqa: E731
        path.write_text(
            head + "efficiency:\n"
            "  source: fitted to 12 published dgxc-benchmarking H100 runs (benchmarks/fit_h100.py)\n"
            f"  # A GEMM of F FLOPs takes F / (e * peak) + t: bf16 e = {x[0]:.3f}, t = {x[1]:.1f} us; "
            f"fp8 e = {x[2]:.3f}, t = {x[3]:.1f} us\n"
            "  # (eff(F) = 1 / (1/e + t * peak / F) at each decade). The fitting rows and the held-out\n"
            "  # errors: benchmarks/fidelity.py; the H200 has the H100's compute (its HBM differs).\n"
            f"  matmul:\n    default: {fmt(e16)}\n    fp8: {fmt(e8)}\n  memory_bound: 0.80\n  op_overhead_us: 4.0\n")
        print("wrote", path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args()
    runs = fit_runs()
    gpu = load_cluster("dgx-h100").gpu
    x, value = nelder_mead(lambda p: loss(p, runs, gpu), START, steps=[0.05, 5.0, 0.05, 5.0, 0.1],
                           iterations=args.iterations)
    for name, v in zip(NAMES, x, strict=True):
        print(f"{name:40s} {v:.4f}")
    for r, e in zip(runs, errors(x, runs, gpu), strict=True):
        print(f"  {r.id:50s} {100 * e:+6.1f}%")
    print(f"fitted rows: {len(runs)}, rms log error {math.sqrt(value):.4f}")
    if args.write:
        write(x)
    return 0


if __name__ == "__main__":
    sys.exit(main())

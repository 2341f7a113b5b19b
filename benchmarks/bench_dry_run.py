"""Predicted vs traced memory and communication over a spread of plans (the executor's dry run).

Each plan goes through ``paraplan simulate --write-plan`` and ``paraplan execute --dry-run --json``, as a
user would run them; the script prints, per traced rank, the peak memory traced (tensors, and with the
allowance both sides add) beside the cost model's prediction, and the worst error over the kinds of
traffic. Run: .venv/bin/python benchmarks/bench_dry_run.py [--quick] [--big] [--moe] [--grid MODEL]

--quick runs the spread the tests assert (tests/test_dry_run.py); --big adds the README's llama2-70b plan
on 64 H100s, a 70B ZeRO-3 plan and Mixtral 8x7B with ep8 (minutes each on a 2-core machine); --moe runs only
the mixture-of-experts plans, Mixtral 8x7B included. --grid MODEL crosses every schedule with every recomputation
mode and ZeRO stage on 4 ranks (dp2 pp2, and tp2 pp2 with SP), printing the refusal where the planner refuses the
combination (the sweep that found zb-v's recomputation, layout.zero_bubble_recompute_refusal): a few minutes a model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "paraplan"]
MODEL = str(ROOT / "benchmarks" / "data" / "llama-small.yaml")
GPT = str(ROOT / "benchmarks" / "data" / "gpt-small.yaml")

# (model, cluster, global batch, layout flags): GPT and LLaMA; ZeRO 0-3; TP with and without SP; PP with
# 1F1B, interleaved and ZB-V; recomputation none / selective / full; with and without accumulation; context
# parallelism.
SPREAD = [
    (MODEL, 16, "--dp 2 --tp 1 --pp 1 --micro-batch 8"),
    (MODEL, 16, "--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 1"),
    (MODEL, 16, "--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 2"),
    (MODEL, 16, "--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 3 --recompute full"),
    (MODEL, 16, "--dp 1 --tp 2 --pp 1 --micro-batch 4"),
    (MODEL, 16, "--dp 2 --tp 2 --pp 1 --micro-batch 2 --sequence-parallel --recompute selective"),
    (MODEL, 16, "--dp 1 --tp 2 --pp 2 --micro-batch 2 --zero 0 --sequence-parallel"),
    (GPT, 16, "--dp 2 --tp 1 --pp 2 --micro-batch 1 --zero 1"),
    (GPT, 16, "--dp 1 --tp 2 --pp 2 --micro-batch 1 --schedule interleaved-1f1b --virtual-stages 2"),
    (MODEL, 16, "--dp 2 --tp 1 --pp 2 --micro-batch 1 --schedule zb-v --virtual-stages 2 --zero 2"),
    # context parallelism (planner/context_parallel.py): K/V all-gathers, the whole sequence's K/V kept by the
    # attention kernel, ZeRO over dp x cp; with TP and SP, selective and full recomputation, a pipeline
    (MODEL, 16, "--dp 1 --tp 1 --pp 1 --cp 4 --micro-batch 4 --recompute selective"),
    (MODEL, 16, "--dp 1 --tp 2 --pp 1 --cp 2 --micro-batch 4 --sequence-parallel"),
    (MODEL, 16, "--dp 2 --tp 1 --pp 1 --cp 2 --micro-batch 2 --zero 2 --recompute full"),
    (GPT, 16, "--dp 1 --tp 1 --pp 2 --cp 2 --micro-batch 2"),
    # MLP recomputation (the MLP sublayer checkpointed: its all-gather repeated under SP, not its output
    # reduce-scatter, which torch's early-stopping checkpoint skips); full recomputation under TP without SP
    (MODEL, 16, "--dp 2 --tp 2 --pp 1 --micro-batch 2 --sequence-parallel --recompute mlp"),
    (GPT, 16, "--dp 1 --tp 2 --pp 2 --micro-batch 2 --recompute full"),
]
BIG = [
    ("llama2-70b", 512, "--nodes 8 --dp 8 --tp 4 --pp 2 --micro-batch 1 --schedule zb-v --virtual-stages 2 --zero 2 "
                        "--sequence-parallel"),
    ("llama2-70b", 64, "--nodes 4 --dp 32 --tp 1 --pp 1 --micro-batch 1 --zero 3 --recompute full"),
]
# interleaved ZeRO-3: torch's runtime gathers whole chunks ahead (memory._state_bytes): with two chunks a rank all of
# them at the step's first op, with six the pending chunks near the activation peak
INTERLEAVED_ZERO3 = [("llama2-70b", 512, f"--nodes 8 --dp 16 --tp 2 --pp 2 --micro-batch 1 --schedule interleaved-1f1b "
                                         f"--virtual-stages {v} --zero 3 --recompute full") for v in (2, 4, 6)]
BIG += INTERLEAVED_ZERO3
# mixtures of experts (planner/moe.py): experts over dp ranks (edp = 1), over dp and tp with sequence
# parallelism in a pipeline (ZeRO 2, tp-summed router), a pipeline with full recomputation (the all-to-alls
# repeated), MLP recomputation of the MoE block over tp with SP, DeepSeek-style MLA with a shared expert and a
# dense first layer over tp without SP (ZeRO 3), and under selective (and selective+mlp) recomputation; and
# Mixtral 8x7B with ep8 on one DGX node
MOE = [
    ("mixtral-tiny", 8, "--dp 2 --tp 1 --pp 1 --ep 2 --micro-batch 2"),
    ("mixtral-tiny", 16, "--dp 2 --tp 2 --pp 2 --ep 2 --micro-batch 1 --zero 2 --sequence-parallel"),
    ("mixtral-tiny", 16, "--dp 2 --tp 1 --pp 2 --ep 2 --micro-batch 1 --recompute full"),
    ("mixtral-tiny", 16, "--dp 2 --tp 2 --pp 1 --ep 2 --micro-batch 2 --sequence-parallel --recompute mlp"),
    ("deepseek-tiny", 8, "--dp 2 --tp 2 --pp 1 --ep 4 --micro-batch 1 --zero 3"),
    # selective recomputation of MLA: its latent norms and up-projection recomputed (models.in_attention_prologue)
    ("deepseek-tiny", 8, "--dp 2 --tp 2 --pp 1 --ep 4 --micro-batch 1 --recompute selective"),
    # and both checkpoints at once (NVIDIA's DeepSeek-V3 recipes: mla_up_proj with mlp and moe). Not under SP: there
    # this executor's MLA backward all-reduces its latents' gradients and skips the input's reduce-scatter, which
    # the cost model (a plain TP region) charges instead — bytes off by 50% (issue 16's notes)
    ("deepseek-tiny", 8, "--dp 2 --tp 2 --pp 1 --ep 4 --micro-batch 1 --recompute selective+mlp"),
    # full recomputation of an MoE layer under TP without SP: its output all-gather, the layer's last collective,
    # is not rerun (torch's early-stopping checkpoint)
    ("mixtral-tiny", 16, "--dp 2 --tp 2 --pp 1 --ep 2 --micro-batch 2 --recompute full"),
]
MOE_BIG = [("mixtral-8x7b", 16, "--dp 8 --tp 1 --pp 1 --ep 8 --micro-batch 1 --zero 1")]
SPREAD += MOE
BIG += MOE_BIG


def grid(model: str) -> list[tuple[str, int, str]]:
    """--grid: every schedule x recomputation mode x ZeRO stage at dp2 pp2 (global batch 8, micro-batch 1), then
    1F1B and ZB-V at tp2 pp2 with sequence parallelism under each of none, selective and full recomputation."""
    out = []
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)):
        for mode in ("none", "selective", "mlp", "full"):
            for zero in (1, 2, 3):
                out.append((model, 8, f"--dp 2 --tp 1 --pp 2 --micro-batch 1 --schedule {schedule} "
                                      f"--virtual-stages {v} --zero {zero} --recompute {mode}"))
    for mode in ("none", "selective", "full"):
        for schedule, v in (("1f1b", 1), ("zb-v", 2)):
            out.append((model, 8, f"--dp 1 --tp 2 --pp 2 --micro-batch 1 --schedule {schedule} --virtual-stages {v} "
                                  f"--sequence-parallel --recompute {mode}"))
    return out


def _compact(flags: str) -> str:
    """simulate's flags, shorter (the table's first column has 70 characters)."""
    for long, short in (("--micro-batch ", "mb"), ("--schedule ", ""), ("--virtual-stages ", "v"), ("--zero ", "z"),
                        ("--recompute ", "rc "), ("--sequence-parallel", "sp"), ("--", "")):
        flags = flags.replace(long, short)
    return flags


def dry_run(model: str, batch: int, flags: str, folder: str) -> dict:
    plan = os.path.join(folder, "plan.json")
    cmd = [*CLI, "simulate", "--model", model, "--cluster", "dgx-h100", "--global-batch", str(batch),
           *flags.split(), "--write-plan", plan, "--json"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    out = subprocess.run([*CLI, "execute", "--plan", plan, "--dry-run", "--json"], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def errors(rank: dict) -> tuple[float, float, float, float]:
    """(peak error, tensor error, worst traffic error, FLOPs error) of the prediction relative to the trace."""
    other = rank["memory_gib"]["other"]
    predicted_tensors = rank["predicted_memory_gib"] - rank["predicted_memory_breakdown_gib"]["other"]
    tensor_err = predicted_tensors / rank["tensor_peak_gib"] - 1
    peak_err = rank["predicted_memory_gib"] / (rank["tensor_peak_gib"] + other) - 1
    total = sum(rank["comm_bytes"].values())
    worst = 0.0
    for kind, got in rank["comm_bytes"].items():
        want = rank["predicted_comm_bytes"][kind]
        if max(got, want) > 0.01 * total:  # kinds under 1% of the rank's traffic: absolute, not relative
            worst = max(worst, abs(want / got - 1) if got else float("inf"))
    flops_err = rank["predicted_flops"] / rank["flops"] - 1 if rank["flops"] else float("inf")
    return peak_err, tensor_err, worst, flops_err


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--moe", action="store_true", help="only the mixture-of-experts plans (Mixtral 8x7B included)")
    ap.add_argument("--grid", metavar="MODEL", help="every schedule x recomputation x ZeRO stage of MODEL instead")
    args = ap.parse_args()
    cases = [(m, b, f) for m, b, f in SPREAD] + (BIG if args.big else [])
    if args.moe:
        cases = MOE + MOE_BIG
    if args.grid:
        cases = grid(args.grid)
    print(f"{'plan':70s} {'rank':>5s} {'traced':>8s} {'pred':>8s} {'peak':>7s} {'tensors':>8s} {'traffic':>8s} "
          f"{'FLOPs':>7s} {'secs':>5s}")
    worst = [0.0, 0.0, 0.0, 0.0]
    with tempfile.TemporaryDirectory() as tmp:
        for model, batch, flags in cases:
            t0 = time.perf_counter()
            name = f"{Path(model).stem} {_compact(flags)}"
            try:
                result = dry_run(model, batch, flags, tmp)
            except subprocess.CalledProcessError as e:  # the planner refuses it (one line on stderr)
                print(f"{name[:70]:70s} refused: {e.stderr.strip().splitlines()[-1][:200]}", flush=True)
                continue
            secs = time.perf_counter() - t0
            for r in result["ranks"]:
                peak, tensors, traffic, flops = errors(r)
                worst = [max(w, abs(x)) for w, x in zip(worst, (peak, tensors, traffic, flops), strict=True)]
                print(f"{name[:70]:70s} {r['rank']:5d} {r['peak_memory_gib']:8.2f} {r['predicted_memory_gib']:8.2f} "
                      f"{100 * peak:+6.1f}% {100 * tensors:+7.1f}% {100 * traffic:7.1f}% {100 * flops:+6.1f}% "
                      f"{secs:5.0f}", flush=True)
    print(f"worst: peak {100 * worst[0]:.1f}%, tensors alone {100 * worst[1]:.1f}%, traffic {100 * worst[2]:.1f}%, "
          f"FLOPs {100 * worst[3]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicted vs published iteration times and throughput of large runs (benchmarks/data/published_runs.yaml).

Prints one line per reference with the error, and a summary. The assertions live in
tests/test_fidelity.py; this script also reports the references the tests do not assert.
Run: .venv/bin/python benchmarks/fidelity.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml

from paraplan.models import spec_from_mapping
from paraplan.planner.costmodel import CostModel, default_stages, validate_layout
from paraplan.planner.errors import InvalidLayout
from paraplan.planner.layout import Layout
from paraplan.planner.placement import placement
from paraplan.planner.workload import Workload

DATA = Path(__file__).with_name("data") / "published_runs.yaml"
MEGATRON = dict(framework="megatron-2021")


def load() -> dict:
    return yaml.safe_load(DATA.read_text())


def gpt(dims: list[int], vocab: int = 51200) -> object:
    layers, hidden, heads = dims
    return spec_from_mapping(dict(name=f"gpt-{layers}x{hidden}", family="gpt", num_layers=layers, hidden_size=hidden,
                                  num_attention_heads=heads, vocab_size=vocab, seq_length=2048), "published run")


def predict_run(run: dict):
    gpus = run["tp"] * run["pp"] * run["dp"]
    options = {**MEGATRON, "overlap_tp": run.get("overlap_tp", True)}
    work = Workload.create(gpt(run["model"], run.get("vocab", 51200)), "dgx-a100-80gb", run["global_batch"],
                           nodes=max(1, gpus // 8), **options)
    model = CostModel(work)
    lay = Layout(dp=run["dp"], tp=run["tp"], pp=run["pp"], micro_batch=run["micro_batch"],
                 global_batch=run["global_batch"], schedule="interleaved-1f1b" if run["v"] > 1 else "1f1b",
                 virtual_stages=run["v"], recompute=run["recompute"], sequence_parallel=run["sp"])
    validate_layout(model, lay)
    return model.evaluate(lay, default_stages(model, lay))


def layer_times(table: dict) -> list[tuple[dict, float, float]]:
    """(row, predicted forward ms, predicted backward ms) per row of Korthikanti's Table 4."""
    spec = spec_from_mapping({"name": "gpt-22b", **table["model"]}, "published run")
    work = Workload.create(spec, "dgx-a100-80gb", 4, nodes=1, **MEGATRON)
    model = CostModel(work)
    out = []
    for row in table["rows"]:
        lay = Layout(dp=1, tp=8, pp=1, micro_batch=4, global_batch=4, recompute=row["recompute"],
                     sequence_parallel=row["sequence_parallel"])
        c = model.block_cost(1, lay, placement(work.cluster, 1, 8, 1), row["recompute"])
        out.append((row, (c.fwd + c.tp_fwd) * 1e3, (c.bwd_input + c.bwd_weight + c.recompute + c.tp_bwd) * 1e3))
    return out


def narayanan_best(run: dict) -> tuple[float, str]:
    """Our fastest fitting (micro-batch, interleaving) for a Table 1 row: TFLOP/s by their Eq. 3."""
    tp, pp, gpus, gb = run["tp"], run["pp"], run["gpus"], run["global_batch"]
    layers, h, _ = run["model"]
    work = Workload.create(gpt(run["model"]), "dgx-a100-80gb", gb, nodes=gpus // 8, **MEGATRON)
    model = CostModel(work)
    best = None
    for mb in (1, 2, 4, 8):
        for sched, v in ([("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("interleaved-1f1b", 2),
                                                       ("interleaved-1f1b", 3), ("interleaved-1f1b", 4)]):
            lay = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=mb, global_batch=gb, schedule=sched,
                         virtual_stages=v, recompute="full")
            try:
                validate_layout(model, lay)
            except InvalidLayout:
                continue
            pred = model.evaluate(lay, default_stages(model, lay))
            if pred.fits and (best is None or pred.iteration_time_s < best[0].iteration_time_s):
                best = (pred, lay)
    pred, lay = best
    s, vocab = 2048, 51200
    flops = 96 * gb * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))  # their Eq. 3
    return flops / (gpus * pred.iteration_time_s) / 1e12, lay.short()


def main() -> int:
    data = load()
    errors = []
    print("Korthikanti et al. 2022, Table 4: time per layer of the 22B GPT (tp=8, micro-batch 4)")
    for row, f, b in layer_times(data["korthikanti_2022_table4"]):
        tag = " (fit)" if row.get("fit") else ""
        print(f"  {row['recompute']:9s} sp={row['sequence_parallel']!s:5s} fwd {f:5.2f} ms vs {row['fwd_ms']:5.2f} "
              f"({100 * (f / row['fwd_ms'] - 1):+5.1f}%)   bwd {b:5.2f} ms vs {row['bwd_ms']:5.2f} "
              f"({100 * (b / row['bwd_ms'] - 1):+5.1f}%){tag}")
    print("Korthikanti et al. 2022, Table 5: iteration time")
    for run in data["korthikanti_2022_table5"]["runs"]:
        pred = predict_run(run)
        err = pred.iteration_time_s / run["iteration_s"] - 1
        if not run.get("fit"):
            errors.append(abs(err))
        print(f"  {run['name']:38s} {pred.iteration_time_s:7.2f} s vs {run['iteration_s']:7.2f} s  ({100 * err:+5.1f}%)"
              f"  MFU {100 * pred.mfu:4.1f}%{' (fit)' if run.get('fit') else ''}")
    print("Narayanan et al. 2021, Table 1: TFLOP/s per GPU (their Eq. 3), our fastest micro-batch/interleaving")
    for run in data["narayanan_2021_table1"]["runs"]:
        ours, lay = narayanan_best(run)
        err = ours / run["tflops"] - 1
        errors.append(abs(err))
        print(f"  {run['model'][1]:6d} hidden, {run['gpus']:5d} GPUs: {ours:6.1f} vs {run['tflops']} "
              f"({100 * err:+5.1f}%)  [{lay}]")
    print("Other runs (DeepSpeed pipeline engine; not asserted)")
    for run in data["other_runs"]:
        pred = predict_run(run)
        err = pred.iteration_time_s / run["iteration_s"] - 1
        print(f"  {run['name']:38s} {pred.iteration_time_s:7.2f} s vs {run['iteration_s']:7.2f} s  "
              f"({100 * err:+5.1f}%)")
    print(f"held-out Megatron references: {len(errors)}, mean |error| {100 * statistics.mean(errors):.1f}%, "
          f"max {100 * max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicted vs published iteration times and throughput of large runs, through the CLI's own code path
(``Workload.create(..., framework=...)`` and ``CostModel.evaluate``, as ``paraplan simulate`` does).

- A100, Megatron-LM 2021-22 (``--framework megatron-2021``): Korthikanti et al. 2022 Tables 4-5
  (benchmarks/data/published_runs.yaml) and Narayanan et al. 2021 Table 1 with the micro-batch sizes and
  interleaving of the published run script (benchmarks/data/megatron_sc21_microbatch.yaml);
- A100, BLOOM's layout sweep on Jean Zay (``--framework megatron-deepspeed`` with the switches of the fork it ran,
  BLOOM_SOFTMAX; benchmarks/data/bloom_sweep.yaml): the Spearman rank correlation of predicted and published
  TFLOP/s; and the DeepSpeed pipeline-engine runs (MT-NLG, BLOOM-176B) with the same profile, not asserted;
- H100 (``--framework megatron-core``): every expressible row of benchmarks/data/published_h100.yaml
  (benchmarks/published.py), split into the 12 rows the H100 efficiency was fitted to
  (benchmarks/fit_h100.py) and the held-out rest, with their errors reported separately.
The assertions live in tests/test_fidelity.py. Run: .venv/bin/python benchmarks/fidelity.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_h100  # noqa: E402
import published  # noqa: E402

from paraplan.models import spec_from_mapping
from paraplan.planner.costmodel import CostModel, framework_stages, validate_layout
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


def _price_run(run: dict, cluster: str, stack: dict, **layout):
    """A published run's prediction on ``cluster`` for the stack ``stack`` (Workload.create's framework and
    switches), its layout from the run (and ``layout``), priced on the stack's own stage split."""
    gpus = run["tp"] * run["pp"] * run["dp"]
    work = Workload.create(gpt(run["model"], run.get("vocab", 51200)), cluster, run["global_batch"],
                           nodes=max(1, gpus // 8), **stack)
    model = CostModel(work)
    lay = Layout(dp=run["dp"], tp=run["tp"], pp=run["pp"], micro_batch=run["micro_batch"],
                 global_batch=run["global_batch"], schedule="interleaved-1f1b" if run["v"] > 1 else "1f1b",
                 virtual_stages=run["v"], recompute=run["recompute"], sequence_parallel=run["sp"], **layout)
    validate_layout(model, lay)
    return model.evaluate(lay, framework_stages(model, lay))


def predict_run(run: dict):
    return _price_run(run, "dgx-a100-80gb", {**MEGATRON, "overlap_tp": run.get("overlap_tp", True)})


def predict_deepspeed_run(run: dict):
    """A Megatron-DeepSpeed run (published_runs.yaml other_runs) as its stack ran it: DeepSpeed's pipeline engine
    (1F1B, partitioned sends, the data-parallel reduce after the flush), ZeRO 1, 16-bit training; BLOOM on Jean
    Zay's cluster, MT-NLG on DGX A100s (Selene)."""
    cluster = "jean-zay-a100" if run["name"].startswith("BLOOM") else "dgx-a100-80gb"
    return _price_run(run, cluster, {"framework": "megatron-deepspeed"}, zero=1 if run["dp"] > 1 else 0,
                      dtype="bf16")


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


def narayanan_published() -> list[tuple[dict, float, float, Layout]]:
    """(row, our TFLOP/s by their Eq. 3, published TFLOP/s, layout) per row of Narayanan et al.'s Table 1, with
    the micro-batch size and interleaving of the published run script (examples/sc21/run_table_1.sh:
    full recomputation, fp16, 2048-token sequences, a 51,200-token vocabulary)."""
    rows = yaml.safe_load((DATA.parent / "megatron_sc21_microbatch.yaml").read_text())["rows"]
    out = []
    for row in rows:
        shape = row["model_shape"]
        layers, h = shape["num_layers"], shape["hidden_size"]
        gpus, tp, pp, gb = row["gpus"], row["tp"], row["pp"], row["global_batch"]
        per_chunk = row["num_layers_per_virtual_pipeline_stage"]
        v = layers // pp // per_chunk if isinstance(per_chunk, int) else 1
        work = Workload.create(gpt([layers, h, shape["num_attention_heads"]]), "dgx-a100-80gb", gb, nodes=gpus // 8,
                               **MEGATRON)
        model = CostModel(work)
        lay = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=row["micro_batch"], global_batch=gb,
                     schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v, recompute="full",
                     dtype="fp16")
        validate_layout(model, lay)
        pred = model.evaluate(lay, framework_stages(model, lay))
        s, vocab = 2048, 51200
        flops = 96 * gb * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))  # their Eq. 3
        out.append((row, flops / (gpus * pred.iteration_time_s) / 1e12,
                    row["table1_tflops_per_gpu_in_published_runs_yaml"], lay))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


# bigscience's Megatron-DeepSpeed as the sweep ran it (Feb 2022), through the CLI's switches: the fused softmax's
# availability check of 2021-10-21..2022-03-06 (--fused-softmax bigscience-2021-10; compute.softmax_falls_back),
# and, before the BF16 optimizer of 02-28, gradients accumulated in fp16 (--no-grad-reduce-in-fp32: "this is
# compared to fp16 which grad accumulates in fp16", chronicles-prequel.md line 899)
BLOOM_SOFTMAX = "bigscience-2021-10"


def bloom_sweep(fused_softmax: str = BLOOM_SOFTMAX) -> list[tuple[dict, float, float, object]]:
    """(row, our TFLOP/s by Megatron's Eq. 3, the published run's by Eq. 3 from its seconds per iteration,
    prediction) for every row of BLOOM's sweep on 384 GPUs that publishes the model's shape, the layout and its
    time: Megatron-DeepSpeed on Jean Zay (4 Omni-Path links per node), ZeRO 1 (or the row's stage), full
    recomputation, 2048-token sequences, a 250,880-token vocabulary. Rows that repeat another's configuration with
    its cells garbled (``repeats``) are left out, as the data file leaves out verbatim repeats. The published
    TFLOP/s are taken from the seconds per iteration (one formula for every row: one row's TFLOP/s cell came from
    the sweep's older estimate)."""
    rows = yaml.safe_load((DATA.parent / "bloom_sweep.yaml").read_text())["rows"]
    keys = ("num_layers", "hidden_size", "num_attention_heads", "tp", "pp", "dp", "micro_batch", "global_batch")
    out, models = [], {}
    for row in rows:
        if row.get("gpus") != 384 or not all(isinstance(row.get(k), int) for k in keys) or row.get("repeats") or \
                not isinstance(row.get("tflops_per_gpu"), (int, float)):
            continue
        layers, h, a = row["num_layers"], row["hidden_size"], row["num_attention_heads"]
        fp16_grads = not str(row.get("dtype", "")).startswith("bf16")
        key = (layers, h, a, row["global_batch"], fp16_grads)
        if key not in models:
            spec = gpt([layers, h, a], 250880)
            models[key] = CostModel(Workload.create(spec, "jean-zay-a100", row["global_batch"], nodes=48,
                                                    framework="megatron-deepspeed", fused_softmax=fused_softmax,
                                                    grad_reduce_in_fp32=not fp16_grads))
        model = models[key]
        lay = Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], micro_batch=row["micro_batch"],
                     global_batch=row["global_batch"], recompute="full", dtype="fp16",
                     zero=row.get("zero_stage", 1) if row["dp"] > 1 else 0)
        validate_layout(model, lay)
        pred = model.evaluate(lay, framework_stages(model, lay))
        s, vocab, gb = 2048, 250880, row["global_batch"]
        flops = 96 * gb * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
        published = flops / (384 * row["step_time_s"]) / 1e12 if isinstance(row.get("step_time_s"), int | float) \
            else row["tflops_per_gpu"]
        out.append((row, flops / (384 * pred.iteration_time_s) / 1e12, published, pred))
    return out


def h100() -> tuple[list, list]:
    """(fitted, held out): published.Predicted of every expressible H100 row."""
    runs, _ = published.h100_runs()
    preds = [published.predict(r) for r in runs]
    preds = [p for p in preds if p.prediction is not None]
    fitted = [p for p in preds if p.run.id in fit_h100.FIT_ROWS]
    return fitted, [p for p in preds if p.run.id not in fit_h100.FIT_ROWS]


def torchtitan_a100() -> tuple[list, list[tuple[str, str]]]:
    """(predicted, [(id, why left out)]): torchtitan's FSDP2 rows on 64 A100 80GB (published.torchtitan_a100_runs),
    priced on DGX A100 nodes (the runs' network is not published), all held out."""
    runs, skipped = published.torchtitan_a100_runs()
    return [published.predict(r, cluster="dgx-a100-80gb") for r in runs], skipped


def _summary(name: str, errors: list[float]) -> str:
    worst = max(errors, key=abs)
    return f"{name}: {len(errors)} rows, MAPE {100 * statistics.mean(map(abs, errors)):.1f}%, worst {100 * worst:+.1f}%"


def main() -> int:
    data = load()
    errors = []
    print("Korthikanti et al. 2022, Table 4: time per layer of the 22B GPT (tp=8, micro-batch 4), megatron-2021")
    for row, f, b in layer_times(data["korthikanti_2022_table4"]):
        tag = " (fit)" if row.get("fit") else ""
        print(f"  {row['recompute']:9s} sp={row['sequence_parallel']!s:5s} fwd {f:5.2f} ms vs {row['fwd_ms']:5.2f} "
              f"({100 * (f / row['fwd_ms'] - 1):+5.1f}%)   bwd {b:5.2f} ms vs {row['bwd_ms']:5.2f} "
              f"({100 * (b / row['bwd_ms'] - 1):+5.1f}%){tag}")
    print("Korthikanti et al. 2022, Table 5: iteration time, megatron-2021")
    for run in data["korthikanti_2022_table5"]["runs"]:
        pred = predict_run(run)
        err = pred.iteration_time_s / run["iteration_s"] - 1
        if not run.get("fit"):
            errors.append(err)
        print(f"  {run['name']:38s} {pred.iteration_time_s:7.2f} s vs {run['iteration_s']:7.2f} s  ({100 * err:+5.1f}%)"
              f"  MFU {100 * pred.mfu:4.1f}%{' (fit)' if run.get('fit') else ''}")
    print(_summary("  held out", errors))
    print("Narayanan et al. 2021, Table 1 with the published micro-batches (--framework megatron-2021)")
    nar = []
    for row, ours, pub, lay in narayanan_published():
        nar.append(ours / pub - 1)
        print(f"  {row['id']:18s} {lay.short():34s} {ours:6.1f} vs {pub} TFLOP/s ({100 * nar[-1]:+5.1f}%)")
    print(_summary("  Table 1 (all held out)", nar))
    print(f"BLOOM-176B layout sweep on Jean Zay (--framework megatron-deepspeed --fused-softmax {BLOOM_SOFTMAX}, "
          "--no-grad-reduce-in-fp32 before 02-28)")
    for rule in (BLOOM_SOFTMAX, "always"):
        bloom = bloom_sweep(rule)
        print(f"  --fused-softmax {rule}: {len(bloom)} rows, Spearman rank correlation of TFLOP/s: "
              f"{spearman([x[1] for x in bloom], [x[2] for x in bloom]):.3f}, mean |error| "
              f"{100 * statistics.mean(abs(x[1] / x[2] - 1) for x in bloom):.1f}%")
    print("Other runs (DeepSpeed's pipeline engine: --framework megatron-deepspeed, MT-NLG on DGX A100s, BLOOM on "
          "Jean Zay; not asserted)")
    for run in data["other_runs"]:
        pred = predict_deepspeed_run(run)
        err = pred.iteration_time_s / run["iteration_s"] - 1
        print(f"  {run['name']:38s} {pred.iteration_time_s:7.2f} s vs {run['iteration_s']:7.2f} s  "
              f"({100 * err:+5.1f}%)")
    print("H100 (--framework megatron-core): published step times (or tokens/s), fitted rows vs held out")
    fitted, held = h100()
    for label, group in (("fitted", fitted), ("held out", held)):
        for p in group:
            print(f"  [{label}] {p.run.id:52s} {p.layout.short():44s} {100 * p.error:+6.1f}%"
                  f"{'' if p.prediction.fits else '  DOES NOT FIT'}")
    print(_summary("  fitted", [p.error for p in fitted]))
    print(_summary("  held out", [p.error for p in held]))
    print(f"  published configurations predicted to fit: {sum(p.prediction.fits for p in fitted + held)} of "
          f"{len(fitted) + len(held)}")
    print("torchtitan FSDP2 on 64 A100 80GB (--framework torchtitan --cluster dgx-a100-80gb; tokens/s per GPU as "
          "published, August 2024), all held out")
    titan, skipped = torchtitan_a100()
    for p in titan:
        print(f"  {p.run.id:60s} {p.layout.short():24s} {p.prediction.iteration_time_s:7.3f} s vs "
              f"{p.run.value:7.3f} s ({100 * p.error:+5.1f}%){'' if p.prediction.fits else '  DOES NOT FIT'}")
    print(_summary("  held out", [p.error for p in titan]))
    print(f"  published configurations predicted to fit: {sum(p.prediction.fits for p in titan)} of {len(titan)}")
    for rid, why in skipped:
        print(f"  left out: {rid}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Close the loop: run layouts through the executor, compare measured with predicted.

For each layout: the planner's stage split and prediction (the same cost model `plan` uses), a plan
file, `paraplan execute` for a few steps, in PASSES passes over all the layouts, the measured step time
(the fastest pass's median of the steps after the first, which warms up) and peak memory. Then the mean
absolute percentage error of the predicted step times, Kendall's tau between the predicted and the
measured rankings, a predicted-vs-measured chart with the y = x line, and whether the planner's
recommendation is the measured-fastest.

``update_spec`` feeds the measurements back: the measured times are fitted as
a·(predicted compute) + c·(predicted communication) (non-negative least squares over the layouts), and
the cluster's spec is rescaled by those factors (GEMM peaks, memory bandwidth, per-kernel overhead and
the framework's per-event costs by a; link bandwidth and latency by c), so the next plan on this
cluster is calibrated by real runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from paraplan.hardware_specs import measurements_dir
from paraplan.hardware_specs.identity import markdown_notes
from paraplan.planner import chart_guard
from paraplan.planner.api import plan_for
from paraplan.planner.costmodel import CostModel, Prediction, validate_layout
from paraplan.planner.errors import InvalidLayout, PlanError
from paraplan.planner.ilp import best_partition
from paraplan.planner.layout import Layout
from paraplan.planner.plan import label_prediction
from paraplan.planner.search import search
from paraplan.planner.strategies import parse_strategy, strategy_layout
from paraplan.planner.workload import Workload

from .errors import ExecutionError

COMPUTE_KEYS = ("compute", "recompute", "bubble", "optimizer")
COMM_KEYS = ("tp_comm", "pp_comm", "dp_comm", "cp_comm", "ep_comm", "host")  # host: in tp_comm until split out
PASSES = 2  # each layout is run this many times, in turn with the others; the fastest pass counts


@dataclass
class Row:
    name: str
    source: str  # default | strategy | planner #k
    layout: Layout
    prediction: Prediction | None = None
    measured_s: float | None = None
    measured_memory_gib: float | None = None
    status: str = "ok"
    plan_path: str = ""
    pass_medians_s: list[float] = field(default_factory=list)  # each pass's median step time

    @property
    def predicted_s(self) -> float | None:
        return self.prediction.iteration_time_s if self.prediction else None

    @property
    def error(self) -> float | None:
        if self.predicted_s is None or not self.measured_s:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s


def default_strategies(gpus: int, global_batch: int) -> list[str]:
    """A spread of layouts: dp, tp, pp with GPipe and 1F1B at several micro-batch counts, recomputation on
    and off, ZeRO 0 and 3 (issue 8)."""
    per = global_batch // gpus if global_batch % gpus == 0 else 1
    small, big = 1, max(1, per)
    mid = max(1, per // 2)
    out = [f"dp={gpus},mb={big}", f"dp={gpus},mb={small}", f"dp={gpus},zero=3,mb={mid}",
           f"dp={gpus},recompute=full,mb={mid}", f"tp={gpus},mb={max(1, global_batch // 2)}",
           f"tp={gpus},sp=1,mb={max(1, global_batch // 2)}", f"tp={gpus},recompute=selective,mb={global_batch}"]
    for sched in ("gpipe", "1f1b"):
        for m in (gpus, 2 * gpus, 4 * gpus):
            if global_batch % m == 0:
                out.append(f"pp={gpus},schedule={sched},mb={global_batch // m}")
    return out


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b between two rankings (ties counted as in scipy's default)."""
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else float("nan")


def price(model: CostModel, lay: Layout, fixed_recompute: bool) -> tuple[Prediction, list[list[int]], list[str]]:
    validate_layout(model, lay)
    part = best_partition(model, lay, (lay.recompute,) if fixed_recompute else None)
    # the executor runs exactly this plan; the event simulator prices its schedule as it will run
    pred = model.evaluate(lay, part.stages, part.recompute, simulate=True)
    return pred, part.stages, part.recompute


def run_plan(plan_path: str, steps: int, out_dir: str, timeout: float) -> tuple[float, float | None]:
    """Run ``paraplan execute`` on a plan; (median steady step time, max peak memory over ranks)."""
    cmd = [sys.executable, "-m", "paraplan", "execute", "--plan", plan_path, "--steps", str(steps), "--out", out_dir,
           "--json", "--timeout", f"{timeout:g}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 3 + 120)
    if p.returncode != 0:
        raise ExecutionError((p.stderr.strip().splitlines() or ["execute failed"])[-1])
    record = json.loads(p.stdout)
    times = record["step_time_s"][1:] or record["step_time_s"]
    mems = [m for m in record.get("peak_memory_gib", []) if m is not None]
    return statistics.median(times), (max(mems) if mems else None)


def collect_layouts(work: Workload, gpus: int, strategies: list[str], top: int, dtype: str) -> list[Row]:
    rows: list[Row] = []
    texts = strategies or default_strategies(gpus, work.global_batch)
    source = "strategy" if strategies else "default"
    for text in texts:
        fields = parse_strategy(text)
        lay = strategy_layout(fields, gpus, work.global_batch, dtype, text)
        rows.append(Row(text, source, lay))
        rows[-1].fixed = "recompute" in fields  # type: ignore[attr-defined]
    if top:
        result = search(work, gpus, top_k=top, dtype=dtype)
        by_short = {r.layout.short(): r for r in rows}
        for k, cand in enumerate(result.ranked, 1):
            same = by_short.get(cand.layout.short())
            if same is not None and not getattr(same, "fixed", False):
                same.source += f", planner #{k}"  # already in the list: run it once, under both names
                continue
            rows.append(Row(cand.layout.short(), f"planner #{k}", cand.layout))
            rows[-1].fixed = False  # type: ignore[attr-defined]
            by_short[cand.layout.short()] = rows[-1]
    return rows


def validate(work: Workload, gpus: int, strategies: list[str], steps: int, top: int, out_dir: str,
             timeout: float = 300.0, progress=None, measure_blocks: bool = True, passes: int = PASSES) -> list[Row]:
    """Price every layout, then run them all ``passes`` times over, in turn: a layout's measured step time is
    the fastest of its passes' medians — how calibrate measures the framework's costs the predictions rest on
    (executor/framework_fit.py), so that a prediction and its measurement are taken alike. On a machine others
    share, work that is not ours only ever slows a run; passes spread over the whole validation also keep a
    slow first run (the machine warming up) or a busy minute from landing on one layout."""
    dtype = work.default_dtype()
    rows = collect_layouts(work, gpus, strategies, top, dtype)
    if measure_blocks and work.cluster.gpu.is_cpu:
        # this machine is the cluster: time the model's blocks here, as the executor's ranks will run them
        from .block_times import measure_block_times

        measure_block_times(work.spec, {r.layout.micro_batch for r in rows}, dtype, work.cluster.gpu.name, gpus)
        work._measurements.clear()
    model = CostModel(work)
    Path(out_dir, "plans").mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        try:
            pred, stages, modes = price(model, row.layout, getattr(row, "fixed", False))
        except (InvalidLayout, PlanError) as e:
            row.status = f"invalid: {e}"
            continue
        row.prediction = pred
        row.plan_path = str(Path(out_dir, "plans", f"{i:02d}.json"))
        plan = plan_for(work, row.layout, stages, pred, modes)
        label_prediction(plan, work)  # calibrated or not, and why, as plan's and simulate's files say
        plan.write(row.plan_path)
    runnable = [(i, row) for i, row in enumerate(rows) if row.plan_path]
    loads = []  # the 1-minute load average after each run: was the machine busy with others' work?
    for p in range(passes):
        for k, (i, row) in enumerate(runnable):
            if row.status != "ok":  # failed in an earlier pass: not again
                continue
            if progress:
                progress(p * len(runnable) + k, passes * len(runnable), row.name)
            run_dir = Path(out_dir, "runs", f"{i:02d}" if p == 0 else f"{i:02d}-pass{p + 1}")
            try:
                median, memory = run_plan(row.plan_path, steps, str(run_dir), timeout)
            except (ExecutionError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                row.status = f"failed: {e}"
                row.measured_s = None
                continue
            row.pass_medians_s.append(median)
            row.measured_s = min(row.pass_medians_s)
            if memory is not None:
                row.measured_memory_gib = max(memory, row.measured_memory_gib or 0.0)
            if hasattr(os, "getloadavg"):
                loads.append(os.getloadavg()[0])
    if progress:
        progress(passes * len(runnable), passes * len(runnable), "")
    from .calibrate import busy_note

    note = busy_note(statistics.mean(loads) if loads else None, gpus,
                     "during the runs: the measured step times include others' work")
    if note:
        work.notes.append(note)
    return rows


def summary(rows: list[Row]) -> dict:
    done = [r for r in rows if r.measured_s and r.predicted_s]
    if not done:
        raise ExecutionError("no layout ran to completion; nothing to compare")
    mape = statistics.mean(abs(r.error) for r in done)
    tau = kendall_tau([r.predicted_s for r in done], [r.measured_s for r in done]) if len(done) > 1 else float("nan")
    fastest = min(done, key=lambda r: r.measured_s)
    # the planner's recommendation is its #1 pick; if that did not run, the best-predicted layout that did
    planner = next((r for r in done if "planner #1" in r.source.split(", ")), None)
    predicted_best = min(done, key=lambda r: r.predicted_s)
    rec = planner or predicted_best
    return {"mape": mape, "kendall_tau": tau, "layouts": len(done), "measured_fastest": fastest.name,
            "recommended": rec.name, "recommended_vs_fastest": rec.measured_s / fastest.measured_s - 1}


def write_outputs(rows: list[Row], stats: dict, out_dir: str, title: str, calibrated: bool = True,
                  notes: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The report (validation.md), the predicted-vs-measured chart and validation.json; ``calibrated`` and
    ``notes`` (executor/autocalibrate.py) label uncalibrated predictions in all three. A chart that cannot be
    drawn is left out, and the report and JSON say why (planner/chart_guard.py)."""
    files = {"report": str(Path(out_dir, "validation.md")), "chart": str(Path(out_dir, "predicted_vs_measured.png")),
             "json": str(Path(out_dir, "validation.json"))}
    notes = list(notes)
    drawn = chart_guard.draw(notes, "predicted vs measured",
                             lambda: _chart(rows, stats, files["chart"], title, calibrated))
    if not drawn:
        del files["chart"]
    lines = [f"# Validation: {title}", "",
             f"- layouts run: {stats['layouts']}; mean absolute percentage error **{100 * stats['mape']:.1f}%**; "
             f"Kendall's tau **{stats['kendall_tau']:.2f}**",
             f"- measured fastest: {stats['measured_fastest']}; recommended by the planner: {stats['recommended']} "
             f"({100 * stats['recommended_vs_fastest']:+.1f}% against the fastest)",
             *markdown_notes(notes), "",
             "| # | layout | source | predicted s | measured s | error | predicted GiB | measured GiB | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r.layout.short()} | {r.source} | {_f(r.predicted_s)} | {_f(r.measured_s)} | "
                     f"{'' if r.error is None else f'{100 * r.error:+.1f}%'} | "
                     f"{_f(r.prediction.peak_memory_gib if r.prediction else None)} | {_f(r.measured_memory_gib)} | "
                     f"{r.status} |")
    passes = max((len(r.pass_medians_s) for r in rows), default=0)
    how = "the median of the steps after the first (one pass over the layouts)" if passes <= 1 else \
        (f"the fastest of the layout's {passes} passes (all layouts are run in turn, {passes} times over), each pass "
         "the median of the steps after the first — as calibrate measures this machine")
    lines += ["", f"Measured step time: {how}. Measured memory: the largest peak over the ranks (CPU: the process's "
              "peak resident set, torch included).", "",
              *(["![predicted vs measured](predicted_vs_measured.png)", ""] if drawn else [])]
    Path(files["report"]).write_text("\n".join(lines))
    Path(files["json"]).write_text(json.dumps({**to_json(rows, stats), "calibrated": calibrated, "notes": list(notes)},
                                              indent=1))
    return files


def _chart(rows: list[Row], stats: dict, path: str, title: str, calibrated: bool) -> None:
    """Predicted against measured step time (planner/charts.py), the rows numbered as in the report's table."""
    from paraplan.planner import charts

    done = [(i, r) for i, r in enumerate(rows, 1) if r.measured_s and r.predicted_s]
    pick = next((k for k, (_, r) in enumerate(done) if r.name == stats["recommended"]), None)
    charts.predicted_vs_measured([r.measured_s for _, r in done], [r.predicted_s for _, r in done],
                                 [i for i, _ in done], pick, path, title,
                                 f"MAPE {100 * stats['mape']:.1f}%, Kendall tau {stats['kendall_tau']:.2f}"
                                 + ("" if calibrated else " (uncalibrated predictions)"))


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def to_json(rows: list[Row], stats: dict) -> dict:
    return {**stats, "rows": [{"plan": r.layout.short(), "name": r.name, "source": r.source,
                               "predicted_s": r.predicted_s, "measured_s": r.measured_s, "error": r.error,
                               "predicted_memory_gib": r.prediction.peak_memory_gib if r.prediction else None,
                               "measured_memory_gib": r.measured_memory_gib, "status": r.status,
                               "measured_passes_s": r.pass_medians_s,
                               "plan_file": r.plan_path} for r in rows]}


def fit_factors(rows: list[Row]) -> tuple[float, float]:
    """(a, c): measured ≈ a·compute + c·communication, least squares on relative errors, a and c >= 0."""
    import numpy as np

    done = [r for r in rows if r.measured_s and r.prediction]
    comp = np.array([sum(r.prediction.time_s.get(k, 0.0) for k in COMPUTE_KEYS) for r in done])
    # (a breakdown may lack cp, ep or host seconds: absent parts read as zero)
    comm = np.array([sum(r.prediction.time_s.get(k, 0.0) for k in COMM_KEYS) for r in done])
    meas = np.array([r.measured_s for r in done])
    a_mat = np.stack([comp / meas, comm / meas], axis=1)
    if comm.sum() > 0.02 * comp.sum():
        (a, c), *_ = np.linalg.lstsq(a_mat, np.ones(len(done)), rcond=None)
        if a > 0 and c > 0:
            return float(a), float(c)
    total = (comp + comm) / meas  # one factor for everything
    k = float(np.dot(total, np.ones(len(done))) / np.dot(total, total))
    return k, k


def update_spec(work: Workload, rows: list[Row], out: str | None = None) -> tuple[Path, float, float]:
    """Rescale the cluster's spec by the fitted compute and communication factors and write it where
    ``load_cluster`` finds it (hardware_specs/measurements/<cluster>.yaml unless ``out`` is given)."""
    from paraplan.hardware_specs import cluster_mapping

    from .calibrate import write_mapping

    a, c = fit_factors(rows)
    spec = cluster_mapping(work.cluster)
    gpu = spec["gpu"]
    gpu["peak_tflops"] = {d: (None if v is None else v / a) for d, v in gpu["peak_tflops"].items()}
    gpu["hbm_GBps"] = gpu["hbm_GBps"] / a
    gpu["efficiency"]["op_overhead_us"] = gpu["efficiency"]["op_overhead_us"] * a
    gpu["efficiency"]["framework_us"] = {k: v * a for k, v in gpu["efficiency"].get("framework_us", {}).items()}
    gpu["efficiency"]["source"] = f"{gpu['efficiency'].get('source', '')}; rescaled by validate (compute x{a:.3f})"
    for link in (x for x in ("intra_node", "inter_node") if x in spec):  # a one-node spec may have no network
        spec[link]["bandwidth_GBps"] = spec[link]["bandwidth_GBps"] / c
        spec[link]["latency_us"] = spec[link]["latency_us"] * c
    from paraplan.hardware_specs.identity import machine_identity

    spec["machine"] = machine_identity("cpu" if work.cluster.gpu.is_cpu else "cuda")  # the runs were measured here
    target = Path(out) if out else measurements_dir() / f"{work.cluster.name}.yaml"
    if not out:
        target.parent.mkdir(parents=True, exist_ok=True)  # the default folder: created on first use
    note = (f"# Rescaled by `paraplan validate --update-spec` from {len([r for r in rows if r.measured_s])} runs: "
            f"compute x{a:.3f}, communication x{c:.3f}.\n")
    write_mapping(spec, target, note)
    return target, a, c

"""Measure the framework's per-event costs from real executor runs (part of `paraplan calibrate`).

A host-bound run (a CPU, or small models on GPUs) pays for more than its kernels: each training step,
micro-batch, tensor-parallel module call, FSDP unit and pipeline action costs host time in PyTorch's
eager machinery. To measure those costs, a calibration model (llama-tiny: not the model `validate`
checks) is trained for a few steps in layouts that exercise each event; for every run the cost model
gives the prediction without these costs, T0, and how many of each event lie on the iteration's
critical path, n_j (the change of the prediction when event j costs 1 ms, over 1 ms). The per-event
costs c_j >= 0 solve measured - T0 = sum_j c_j n_j.

Robustness (two calibrations used to disagree by 30% on an event; issue 13): every layout runs in one
torchrun launch (the start-up is paid once, so each layout can run more steps), twice over (``PASSES``),
and a layout's measured time is the faster of its two passes' medians (others' work on a shared machine
only adds time; a burst then spoils a pass, not the layout); the fit is non-negative least squares on
relative errors, made robust by iteratively down-weighting layouts whose residual is far beyond the
typical one (Huber weights), so one run disturbed by another process does not move every cost.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from paraplan.hardware_specs import FRAMEWORK_EVENTS
from paraplan.hardware_specs.identity import threads_per_rank
from paraplan.models import load_model_spec
from paraplan.planner.api import plan_for
from paraplan.planner.costmodel import CostModel
from paraplan.planner.ilp import best_partition
from paraplan.planner.strategies import parse_strategy, strategy_layout
from paraplan.planner.workload import Workload

from .block_times import measure_block_times
from .errors import ExecutionError, JobFailed

CALIBRATION_MODEL = "llama-tiny"
GLOBAL_BATCH = 8
# Each event is exercised by layouts that differ in how often it occurs (micro-batch counts 1-8, with and
# without FSDP, TP with and without sequence parallelism, two pipeline schedules at two micro-batch counts).
LAYOUTS = ("dp=2,mb=4", "dp=2,mb=1", "dp=2,zero=3,mb=2", "dp=2,zero=3,mb=4", "dp=2,zero=2,mb=4", "tp=2,mb=4",
           "tp=2,sp=1,mb=8", "pp=2,schedule=1f1b,mb=2", "pp=2,schedule=gpipe,mb=1", "pp=2,schedule=1f1b,mb=4")
STEPS = 5  # per layout and pass; the first of each run warms up and is not timed
PASSES = 2
HUBER_K = 1.5  # residuals beyond 1.5 robust standard deviations are down-weighted


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by elimination: solve, drop the most negative unknown, repeat."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        del active[int(np.argmin(sol))]
    return x


def robust_nnls(a: np.ndarray, b: np.ndarray, iterations: int = 100) -> np.ndarray:
    """:func:`nnls` with Huber weights (iteratively reweighted): rows whose residual exceeds ``HUBER_K``
    robust standard deviations (1.4826 x the median absolute residual) count with weight k·s/|r|."""
    w = np.ones(len(b))
    x = nnls(a, b)
    for _ in range(iterations):
        r = b - a @ x
        scale = 1.4826 * float(np.median(np.abs(r)))
        if scale <= 1e-12:
            break
        w_new = np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(r), 1e-300))
        if np.allclose(w_new, w):
            break
        w = w_new
        sw = np.sqrt(w)
        x = nnls(a * sw[:, None], b * sw)
    return x


def _with_framework(mapping: dict, costs: dict[str, float]) -> dict:
    return {**mapping, "gpu": {**mapping["gpu"], "efficiency": {**mapping["gpu"]["efficiency"],
                                                                "framework_us": costs}}}


def fit_framework(mapping: dict, ranks: int = 2, steps: int = STEPS, passes: int = PASSES,
                  seconds: dict[str, float] | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run the calibration layouts, fit the per-event costs (µs); returns them and the runs' details.
    ``seconds`` receives what the block timing and the runs cost."""
    tmp = Path(tempfile.mkdtemp(prefix="paraplan-framework-"))
    try:
        return _fit_in(tmp, mapping, ranks, steps, passes, {} if seconds is None else seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # plans, cluster copies and the runs' records and logs


def _fit_in(tmp: Path, mapping: dict, ranks: int, steps: int, passes: int,
            seconds: dict[str, float]) -> tuple[dict[str, float], list[dict]]:
    import yaml

    from .calibrate import write_mapping
    from .launch import LaunchOptions, launch
    from .machine import free_port

    spec_path = tmp / "cluster.yaml"
    base = _with_framework(mapping, {})
    write_mapping(base, spec_path, "# calibration in progress\n")
    work = Workload.create(CALIBRATION_MODEL, str(spec_path), GLOBAL_BATCH)
    layouts = [strategy_layout(parse_strategy(t), ranks, GLOBAL_BATCH, "fp32", t) for t in LAYOUTS]
    clock = time.perf_counter()
    measure_block_times(load_model_spec(CALIBRATION_MODEL), {lay.micro_batch for lay in layouts}, "fp32",
                        work.cluster.gpu.name, ranks)
    seconds["framework_block_times"] = time.perf_counter() - clock
    probes = {}
    for event in FRAMEWORK_EVENTS:  # the same cluster with one event costing 1 ms
        probe_path = tmp / f"probe-{event}.yaml"
        probe_path.write_text(yaml.safe_dump(_with_framework(base, {event: 1000.0})))
        probes[event] = Workload.create(CALIBRATION_MODEL, str(probe_path), GLOBAL_BATCH)
        probes[event]._profiles = work._profiles
    model = CostModel(work)
    priced, plans = [], []
    for i, (text, lay) in enumerate(zip(LAYOUTS, layouts, strict=True)):
        part = best_partition(model, lay, (lay.recompute,))
        t0 = model.evaluate(lay, part.stages, part.recompute, simulate=True).iteration_time_s
        counts = []  # events on the critical path: d(prediction) / d(cost of the event)
        for event in FRAMEWORK_EVENTS:
            t1 = CostModel(probes[event]).evaluate(lay, part.stages, part.recompute, simulate=True).iteration_time_s
            counts.append((t1 - t0) / 1e-3)
        plan_path = str(tmp / f"plan-{i}.json")
        plan_for(work, lay, part.stages, None, part.recompute).write(plan_path)
        plans.append(plan_path)
        priced.append((text, t0, counts))
    outs = [str(tmp / f"run-{k}-{i}") for k in range(passes) for i in range(len(plans))]
    threads = threads_per_rank(ranks)
    clock = time.perf_counter()
    try:  # every layout, every pass, in one launch: torchrun and torch start once
        launch(plans * passes, outs, LaunchOptions(nproc_per_node=ranks, master_port=free_port("127.0.0.1"),
                                                   steps=steps, timeout_s=300.0, quiet=True,
                                                   threads_per_rank=threads))
    except JobFailed as e:
        raise ExecutionError(f"the calibration runs failed: {e}") from None
    seconds["framework_runs"] = time.perf_counter() - clock
    rows, targets, runs = [], [], []
    for i, (text, t0, counts) in enumerate(priced):
        medians = []
        for k in range(passes):
            with open(Path(outs[k * len(plans) + i], "run.json")) as f:
                steps_s = json.load(f)["step_time_s"]
            medians.append(statistics.median(steps_s[1:] or steps_s))
        measured = min(medians)
        rows.append([c / measured for c in counts])
        targets.append((measured - t0) / measured)
        runs.append({"layout": text, "measured_s": measured, "predicted_without_framework_s": t0,
                     "events": dict(zip(FRAMEWORK_EVENTS, counts, strict=True)), "pass_medians_s": medians})
    costs = robust_nnls(np.array(rows), np.array(targets))
    fitted = {e: round(float(c) * 1e6, 2) for e, c in zip(FRAMEWORK_EVENTS, costs, strict=True)}
    for run in runs:
        run["predicted_s"] = run["predicted_without_framework_s"] + sum(
            fitted[e] * 1e-6 * n for e, n in run["events"].items())
    return fitted, runs

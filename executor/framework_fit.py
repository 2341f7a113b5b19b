"""Measure the framework's per-event costs from real executor runs (part of `paraplan calibrate`).

A host-bound run (a CPU, or small models on GPUs) pays for more than its kernels: each training step,
micro-batch, tensor-parallel module call, FSDP unit and pipeline action costs host time in PyTorch's
eager machinery. To measure those costs, a calibration model (llama-tiny: not the model `validate`
checks) is trained for a few steps in layouts that exercise each event; for every run the cost model
gives the prediction without these costs, T0, and how many of each event lie on the iteration's
critical path, n_j (the change of the prediction when event j costs 1 ms, over 1 ms). The per-event
costs c_j >= 0 are the least-squares solution (errors relative to the measured times) of
measured - T0 = sum_j c_j n_j.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from paraplan.hardware_specs import FRAMEWORK_EVENTS
from paraplan.models import load_model_spec
from paraplan.planner.api import plan_for
from paraplan.planner.costmodel import CostModel
from paraplan.planner.ilp import best_partition
from paraplan.planner.strategies import parse_strategy, strategy_layout
from paraplan.planner.workload import Workload

from .block_times import measure_block_times
from .validate import run_plan

CALIBRATION_MODEL = "llama-tiny"
GLOBAL_BATCH = 8
LAYOUTS = ("dp=2,mb=4", "dp=2,mb=1", "dp=2,zero=3,mb=2", "dp=2,zero=2,mb=4", "tp=2,mb=4", "tp=2,sp=1,mb=8",
           "pp=2,schedule=1f1b,mb=2", "pp=2,schedule=gpipe,mb=1")


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


def fit_framework(mapping: dict, ranks: int = 2, steps: int = 8) -> tuple[dict[str, float], list[dict]]:
    """Run the calibration layouts, fit the per-event costs (µs); returns them and the runs' details."""
    import yaml

    from .calibrate import write_mapping

    tmp = Path(tempfile.mkdtemp(prefix="paraplan-framework-"))
    spec_path = tmp / "cluster.yaml"
    base = {**mapping, "gpu": {**mapping["gpu"], "efficiency": {**mapping["gpu"]["efficiency"], "framework_us": {}}}}
    write_mapping(base, spec_path, "# calibration in progress\n")
    work = Workload.create(CALIBRATION_MODEL, str(spec_path), GLOBAL_BATCH)
    layouts = [strategy_layout(parse_strategy(t), ranks, GLOBAL_BATCH, "fp32", t) for t in LAYOUTS]
    measure_block_times(load_model_spec(CALIBRATION_MODEL), {lay.micro_batch for lay in layouts}, "fp32",
                        work.cluster.gpu.name, ranks)
    rows, targets, runs = [], [], []
    for i, (text, lay) in enumerate(zip(LAYOUTS, layouts, strict=True)):
        model = CostModel(work)
        part = best_partition(model, lay, (lay.recompute,))
        t0 = model.evaluate(lay, part.stages, part.recompute, simulate=True).iteration_time_s
        counts = []
        for event in FRAMEWORK_EVENTS:  # events on the critical path: d(prediction) / d(cost of the event)
            probe = {**base, "gpu": {**base["gpu"], "efficiency": {**base["gpu"]["efficiency"],
                                                                   "framework_us": {event: 1000.0}}}}
            probe_path = tmp / f"probe-{event}.yaml"
            probe_path.write_text(yaml.safe_dump(probe))
            probe_work = Workload.create(CALIBRATION_MODEL, str(probe_path), GLOBAL_BATCH)
            probe_work._profiles = work._profiles
            t1 = CostModel(probe_work).evaluate(lay, part.stages, part.recompute, simulate=True).iteration_time_s
            counts.append((t1 - t0) / 1e-3)
        plan = plan_for(work, lay, part.stages, None, part.recompute)
        plan_path = str(tmp / f"plan-{i}.json")
        plan.write(plan_path)
        measured, _ = run_plan(plan_path, steps, str(tmp / f"run-{i}"), timeout=300.0)
        rows.append([c / measured for c in counts])
        targets.append((measured - t0) / measured)
        runs.append({"layout": text, "measured_s": measured, "predicted_without_framework_s": t0,
                     "events": dict(zip(FRAMEWORK_EVENTS, counts, strict=True))})
    costs = nnls(np.array(rows), np.array(targets))
    fitted = {e: round(float(c) * 1e6, 2) for e, c in zip(FRAMEWORK_EVENTS, costs, strict=True)}
    for run in runs:
        run["predicted_s"] = run["predicted_without_framework_s"] + sum(
            fitted[e] * 1e-6 * n for e, n in run["events"].items())
    return fitted, runs

"""Calibration and validation: the fits and statistics exactly, the commands end to end on this machine."""

from __future__ import annotations

import json
import math
import os

import pytest

from conftest import assert_one_line_error, run_cli
from paraplan.executor.calibrate import Calibration, calibrated_spec, fit_link
from paraplan.executor.framework_fit import nnls
from paraplan.executor.validate import Row, default_strategies, fit_factors, kendall_tau, summary
from paraplan.hardware_specs import load_cluster
from paraplan.hardware_specs.loader import cluster_from_mapping
from paraplan.planner.layout import Layout


def test_fit_link_recovers_alpha_beta():
    """Timings generated from the ring formulas with B = 4 GB/s and α = 50 µs fit back exactly."""
    bw, alpha = 4e9, 50e-6
    points = []
    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
        for n in (2, 4):
            points.append(("all_reduce", n, nbytes, 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha))
            points.append(("all_gather", n, nbytes, (n - 1) / n * nbytes / bw + (n - 1) * alpha))
        points.append(("send_recv", 2, nbytes, nbytes / bw + alpha))
    got_bw, got_alpha = fit_link(points)
    assert got_bw == pytest.approx(4.0, rel=1e-6) and got_alpha == pytest.approx(50.0, rel=1e-6)


def test_kendall_tau_b():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # scipy.stats.kendalltau([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) = 0.6
    assert kendall_tau([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) == pytest.approx(0.6)
    assert math.isnan(kendall_tau([1, 1], [2, 2]))


class _Pred:
    def __init__(self, comp, comm):
        self.time_s = {"compute": comp, "recompute": 0, "bubble": 0, "optimizer": 0, "tp_comm": comm, "pp_comm": 0,
                       "dp_comm": 0}
        self.iteration_time_s = comp + comm


def test_fit_factors_separates_compute_and_communication():
    """Measured = 1.3 x compute + 0.5 x communication is recovered from the predicted breakdowns."""
    rows = []
    for comp, comm in ((1.0, 0.1), (0.5, 0.6), (2.0, 0.3), (0.8, 1.0)):
        r = Row("x", "default", Layout(dp=1, tp=1, pp=1, micro_batch=1, global_batch=1))
        r.prediction = _Pred(comp, comm)
        r.measured_s = 1.3 * comp + 0.5 * comm
        rows.append(r)
    a, c = fit_factors(rows)
    assert (a, c) == (pytest.approx(1.3), pytest.approx(0.5))


def test_nnls_recovers_non_negative_costs_and_clamps_a_negative_one():
    """Framework costs are >= 0: an exact non-negative solution is found; a column whose unconstrained
    coefficient would be negative is dropped to 0 and the rest refitted."""
    import numpy as np

    a = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0], [3.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    x = np.array([0.5, 1.5, 2.0])
    assert nnls(a, a @ x) == pytest.approx(x)
    b = a @ np.array([1.0, 2.0, -3.0])
    got = nnls(a, b)
    assert got[2] == 0 and (got >= 0).all()
    refit, *_ = np.linalg.lstsq(a[:, :2], b, rcond=None)
    assert got[:2] == pytest.approx(refit)


def test_summary_recommends_the_planners_first_pick_even_when_it_was_a_default_layout():
    """The planner's #1 often equals one of the default spread; validate runs it once under both names,
    and the recommendation it judges is that #1 (not the next planner pick)."""
    rows = []
    for name, source, pred, meas in (("a", "default, planner #1", 1.0, 1.0), ("b", "default", 1.5, 1.4),
                                     ("c", "planner #2", 1.1, 1.2)):
        r = Row(name, source, Layout(dp=1, tp=1, pp=1, micro_batch=1, global_batch=1))
        r.prediction, r.measured_s = _Pred(pred, 0.0), meas
        rows.append(r)
    stats = summary(rows)
    assert stats["recommended"] == "a" and stats["measured_fastest"] == "a"
    assert stats["recommended_vs_fastest"] == 0
    assert stats["mape"] == pytest.approx((0 + 0.1 / 1.4 + 0.1 / 1.2) / 3)


def test_calibrated_spec_loads_back_with_the_measurements():
    cal = Calibration(device="cpu", threads=1, ranks=2,
                      gemm={"fp32": [(1e6, 2e10), (1e8, 5e10), (1e9, 6e10)]}, bandwidth_GBps=15.0,
                      op_overhead_us=7.5, link_bandwidth_GBps=3.0, link_latency_us=40.0)
    spec = cluster_from_mapping(calibrated_spec(load_cluster("local"), cal), "x")
    assert spec.gpu.peak_flops("fp32") == pytest.approx(6e10)
    assert spec.gpu.efficiency.matmul_fraction(1e6, "fp32") == pytest.approx(2 / 6, rel=1e-3)
    assert spec.gpu.efficiency.op_overhead_us == 7.5 and spec.gpu.hbm_GBps == 15.0
    assert spec.intra_node.bandwidth_GBps == 3.0 and spec.intra_node.latency_us == 40.0


def test_default_spread_has_at_least_eight_layouts():
    spread = default_strategies(2, 8)
    assert len(spread) >= 8
    kinds = " ".join(spread)
    for must in ("dp=2", "tp=2", "schedule=gpipe", "schedule=1f1b", "zero=3", "recompute=full"):
        assert must in kinds


def test_calibrate_command_writes_a_spec(tmp_path):
    out = tmp_path / "local.yaml"
    p = run_cli("calibrate", "--quick", "--out", str(out), "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    spec = load_cluster(str(out))
    assert spec.gpu.peak_flops("fp32") > 1e9 and spec.intra_node.bandwidth_GBps > 0
    assert r["op_overhead_us"] > 0 and len(r["collectives"]) >= 4


@pytest.mark.slow  # runs a spread of layouts through the executor (~35 s)
def test_validate_command_runs_layouts_and_compares(tmp_path):
    p = run_cli("validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8",
                "--strategy", "dp=2,mb=4", "--strategy", "pp=2,schedule=1f1b,mb=2", "--steps", "3", "--top", "0",
                "--out", str(tmp_path), "--json", timeout=900)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert {"mape", "kendall_tau", "rows"} <= set(r)
    assert [x["plan"] for x in r["rows"]] == ["dp2 tp1 pp1 mb4", "dp1 tp1 pp2 mb2 1f1b"]
    for row in r["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert row["error"] == pytest.approx((row["predicted_s"] - row["measured_s"]) / row["measured_s"])
        assert len(row["measured_passes_s"]) == 2 and row["measured_s"] == min(row["measured_passes_s"])
    assert (tmp_path / "validation.md").exists() and (tmp_path / "predicted_vs_measured.png").exists()


def test_validate_runs_every_layout_in_passes_and_keeps_the_fastest(tmp_path, monkeypatch):
    """All layouts run in turn, then again; each keeps its faster pass's median (calibrate's own rule); a
    layout that fails is not run again and has no measurement."""
    from paraplan.executor import validate as v
    from paraplan.executor.errors import ExecutionError
    from paraplan.planner.workload import Workload

    times = {("00", 1): 0.30, ("01", 1): 0.20, ("00", 2): 0.25, ("01", 2): 0.40}
    calls = []

    def fake_run(plan_path, steps, out_dir, timeout):
        name = os.path.basename(out_dir)
        index, pass_ = name[:2], 2 if "pass2" in name else 1
        calls.append((index, pass_))
        if index == "02":
            raise ExecutionError("rank 1 exited with code 1")
        return times[(index, pass_)], 0.5

    monkeypatch.setattr(v, "run_plan", fake_run)
    work = Workload.create("gpt-tiny", "local", 8)
    rows = v.validate(work, 2, ["dp=2,mb=4", "pp=2,schedule=1f1b,mb=2", "tp=2,mb=4"], 3, 0, str(tmp_path),
                      measure_blocks=False)
    assert calls == [("00", 1), ("01", 1), ("02", 1), ("00", 2), ("01", 2)]
    assert [r.measured_s for r in rows] == [0.25, 0.20, None]
    assert rows[0].pass_medians_s == [0.30, 0.25] and rows[2].status.startswith("failed: rank 1")


def test_validate_refuses_more_gpus_than_the_cluster():
    p = run_cli("validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "16", "--global-batch", "8")
    assert_one_line_error(p, "--gpus 16 is more than")

"""A solver that fails to run never ends a plan: the layout keeps its balanced split, polished on the exact
cost model, and says why (issue 13). Failures are injected by making every solver raise."""

from __future__ import annotations

import pulp
import pytest

import paraplan.planner.ilp as ilp
from paraplan.planner.costmodel import CostModel
from paraplan.planner.layout import Layout
from paraplan.planner.search import enumerate_layouts, search
from paraplan.planner.workload import Workload


@pytest.fixture
def broken_solvers(monkeypatch):
    def fail(prob, name, **kwargs):
        raise pulp.PulpSolverError(f"Pulp: Error while trying to execute {name} (injected)")

    monkeypatch.setattr(ilp, "_run_solver", fail)


def test_failed_solvers_fall_back_to_the_balanced_split(broken_solvers):
    work = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1)
    model = CostModel(work)
    lay = Layout(dp=2, tp=1, pp=4, micro_batch=1, global_batch=64)
    part = ilp.best_partition(model, lay)
    assert part.ilp_status.startswith("solver failed (cbc: Pulp: Error while trying to execute cbc (injected)")
    assert part.prediction.fits
    # the fallback is the balanced split or better (polished), priced exactly
    from paraplan.planner.costmodel import default_stages

    balanced = model.evaluate(lay, default_stages(model, lay))
    assert part.prediction.iteration_time_s <= balanced.iteration_time_s * (1 + 1e-12)


def test_search_goes_on_and_reports_the_failure(broken_solvers):
    work = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1)
    # pipelined layouts of one chunk per rank only: a single stage needs no solver, and the heuristic search splits
    # interleaved and V layouts of identical layers without one (ilp.polished_quick_split)
    piped = [lay for lay in enumerate_layouts(work, 8, "bf16") if lay.pp > 1 and lay.virtual_stages == 1]
    result = search(work, 8, top_k=3, layouts=piped)
    assert result.best is not None and result.best.prediction.fits
    assert any("without an ILP solver" in note for note in result.notes)
    failed = [c for c in result.candidates if c.solver.startswith("solver failed")]
    assert failed and all(c.status_text().startswith("ok (solver failed") for c in failed)


def test_cbc_failing_falls_back_to_highs(monkeypatch):
    """The first solver failing hands the ILP to the next (HiGHS through highspy, in this process)."""
    real = ilp._run_solver
    used = []

    def cbc_fails(prob, name, **kwargs):
        used.append(name)
        if name == "cbc":
            raise pulp.PulpSolverError("Pulp: Error while trying to execute cbc (injected)")
        return real(prob, name, **kwargs)

    monkeypatch.setattr(ilp, "_run_solver", cbc_fails)
    monkeypatch.setattr(ilp, "SOLVER_ORDER", ("cbc", "highs"))
    work = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1)
    model = CostModel(work)
    part = ilp.best_partition(model, Layout(dp=2, tp=1, pp=4, micro_batch=1, global_batch=64))
    assert "highs" in used and not part.ilp_status.startswith("solver failed")


def test_highs_prints_nothing_beside_the_json(tmp_path):
    """highspy writes a banner on stdout (from C) with the first solver a process makes; `--json` must still print
    exactly one JSON object (DESIGN.md's CLI contract)."""
    from conftest import run_cli_json

    r = run_cli_json("plan", "--solver", "highs", "--no-charts", "--out", str(tmp_path / "report"))  # the demo
    assert r["ilp_solves"] > 0 and r["best"]["plan"]["pp"] > 1


def test_a_split_the_solver_passes_over_memory_is_refitted(monkeypatch):
    """A solver's answer that the exact model finds over the GPU's memory (HiGHS through PuLP returned one: its
    linear rows said it fit) is never the plan: its stages keep the least recomputation that fits them."""
    from paraplan.planner.costmodel import even_stages

    work = Workload.create("llama2-70b", "dgx-h100", 512)
    model = CostModel(work)
    lay = Layout(dp=16, tp=2, pp=2, micro_batch=1, global_batch=512, schedule="interleaved-1f1b", virtual_stages=6,
                 zero=3, sequence_parallel=True)
    stages = even_stages(model, lay)
    assert not model.evaluate(lay, stages, ["none"] * lay.num_stages).fits  # what the injected solver answers

    def over_memory(self, beta=0.0, start=None, cutoff_s=None):
        return stages, ["none"] * lay.num_stages, "optimal", 1.0

    monkeypatch.setattr(ilp.StageILP, "solve", over_memory)
    part = ilp.best_partition(model, lay, local_search=False)
    assert part.stages == stages and part.prediction.fits
    assert part.recompute == model.least_recompute(lay, stages, ilp.modes_for(model))[0]

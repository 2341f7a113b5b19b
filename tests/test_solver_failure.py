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
    assert part.ilp_status.startswith("solver failed (highs: Pulp: Error while trying to execute highs (injected); "
                                      "cbc: Pulp: Error while trying to execute cbc (injected)")
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


def test_each_formulation_tries_its_own_solver_first(monkeypatch):
    """Models of identical layers get a few integer counts per stage, others a binary per block, stage and mode,
    where CBC's root LP can outrun its time limit by minutes; HiGHS goes first in both (ilp.SOLVER_ORDER,
    ilp.BLOCK_SOLVER_ORDER); plan --solver puts its choice first in both."""
    from paraplan.models import spec_from_mapping

    real = ilp._run_solver
    first: list[str] = []

    def record(prob, name, **kwargs):
        first.append(name)
        return real(prob, name, **kwargs)

    monkeypatch.setattr(ilp, "_run_solver", record)
    layered = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1)
    ilp.best_partition(CostModel(layered), Layout(dp=2, tp=1, pp=4, micro_batch=1, global_batch=64))
    # one dense layer before the MoE ones: no longer identical layers
    mixed = spec_from_mapping(dict(name="dense-then-moe", family="llama", num_layers=4, hidden_size=256,
                                   num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=704, vocab_size=1000,
                                   seq_length=256, num_experts=4, experts_per_token=2, dense_layers=1), "test")
    work = Workload.create(mixed, "dgx-a100-80gb", 16, nodes=1)
    model = CostModel(work)
    assert not model.repeated_blocks(Layout(dp=4, tp=1, pp=2, micro_batch=1, global_batch=16))
    ilp.best_partition(model, Layout(dp=4, tp=1, pp=2, micro_batch=1, global_batch=16))
    assert first == ["highs", "highs"]


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_no_split_above_the_cutoff_comes_back(monkeypatch, solver):
    """Told a cutoff (the search's time to beat) that no split beats, either solver's ILP answers nothing: CBC
    proves it at its root; HiGHS, given the cutoff as its objective bound, stopped on a split above it (this
    layout's: 49.5 s, reported optimal, against its best 35.4 s), which must not come back as the layout's answer."""
    monkeypatch.setattr(ilp, "SOLVER_ORDER", (solver,))
    work = Workload.create("llama2-70b", "dgx-h100", 512)
    model = CostModel(work)
    lay = Layout(dp=4, tp=2, pp=4, micro_batch=1, global_batch=512, zero=2, sequence_parallel=True, cp=2)
    best = ilp.best_partition(model, lay, local_search=False)
    assert best is not None and best.ilp_status == "optimal"
    for below in (0.9, 0.99):
        assert ilp.best_partition(model, lay, cutoff_s=below * best.prediction.iteration_time_s) is None
    again = ilp.best_partition(model, lay, local_search=False, cutoff_s=1.01 * best.prediction.iteration_time_s)
    assert again.prediction.iteration_time_s == pytest.approx(best.prediction.iteration_time_s, rel=1e-9)


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


def test_an_ilp_that_finds_nothing_in_time_keeps_the_fitting_quick_split(monkeypatch):
    """A time-limited ILP that found no split (no cutoff given: the search's first batches) is not an out-of-memory
    verdict when the search's quick split fits: the layout keeps that split (Llama 4 Maverick's search had marked
    five fitting layouts out of memory so, two of which belonged in the top five)."""
    from paraplan.planner.search import quick_price

    work = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1)
    model = CostModel(work)
    lay = Layout(dp=2, tp=1, pp=4, micro_batch=1, global_batch=64)
    start = quick_price(model, lay, ilp.modes_for(model))
    assert start is not None and start.fits
    monkeypatch.setattr(ilp.StageILP, "solve", lambda self, beta, warm, cutoff: ([], [], "Not Solved", None))
    part = ilp.best_partition(model, lay, start=start)
    assert part.prediction.fits and part.ilp_status.startswith("not solved")
    assert part.prediction.iteration_time_s <= start.iteration_time_s * (1 + 1e-12)
    with pytest.raises(Exception, match="out of memory|no stage split fits"):
        ilp.best_partition(model, lay)  # with no split to fall back on, it still says so


def test_chunks_of_unlike_layers_start_from_blocks_dealt_evenly():
    """For interleaved chunks of unlike layers (Llama 4's dense and MoE layers alternate) the quick split also tries
    the blocks dealt evenly, a split the ILP's chunk rule accepts as its start (the time-balanced one is not)."""
    from paraplan.planner.costmodel import count_balanced_stages

    work = Workload.create("llama4-maverick", "dgx-h100", 1024, nodes=64, framework="megatron-core")
    model = CostModel(work)
    lay = Layout(dp=256, tp=1, pp=2, micro_batch=1, global_batch=1024, schedule="interleaved-1f1b",
                 virtual_stages=8, zero=3, ep=32)
    stages = count_balanced_stages(model, lay)
    n = len(work.profile("bf16").layers)
    assert [i for s in stages for i in s] == list(range(n)) and len(stages) == lay.num_stages
    assert ilp.chunks_balanced(stages, n, model.repeated_blocks(lay))
    assert count_balanced_stages(model, lay.replace(schedule="1f1b", virtual_stages=1)) is None

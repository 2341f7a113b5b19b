"""The polish's shortcuts (planner/ilp.py) change what it costs, never what it finds: the boundary moves it tries are
exactly those that keep the chunk rule, and its cheap pipeline test skips only moves the fit would have dropped."""

from __future__ import annotations

import random

import pytest

from paraplan.planner import ilp
from paraplan.planner.costmodel import (
    CostModel,
    even_stages,
    least_recompute_prediction,
    lighter_end_stages,
    pipeline_makespan,
)
from paraplan.planner.layout import Layout
from paraplan.planner.workload import Workload


def _split(rng: random.Random) -> tuple[list[list[int]], int]:
    stages = rng.randint(1, 12)
    n = rng.randint(stages, 6 * stages)
    cuts = sorted(rng.sample(range(1, n), stages - 1))
    bounds = [0, *cuts, n]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(stages)], n


@pytest.mark.parametrize("ends_ride_along", [True, False])
def test_chunk_rule_on_sizes_is_its_definition(ends_ride_along):
    """ilp._sizes_balanced answers the chunk rule's question — is there a floor f with every chunk within
    [f - slack, f + 1], the two end chunks' slack 1 where the ends ride along? — asked here of every floor, for every
    list of up to 6 chunk sizes from 0 to 4."""
    import itertools

    for length in range(1, 7):
        for sizes in itertools.product(range(5), repeat=length):
            slack = [1 if ends_ride_along and length > 1 and k in (0, length - 1) else 0 for k in range(length)]
            some_floor = any(all(f - e <= c <= f + 1 for c, e in zip(sizes, slack, strict=True))
                             for f in range(-2, 8))
            assert ilp._sizes_balanced(list(sizes), ends_ride_along) == some_floor, sizes


@pytest.mark.parametrize("ends_ride_along", [True, False])
def test_balanced_moves_are_the_moves_that_keep_the_chunk_rule(ends_ride_along):
    """_neighbours(balanced=...) yields, in the same order, the neighbours chunks_balanced accepts, for the boundary
    moves and for the mode changes alike (none of those where the split itself breaks the rule)."""
    rng = random.Random(7)
    allowed = ("none", "selective", "full")
    kept = 0
    for _ in range(600):
        stages, n = _split(rng)
        modes = [rng.choice(allowed) for _ in stages]
        rank_of = [s % max(1, len(stages) // 2) for s in range(len(stages))]
        every = [(st, md) for st, md in ilp._neighbours(stages, modes, allowed, rank_of)
                 if ilp.chunks_balanced(st, n, ends_ride_along)]
        assert list(ilp._neighbours(stages, modes, allowed, rank_of, True, ends_ride_along)) == every
        kept += len(every)
    assert kept > 1000  # the rule lets many through: the comparison is not of empty lists


def test_pipeline_pretest_leaves_the_polished_split_as_it_was(monkeypatch):
    """polished_quick_split skips an end chunk's lighter split whose pipeline, with no stage recomputing, is no faster
    than the start: the fit that follows would have dropped it. With the pretest switched off (linear_makespan
    answering None) the answer is the same split, modes and time (an interleaved x3 layout of the README demo's, whose
    even split recomputes on some stages and one of whose four lighter splits is no faster without recomputation; the
    demo's pp8 cp2 x4 layout was one until the closed form priced the rounds, schedules.rounds_excess)."""
    work = Workload.create("llama2-70b", "dgx-h100", 512)
    lay = Layout(dp=2, tp=4, pp=8, micro_batch=1, global_batch=512, schedule="interleaved-1f1b",
                 virtual_stages=3, zero=2, sequence_parallel=True)
    answers = []
    for pretest in (True, False):
        model = CostModel(work)
        start = least_recompute_prediction(model, lay, even_stages(model, lay), ilp.modes_for(model))
        if not pretest:
            monkeypatch.setattr(ilp, "linear_makespan", lambda *args: None)
        if pretest:  # some lighter split is skipped by the pretest, so the comparison tests it
            assert any(pipeline_makespan(lay, model.stage_costs(lay, st, ["none"] * len(st))) >= start.iteration_time_s
                       for st in lighter_end_stages(model, lay))
        part = ilp.polished_quick_split(model, lay, start)
        answers.append((part.stages, part.recompute, part.prediction.iteration_time_s))
    assert answers[0] == answers[1]


def _floor_cases():
    """(layout, model) pairs of the kinds the polish prices: 1F1B with ZeRO 2 and 3, interleaved, zb-v, one rank."""
    work = Workload.create("llama2-70b", "dgx-h100", 512)
    base = dict(micro_batch=1, global_batch=512, sequence_parallel=True)
    return work, [Layout(dp=2, tp=2, pp=8, cp=2, zero=2, **base), Layout(dp=4, tp=2, pp=8, zero=3, **base),
                  Layout(dp=8, tp=2, pp=4, zero=3, schedule="interleaved-1f1b", virtual_stages=4, **base),
                  Layout(dp=4, tp=2, pp=8, zero=1, schedule="zb-v", virtual_stages=2, **base),
                  Layout(dp=16, tp=4, pp=1, zero=3, **base)]


def test_closed_form_floor_is_never_above_the_price():
    """CostModel.closed_form_floor, which lets the polish skip a neighbour without pricing it, is at most evaluate's
    closed-form iteration time for any split and per-stage modes (exactly, not within a tolerance: the skip must
    never drop a split the price would have kept), and with one pipeline rank, whose end is the only one, it is
    that time."""
    work, layouts = _floor_cases()
    model = CostModel(work)
    rng = random.Random(11)
    n = len(work.profile("bf16").layers)
    modes = ("none", "selective", "full")
    below = 0
    for lay in layouts:
        for _ in range(25):
            cuts = sorted(rng.sample(range(1, n), lay.num_stages - 1))
            bounds = [0, *cuts, n]
            stages = [list(range(bounds[j], bounds[j + 1])) for j in range(lay.num_stages)]
            chosen = [rng.choice(modes) for _ in stages]
            costs = model.stage_costs(lay, stages, chosen)
            floor = model.closed_form_floor(lay, costs)
            price = model.evaluate(lay, stages, chosen, costs=costs).iteration_time_s
            assert floor <= price, (lay.short(), stages, chosen)
            if lay.pp == 1:
                assert floor == price
            below += floor < price
    assert below > 0  # the pipelines' other ranks end later somewhere: a bound, not the price itself


def test_the_floor_leaves_the_polish_as_it_was(monkeypatch):
    """The polish with closed_form_floor finds the same split, modes and time as without it (the floor made
    useless), on layouts whose polish moves several times."""
    work, layouts = _floor_cases()
    for lay in layouts[:3]:
        answers = []
        for use_floor in (True, False):
            model = CostModel(work)
            if not use_floor:
                monkeypatch.setattr(CostModel, "closed_form_floor", lambda self, lay, costs: float("-inf"))
            start = least_recompute_prediction(model, lay, even_stages(model, lay), ilp.modes_for(model))
            part = ilp.polished_quick_split(model, lay, start) if lay.virtual_stages > 1 else \
                ilp._from_start(model, lay, ilp.modes_for(model), start, "test", True)
            answers.append((part.stages, part.recompute, part.prediction.iteration_time_s))
            monkeypatch.undo()
        assert answers[0] == answers[1], lay.short()


def test_a_stage_priced_alone_is_the_stage_priced_with_the_others():
    """CostModel.stage_cost (least_recompute's dearer modes, one stage at a time) gives the very object stage_costs
    gives for that stage, whichever is asked first."""
    work, layouts = _floor_cases()
    model = CostModel(work)
    lay = layouts[2]
    stages = even_stages(model, lay)
    alone = [model.stage_cost(lay, stages, s, "full") for s in range(0, len(stages), 3)]
    together = model.stage_costs(lay, stages, ["full"] * len(stages))
    assert all(a is together[s] for a, s in zip(alone, range(0, len(stages), 3), strict=True))
    assert model.stage_cost(lay, stages, 1, "selective") is model.stage_costs(lay, stages, ["selective"] * 32)[1]

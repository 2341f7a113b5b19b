"""The planner's front door for one layout: validate it, cut the model into stages, price it.

``simulate`` is what ``paraplan simulate`` and the executor's ``--plan`` predictions call; it returns
the Prediction and the runnable Plan (DESIGN.md: one object from planner to simulator to executor).
"""

from __future__ import annotations

import os

from paraplan.hardware_specs import cluster_mapping

from .costmodel import CostModel, Prediction, framework_stages, validate_layout
from .errors import PlanError
from .framework import switches_of
from .layout import Layout
from .plan import Plan, config_numerics
from .workload import Workload

# The event simulator walks every task of the iteration; beyond this many it would dominate the answer's
# latency, and the closed forms (exact on uniform stages) take over.
EVENT_SIM_MAX_TASKS = 400_000


def event_sim_tasks(lay: Layout) -> int:
    """The tasks the event simulator walks for ``lay``: a forward, a backward and a weight pass per stage and
    micro-batch (what EVENT_SIM_MAX_TASKS bounds)."""
    return lay.num_stages * lay.num_micro_batches * 3


def plan_for(work: Workload, lay: Layout, stages: list[list[int]], prediction: Prediction | None = None,
             stage_recompute: list[str] | None = None, seed: int = 0,
             layer_strategies: dict | None = None) -> Plan:
    names = [x.name for x in work.profile(lay.dtype).layers]
    return Plan(model=work.model_ref, cluster=work.cluster_ref, layout=lay,
                stages=[[names[i] for i in s] for s in stages], seed=seed, model_spec=work.spec.to_dict(),
                cluster_spec=cluster_mapping(work.cluster) if os.path.isfile(work.cluster_ref) else None,
                seq_length=work.seq_length, nodes=work.cluster.nodes, stage_recompute=stage_recompute,
                layer_strategies=layer_strategies or {}, attention=work.attention, framework=work.framework.name,
                framework_switches=switches_of(work.framework), model_numerics=config_numerics(work.model_ref),
                prediction=None if prediction is None else prediction.to_dict())


def stage_indices(work: Workload, lay: Layout, plan_stages: list[list[str]]) -> list[list[int]]:
    names = [x.name for x in work.profile(lay.dtype).layers]
    index = {n: i for i, n in enumerate(names)}
    try:
        return [[index[n] for n in s] for s in plan_stages]
    except KeyError as e:
        raise PlanError(f"stage lists {e.args[0]!r}, which is not a block of {work.spec.name}") from None


def simulate(work: Workload, lay: Layout, stages: list[list[int]] | None = None,
             stage_recompute: list[str] | None = None, event_sim: bool | None = None,
             keep_timeline: bool = False) -> tuple[Prediction, Plan]:
    """Price ``lay`` on ``work`` (unless given, stages as its framework cuts them: costmodel.framework_stages)
    and return the prediction and the plan. ``event_sim``: None = the event simulator up to EVENT_SIM_MAX_TASKS
    tasks, the closed forms beyond (the prediction says so); True = the event simulator whatever the count
    (``simulate --event-sim``); False = the closed forms."""
    model = CostModel(work)
    validate_layout(model, lay)
    stages = stages or framework_stages(model, lay)
    tasks = event_sim_tasks(lay)
    use_sim = bool(event_sim) or ((event_sim is None or keep_timeline) and tasks <= EVENT_SIM_MAX_TASKS)
    pred = model.evaluate(lay, stages, stage_recompute, simulate=use_sim, keep_timeline=keep_timeline)
    note = a2a_overlap_note(work, lay, [c.recompute for c in pred.stages])
    if note:
        pred.notes.append(note)
    if not use_sim and event_sim is None:
        pred.notes.append(f"timed by the closed forms, not the event simulation: it would walk {tasks:,} tasks "
                          f"(more than {EVENT_SIM_MAX_TASKS:,}); --event-sim runs it anyway")
    plan = plan_for(work, lay, stages, pred, stage_recompute)
    pred_dict = pred.to_dict()
    pred_dict["plan"] = {k: v for k, v in plan.to_dict().items() if k != "prediction"}
    plan.prediction = {k: v for k, v in pred_dict.items() if k != "plan"}
    return pred, plan


def a2a_overlap_note(work: Workload, lay: Layout, modes: list[str]) -> str | None:
    """Where --moe-a2a-overlap was asked for but hides nothing of this layout (moe.a2a_overlap_applies to none of its
    stages' recomputation modes), the note that says why: it is priced without it, as Megatron-Core would run it."""
    from .moe import a2a_overlap_applies

    fw = work.framework
    if not fw.moe_a2a_overlap or any(a2a_overlap_applies(fw, lay, u) for u in modes):
        return None
    return ("--moe-a2a-overlap does not apply to this layout, priced without it: Megatron-Core overlaps the "
            "all-to-alls only with ep > 1, two micro-batches or more per replica, no full recomputation nor of the MoE "
            "blocks (mlp, selective+mlp), and virtual stages under a pipeline")


def predict_plan(plan: Plan, spec=None) -> Prediction:
    """What the cost model predicts for ``plan`` exactly as written: its layout, stage boundaries and
    per-stage recomputation, on its cluster, for its framework (the dry run's and validate's yardstick)."""
    from paraplan.models import load_model_spec, spec_from_mapping

    if spec is None:
        spec = spec_from_mapping(plan.model_spec, "plan") if plan.model_spec else load_model_spec(plan.model)
    if plan.seq_length and spec.is_transformer and plan.seq_length != spec.seq_length:
        spec = spec.replace(seq_length=plan.seq_length)
    work = Workload.create(spec, plan.load_cluster() if plan.cluster_spec else plan.cluster, plan.layout.global_batch,
                           nodes=plan.nodes,
                           framework=plan.framework, attention=plan.attention, **plan.framework_switches)
    model = CostModel(work)
    lay = plan.layout
    validate_layout(model, lay)
    return model.evaluate(lay, stage_indices(work, lay, plan.stages), plan.stage_recompute)

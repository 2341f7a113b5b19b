"""What every export shares: the result type, the refusal error, and facts read off a plan.

An exporter turns a Plan into another stack's launch file. It either says everything the plan decided
(degrees, batch sizes, schedule, stage boundaries, ZeRO, recomputation, dtype) in that stack's own
terms, or refuses with one line naming the feature the stack cannot express. Where the stack can run
the layout but not exactly as planned (e.g. one recomputation mode for every stage), the export goes
ahead and says what changed in a note.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from paraplan.hardware_specs import HardwareSpecError
from paraplan.models import ModelSpec, ModelSpecError, TransformerSpec, load_model_spec, spec_from_mapping
from paraplan.profiler.errors import ProfileError

from ..errors import InvalidLayout, PlanError
from ..plan import Plan

RECOMPUTE_STRENGTH = {"none": 0, "norm+act": 1, "selective": 2, "mlp": 3, "selective+mlp": 4, "full": 5}


class ExportRefused(PlanError):
    """The target cannot express a feature of the plan (one line naming it; exit 2)."""

    def __init__(self, target: str, feature: str, why: str):
        super().__init__(f"{target} cannot express {feature}: {why}")
        self.target, self.feature = target, feature


@dataclass
class Export:
    """One exported file: its text, a suggested file name, the launch command, and what changed."""

    target: str
    text: str
    filename: str
    launch: str
    notes: list[str] = field(default_factory=list)
    where: str = ""  # where the launch command runs, e.g. "on each of the 2 nodes" ("" = once)
    values: dict[str, Any] = field(default_factory=dict)  # the plan's figures as the file states them
    files: dict[str, str] = field(default_factory=dict)  # files the main one needs, beside it: name -> text


@dataclass(frozen=True)
class StageShape:
    """One (virtual) pipeline stage as the frameworks count it: embedding, transformer layers, head."""

    embed: bool
    layers: int
    head: bool


def plan_spec(plan: Plan) -> ModelSpec:
    """The model the plan trains: its recorded ``model_spec`` or, failing that, the named model."""
    try:
        if plan.model_spec:
            return spec_from_mapping(plan.model_spec, source=f"plan model_spec ({plan.model})")
        return load_model_spec(plan.model)
    except ModelSpecError as e:
        raise PlanError(str(e)) from None


def model_blocks(spec: ModelSpec, dtype: str) -> list[str]:
    """The model's pipeline blocks in order: the layer names of its meta profile, the names the planner wrote the
    stages with (api.plan_for) and the blocks ``execute`` checks them against (models.block_names). A cached
    profile needs no torch; the planner profiles FP8 plans in bf16 (workload.profile), so that copy is the cached
    one (block names do not depend on the dtype)."""
    from paraplan.profiler.api import profile_model

    profile = profile_model(spec, "meta", micro_batch=1, dtype="bf16" if dtype == "fp8" else dtype)
    return [layer.name for layer in profile.layers]


def check_plan(plan: Plan, spec: ModelSpec, plan_path: str) -> None:
    """Refuse a plan no target should write a file for, as the planner and ``execute`` refuse it: its layout
    against the model (Layout.validate: tp dividing the heads, ep dividing dp x cp x tp and the experts, ...) and
    its cluster's GPUs for its ``nodes``, and its ``stages`` against the model's blocks (Plan.validate_stages:
    pp x virtual_stages stages, every block once, in model order). One PlanError line naming the file."""
    lay = plan.layout
    if spec.family == "custom":  # its blocks come from running the user's code, which nothing here does
        raise PlanError(f"{plan_path}: model {plan.model} is a python callable; plans of the zoo's families export")
    try:
        cluster = plan.load_cluster()
    except HardwareSpecError as e:
        if plan.cluster_spec is not None or os.path.isfile(plan.cluster):  # one here that cannot be read: say so
            raise PlanError(f"{plan_path}: 'cluster': {e}") from None
        cluster = None  # a cluster only known elsewhere: the export's placement() refuses it
    try:
        blocks = model_blocks(spec, lay.dtype)
    except (ModelSpecError, ProfileError) as e:
        raise PlanError(f"{plan_path}: model {plan.model}: {e}") from None
    try:
        lay.validate(spec, len(blocks), cluster.num_gpus if cluster is not None else None)
    except InvalidLayout as e:
        if e.reason == "more GPUs than the cluster":  # the plan's nodes: say what they hold
            raise PlanError(f"{plan_path}: 'nodes': {e} ({cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x "
                            f"{cluster.gpus_per_node} GPUs per node of {cluster.name})") from None
        raise PlanError(f"{plan_path}: {e}") from None
    try:
        plan.validate_stages(blocks)
    except PlanError as e:
        raise PlanError(f"{plan_path}: {e}") from None


def require_transformer(spec: ModelSpec, target: str, what: str) -> TransformerSpec:
    if not isinstance(spec, TransformerSpec):
        raise ExportRefused(target, f"a {spec.family} model", f"{what} trains transformer language models")
    return spec


def stage_shapes(plan: Plan) -> list[StageShape]:
    """Per (virtual) stage in model order: does it hold the embedding, how many layers, the head?"""
    shapes = []
    for names in plan.stages:
        unknown = [n for n in names if n not in ("embed", "head") and not n.startswith("layers.")]
        if unknown:
            raise PlanError(f"plan stage lists {unknown[0]!r}; exports know embed, layers.N and head")
        shapes.append(StageShape(embed="embed" in names, layers=sum(n.startswith("layers.") for n in names),
                                 head="head" in names))
    return shapes


def uniform_recompute(plan: Plan, target: str) -> tuple[str, str | None]:
    """One recomputation mode for the whole model, and a note when the plan chose one per stage.

    Frameworks apply one setting to every stage; the strongest mode any stage uses keeps every stage
    within the memory the plan allowed (it recomputes more than planned, so it runs slower).
    """
    modes = plan.stage_recompute or [plan.layout.recompute]
    if len(set(modes)) <= 1:
        return modes[0], None
    strongest = max(modes, key=RECOMPUTE_STRENGTH.__getitem__)
    return strongest, (f"the plan recomputes per stage ({', '.join(modes)}); {target} applies one mode to every "
                       f"stage, so '{strongest}' is used throughout (fits, but slower than predicted)")


def refuse_ps_and_sharded_heads(plan: Plan, target: str) -> None:
    """Parameter servers and class-sharded classifiers are this executor's own: no framework runs them."""
    lay = plan.layout
    if lay.dp_mode == "ps":
        raise ExportRefused(target, "parameter servers (dp_mode ps)",
                            "it synchronises gradients with collectives only; re-plan with --dp-mode allreduce")
    if lay.head_parallel > 1:
        raise ExportRefused(target, f"a class-sharded classifier (head_parallel {lay.head_parallel})",
                            "it has no per-layer hybrid parallelism; re-plan without --head-parallel")


@dataclass(frozen=True)
class Placement:
    """Where the plan's ranks go: nodes and processes per node."""

    world_size: int
    nodes: int
    per_node: int
    gpus: bool  # False for the CPU ('local') cluster


def placement(plan: Plan, target: str) -> Placement:
    """Fewest nodes of the plan's cluster that hold its ranks, with the same count on every node. A cluster known
    neither by the plan (cluster_spec) nor here is refused: its nodes and GPUs per node decide every launch line,
    and a guess (one node of all the GPUs) would launch another shape."""
    world = plan.layout.world_size
    try:
        cluster = plan.load_cluster()
    except HardwareSpecError:
        raise PlanError(f"{target}: cannot read the plan's cluster {plan.cluster!r} (no such spec name or file here, "
                        "and the plan carries no cluster_spec; its nodes and GPUs per node decide the launch); export "
                        "where that spec is known") from None
    gpn = cluster.gpus_per_node
    # the most ranks per node (at most gpn) that divides the world: one per node always does
    per_node = next(k for k in range(min(gpn, world), 0, -1) if world % k == 0)
    nodes = world // per_node
    return Placement(world, nodes, world // nodes, not cluster.gpu.is_cpu)


def header_lines(plan: Plan, plan_path: str, what: str) -> list[str]:
    """The comment lines that open every exported file: what it is and which plan it came from."""
    pred = plan.prediction or {}
    predicted = ""
    if pred.get("iteration_time_s"):
        predicted = f"; predicted {pred['iteration_time_s']:.4g} s/iteration"
        if pred.get("peak_memory_gib"):
            predicted += f", {pred['peak_memory_gib']:.1f} GiB/GPU"
    return [f"{what}, exported by paraplan from {plan_path}",
            f"{plan.model} on {plan.layout.world_size} GPUs of {plan.cluster}: {plan.layout.short()}{predicted} "
            f"(priced for framework {plan.framework}"
            + "".join(f", {k} {v}" for k, v in sorted(plan.framework_switches.items())) + ")"]

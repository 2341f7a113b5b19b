"""Exports: a plan as the launch files of the stacks people already run (DESIGN.md, the flow).

``export_plan(plan, target)`` returns an :class:`Export` (the file's text, a suggested name, the launch
command and notes on what the target runs differently), or raises :class:`ExportRefused` naming the
feature the target cannot express. One module per target: megatron, torchtitan (a TOML; torchtitan_model
picks torchtitan's model and writes the flavor module a model without a torchtitan flavor needs, which
``Export.files`` carries), torchtitan_cli (the same as command-line overrides), deepspeed, slurm.
"""

from __future__ import annotations

import importlib

from paraplan.models import ModelSpec

from ..errors import PlanError
from ..plan import Plan
from .common import Export, ExportRefused, check_plan, plan_spec

TARGETS = ("megatron", "torchtitan", "torchtitan-cli", "deepspeed", "slurm")
# the framework profiles (planner/framework.py) each target runs, the first its own: a plan priced for another says so
TARGET_STACKS = {"megatron": ("megatron-core", "megatron-2021", "megatron-deepspeed"),
                 "torchtitan": ("torchtitan", "paraplan"), "torchtitan-cli": ("torchtitan", "paraplan"),
                 "deepspeed": ("deepspeed", "megatron-deepspeed"), "slurm": ("paraplan",)}


def export_plan(plan: Plan, target: str, plan_path: str = "plan.json", spec: ModelSpec | None = None,
                **options) -> Export:
    """The plan as ``target``'s file. ``spec`` defaults to the plan's model; ``options`` go to the target
    (slurm: ``execute_flags``, the option strings ``paraplan execute`` accepts). A plan that does not cover its
    model or needs more GPUs than its cluster's nodes hold is refused first, whatever the target (check_plan)."""
    if target not in TARGETS:
        raise PlanError(f"unknown export target {target!r} (one of {', '.join(TARGETS)})")
    spec = spec if spec is not None else plan_spec(plan)
    check_plan(plan, spec, plan_path)
    return _export(plan, target, plan_path, spec, **options)


def _export(plan: Plan, target: str, plan_path: str, spec: ModelSpec, **options) -> Export:
    """``export_plan`` for a plan check_plan has passed."""
    module = importlib.import_module(f".{target.replace('-', '_')}", __name__)
    result = module.export(plan, plan_path, spec, **options)
    stacks = TARGET_STACKS[target]
    if plan.framework not in stacks:
        result.notes.append(f"the plan was priced for framework {plan.framework}, but {target} runs "
                            f"{'this executor' if target == 'slurm' else target}'s own stack: expect other memory "
                            f"and time than predicted (price it with --framework {stacks[0]} to compare)")
    routing = plan.framework_switches.get("moe_routing")
    if target == "megatron" and routing and routing != "uniform":
        result.notes.append(f"--moe-routing {routing} (a benchmark gate's expert choice) is not Megatron-Core's: its "
                            "router picks experts (forced balancing draws them at random)")
    # the switches the target's file carries (torchtitan's [optimizer] implementation: exports/torchtitan.py)
    carried = {"optimizer_implementation"} if target.startswith("torchtitan") else set()
    left = {k: v for k, v in plan.framework_switches.items() if k not in carried}
    if left and target not in ("megatron", "slurm"):  # slurm runs this executor's own stack
        result.notes.append(f"{target} runs its own settings for {', '.join(sorted(left))} "
                            f"(the plan was priced with {plan.framework}'s switches "
                            + ", ".join(f"{k} {v}" for k, v in sorted(left.items()))
                            + "): expect other memory and time than predicted")
    return result


def report_lines(plan_path: str, name: str = "plan.json") -> list[str]:
    """The report's closing section: the export command per target, or why the target cannot take the plan."""
    lines = ["## Run it with another stack", ""]
    try:
        plan = Plan.read(plan_path)
        spec = plan_spec(plan)
        check_plan(plan, spec, plan_path)  # once for every target
    except PlanError as e:
        return lines + [f"(export unavailable: {e})", ""]
    for target in TARGETS:
        try:
            result = _export(plan, target, name, spec)
        except PlanError as e:
            lines.append(f"- {target}: not exported — {e}")
            continue
        lines.append(f"- {target}: `paraplan export --plan {name} --to {target} --out {result.filename}`, then "
                     f"`{result.launch}`" + (f" {result.where}" if result.where else ""))
    return lines + [""]


__all__ = ["TARGETS", "Export", "ExportRefused", "export_plan", "report_lines"]

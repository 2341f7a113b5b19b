"""A plan made ready to run: the plan, the model spec and the checks that need no machine.

Both sides use it: the launcher refuses a plan that cannot run (one clear line, before anything
starts), and every rank builds its part of the model from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraplan.models import ModelSpec, TransformerSpec, block_names, load_model_spec, spec_from_mapping
from paraplan.planner.errors import PlanError
from paraplan.planner.layout import Layout
from paraplan.planner.plan import Plan

from .errors import ExecutionError
from .parallel_dims import ParallelDims


@dataclass(frozen=True)
class Job:
    plan: Plan
    spec: ModelSpec
    source: str  # the plan file, for messages

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def dims(self) -> ParallelDims:
        lay = self.layout
        return ParallelDims(dp=lay.dp, tp=lay.tp, pp=lay.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def num_stages(self) -> int:
        return len(self.plan.stages)

    @property
    def seq_length(self) -> int | None:
        if not isinstance(self.spec, TransformerSpec):
            return None
        return self.plan.seq_length or self.spec.seq_length

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_length or 1

    def recompute_of(self, stage: int) -> str:
        if self.plan.stage_recompute is not None:
            return self.plan.stage_recompute[stage]
        return self.layout.recompute

    @classmethod
    def load(cls, path: str) -> Job:
        """Read and check a plan file; every problem is one ExecutionError/PlanError line."""
        plan = Plan.read(path)
        if plan.model_spec:
            spec = spec_from_mapping(plan.model_spec, source=f"{path}: model_spec")
        else:
            spec = load_model_spec(plan.model)
        job = cls(plan=plan, spec=spec, source=path)
        job.check()
        return job

    def check(self) -> None:
        """Everything that can be refused without looking at the machine."""
        plan, lay, spec, src = self.plan, self.layout, self.spec, self.source
        if spec.family == "custom":
            raise ExecutionError(f"{src}: model {plan.model} is a python callable; the executor runs the zoo's "
                                 "families only")
        blocks = block_names(spec)
        try:
            lay.validate(spec, len(blocks))
            plan.validate_stages(blocks)
        except PlanError as e:
            raise ExecutionError(f"{src}: {e}") from None
        if lay.dp_mode != "allreduce":
            raise ExecutionError(f"{src}: dp_mode {lay.dp_mode!r} (parameter servers) is simulated, not executed; "
                                 "use dp_mode allreduce")
        if plan.layer_strategies:
            raise ExecutionError(f"{src}: per-layer strategies (layer_strategies) are not executed yet")
        if lay.dtype == "fp16":
            raise ExecutionError(f"{src}: fp16 training needs loss scaling, which the executor does not do; "
                                 "use bf16 (or fp32)")
        if plan.stage_recompute is not None:
            bad = [m for m in plan.stage_recompute if m not in ("none", "selective", "full")]
            if bad:
                raise ExecutionError(f"{src}: unknown recompute mode {bad[0]!r} in stage_recompute")
        if not isinstance(spec, TransformerSpec):
            if lay.tp > 1:
                raise ExecutionError(f"{src}: tensor parallelism for family {spec.family} (class-sharded "
                                     "classifier) is not executed yet")
            if lay.recompute != "none" or any(m != "none" for m in plan.stage_recompute or []):
                raise ExecutionError(f"{src}: recomputation is executed for transformer layers only")
        else:
            s = self.seq_length
            if spec.family != "llama" and s > spec.seq_length:
                raise ExecutionError(f"{src}: seq_length {s} exceeds the model's {spec.seq_length} positions")
            if lay.sequence_parallel and s % lay.tp:
                raise ExecutionError(f"{src}: sequence parallelism needs tp {lay.tp} to divide the sequence "
                                     f"length {s}")

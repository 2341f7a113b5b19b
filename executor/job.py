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
    stale_prediction: str = ""  # why the plan's prediction was left out (it prices another step than the plan runs)

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def dims(self) -> ParallelDims:
        lay = self.layout
        return ParallelDims(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, etp=lay.etp)

    @property
    def world_size(self) -> int:
        """Every rank the plan runs: dp x tp x pp trainers, plus parameter servers (dp_mode ps)."""
        return self.layout.world_size

    def is_server(self, rank: int) -> bool:
        """Parameter servers are the last ``ps_servers`` ranks (ps_protocol.py)."""
        return self.layout.dp_mode == "ps" and rank >= self.layout.num_gpus

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            lay = self.layout
            servers = f" + {lay.ps_servers} parameter servers" if lay.dp_mode == "ps" else ""
            raise ExecutionError(f"the plan needs dp x tp x pp = {lay.dp} x {lay.tp} x {lay.pp}{servers} = "
                                 f"{self.world_size} ranks, but {world_size} were launched")

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
        stale = job._stale_prediction()
        return cls(plan=plan.replace(prediction=None), spec=spec, source=path, stale_prediction=stale) if stale else job

    def _stale_prediction(self) -> str:
        """Why the plan's prediction does not price what the plan runs ("" where it does): its tokens per step
        (tokens/s x seconds) against global batch x sequence length, as after a hand edit of ``seq_length``. A run
        summary would have set the measured step beside another step's prediction."""
        pred = self.plan.prediction or {}
        seconds, rate = pred.get("iteration_time_s"), pred.get("tokens_per_s")
        if not all(isinstance(x, int | float) and x > 0 for x in (seconds, rate)):
            return ""
        priced, runs = seconds * rate, self.layout.global_batch * self.tokens_per_sample
        if abs(priced / runs - 1) <= 0.01:
            return ""
        return (f"{self.source}: the plan's prediction prices {priced:,.0f} tokens a step, the plan runs {runs:,.0f} "
                "(edited after it was priced?): its predicted figures are left out (paraplan simulate prices it again)")

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
        if lay.etp > 1:
            raise ExecutionError(f"{src}: expert tensor parallelism (etp {lay.etp}) is not executed yet; use etp 1 "
                                 "(experts whole on each expert-parallel rank)")
        if lay.dp_mode == "ps":
            self._check_parameter_servers()
        if lay.head_parallel > 1:
            self._check_class_sharded_head()
        if plan.layer_strategies:
            raise ExecutionError(f"{src}: layer_strategies for {next(iter(plan.layer_strategies))!r}: only the "
                                 "classifier 'head' can be sharded (head_parallel)")
        if "norm+act" in (lay.recompute, *(plan.stage_recompute or [])):
            raise ExecutionError(f"{src}: recompute norm+act (Megatron-Core's recompute_modules layernorm and moe_act) "
                                 "is priced for Megatron-Core, not executed: this executor recomputes none, selective, "
                                 "mlp, selective+mlp or full; export the plan --to megatron, or plan with those")
        try:  # the layout's own mode was checked by lay.validate; each stage's here
            lay.validate_stage_recompute(spec, plan.stage_recompute)
        except PlanError as e:
            raise ExecutionError(f"{src}: stage_recompute: {e}") from None
        if lay.dtype == "fp16":
            raise ExecutionError(f"{src}: fp16 training needs loss scaling, which the executor does not do; "
                                 "use bf16 (or fp32)")
        if lay.dtype == "fp8":  # priced by the planner (planner/fp8.py); running it needs FP8 tensor cores
            raise ExecutionError(f"{src}: fp8 plans are priced, not executed: FP8 GEMMs need an H100-class GPU and "
                                 "torchao's float8 training, which this executor does not drive yet (a CPU has no "
                                 "FP8 matmuls at all); run the same layout with --dtype bf16")
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
            window = getattr(spec, "sliding_window", None)
            if window is not None and s > window:  # Workload.create refuses it; a hand edit: here
                raise ExecutionError(f"{src}: seq_length {s} exceeds {spec.name}'s sliding_window {window}: this "
                                     "executor attends over whole sequences (no sliding window), so it would train "
                                     f"another model; use seq_length {window} or less")
            chunks = 2 * lay.cp if spec.causal else lay.cp
            if lay.cp > 1 and s % chunks:
                raise ExecutionError(f"{src}: context parallelism {lay.cp} cuts the sequence into {chunks} equal "
                                     f"chunks; the sequence length {s} does not divide")
            s //= lay.cp  # the tokens of each sequence one rank holds
            if lay.sequence_parallel and s % lay.tp:
                raise ExecutionError(f"{src}: sequence parallelism needs tp {lay.tp} to divide the sequence "
                                     f"length {s}{' per context-parallel rank' if lay.cp > 1 else ''}")
            if spec.num_experts and lay.tp > 1 and s % lay.tp:
                raise ExecutionError(f"{src}: MoE layers under tensor parallelism route 1/tp of each sequence per "
                                     f"rank; tp {lay.tp} must divide the sequence length {s}"
                                     f"{' per context-parallel rank' if lay.cp > 1 else ''}")

    def _check_parameter_servers(self) -> None:
        lay, src = self.layout, self.source
        if lay.tp > 1 or lay.pp > 1:
            raise ExecutionError(f"{src}: parameter servers (dp_mode ps) are executed for data parallelism only "
                                 f"(tp = pp = 1), the plan has tp {lay.tp} and pp {lay.pp}")
        if lay.zero:
            raise ExecutionError(f"{src}: parameter servers hold the optimizer themselves; use zero 0 with dp_mode ps")

    def _check_class_sharded_head(self) -> None:
        lay, spec, src = self.layout, self.spec, self.source
        k = lay.head_parallel
        if isinstance(spec, TransformerSpec):
            raise ExecutionError(f"{src}: a class-sharded classifier (head_parallel {k}) is executed for resnet, vgg "
                                 f"and mlp models, not {spec.family}")
        if lay.tp > 1 or lay.pp > 1 or lay.dp_mode != "allreduce" or lay.dp % k:
            raise ExecutionError(f"{src}: head_parallel {k} runs on data parallelism only (tp = pp = 1, dp_mode "
                                 f"allreduce) with k dividing dp {lay.dp}")
        if lay.zero:
            raise ExecutionError(f"{src}: a class-sharded classifier (head_parallel) is executed with zero 0 only, "
                                 f"the plan has zero {lay.zero}")
        if spec.num_classes % k:
            raise ExecutionError(f"{src}: head_parallel {k} does not divide the {spec.num_classes} classes")

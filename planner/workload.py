"""What is being trained, on what: the model (spec and profile), the cluster, the batch.

The profile is taken once per dtype on the meta device at one sample per micro-batch; every
per-micro-batch quantity the cost model needs is linear in the micro-batch size (FLOPs, bytes
moved, saved activations, boundary tensors), and each GEMM's size scales with it for the efficiency
curve. Measured block times, where a measurement file matches the workload exactly, replace the
estimates (see :mod:`paraplan.profiler.measurements`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from paraplan.hardware_specs import ClusterSpec, load_cluster
from paraplan.models import ModelSpec, load_model_spec, tokens_per_sample
from paraplan.profiler import ModelProfile, profile_for_planning
from paraplan.profiler.measurements import find_measurement

from .errors import PlanError
from .framework import PARAPLAN, Framework
from .framework import framework as framework_profile

# A config.json's max_position_embeddings above this (Llama 3.1's 131,072, Qwen3's 40,960) is worth a note when it
# becomes the planned sequence length by default
LONG_DEFAULT_SEQUENCE = 8192


@dataclass
class Workload:
    model_ref: str
    spec: ModelSpec
    cluster_ref: str
    cluster: ClusterSpec
    global_batch: int
    framework: Framework = PARAPLAN  # the software stack priced (planner/framework.py)
    # the share of each GPU's memory the planner leaves free for its own error against what the executor allocates
    # (plan and compare --memory-margin; 0.0: plans may fill the GPU, as simulate prices a layout)
    memory_margin: float = 0.0
    _profiles: dict[str, ModelProfile] = field(default_factory=dict, repr=False)
    _measurements: dict[tuple, dict | None] = field(default_factory=dict, repr=False)
    _tp_calls: dict[tuple, int] = field(default_factory=dict, repr=False)
    notes: list[str] = field(default_factory=list, repr=False)  # measurements found but not used, and why

    @classmethod
    def create(cls, model: str | ModelSpec, cluster: str | ClusterSpec, global_batch: int,
               seq_length: int | None = None, nodes: int | None = None, framework: str | Framework = "paraplan",
               attention: str | None = None, overlap_dp: bool | None = None,
               overlap_tp: bool | None = None, **switches) -> Workload:
        spec = load_model_spec(model) if isinstance(model, str) else model
        if spec.family == "custom":
            raise PlanError(f"{spec.name}: planning needs a zoo model or spec file (a callable's module has no "
                            "tensor-parallel plan or loss); use `paraplan profile` for callables")
        if seq_length is not None:
            if not spec.is_transformer:
                raise PlanError(f"--seq-len applies to language models; {spec.name} is a {spec.family}")
            spec = spec.replace(seq_length=seq_length)
        window = getattr(spec, "sliding_window", None)
        if window is not None and spec.seq_length > window:
            raise PlanError(f"{spec.name}: sliding_window {window} is shorter than the sequence ({spec.seq_length:,} "
                            f"tokens{'' if seq_length else ': the spec default'}): attention over a sliding "
                            f"window is not modelled; plan with --seq-len {window} or less (the window then covers "
                            "every sequence)")
        cl = load_cluster(cluster, nodes=nodes) if isinstance(cluster, str) else (
            cluster.with_nodes(nodes) if nodes else cluster)
        if global_batch <= 0:
            raise PlanError(f"--global-batch must be positive, got {global_batch}")
        moe_switches = sorted(k for k, v in switches.items() if k.startswith("moe_") and v is not None)
        if moe_switches and not getattr(spec, "is_moe", False):  # recorded in the plan, they would change nothing
            raise PlanError(f"--{moe_switches[0].replace('_', '-')}: {spec.name} has no experts (a mixture-of-experts "
                            "switch)")
        if switches.get("moe_shared_expert_overlap") and not getattr(spec, "num_shared_experts", 0):
            # Megatron-Core asserts moe_shared_expert_intermediate_size beside it: there is nothing to overlap
            raise PlanError(f"--moe-shared-expert-overlap: {spec.name} has no shared experts "
                            "(num_shared_experts is 0): there is nothing to overlap with the dispatcher")
        fw = framework_profile(framework, attention, overlap_dp, overlap_tp, **switches)
        model_ref = model if isinstance(model, str) else spec.name
        # a cluster file's absolute path: the plan it goes into must find it from any working directory
        cluster_ref = (os.path.abspath(cluster) if os.path.isfile(cluster) else cluster) if isinstance(cluster, str) \
            else cl.name
        work = cls(model_ref=model_ref, spec=spec, cluster_ref=cluster_ref, cluster=cl, global_batch=global_batch,
                   framework=fw)
        if seq_length is None and isinstance(model, str) and model.endswith(".json") and spec.is_transformer \
                and spec.seq_length > LONG_DEFAULT_SEQUENCE:
            work.notes.append(f"sequence length {spec.seq_length:,}: the config.json's max_position_embeddings, the "
                              "longest the model takes, not necessarily the length to train at; --seq-len sets it")
        return work

    @property
    def memory_limit_GiB(self) -> float:
        """GPU memory a plan may fill: the GPU's less the planning margin (``memory_margin``)."""
        return self.cluster.gpu.memory_GiB * (1.0 - self.memory_margin)

    @property
    def memory_limit_bytes(self) -> float:
        return self.memory_limit_GiB * 2**30

    @property
    def attention(self) -> str:
        return self.framework.attention

    @property
    def overlap_dp(self) -> bool:
        return self.framework.overlap_dp

    @property
    def overlap_tp(self) -> bool:
        return self.framework.overlap_tp

    @property
    def seq_length(self) -> int | None:
        return getattr(self.spec, "seq_length", None) if self.spec.is_transformer else None

    @property
    def tokens_per_sample(self) -> int:
        return tokens_per_sample(self.spec)

    def profile(self, dtype: str) -> ModelProfile:
        """The planning profile in ``dtype``; FP8 training's tensors are bf16 (only its GEMMs differ:
        compute.gemm_dtype, planner/fp8.py), so it shares the bf16 profile."""
        dtype = "bf16" if dtype == "fp8" else dtype
        if dtype not in self._profiles:
            self._profiles[dtype] = profile_for_planning(self.spec, dtype)
        return self._profiles[dtype]

    def tp_module_calls(self, block: int, sequence_parallel: bool) -> int:
        """Modules of block ``block`` that tensor parallelism wraps (what the executor parallelizes): the
        sharded linears and embeddings, plus under sequence parallelism the norms and the regions whose
        inputs are gathered. Each is one call per pass, and carries the framework's per-call cost."""
        key = (block, sequence_parallel)
        if key not in self._tp_calls:
            from paraplan.models import build_model, tp_plan, tp_style

            model = build_model(self.spec, "meta")
            plan = tp_plan(self.spec)
            styles = {"colwise", "rowwise", "vocab_embedding", "vocab_head"} | (
                {"norm", "region"} if sequence_parallel else set())
            name = model.block_names[block]
            self._tp_calls[key] = sum(1 for fqn, _ in model.get_submodule(name).named_modules()
                                      if tp_style(plan, f"{name}.{fqn}" if fqn else name) in styles)
        return self._tp_calls[key]

    def measurement(self, micro_batch: int, dtype: str) -> dict | None:
        key = (micro_batch, dtype)
        if key not in self._measurements:
            self._measurements[key] = find_measurement(self.cluster.gpu.name, self.spec.to_dict(), micro_batch,
                                                       self.seq_length, dtype, notes=self.notes)
        return self._measurements[key]

    def default_dtype(self) -> str:
        return "fp32" if self.cluster.gpu.is_cpu else "bf16"

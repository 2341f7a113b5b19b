"""A parallel layout: the degrees and switches that, with stage boundaries, make a Plan.

Following torchtitan's ParallelDims: one small frozen dataclass, validated against the model and
cluster; derived facts are properties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from paraplan.models import ModelSpec, TransformerSpec

from .errors import InvalidLayout

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")
RECOMPUTE = ("none", "norm+act", "selective", "mlp", "selective+mlp", "full")  # weakest to strongest (memory kept)


def recomputes_core(mode: str) -> bool:
    """Does recomputation ``mode`` rerun the attention core (and its prologue): "selective", alone or with the MLP
    ("selective+mlp": Megatron-Core's recompute_modules core_attn/mla_up_proj with mlp/moe, as NVIDIA's DeepSeek-V3
    recipes run)?"""
    return mode in ("selective", "selective+mlp")


def recomputes_mlp(mode: str) -> bool:
    """Does recomputation ``mode`` rerun the MLP sublayer (dense MLP or MoE block) under its own checkpoint?"""
    return mode in ("mlp", "selective+mlp")


def zero_bubble_recompute_refusal(spec: ModelSpec, mode: str, cp: int = 1) -> str | None:
    """Why a zb-v stage cannot recompute in ``mode`` (None: it can). torch's pipelining splits a stage's backward
    into an input pass and a weight pass (stage_backward_weight), which asks autograd once per parameter group: a
    checkpointed region that holds weights is recomputed once per group it holds (counted: a three-weight MLP, three
    times), and every copy is kept until the pass ends. Traced with execute --dry-run (torch 2.13): llama-12 dp2 pp2
    under full recomputation, the weight pass of a three-layer stage rose 2.0 GB, 7-8 times the layers' activations
    without recomputation (the ranks 14% and 48% over the prediction); latent attention's up-projections under
    selective recomputation and Mixtral's experts under mlp, 13% and 16% over. So zb-v recomputes only where no
    weight is checkpointed: the attention core alone (selective), on models without a weighted prologue (Qwen3's
    query/key norms, latent attention's up-projections; under context parallelism they are not recomputed)."""
    if mode == "none":
        return None
    if mode == "selective" and not ((getattr(spec, "qk_norm", False) or getattr(spec, "mla", False)) and cp == 1):
        return None
    what = {"selective": "the attention core with its query/key norms or latent up-projections", "mlp": "the MLP",
            "selective+mlp": "the MLP", "norm+act": "the norms", "full": "whole layers"}.get(mode, mode)
    return (f"zb-v with {mode} recomputation: torch's weight pass recomputes a checkpointed region ({what}) once per "
            "parameter group it holds and keeps every copy until the pass ends (llama-12 under full recomputation: "
            "7-8 times a layer's activations per layer); use " + ("no recomputation" if mode == "selective" else
                                                                  "selective or no recomputation")
            + " with zb-v, or another schedule")


def recomputes_norm_act(mode: str) -> bool:
    """Does recomputation ``mode`` rerun the separate norms and the routed experts' activation ("norm+act":
    Megatron-Core's recompute_modules layernorm and moe_act, output-discarding checkpoints, as NVIDIA's GPT-OSS
    H100 recipe runs)? planner/fused_activations.py says what they free, planner/costmodel.py what they cost."""
    return mode == "norm+act"
DTYPES = ("bf16", "fp16", "fp32", "fp8")  # fp8: GEMMs in FP8, everything else in bf16 (planner/fp8.py)
DP_MODES = ("allreduce", "ps")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    dtype: str = "bf16"
    dp_mode: str = "allreduce"
    ps_servers: int = 1
    ps_staleness: int = 0
    head_parallel: int = 1  # hybrid parallelism: the classifier sharded over this many data-parallel ranks
    cp: int = 1  # context parallelism: each sequence split over this many ranks
    ep: int = 1  # expert parallelism: experts spread over this many of a stage's dp x cp x tp ranks
    etp: int = 1  # expert tensor parallelism: each expert's weights split over this many ranks

    @property
    def num_gpus(self) -> int:
        """GPUs that train (parameter servers, when used, come on top)."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks that hold the same model chunk: gradients are averaged and ZeRO shards states over them —
        the data-parallel and the context-parallel ranks together (Megatron-Core's data-parallel group with
        context parallelism; the executor flattens its dp and cp mesh dimensions alike)."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.num_gpus + (self.ps_servers if self.dp_mode == "ps" else 0)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel replica runs per iteration (gradient accumulation steps)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def micro_batches_text(self) -> str:
        """The count of micro-batches per replica in words, singular for one (titles and console lines)."""
        m = self.num_micro_batches
        return f"{m} micro-batch" if m == 1 else f"{m} micro-batches"

    @property
    def experts_beside_tp_without_sp(self) -> bool:
        """Expert and tensor parallelism without sequence parallelism: what Megatron-Core refuses
        (Framework.moe_tp_needs_sp; model_parallel_config.py)."""
        return self.ep > 1 and self.tp > 1 and not self.sequence_parallel

    @property
    def num_stages(self) -> int:
        """Model chunks in the pipeline: pp ranks x virtual stages each."""
        return self.pp * self.virtual_stages

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    @classmethod
    def maker(cls, **common) -> Callable[..., Layout]:
        """A function making layouts that share ``common`` fields, each call's own fields on top: the same objects
        as ``Layout(**common, **fields)``, made without the frozen dataclass's field-by-field ``__init__`` (4.4 µs a
        layout; this, 0.7 µs). The search enumerates up to a million layouts (DeepSeek-V3 on 1024 GPUs: 950,000, 4.2 s
        the slow way).
        Neither checks the values; :meth:`validate` does."""
        base = dict(cls(dp=1, tp=1, pp=1, micro_batch=1, global_batch=1).__dict__) | common  # every field
        new = object.__new__

        def make(**fields) -> Layout:
            assert fields.keys() <= base.keys(), f"not Layout fields: {fields.keys() - base.keys()}"
            lay = new(cls)
            own = lay.__dict__
            own.update(base)
            own.update(fields)
            return lay

        return make

    def short(self) -> str:
        """A compact human name: dp8 tp4 pp2 mb1 1f1b z1 sel sp."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"{name}{getattr(self, name)}" for name in ("cp", "ep", "etp") if getattr(self, name) > 1]
        parts.append(f"mb{self.micro_batch}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.zero:
            parts.append(f"z{self.zero}")
        if self.recompute != "none":
            parts.append({"norm+act": "norm+act-rc", "selective": "sel", "mlp": "mlp-rc", "selective+mlp": "sel+mlp-rc",
                          "full": "full"}[self.recompute])
        if self.sequence_parallel:
            parts.append("sp")
        if self.dp_mode == "ps":
            parts.append(f"ps{self.ps_servers}" + (f"s{self.ps_staleness}" if self.ps_staleness else ""))
        if self.head_parallel > 1:
            parts.append(f"head/{self.head_parallel}")
        return " ".join(parts)

    def check_fields(self) -> None:
        """Raise InvalidLayout if a field is out of its range, whatever the model: degrees and batch sizes
        positive, a known schedule, recomputation, dtype, ZeRO stage and data-parallel mode."""
        if min(self.dp, self.tp, self.pp, self.cp, self.ep, self.etp, self.micro_batch, self.global_batch,
               self.virtual_stages, self.ps_servers) <= 0:  # (the search checks a million layouts: one test first)
            for name in ("dp", "tp", "pp", "cp", "ep", "etp", "micro_batch", "global_batch", "virtual_stages",
                         "ps_servers"):
                if getattr(self, name) <= 0:
                    raise InvalidLayout(f"{name} must be positive, got {getattr(self, name)}", f"{name} not positive")
        if self.schedule not in SCHEDULES:
            raise InvalidLayout(f"unknown schedule {self.schedule!r} (one of {', '.join(SCHEDULES)})", "schedule")
        if self.recompute not in RECOMPUTE:
            raise InvalidLayout(f"unknown recompute {self.recompute!r} (one of {', '.join(RECOMPUTE)})", "recompute")
        if self.dtype not in DTYPES:
            raise InvalidLayout(f"unknown dtype {self.dtype!r} (one of {', '.join(DTYPES)})", "dtype")
        if self.zero not in (0, 1, 2, 3):
            raise InvalidLayout(f"zero must be 0, 1, 2 or 3, got {self.zero}", "zero stage")
        if self.dp_mode not in DP_MODES:
            raise InvalidLayout(f"unknown dp mode {self.dp_mode!r}", "dp mode")
        if self.ps_staleness < 0:
            raise InvalidLayout("ps staleness must be >= 0", "ps staleness")

    def validate(self, spec: ModelSpec, num_blocks: int, cluster_gpus: int | None = None) -> None:
        """Raise InvalidLayout with the reason if this layout cannot run this model."""
        self.check_fields()
        if cluster_gpus is not None and self.world_size > cluster_gpus:
            extra = f" + {self.ps_servers} parameter servers" if self.dp_mode == "ps" else ""
            raise InvalidLayout(f"dp x cp x tp x pp = {self.num_gpus}{extra} needs more GPUs than the cluster's "
                                f"{cluster_gpus}", "more GPUs than the cluster")
        if self.global_batch % (self.dp * self.micro_batch):
            raise InvalidLayout(f"global batch {self.global_batch} is not divisible by dp x micro-batch = "
                                f"{self.dp} x {self.micro_batch}", "batch not divisible by dp x micro-batch")
        if isinstance(spec, TransformerSpec):
            if spec.num_attention_heads % self.tp:
                raise InvalidLayout(f"tp {self.tp} does not divide the {spec.num_attention_heads} attention heads",
                                    "tp does not divide heads")
            if spec.kv_heads % self.tp:  # the executor shards whole K/V heads (no replicated K/V heads)
                raise InvalidLayout(f"tp {self.tp} does not divide the {spec.kv_heads} key/value heads",
                                    "tp vs kv heads")
            if spec.ffn_size % self.tp:
                raise InvalidLayout(f"tp {self.tp} does not divide the FFN size {spec.ffn_size}", "tp vs ffn")
        else:
            if self.recompute != "none":
                raise InvalidLayout(f"recomputation is modelled and run for transformer layers; {spec.family} "
                                    "models train without it", "recompute on a non-transformer")
            if self.tp > 1:
                raise InvalidLayout(f"{spec.family} models shard only their classifier (hybrid parallelism: "
                                    "head_parallel), not the trunk (tp must be 1)", "tp on a non-transformer")
        if self.head_parallel > 1:
            if spec.is_transformer:
                raise InvalidLayout("a class-sharded classifier (head_parallel) is for resnet, vgg and mlp models; "
                                    "transformers shard their output layer with tp", "head_parallel on a transformer")
            if self.pp > 1 or self.tp > 1 or self.dp % self.head_parallel:
                raise InvalidLayout(f"head_parallel {self.head_parallel} needs tp = pp = 1 and must divide dp "
                                    f"{self.dp}", "head_parallel vs dp")
            if self.dp_mode == "ps" or self.zero:
                raise InvalidLayout("head_parallel runs with plain data parallelism (zero 0, all-reduce)",
                                    "head_parallel with ps or zero")
            if spec.num_classes % self.head_parallel:
                raise InvalidLayout(f"head_parallel {self.head_parallel} does not divide the {spec.num_classes} "
                                    "classes", "head_parallel vs classes")
        self._validate_cp_ep(spec)
        if self.sequence_parallel and self.tp == 1:
            raise InvalidLayout("sequence parallelism needs tp > 1", "sequence parallel without tp")
        if self.sequence_parallel and isinstance(spec, TransformerSpec) and spec.seq_length % self.tp:
            raise InvalidLayout(f"sequence parallelism needs tp {self.tp} to divide the sequence length "
                                f"{spec.seq_length}", "tp vs sequence")
        if self.pp == 1 and (self.virtual_stages > 1 or self.schedule in ("interleaved-1f1b", "zb-v")):
            raise InvalidLayout(f"schedule {self.schedule} with {self.virtual_stages} virtual stages needs pp > 1",
                                "pipeline schedule without pp")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise InvalidLayout("interleaved-1f1b needs --virtual-stages >= 2", "interleaved without virtual stages")
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise InvalidLayout(f"{self.schedule} runs one stage per rank; use interleaved-1f1b for virtual stages",
                                "virtual stages need interleaving")
        if self.schedule == "zb-v" and self.virtual_stages != 2:
            raise InvalidLayout("zb-v runs exactly two stages per rank (--virtual-stages 2)", "zb-v needs v=2")
        m = self.num_micro_batches
        if self.schedule == "interleaved-1f1b":
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise InvalidLayout(f"interleaved-1f1b needs the {m} micro-batches per replica to be a multiple of "
                                    f"max(1, m // pp) = {rounds}", "interleaved micro-batch count")
        # What torch.distributed.pipelining's schedules need beyond the layout itself (the executor runs them):
        if self.pp > 1 and self.schedule == "1f1b" and m < self.pp:
            raise InvalidLayout(f"1f1b needs at least pp = {self.pp} micro-batches per replica, the layout has {m}",
                                "1f1b with fewer micro-batches than pp")
        if self.pp > 1 and self.schedule == "zb-v" and m < 2 * self.pp:
            raise InvalidLayout(f"zb-v needs at least 2 x pp = {2 * self.pp} micro-batches per replica, the layout "
                                f"has {m}", "zb-v with fewer than 2 x pp micro-batches")
        if self.pp > 1 and self.schedule == "zb-v" and self.zero == 3 and self.dp > 1:
            # FSDP2 reshards the weights after the input-gradient pass, before ZB-V's separate weight-gradient
            # pass runs: torch 2.13 then computes wrong weight gradients (caught by tests/test_executor*.py).
            raise InvalidLayout("zb-v with ZeRO 3 is not supported by torch's pipelining (weights resharded before "
                                "the weight-gradient pass); use zero 2 or interleaved-1f1b", "zb-v with ZeRO 3")
        if self.schedule == "zb-v":  # the layout's own (heaviest stage's) mode; tested first: the search validates
            self.validate_stage_recompute(spec, [self.recompute])  # up to a million layouts
        if self.num_stages > num_blocks:
            raise InvalidLayout(f"pp x virtual stages = {self.num_stages} exceeds the model's {num_blocks} blocks",
                                "more stages than blocks")
        if self.dp_mode == "ps" and self.zero:
            raise InvalidLayout("parameter servers hold the optimizer themselves: use zero 0 with --dp-mode ps",
                                "ps with zero")

    def recompute_refusal(self, spec: ModelSpec, mode: str) -> str | None:
        """Why a stage of this layout cannot recompute in ``mode`` with its schedule (None: it can): zb-v's
        zero_bubble_recompute_refusal, for a pipeline of transformer layers."""
        if self.pp > 1 and self.schedule == "zb-v" and isinstance(spec, TransformerSpec):
            return zero_bubble_recompute_refusal(spec, mode, self.cp)
        return None

    def validate_stage_recompute(self, spec: ModelSpec, modes: list[str] | None) -> None:
        """Raise InvalidLayout if a stage's recomputation mode cannot run with this layout's schedule
        (:meth:`recompute_refusal`); :meth:`validate` checks the layout's own (its heaviest stage's) mode."""
        for mode in modes or []:
            why = self.recompute_refusal(spec, mode)
            if why:
                raise InvalidLayout(why, f"zb-v with {mode} recomputation")

    def _validate_cp_ep(self, spec: ModelSpec) -> None:
        """Context and expert parallelism: what the model and the other degrees must allow."""
        if self.cp > 1:
            if not isinstance(spec, TransformerSpec):
                raise InvalidLayout(f"context parallelism splits sequences; {spec.family} models have none",
                                    "cp on a non-transformer")
            # causal attention: each rank holds two of 2·cp chunks (load balance), each split by tp under SP
            chunks = (2 * self.cp if spec.causal else self.cp) * (self.tp if self.sequence_parallel else 1)
            if spec.seq_length % chunks:
                raise InvalidLayout(f"cp {self.cp} needs the sequence length {spec.seq_length} to split into {chunks} "
                                    "equal chunks", "cp vs sequence")
            if self.dp_mode == "ps" or self.head_parallel > 1:
                raise InvalidLayout("context parallelism runs with all-reduce data parallelism", "cp with ps")
        experts = getattr(spec, "num_experts", 0) or 0
        if self.ep > 1 or self.etp > 1:
            if not experts:
                raise InvalidLayout(f"ep {self.ep} / etp {self.etp}: {spec.name} has no experts", "ep without experts")
            if (self.dp * self.cp * self.tp) % (self.ep * self.etp):
                raise InvalidLayout(f"ep x etp = {self.ep * self.etp} must divide a stage's dp x cp x tp = "
                                    f"{self.dp * self.cp * self.tp} ranks (MoE parallel folding)", "ep vs dp x tp")
            if experts % self.ep:
                raise InvalidLayout(f"ep {self.ep} does not divide the {experts} experts", "ep vs experts")
            ffn = getattr(spec, "moe_ffn_hidden_size", None) or spec.ffn_size
            if ffn % self.etp:
                raise InvalidLayout(f"etp {self.etp} does not divide the expert FFN size {ffn}", "etp vs ffn")

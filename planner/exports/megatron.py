"""Megatron-LM: the plan as ``pretrain_gpt.py`` arguments, in a bash fragment that can be sourced or run.

Every flag name was checked against Megatron-LM's own parser (``add_megatron_arguments`` in
megatron/training/arguments.py, many of its flags generated from the config dataclasses) at the commit
in MEGATRON_SOURCE; tests/data/megatron_args.txt is that parser's list and the tests hold every flag
written here to it.

Mapping (plan -> Megatron-LM):
- tp, pp, cp, ep, etp -> --tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
  --expert-model-parallel-size, --expert-tensor-parallel-size (always given for MoE: Megatron's default is tp);
  data parallelism is what the world size leaves, as in the plan.
- stages -> nothing when they are Megatron's even split; --num-virtual-stages-per-pipeline-rank v when
  interleaved and even; --decoder-first/last-pipeline-num-layers when only the end stages differ;
  otherwise --pipeline-model-parallel-layout, which states every (virtual) stage exactly.
- ZeRO 1 -> --use-distributed-optimizer; ZeRO 2 / 3 -> Megatron-FSDP (--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads / optim_grads_params, with the flags NVIDIA's Megatron-FSDP scripts
  give it: MEGATRON_FSDP_FLAGS).
- recompute selective -> --recompute-granularity selective; norm+act -> selective with --recompute-modules layernorm
  moe_act; full -> full, uniform, one layer per checkpoint.
- dtype bf16/fp16 -> --bf16/--fp16; fp8 -> --bf16 --fp8-format hybrid (and --fp8-recipe tensorwise where priced with
  per-tensor current scaling; Megatron's default is delayed scaling); fp32 -> Megatron's default.
- the stack the plan was priced for (its framework and framework_switches), where Megatron's defaults run
  otherwise (STACK_ARGS): Megatron-style ZeRO accounting with 16-bit gradients -> --grad-reduce-in-bf16 (Megatron
  accumulates bf16 runs' gradients in fp32 unless told); FP8 parameters (no cached FP8 weight copy priced) ->
  --fp8-param-gather; bf16 Adam moments -> --use-precision-aware-optimizer
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16; the data-parallel overlap -> --overlap-grad-reduce (and
  --overlap-param-gather with the distributed optimizer where priced, always with Megatron-FSDP); MoE: the token
  dispatcher (--moe-token-dispatcher-type alltoall, or flex with --moe-flex-dispatcher-backend hybridep; Megatron's
  default is allgather), grouped GEMMs (--moe-grouped-gemm), the all-to-all overlap
  (--overlap-moe-expert-parallel-comm --delay-wgrad-compute).
Refused: the zb-v schedule, parameter servers, class-sharded heads, non-decoder models (bert, CNNs).
"""

from __future__ import annotations

import shlex

from paraplan.models import ModelSpec, mtp_params

from ..plan import Plan
from .common import (
    Export,
    ExportRefused,
    StageShape,
    header_lines,
    placement,
    refuse_ps_and_sharded_heads,
    require_transformer,
    stage_shapes,
    uniform_recompute,
)

TARGET = "megatron"
MEGATRON_SOURCE = "NVIDIA/Megatron-LM megatron/training/arguments.py at d98e8a64ddf3 (2026-08-22)"
# What Megatron-FSDP runs with besides its sharding strategy, as NVIDIA's own scripts give it
# (examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh and sbatch_mfsdp_deepseek_v3.sh): the distributed optimizer
# (Megatron-FSDP v1 needs it; arguments.py sets it, with a warning, where it is missing), no fused weight-gradient
# accumulation, the model built on the meta device and materialised in shards (a model that fits only sharded would
# not fit while it is built whole), and the fsdp_dtensor checkpoint format (arguments.py requires it).
MEGATRON_FSDP_FLAGS = [("--use-distributed-optimizer", None), ("--no-gradient-accumulation-fusion", None),
                       ("--init-model-with-meta-device", None), ("--ckpt-format", "fsdp_dtensor")]
ZERO_FLAGS = {
    0: [],
    1: [("--use-distributed-optimizer", None)],
    2: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads"), *MEGATRON_FSDP_FLAGS],
    3: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
        *MEGATRON_FSDP_FLAGS],
}
DTYPE_FLAGS = {"bf16": [("--bf16", None)], "fp16": [("--fp16", None)], "fp32": [],
               "fp8": [("--bf16", None), ("--fp8-format", "hybrid")]}

Args = list[tuple[str, object]]  # (flag, value or None for a switch)


def export(plan: Plan, plan_path: str, spec: ModelSpec) -> Export:
    refuse_ps_and_sharded_heads(plan, TARGET)
    spec = require_transformer(spec, TARGET, "pretrain_gpt.py")
    if spec.family == "bert":
        raise ExportRefused(TARGET, "a bert model", "pretrain_gpt.py trains decoder-only (causal) models")
    lay = plan.layout
    if lay.pp > 1 and lay.schedule == "zb-v":
        raise ExportRefused(TARGET, "the zb-v schedule", "Megatron-LM pipelines with 1F1B or interleaved 1F1B; "
                            "re-plan or simulate with --schedule interleaved-1f1b")
    if lay.dtype not in DTYPE_FLAGS:
        raise ExportRefused(TARGET, f"dtype {lay.dtype}", f"known: {', '.join(DTYPE_FLAGS)}")
    if lay.experts_beside_tp_without_sp:
        raise ExportRefused(TARGET, f"expert parallelism (ep {lay.ep}) with tensor parallelism (tp {lay.tp}) "
                            "without sequence parallelism", "Megatron-Core requires sequence parallelism there "
                            "(megatron/core/model_parallel_config.py); re-plan or simulate with --sequence-parallel")
    if getattr(spec, "expert_bias", False):
        raise ExportRefused(TARGET, f"biases on the experts and the router without every other linear's "
                            f"({spec.name}: expert_bias)", "Megatron-LM has --add-bias-linear (every linear: "
                            "GPT-OSS's attention and experts alike) or --add-qkv-bias (q, k and v only); train it with "
                            "paraplan execute")
    notes: list[str] = []
    if lay.pp > 1 and lay.schedule == "gpipe":
        notes.append("Megatron-LM has no GPipe schedule: it runs 1F1B (the same bubble, less activation memory)")
    if getattr(spec, "mtp_layers", 0):
        notes.append(f"the model's {spec.mtp_layers} multi-token-prediction module(s) ({mtp_params(spec) / 1e9:.1f} B "
                     "parameters) are not in the plan and are left out (its memory and time do not count them); "
                     f"--mtp-num-layers {spec.mtp_layers} trains them, beyond the plan's figures")
    if getattr(spec, "moe_score_function", "softmax") == "sigmoid" and not getattr(spec, "moe_norm_topk", True) \
            and getattr(spec, "experts_per_token", 1) > 1:
        notes.append("Megatron-Core renormalises the top k sigmoid scores to sum to 1; the model keeps them as they "
                     "are (moe_norm_topk false): its expert weights differ")
    if getattr(spec, "moe_router_group_score", "top-sum") == "max":
        notes.append("Megatron-Core scores a group of experts by the sum of its top k / group_topk scores; the model "
                     "(DeepSeek-V2's group_limited_greedy) by its best score: the groups chosen may differ")
    groups = {"MODEL_ARGS": model_args(spec, plan.seq_length or spec.seq_length) + numerics_args(plan, spec, notes),
              "PARALLEL_ARGS": parallel_args(plan, spec),
              "TRAINING_ARGS": training_args(plan, notes, spec) + stack_args(plan, spec, notes)}
    env = []
    if lay.zero >= 2:
        env = ["unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron-FSDP needs more than one connection"]
    elif lay.tp > 1 or lay.cp > 1:
        env = ["export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron requires it with tensor or context parallelism"]
    place = placement(plan, TARGET)
    text = _render(plan, plan_path, spec, groups, env, place)
    flags = [flag for args in groups.values() for flag, _ in args] + ["--train-iters", "--lr", "--save", "--load",
                                                                        "--save-interval", "--mock-data",
                                                                        "--tokenizer-type", "--vocab-size",
                                                                        "--make-vocab-size-divisible-by"]
    nodes = place.nodes
    launch = ("MEGATRON_LM=/path/to/Megatron-LM" + (" RDZV_ENDPOINT=<first-node>:29500" if nodes > 1 else "")
              + " bash megatron.sh")
    return Export(target=TARGET, text=text, filename="megatron.sh", launch=launch, notes=notes,
                  where=f"on each of the {nodes} nodes" if nodes > 1 else "",
                  values={"flags": flags, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp,
                          "micro_batch": lay.micro_batch, "global_batch": lay.global_batch})


def vocab_multiple(vocab: int, tp: int) -> int:
    """Megatron pads the tokenizer's vocabulary to a multiple of --make-vocab-size-divisible-by x tp (default 128):
    the largest power of two up to 128 that leaves the plan's vocabulary as it is, as the cost model prices it (it
    pads nothing); 1 where none does (Megatron then pads to a multiple of tp alone)."""
    return next((g for g in (128, 64, 32, 16, 8, 4, 2) if vocab % (g * tp) == 0), 1)


def model_args(spec, seq_length: int) -> Args:
    """The model's shape in Megatron's words (spec fields added with MoE are read when present)."""
    a: Args = [("--num-layers", spec.num_layers), ("--hidden-size", spec.hidden_size),
               ("--num-attention-heads", spec.num_attention_heads), ("--ffn-hidden-size", spec.ffn_size),
               ("--seq-length", seq_length), ("--max-position-embeddings", max(seq_length, spec.seq_length))]
    if spec.kv_heads < spec.num_attention_heads:
        a += [("--group-query-attention", None), ("--num-query-groups", spec.kv_heads)]
    if spec.family == "llama":
        a += [("--normalization", "RMSNorm"), ("--swiglu", None), ("--position-embedding-type", "rope"),
              ("--disable-bias-linear", None)]
    if not spec.tied:
        a.append(("--untie-embeddings-and-output-weights", None))
    # the models here have no dropout (nor does the executor or the cost model: memory.py); Megatron's default is 0.1
    # on attention probabilities and hidden states (its own Llama examples set both to 0 too)
    a += [("--attention-dropout", 0), ("--hidden-dropout", 0)]
    if getattr(spec, "kv_lora_rank", None):
        a += [("--multi-latent-attention", None), ("--kv-lora-rank", spec.kv_lora_rank),
              ("--qk-head-dim", spec.qk_nope_head_dim), ("--qk-pos-emb-head-dim", spec.qk_rope_head_dim),
              ("--v-head-dim", spec.v_head_dim)]
        if getattr(spec, "q_lora_rank", None):
            a.append(("--q-lora-rank", spec.q_lora_rank))
    elif getattr(spec, "head_dim", None) and spec.head_dim != spec.hidden_size // spec.num_attention_heads:
        a.append(("--kv-channels", spec.head_dim))
    if getattr(spec, "qk_norm", False):
        a.append(("--qk-layernorm", None))
    if getattr(spec, "qkv_bias", False):  # with --disable-bias-linear: biases on q, k and v alone (Qwen2)
        a.append(("--add-qkv-bias", None))
    a += _moe_args(spec)  # no --mtp-num-layers: the plan has no multi-token-prediction module (export's note)
    return a


def numerics_args(plan: Plan, spec, notes: list[str]) -> Args:
    """A LLaMA-style model's RoPE base, RMSNorm eps and Llama 3.1 RoPE scaling as its config.json gives them, where
    the plan came from one still here (exports/torchtitan_model.numerics; else Megatron's defaults are paraplan's:
    base 10000, eps 1e-5): --rotary-base, --norm-epsilon, --use-rope-scaling --rope-scaling-factor (Megatron's
    llama3 scaling, low/high frequency factors 1 and 4 over 8192 positions, megatron/core/models/common/embeddings/
    rotary_pos_embedding.py). A scaling Megatron has no flags for is left out with a note."""
    from .torchtitan_model import numerics

    if spec.family != "llama":
        return []
    num = numerics(plan)
    if num.missing:
        notes.append(f"the plan's {num.missing} could not be read: RoPE base and norm eps are Megatron's defaults")
    if not num.source:
        return []
    a: Args = [("--rotary-base", int(num.rope_theta)), ("--norm-epsilon", num.norm_eps)]
    scaling = num.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        a += [("--use-rope-scaling", None), ("--rope-scaling-factor", float(scaling.get("factor", 8.0)))]
        megatron = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
        other = {k: scaling[k] for k in megatron if k in scaling and scaling[k] != megatron[k]}
        if other:
            notes.append(f"Megatron's llama3 RoPE scaling fixes {megatron}; the model's config has {other}")
    elif kind:
        notes.append(f"RoPE scaling {kind!r} ({num.source}) has no Megatron-LM flags here: left out")
    return a


def _moe_args(spec) -> Args:
    experts = getattr(spec, "num_experts", 0) or 0
    if not experts:
        return []
    ffn = getattr(spec, "moe_ffn_hidden_size", None) or spec.ffn_size
    a: Args = [("--num-experts", experts), ("--moe-router-topk", spec.experts_per_token),
               ("--moe-ffn-hidden-size", ffn)]
    shared = getattr(spec, "num_shared_experts", 0) or 0
    if shared:
        a.append(("--moe-shared-expert-intermediate-size", shared * ffn))
    dense = getattr(spec, "dense_layers", 0) or 0
    if getattr(spec, "moe_layer_step", 1) > 1:  # a 0/1 per layer (Megatron-Core parses the list expression)
        a.append(("--moe-layer-freq", "[" + ",".join(str(int(spec.is_moe_layer(i))) for i in range(spec.num_layers))
                  + "]"))
    elif dense:
        a.append(("--moe-layer-freq", f"([0]*{dense}+[1]*{spec.num_layers - dense})"))
    if getattr(spec, "moe_score_function", "softmax") != "softmax":
        a.append(("--moe-router-score-function", spec.moe_score_function))
    elif not getattr(spec, "moe_norm_topk", True) and spec.experts_per_token > 1:
        # softmax over every expert, the top k's scores kept as they are (DeepSeek-V2, norm_topk_prob false):
        # Megatron-Core's pre-softmax; its default softmax over the top k's logits renormalises them
        # (moe_utils.topk_routing_with_score_function)
        a.append(("--moe-router-pre-softmax", None))
    if getattr(spec, "moe_routed_scaling_factor", 1.0) != 1.0:
        a.append(("--moe-router-topk-scaling-factor", spec.moe_routed_scaling_factor))
    groups, group_topk = getattr(spec, "routing_groups", (1, 1))
    if groups > 1:  # node-limited routing (Megatron-Core's moe_utils.group_limited_topk: the plan's "top-sum" rule)
        a += [("--moe-router-num-groups", groups), ("--moe-router-group-topk", group_topk)]
    if getattr(spec, "moe_router_expert_bias", False):  # Megatron-Core's default update rate, 1e-3, is DeepSeek-V3's
        a.append(("--moe-router-enable-expert-bias", None))
    if hasattr(spec, "moe_aux_loss_coeff"):
        a.append(("--moe-aux-loss-coeff", spec.moe_aux_loss_coeff))
        if spec.moe_aux_loss_coeff:  # the plan's loss is per sequence (models/moe.py sequence_aux_loss, DeepSeek's);
            # Megatron-Core's default, aux_loss, is per micro-batch
            a.append(("--moe-router-load-balancing-type", "seq_aux_loss"))
    return a


def parallel_args(plan: Plan, spec) -> Args:
    lay = plan.layout
    a: Args = [("--tensor-model-parallel-size", lay.tp), ("--pipeline-model-parallel-size", lay.pp)]
    if lay.cp > 1:
        a.append(("--context-parallel-size", lay.cp))
    if getattr(spec, "num_experts", 0):
        a += [("--expert-model-parallel-size", lay.ep), ("--expert-tensor-parallel-size", lay.etp)]
    if lay.sequence_parallel:
        a.append(("--sequence-parallel", None))
    if lay.pp > 1:
        a += stage_args(stage_shapes(plan), spec.num_layers, lay.pp, lay.virtual_stages)
    return a


def stage_args(shapes: list[StageShape], num_layers: int, pp: int, v: int) -> Args:
    """The plan's stage boundaries with the simplest Megatron flags that state them exactly."""
    counts = [s.layers for s in shapes]
    n = len(shapes)
    if num_layers % n == 0 and all(c == num_layers // n for c in counts):
        return [("--num-virtual-stages-per-pipeline-rank", v)] if v > 1 else []
    if v == 1:
        first, last, middle = counts[0], counts[-1], counts[1:-1]
        if len(set(middle)) <= 1 and all(m > 0 for m in middle) and first > 0 and last > 0:
            return [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]
    return [("--pipeline-model-parallel-layout", layout_string(shapes))]


def layout_string(shapes: list[StageShape]) -> str:
    """Megatron's --pipeline-model-parallel-layout: stages split by '|', E embedding, t a layer, L the loss (output
    layer); stages listed in model order, virtual stage k on pipeline rank k % pp. (Megatron's m, an MTP layer, is
    never written: plans have none.)"""
    stages = []
    for s in shapes:
        parts = (["E"] if s.embed else []) + ([f"t*{s.layers}" if s.layers > 1 else "t"] if s.layers else [])
        if s.head:
            parts.append("L")
        stages.append(",".join(parts))
    return "|".join(stages)


def training_args(plan: Plan, notes: list[str], spec=None) -> Args:
    lay = plan.layout
    a: Args = [("--micro-batch-size", lay.micro_batch), ("--global-batch-size", lay.global_batch)]
    a += DTYPE_FLAGS[lay.dtype] + ZERO_FLAGS[lay.zero]
    if lay.zero == 2:
        notes.append("ZeRO-2 runs as Megatron-FSDP's optim_grads sharding (optimizer state and gradients "
                     "sharded, parameters replicated)")
    if lay.zero >= 2 and lay.pp > 1:
        notes.append("Megatron-FSDP documents tensor, context and expert parallelism beside it, not pipeline "
                     "parallelism (NVIDIA/Megatron-LM issue #1455 is open): if it refuses pp > 1, re-plan with "
                     "--zero 1 (the distributed optimizer)")
    mode, note = uniform_recompute(plan, TARGET)
    if note:
        notes.append(note)
    if mode == "selective" and getattr(spec, "mla", False):  # MLA: its up-projections too (as priced)
        a += [("--recompute-granularity", "selective"), ("--recompute-modules", ("core_attn", "mla_up_proj"))]
    elif mode == "selective":
        a.append(("--recompute-granularity", "selective"))
    elif mode == "norm+act":  # the separate norms and the routed experts' activation (output-discarding)
        a += [("--recompute-granularity", "selective"), ("--recompute-modules", ("layernorm", "moe_act"))]
    elif mode == "mlp":  # Megatron-Core's per-module recomputation: dense MLPs and MoE blocks
        a += [("--recompute-granularity", "selective"), ("--recompute-modules", ("mlp", "moe"))]
    elif mode == "selective+mlp":  # both (NVIDIA's DeepSeek-V3 recipes: mla_up_proj with mlp and moe)
        core = ("core_attn", "mla_up_proj") if getattr(spec, "mla", False) else ("core_attn",)
        a += [("--recompute-granularity", "selective"), ("--recompute-modules", (*core, "mlp", "moe"))]
    elif mode == "full":
        a += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    return a


def stack_args(plan: Plan, spec, notes: list[str]) -> Args:
    """Flags that make Megatron-LM run the software behaviour the plan was priced with (its framework profile and
    switches, planner/framework.py) where Megatron's own defaults differ. A plan priced for this executor
    (framework paraplan) keeps Megatron's defaults for the model states and their sync (its stack is not
    Megatron's), but its MoE token dispatch is stated: one all-to-all each way, as priced."""
    from ..moe import a2a_overlap_applies

    fw = plan.stack()
    lay = plan.layout
    a: Args = []
    if getattr(spec, "num_experts", 0):
        if fw.moe_dispatcher == "hybridep":
            a += [("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", "hybridep")]
        else:
            a.append(("--moe-token-dispatcher-type", "alltoall"))
        if fw.moe_grouped_gemm:
            a.append(("--moe-grouped-gemm", None))
        if fw.moe_capacity_factor is not None:  # token dropping (Megatron drops the lowest-probability copies)
            a.append(("--moe-expert-capacity-factor", fw.moe_capacity_factor))
            if fw.moe_pad_to_capacity:
                a.append(("--moe-pad-expert-input-to-capacity", None))
        if fw.moe_shared_expert_overlap and getattr(spec, "num_shared_experts", 0):
            a.append(("--moe-shared-expert-overlap", None))
            if fw.moe_dispatcher == "hybridep":
                notes.append("--moe-shared-expert-overlap beside the flex dispatcher: Megatron-Core runs the pair "
                             "since ebfa1385 (2026-04-14, #2207); earlier versions refuse it (alltoall only)")
        if a2a_overlap_applies(fw, lay):
            a += [("--overlap-moe-expert-parallel-comm", None), ("--delay-wgrad-compute", None)]
        elif fw.moe_a2a_overlap:
            # the layout's mode is the strongest of its stages' (what the export applies to all); lighter stages
            # were priced with the overlap
            priced = any(a2a_overlap_applies(fw, lay, mode) for mode in plan.stage_recompute or [])
            notes.append("the all-to-all overlap is left out: Megatron-Core runs it only with ep > 1, two "
                         "micro-batches or more, no full recomputation nor of the MoE blocks (mlp), and virtual stages "
                         "under a pipeline (" + ("priced with it on the stages recomputing less: slower than "
                                                 "predicted)" if priced else "priced without it too)"))
    if fw.fused_softmax != "always":
        notes.append(f"priced with the softmax of --fused-softmax {fw.fused_softmax} (PyTorch's fp32 softmax where "
                     "that fork's check turned its fused kernel down); Megatron-LM takes its fused kernel (or a "
                     "flash kernel) there: faster than predicted")
    if lay.dtype == "fp8" and fw.fp8_scaling == "current":  # Megatron's default recipe is delayed scaling
        a.append(("--fp8-recipe", "tensorwise"))
    if fw.states != "zero":
        return a
    if lay.dtype in ("bf16", "fp8") and fw.grad_bytes == 2:
        a.append(("--grad-reduce-in-bf16", None))
    if lay.dtype == "fp8" and fw.fp8_weight_bytes == 0:  # priced with FP8 parameters: no cached FP8 weight copy
        a.append(("--fp8-param-gather", None))
    if fw.moment_bytes == 4 and lay.dtype == "fp32":
        notes.append("priced with bf16 Adam moments; Megatron's precision-aware optimizer serves 16-bit training "
                     "only, so this fp32 run keeps fp32 moments: 4 B per parameter more than priced")
    if fw.moment_bytes == 4 and lay.dtype != "fp32":
        a += [("--use-precision-aware-optimizer", None), ("--exp-avg-dtype", "bf16"), ("--exp-avg-sq-dtype", "bf16")]
        if fw.master_bytes == 2 and lay.dtype == "fp8":
            notes.append("the plan keeps a 16-bit optimizer copy of the weights; with FP8 parameters Megatron's "
                         "precision-aware optimizer keeps an fp32 one (2 B per parameter more than priced)")
        elif fw.master_bytes == 4 and lay.dtype == "bf16":
            notes.append("priced with fp32 master weights (8 B of optimizer state per parameter); Megatron with bf16 "
                         "parameters keeps them as 16-bit remainders by default (store_param_remainders): less "
                         "memory than priced")
    if fw.overlap_dp and lay.data_ranks > 1:
        a.append(("--overlap-grad-reduce", None))
        # the distributed optimizer's gathers under the next step's forward; Megatron-FSDP's prefetch of the next
        # units' parameters (NVIDIA's Megatron-FSDP scripts give both flags)
        if (lay.zero == 1 and fw.overlap_param_gather) or lay.zero >= 2:
            a.append(("--overlap-param-gather", None))
    return a


def _value(value) -> str:
    """A flag's value(s) as shell words: none for a switch, one per item of a tuple (argparse nargs)."""
    if value is None:
        return ""
    items = value if isinstance(value, tuple) else (value,)
    return "".join(f" {shlex.quote(str(v))}" for v in items)


def _render(plan: Plan, plan_path: str, spec, groups: dict[str, Args], env: list[str], place) -> str:
    lines = ["#!/usr/bin/env bash"]
    lines += [f"# {x}" for x in header_lines(plan, plan_path, "Megatron-LM pretrain_gpt.py arguments")]
    lines += [f"# Flag names checked against {MEGATRON_SOURCE}.",
              "# Source this file and pass \"${MEGATRON_ARGS[@]}\" to pretrain_gpt.py, or run it: it starts this",
              "# node's ranks with torchrun (MEGATRON_LM: your Megatron-LM checkout; on several nodes run it on",
              "# each with NNODES and RDZV_ENDPOINT=host:port of the first node).", ""]
    lines += env + ([""] if env else [])
    for name, args in groups.items():
        lines.append(f"{name}=(")
        lines += [f"    {flag}" + _value(value) for flag, value in args]
        lines += [")", ""]
    lines += ["# Not decided by the plan: iterations, learning rate, checkpoints (--load resumes from the latest).",
              "RUN_ARGS=(",
              "    --train-iters \"${TRAIN_ITERS:-1000}\"",
              "    --lr \"${LR:-3e-4}\"",
              "    --save \"${CKPT_DIR:-checkpoints}\"",
              "    --load \"${CKPT_DIR:-checkpoints}\"",
              "    --save-interval \"${SAVE_INTERVAL:-500}\"",
              ")",
              "# Mock data with the plan's vocabulary (NullTokenizer adds an end-of-document id to --vocab-size; the",
              "# padding multiple keeps it unpadded); for a real run: --data-path ... --tokenizer-type ...",
              f"DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size {spec.vocab_size - 1} "
              f"--make-vocab-size-divisible-by {vocab_multiple(spec.vocab_size, plan.layout.tp)})", "",
              "MEGATRON_ARGS=(\"${" + "[@]}\" \"${".join([*groups, "RUN_ARGS", "DATA_ARGS"]) + "[@]}\")", "",
              'if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then',
              f"    exec torchrun --nnodes \"${{NNODES:-{place.nodes}}}\" "
              f"--nproc-per-node {place.per_node} \\",
              "        --rdzv-backend c10d --rdzv-endpoint \"${RDZV_ENDPOINT:-localhost:29500}\" "
              "--rdzv-id \"${RDZV_ID:-paraplan}\" \\",
              "        \"${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}/pretrain_gpt.py\" "
              "\"${MEGATRON_ARGS[@]}\"",
              "fi", ""]
    return "\n".join(lines)


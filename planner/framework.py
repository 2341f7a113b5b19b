"""The software stack a prediction prices: what it keeps in memory, what it sends, what it overlaps.

The same layout costs differently under different stacks (Megatron-LM's distributed optimizer keeps
bf16 weights and reduce-scatters fp32 gradients once per step; this project's executor runs FSDP2 with
fp32 master weights and reduce-scatters every micro-batch under ZeRO 2/3). A :class:`Framework` is the
set of such behaviours; :data:`FRAMEWORKS` names the profiles a user picks with ``--framework``.
``paraplan`` — what ``paraplan execute`` really does, checked by its dry run — is the default.

Each field is read by the cost model (where is said beside it) and each profile cites where its values
come from. A field a profile leaves at its default behaves as this executor does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .compute import ATTENTION_KERNELS
from .errors import PlanError

CP_COMM = ("all_gather", "ring", "all_gather_overlap")
MOE_DISPATCHERS = ("alltoall", "hybridep")
# How tokens pick experts, for what a deduplicating dispatcher sends (planner/moe.py token_destinations): "uniform" =
# each token's k experts spread at random (a trained router; Megatron-Core's moe_router_force_load_balancing draws
# random logits); "consecutive" = token t takes experts t·k ... t·k + k - 1 mod E (NeMo Automodel's
# fake_balanced_gate, FakeBalancedGate in nemo_automodel/components/moe/layers.py, which its published benchmarks run)
MOE_ROUTINGS = ("uniform", "consecutive")
# ``--fp8-recipe``, Megatron-Core's names (TransformerConfig.fp8_recipe; its default is delayed): the Framework.
# fp8_scaling each means on a Transformer Engine stack. A torchao stack (this executor, torchtitan) scales each
# tensor as it casts it ("dynamic"), which is its tensorwise recipe; it has no delayed scaling.
FP8_RECIPES = {"delayed": "delayed", "tensorwise": "current"}
FUSED_SOFTMAX = ("always", "bigscience-2021-10")
ADAM_STEPS = ("for-loop", "foreach", "fused")  # Framework.adam_step, as --optimizer-implementation sets it
# Adam's state in 16-bit training (``--optimizer-states``), bytes per parameter as (master weights, both moments):
# "fp32" = fp32 master weights and moments (ZeRO's K = 12, Rajbhandari et al. 2020 Sec. 3.1; Megatron-LM's
# distributed optimizer by default); "bf16-moments" = fp32 master weights, bf16 moments (Megatron-Core's
# --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 where the master stays whole: with
# FP8 parameters, or FP8 recipes other than delayed scaling); "bf16" = 16-bit master weights and bf16 moments (Apex
# DistributedFusedAdam with dtype=bf16, NeMo 1.0's distributed_fused_adam: a bf16 copy of the weights and bf16
# moments; or Transformer Engine's FusedAdam under the precision-aware optimizer with bf16 weights, which keeps
# the fp32 master as its 16 low bits beside them, optimizer_config.py store_param_remainders).
OPTIMIZER_STATES = {"fp32": (4, 8), "bf16-moments": (4, 4), "bf16": (2, 4)}


@dataclass(frozen=True)
class Framework:
    name: str
    attention: str = "flash"  # fused SDPA / FlashAttention, or Megatron 2021-22's unfused kernels with dropout
    overlap_dp: bool = True  # gradient reduction overlapped with the backward where the stack can
    overlap_tp: bool = False  # TP all-reduce of input gradients hidden behind weight-gradient GEMMs (Megatron)
    # Model states: "executor" = FSDP2 mixed precision (fp32 master weights sharded by ZeRO 3 and 2, a bf16
    # copy for compute, fp32 gradients, Adam's two fp32 moments); "zero" = ZeRO's accounting (Rajbhandari
    # et al. 2020: 2 bytes of weights, ``grad_bytes`` of gradients, 12 of optimizer state per parameter,
    # sharded by the stage).
    states: str = "executor"
    # bytes per gradient element in 16-bit training: the buffer gradients accumulate in and the data-parallel
    # reduction's dtype (4: fp32; "zero" states: memory.state_bytes, dp_sync.grad_bytes)
    grad_bytes: int = 4
    # Data-parallel gradient sync with a pipeline: "end" = after the pipeline's last backward, exposed
    # (torch.distributed.pipelining's REDUCE_GRAD); "overlap" = during the last micro-batch's backward.
    dp_sync_pipelined: str = "end"
    zero1: str = "allreduce+broadcast"  # or "reduce_scatter+all_gather" (Megatron's distributed optimizer)
    zero23_every_micro_batch: bool = True  # ZeRO 2/3 reduce-scatter each micro-batch (executor, DeepSpeed)
    sp_saves_gathered_input: bool = True  # SP regions keep their gathered input for backward (DTensor)
    p2p_scatter_gather: bool = False  # without SP a pipeline send carries 1/t of the boundary (Megatron)
    embedding_sp_reduce: str = "all_reduce"  # the vocab-parallel embedding's output under SP (or reduce_scatter)
    # MLA's attention input under TP (profiler/tp_view.region_collectives): "hidden" — gathered and its gradient
    # reduced at the hidden width (torchtitan's NoParallel down-projections); "latent" — the latents gathered and
    # reduced instead (Megatron-Core); "mixed" — the hidden gathered, the latents' gradients all-reduced (this
    # executor)
    mla_tp_input: str = "hidden"
    # the gradient buffer is allocated whole when the model is wrapped, never freed (Megatron's DDP:
    # param_and_grad_buffer.py grad_data = torch.zeros(...)): gradients are in memory at every activation peak
    grad_buffer_at_wrap: bool = False
    # ZeRO 1/2 ("zero" states): the all-gather of the updated 16-bit weights after the optimizer step runs
    # bucket by bucket under the next step's first forward (Megatron-Core's overlap_param_gather) instead of
    # before it (dp_sync._zero_accounting)
    overlap_param_gather: bool = False
    # interleaved pipelines: each send and receive of a micro-batch's boundary overlaps the next chunk's
    # compute (Megatron-Core's overlap_p2p_comm) instead of sitting between the two (costmodel.p2p_seconds)
    overlap_p2p: bool = False
    # context parallelism's exchange of keys and values (planner/context_parallel.py): "all_gather" = K/V
    # all-gathered before attention, dK/dV reduce-scattered after, exposed (this executor; Llama 3 Sec. 3.3.2);
    # "ring" = K/V chunks passed around the cp ring while the attention of the previous chunk computes
    # (Megatron-Core with Transformer Engine, cp_comm_type p2p); "all_gather_overlap" = one all-gather
    # overlapped with the attention of the local chunk (torch's context_parallel, rotate method allgather)
    cp_comm: str = "all_gather"
    # FP8 (planner/fp8.py): does the stack keep a linear layer's input for its weight gradient as FP8 (1 byte;
    # Transformer Engine) or in 16 bits (torchao's float8 training saves the high-precision tensors)?
    fp8_saves_fp8_inputs: bool = False
    # bytes per parameter an FP8 run keeps beyond the 16-bit weights: TE's cached FP8 weight and its transpose
    # (2) unless the weights themselves are FP8 parameters (Megatron-Core's fp8_param_gather: 0)
    fp8_weight_bytes: float = 0.0
    # FP8 scaling: "dynamic" = each tensor's amax is read in a pass of its own before the cast (torchao
    # tensorwise); "delayed" = the scale comes from an amax history and the amax is computed inside the
    # cast kernel (TE's DelayedScaling); "current" = TE's per-tensor current scaling (Float8CurrentScaling,
    # Megatron-Core's --fp8-recipe tensorwise): an amax pass, then the cast: planner/fp8.py prices the difference
    fp8_scaling: str = "dynamic"
    # the buckets a data-parallel gradient reduce (and the overlapped weight gather) runs in, whose last cannot hide
    # (dp_sync.bucket_bytes): "ddp" = torch DDP's 25 MiB (bucket_cap_mb); "megatron" = Megatron-Core's default
    # bucket_size, max(40M, 1M x data-parallel size) parameters (DistributedDataParallelConfig: "larger DP sizes
    # need larger buckets to ensure collectives do not become latency-bound")
    dp_buckets: str = "ddp"
    # the unfused attention's scale-mask-softmax (compute.softmax_falls_back): "always" = Megatron's fused kernel;
    # "bigscience-2021-10" = only where bigscience's Megatron-DeepSpeed of 2021-10-21..2022-03-06 found it
    # available (its check passed its arguments in the wrong order), elsewhere PyTorch's fp32 softmax
    fused_softmax: str = "always"
    # fraction of the element-wise and normalisation memory traffic of eager PyTorch (what the profiler
    # traces) that the stack's fused kernels still move (compute.estimate_pass_times)
    elementwise_traffic: float = 1.0
    # activations a transformer layer keeps: "traced" = what the profiler traced eager PyTorch modules to save
    # (this executor); "fused" = Transformer Engine's fused modules (planner/fused_activations.py)
    saved_activations: str = "traced"
    # Mixture of experts (planner/moe.py): the most loaded rank's routed tokens over the mean (multiplies the
    # experts' GEMM time and the all-to-all's); routed experts run as one grouped GEMM per projection (Megatron-
    # Core's moe_grouped_gemm) rather than one GEMM per expert (this executor's loop)
    moe_imbalance: float = 1.25
    moe_grouped_gemm: bool = False
    # the token dispatcher: "alltoall" (one copy per routed expert, this executor's; Megatron-Core's alltoall),
    # "hybridep" (DeepEP / HybridEP: one copy per remote node, forwarded over NVLink; Megatron-Core's flex
    # dispatcher); moe_a2a_overlap: each pass's all-to-alls hidden behind another micro-batch's compute
    # (Megatron-Core's overlap_moe_expert_parallel_comm); moe_shared_expert_overlap: the shared experts' GEMMs run
    # on a stream of their own beside the dispatch and combine all-to-alls (Megatron-Core's moe_shared_expert_overlap)
    moe_dispatcher: str = "alltoall"
    # the dispatchers a stack of "executor" states can run (--moe-dispatcher refuses the others there)
    moe_dispatchers: tuple[str, ...] = ("alltoall",)
    moe_routing: str = "uniform"  # MOE_ROUTINGS
    # the ZeRO stages the stack runs over dp > 1 (what the search enumerates; costmodel.validate_layout refuses others)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # the pipeline schedules the stack runs (pp > 1; the search enumerates these, validate_layout refuses others)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")
    # expert with tensor parallelism only with sequence parallelism (Megatron-Core: "When using expert parallelism
    # and tensor parallelism for training, sequence parallelism must be used", model_parallel_config.py)
    moe_tp_needs_sp: bool = False
    # tensor parallelism always with sequence parallelism, and expert tensor parallelism of 1 or tp (torchtitan:
    # parallelize.py shards norms over the sequence whenever tp > 1; its MoE takes etp 1 or tp)
    tp_always_sp: bool = False
    moe_a2a_overlap: bool = False
    moe_shared_expert_overlap: bool = False
    # token dropping (Megatron-Core's moe_expert_capacity_factor): each expert takes at most c times its mean share
    # of a rank's routed tokens, the rest are dropped (None: dropless); moe_pad_to_capacity fills every expert up
    # to that capacity (moe_pad_expert_input_to_capacity: fixed shapes, c times the mean work and traffic)
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    # the MoE block's non-GEMM kernels: "traced" = the profiler's trace of this executor's eager block (scaled by
    # ``elementwise_traffic`` like the rest of the layer); "fused" = Megatron-Core's fused router, permute,
    # activation and unpermute kernels, whose traffic planner/fused_moe.py counts (not scaled)
    moe_kernels: str = "traced"
    # expert biases (spec expert_bias) added expert by expert after the second grouped GEMM, each its own kernels
    # (Megatron-Core's TEGroupedMLP._apply_bias: planner/fused_moe.py); elsewhere inside the GEMMs, free
    moe_bias_per_expert: bool = False
    # FP8 reaches the experts' GEMMs (TE's GroupedLinear under Megatron-Core). This executor's experts are stacked
    # weights, not the nn.Linear modules torchao's float8 conversion swaps: their GEMMs run in bf16
    # (compute.estimate_pass_times) and planner/fp8.py casts and saves nothing for them
    fp8_experts: bool = False
    # Recomputation stops once backward's saved tensors are rebuilt (torch.utils.checkpoint's non-reentrant
    # early stop: this executor, torchtitan), so a recomputed forward does not repeat a last collective whose
    # output nothing saves (a pre-norm layer's MLP output reduce: reduce-scatter under SP, else all-reduce);
    # Megatron's tensor_parallel.checkpoint and DeepSpeed's checkpointing rerun the whole function.
    recompute_early_stop: bool = False
    # What selective recomputation reruns besides the attention core: "prologue" — the attention's whole prologue
    # (models.in_attention_prologue: MLA's latent norms and up-projection, Qwen3's q/k norms with the rotary
    # embedding and K/V sharing), but not under context parallelism (this executor's checkpoint); "mla" — MLA's
    # up-projections (Megatron-Core's recompute_modules mla_up_proj, which paraplan's export adds for MLA models);
    # "" — the core alone (Megatron's core_attn elsewhere, DeepSpeed; torchtitan's op-level policy: selective_policy)
    selective_extra: str = ""
    # Whose selective recomputation: "core" — the attention core (with selective_extra); "torchtitan-op" —
    # torchtitan's per-op checkpoint policy (planner/op_sac.py: every second matmul of a block and all its
    # element-wise work rerun, SDPA's output kept), on the blocks it describes
    selective_policy: str = "core"
    # Adam's state under ZeRO's accounting ("zero" states; OPTIMIZER_STATES): bytes per parameter of the master
    # weights (16-bit training only) and of the two moments (memory.state_bytes, dp_sync.optimizer_step)
    master_bytes: int = 4
    moment_bytes: int = 8
    # The cross-entropy's logits under the executor's states (memory.loss_bytes): "fp32" — upcast first, as this
    # executor (models.transformer_loss) and torchtitan do; "16-bit" — the logits' own dtype, as NeMo Automodel's
    # benchmark configs ask (MaskedCrossEntropy fp32_upcast false), its recipe keeping the model's output (the
    # logits) referenced through the backward
    loss_logits: str = "fp32"
    # Adam's step under the executor's states (memory.step_bytes), what it allocates beside the states, torch's
    # implementations by torchtitan's names (``--optimizer-implementation``, ADAM_STEPS): "for-loop" — one tensor at
    # a time, two temporaries the size of the tensor being updated (exp_avg_sq.sqrt(), and its quotient by the bias
    # correction); "foreach" — one temporary copy of every second moment at once (torch/optim/adam.py
    # _multi_tensor_adam: _foreach_sqrt; torch's default on GPUs, DTensors included: NeMo Automodel's
    # torch.optim.Adam); "fused" — one kernel updating in place, nothing beside the states (torchtitan's default;
    # Apex / Transformer Engine FusedAdam under "zero" states, which do not read this field); "executor" — as this
    # executor builds AdamW (executor/optim.py adamw): for-loop over DTensors, foreach over plain tensors (DDP,
    # ZeRO-1's shares, one fp32 rank)
    adam_step: str = "executor"
    source: str = ""

    def replace(self, **changes) -> Framework:
        return dataclasses.replace(self, **changes)

    @property
    def runs_on_executor(self) -> bool:
        return self.states == "executor"


PARAPLAN = Framework(
    name="paraplan", recompute_early_stop=True, selective_extra="prologue", mla_tp_input="mixed",
    source="executor/data_parallel.py, pipeline.py, tensor_parallel.py, context_parallel.py (checked by execute "
           "--dry-run); FP8 as torchao's float8 training (tensorwise dynamic scaling, high-precision tensors saved)")

# Megatron-LM's pipeline schedules (megatron/core/pipeline_parallel/schedules.py: 1F1B without and with
# interleaving; no GPipe, no zero-bubble V); DeepSpeed's pipeline engine runs 1F1B (deepspeed/runtime/pipe/
# schedule.py TrainSchedule)
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
DEEPSPEED_SCHEDULES = ("1f1b",)

MEGATRON_2021 = Framework(
    name="megatron-2021", grad_buffer_at_wrap=True,
    attention="unfused", overlap_dp=False, overlap_tp=True, states="zero", grad_bytes=2,
    dp_sync_pipelined="overlap", zero1="reduce_scatter+all_gather", zero23_every_micro_batch=False,
    sp_saves_gathered_input=False, p2p_scatter_gather=True, embedding_sp_reduce="reduce_scatter",
    cp_comm="ring", fp8_saves_fp8_inputs=True, fp8_weight_bytes=2.0, fp8_scaling="delayed",
    # data-parallel replicas, or (from 2022) the distributed optimizer, ZeRO-1: Megatron-LM had no ZeRO-2/3 then
    # (its FSDP, Megatron-FSDP, came in 2025: the megatron-core profile)
    zero_stages=(0, 1), schedules=MEGATRON_SCHEDULES, moe_tp_needs_sp=True,
    source="Narayanan et al. 2021 (SC21) and Korthikanti et al. 2022: Megatron-LM with unfused attention "
           "and dropout, fp16 gradients all-reduced after the pipeline flush, scatter/gather P2P")

# Megatron-Core as NeMo 2.0 / Megatron-Bridge run it (the NeMo and dgxc-benchmarking H100 tables):
# - distributed optimizer (ZeRO 1: Megatron-LM docs/api-guide/dist_optimizer.md) with overlap_grad_reduce and
#   overlap_param_gather on (NeMo's recipes: DistributedDataParallelConfig(overlap_grad_reduce=True,
#   overlap_param_gather=True, use_distributed_optimizer=True)), gradients kept and reduce-scattered in bf16 as
#   NeMo's performance scripts set it (scripts/performance: recipe.trainer.plugins.grad_reduce_in_fp32 = False;
#   the recipes' default, fp32, is grad_bytes=4: the docs' "bf16 parameters, fp32 gradients: 6 + 12/d");
# - fused attention (TE / cuDNN flash), fused element-wise kernels (TE's LayerNormLinear and LayerNormMLP,
#   fused bias-activation, fused RoPE, fused cross-entropy: Megatron-LM docs/api-guide/fusions.md);
# - input-gradient all-reduce / SP all-gather overlapped with weight-gradient GEMMs (the async TP of
#   Megatron's LinearWithGradAccumulationAndAsyncCommunication; tp_comm_overlap adds more where a recipe sets it);
# - interleaved schedule's P2P overlapped with compute (overlap_p2p_comm, NeMo sets it whenever vp > 1);
# - sequence-parallel inputs kept as the local shard and gathered again in backward; no scatter/gather P2P;
# - context parallelism through TE's ring of P2P K/V exchanges overlapped with attention (Megatron-LM
#   docs/api-guide/context_parallel.md: "The all-gather and reduce-scatter are transformed to point-to-point
#   communications in ring topology");
# - FP8 through Transformer Engine: delayed scaling (amax history), FP8 copies of linear inputs saved for
#   backward, FP8 parameters (fp8_param_gather) so no extra weight copy.
MEGATRON_CORE = Framework(
    name="megatron-core", grad_buffer_at_wrap=True,
    attention="flash", overlap_dp=True, overlap_tp=True, states="zero", grad_bytes=2,
    dp_sync_pipelined="overlap", zero1="reduce_scatter+all_gather", zero23_every_micro_batch=False,
    sp_saves_gathered_input=False, p2p_scatter_gather=False, embedding_sp_reduce="reduce_scatter",
    overlap_param_gather=True, overlap_p2p=True, cp_comm="ring", fp8_saves_fp8_inputs=True, fp8_weight_bytes=0.0,
    fp8_scaling="delayed", elementwise_traffic=0.17, saved_activations="fused", moe_imbalance=1.0,
    moe_grouped_gemm=True, moe_kernels="fused", moe_bias_per_expert=True, fp8_experts=True, selective_extra="mla",
    dp_buckets="megatron", mla_tp_input="latent",
    schedules=MEGATRON_SCHEDULES, moe_tp_needs_sp=True,
    source="Megatron-LM docs (dist_optimizer.md, context_parallel.md, fusions.md) and NeMo 2.0 / Megatron-Bridge "
           "recipes (DistributedDataParallelConfig: overlap_grad_reduce, overlap_param_gather, "
           "use_distributed_optimizer; overlap_p2p_comm with virtual pipelines; performance scripts' "
           "grad_reduce_in_fp32 = False); MoE: moe_grouped_gemm, moe_permute_fusion, moe_router_fusion, "
           "bias_activation_fusion (planner/fused_moe.py), TE's FP8 GroupedLinear, and the "
           "token distribution force-balanced as Megatron-Bridge's published MoE benchmarks run (their tables' "
           "footnote)")

# Megatron-DeepSpeed as BigScience ran BLOOM-176B (bigscience-workshop/bigscience train/tr11-176B-ml: Megatron-LM's
# 2021 model code, Megatron's fused scale-mask-softmax attention, DeepSpeed's pipeline engine and ZeRO-1 with its
# BF16 optimizer, which accumulates and all-reduces fp32 gradients after the pipeline's flush): unfused
# attention, fp32 gradient buffers, the data-parallel reduction after the last backward, full-tensor P2P
# (DeepSpeed's pipeline engine sends whole activations), no TP overlap (--no-async-tensor-model-parallel-allreduce
# is not the default there, but the engine's bucketed reduce runs after the flush).
MEGATRON_DEEPSPEED = Framework(
    name="megatron-deepspeed", grad_buffer_at_wrap=True,
    attention="unfused", overlap_dp=False, overlap_tp=False, states="zero", grad_bytes=4,
    dp_sync_pipelined="end", zero1="reduce_scatter+all_gather", zero23_every_micro_batch=False,
    sp_saves_gathered_input=False, p2p_scatter_gather=True, embedding_sp_reduce="reduce_scatter",
    cp_comm="all_gather", fp8_saves_fp8_inputs=True, fp8_weight_bytes=2.0, fp8_scaling="delayed",
    schedules=DEEPSPEED_SCHEDULES,
    source="bigscience-workshop/bigscience train/tr11-176B-ml (README and chronicles): Megatron-DeepSpeed, "
           "DeepSpeed pipeline engine, ZeRO-1 with the BF16 optimizer (fp32 gradient accumulation), fused "
           "scale-mask-softmax, bias-gelu and bias-dropout-add kernels; DeepSpeed's pipeline engine sends 1/t of "
           "each boundary tensor per tensor-parallel rank and all-gathers it on arrival (deepspeed/runtime/pipe/"
           "engine.py, v0.6.0: is_pipe_partitioned = is_grad_partitioned = is_model_parallel)")

# DeepSpeed's ZeRO engine with a plain PyTorch model (HF Transformers): ZeRO's memory accounting (2 + 2 + 12
# bytes per parameter, Rajbhandari et al. 2020), gradients reduced in the 16-bit training dtype
# (communication_data_type defaults to it), ZeRO-2/3 reducing every micro-batch's gradients in buckets
# (reduce_bucket_size) overlapped with the backward (overlap_comm; on by default with ZeRO-3), ZeRO-3
# prefetching parameters under the forward and backward; SDPA attention (HF's default on GPUs); DeepSpeed
# Ulysses-free context parallelism is not part of it (cp priced as an exposed all-gather).
DEEPSPEED = Framework(
    name="deepspeed", attention="flash", overlap_dp=True, overlap_tp=False, states="zero", grad_bytes=2,
    dp_sync_pipelined="end", zero1="reduce_scatter+all_gather", zero23_every_micro_batch=True,
    sp_saves_gathered_input=False, p2p_scatter_gather=False, embedding_sp_reduce="all_reduce",
    cp_comm="all_gather", fp8_saves_fp8_inputs=True, fp8_weight_bytes=2.0, fp8_scaling="delayed",
    schedules=DEEPSPEED_SCHEDULES,
    source="DeepSpeed docs (ZeRO config: overlap_comm, reduce_bucket_size, communication_data_type, "
           "stage3_prefetch_bucket_size) and Rajbhandari et al. 2020 (ZeRO) Sec. 3.1")

# torchtitan (pytorch/torchtitan): FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
# (training.mixed_precision_reduce = "float32") over fp32 master weights — the same states as this executor —,
# DTensor tensor parallelism with loss_parallel, torch.distributed.pipelining schedules (gradients reduced
# after the last backward), SDPA flash attention, context parallelism through torch's context_parallel with
# the default rotate method "allgather" (all K/V shards gathered while the first local sub-attention runs),
# FP8 through torchao's float8 training (tensorwise dynamic scaling).
TORCHTITAN = Framework(
    name="torchtitan", attention="flash", overlap_dp=True, overlap_tp=False, states="executor", grad_bytes=4,
    dp_sync_pipelined="end", cp_comm="all_gather_overlap", fp8_saves_fp8_inputs=False, fp8_weight_bytes=0.0,
    fp8_scaling="dynamic", recompute_early_stop=True, tp_always_sp=True, selective_policy="torchtitan-op",
    adam_step="fused",
    source="pytorch/torchtitan: parallelize.py (FSDP2 MixedPrecisionPolicy, reduce_dtype float32), "
           "config (context_parallel_rotate_method 'allgather', float8 via torchao, optimizer implementation "
           "'fused')")

# NeMo Automodel's MoE training (NVIDIA-NeMo/Automodel: nemo_automodel/components/moe/parallelizer.py, fsdp_mixin.py,
# experts.py; its benchmark configs examples/llm_benchmark/*_te_deepep.yaml): torch FSDP2 with
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over a model built in bf16 (its MoE models'
# initialize_weights end in self.to(bfloat16)), so bf16 weight shards and torch Adam's moments in bf16
# (master_bytes 2, moment_bytes 4 under this executor's states: memory.state_bytes); FSDP2's
# reshard_after_forward True is paraplan's ZeRO-3, False (its MoE default today, and with pp) ZeRO-2, the only
# two it runs (zero_stages); no gradient sync or reshard until the step's last backward (MoEFSDPSyncMixin:
# set_requires_gradient_sync(False) while accumulating, so FSDP2 keeps fp32 unsharded gradient sums and
# reduce-scatters once per step: after the pipeline's last backward with pp, under the last
# micro-batch's backward without); torch.distributed.pipelining schedules; full-block activation checkpointing with
# torch's non-reentrant checkpoint_wrapper (early stop); Transformer Engine attention, linear and RMSNorm with
# fused RoPE, and Megatron-Core's MoE kernels it imports (the DeepEP flex token dispatcher with
# moe_permute_fusion, weighted_bias_swiglu_impl, TE GroupedLinear experts): priced with Megatron-Core's fused
# element-wise share and fused MoE kernels. Its published benchmarks route with fake_balanced_gate (every expert
# the same load): moe_imbalance 1.0, as the megatron-core profile for the same reason. dispatcher "deepep" (or
# "hybridep") is --moe-dispatcher hybridep, "torch" is alltoall.
NEMO_AUTOMODEL = Framework(
    name="nemo-automodel", attention="flash", overlap_dp=True, overlap_tp=False, states="executor", grad_bytes=4,
    dp_sync_pipelined="end", zero23_every_micro_batch=False, cp_comm="ring", fp8_saves_fp8_inputs=True,
    fp8_scaling="delayed", recompute_early_stop=True, elementwise_traffic=MEGATRON_CORE.elementwise_traffic,
    moe_imbalance=1.0, moe_grouped_gemm=True, moe_kernels="fused", moe_dispatcher="hybridep",
    moe_dispatchers=("alltoall", "hybridep"), fp8_experts=True, master_bytes=2, moment_bytes=4, zero_stages=(2, 3),
    loss_logits="16-bit", adam_step="foreach",
    source="NVIDIA-NeMo/Automodel (nemo_automodel/components/moe/parallelizer.py apply_fsdp: MixedPrecisionPolicy "
           "bf16/fp32, reshard_after_forward; moe/fsdp_mixin.py: gradients synced on the last backward only; "
           "moe/experts.py: TE GroupedLinear, Megatron's token dispatcher with DeepEP; "
           "examples/llm_benchmark/*_te_deepep.yaml: attn/linear/rms_norm te, rope_fusion, experts gmm, "
           "dispatcher deepep, fake_balanced_gate, activation_checkpointing, loss_fn MaskedCrossEntropy with "
           "fp32_upcast false, optimizer torch.optim.Adam at its defaults (foreach on GPUs); recipes/llm/train_ft.py "
           "_forward_backward_step: the output kept through backward)")

FRAMEWORKS = {f.name: f for f in (PARAPLAN, MEGATRON_CORE, MEGATRON_2021, MEGATRON_DEEPSPEED, DEEPSPEED, TORCHTITAN,
                                  NEMO_AUTOMODEL)}


def framework(profile: str | Framework, attention: str | None = None, overlap_dp: bool | None = None,
              overlap_tp: bool | None = None, moe_dispatcher: str | None = None, moe_a2a_overlap: bool | None = None,
              grad_reduce_in_fp32: bool | None = None, optimizer_states: str | None = None,
              fused_softmax: str | None = None, moe_capacity_factor: float | None = None,
              moe_pad_to_capacity: bool | None = None, fp8_recipe: str | None = None,
              moe_shared_expert_overlap: bool | None = None, moe_routing: str | None = None,
              optimizer_implementation: str | None = None) -> Framework:
    """The named profile (or the given one) with explicit switches on top (``--attention``, ``--overlap-dp``,
    ``--overlap-tp``, ``--moe-dispatcher``, ``--moe-routing``, ``--moe-a2a-overlap``, ``--moe-shared-expert-overlap``,
    ``--grad-reduce-in-fp32``,
    ``--optimizer-states``, ``--fused-softmax``, ``--moe-capacity-factor``, ``--moe-pad-to-capacity``,
    ``--fp8-recipe``, ``--optimizer-implementation``: the settings
    of a recipe, Megatron-Bridge's names where it has them). Switches a stack cannot run are refused, not priced:
    this executor (and torchtitan) dispatch every token (dropless) with one all-to-all each way, exposed, reduce
    fp32 gradients and keep torch's Adam state in fp32."""
    if isinstance(profile, Framework):
        fw = profile
    elif profile in FRAMEWORKS:
        fw = FRAMEWORKS[profile]
    else:
        raise PlanError(f"unknown framework {profile!r} (one of {', '.join(FRAMEWORKS)})")
    changes = {k: v for k, v in (("attention", attention), ("overlap_dp", overlap_dp), ("overlap_tp", overlap_tp),
                                 ("moe_dispatcher", moe_dispatcher), ("moe_a2a_overlap", moe_a2a_overlap),
                                 ("fused_softmax", fused_softmax), ("moe_capacity_factor", moe_capacity_factor),
                                 ("moe_pad_to_capacity", moe_pad_to_capacity),
                                 ("moe_shared_expert_overlap", moe_shared_expert_overlap), ("moe_routing", moe_routing))
               if v is not None}
    if grad_reduce_in_fp32 is not None:
        changes["grad_bytes"] = 4 if grad_reduce_in_fp32 else 2
    if optimizer_states is not None:
        if optimizer_states not in OPTIMIZER_STATES:
            raise PlanError(f"--optimizer-states must be one of {', '.join(OPTIMIZER_STATES)}, "
                            f"got {optimizer_states!r}")
        changes["master_bytes"], changes["moment_bytes"] = OPTIMIZER_STATES[optimizer_states]
    if optimizer_implementation is not None:
        if optimizer_implementation not in ADAM_STEPS:
            raise PlanError(f"--optimizer-implementation must be one of {', '.join(ADAM_STEPS)}, "
                            f"got {optimizer_implementation!r}")
        if fw.states != "executor" or fw.adam_step == "executor":
            runs = "a fused Adam" if fw.states != "executor" else \
                "torch's AdamW as it builds it (one tensor at a time over DTensors, foreach over plain tensors)"
            raise PlanError(f"--optimizer-implementation {optimizer_implementation}: the {fw.name} stack runs {runs}; "
                            "the switch prices torch's implementations under an FSDP2 stack that picks one "
                            "(--framework torchtitan, nemo-automodel)")
        changes["adam_step"] = optimizer_implementation
    if fp8_recipe is not None:
        if fp8_recipe not in FP8_RECIPES:
            raise PlanError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {fp8_recipe!r}")
        if fw.fp8_scaling == "dynamic":  # torchao's float8 training
            if fp8_recipe != "tensorwise":
                raise PlanError(f"--fp8-recipe {fp8_recipe}: the {fw.name} stack's FP8 is torchao's float8 training, "
                                "which scales each tensor as it casts it (tensorwise); delayed scaling is Transformer "
                                "Engine's: price a stack that runs it, e.g. --framework megatron-core")
        else:
            changes["fp8_scaling"] = FP8_RECIPES[fp8_recipe]
    if changes.get("attention", fw.attention) not in ATTENTION_KERNELS:
        raise PlanError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}")
    softmax = changes.get("fused_softmax", fw.fused_softmax)
    if softmax not in FUSED_SOFTMAX:
        raise PlanError(f"--fused-softmax must be one of {', '.join(FUSED_SOFTMAX)}")
    if softmax != "always" and changes.get("attention", fw.attention) != "unfused":
        raise PlanError("--fused-softmax: only the unfused attention (--attention unfused) has a softmax kernel of its "
                        "own; a flash kernel fuses it")
    if changes.get("moe_dispatcher", fw.moe_dispatcher) not in MOE_DISPATCHERS:
        raise PlanError(f"MoE token dispatcher must be one of {', '.join(MOE_DISPATCHERS)}")
    if changes.get("moe_routing", fw.moe_routing) not in MOE_ROUTINGS:
        raise PlanError(f"--moe-routing must be one of {', '.join(MOE_ROUTINGS)}")
    if changes.get("moe_routing", fw.moe_routing) != "uniform" and \
            changes.get("moe_dispatcher", fw.moe_dispatcher) != "hybridep":
        raise PlanError("--moe-routing sets what a deduplicating dispatcher sends (--moe-dispatcher hybridep); the "
                        "alltoall dispatcher sends one copy per routed expert whatever the routing")
    capacity = changes.get("moe_capacity_factor", fw.moe_capacity_factor)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float)
                                 or not math.isfinite(capacity) or capacity <= 0):
        raise PlanError(f"--moe-capacity-factor must be a positive number, got {capacity!r}")
    if changes.get("moe_pad_to_capacity", fw.moe_pad_to_capacity) and capacity is None:
        raise PlanError("--moe-pad-to-capacity pads each expert to its capacity: give --moe-capacity-factor too")
    if changes.get("moe_shared_expert_overlap", fw.moe_shared_expert_overlap) and \
            changes.get("moe_a2a_overlap", fw.moe_a2a_overlap):
        raise PlanError("--moe-shared-expert-overlap and --moe-a2a-overlap cannot both be on: Megatron-Core refuses "
                        "the pair (TransformerConfig: disable moe_shared_expert_overlap when enabling "
                        "overlap_moe_expert_parallel_comm)")
    if fw.states == "executor":
        dispatcher = changes.get("moe_dispatcher", fw.moe_dispatcher)
        for flag, key, runs in ((f"--moe-dispatcher {dispatcher}", "moe_dispatcher",
                                 dispatcher if dispatcher in fw.moe_dispatchers else fw.moe_dispatchers[0]),
                                ("--moe-a2a-overlap", "moe_a2a_overlap", False),
                                ("--moe-shared-expert-overlap", "moe_shared_expert_overlap", False),
                                ("--moe-capacity-factor", "moe_capacity_factor", None),
                                ("--moe-pad-to-capacity", "moe_pad_to_capacity", False),
                                ("--no-grad-reduce-in-fp32", "grad_bytes", fw.grad_bytes),
                                (f"--optimizer-states {optimizer_states}", "master_bytes", fw.master_bytes),
                                (f"--optimizer-states {optimizer_states}", "moment_bytes", fw.moment_bytes)):
            if changes.get(key, runs) != runs:
                states = "fp32 weights and Adam moments" if fw.master_bytes == 4 else "bf16 weights and Adam moments"
                raise PlanError(f"{flag}: the {fw.name} stack does not run it (it reduces fp32 gradients, keeps "
                                f"{states} and dispatches every token, dropless, "
                                f"by {' or '.join(fw.moe_dispatchers)}, exposed); "
                                "price a stack that does, e.g. --framework megatron-core")
    return fw.replace(**changes) if changes else fw


# The switches framework() takes beside attention (which plans record on their own), as plan.json records them.
SWITCHES = ("overlap_dp", "overlap_tp", "moe_dispatcher", "moe_a2a_overlap", "grad_reduce_in_fp32", "optimizer_states",
            "fused_softmax", "moe_capacity_factor", "moe_pad_to_capacity", "fp8_recipe", "moe_shared_expert_overlap",
            "moe_routing", "optimizer_implementation")
NAMED_SWITCHES = ("moe_dispatcher", "optimizer_states", "fused_softmax", "fp8_recipe", "moe_routing",
                  "optimizer_implementation")
NUMBER_SWITCHES = ("moe_capacity_factor",)  # the rest are on/off


def switches_of(fw: Framework) -> dict:
    """The switches (SWITCHES) that make ``fw`` of its named profile: what a plan records so that pricing it again,
    validating it or exporting it sees the stack the planner priced. Empty for a profile as it stands."""
    base = FRAMEWORKS[fw.name]
    out: dict = {k: getattr(fw, k) for k in ("overlap_dp", "overlap_tp", "moe_dispatcher", "moe_a2a_overlap",
                                             "fused_softmax", "moe_capacity_factor", "moe_pad_to_capacity",
                                             "moe_shared_expert_overlap", "moe_routing")
                 if getattr(fw, k) != getattr(base, k)}
    if fw.grad_bytes != base.grad_bytes:
        out["grad_reduce_in_fp32"] = fw.grad_bytes == 4
    if (fw.master_bytes, fw.moment_bytes) != (base.master_bytes, base.moment_bytes):
        out["optimizer_states"] = next(k for k, v in OPTIMIZER_STATES.items() if v == (fw.master_bytes,
                                                                                        fw.moment_bytes))
    if fw.fp8_scaling != base.fp8_scaling:
        out["fp8_recipe"] = next(k for k, v in FP8_RECIPES.items() if v == fw.fp8_scaling)
    if fw.adam_step != base.adam_step:
        out["optimizer_implementation"] = fw.adam_step
    return out


def switch_flags(fw: Framework) -> list[str]:
    """The switches that make ``fw`` of its named profile (switches_of, and the attention kernel, which plans record
    on their own) as the CLI flags that set them, e.g. ``["--optimizer-states bf16-moments", "--no-overlap-dp"]``;
    empty for a profile as it stands."""
    switches = switches_of(fw)
    if fw.attention != FRAMEWORKS[fw.name].attention:
        switches = {"attention": fw.attention, **switches}
    flags = []
    for key, value in switches.items():
        flag = key.replace("_", "-")
        flags.append((f"--{flag}" if value else f"--no-{flag}") if isinstance(value, bool) else f"--{flag} {value}")
    return flags


def describe(fw: Framework) -> str:
    """The stack a prediction was priced for, as the reports name it: the profile and the switches set apart from
    its defaults (switch_flags), e.g. ``megatron-core with --optimizer-states bf16-moments``."""
    flags = switch_flags(fw)
    return f"{fw.name} with {' '.join(flags)}" if flags else f"{fw.name} (the profile's defaults)"


def other_stack_note(fw: Framework, priced: str, measured: str, check: str) -> str | None:
    """Where a prediction priced for another stack than this executor's is set beside what this executor does
    (``execute --dry-run``'s trace, ``validate``'s measurements), the note that says so; None for this executor's
    own profile. ``priced``: what was priced ("the plan was"); ``measured``: what this executor gave ("the trace
    is"); ``check``: how to check the prediction itself ("price it ... to check the prediction itself")."""
    if fw.name == PARAPLAN.name:
        return None
    return (f"{priced} priced for framework {describe(fw)}, but {measured} of this executor's stack (paraplan): "
            f"their differences (states, buffers, overlaps) show as prediction error; {check}")


def sequence_parallel_as_run(fw: Framework, lay):
    """``lay`` as the stack runs it when sequence parallelism was not asked for: on beside tensor parallelism where
    the stack always has it (Framework.tp_always_sp: torchtitan); ``lay`` itself otherwise. simulate and compare price
    that (the search enumerates both and validate_layout drops the other)."""
    if fw.tp_always_sp and lay.tp > 1 and not lay.sequence_parallel:
        return lay.replace(sequence_parallel=True)
    return lay

"""FP8 training: what it changes in a transformer layer's time and memory, beyond the GEMM rate.

``--dtype fp8`` runs the linear layers of the transformer layers in FP8 (E4M3 forward, E5M2 gradients) and
everything else in bf16, as Transformer Engine (Megatron-Core, NeMo) and torchao's float8 training
(torchtitan, this project's executor on CUDA) do: the attention core (softmax(QK^T)V), norms, element-wise
ops, the embedding and the output layer stay bf16 (TE's fp8_autocast covers TE modules only; torchao's
default filter leaves the ``output`` layer out). compute.estimate_pass_times prices those GEMMs at the FP8
peak and the GPU's FP8 efficiency curve; this module adds what FP8 costs around them:

- quantisation traffic (each FP8 GEMM operand is read in bf16 and written in FP8 first): with TE's delayed
  scaling (the scale comes from an amax history; the amax of the new tensor is computed inside the cast,
  which also writes the transposed copy the other GEMM needs) a linear's input costs 2 + 1 + 1 bytes per
  element in forward and its output gradient the same in backward; with TE's per-tensor current scaling
  (Megatron-Core's ``--fp8-recipe tensorwise``, TE's Float8CurrentScaling) each cast is three kernels — the
  amax over the tensor, the scale from it, the cast with its transposed copy (Float8CurrentScalingQuantizer::
  quantize_impl in transformer_engine/pytorch/csrc/quantizer.cpp) —, 2 + 2 + 1 + 1 bytes per element, on the
  same tensors as delayed scaling (weights are cast once per step: FP8 parameters, or TE's cache across a
  step's micro-batches); not priced: the one-scalar amax all-reduce over the tensor-parallel group that a
  sequence-parallel input's cast waits for (latency only); with torchao's dynamic tensorwise
  scaling each cast is preceded by an amax pass over the tensor (2 more bytes read), the weight is cast
  every forward and again, transposed, in backward, and the saved bf16 input is cast again (transposed)
  for the weight gradient: 5 bytes per element of input, output gradient and weight per use;
- one kernel per cast (two with dynamic scaling: amax, then cast), at the GPU's per-kernel overhead; a grouped
  expert GEMM's operand is cast expert by expert with current scaling (TE's GroupedLinear split_quantize: only
  delayed scaling has the fused multi-tensor cast, transformer_engine/pytorch/csrc/extensions/cast.cpp), so each of
  a rank's E/ep experts pays the three kernels for its fc1 and fc2 input forward and output gradient backward;
- memory: TE saves a linear's input for the weight gradient as its FP8 (transposed) copy — 1 byte per
  element instead of 2 — while torchao saves the bf16 tensor (not counted for multi-head latent attention, whose
  saved tensors fused_activations.mla_bytes counts in 16 bits); FP8 weight copies, where a stack keeps them,
  are ``Framework.fp8_weight_bytes`` per parameter (memory.state_bytes).

Linear shapes per token of a dense transformer layer (Megatron names): QKV h -> (a + 2·kv)·d, output
projection a·d -> h, MLP h -> ffn (x2 when gated: SwiGLU) and ffn -> h. Column-parallel layers (QKV, MLP up)
take the whole input (its 1/t under sequence parallelism, where TE gathers the FP8 copy) and give 1/t of
the output; row-parallel ones (output projection, MLP down) the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import fused_moe
from .layout import recomputes_mlp, recomputes_norm_act

# bytes moved per element quantised (see the module docstring)
CAST_BYTES = {"delayed": 2 + 1 + 1, "current": 2 + 2 + 1 + 1, "dynamic": 2 + 2 + 1}
CAST_KERNELS = {"delayed": 1, "current": 3, "dynamic": 2}


@dataclass(frozen=True)
class LinearShapes:
    """Elements per token (and weight elements) one tensor-parallel rank's FP8 linears of a layer handle."""

    inputs: float  # GEMM input elements per token, summed over the layer's linears
    grad_outputs: float  # output-gradient elements per token
    weights: float  # weight elements
    saved_inputs: float  # input elements per token kept for the weight gradients
    linears: int  # FP8 GEMMs per pass (one per linear)


def mla_linears(spec, tp: int, sp: bool) -> tuple[float, float, float, int]:
    """(inputs, output gradients, weights, linears) of multi-head latent attention's FP8 linears on one of ``tp``
    ranks (Megatron-Core's MLASelfAttention, megatron/core/transformer/multi_latent_attention.py): the down
    projections h -> q_lora and h -> kv_lora + rope run duplicated on every rank (on its sequence shard under SP,
    like a column-parallel layer's input), the up projections q_lora -> a·(nope + rope) and kv_lora -> a·(nope +
    v) column-parallel behind their latent norms, the output projection a·v -> h row-parallel. Without a query
    rank (V2-Lite) the queries are projected directly, h -> a·(nope + rope), column-parallel."""
    h, a, t = spec.hidden_size, spec.num_attention_heads, tp
    q_head, v, rope = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim, spec.qk_rope_head_dim
    q_lora, kv_lora = spec.q_lora_rank, spec.kv_lora_rank
    shard = t if sp else 1  # duplicated projections and column-parallel inputs: the sequence shard under SP
    inputs = h / shard + kv_lora / shard + a * v / t  # kv down, kv up, output projection
    grads = (kv_lora + rope) / shard + a * (spec.qk_nope_head_dim + v) / t + h
    weights = h * (kv_lora + rope) + (kv_lora * a * (spec.qk_nope_head_dim + v) + a * v * h) / t
    if q_lora:  # q down (duplicated) and q up (column-parallel)
        inputs += h / shard + q_lora / shard
        grads += q_lora / shard + a * q_head / t
        weights += h * q_lora + q_lora * a * q_head / t
        return inputs, grads, weights, 5
    inputs += h / shard
    grads += a * q_head / t
    weights += h * a * q_head / t
    return inputs, grads, weights, 4


def layer_linears(spec, tp: int, sp: bool, moe_layer: bool = False, experts: bool = False) -> LinearShapes | None:
    """The FP8 linears of one transformer layer of ``spec`` on one of ``tp`` ranks (None: not a transformer
    layer). ``moe_layer``: its MLP is a mixture of experts; ``experts``: the experts' GEMMs run in FP8 too
    (Framework.fp8_experts), each tensor-parallel rank routing its own 1/tp of the tokens to k experts: per
    token, k copies through the routed experts' two GEMMs (h -> up, f -> h) and one through the shared experts'
    (width f_s). Multi-head latent attention's linears: :func:`mla_linears`."""
    if not getattr(spec, "is_transformer", False):
        return None
    h, d = spec.hidden_size, spec.head_dim
    a, kv = spec.num_attention_heads, spec.kv_heads
    t = tp
    rep = h / t if sp else h  # a column-parallel layer's input: whole, or its sequence shard under SP
    if getattr(spec, "mla", False):
        inputs, grads, weights, linears = mla_linears(spec, tp, sp)
    else:  # attention: QKV and the output projection; column-parallel outputs are sharded, row-parallel whole
        inputs, grads = rep + a * d / t, (a + 2 * kv) * d / t + h
        weights = (h * (a + 2 * kv) * d + a * d * h) / t
        linears = 2
    saved = inputs
    if not moe_layer:  # the dense MLP: up (x2 when gated: SwiGLU) and down
        ffn = spec.ffn_size
        up = ffn * (2 if spec.family == "llama" else 1)
        inputs += rep + ffn / t
        grads += up / t + h
        weights += (h * up + ffn * h) / t
        saved, linears = inputs, linears + 2
    elif experts:
        f, up, f_s, up_s = fused_moe.expert_widths(spec)
        k = spec.top_k
        inputs += (k * (h + f) + (h + f_s if f_s else 0)) / t
        grads += (k * (up + h) + (up_s + h if f_s else 0)) / t
        # the shared experts' first input is the norm's output the router keeps in 16 bits: no saving there
        saved += (k * (h + f) + f_s) / t
        linears += 2 + (2 if f_s else 0)
    return LinearShapes(inputs=inputs, grad_outputs=grads, weights=weights, saved_inputs=saved, linears=linears)


def cast_seconds(spec, framework, tokens: float, tp: int, sp: bool, hbm_Bps: float, kernel_s: float,
                 moe_layer: bool = False, local_experts: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of ``tokens`` tokens' FP8 quantisation in one layer;
    ``local_experts``: the routed experts on the rank (E/ep), whose grouped GEMMs' operands current scaling casts
    one expert at a time."""
    shapes = layer_linears(spec, tp, sp, moe_layer, framework.fp8_experts)
    if shapes is None:
        return 0.0, 0.0
    scaling = framework.fp8_scaling
    per = CAST_BYTES[scaling]
    casts = shapes.linears
    if scaling == "current" and moe_layer and framework.fp8_experts and framework.moe_grouped_gemm:
        casts += 2 * (max(local_experts, 1) - 1)  # fc1's and fc2's operand split per expert: one cast each
    kernels = CAST_KERNELS[scaling] * casts
    if scaling in ("delayed", "current"):  # TE: inputs in forward, output gradients in backward (weights are FP8
        # parameters or cast once per step: negligible per micro-batch)
        fwd_bytes = per * tokens * shapes.inputs
        bwd_bytes = per * tokens * shapes.grad_outputs
        return fwd_bytes / hbm_Bps + kernels * kernel_s, bwd_bytes / hbm_Bps + kernels * kernel_s
    # torchao dynamic: forward casts input and weight; backward casts the output gradient, the saved input
    # (transposed, for the weight gradient) and the weight (transposed, for the input gradient)
    fwd_bytes = per * (tokens * shapes.inputs + shapes.weights)
    bwd_bytes = per * (tokens * (shapes.grad_outputs + shapes.inputs) + shapes.weights)
    return fwd_bytes / hbm_Bps + 2 * kernels * kernel_s, bwd_bytes / hbm_Bps + 3 * kernels * kernel_s


def saved_bytes_saving(spec, framework, tokens: float, tp: int, sp: bool, recompute: str,
                       moe_layer: bool = False) -> float:
    """Bytes of one layer's activations per micro-batch that FP8 saves: the 16-bit copies of the linear inputs
    a TE stack keeps as FP8 instead (1 byte per element less); nothing for torchao or under full
    recomputation (only the layer's input is kept); under MLP recomputation only the attention's linears keep
    theirs."""
    if not framework.fp8_saves_fp8_inputs or recompute == "full" or getattr(spec, "mla", False):
        return 0.0  # MLA's saved tensors are fused_activations.mla_bytes' (16-bit, what its modules keep)
    if recomputes_mlp(recompute):  # the attention's linears alone (layer_linears of an MoE layer without its experts)
        shapes = layer_linears(spec, tp, sp, True, False)
    else:
        shapes = layer_linears(spec, tp, sp, moe_layer, framework.fp8_experts)
    if shapes is None:
        return 0.0
    saved = shapes.saved_inputs
    if recomputes_norm_act(recompute) and moe_layer and framework.fp8_experts:  # moe_act keeps no second-GEMM input
        saved -= spec.top_k * fused_moe.expert_widths(spec)[0] / tp
    return tokens * saved * 1.0

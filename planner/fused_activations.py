"""Activations a transformer layer keeps under Megatron-Core with Transformer Engine's fused modules.

The profiler traces what eager PyTorch modules save (this executor's layers): every norm keeps its input
and its fp32 statistics, the rotary embedding its intermediates, SwiGLU its gate, up and product. Megatron-
Core builds the layer from Transformer Engine's fused modules instead, which save per token, in 16-bit
(Korthikanti et al. 2022, Sec. 4.1's accounting, for the modules as TE fuses them):

- ``TELayerNormColumnParallelLinear`` (norm + QKV, norm + MLP up): the norm's input (2h) and its output,
  the linear's input (2h; a sequence shard under sequence parallelism, gathered again in backward), twice;
- fused RoPE keeps nothing; the flash attention kernel keeps Q (2·a·d), K and V (2·2·kv·d) and its output
  (2·a·d), which the output projection shares as its input;
- the MLP: the up projection's output, the activation's input (2·up, up = 2·ffn when gated), and the
  activation's output, the down projection's input (2·ffn).

With query/key norms (Qwen3's ``qk_norm``), TE's norms keep their inputs: 2(a·d + kv·d) more.

Per token: 4h + 4h (the two norm + linear pairs) + 2(2a·d + 2kv·d) (attention) + 2·up + 2·ffn (MLP). Attention
and MLP tensors are split over the tensor-parallel ranks, the norms' over them only with sequence parallelism.
Korthikanti's 34·s·b·h for GPT (MHA, 4h MLP) is this count's 32·s·b·h plus the two residual dropout masks.
With a flash kernel selective recomputation (Megatron's ``core_attn``) saves nothing more: there is no score
matrix, and the kernel's inputs and output are kept by the linears around it. MLP recomputation (Megatron-
Core's recompute_modules ``mlp``/``moe``: the sublayer runs under tensor_parallel.checkpoint) keeps the
sublayer's input (2h: for a dense MLP the residual its fused norm + linear takes; for an MoE block the
separate pre-MLP norm's output, beside that norm's input) instead of the sublayer's tensors. Full
recomputation keeps the layer's input only. A layer whose MLP is a mixture of experts keeps its attention's
part as above, the pre-MLP norm's input (2h) and what planner/fused_moe.py counts for the MoE block.
"""

from __future__ import annotations

from . import fused_moe


def fused_layer_bytes(spec, tokens: float, tp: int, sp: bool, recompute: str, moe_layer: bool = False) -> float | None:
    """Bytes one rank keeps for ``tokens`` tokens through one transformer layer of ``spec`` (None: a layer this
    accounting does not describe — MLA — whose traced bytes stand). ``moe_layer``: the layer's MLP is a
    Megatron-Core MoE block (planner/fused_moe.py) behind its own pre-MLP norm."""
    if getattr(spec, "mla", False):
        return None
    h, d, a, kv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.kv_heads
    if recompute == "full":
        return 2 * h * tokens / (tp if sp else 1)
    attention = 2 * (a * d + 2 * kv * d) + 2 * a * d
    if getattr(spec, "qk_norm", False):  # the query and key norms keep their inputs
        attention += 2 * (a * d + kv * d)
    if moe_layer:
        # the attention's norm + linear pair, the pre-MLP norm's input; each tensor-parallel rank routes its own
        # 1/tp of the tokens (Megatron-Core requires sequence parallelism for MoE under TP). Recomputing the MoE
        # block (recompute_modules moe) keeps its input, the norm's output, instead of what the block saves.
        block = 2 * h if recompute == "mlp" else fused_moe.saved_bytes(spec)
        return tokens * ((4 * h + 2 * h) / (tp if sp else 1) + (attention + block) / tp)
    ffn = spec.ffn_size
    up = 2 * ffn if spec.family == "llama" else ffn
    if recompute == "mlp":  # recompute_modules mlp: the checkpointed TE MLP keeps only its input (2h)
        return tokens * ((4 * h + 2 * h) / (tp if sp else 1) + attention / tp)
    replicated = 4 * h + 4 * h  # the two norms' inputs and outputs
    mlp = 2 * up + 2 * ffn
    return tokens * (replicated / (tp if sp else 1) + (attention + mlp) / tp)

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
matrix, and the kernel's inputs and output are kept by the linears around it (but with multi-head latent
attention, whose up-projections selective recomputation repeats too: see :func:`mla_bytes`). MLP recomputation
(Megatron-Core's recompute_modules ``mlp``/``moe``: the sublayer runs under tensor_parallel.checkpoint) keeps the
sublayer's input (2h: for a dense MLP the residual its fused norm + linear takes; for an MoE block the
separate pre-MLP norm's output, beside that norm's input) instead of the sublayer's tensors. "norm+act"
(recompute_modules layernorm and moe_act: output-discarding checkpoints) frees the outputs of the norms that are
modules of their own — an MoE layer's pre-MLP norm, MLA's input norm; the others are fused into TE's norm + linear
modules — and the routed experts' activation outputs (2f per token copy). Full
recomputation keeps the layer's input only. A layer whose MLP is a mixture of experts keeps its attention's
part as above, the pre-MLP norm's input (2h) and what planner/fused_moe.py counts for the MoE block.
Multi-head latent attention (DeepSeek) keeps what Megatron-Core's MLA modules save instead (:func:`mla_bytes`).
"""

from __future__ import annotations

from . import fused_moe
from .layout import recomputes_core, recomputes_mlp, recomputes_norm_act


def mla_bytes(spec, recompute: str = "none") -> tuple[float, float]:
    """(replicated, sharded) bytes per token Megatron-Core's multi-head latent attention keeps (MLASelfAttention,
    megatron/core/transformer/multi_latent_attention.py, with TE modules): the input norm's input and output
    (2h each; the down projections run on the sequence shard under SP and share the norm's output as input);
    the query and key/value latents, each before and after its norm (2·(q_lora + kv_lora) twice: the up
    projections are column-parallel, their latents sharded like the hidden states); the flash kernel's query and
    key (a heads of qk_nope + qk_rope each), value (a·v_head) and output (a·v_head, shared with the output
    projection). The rotary part of the key (qk_rope per token, gathered whole) is negligible and left out.
    Without SP the latents and norms are replicated (the down projections run on every rank).
    ``recompute`` "selective" (and "selective+mlp") recomputes the up-projections too (recompute_modules
    ``mla_up_proj``: output-discarding checkpointing frees the kernel's query, key and value after the forward and
    rebuilds them from the latents in backward): the kernel's output alone stays of the sharded part. "norm+act"
    (recompute_modules layernorm) discards the input norm's output, a module of its own here, and rebuilds it."""
    h, a = spec.hidden_size, spec.num_attention_heads
    q_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    latents = 4 * ((spec.q_lora_rank or 0) + spec.kv_lora_rank)
    replicated = (2 * h if recomputes_norm_act(recompute) else 4 * h) + latents
    qkv = 0 if recomputes_core(recompute) else 2 * a * (2 * q_head + spec.v_head_dim)
    return replicated, qkv + 2 * a * spec.v_head_dim


def fused_layer_bytes(spec, tokens: float, tp: int, sp: bool, recompute: str, moe_layer: bool = False,
                      copies: float = 1.0) -> float:
    """Bytes one rank keeps for ``tokens`` tokens through one transformer layer of ``spec``. ``moe_layer``: the
    layer's MLP is a Megatron-Core MoE block (planner/fused_moe.py) behind its own pre-MLP norm, keeping ``copies``
    times the mean routed copies (moe.padded_copies)."""
    h, d, a, kv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.kv_heads
    if recompute == "full":
        return 2 * h * tokens / (tp if sp else 1)
    if getattr(spec, "mla", False):  # the attention's norm and its tensors (mla_bytes), in the same two shares
        norm_and_qkv, attention = mla_bytes(spec, recompute)
        return tokens * (norm_and_qkv / (tp if sp else 1)) + _mlp_bytes(spec, tokens, tp, sp, recompute, moe_layer,
                                                                           attention, replicated=0.0, copies=copies)
    attention = 2 * (a * d + 2 * kv * d) + 2 * a * d
    if getattr(spec, "qk_norm", False):  # the query and key norms keep their inputs
        attention += 2 * (a * d + kv * d)
    return _mlp_bytes(spec, tokens, tp, sp, recompute, moe_layer, attention, replicated=4 * h, copies=copies)


def _mlp_bytes(spec, tokens: float, tp: int, sp: bool, recompute: str, moe_layer: bool, attention: float,
               replicated: float, copies: float = 1.0) -> float:
    """The layer's bytes given its attention's (``attention`` sharded and ``replicated`` per token), with its MLP
    sublayer's added."""
    h = spec.hidden_size
    if moe_layer:
        # the attention's norm + linear pair, the pre-MLP norm's input; each tensor-parallel rank routes its own
        # 1/tp of the tokens (Megatron-Core requires sequence parallelism for MoE under TP). Recomputing the MoE
        # block (recompute_modules moe) keeps its input, the norm's output, instead of what the block saves.
        block = 2 * h if recomputes_mlp(recompute) else fused_moe.saved_bytes(spec, copies)
        if recomputes_norm_act(recompute):  # recompute_modules layernorm and moe_act discard the pre-MLP norm's
            # output (2h: the router's and the dispatch's input) and each routed copy's activation output (2f)
            block -= 2 * h + 2 * copies * spec.top_k * fused_moe.expert_widths(spec)[0]
        return tokens * ((replicated + 2 * h) / (tp if sp else 1) + (attention + block) / tp)
    ffn = spec.ffn_size
    up = 2 * ffn if spec.family == "llama" else ffn
    if recomputes_mlp(recompute):  # recompute_modules mlp: the checkpointed TE MLP keeps only its input (2h)
        return tokens * ((replicated + 2 * h) / (tp if sp else 1) + attention / tp)
    replicated += 4 * h  # the MLP's norm + linear pair: the norm's input and output
    mlp = 2 * up + 2 * ffn
    return tokens * (replicated / (tp if sp else 1) + (attention + mlp) / tp)

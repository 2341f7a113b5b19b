"""What a fused RMSNorm kernel keeps for its backward less than the eager form the profiler traces.

The profiler traces blocks on the meta device (and the executor's dry run traces there too), where torch's
``nn.RMSNorm`` runs ``aten::_fused_rms_norm``'s composite form: upcast, pow, mean, rsqrt, two multiplies, cast. Its
autograd keeps, per normalised element, the input's fp32 upcast and the fp32 normalised tensor (16-bit training:
8 bytes; fp32: the input itself and the normalised tensor, 8 bytes). A fused kernel — torch's ``_fused_rms_norm_cuda``
(``nn.RMSNorm`` on CUDA), whose backward formula in ``derivatives.yaml`` is ``_fused_rms_norm_backward(grad, input,
normalized_shape, rstd, weight, ...)``, torchtitan's, Transformer Engine's — keeps the input (2 bytes in 16-bit,
4 in fp32) and one fp32 reciprocal RMS per row (the composite form keeps that too). So a stack that runs fused norms
keeps 6 bytes per normalised 16-bit element less than the trace (4 in fp32).

Per Llama layer that is the two hidden-size norms (sharded over the tensor-parallel ranks with sequence parallelism,
whole on each without), and with Qwen3's query/key norms each rank's query and key heads; the LM head's final norm
once. Llama 2 13B in bf16: 2 x 5,120 x 6 = 61,440 bytes a token a layer, 23% of what the trace keeps there
(llama2-13b batch 2 of 4,096 tokens under torchtitan without recomputation: 95.5 GiB priced from the trace,
75.5 GiB with fused norms; torchtitan ran it on 80 GB A100s, benchmarks/data/published_a100_extra.yaml).
MLA's latent norms are left at the trace's (not modelled here).
"""

from __future__ import annotations

from paraplan.models.specs import TransformerSpec

# bytes per normalised element the composite form keeps beyond the fused kernel's
EXCESS_BYTES = {2: 6, 4: 4}


def layer_norm_excess_bytes(spec: TransformerSpec, tokens: float, tp: int, sp: bool, elem: int,
                            kind: str, qk_norms_kept: bool = True) -> float:
    """Bytes one rank's block of ``kind`` keeps less with fused RMSNorms than its trace shows, for ``tokens``
    tokens (micro-batch x sequence, per context-parallel rank), activations of ``elem`` bytes; 0.0 where the
    block has no RMSNorm (gpt, bert: LayerNorm, which is one fused kernel on every device). ``qk_norms_kept``:
    False where selective recomputation reruns the query/key norms with the attention's prologue (nothing of
    theirs is kept then)."""
    if spec.family != "llama":
        return 0.0
    per_elem = EXCESS_BYTES[elem]
    hidden = spec.hidden_size / (tp if sp else 1)  # a norm's row on this rank
    if kind == "lm_head":
        return tokens * hidden * per_elem
    if kind != "transformer_layer":
        return 0.0
    elements = 2 * hidden
    if spec.qk_norm and qk_norms_kept:  # over each local query and key head
        elements += (spec.num_attention_heads + spec.kv_heads) * spec.head_dim / tp
    return tokens * elements * per_elem


__all__ = ["EXCESS_BYTES", "layer_norm_excess_bytes"]

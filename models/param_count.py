"""Closed-form parameter counts per family (total and, for mixtures of experts, active per token),
checked against the built modules and the published figures in the tests."""

from __future__ import annotations

from .specs import MLPSpec, ModelSpec, ResNetSpec, TransformerSpec, VGGSpec


def attention_params(spec: TransformerSpec) -> int:
    """Q, K, V and output projections (+ biases for gpt/bert, + Qwen3's per-head RMSNorms on Q and K).

    Multi-head latent attention (DeepSeek-V2 paper, arXiv 2405.04434, Sec. 2.1.2-2.1.3; the layer names of
    HF's modeling_deepseek.py): queries through a rank-q_lora_rank bottleneck with an RMSNorm (or one direct
    projection), keys and values from one shared latent of kv_lora_rank (RMSNorm) plus a decoupled rotary
    key of qk_rope_head_dim shared by all heads, and the output projection from heads x v_head_dim.
    """
    h, a = spec.hidden_size, spec.num_attention_heads
    if spec.mla:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q = spec.q_lora_rank * a * qk if spec.q_lora_rank else h * a * qk  # up-projection, or the direct one
        kv = spec.kv_lora_rank * a * (spec.qk_nope_head_dim + spec.v_head_dim)
        return latent_down_params(spec) + q + kv + a * spec.v_head_dim * h
    q_out, kv_out = a * spec.head_dim, spec.kv_heads * spec.head_dim
    n = h * q_out + 2 * h * kv_out + q_out * h
    if spec.family != "llama":
        n += q_out + 2 * kv_out + h  # biases
    elif spec.qkv_bias:  # Qwen2: on q, k and v, not on the output projection
        n += q_out + 2 * kv_out
    if spec.qk_norm:
        n += 2 * spec.head_dim
    return n


def latent_down_params(spec: TransformerSpec) -> int:
    """Multi-head latent attention's down-projections and latent norms (wq_a and q_norm where q_lora_rank is set,
    wkv_a and kv_norm): q_lora_rank·(h + 1) + (kv_lora_rank + rope)·h + kv_lora_rank; 0 without MLA."""
    if not spec.mla:
        return 0
    q = spec.q_lora_rank or 0
    return q * (spec.hidden_size + 1) + (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.hidden_size \
        + spec.kv_lora_rank


def mlp_params(spec: TransformerSpec, ffn: int) -> int:
    """One MLP of width ``ffn``: SwiGLU's three bias-free matrices (llama) or GELU's two with biases."""
    h = spec.hidden_size
    if spec.family == "llama":
        return 3 * h * ffn
    return 2 * h * ffn + ffn + h


def expert_params(spec: TransformerSpec) -> int:
    """One routed or shared expert: an MLP of moe_ffn_hidden_size without biases (Mixtral, Qwen3 and
    DeepSeek experts have none; so do ours for gpt/bert, Megatron's --disable-bias-linear)."""
    return (3 if spec.family == "llama" else 2) * spec.hidden_size * spec.moe_ffn_size


def routed_expert_params(spec: TransformerSpec) -> int:
    """One routed expert: :func:`expert_params`, plus its linears' biases where the spec has them (GPT-OSS:
    the first linear's 2f outputs, gate and up, and the second's h)."""
    n = expert_params(spec)
    if spec.expert_bias:
        n += (2 if spec.family == "llama" else 1) * spec.moe_ffn_size + spec.hidden_size
    return n


def _norms(spec: TransformerSpec) -> int:
    """The layer's two norms: RMSNorm keeps a weight (llama), LayerNorm a weight and a bias."""
    return 2 * spec.hidden_size if spec.family == "llama" else 4 * spec.hidden_size


def transformer_layer_params(spec: TransformerSpec, index: int = 0) -> int:
    """Parameters of layer ``index``: a dense MLP, or (MoE layers) the router's E x h weight (and E biases), every
    routed expert and the shared experts."""
    n = attention_params(spec) + _norms(spec)
    if not spec.is_moe_layer(index):
        return n + mlp_params(spec, spec.ffn_size)
    router = (spec.hidden_size + spec.expert_bias) * spec.num_experts  # its E x h gate (and E biases)
    return n + router + spec.num_experts * routed_expert_params(spec) + spec.num_shared_experts * expert_params(spec)


def transformer_layer_active_params(spec: TransformerSpec, index: int = 0) -> int:
    """Parameters one token's forward pass uses in layer ``index``: all of a dense layer; in an MoE layer
    everything but the num_experts - experts_per_token routed experts the token is not sent to."""
    n = transformer_layer_params(spec, index)
    if spec.is_moe_layer(index):
        n -= (spec.num_experts - spec.top_k) * routed_expert_params(spec)
    return n


def transformer_embedding_params(spec: TransformerSpec) -> int:
    h = spec.hidden_size
    n = spec.vocab_size * h
    if spec.family != "llama":
        n += spec.seq_length * h
    if spec.family == "bert":
        n += 2 * h + 2 * h  # token types, LayerNorm
    return n


def transformer_head_params(spec: TransformerSpec, count_tied: bool = False) -> int:
    """Final norm (+ BERT's transform) and the vocabulary projection (its weight only when untied,
    unless ``count_tied``: a pipeline stage that holds the head alone keeps its own copy)."""
    h, v = spec.hidden_size, spec.vocab_size
    n = h if spec.family == "llama" else 2 * h
    if spec.family == "bert":
        n += h * h + h + v  # transform dense, decoder bias
    if count_tied or not spec.tied:
        n += v * h
    return n


def _resnet_params(spec: ResNetSpec) -> int:
    bn = lambda c: 2 * c
    kind, counts = spec.DEPTHS[spec.depth]
    total = 3 * 64 * 49 + bn(64)
    inplanes = 64
    for stage, (planes, n) in enumerate(zip((64, 128, 256, 512), counts, strict=True), start=1):
        for i in range(n):
            stride = 2 if (i == 0 and stage > 1) else 1
            if kind == "basic":
                out = planes
                total += inplanes * planes * 9 + bn(planes) + planes * planes * 9 + bn(planes)
            else:
                out = planes * 4
                total += inplanes * planes + bn(planes) + planes * planes * 9 + bn(planes) + planes * out + bn(out)
            if stride != 1 or inplanes != out:
                total += inplanes * out + bn(out)
            inplanes = out
    return total + inplanes * spec.num_classes + spec.num_classes


def _vgg_params(spec: VGGSpec) -> int:
    total, cin = 0, 3
    for c in spec.CONFIGS[spec.depth]:
        if c != "M":
            total += cin * c * 9 + c
            cin = c
    return total + (cin * 49 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * spec.num_classes + spec.num_classes)


def _mlp_params(spec: MLPSpec) -> int:
    widths = [spec.input_size, *spec.hidden_sizes, spec.num_classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def count_parameters(spec: ModelSpec) -> int:
    """Total parameters, tied weights counted once. Multi-token-prediction modules (DeepSeek-V3's
    ``mtp_layers``) are not built and not counted here: see :func:`mtp_params`."""
    if isinstance(spec, TransformerSpec):
        return (transformer_embedding_params(spec) + transformer_head_params(spec)
                + sum(transformer_layer_params(spec, i) for i in range(spec.num_layers)))
    if isinstance(spec, ResNetSpec):
        return _resnet_params(spec)
    if isinstance(spec, VGGSpec):
        return _vgg_params(spec)
    if isinstance(spec, MLPSpec):
        return _mlp_params(spec)
    raise TypeError(f"no closed-form count for {type(spec).__name__}")


def count_active_parameters(spec: ModelSpec) -> int:
    """Parameters one token's forward pass uses: the total less, in every MoE layer, the routed experts it
    is not sent to. The embedding table counts whole, as in the total (Mixtral's 12.9B and Qwen3's
    published active counts include it; DeepSeek-V3's 36.6B leaves the input embedding out). Equal to
    :func:`count_parameters` for dense models."""
    if not isinstance(spec, TransformerSpec) or not spec.is_moe:
        return count_parameters(spec)
    return (transformer_embedding_params(spec) + transformer_head_params(spec)
            + sum(transformer_layer_active_params(spec, i) for i in range(spec.num_layers)))


def mtp_params(spec: TransformerSpec) -> int:
    """Parameters of DeepSeek-V3's multi-token-prediction modules, not counting the embedding and output
    head they share with the main model (DeepSeek-V3 report, arXiv 2412.19437, Sec. 2.2; README_WEIGHTS.md):
    per module an RMSNorm on the hidden state and one on the embedding, the 2h -> h projection, one
    transformer layer like the last main one, and the shared head's own final RMSNorm."""
    h = spec.hidden_size
    per_module = 3 * h + 2 * h * h + transformer_layer_params(spec, spec.num_layers - 1)
    return spec.mtp_layers * per_module

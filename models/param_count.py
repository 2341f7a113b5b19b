"""Closed-form parameter counts per family, checked against the built modules in the tests."""

from __future__ import annotations

from .specs import MLPSpec, ModelSpec, ResNetSpec, TransformerSpec, VGGSpec


def transformer_layer_params(spec: TransformerSpec) -> int:
    h, f = spec.hidden_size, spec.ffn_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.kv_heads * spec.head_dim
    if spec.family == "llama":  # no biases; SwiGLU has three matrices; RMSNorm has a weight only
        return h * q_out + 2 * h * kv_out + q_out * h + 3 * h * f + 2 * h
    attn = (h * q_out + q_out) + 2 * (h * kv_out + kv_out) + (q_out * h + h)
    mlp = (h * f + f) + (f * h + h)
    return attn + mlp + 2 * 2 * h  # two LayerNorms, weight and bias


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
    """Total parameters, tied weights counted once."""
    if isinstance(spec, TransformerSpec):
        return (transformer_embedding_params(spec) + spec.num_layers * transformer_layer_params(spec)
                + transformer_head_params(spec))
    if isinstance(spec, ResNetSpec):
        return _resnet_params(spec)
    if isinstance(spec, VGGSpec):
        return _vgg_params(spec)
    if isinstance(spec, MLPSpec):
        return _mlp_params(spec)
    raise TypeError(f"no closed-form count for {type(spec).__name__}")

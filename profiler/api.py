"""The profiler's entry points, importable without torch.

A meta profile is deterministic, so it is cached on disk (see :mod:`.cache`); on a hit nothing here
imports torch, which keeps planning from a warm cache fast. On a miss, or on a real device, the
tracing and timing machinery of :mod:`.profile` is imported and run.
"""

from __future__ import annotations

import copy

from paraplan.models import CallableSpec, ModelSpec, TransformerSpec, load_model_spec

from . import cache
from .errors import ProfileError
from .records import ModelProfile


def default_dtype(device: str) -> str:
    return "fp32" if device == "cpu" else "bf16"


def profile_model(model: str | ModelSpec, device: str = "meta", micro_batch: int = 1, seq_length: int | None = None,
                  dtype: str | None = None, tp_degrees: list[int] | None = None, warmup: int = 2,
                  repeats: int = 5) -> ModelProfile:
    """Profile ``model`` at ``micro_batch`` samples (and ``seq_length`` tokens each, for language models).

    A transformer's layers are identical, so a two-layer copy of the model is traced (and timed) and
    its second layer's record stands for every layer: a 126-layer model costs what a 2-layer one does.
    A mixture of experts with dense layers (the first k, or all but every moe_layer_step-th) is traced as
    one dense and two MoE layers, the dense layer's record standing for the dense layers and the last for
    the MoE layers.
    """
    spec = load_model_spec(model) if isinstance(model, str) else model
    for t in tp_degrees or []:  # what the planner accepts (planner/layout.py): whole heads and FFN columns per rank
        if not isinstance(spec, TransformerSpec):
            raise ProfileError(f"--tp: {spec.name} is a {spec.family} model; tensor-parallel views are of transformers")
        for what, n in (("attention heads", spec.num_attention_heads), ("key/value heads", spec.kv_heads),
                        ("FFN size", spec.ffn_size)):
            if n % t:
                raise ProfileError(f"--tp {t} does not divide {spec.name}'s {n} {what}")
    key = None
    if device == "meta" and not isinstance(spec, CallableSpec):
        key = cache.cache_key(spec.to_dict(), micro_batch, seq_length, dtype or default_dtype(device),
                              sorted(set(tp_degrees or [])))
        hit = cache.load(key)
        if hit is not None:
            return hit
    moe_layers = isinstance(spec, TransformerSpec) and spec.is_moe
    dense = spec.num_layers - spec.num_moe_layers if moe_layers else 0
    if isinstance(spec, TransformerSpec) and spec.num_layers > 2 + min(dense, 1):
        changes = {"num_layers": 3, "dense_layers": 1, "moe_layer_step": 1} if dense else {"num_layers": 2}
        short = profile_model(spec.replace(**changes), device, micro_batch, seq_length, dtype, tp_degrees,
                              warmup, repeats)
        embed, *traced, head = short.layers
        first, layer = traced[0], traced[-1]  # a dense first layer (when there are dense layers), an MoE/any layer
        layers = [embed]
        for i in range(spec.num_layers):
            copy_ = copy.deepcopy(first if moe_layers and not spec.is_moe_layer(i) else layer)
            copy_.name = f"layers.{i}"
            layers.append(copy_)
        layers.append(head)
        # the layers beyond those the short model has: dense ones like `first`, the others like `layer`
        more_first, more_layer = dense - min(dense, 1), spec.num_layers - dense - (len(traced) - min(dense, 1))
        short.num_parameters += more_first * first.params + more_layer * layer.params
        if short.num_active_parameters is not None:
            short.num_active_parameters += (more_first * (first.params - first.inactive_params)
                                            + more_layer * (layer.params - layer.inactive_params))
        short.layers = layers
        short.model, short.spec = spec.name, spec.replace(seq_length=short.seq_length).to_dict()
        result = short
    else:
        from .profile import _profile_model  # torch: only on a miss

        result = _profile_model(spec, device, micro_batch, seq_length, dtype, tp_degrees, warmup, repeats)
    if key is not None:
        cache.store(key, result)
    return result


def profile_for_planning(spec: ModelSpec, dtype: str) -> ModelProfile:
    """The meta profile at one sample per micro-batch, with each pass's memory traffic split into a
    part that grows with the micro-batch (activations) and a fixed part (weight-sized: gradient
    accumulation, optimizer-facing copies), found by also profiling two samples: fixed = 2·t(1) - t(2).
    The cost model scales only the first part by the micro-batch size."""
    one = profile_model(spec, "meta", micro_batch=1, dtype=dtype)
    two = profile_model(spec, "meta", micro_batch=2, dtype=dtype)
    for a, b in zip(one.layers, two.layers, strict=True):
        for mix_a, mix_b in ((a.fwd_ops, b.fwd_ops), (a.bwd_ops, b.bwd_ops)):
            mix_a.other_bytes_fixed = max(0, min(mix_a.other_bytes, 2 * mix_a.other_bytes - mix_b.other_bytes))
    return one

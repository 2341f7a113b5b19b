"""Fused RMSNorm pricing (planner/fused_norms.py): what torch's eager RMSNorm keeps beyond the fused kernel's
input and reciprocal RMS (derivatives.yaml's ``_fused_rms_norm`` backward), traced, and the published torchtitan run
it lets fit."""

from __future__ import annotations

import pytest
import torch

from paraplan.models.specs import TransformerSpec
from paraplan.models.transformer import TransformerLayer
from paraplan.planner.fused_norms import layer_norm_excess_bytes

B, S = 2, 64


def _norm_saved_beyond_fused(spec: TransformerSpec, dtype: torch.dtype) -> int:
    """Bytes the layer's RMSNorm modules keep for backward (traced on meta, as the profiler traces) less what the fused
    kernel keeps: each norm's input and its per-row reciprocal RMS."""
    layer = TransformerLayer(spec).to(device="meta", dtype=dtype)
    norms = [m for m in layer.modules() if isinstance(m, torch.nn.RMSNorm)]
    inside, kept, fused = [False], {}, [0]
    params = {p.untyped_storage()._cdata for p in layer.parameters()}

    def enter(module, args):
        inside[0] = True
        x = args[0]  # (..., n)
        fused[0] += x.numel() * x.element_size() + x.numel() // x.shape[-1] * 4  # input + fp32 rstd per row

    def leave(module, args, out):
        inside[0] = False

    for m in norms:
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)

    def pack(t):
        key = t.untyped_storage()._cdata
        if inside[0] and key not in params:
            kept[key] = t.untyped_storage().nbytes()
        return t

    x = torch.empty(B, S, spec.hidden_size, device="meta", dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values()) - fused[0]


@pytest.mark.parametrize("dtype,elem", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_eager_norms_keep_what_the_formula_says_beyond_the_fused_kernel(dtype, elem, qk_norm):
    spec = TransformerSpec(name="t", family="llama", num_layers=2, hidden_size=256, num_attention_heads=8,
                           num_kv_heads=4, ffn_hidden_size=704, seq_length=S, vocab_size=1000, qk_norm=qk_norm,
                           head_dim=48 if qk_norm else None)
    assert _norm_saved_beyond_fused(spec, dtype) == layer_norm_excess_bytes(spec, B * S, 1, False, elem,
                                                                            "transformer_layer")


def test_gpt_layers_have_no_rms_norm_to_correct():
    spec = TransformerSpec(name="g", family="gpt", num_layers=2, hidden_size=256, num_attention_heads=8,
                           seq_length=S, vocab_size=1000)
    assert layer_norm_excess_bytes(spec, B * S, 1, False, 2, "transformer_layer") == 0.0


def test_torchtitan_llama2_13b_without_recomputation_fits_as_it_ran():
    """torchtitan's August 2024 table (benchmarks/data/published_a100_extra.yaml): Llama 2 13B, batch 2 of 4,096
    tokens per GPU, no activation checkpointing, FSDP over 64 A100 80GB, ran. Priced from the eager trace it needed
    95.5 GiB; with fused norms (6 bytes an element less, two norms of 5,120 a token a layer) 75.5 GiB."""
    from paraplan.planner.costmodel import CostModel
    from paraplan.planner.layout import Layout
    from paraplan.planner.workload import Workload

    work = Workload.create("llama2-13b", "dgx-a100-80gb", 128, seq_length=4096, framework="torchtitan")
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=2, global_batch=128, zero=3)
    pred = CostModel(work).evaluate(lay, [list(range(len(work.profile("bf16").layers)))], ["none"])
    assert pred.fits and pred.peak_memory_gib < 80
    paraplan = Workload.create("llama2-13b", "dgx-a100-80gb", 128, seq_length=4096, framework="paraplan")
    eager = CostModel(paraplan).evaluate(lay, [list(range(len(paraplan.profile("bf16").layers)))], ["none"])
    per_layer = 2 * 5120 * 6 * 2 * 4096  # two norms, 6 bytes an element, the micro-batch's tokens
    assert eager.memory_gib["activations"] - pred.memory_gib["activations"] == pytest.approx(
        (40 * per_layer + 5120 * 6 * 2 * 4096) / 2**30, rel=1e-6)  # the 40 layers and the head's final norm


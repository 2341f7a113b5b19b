"""A Megatron-Core MoE block as Transformer Engine and Megatron's fused MoE kernels run it: the bytes it keeps
for backward and the bytes its non-GEMM kernels move, per token a rank routes.

The profiler traces this project's eager MoE block (models/moe.py); Megatron-Core's ``MoELayer`` with
``moe_grouped_gemm``, ``moe_permute_fusion``, ``moe_router_fusion`` and ``bias_activation_fusion`` (the
settings of Megatron-Bridge's MoE recipes, Megatron-LM docs/api-guide/fusions.md and megatron/core/
transformer/moe/README.md) runs it as a fixed set of kernels. Per token routed to k experts, with h the hidden
size, f one expert's FFN width, up = 2f for a gated (SwiGLU) expert and f otherwise, E the experts, 16-bit
tensors (2 bytes) and fp32 router scores:

Kept for backward:
- the router: its input, the pre-MLP norm's output (2h; the shared experts read the same tensor), and its
  scores after the fused top-k softmax (4E);
- per routed copy (k of them): the first expert GEMM's input (2h), the fused activation's input (2·up) and its
  router probability (4: today's Megatron-Core hands the permuted probabilities to the experts, whose fused
  weighted activation applies them before the second GEMM — TEGroupedMLP.forward's ``permuted_probs``), the
  second GEMM's input (2f); the permutation and the unpermute keep only index maps (before Megatron-Core 0.13
  the unpermute weighted the outputs and kept them, 2h per copy more: the 2024-25 rows of
  benchmarks/data/published_moe.yaml ran that, and are priced as today's kernels);
- the shared experts (width f_s): the activation's input (2·up_s) and the second GEMM's input (2·f_s).

Moved by the kernels other than GEMMs (reads plus writes; GEMMs are priced by their FLOPs), forward:
- top-k softmax over fp32 logits: read 4E, write 4E;
- fused permute: read the token (2h), write its k copies (2kh); with the all-to-all dispatcher and more than
  one expert on the rank, the received tokens are sorted by expert and the outputs sorted back
  (``sort_chunks_by_idxs``: read and write 2kh, twice); DeepEP / HybridEP write them in expert order;
- fused (weighted) activation: read 2·up, write 2f per copy (and per shared-expert token);
- fused unpermute: read the k outputs (2kh), write one token (2h); adding the shared experts' output: read
  4h, write 2h.
Backward, the transposes: the unpermute's gradient reads the output gradient (2h) and writes the copies'
gradients (2kh); the sorts again (4kh each, where there); the activation's gradient reads its input and the
output gradient and writes the input gradient (2·up + 2f + 2·up per copy; the probabilities' gradient with it); the
permute's gradient sums the k copies (read 2kh, write 2h); the top-k softmax's gradient reads scores and
gradient and writes a gradient (12E); the shared experts' activation as the routed ones'.

FP8 with the all-to-all dispatcher: the grouped GEMM needs each expert's tokens in multiples of 16 rows, which
that dispatcher's permutation does not give, so TE's Fp8Padding copies the permuted tokens into a padded buffer
and Fp8Unpadding copies the outputs back (megatron/core/transformer/moe/experts.py: "Regular AllToAll normally
reaches this branch"; HybridEP pads inside its dispatch, and routing does where moe_router_padding_for_
quantization is set, which the recipes priced here leave off): read and write 2h per copy each way, twice
(8kh forward), and their gradients the same backward.
FP8 keeps the expert GEMMs' inputs as FP8 copies, 1 byte each instead of 2: planner/fp8.py subtracts that.

Expert biases (GPT-OSS; spec field expert_bias): TE's grouped linear adds the first linear's in its GEMMs, but
the second's is returned apart (skip_bias_add) and added expert by expert, scaled by the router probability
(Megatron-Core experts.py TEGroupedMLP._apply_bias, from a329dd6d, 2025-09-22, "Enable bias in expert mlp
[gpt-oss 5/5]", to 883533e0, 2026-08-14, which packed it into one kernel for tensor token counts):
``torch.cat([t + b * p for each expert's rows]).to(dtype)``. Per routed copy, forward: b·p written in fp32
(4h), the sum reading the 16-bit output (2h) and b·p (4h) and writing fp32 (4h), the cat reading and writing it
(8h), the cast back reading 4h and writing 2h: 28h; backward: the cast's gradient (2h in, 4h out), the sum's
gradient cast to 16 bits for the output (4h, 2h), b's gradient as the rows' sum of gradient x p (4h read, 4h
written, 4h reduced), p's as the sum over h of gradient x b (the same 12h), and the split's gradient joining the
experts' 16-bit output gradients into one tensor (2h, 2h): 40h. Kernels: two per local expert forward (multiply,
add) and the cat and the cast; backward five per local expert (two multiplies, two reductions, the cast of its
output gradient), the cast's gradient and the split's (:func:`expert_bias_kernels`). Megatron-Core from 883533e0
adds a packed bias in one pass where the token counts reach the experts as a device tensor, but keeps this loop
where they are host lists (the alltoall dispatcher's): priced as the loop for every megatron-core plan.
The pre-MLP norm is outside the block (fused_activations.py counts it with the layer).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEBlockBytes:
    """Per token a rank routes through one MoE block."""

    saved: float  # bytes kept for backward
    fwd: float  # bytes the forward's non-GEMM kernels move
    bwd: float  # bytes the backward's non-GEMM kernels move


def expert_widths(spec) -> tuple[int, int, int, int]:
    """(f, up, f_s, up_s): one routed expert's FFN width and its first GEMM's output width; the shared experts'."""
    gated = spec.family == "llama"
    f = spec.moe_ffn_size
    f_s = spec.num_shared_experts * f
    return f, (2 if gated else 1) * f, f_s, (2 if gated else 1) * f_s


def block_bytes(spec, local_experts: int, dispatcher: str, fp8: bool = False) -> MoEBlockBytes:
    """The Megatron-Core MoE block of ``spec`` on a rank holding ``local_experts`` routed experts, with the
    token ``dispatcher`` (``alltoall`` or ``hybridep``), its experts' GEMMs in FP8 or not: see the module
    docstring."""
    h, k, e = spec.hidden_size, spec.top_k, spec.num_experts
    f, up, f_s, up_s = expert_widths(spec)
    sorts = 2 * (4 * k * h) if dispatcher == "alltoall" and local_experts > 1 else 0.0
    padding = 8 * k * h if fp8 and dispatcher == "alltoall" else 0.0  # Fp8Padding and Fp8Unpadding
    shared_add = 6 * h if f_s else 0
    fwd = (8 * e + (2 * h + 2 * k * h) + sorts + padding + k * (2 * up + 2 * f) + (2 * k * h + 2 * h) + shared_add
           + (2 * up_s + 2 * f_s if f_s else 0))
    bwd = ((2 * h + 2 * k * h) + sorts + padding + k * (4 * up + 2 * f) + (2 * k * h + 2 * h) + 12 * e + shared_add
           + (4 * up_s + 2 * f_s if f_s else 0))
    return MoEBlockBytes(saved=saved_bytes(spec), fwd=fwd, bwd=bwd)


def saved_bytes(spec, copies: float = 1.0) -> float:
    """Bytes the block keeps for backward per token a rank routes (the module docstring's first list); ``copies``:
    the routed copies kept over the mean (moe.padded_copies: c where experts are padded to capacity)."""
    h, k, e = spec.hidden_size, spec.top_k, spec.num_experts
    f, up, f_s, up_s = expert_widths(spec)
    return 2 * h + 4 * e + copies * k * (2 * h + 2 * up + 4 + 2 * f) + (2 * up_s + 2 * f_s if f_s else 0)


EXPERT_BIAS_BYTES = (28, 40)  # (forward, backward) bytes per routed copy, times h (module docstring)


def expert_bias_bytes(spec) -> tuple[float, float]:
    """(forward, backward) bytes per token a rank routes (its k copies) of Megatron-Core's expert-by-expert bias
    add (the module docstring); none without expert biases."""
    if not getattr(spec, "expert_bias", False):
        return 0.0, 0.0
    per_token = spec.top_k * spec.hidden_size
    return EXPERT_BIAS_BYTES[0] * per_token, EXPERT_BIAS_BYTES[1] * per_token


def expert_bias_kernels(spec, local_experts: int) -> tuple[int, int]:
    """(forward, backward) kernels of that bias add on a rank holding ``local_experts`` experts."""
    if not getattr(spec, "expert_bias", False):
        return 0, 0
    return 2 * local_experts + 2, 5 * local_experts + 2

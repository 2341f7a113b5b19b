"""RMSNorm that keeps for its backward what a GPU's fused kernel keeps, on every device.

On CUDA, ``nn.RMSNorm`` runs ``aten::_fused_rms_norm`` (torch ``layer_norm_kernel.cu``, ``_fused_rms_norm_cuda``),
whose backward formula (``derivatives.yaml``: ``_fused_rms_norm_backward(grad, input, normalized_shape, rstd,
weight, ...)``) keeps the input, the per-token reciprocal RMS and the weight. Elsewhere — the CPU, and the meta
device that the profiler and the executor's dry run trace on — the same op falls back to its composite form (upcast,
pow, mean, rsqrt, two multiplies, cast), whose autograd keeps the fp32 upcast of the input and the fp32 normalised
tensor as well: for a 16-bit Llama layer, about six hidden-sizes of activations per token more than the GPU holds
(Llama 2 13B: 30,720 of ~133,000 elements a token a layer). The planner prices what the trace sees, so it would
over-price every RMSNorm model's memory on GPUs.

:class:`RMSNorm` is ``nn.RMSNorm`` (same parameters, state dict and tensor-parallel styles) that on CUDA runs the
native op and elsewhere :class:`_FusedSaving`: the composite forward's arithmetic, keeping only the fused kernel's
three tensors, and its backward from them — the same values and gradients (to rounding), the GPU's memory.
"""

from __future__ import annotations

import torch
from torch import nn


class _FusedSaving(torch.autograd.Function):
    """y = x · rsqrt(mean(x², -1) + eps) · w in the input's compute precision (fp32 for 16-bit inputs, as torch's
    composite form), keeping (x, rstd, w) for the backward as ``_fused_rms_norm`` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
        compute = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        upcast = x.to(compute)  # (..., h)
        eps = torch.finfo(compute).eps if eps is None else eps
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        y = upcast * rstd
        if weight is not None:
            y = y * weight
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        compute = rstd.dtype
        normed = x.to(compute) * rstd  # (..., h)
        g = grad.to(compute)
        scaled = g * weight.to(compute) if weight is not None else g
        # d/dx of x·r·w with r = (mean(x²) + eps)^-1/2: r·(g·w - x̂·mean(g·w·x̂))
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (g * normed).sum(tuple(range(x.dim() - 1))).to(weight.dtype)  # (h,): summed over the tokens
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension that keeps what the GPU's fused kernel keeps on every device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" or len(self.normalized_shape) != 1:
            return super().forward(x)
        return _FusedSaving.apply(x, self.weight, self.eps)


__all__ = ["RMSNorm"]

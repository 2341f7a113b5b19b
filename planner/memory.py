"""Memory per rank: model states (ZeRO's accounting), activations (Korthikanti et al.), an allowance.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and Fig. 1): mixed-precision Adam keeps
2 bytes of fp16/bf16 weights, 2 of gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance) per parameter. ZeRO-1 shards the optimizer state over the data-parallel group,
ZeRO-2 also the gradients, ZeRO-3 also the weights. Plain fp32 training keeps 4 + 4 + 8.

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, Table 2): what the
profiler traced the layer to save, split into the part inside the tensor-parallel regions (divided by
t) and the replicated rest (divided by t only with sequence parallelism). Selective recomputation keeps
what is saved without the attention core's internals; full recomputation keeps only the layer's
input (one checkpoint per layer) plus, while a layer's backward runs, that one layer's activations.
With a fused (flash) attention kernel the score matrix is never saved, so "none" costs what
"selective" does plus the core's output. With Megatron's ``unfused`` attention and dropout (the papers'
setting) each layer also keeps its dropout masks: one byte per element of the two residual-branch
dropouts (2·s·b·h, replicated) and of the attention dropout with its output (3·a·s²·b, sharded) —
exactly the terms by which Korthikanti et al.'s 34·s·b·h + 5·a·s²·b exceeds what our dropout-free
modules save.
"""

from __future__ import annotations

from paraplan.hardware_specs import GPUSpec
from paraplan.profiler import LayerProfile

GiB = 2**30
# Allowance for the framework: CUDA context, cuBLAS/NCCL workspaces and buffers (~1-2 GiB is what
# PyTorch jobs show on A100/H100 before the model is loaded), or a CPU process's runtime; plus the
# caching allocator's fragmentation, taken as 5% of everything else (PyTorch memory docs report
# 5-10% for training workloads without expandable segments).
FRAMEWORK_GIB = {"gpu": 1.5, "cpu": 0.3}
FRAGMENTATION = 0.05


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter for Adam in this training dtype."""
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 12)


def model_state_bytes(params: float, dtype: str, zero: int, dp: int, optimizer_on_servers: bool = False
                      ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one rank holding ``params`` parameters (ZeRO Sec. 5)."""
    w, g, o = state_bytes_per_param(dtype)
    weights, grads, opt = params * w, params * g, params * o
    if optimizer_on_servers:
        return weights, grads, 0.0
    if zero >= 1:
        opt /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights, grads, opt


def layer_activation_bytes(layer: LayerProfile, b: float, tp: int, sp: bool, recompute: str, attention: str
                           ) -> float:
    """Bytes one rank keeps for one micro-batch of ``b`` samples through this block until its backward."""
    if recompute == "full":
        return layer.input_bytes * b / (tp if sp else 1)
    if recompute == "selective" or attention == "flash":
        total, sharded = layer.activation_bytes_selective, layer.activation_bytes_selective_sharded
        if recompute == "none":  # a flash kernel keeps its output (and a small log-sum-exp) for backward
            total += layer.fwd_ops.core_output_bytes
            sharded += layer.fwd_ops.core_output_bytes
    else:
        total, sharded = layer.activation_bytes, layer.activation_bytes_sharded
    if attention == "unfused" and layer.kind == "transformer_layer":
        hidden_masks = layer.input_bytes / _elem(layer) * 2  # 2 masks x s·b·h elements x 1 byte
        replicated_extra = hidden_masks
        sharded_extra = 0.0 if recompute == "selective" else 1.5 * layer.fwd_ops.core_scores_bytes
        total, sharded = total + replicated_extra + sharded_extra, sharded + sharded_extra
    replicated = total - sharded
    return b * (sharded / tp + (replicated / tp if sp else replicated))


def _elem(layer: LayerProfile) -> int:
    """Bytes per element of the block's activations (its input is s·b·h of them)."""
    return max(1, round(layer.param_bytes / layer.params)) if layer.params else 2


def framework_allowance(gpu: GPUSpec) -> float:
    return FRAMEWORK_GIB["cpu" if gpu.is_cpu else "gpu"] * GiB

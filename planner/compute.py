"""Time of one block's forward and backward on one GPU, from its kernels or from measurements.

A block's pass is the sum of its kernels: each matmul-like kernel takes FLOPs / (peak x the GPU's
achievable fraction for a GEMM of that size); every other kernel is bandwidth-bound and takes its
bytes moved / (HBM bandwidth x achievable fraction); each kernel adds a fixed launch overhead (the
roofline view, Williams et al. 2009, with measured efficiency curves as in calculon and llm-analysis).

Backward kernels: every forward GEMM becomes two GEMMs of the same size (input gradient and weight
gradient; for the attention core both operands are activations), so backward GEMM FLOPs are 2x forward,
as torch's flop counter also finds. The weight-gradient half is what zero-bubble schedules defer (W).

The attention core (softmax(QK^T)V) follows the attention kernel: ``flash`` (fused, what torch's SDPA
runs on GPUs) moves no score matrix through memory; ``unfused`` is Megatron-LM's GPT as the 2021-2022
papers ran it: a fused scale-mask-softmax between two batched GEMMs that reads and writes the score
matrix once per pass, and dropout (p > 0) on the attention probabilities and on both residual branches,
each reading and writing its tensor and writing a one-byte mask. Where the fused softmax kernel is not taken
(softmax_falls_back), PyTorch's path runs instead: a cast to fp32, the scale, the masked fill, the softmax and
the cast back, each a pass over the score matrix of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paraplan.hardware_specs import GPUSpec
from paraplan.profiler import LayerProfile

ATTENTION_KERNELS = ("flash", "unfused")
# A causal flash kernel computes the tiles on and below the diagonal: half the score matrix, plus half the
# diagonal tiles (FlashAttention-2 skips the masked blocks), taken as one half for long sequences.
CAUSAL_FLASH_FRACTION = 0.5


# Memory traffic of the unfused attention's softmax, in units of the 16-bit score matrix S (bytes), per pass.
# The fused scale-mask-softmax kernel reads and writes it once (2 S) and its backward reads the output and its
# gradient and writes the input's gradient (3 S). Megatron's PyTorch fallback (FusedScaleMaskSoftmax.
# forward_torch_softmax with softmax in fp32, the scale on): float() reads S and writes 2 S (3), the scale 2 S in
# and out (4), masked_fill the same (4), softmax the same (4), half() 2 S in, S out (3): 18 S; their backwards in
# reverse: 3 + 6 (softmax's reads output and gradient) + 4 + 4 + 3 = 20 S.
SOFTMAX_FUSED_TRAFFIC = (2.0, 3.0)
SOFTMAX_TORCH_TRAFFIC = (18.0, 20.0)


def softmax_falls_back(rule: str, heads_per_rank: int, micro_batch: int, seq: int, dtype: str = "bf16") -> bool:
    """Whether Megatron's FusedScaleMaskSoftmax runs PyTorch's softmax instead of its fused kernel (causal mask)
    under the availability ``rule`` (Framework.fused_softmax). "bigscience-2021-10": bigscience's
    Megatron-DeepSpeed from 9f5f5d4c (2021-10-21) to 1cb76a64 (2022-03-06) — BLOOM's layout sweep of Feb 2022 —
    called get_batch_per_block(sq, sk, b, np) on a function declared (b, np, sq, sk), so the kernel's batches per
    block came from the heads per rank np instead of the key length: with P the power of two at or above np, a
    warp of min(P, 32) threads, 128 threads per block and 2 batches per warp where P <= 128, b·np had to be a
    multiple of (128 / warp)·(2 or 1) — 32 for 8 heads per rank, 16 for 9-16 — and of 4; the kernel also needed
    16-bit inputs, 16 < sq <= 2048 and sk a multiple of 4 (megatron/model/fused_softmax.py, is_kernel_available, at
    c9afebc6; here sq = sk = ``seq``)."""
    if rule == "always":
        return False
    assert rule == "bigscience-2021-10", rule
    if dtype not in ("fp16", "bf16", "fp8"):  # FP8 runs the attention in 16 bits
        return True
    power = 1
    while power < heads_per_rank:
        power *= 2
    warp = min(power, 32)
    per_block = (128 // warp) * (2 if power <= 128 else 1)
    batches = micro_batch * heads_per_rank
    return not (16 < seq <= 2048 and seq % 4 == 0 and batches % 4 == 0 and batches % per_block == 0)


@dataclass(frozen=True)
class PassTimes:
    """Seconds for one micro-batch through one block on one rank."""

    fwd: float
    bwd_input: float  # backward minus the weight-gradient GEMMs (the B of zero-bubble schedules)
    bwd_weight: float  # weight-gradient GEMMs (the W)
    core_fwd: float  # the attention core's forward (what selective recomputation repeats)
    mlp_fwd: float = 0.0  # the MLP sublayer's forward, dense MLP or MoE block (what MLP recomputation repeats)
    mlp_last_gemm: float = 0.0  # of which its last GEMM (a dense MLP's down projection)
    prologue_fwd: float = 0.0  # the attention's prologue (models.in_attention_prologue): selective repeats it too
    # the forward's work outside its GEMMs and attention core: norms, activations, residual adds (what torchtitan's
    # per-op checkpoint reruns besides some GEMMs: planner/op_sac.py)
    elementwise_fwd: float = 0.0

    @property
    def bwd(self) -> float:
        return self.bwd_input + self.bwd_weight

    def scaled(self, factor: float) -> PassTimes:
        """Every time ``factor`` times as long (a CPU rank with a smaller or larger share of the cores)."""
        if factor == 1.0:
            return self
        return PassTimes(**{f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)})


def gemm_seconds(flops: float, gpu: GPUSpec, dtype: str) -> float:
    """One GEMM of ``flops`` on ``gpu`` in ``dtype``: its peak at the efficiency a GEMM of that size reaches."""
    if flops <= 0:
        return 0.0
    return flops / (gpu.peak_flops(dtype) * gpu.efficiency.matmul_fraction(flops, dtype))


def gemm_dtype(dtype: str, layer_kind: str, core: bool, bf16_expert: bool = False) -> str:
    """The dtype a GEMM runs in: under ``fp8`` only the transformer layers' linears run in FP8; the attention
    core, the embedding and the output layer stay bf16 (planner/fp8.py), and so do routed experts a stack does
    not convert (``bf16_expert``: Framework.fp8_experts off)."""
    if dtype == "fp8" and (core or bf16_expert or layer_kind != "transformer_layer"):
        return "bf16"
    return dtype


def estimate_pass_times(layer: LayerProfile, micro_batch_scale: float, tp: int, sp: bool, gpu: GPUSpec, dtype: str,
                        attention: str, elementwise: float = 1.0, causal_fraction: float = 1.0,
                        fp8_experts: bool = True, softmax_fallback: bool = False,
                        split_replicated: bool = False) -> PassTimes:
    """Peak-and-efficiency estimate for a block profiled at one micro-batch, scaled to ``micro_batch_scale``.

    Tensor parallelism divides the GEMMs and memory traffic of the sharded modules by ``tp``;
    sequence parallelism divides the replicated rest (norms, residual adds) too. ``elementwise``: the
    fraction of eager PyTorch's element-wise traffic and kernels a stack's fused kernels leave
    (Framework.elementwise_traffic; the unfused attention's score and dropout traffic is modelled as such).
    ``causal_fraction``: the share of the attention core's s x s work a causal kernel computes (a flash kernel
    skips the tiles above the diagonal: about half, FlashAttention-2, Dao 2023, Sec. 3.1.1); its FLOPs are
    still counted whole in the model FLOPs, as Megatron's formula counts them. ``fp8_experts``: under FP8 the
    routed experts' GEMMs (marked 2 in ``gemm_moe``) run in FP8 too (Framework.fp8_experts), or in bf16.
    ``softmax_fallback``: the unfused attention's softmax runs PyTorch's path, not the fused kernel
    (softmax_falls_back; SOFTMAX_TORCH_TRAFFIC). ``split_replicated``: the GEMMs the profile marks replicated run on
    each rank's sequence shard, so are divided by ``tp`` too (MLA's down-projections in Megatron-Core under
    sequence parallelism: Framework.mla_tp_input "latent").
    """
    mix, b = layer.fwd_ops, micro_batch_scale
    memo: dict[tuple[float, str], float] = {}  # an MoE layer's E/ep experts repeat one GEMM shape: price it once

    def gemm(done: float, dt: str) -> float:
        t = memo.get((done, dt))
        if t is None:
            t = memo[(done, dt)] = gemm_seconds(done, gpu, dt)
        return t

    gemm_all = gemm_core = gemm_mlp = last_mlp = 0.0
    marks = mix.gemm_moe or [0] * len(mix.gemm_flops)
    in_mlp = mix.gemm_mlp or [False] * len(mix.gemm_flops)
    for flops, sharded, core, mark, mlp in zip(mix.gemm_flops, mix.gemm_sharded, mix.gemm_core, marks, in_mlp,
                                               strict=True):
        done = flops * b / (tp if sharded or split_replicated else 1) * (causal_fraction if core else 1.0)
        t = gemm(done, gemm_dtype(dtype, layer.kind, core, bf16_expert=mark == 2 and not fp8_experts))
        gemm_all += t
        gemm_core += t if core else 0.0
        gemm_mlp += t if mlp else 0.0
        last_mlp = t if mlp else last_mlp
    hbm = gpu.memory_bound_Bps
    overhead = gpu.efficiency.op_overhead_us * 1e-6
    if mix.other_bytes:  # the forward's split of memory traffic, applied to both passes
        core_frac = mix.other_bytes_core / mix.other_bytes
        sharded_frac = max(mix.other_bytes_sharded - mix.other_bytes_core, 0) / mix.other_bytes
    else:
        core_frac = sharded_frac = 0.0
    replicated_frac = 1.0 - core_frac - sharded_frac

    weight_share = ((layer.param_bytes_sharded / tp + layer.param_bytes - layer.param_bytes_sharded)
                    / layer.param_bytes) if layer.param_bytes else 1.0

    def traffic(pass_mix) -> float:
        """Seconds of non-attention-core memory traffic of a pass, per rank: the activation part grows with
        the micro-batch and splits like the forward's traffic; the fixed (weight-sized) part splits like
        the weights."""
        scaled = pass_mix.other_bytes - pass_mix.other_bytes_fixed
        moved = scaled * b * (sharded_frac / tp + replicated_frac / (tp if sp else 1))
        return elementwise * (moved + pass_mix.other_bytes_fixed * weight_share) / hbm

    scores = mix.core_scores_bytes * b / tp if attention == "unfused" else 0.0
    # Scale-mask-softmax moves the scores SOFTMAX_FUSED_TRAFFIC times each way (or PyTorch's path, where the fused
    # kernel is not taken); attention dropout reads, writes and writes a half-size mask (2.5 each way).
    softmax_fwd, softmax_bwd = SOFTMAX_TORCH_TRAFFIC if softmax_fallback else SOFTMAX_FUSED_TRAFFIC
    core_fwd_traffic = (softmax_fwd + 2.5) * scores / hbm
    core_bwd_traffic = (softmax_bwd + 2.5) * scores / hbm
    hidden_dropout = 0.0
    if attention == "unfused" and layer.kind == "transformer_layer":  # two residual-branch dropouts
        hidden_dropout = 2 * 2.5 * layer.input_bytes * b / (tp if sp else 1) / hbm
    fwd_traffic = traffic(mix)
    fwd = gemm_all + fwd_traffic + core_fwd_traffic + hidden_dropout + elementwise * mix.kernels * overhead
    bwd_weight = gemm_all - gemm_core  # one weight-gradient GEMM per linear GEMM
    bwd_input = (gemm_all + gemm_core + traffic(layer.bwd_ops) + core_bwd_traffic + hidden_dropout
                 + elementwise * layer.bwd_ops.kernels * overhead)
    mlp_traffic = fwd_traffic * mix.other_bytes_mlp / mix.other_bytes if mix.other_bytes else 0.0
    mlp_fwd = gemm_mlp + mlp_traffic + elementwise * mix.kernels_mlp * overhead
    prologue_gemms = sum(gemm(flops * b / (tp if sharded else 1), gemm_dtype(dtype, layer.kind, False))
                         for flops, sharded in zip(mix.prologue_gemm_flops, mix.prologue_gemm_sharded, strict=True))
    prologue_traffic = fwd_traffic * mix.other_bytes_prologue / mix.other_bytes if mix.other_bytes else 0.0
    prologue_fwd = prologue_gemms + prologue_traffic + elementwise * mix.kernels_prologue * overhead
    linear_gemms = len(mix.gemm_flops) - sum(mix.gemm_core)
    elementwise_fwd = fwd_traffic * (1.0 - core_frac) + hidden_dropout \
        + elementwise * max(mix.kernels - mix.kernels_core - linear_gemms, 0) * overhead
    return PassTimes(fwd=fwd, bwd_input=bwd_input, bwd_weight=bwd_weight, core_fwd=gemm_core + core_fwd_traffic,
                     mlp_fwd=mlp_fwd, mlp_last_gemm=last_mlp, prologue_fwd=prologue_fwd,
                     elementwise_fwd=elementwise_fwd)


def measured_pass_times(fwd_ms: float, bwd_ms: float, estimate_tp1: PassTimes, estimate: PassTimes) -> PassTimes:
    """Measured tp=1 times of a block, carried to this layout by the estimate's own ratios."""
    f_scale = estimate.fwd / estimate_tp1.fwd if estimate_tp1.fwd else 1.0
    b_scale = estimate.bwd / estimate_tp1.bwd if estimate_tp1.bwd else 1.0
    bwd = bwd_ms * 1e-3 * b_scale
    w_frac = estimate.bwd_weight / estimate.bwd if estimate.bwd else 0.0
    core_frac = estimate.core_fwd / estimate.fwd if estimate.fwd else 0.0
    mlp_frac = estimate.mlp_fwd / estimate.fwd if estimate.fwd else 0.0
    last_frac = estimate.mlp_last_gemm / estimate.fwd if estimate.fwd else 0.0
    prologue_frac = estimate.prologue_fwd / estimate.fwd if estimate.fwd else 0.0
    elementwise_frac = estimate.elementwise_fwd / estimate.fwd if estimate.fwd else 0.0
    fwd = fwd_ms * 1e-3 * f_scale
    return PassTimes(fwd=fwd, bwd_input=bwd * (1 - w_frac), bwd_weight=bwd * w_frac, core_fwd=fwd * core_frac,
                     mlp_fwd=fwd * mlp_frac, mlp_last_gemm=fwd * last_frac, prologue_fwd=fwd * prologue_frac,
                     elementwise_fwd=fwd * elementwise_frac)

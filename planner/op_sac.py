"""torchtitan's per-op selective activation checkpointing on a dense Llama block: what it keeps and what it reruns.

torchtitan's selective mode with ``selective_ac_option = "op"`` (its default; torchtitan
torchtitan/models/llama/parallelize_llama.py ``_apply_ac_to_transformer_block`` from 2024-08, later
torchtitan/distributed/activation_checkpoint.py) wraps each transformer block in torch's non-reentrant checkpoint with
a selective-checkpoint policy: the outputs of ``aten.mm``, of SDPA (flash or memory-efficient) and of the functional
``reduce_scatter_tensor`` are saved (``CheckpointPolicy.MUST_SAVE``), except every second ``aten.mm`` of the block
(a counter per block: the 2nd, 4th, ... are recomputed); everything else is recomputed in backward
(``PREFER_RECOMPUTE``). The block's input stays, as the checkpoint's.

torchtitan's Llama block runs its matmuls in this order (torchtitan/models/llama3/model.py: ``self.wq(x),
self.wk(x), self.wv(x)``; SDPA; ``self.wo``; ``self.w2(F.silu(self.w1(x)) * self.w3(x))``): wq 1, wk 2, wv 3, wo 4,
w1 5, w3 6, w2 7. So the block keeps wq's, wv's, w1's and w2's outputs, SDPA's output and log-sum-exp, the
reduce-scatters' outputs under sequence parallelism, and its input; backward reruns wk, wo and w3 and every norm,
rotary embedding, SiLU, product and residual add (the time of the forward's element-wise work). Under tensor
parallelism (torchtitan's always with sequence parallelism) wk's and w3's inputs are the sequence all-gathers'
outputs, which nothing saves: those gathers run again.

Where this does not describe the block, the cost model keeps pricing selective as the attention core alone
(:func:`applies`): MoE blocks (grouped expert GEMMs are not ``aten.mm``), MLA, query/key/value biases (a biased linear
on a 3-D input runs ``aten.addmm``, not counted), and FP8 (torchao's float8 linears run ``_scaled_mm``, which the
policy's list has or lacks by version).
"""

from __future__ import annotations

POLICY = "torchtitan-op"  # Framework.selective_policy's value for this policy


def applies(fw, spec, layer, dtype: str, moe_layer: bool) -> bool:
    """Whether selective recomputation of ``layer`` is this policy's: the framework checkpoints by it, and the
    block is a dense Llama layer whose linears are plain matmuls."""
    return (fw.selective_policy == POLICY and layer.kind == "transformer_layer"
            and spec.family == "llama" and not moe_layer and not getattr(spec, "mla", False)
            and not spec.qkv_bias and dtype != "fp8")


def _widths(spec) -> tuple[int, int, int, int]:
    """(hidden, query width a·d, key/value width kv·d, FFN width) of the Llama block."""
    d = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    kv = spec.num_kv_heads or spec.num_attention_heads
    return spec.hidden_size, spec.num_attention_heads * d, kv * d, spec.ffn_size


def saved_bytes(spec, tokens: float, tp: int, sp: bool, elem: int) -> float:
    """Bytes one rank keeps for ``tokens`` tokens (its share of a micro-batch's sequences, whole sequences) through
    the block until its backward, ``elem`` bytes an activation element: the block's input (sequence-sharded under
    SP), the outputs of wq, wv and w1 (column-parallel: a 1/tp share of their width), of w2 (row-parallel: each rank's
    whole-width partial sum), SDPA's output (1/tp of the heads) with its fp32 log-sum-exp (one per head and token),
    and under SP the two reduce-scatters' sequence shards."""
    h, q, kv, f = _widths(spec)
    shard = tp if sp else 1
    kept = h / shard + (q + kv + f) / tp + h + q / tp  # input; wq, wv, w1; w2; SDPA's output
    if tp > 1 and sp:
        kept += 2 * h / tp  # the reduce-scatters after wo and w2
    return tokens * (kept * elem + 4 * spec.num_attention_heads / tp)


def rerun_gemm_flops(spec, tokens: float) -> list[float]:
    """The FLOPs of the matmuls backward reruns, wk, wo and w3, over the whole tensor-parallel group (each rank
    runs 1/tp of each)."""
    h, q, kv, f = _widths(spec)
    return [2.0 * tokens * h * kv, 2.0 * tokens * q * h, 2.0 * tokens * h * f]

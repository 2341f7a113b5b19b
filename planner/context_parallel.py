"""Context parallelism's cost per transformer layer and micro-batch (issue 14).

With context parallelism of degree cp each sequence is split over cp ranks (causal models: 2·cp chunks, rank c
holding chunks c and 2·cp-1-c, so that every rank has as much attention work as the others: Llama 3 paper,
arXiv 2407.21783, Sec. 3.3.2; Megatron-LM docs/api-guide/context_parallel.md). Everything token-wise — the
linears, norms, element-wise ops, the loss, the pipeline's boundary tensors, the tensor-parallel collectives —
then runs on s/cp tokens, exactly as a micro-batch of b/cp sequences would: the cost model prices a block at
b/cp (costmodel.block_cost). The attention core's work also divides by cp: each rank computes its s/cp
queries against all s keys, s²/cp of the s² score matrix (the load-balanced chunks give each rank the same
share of the causal triangle). Gradients are averaged, and ZeRO shards, over the dp·cp ranks that hold the
same model chunk (Layout.data_ranks).

What remains is the exchange of keys and values, by the framework's ``cp_comm`` (planner/framework.py):

- ``all_gather`` (this executor, executor/context_parallel.py; the Llama 3 form): each rank all-gathers the
  keys and the values of its group before attention (two all-gathers of the full (b, kv_heads/t, s, d)
  tensors), and reduce-scatters their gradients in backward; nothing overlaps them. The attention kernel
  saves the gathered (and, with grouped-query heads, repeated) keys and values for its backward: the whole
  sequence's, not 1/cp of it. Full recomputation runs the forward's all-gathers again.
- ``ring`` (Megatron-Core with Transformer Engine, cp_comm_type p2p): cp-1 steps, each sending the K/V chunk
  held to the next rank of the ring while attention computes on the one received before (Liu et al. 2023,
  "Ring Attention"): the exchange waits only for what the attention of cp-1 of the cp chunks cannot hide.
  Backward passes K/V and their gradients around the ring again (twice the bytes). Each rank keeps only its
  own chunk. Recomputation of the attention (selective or full) repeats the forward ring.
- ``all_gather_overlap`` (torch's context_parallel with rotate method "allgather", torchtitan's default): one
  all-gather of K/V issued while attention runs on the local chunk, hidden behind that 1/cp of the attention's
  work; the gradients' reduce-scatter likewise in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import comm
from .layout import recomputes_core
from .placement import cp_group, ring_senders


@dataclass(frozen=True)
class CPCost:
    """One transformer layer's context-parallel exchange for one micro-batch on one rank."""

    fwd: float = 0.0  # seconds the forward waits for
    bwd: float = 0.0  # seconds the backward waits for (recomputation's repeated exchange included)
    traffic: dict[str, float] = field(default_factory=dict)  # bytes by collective kind (costmodel.COMM_KINDS)
    saved_bytes: float = 0.0  # activations kept beyond the layer's 1/cp share (the gathered K/V the kernel saves)


def kv_elements(spec, tp: int) -> tuple[float, float]:
    """(exchanged, saved) key + value elements per token on one of ``tp`` ranks: what the ranks exchange
    (grouped-query K/V heads before their repeat; MLA's per-head keys and values) and what the attention
    kernel saves of them (after the repeat to every query head)."""
    a = spec.num_attention_heads / tp
    if getattr(spec, "mla", False):
        both = a * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        return both, both
    d = spec.head_dim
    return 2 * spec.kv_heads / tp * d, 2 * a * d


def layer_cost(model, lay, place, mode: str, elem: int, core_fwd: float) -> CPCost:
    """The exchange of one transformer layer for one micro-batch (lay.micro_batch sequences, 1/cp of each on
    this rank), ``elem`` bytes per element, recomputation ``mode``, the attention core taking ``core_fwd``
    seconds forward on one rank (its share) and twice that backward."""
    cp = lay.cp
    if cp <= 1:
        return CPCost()
    work = model.work
    fw, cluster, spec = work.framework, work.cluster, work.spec
    exchanged, saved = kv_elements(spec, lay.tp)
    b = lay.micro_batch
    full = b * spec.seq_length * exchanged * elem  # the whole sequences' K and V on one tensor-parallel rank
    group = cp_group(cluster, lay)
    busy = place.gpus_per_node_busy
    core_bwd = 2 * core_fwd
    if fw.cp_comm == "ring":
        chunk = full / cp
        cross = group.crosses_nodes
        # a ring's slowest step: a rank whose successor is on another node, sharing the network with the other
        # ranks of its node that send out of it (placement.ring_senders)
        senders = max(1, ring_senders(cluster, cp, lay.tp, lay.num_gpus)) if cross else busy
        step = comm.p2p(chunk, cross, cluster, senders)  # send one chunk while receiving the previous rank's
        hidden = (cp - 1) / cp
        fwd = max(0.0, (cp - 1) * step - hidden * core_fwd)
        bwd = max(0.0, (cp - 1) * comm.p2p(2 * chunk, cross, cluster, senders) - hidden * core_bwd)
        repeat = 1 if mode == "full" or recomputes_core(mode) else 0
        sends = (1 + repeat) * 2 * (cp - 1) * chunk + 2 * 2 * (cp - 1) * chunk  # sent and received
        return CPCost(fwd=fwd, bwd=bwd + repeat * fwd, traffic={"send_recv": sends})
    gather = 2 * comm.gather(full / 2, group, cluster, busy)  # K and V: one collective each
    if fw.cp_comm == "all_gather_overlap":
        fwd = max(0.0, gather - core_fwd / cp)
        bwd = max(0.0, gather - core_bwd / cp)
        repeat = 1 if mode == "full" or recomputes_core(mode) else 0
        return CPCost(fwd=fwd, bwd=bwd + repeat * fwd,
                      traffic={"all_gather": (1 + repeat) * full, "reduce_scatter": full})
    # the executor's selective recomputation checkpoints the core alone, keeping its inputs: the gathered K/V
    repeat = 1 if mode == "full" else 0
    kept = b * spec.seq_length * saved * elem * (1 - 1 / cp)  # the kernel's K/V: whole sequences, not 1/cp
    return CPCost(fwd=gather, bwd=gather * (1 + repeat), saved_bytes=kept,
                  traffic={"all_gather": (1 + repeat) * full, "reduce_scatter": full})


# The planner's search tries context parallelism where each rank keeps at least this many tokens of a sequence
# (published runs use it from 8K-token sequences on: Llama 3 at 8K, cp 2); ``--cp`` prices any degree.
SEARCH_MIN_TOKENS = 2048


def search_degrees(spec, gpus: int) -> list[int]:
    """Context-parallel degrees > 1 the search enumerates on ``gpus`` GPUs: divisors of the GPU count that cut a
    sequence into equal load-balanced chunks (2·cp for causal models) of at least SEARCH_MIN_TOKENS per rank."""
    if not getattr(spec, "is_transformer", False):
        return []
    s = spec.seq_length
    chunks = 2 if spec.causal else 1
    return [cp for cp in range(2, gpus + 1) if gpus % cp == 0 and s % (chunks * cp) == 0
            and s // cp >= SEARCH_MIN_TOKENS]


def attention_work_fraction(work, lay) -> float:
    """The share of the attention core's s x s work the layout's kernel computes: about half for a causal
    flash kernel on a GPU (compute.CAUSAL_FLASH_FRACTION), all of it for unfused attention (the score matrix
    is computed, then masked), for bidirectional models, and under this executor's all-gather context
    parallelism, whose attention takes an explicit mask (no kernel skips masked tiles of it)."""
    from .compute import CAUSAL_FLASH_FRACTION

    spec = work.spec
    if work.attention != "flash" or not getattr(spec, "causal", False) or work.cluster.gpu.is_cpu:
        return 1.0
    if lay.cp > 1 and work.framework.cp_comm == "all_gather":
        return 1.0
    return CAUSAL_FLASH_FRACTION

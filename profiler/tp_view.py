"""A block as one rank of a tensor-parallel group sees it: per-rank FLOPs, bytes and collectives.

Rules (Megatron-LM, Shoeybi et al. 2019 Sec. 3; sequence parallelism, Korthikanti et al. 2022 Sec. 4.2):
- FLOPs and saved activations produced inside TP-sharded modules are divided by t; the rest is
  replicated — or, with sequence parallelism, divided by t over the sequence too.
- A ``region`` (attention, MLP) all-reduces its output in forward (the ``g`` operator) and its input
  gradient in backward (the ``f`` operator); with sequence parallelism each all-reduce becomes an
  all-gather before the region plus a reduce-scatter after it, in both passes.
- A vocabulary-parallel embedding all-reduces (SP: reduce-scatters) its output in forward; under SP its
  output gradient is all-gathered over the sequence in backward.
- A vocabulary-parallel output layer with its parallel cross-entropy all-reduces three fp32 numbers
  per token in forward (max, sum of exponentials, target logit) and its input gradient in backward.
Collective sizes are those of the full tensor; the cost model turns them into time per algorithm.
"""

from __future__ import annotations

from .records import Collective, TPView

FP32 = 4


def region_collectives(style: str, in_bytes: int, out_bytes: int, tokens: int, sp: bool,
                       embedding_sp: str = "reduce_scatter", latent_bytes: float | None = None,
                       mla_input: str = "hidden") -> list[Collective]:
    """The collectives of one region per micro-batch. ``embedding_sp``: how a vocabulary-parallel embedding
    hands its output to the sequence-parallel region — Megatron reduce-scatters it; DTensor's
    RowwiseParallel (this executor) all-reduces it and each rank keeps its shard. Either way the gradient
    comes back all-gathered over the sequence.

    ``latent_bytes``: an MLA attention region's latents (DeepSeek-V2 Sec. 2.1: the compressed query, the
    compressed key-value and the shared rotary key, tokens x (q_lora_rank or h, + kv_lora_rank + rope)), which
    its replicated down-projections make and its head-sharded up-projections take; ``mla_input`` where its
    input-side collectives run (Framework.mla_tp_input): "latent" — Megatron-Core, whose duplicated down-projections
    run on the sequence shard and whose column-parallel up-projections gather the latents (SP) and reduce their
    gradients (multi_latent_attention.py); "mixed" — this executor: the hidden gathered (SP), the latents'
    gradients all-reduced (executor/tensor_parallel.py); "hidden" — the input's gradient reduced whole (DTensor's
    NoParallel down-projections: torchtitan), as any region."""
    if style == "region" and latent_bytes is not None and mla_input != "hidden":
        if not sp:
            return [Collective("all_reduce", "fwd", out_bytes, "region output"),
                    Collective("all_reduce", "bwd", latent_bytes, "latent grads")]
        mixed = mla_input == "mixed"
        return [Collective("all_gather", "fwd", in_bytes if mixed else latent_bytes,
                           "region input" if mixed else "latents"),
                Collective("reduce_scatter", "fwd", out_bytes, "region output"),
                Collective("all_gather", "bwd", out_bytes, "output grad"),
                Collective("all_reduce" if mixed else "reduce_scatter", "bwd", latent_bytes, "latent grads")]
    if style == "region":
        if sp:
            return [Collective("all_gather", "fwd", in_bytes, "region input"),
                    Collective("reduce_scatter", "fwd", out_bytes, "region output"),
                    Collective("all_gather", "bwd", out_bytes, "output grad"),
                    Collective("reduce_scatter", "bwd", in_bytes, "input grad")]
        return [Collective("all_reduce", "fwd", out_bytes, "region output"),
                Collective("all_reduce", "bwd", in_bytes, "input grad")]
    if style == "vocab_embedding":
        if not sp:
            return [Collective("all_reduce", "fwd", out_bytes, "embedding output")]
        return [Collective(embedding_sp, "fwd", out_bytes, "embedding output"),
                Collective("all_gather", "bwd", out_bytes, "output grad")]
    if style in ("vocab_head", "class_sharded"):
        out = [Collective("all_reduce", "fwd", 3 * FP32 * tokens, "parallel cross-entropy"),
               Collective("all_reduce", "bwd", in_bytes, "input grad")]
        if sp:
            out = [Collective("all_gather", "fwd", in_bytes, "head input"), out[0],
                   Collective("reduce_scatter", "bwd", in_bytes, "input grad")]
        return out
    return []


def tp_view(t: int, *, fwd_flops: int, bwd_flops: int, gemm_flops: list[int], gemm_sharded: list[bool],
            param_bytes: int, param_bytes_sharded: int, saved_bytes: int, saved_bytes_sharded: int,
            region_io: list[tuple[str, int, int, int]]) -> TPView:
    total = sum(gemm_flops)
    sharded = sum(f for f, s in zip(gemm_flops, gemm_sharded, strict=True) if s)
    ratio = ((sharded / t + (total - sharded)) / total) if total else 1.0
    replicated_saved = saved_bytes - saved_bytes_sharded
    colls = [c for style, i, o, tok in region_io for c in region_collectives(style, i, o, tok, sp=False)]
    colls_sp = [c for style, i, o, tok in region_io for c in region_collectives(style, i, o, tok, sp=True)]
    return TPView(tp=t, fwd_flops=round(fwd_flops * ratio), bwd_flops=round(bwd_flops * ratio),
                  param_bytes=round(param_bytes_sharded / t + param_bytes - param_bytes_sharded),
                  activation_bytes=round(saved_bytes_sharded / t + replicated_saved),
                  activation_bytes_sp=round(saved_bytes / t),
                  collectives=colls if t > 1 else [], collectives_sp=colls_sp if t > 1 else [])

"""Mixture of experts under expert parallelism: what one rank computes, holds, sends and waits for.

Folding (Megatron-Core's MoE parallel folding, Liu et al. 2025, arXiv:2504.14960; executor/parallel_dims.py):
the dp·cp·tp ranks of a pipeline stage are cut again for the routed experts, expert tensor parallelism (etp)
innermost, then expert parallelism (ep), then expert data parallelism, edp = dp·cp·tp / (ep·etp). A rank
holds E/ep experts, each split over etp ranks: expert_params / (ep·etp) of a layer's routed-expert weights.
With ep = etp = 1 this executor keeps the experts in the layer's own data-parallel unit (dense parameters,
synced over dp·cp); Megatron-Core always syncs them over its expert-data-parallel group.

Per MoE layer and micro-batch, on a rank holding T tokens of it (b/cp sequences' worth, 1/tp of them: every
tensor-parallel rank routes its own share of the tokens, as this executor does with or without sequence
parallelism and Megatron-Core does with the sequence parallelism it requires for MoE under TP):

- compute (:func:`rank_view`): the router, the dispatch's permutations and the shared experts run on the
  rank's T tokens (the profile's MoE work divided by tp, like a sharded region); the routed experts: E/ep of
  them, each receiving the tokens the ep ranks route to it, ep·T·k/E on average (dropless, balanced), so the
  same k·T token-expert products as without expert parallelism, in GEMMs ep times taller — the expert GEMM
  efficiency is read at that per-expert token count (with Megatron-Core's grouped GEMM, at the sum over the
  rank's experts: one kernel per projection). FLOPs per token count the active experts only (the profile
  routes every token to k experts), so MFU is against the active parameters.
- token imbalance: dropless top-k routing with an auxiliary loss balances the experts' load on average, not
  exactly; the most loaded rank computes and receives more than the mean. ``Framework.moe_imbalance`` is that
  max over the mean and multiplies the routed experts' GEMM time and the all-to-all time (not the bytes, which
  are the mean; the dry run routes balanced). This executor routes for real: 1.25, the expert capacity
  factor Switch Transformers train with (Fedus et al. 2022, JMLR, Sec. 2.2 and Table 1: the headroom over
  the mean load that routing with an auxiliary loss is given, which a dropless layer's most loaded expert
  then uses). Megatron-Bridge's published MoE benchmarks force-balance the tokens (their table's footnote,
  benchmarks/data/published_moe.yaml): 1.0 there. With token dropping (``Framework.moe_capacity_factor`` c,
  Megatron-Core's moe_expert_capacity_factor) no expert takes more than c times its mean share: the load is
  min(imbalance, c); padded to capacity (``moe_pad_to_capacity``) every expert computes and receives c times
  the mean (:func:`routed_load`), its all-to-all bytes too.
- the token all-to-all (:func:`all_to_all`): dispatch and combine in forward, their transposes in backward,
  each moving the rank's T·k token copies of h elements (16-bit: 2 bytes), of which (ep-1)/ep leave the rank
  (pairwise exchange, Thakur, Rabenseifner and Gropp 2005: (p-1)/p·M·β plus latency); within a node over
  NVLink, across nodes the share bound for other nodes through the node's network, shared by its busy GPUs;
  the two paths run at once. Plus one all-to-all of E token counts (int64) per layer (the executor's
  uneven-split exchange). Full recomputation repeats the forward's. With etp > 1 the received tokens are
  all-gathered over the etp group (and the results reduce-scattered), both passes.
- the executor's MoE under tensor parallelism without sequence parallelism: the block's output all-gathered
  over tp in forward, its input gradient in backward (executor/expert_parallel.py); its auxiliary loss sums
  the tokens per expert (b·E fp32) over the tp·cp ranks that split each sequence.
- gradients (:func:`expert_exposures`): expert-parallel experts sync over edp, in dp_sync.py's style (the
  executor: FSDP2 units over the edp mesh, by ZeRO stage; Megatron: its distributed optimizer over the
  expert-data-parallel group); the MoE weights every tensor-parallel rank holds whole but trains on its own
  tokens (router, shared experts, experts when ep = 1) have their gradients summed over tp by this executor
  (:func:`tp_summed_exposure`).
- memory (:func:`expert_states`): model states of the experts sharded by ZeRO over edp, not dp·cp.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

from paraplan.profiler import LayerProfile

from . import comm, compute, fused_moe
from .concerns import Affine, Exposure, Sync
from .layout import Layout, recomputes_mlp
from .memory import StateBytes, state_bytes
from .placement import Placement, consecutive_group, layout_placement

COUNT_BYTES = 8  # one int64 token count per expert in the executor's split-size exchange
AUX_BYTES = 4  # the auxiliary loss's tokens per expert, fp32 (models/moe.py sequence_aux_loss)
ROUTING_MAP_BYTES = 1  # HybridEP's routing map: one bool per token and expert
# SMs an all-to-all kernel holds while it runs beside compute: DeepSeek-V3's report (Sec. 3.2.2) runs its
# dispatch and combine on 20 of the H800's 132 SMs, enough to saturate InfiniBand and NVLink (DeepEP's Buffer
# default num_sms is 20); taken for every dispatcher (NCCL's all-to-all runs one block per channel, a like count)
COMM_SMS = 20
# Of the compute's speed that the SM count leaves it beside an exchange, the share it keeps under Megatron-Core's
# paired schedule (overlap_moe_expert_parallel_comm): the exchange's copies contend for HBM bandwidth too, and
# the two micro-batches' streams wait on each other at every phase. Fitted, one number, on one run:
# Megatron-Bridge 26.04's Qwen3-235B-A22B on 256 H100s (tp2 pp8 vp4 ep32, FP8, its recipe's overlap on;
# benchmarks/fidelity_moe.py FIT) gives 0.712. With the SM share alone (1.0) every published run with the overlap
# on was priced fast, 5-17% (the Qwen3-235B ones, DeepSeek-V3's) beside runs without it within a few percent;
# the model zoo's pair of one Qwen3-235B layout with and without the overlap (19.7 s -> 17.6 s, 11% saved) was
# priced as saving 25% (18% with this factor).
PAIRED_OVERLAP_EFFICIENCY = 0.712


def overlapped_exposure(a2a: float, compute: float, sm_count: int, efficiency: float = 1.0) -> float:
    """Seconds an all-to-all of ``a2a`` seconds adds to the ``compute`` it runs beside: the compute keeps
    r = efficiency x (1 - COMM_SMS / sm_count) of the GPU while the exchange runs, so it ends with it (exposing
    a2a - compute) where a2a·r covers it, else a2a·(1 - r) later than alone. Without an SM count, the SMs are not
    counted (r = efficiency: the exchange free beside compute at 1.0). ``efficiency``: what else the compute loses
    beside the exchange (PAIRED_OVERLAP_EFFICIENCY under the paired schedule; 1.0 for the shared experts' stream)."""
    r = (1.0 - COMM_SMS / sm_count if sm_count > COMM_SMS else 1.0) * efficiency
    return a2a - compute if a2a * r >= compute else a2a * (1.0 - r)


def overlapped_layer_exchanges(one: float, times, sm_count: int) -> tuple[float, float]:
    """(forward, backward) seconds a MoE layer's four exchanges of ``one`` second each (dispatch and combine, both
    passes) add under Megatron-Core's overlap_moe_expert_parallel_comm, which runs one micro-batch's forward of a
    layer beside another's backward of it in three phases, each exchange beside one stretch of the other's compute
    (megatron/core/models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.run):

        comm:    combine_bwd        | dispatch_fwd -> dispatch_bwd            | combine_fwd
        compute: pre_dispatch_fwd   | mlp_bwd     -> mlp_bwd_dw + mlp_fwd     | pre_dispatch_bwd

    so an exchange hides only behind its own stretch (:func:`overlapped_exposure` each, the compute slowed by
    PAIRED_OVERLAP_EFFICIENCY too), not behind the whole opposite pass. ``times`` (compute.PassTimes, or None for
    no compute): the layer's passes on the rank; its MLP
    sublayer's forward (``mlp_fwd``: the MoE block) is the ``mlp`` stretch, the rest of the forward the pre-dispatch
    one (attention, norms), and the backward splits in the forward's proportions. The attention's weight-gradient
    GEMMs run after the phases (delayed), beside none."""
    mlp_f = pre_f = mlp_b = pre_b = mlp_dw = 0.0
    if times is not None and times.fwd > 0:
        share = times.mlp_fwd / times.fwd
        mlp_f, pre_f = times.mlp_fwd, times.fwd - times.mlp_fwd
        mlp_b, pre_b = share * times.bwd_input, (1 - share) * times.bwd_input
        mlp_dw = share * times.bwd_weight
    eff = PAIRED_OVERLAP_EFFICIENCY
    fwd = overlapped_exposure(one, mlp_b, sm_count, eff) + overlapped_exposure(one, pre_b, sm_count, eff)
    bwd = overlapped_exposure(one, pre_f, sm_count, eff) + overlapped_exposure(one, mlp_dw + mlp_f, sm_count, eff)
    return fwd, bwd


def shared_expert_gemms(spec, tokens: float, gpu, dtype: str) -> tuple[float, float]:
    """Seconds of the shared experts' two forward GEMMs (h -> up_s, then f_s -> h) on a rank for ``tokens``, its
    1/tp share of the micro-batch's tokens (the GEMMs split their width over tp: the same FLOPs); FP8 where the
    layer's linears are."""
    _, _, f_s, up_s = fused_moe.expert_widths(spec)
    h, dt = spec.hidden_size, compute.gemm_dtype(dtype, "transformer_layer", False)
    return compute.gemm_seconds(2 * tokens * h * up_s, gpu, dt), compute.gemm_seconds(2 * tokens * f_s * h, gpu, dt)


def shared_expert_exchanges(one: float, gemms: tuple[float, float], sm_count: int) -> tuple[float, float]:
    """(forward, backward) seconds a MoE layer's four exchanges of ``one`` second each add under Megatron-Core's
    moe_shared_expert_overlap, which runs the shared experts on a stream of their own beside the token dispatcher's
    all-to-alls (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher: the first GEMM
    and its activation, linear_fc1_forward_and_act, after the dispatch is launched; the second, linear_fc2_forward,
    after the combine). Their backward keeps the pairing (shared_experts.py orders the backward so the exchange is
    launched first): the combine's beside the second GEMM's input and weight gradients, the dispatch's beside the
    first's. Each exchange hides behind its own GEMMs only (:func:`overlapped_exposure`). ``gemms``: the two
    forward GEMMs' seconds (:func:`shared_expert_gemms`); each backward is twice its forward."""
    fc1, fc2 = gemms
    fwd = overlapped_exposure(one, fc1, sm_count) + overlapped_exposure(one, fc2, sm_count)
    bwd = overlapped_exposure(one, 2 * fc2, sm_count) + overlapped_exposure(one, 2 * fc1, sm_count)
    return fwd, bwd


def routed_work(fw) -> float:
    """The mean rank's routed token copies over the balanced count: c padded to capacity (every expert computes its
    whole capacity), else 1 — the imbalance (:func:`routed_load`) is the most loaded rank's, which the others wait
    for, not work every rank does."""
    c = fw.moe_capacity_factor
    return c if c is not None and fw.moe_pad_to_capacity else 1.0


def routed_load(fw) -> float:
    """The most loaded rank's routed token copies over the mean (see the module docstring): the imbalance when
    dropless; with a capacity factor c, at most c (the rest dropped); padded to capacity, c."""
    c = fw.moe_capacity_factor
    if c is None:
        return fw.moe_imbalance
    return c if fw.moe_pad_to_capacity else min(fw.moe_imbalance, c)


def padded_copies(fw) -> float:
    """The routed token copies a rank keeps for backward over the mean: padded to capacity (fixed shapes), every
    expert holds c times its mean share, padding included; otherwise the mean (as the bytes of the all-to-all: the
    dry run routes balanced)."""
    return routed_load(fw) if fw.moe_pad_to_capacity else 1.0


def is_moe(layer: LayerProfile) -> bool:
    return layer.moe_params > 0


def edp(lay: Layout) -> int:
    """Expert data parallelism: the ranks of a stage holding the same expert shard."""
    return lay.dp * lay.cp * lay.tp // (lay.ep * lay.etp)


def expert_parallel(lay: Layout, framework) -> bool:
    """Are the routed experts units of their own, synced over edp (not the layer's dense parameters)?
    Always under Megatron's states; in this executor only with ep or etp above 1."""
    return framework.states != "executor" or lay.ep * lay.etp > 1


def experts_on_rank(layer: LayerProfile, lay: Layout, framework) -> float:
    """Routed-expert parameters of ``layer`` a rank holds as expert-parallel parameters (0 when they are dense)."""
    if not layer.expert_params or not expert_parallel(lay, framework):
        return 0.0
    return layer.expert_params / (lay.ep * lay.etp)


def largest_tensors_on_rank(layer: LayerProfile, lay: Layout, framework, t: int) -> tuple[float, float]:
    """Elements of ``layer``'s largest parameter tensor a rank holds outside its expert-parallel experts (the shard of
    ``t`` ranks where tensor parallelism, or the hybrid class-sharded head, splits it; the stacked experts where they
    are dense, kept whole over tp: the executor's), and of its largest expert-parallel tensor (its ep x etp shard);
    before ZeRO's sharding."""
    ep = bool(layer.largest_expert_param) and expert_parallel(lay, framework)
    dense = max(layer.largest_split_param / t, layer.largest_whole_param,
                0.0 if ep else layer.largest_expert_param)
    return dense, layer.largest_expert_param / (lay.ep * lay.etp) if ep else 0.0


def tp_summed_on_rank(layer: LayerProfile, lay: Layout, framework) -> float:
    """MoE weights replicated over tensor-parallel ranks that each route their own tokens, whose gradients this
    executor sums over tp: router and shared experts, and the routed experts when they are not expert-parallel."""
    if lay.tp == 1 or not layer.moe_params or framework.states != "executor":
        return 0.0
    return layer.moe_params - (layer.expert_params if expert_parallel(lay, framework) else 0)


def params_on_rank(layer: LayerProfile, lay: Layout, tp_share: float, framework) -> float:
    """All parameters of ``layer`` on one rank: the tensor-parallel share (``tp_share``: bytes kept over bytes)
    of what is not expert-parallel, plus the rank's expert shard."""
    experts = experts_on_rank(layer, lay, framework)
    dense = layer.params * tp_share - (layer.expert_params if experts else 0.0)
    return dense + experts


def expert_degrees(spec, framework, stage_ranks: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs the search tries on a stage of ``stage_ranks`` = dp·cp·tp ranks: ep dividing both the
    ranks and the experts; etp = 1 for this executor (it refuses etp > 1), and for the stacks that run expert
    tensor parallelism also etp dividing the expert FFN width and the ranks left (Megatron-Core's
    --expert-tensor-parallel-size)."""
    experts = getattr(spec, "num_experts", 0) or 0
    if not experts:
        return [(1, 1)]
    out = []
    for ep in range(1, min(stage_ranks, experts) + 1):
        if stage_ranks % ep or experts % ep:
            continue
        out.append((ep, 1))
        if framework.states != "executor":
            ffn = spec.moe_ffn_size
            out += [(ep, etp) for etp in range(2, stage_ranks // ep + 1)
                    if (stage_ranks // ep) % etp == 0 and ffn % etp == 0 and etp <= 8]
    return out


# ---- compute ----

def rank_view(layer: LayerProfile, lay: Layout, framework, spec) -> LayerProfile:
    """``layer`` (profiled at one sample, whole model on one rank) as one rank of ``lay`` runs it, for
    compute.estimate_pass_times and memory.layer_activation_bytes: the MoE block's GEMMs, memory traffic and
    saved activations split over tensor-parallel ranks like a sharded region (each routes its own tokens),
    the routed experts regrouped as the rank's E/ep experts with ep times the tokens each, times the
    imbalance (see the module docstring); the backward's weight-gradient traffic of the stacked expert
    weights for the rank's experts (:func:`stacked_grad_traffic`)."""
    if not is_moe(layer):
        return layer
    ep, imbalance, num_experts = lay.ep, routed_load(framework), spec.num_experts
    fwd, bwd = layer.fwd_ops, layer.bwd_ops
    experts = [i for i, x in enumerate(fwd.gemm_moe) if x == 2]
    keep = experts[:len(experts) // ep]  # the rank's E/ep experts (balanced: all alike)
    flops, sharded, core, marks, mlp = [], [], [], [], []
    in_mlp = fwd.gemm_mlp or [False] * len(fwd.gemm_flops)
    for f, s, c, m, x in zip(fwd.gemm_flops, fwd.gemm_sharded, fwd.gemm_core, fwd.gemm_moe, in_mlp, strict=True):
        if m == 2:
            continue
        flops.append(f)
        sharded.append(s or m > 0)
        core.append(c)
        marks.append(m)
        mlp.append(x)
    # each expert's GEMMs at its own token count (a grouped GEMM runs them in one kernel, each problem at its size)
    routed = [fwd.gemm_flops[i] * ep * imbalance for i in keep]
    flops += routed
    sharded += [True] * len(routed)
    core += [False] * len(routed)
    marks += [2] * len(routed)  # still the routed experts' (compute.estimate_pass_times: their dtype under FP8)
    mlp += [bool(fwd.gemm_mlp)] * len(routed)  # inside the MLP sublayer (where the profile says so)
    kernels_left = (fwd.kernels_expert * (1 - 1 / ep) if not framework.moe_grouped_gemm or not num_experts else
                    fwd.kernels_expert * (1 - 1 / num_experts))
    bwd_left = bwd.kernels * kernels_left / fwd.kernels if fwd.kernels else 0.0
    # the block's other traffic: the trace's, split over tp like a sharded region; or, for a stack of fused MoE
    # kernels, none of it here (fused_kernel_seconds prices theirs): the forward's traced MoE share taken out,
    # and twice that out of the backward's (whose MoE share is not traced apart: a backward kernel moves about
    # twice what its forward does)
    moe_fwd = fwd.other_bytes_moe if framework.moe_kernels == "fused" else 0
    moe_bwd = min(2 * moe_fwd, bwd.other_bytes - bwd.other_bytes_fixed)
    new_fwd = dataclasses.replace(fwd, gemm_flops=flops, gemm_sharded=sharded, gemm_core=core,
                                  gemm_moe=marks, gemm_mlp=mlp if fwd.gemm_mlp else [],
                                  other_bytes=fwd.other_bytes - moe_fwd,
                                  other_bytes_sharded=fwd.other_bytes_sharded + fwd.other_bytes_moe - moe_fwd,
                                  other_bytes_mlp=max(0, fwd.other_bytes_mlp - moe_fwd),
                                  kernels=round(fwd.kernels - kernels_left),
                                  kernels_mlp=max(0, round(fwd.kernels_mlp - kernels_left)))
    # the executor's per-expert weight gradients, profiled with all E experts on one rank: E/ep of them here,
    # none with a grouped GEMM (it writes each expert's gradient once, as the GEMM's own output).
    # Known and kept (issue 16's notes): the trace's weight-sized traffic beyond that formula, about 4
    # elements per parameter of all E experts in every MoE preset (a part linear in the experts), stays whole on
    # every rank, whatever ep, etp or a grouped GEMM. Scaled as physics says (the rank's E/ep experts; a grouped
    # GEMM's fp32 main-gradient accumulation, 8 bytes per local expert parameter) every Megatron-Core MoE row
    # priced 5-25% faster: held out, 14.1% mean error instead of 8.2% (benchmarks/fidelity_moe.py), and 18.3%
    # instead of 14.7% on six rows first seen then (Megatron-Core MoE model zoo, dgxc v25.08); re-checked in
    # round 3 with the rows' FP8 recipes and the paired all-to-all overlap: 12.9% instead of 9.3%. It stands in for
    # an MoE cost not otherwise modelled; what that cost is remains open. It overprices large ep x etp with large
    # experts (Llama 4 Maverick at ep128 etp4: +30%, -6% without it).
    elem = 4 if lay.dtype == "fp32" else 2
    profiled = min(stacked_grad_traffic(spec, num_experts, elem), bwd.other_bytes_fixed)
    kept = 0.0 if framework.moe_grouped_gemm else stacked_grad_traffic(spec, num_experts // ep, elem)
    new_bwd = dataclasses.replace(bwd, kernels=round(bwd.kernels - bwd_left),
                                  other_bytes=round(bwd.other_bytes - moe_bwd - profiled + kept),
                                  other_bytes_fixed=round(bwd.other_bytes_fixed - profiled + kept))
    moe_saved = layer.activation_bytes_moe * padded_copies(framework)  # (what the router keeps scaled too: small)
    # what MLP recomputation drops is the MoE block's own (each tensor-parallel rank routes its own tokens)
    return dataclasses.replace(layer, fwd_ops=new_fwd, bwd_ops=new_bwd,
                               activation_bytes_sharded=layer.activation_bytes_sharded + moe_saved,
                               activation_bytes_selective_sharded=layer.activation_bytes_selective_sharded + moe_saved,
                               mlp_dropped_bytes_sharded=layer.mlp_dropped_bytes)


def norm_act_recompute_seconds(spec, lay: Layout, framework, tokens: float, moe_layer: bool, hbm_Bps: float,
                               kernel_s: float) -> float:
    """Seconds a transformer layer's ``--recompute norm+act`` reruns in backward on a rank holding ``tokens`` tokens
    of the micro-batch (Megatron-Core's recompute_modules layernorm and moe_act: output-discarding checkpoints,
    transformer_layer.py and experts.py): each norm that is a module of its own — the pre-MLP norm of an MoE layer
    (its router and dispatch read it) and multi-head latent attention's input norm (before its down projections);
    the other norms are fused into Transformer Engine's norm + linear modules and are not recomputed — reads 2h and
    writes 2h per token of the rank's sequence shard; the routed experts' fused activation reads 2·up and writes 2f
    per token copy it holds (fused_moe's accounting), and under FP8 its output is cast again for the second GEMM's
    weight gradient (planner/fp8.py's bytes per element cast). One kernel each (plus the casts')."""
    from . import fp8

    h = spec.hidden_size
    shard = tokens / (lay.tp if lay.sequence_parallel else 1)
    norms = (1 if moe_layer else 0) + (1 if getattr(spec, "mla", False) else 0)
    moved, kernels = norms * 4 * h * shard, norms
    if moe_layer:
        f, up, _, _ = fused_moe.expert_widths(spec)
        copies = tokens / lay.tp * spec.top_k * routed_load(framework)
        moved += copies * (2 * up + 2 * f)
        kernels += 1
        if lay.dtype == "fp8" and framework.fp8_experts:
            moved += copies * f * fp8.CAST_BYTES[framework.fp8_scaling]
            kernels += fp8.CAST_KERNELS[framework.fp8_scaling]
    return moved / hbm_Bps + kernels * kernel_s


def local_experts(spec, lay: Layout) -> int:
    """The routed experts one rank holds: E/ep (each split over etp ranks, still E/ep of them)."""
    return max(1, spec.num_experts // lay.ep)


def fused_kernel_seconds(spec, lay: Layout, framework, tokens: float, hbm_Bps: float, kernel_s: float = 0.0
                         ) -> tuple[float, float]:
    """(forward, backward) seconds of the fused MoE kernels' memory traffic (planner/fused_moe.py) on a rank
    routing its 1/tp of ``tokens`` tokens, the most loaded rank's share of copies (:func:`routed_load`), and of
    expert biases added expert by expert where the spec has them and the stack adds them so
    (Framework.moe_bias_per_expert; fused_moe.expert_bias_bytes: their kernels at ``kernel_s`` each too)."""
    local = local_experts(spec, lay)
    per = fused_moe.block_bytes(spec, local, framework.moe_dispatcher, lay.dtype == "fp8" and framework.fp8_experts)
    looped = framework.moe_bias_per_expert
    bias_f, bias_b = fused_moe.expert_bias_bytes(spec) if looped else (0.0, 0.0)
    kernels_f, kernels_b = fused_moe.expert_bias_kernels(spec, local) if looped else (0, 0)
    routed = tokens / lay.tp * routed_load(framework)
    return ((per.fwd + bias_f) * routed / hbm_Bps + kernels_f * kernel_s,
            (per.bwd + bias_b) * routed / hbm_Bps + kernels_b * kernel_s)


def stacked_grad_traffic(spec, local_experts: int, elem: int) -> float:
    """Bytes the executor's backward moves for the weight gradients of a rank's ``local_experts`` experts,
    held as stacked (E_l, in, out) tensors and unbound into per-expert views once per forward (models/moe.py
    GroupedExperts): autograd's unbind_backward stacks the experts' gradients into one zero-filled whole-stack
    tensor (E_l·in·out written, each slice read and written): 3·E_l·in·out elements per stacked weight, ``elem``
    bytes each (profiled: Qwen3-30B-A3B's 128 experts and Mixtral's 8 alike, the traced backward's weight-sized
    traffic less the ~4 elements per expert parameter the layer's other work moves). Indexing each expert apart
    (w[e]) wrote a whole-stack gradient per expert and summed them: (4·E_l² - E_l), 511 per element at 128 experts
    where this is 3."""
    mats = 3 if spec.family == "llama" else 2  # SwiGLU's w1, w3, w2; GELU's w1, w2
    return mats * 3 * local_experts * spec.hidden_size * spec.moe_ffn_size * elem


# ---- communication ----

def all_to_all(nbytes: float, span, cluster, busy: int) -> float:
    """One all-to-all where every rank of a group placed as ``span`` sends ``nbytes`` (its whole send buffer,
    1/n of it to itself): (n-1)/n of it leaves the rank — (r-1)/n to the r-1 peers in its node over NVLink,
    (n-r)/n to other nodes through its share of the node's network — both at once, each paying its link's
    latency once (every peer is sent to at once, as NCCL's grouped send/receive does). Where nodes hold unequal
    shares of the group, a rank of the emptiest sends the most across."""
    n = span.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    r = span.max_per_node
    intra = cluster.intra_node
    t_intra = (r - 1) / n * nbytes / intra.bandwidth_Bps + (intra.latency_s if r > 1 else 0.0)
    if n == r:
        return t_intra
    net = comm.network_share(cluster, comm.senders(span, busy))
    # a rank on the node holding the fewest of the group (4 + 1) sends the most through the network
    t_inter = (n - span.fewest_per_node) / n * nbytes / net.bandwidth_Bps + net.latency_s
    return max(t_intra, t_inter)


@lru_cache(maxsize=256)
def token_destinations(experts: int, k: int, groups: int, routing: str = "uniform",
                       limit: tuple = (1, 1, "top-sum")) -> float:
    """How many of ``groups`` equal blocks of consecutive experts (ranks, or nodes) one token's k experts fall
    in, on average. ``uniform`` (k distinct experts at random): a block of E/g experts holds none of them with
    probability C(E - E/g, k) / C(E, k), so g·(1 - that). ``consecutive`` (token t takes experts t·k ... t·k + k - 1
    mod E: Framework.moe_routing): counted over the starts the tokens cycle through. ``limit``: group-limited
    routing's (groups, groups chosen, group score) (ModelSpec.routing_limit), under uniform routing: see
    :func:`limited_destinations`."""
    per = experts // groups
    if groups <= 1 or per <= 0:
        return 1.0
    if routing == "uniform" and limit[0] > 1:
        return limited_destinations(experts, k, groups, *limit)
    if routing == "consecutive":
        starts = [(t * k) % experts for t in range(experts // math.gcd(experts, k))]
        block = lambda e: min(e // per, groups - 1)  # noqa: E731  (a last, larger block takes what is left over)
        return sum(len({block((s + j) % experts) for j in range(k)}) for s in starts) / len(starts)
    miss = math.comb(experts - per, k) / math.comb(experts, k) if experts - per >= k else 0.0
    return groups * (1 - miss)


LIMITED_SAMPLES = 4096  # tokens drawn by limited_destinations (its estimate's standard error is under 0.5%)


@lru_cache(maxsize=16)
def _limited_choices(experts: int, k: int, groups: int, group_topk: int, group_score: str = "top-sum"):
    """The k experts models.moe.group_limited_topk picks for each of LIMITED_SAMPLES tokens of uniform scores
    (a fixed seed): (T, k) expert indices."""
    import numpy as np

    rng = np.random.default_rng(0)
    scores = rng.random((LIMITED_SAMPLES, groups, experts // groups), dtype=np.float32)  # (T, G, E/G)
    best = k // group_topk if group_score == "top-sum" else 1  # "max": a group's best score
    group_scores = -np.partition(-scores, best - 1, axis=-1)[..., :best].sum(axis=-1)  # (T, G)
    chosen = np.argpartition(-group_scores, group_topk - 1, axis=-1)[:, :group_topk]  # (T, M)
    keep = np.zeros(group_scores.shape, dtype=bool)
    np.put_along_axis(keep, chosen, True, axis=-1)
    masked = np.where(keep[..., None], scores, np.float32(-1.0)).reshape(LIMITED_SAMPLES, experts)  # (T, E)
    return np.argpartition(masked, experts - k, axis=-1)[:, experts - k:]  # (T, k): the k best experts


@lru_cache(maxsize=64)
def limited_destinations(experts: int, k: int, blocks: int, groups: int, group_topk: int,
                         group_score: str = "top-sum") -> float:
    """token_destinations under group-limited routing (DeepSeek-V3 Sec. 2.1.2: at most ``group_topk`` of
    ``groups`` blocks of experts per token) with scores independent and identically distributed, as force-balanced
    routing draws them (Megatron-Core's moe_router_force_load_balancing: random logits): the blocks the k experts
    of models.moe.group_limited_topk fall in, averaged over LIMITED_SAMPLES tokens (_limited_choices). Not the
    uniform formula within the chosen groups: a group is chosen for its best scores, which then tend to be among
    the k (DeepSeek-V3's 256 experts, 8 groups, 4 chosen, top 8: 3.95 of the 8 groups hit, not the 3.64 of k
    experts drawn uniformly from the 4)."""
    import numpy as np

    idx = _limited_choices(experts, k, groups, group_topk, group_score)
    block = np.minimum(idx // (experts // blocks), blocks - 1)  # a last, larger block takes what is left over
    hit = np.zeros((LIMITED_SAMPLES, blocks), dtype=bool)
    np.put_along_axis(hit, block, True, axis=-1)
    return float(hit.sum(axis=-1).mean())


def deduplicated_dispatch(tokens: float, token_bytes: float, experts: int, k: int, span, cluster,
                          busy: int, routing: str = "uniform", limit: tuple = (1, 1, "top-sum")) -> float:
    """One dispatch (or combine) of ``tokens`` tokens by DeepEP / HybridEP (Megatron-Core's flex dispatcher):
    a token crosses the network once per remote node holding any of its k experts, then NVLink forwards it
    to those experts' GPUs (DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.2.2: "first transmitted via IB to
    the GPUs with the same in-node index on its target nodes ... then forwarded via NVLink"), once per GPU
    whatever its experts among the k (DeepEP's dispatch sends a token to each rank in is_token_in_rank once, with
    the rank's expert indices; the rank permutes it to its experts locally). How many nodes and GPUs a token
    reaches is :func:`token_destinations` over the group's n ranks, r per node: a share (g - 1)/g of them other
    than the sender's own. The two paths run at once."""
    n, r = span.size, span.max_per_node
    if n <= 1 or tokens <= 0:
        return 0.0
    intra = cluster.intra_node
    ranks = token_destinations(experts, k, n, routing, limit)
    t_intra = tokens * ranks * token_bytes * (n - 1) / n / intra.bandwidth_Bps + (intra.latency_s if r > 1 else 0.0)
    if n == r:
        return t_intra
    nodes = span.nodes
    remote = token_destinations(experts, k, nodes, routing, limit) * (nodes - 1) / nodes  # remote nodes it goes to
    net = comm.network_share(cluster, comm.senders(span, busy))
    t_inter = tokens * remote * token_bytes / net.bandwidth_Bps + net.latency_s
    return max(t_intra, t_inter)


@dataclass(frozen=True)
class EPCost:
    """One MoE layer's expert-parallel and token-split communication for one micro-batch on one rank."""

    fwd: float = 0.0  # seconds the forward waits for
    bwd: float = 0.0  # seconds the backward waits for (full recomputation's repeated forward included)
    traffic: dict[str, float] = field(default_factory=dict)  # bytes by collective kind (costmodel.COMM_KINDS)

    @property
    def seconds(self) -> float:
        return self.fwd + self.bwd


def layer_cost(model, layer: LayerProfile, lay: Layout, place: Placement, b: float, mode: str,
               times=None) -> EPCost:
    """The all-to-alls (and etp gathers) of MoE layer ``layer`` for a micro-batch of ``b`` whole sequences on
    one rank (their 1/cp share, 1/tp of its tokens: see the module docstring), in recomputation ``mode``.
    ``times``: the layer's passes on the rank (compute.PassTimes), what ``Framework.moe_a2a_overlap`` hides
    the all-to-alls behind (:func:`overlapped_layer_exchanges`)."""
    if not is_moe(layer):
        return EPCost()
    work = model.work
    spec, cluster, fw = work.spec, work.cluster, work.framework
    busy = place.gpus_per_node_busy
    elem = 4 if lay.dtype == "fp32" else 2
    h, k, e = spec.hidden_size, spec.top_k, spec.num_experts
    tokens = b * work.tokens_per_sample / lay.tp  # this rank's tokens of the micro-batch (b already over cp)
    repeat = 1 if mode == "full" or recomputes_mlp(mode) else 0  # they recompute the MoE block, its all-to-alls too
    padded = fw.moe_capacity_factor if fw.moe_pad_to_capacity else 1.0  # padding to capacity is sent too
    traffic: dict[str, float] = {}
    fwd = bwd = 0.0
    skipped = 0.0  # forward seconds a recomputation does not rerun
    if lay.ep > 1:
        span = consecutive_group(cluster, lay.ep, lay.etp, lay.num_gpus)
        # every token copy the rank routes (balanced: also what it receives): one per routed expert, or with a
        # deduplicating dispatcher one per GPU holding any of the token's experts (deduplicated_dispatch)
        limit = spec.routing_limit
        copies = token_destinations(e, k, span.size, fw.moe_routing, limit) if fw.moe_dispatcher == "hybridep" else k
        sent = tokens * copies * h * elem
        if fw.moe_dispatcher == "hybridep":
            one = deduplicated_dispatch(tokens, h * elem, e, k, span, cluster, busy, fw.moe_routing, limit)
        else:
            one = all_to_all(sent, span, cluster, busy)
        one *= routed_load(fw)
        # what the forward exchanges before the tokens: the executor's token counts, HybridEP's routing maps
        prelude = all_to_all(e * COUNT_BYTES, span, cluster, busy) if fw.states == "executor" else 0.0
        if fw.moe_dispatcher == "hybridep":  # its forward first all-gathers every rank's routing map over the ep
            # group, a token x expert bool each (DeepEP's hybrid_ep_buffer.py, dispatch without a cached handle:
            # all_gather_into_tensor; the backward reuses the handle)
            routing_map = lay.ep * tokens * e * ROUTING_MAP_BYTES
            prelude += comm.gather(routing_map, span, cluster, busy)
            traffic["all_gather"] = traffic.get("all_gather", 0.0) + (1 + repeat) * routing_map
        a2a_fwd = a2a_bwd = 2 * one
        if a2a_overlap_applies(fw, lay, mode):  # each exchange beside a stretch of another micro-batch's other pass
            q = paired_share(fw, lay)  # the passes that have one; the rest (warm-up, cool-down) run theirs alone
            hidden_fwd, hidden_bwd = overlapped_layer_exchanges(one, times, cluster.gpu.sm_count)
            a2a_fwd, a2a_bwd = q * hidden_fwd + (1 - q) * a2a_fwd, q * hidden_bwd + (1 - q) * a2a_bwd
        elif fw.moe_shared_expert_overlap and spec.num_shared_experts:  # each exchange beside a shared GEMM
            a2a_fwd, a2a_bwd = shared_expert_exchanges(one, shared_expert_gemms(spec, tokens, cluster.gpu, lay.dtype),
                                                       cluster.gpu.sm_count)
        fwd += a2a_fwd + prelude
        bwd += a2a_bwd
        traffic["all_to_all"] = (4 + 2 * repeat) * sent * padded + \
            ((1 + repeat) * e * COUNT_BYTES if fw.states == "executor" else 0.0)
    if lay.etp > 1:  # received tokens gathered over the etp group, the results reduce-scattered; both passes
        full = lay.etp * tokens * k * h * elem
        group = consecutive_group(cluster, lay.etp, world=lay.num_gpus)
        one = comm.gather(full, group, cluster, busy) * routed_load(fw)
        fwd += 2 * one
        bwd += 2 * one
        traffic["all_gather"] = traffic.get("all_gather", 0.0) + (2 + repeat) * full * padded
        traffic["reduce_scatter"] = traffic.get("reduce_scatter", 0.0) + (2 + repeat) * full * padded
    if fw.states == "executor" and lay.tp > 1:
        if not lay.sequence_parallel:  # the block's output all-gathered (forward), its input gradient (backward)
            whole = b * work.tokens_per_sample * h * elem
            one = comm.gather(whole, place.tp, cluster, busy)
            fwd += one
            bwd += one
            # the block's last op: an early-stopping checkpoint (Framework.recompute_early_stop) has what backward
            # needs before it, so never reruns it (the dry run traces no third gather)
            skipped = one if fw.recompute_early_stop else 0.0
            traffic["all_gather"] = traffic.get("all_gather", 0.0) + (2 + (0 if skipped else repeat)) * whole
    if fw.states == "executor" and lay.tp * lay.cp > 1 and spec.moe_aux_loss_coeff > 0:
        hits = b * e * AUX_BYTES  # tokens per expert of each sequence, summed over the ranks sharing it
        fwd += comm.all_reduce(hits, place.tp, cluster, busy)
        traffic["all_reduce"] = traffic.get("all_reduce", 0.0) + (1 + repeat) * hits
    return EPCost(fwd=fwd, bwd=bwd + repeat * (fwd - skipped), traffic=traffic)


# ---- gradients, optimizer, memory ----

def expert_states(framework, lay: Layout) -> StateBytes:
    """Model-state bytes per expert-parallel parameter: memory.state_bytes with ZeRO sharding over edp."""
    return state_bytes(framework, lay, data_ranks=edp(lay))


def expert_exposures(model, lay: Layout, place: Placement, root_experts: float = 0.0) -> list[Exposure]:
    """What a rank sends and waits for per iteration to sync its expert-parallel experts' gradients over the
    edp ranks holding the same experts (ranks ep·etp apart), in dp_sync.py's style (dp_sync._executor and
    _zero_accounting with the edp group and the rank's ``experts``). ``root_experts``: the experts of the
    unit synced last (one layer's), which cannot hide behind the backward."""
    from .dp_sync import bucket_bytes, copy_out, executor_sharded, grad_bytes, weight_bytes

    work = model.work
    fw, cluster, busy = work.framework, work.cluster, place.gpus_per_node_busy
    n = edp(lay)
    if n <= 1 or lay.dp_mode == "ps" or not getattr(work.spec, "is_moe", False) or not expert_parallel(lay, fw):
        return []
    group = consecutive_group(cluster, n, lay.ep * lay.etp, lay.num_gpus)
    all_reduce = lambda nbytes: comm.all_reduce(nbytes, group, cluster, busy)  # noqa: E731
    gather = lambda nbytes: comm.gather(nbytes, group, cluster, busy)  # noqa: E731
    ge, wb, m = grad_bytes(work, lay), weight_bytes(lay), lay.num_micro_batches
    window = Affine(window=1.0) if work.overlap_dp else Affine()
    fwd, bwd = Affine(fwd=1.0), Affine(bwd=1.0)
    if fw.states == "executor":
        if lay.zero <= 1:
            if lay.pp == 1:
                items = [Exposure(Sync("all_reduce", all_reduce, per_expert=ge), hidden=window, floor="bucket",
                                  bucket_bytes=root_experts * ge)]
            else:  # torch pipelining reduces after the step's last backward
                items = [Exposure(Sync("all_reduce", all_reduce, per_expert=ge))]
            if lay.zero == 1:  # owners broadcast their updated fp32 experts over edp
                items.append(Exposure(Sync("all_gather", gather, per_expert=4)))
            return items
        return executor_sharded(lay, fw, gather, ge, wb, m, "per_expert", copy_out(cluster.gpu))
    # Megatron-Core: the expert-data-parallel group's buffers, like the dense ones (dp_sync._zero_accounting), in
    # buckets of the size the dense data-parallel group sets (one DistributedDataParallelConfig.bucket_size)
    if lay.pp > 1 and fw.dp_sync_pipelined == "end":
        window = Affine()
    if lay.zero == 0:
        return [Exposure(Sync("all_reduce", all_reduce, per_expert=ge), hidden=window, floor="bucket",
                         bucket_bytes=bucket_bytes(fw, lay, ge))]
    items = [Exposure(Sync("reduce_scatter", gather, per_expert=ge), hidden=window, floor="bucket",
                      bucket_bytes=bucket_bytes(fw, lay, ge))]
    gathers = Sync("all_gather", gather, per_expert=wb)
    if lay.zero == 3:
        items += [Exposure(gathers, count=m, hidden=fwd, floor="zero"),
                  Exposure(gathers, count=m, hidden=bwd, floor="zero")]
    elif getattr(fw, "overlap_param_gather", False):
        items.append(Exposure(gathers, hidden=fwd, floor="bucket", bucket_bytes=bucket_bytes(fw, lay, wb)))
    else:
        items.append(Exposure(gathers))
    return items


def tp_summed_exposure(model, lay: Layout, place: Placement) -> Exposure | None:
    """This executor sums over the tensor-parallel group the gradients of the MoE weights every tp rank holds
    whole but trains on its own tokens (router, shared experts; routed experts when ep = 1;
    executor/expert_parallel.py SumGrads): one fp32 all-reduce after the step's backward, of the rank's
    data-parallel shard under ZeRO 2/3 (FSDP2 has reduce-scattered them by then; ZB-V's pipeline, or a stack that
    syncs gradients on the last backward only, accumulates them whole: dp_sync.reduces_once). Traced by the dry
    run, pipelined or not."""
    from .dp_sync import reduces_once

    if lay.tp == 1 or model.work.framework.states != "executor" or not getattr(model.work.spec, "is_moe", False):
        return None
    cluster, data = model.work.cluster, lay.dp * lay.cp
    sync = lambda n: comm.all_reduce(n, place.tp, cluster, place.gpus_per_node_busy)  # noqa: E731
    sharded = lay.zero >= 2 and data > 1 and not reduces_once(model.work.framework, lay)
    return Exposure(Sync("all_reduce", sync, per_moe_shared=4.0 / data if sharded else 4.0))


def a2a_overlap_possible(fw, lay: Layout) -> bool:
    """a2a_overlap_applies before the recomputation mode: a block's cost depends on this (CostModel's block keys)."""
    return fw.moe_a2a_overlap and lay.ep > 1 and lay.num_micro_batches >= 2 and (lay.pp == 1 or lay.virtual_stages > 1)


def paired_share(fw, lay: Layout) -> float:
    """Of a rank's passes of a layer, the share that runs beside another micro-batch's other pass under
    overlap_moe_expert_parallel_comm (0 where the overlap is impossible), as a mean over the pipeline's ranks (one
    block cost serves them all). Megatron-Core pairs a forward with a backward only in the steady state:
    without a pipeline (combined_1f1b_schedule_for_no_pipelining) the first micro-batch's forward and the last
    one's backward run alone, so (m - 1) / m; in an interleaved pipeline rank r's warm-up forwards and as many
    cool-down backwards run alone, w_r = 2 (p - r - 1) + (v - 1) g + 1 of its m·v chunk passes
    (schedules.get_pp_rank_microbatches: the +1 is the extra warm-up micro-batch the overlap schedules; g, the
    micro-batch group per virtual stage, defaults to p)."""
    if not a2a_overlap_possible(fw, lay):
        return 0.0
    p, v, m = lay.pp, lay.virtual_stages, lay.num_micro_batches
    if p == 1:
        return (m - 1) / m
    passes = m * v
    alone = [min(passes, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]
    return 1.0 - sum(alone) / (p * passes)


def a2a_overlap_applies(fw, lay: Layout, recompute: str | None = None) -> bool:
    """Does ``fw.moe_a2a_overlap`` hide this layout's all-to-alls? Megatron-Core's overlap_moe_expert_parallel_comm
    runs one micro-batch's forward beside another's backward: it needs ep > 1, two micro-batches or more, no full
    recomputation, no recomputation of the MoE block ("moe" in recompute_modules: the "mlp" mode, see
    exports/megatron.py) and, with a pipeline, virtual stages (TransformerConfig.__post_init__'s checks); elsewhere
    nothing is hidden. ``recompute``: the block's mode where it is not the layout's own."""
    mode = recompute or lay.recompute
    return a2a_overlap_possible(fw, lay) and mode != "full" and not recomputes_mlp(mode)


def expert_optimizer_step(model, lay: Layout) -> Affine:
    """Adam's memory traffic over the expert shard a rank updates (all its experts, 1/edp with ZeRO): the
    expert side of dp_sync.optimizer_step."""
    from .dp_sync import adam_bytes_per_param

    work = model.work
    gpu = work.cluster.gpu
    if lay.dp_mode == "ps" or not getattr(work.spec, "is_moe", False):
        share = None
    else:
        share = 1.0 / edp(lay) if lay.zero >= 1 else 1.0
    busy = layout_placement(work.cluster, lay).gpus_per_node_busy if model.cpu_share.cpu and share else 0
    key = ("experts' optimizer", share, busy)  # all it depends on (as dp_sync.optimizer_step)
    got = model.step_affines.get(key)
    if got is None:
        if share is None:
            got = Affine()
        else:
            per_expert = share * adam_bytes_per_param(work.framework) / gpu.memory_bound_Bps
            if model.cpu_share.cpu:  # a CPU rank's share of the machine's cores (cpu_share.py)
                per_expert *= model.cpu_share.compute(busy)
            got = Affine(experts=per_expert)
        model.step_affines[key] = got
    return got

"""Mixture-of-experts pricing (planner/moe.py, issue 16 item 2): every formula against its source, the ILP
against brute force on an expert-parallel layout, the search choosing expert parallelism where it pays,
the CLI showing the all-to-all, and the executor's dry run agreeing with the prediction."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from conftest import run_cli, run_cli_json
from paraplan.models import load_model_spec
from paraplan.planner import comm, moe
from paraplan.planner.costmodel import CostModel, default_stages, validate_layout
from paraplan.planner.errors import InvalidLayout, PlanError
from paraplan.planner.framework import FRAMEWORKS
from paraplan.planner.ilp import best_partition, modes_for
from paraplan.planner.layout import Layout
from paraplan.planner.memory import GiB
from paraplan.planner.placement import consecutive_group, layout_placement
from paraplan.planner.schedules import stage_rank
from paraplan.planner.search import enumerate_layouts, lower_bound
from paraplan.planner.workload import Workload


@pytest.fixture(scope="module")
def mixtral():
    return Workload.create("mixtral-8x7b", "dgx-h100", 512, nodes=8)


def _layer(work):
    return next(x for x in work.profile("bf16").layers if x.moe_params)


# ---------------- formulas ----------------


def test_all_to_all_inside_a_node_is_thakurs_pairwise_exchange(mixtral):
    """Thakur et al. 2005: each of p ranks sends (p-1)/p of its M bytes, at the link's bandwidth, plus latency."""
    cl = mixtral.cluster
    span = consecutive_group(cl, 8)
    m = 64 * 2**20
    link = cl.intra_node
    assert moe.all_to_all(m, span, cl, 8) == pytest.approx(7 / 8 * m / link.bandwidth_Bps + link.latency_s)
    assert moe.all_to_all(m, consecutive_group(cl, 1), cl, 8) == 0.0


def test_all_to_all_across_nodes_sends_the_foreign_share_through_the_shared_network(mixtral):
    """ep 16 over two nodes: 7/16 of the buffer to node peers over NVLink, 8/16 to the other node through a
    1/8 share of the node's network (all 8 GPUs exchange at once), both at once: the slower bounds it."""
    cl = mixtral.cluster
    span = consecutive_group(cl, 16)
    assert (span.nodes, span.max_per_node) == (2, 8)
    m = 64 * 2**20
    intra = 7 / 16 * m / cl.intra_node.bandwidth_Bps + cl.intra_node.latency_s
    net_bw = cl.inter_node.bandwidth_Bps / 8
    inter = 8 / 16 * m / net_bw + cl.inter_node.latency_s
    assert moe.all_to_all(m, span, cl, 8) == pytest.approx(max(intra, inter))
    assert inter > intra  # across nodes the network binds


def test_expert_params_and_states_per_rank_follow_the_folding(mixtral):
    """ep8 on dp64: a rank holds 1/8 of each layer's experts (3 x h x f x E / 8 for SwiGLU experts); ZeRO
    shards their states over edp = 64 / 8 = 8 ranks, the dense parameters' over dp = 64."""
    spec, fw = mixtral.spec, mixtral.framework
    layer = _layer(mixtral)
    assert layer.expert_params == 3 * spec.hidden_size * spec.moe_ffn_size * spec.num_experts
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=8, zero=1)
    assert moe.edp(lay) == 8
    assert moe.experts_on_rank(layer, lay, fw) == layer.expert_params / 8
    assert moe.params_on_rank(layer, lay, 1.0, fw) == layer.params - layer.expert_params * 7 / 8
    # this executor's states (memory.state_bytes): fp32 weights 4 + bf16 copy 2, fp32 grads 4, Adam 8 / ZeRO-1 ranks
    assert moe.expert_states(fw, lay).optimizer == pytest.approx(8 / 8)
    assert moe.expert_states(fw, lay).weights + moe.expert_states(fw, lay).grads == pytest.approx(10)
    # without expert parallelism this executor keeps the experts among the layer's dense parameters
    assert moe.experts_on_rank(layer, lay.replace(ep=1), fw) == 0.0
    # Megatron syncs them over its expert-data-parallel group even at ep = 1
    assert moe.experts_on_rank(layer, lay.replace(ep=1), FRAMEWORKS["megatron-2021"]) == layer.expert_params


def test_token_all_to_all_bytes_per_micro_batch(mixtral):
    """Per MoE layer and micro-batch: dispatch and combine forward and backward, each the rank's tokens x k
    copies x h x 2 bytes (bf16), plus one all-to-all of E int64 token counts; full recomputation repeats the
    forward's two and the counts."""
    spec = mixtral.spec
    model = CostModel(mixtral)
    layer = _layer(mixtral)
    lay = Layout(dp=32, tp=2, pp=1, micro_batch=2, global_batch=512, ep=8, sequence_parallel=True)
    place = layout_placement(mixtral.cluster, lay)
    tokens = 2 * spec.seq_length / 2  # b sequences, 1/tp of their tokens routed by each tensor-parallel rank
    one = tokens * spec.top_k * spec.hidden_size * 2
    cost = moe.layer_cost(model, layer, lay, place, 2, "none")
    assert cost.traffic["all_to_all"] == 4 * one + spec.num_experts * 8
    full = moe.layer_cost(model, layer, lay, place, 2, "full")
    assert full.traffic["all_to_all"] == 6 * one + 2 * spec.num_experts * 8
    assert full.bwd == pytest.approx(cost.bwd + cost.fwd)
    # the time is the imbalance factor times the mean rank's exchange
    span = consecutive_group(mixtral.cluster, 8)
    counts = moe.all_to_all(spec.num_experts * 8, span, mixtral.cluster, place.gpus_per_node_busy)
    a2a = moe.all_to_all(one, span, mixtral.cluster, place.gpus_per_node_busy)
    # and the auxiliary loss's tokens per expert (b x E fp32) summed over the ranks sharing each sequence
    aux = comm.all_reduce(2 * spec.num_experts * 4, place.tp, mixtral.cluster, place.gpus_per_node_busy)
    assert cost.fwd == pytest.approx(2 * a2a * mixtral.framework.moe_imbalance + counts + aux)
    assert cost.traffic["all_reduce"] == 2 * spec.num_experts * 4
    assert cost.bwd == pytest.approx(2 * a2a * mixtral.framework.moe_imbalance)


def test_rank_view_regroups_the_experts_and_splits_the_moe_block_over_tp(mixtral):
    """E/ep experts per rank, each GEMM ep times the tokens (times the imbalance): the same expert FLOPs per
    rank as without expert parallelism; the router, dispatch and experts marked as split over tp (each tp rank
    routes its own tokens); the MoE block's saved activations likewise."""
    layer, spec = _layer(mixtral), mixtral.spec
    fw = mixtral.framework.replace(moe_imbalance=1.0)
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=4)
    view = moe.rank_view(layer, lay, fw, spec)
    experts = [f for f, m in zip(layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_moe, strict=True) if m == 2]
    assert len(experts) == 3 * spec.num_experts
    # one expert GEMM of the profile: its s·k/E tokens through an h x f linear
    assert experts[0] == 2 * spec.seq_length * spec.top_k // spec.num_experts * spec.hidden_size * spec.moe_ffn_size
    regrouped = view.fwd_ops.gemm_flops[-len(experts) // 4:]
    assert regrouped == [4 * f for f in experts[:len(experts) // 4]]
    assert sum(view.fwd_ops.gemm_flops) == sum(layer.fwd_ops.gemm_flops)
    moe_gemms = sum(1 for m in layer.fwd_ops.gemm_moe if m)
    assert sum(view.fwd_ops.gemm_sharded) == sum(layer.fwd_ops.gemm_sharded) + moe_gemms - len(experts) * 3 // 4
    assert view.activation_bytes_sharded == layer.activation_bytes_sharded + layer.activation_bytes_moe
    # the imbalance multiplies the routed experts' work only
    heavy = moe.rank_view(layer, lay, fw.replace(moe_imbalance=1.25), spec)
    assert sum(heavy.fwd_ops.gemm_flops) - sum(view.fwd_ops.gemm_flops) == pytest.approx(0.25 * sum(experts))
    # Megatron-Core's grouped GEMM: the same GEMMs (each at its expert's size), one kernel per projection, and
    # no per-expert weight-gradient traffic (each expert's gradient is the GEMM's own output)
    grouped = moe.rank_view(layer, lay, fw.replace(moe_grouped_gemm=True), spec)
    assert grouped.fwd_ops.gemm_flops == view.fwd_ops.gemm_flops
    assert grouped.fwd_ops.kernels == round(layer.fwd_ops.kernels - layer.fwd_ops.kernels_expert * (1 - 1 / 8))
    assert view.fwd_ops.kernels == round(layer.fwd_ops.kernels - layer.fwd_ops.kernels_expert * (1 - 1 / 4))
    assert layer.bwd_ops.other_bytes_fixed - grouped.bwd_ops.other_bytes_fixed == pytest.approx(
        moe.stacked_grad_traffic(spec, 8, 2), abs=1)
    assert view.bwd_ops.other_bytes_fixed - grouped.bwd_ops.other_bytes_fixed == pytest.approx(
        moe.stacked_grad_traffic(spec, 2, 2), abs=1)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_stacked_expert_gradient_traffic_is_what_the_profile_traced(name):
    """The executor's stacked expert weights, unbound into per-expert views once: 3 E x in x out elements per stacked
    weight in backward (unbind_backward's zero-filled whole stack, each expert's slice copied in); with the ~4 elements
    per expert parameter the rest of the layer's backward moves, the weight-sized traffic the profiler traced — alike
    for 128 experts and for 8 (indexing each expert apart made it 4 E² - E: 515 x the weights at 128 experts)."""
    work = Workload.create(name, "dgx-h100", 8)
    layer, spec = _layer(work), work.spec
    traced = layer.bwd_ops.other_bytes_fixed
    weights = 3 * spec.num_experts * spec.hidden_size * spec.moe_ffn_size * 2  # bytes of the three stacked weights
    formula = moe.stacked_grad_traffic(spec, spec.num_experts, 2)
    assert formula == 3 * weights
    assert 3.5 * weights < traced - formula < 4.5 * weights


def test_model_flops_count_active_experts_only(mixtral):
    """MFU from the active parameters: 3 x the profile's forward FLOPs, which route each token to k experts:
    per token about 6 x the active parameters outside the embedding (Kaplan et al. 2020's 6N, N active) plus
    attention."""
    model = CostModel(mixtral)
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=8, zero=3)
    pred = model.evaluate(lay, default_stages(model, lay))
    prof = mixtral.profile("bf16")
    spec = mixtral.spec
    tokens = 512 * spec.seq_length
    flops = pred.model_tflops_per_gpu * 1e12 * pred.iteration_time_s * 64
    assert flops == pytest.approx(3 * prof.total_fwd_flops * 512)
    active = prof.active_parameters - spec.vocab_size * spec.hidden_size  # the embedding's lookup is free
    attention = 3 * 2 * 2 * spec.num_layers * spec.seq_length * spec.hidden_size  # QK^T and AV, fwd + bwd
    assert flops / tokens == pytest.approx(6 * active + attention, rel=0.01)


# ---------------- the whole model ----------------


def test_expert_parallelism_moves_expert_sync_to_edp_and_adds_all_to_all(mixtral):
    """dp64 vs dp64 ep8, ZeRO 1: the all-to-all appears (bytes and time), the dense gradients still
    all-reduce over 64 ranks while the experts' go over 8, optimizer states of experts shard over 8."""
    model = CostModel(mixtral)
    plain = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, zero=1)
    ep = plain.replace(ep=8)
    a, b = (model.evaluate(x, default_stages(model, x)) for x in (plain, ep))
    assert a.rank_comm_bytes[0]["all_to_all"] == 0 < b.rank_comm_bytes[0]["all_to_all"]
    assert a.time_s["ep_comm"] == 0 < b.time_s["ep_comm"]
    experts = sum(x.expert_params for x in mixtral.profile("bf16").layers)
    # ZeRO-1 in this executor: all-reduce of fp32 gradients, broadcast of fp32 weights, dense over dp, experts over edp
    assert a.rank_comm_bytes[0]["all_reduce"] - b.rank_comm_bytes[0]["all_reduce"] == pytest.approx(
        4 * experts * 7 / 8)
    assert b.memory_gib["optimizer"] * GiB == pytest.approx(
        8 * (a.stages[0].params - experts) / 64 + 8 * experts / 8 / 8, rel=1e-9)


def test_edp_sync_is_its_own_exposure_over_ranks_ep_apart(mixtral):
    model = CostModel(mixtral)
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=8, zero=0)
    place = layout_placement(mixtral.cluster, lay)
    items = moe.expert_exposures(model, lay, place, 1e6)
    assert [e.sync.kind for e in items] == ["all_reduce"]
    assert items[0].sync.per_expert == 4 and items[0].sync.per_param == 0
    # the edp group: ranks 8 apart, one per node on 8 nodes
    span = consecutive_group(mixtral.cluster, 8, 8)
    assert (span.size, span.nodes) == (8, 8)
    assert moe.expert_exposures(model, lay.replace(dp=8, global_batch=64), layout_placement(mixtral.cluster, lay),
                                1e6) == []  # edp = 1: nothing to sync


def test_ilp_split_equals_brute_force_on_expert_parallel_layouts():
    """The stage ILP builds its rows from the same concerns (experts, their edp sync, the all-to-all)."""
    work = Workload.create("mixtral-tiny", "dgx-h100", 16)
    model = CostModel(work)
    modes = modes_for(model)
    checked = 0
    for lay in enumerate_layouts(work, 8, "bf16"):
        if lay.ep == 1 or lay.pp != 2 or lay.micro_batch > 1 or lay.virtual_stages > 1 or checked >= 8:
            continue
        try:
            validate_layout(model, lay)
        except InvalidLayout:
            continue
        n = len(work.profile("bf16").layers)
        rank_of = [stage_rank(lay.schedule, s, lay.pp) for s in range(lay.num_stages)]
        best = float("inf")
        for cuts in itertools.combinations(range(1, n), lay.num_stages - 1):
            bounds = [0, *cuts, n]
            stages = [list(range(bounds[i], bounds[i + 1])) for i in range(lay.num_stages)]
            for per_rank in itertools.product(modes, repeat=lay.pp):
                pred = model.evaluate(lay, stages, [per_rank[r] for r in rank_of])
                if pred.fits:
                    best = min(best, pred.iteration_time_s)
        got = best_partition(model, lay).prediction.iteration_time_s
        assert got == pytest.approx(best, rel=1e-9), lay.short()
        bound, _ = lower_bound(model, lay, modes)
        assert bound <= best * (1 + 1e-9), lay.short()
        checked += 1
    assert checked >= 6


def test_search_enumerates_expert_parallelism_only_for_moe_models():
    dense = Workload.create("llama-tiny", "dgx-h100", 16)
    assert {x.ep for x in enumerate_layouts(dense, 8, "bf16")} == {1}
    work = Workload.create("mixtral-tiny", "dgx-h100", 16)
    layouts = enumerate_layouts(work, 8, "bf16")
    assert {x.ep for x in layouts} == {1, 2, 4}  # divisors of dp x tp that divide the 4 experts
    assert {x.etp for x in layouts} == {1}  # this executor runs etp = 1 only
    assert all((x.dp * x.tp) % x.ep == 0 for x in layouts)
    megatron = Workload.create("mixtral-tiny", "dgx-h100", 16, framework="megatron-2021")
    assert {x.etp for x in enumerate_layouts(megatron, 8, "bf16")} > {1}


def test_plan_mixtral_8x7b_on_64_h100s_chooses_expert_parallelism_and_fits(tmp_path):
    out = run_cli_json("plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "8",
                       "--global-batch", "512", "--no-charts", "--top", "3", "--out", str(tmp_path / "r"))
    best = out["best"]
    assert best["plan"]["ep"] > 1 and best["fits"], best["plan"]
    assert best["time_s"]["ep_comm"] > 0 and best["rank_comm_bytes"][0]["all_to_all"] > 0


def test_simulate_json_and_plan_carry_ep_and_the_all_to_all(tmp_path):
    path = str(tmp_path / "plan.json")
    out = run_cli_json("simulate", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "8",
                       "--dp", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "2", "--write-plan", path)
    assert out["plan"]["ep"] == 2 and out["plan"]["etp"] == 1
    assert out["time_s"]["ep_comm"] > 0
    assert {"compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble"} <= set(out["time_s"])
    assert out["rank_comm_bytes"][0]["all_to_all"] > 0
    p = run_cli("simulate", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "2",
                "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "2")
    assert p.returncode == 0 and "ep comm" in p.stdout


def test_compare_shows_expert_against_data_and_tensor_parallelism(tmp_path):
    p = run_cli("compare", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
                "--out", str(tmp_path / "cmp"))
    assert p.returncode == 0, p.stderr
    for family in ("data parallel", "data x tensor", "data x expert"):
        assert family in p.stdout
    assert "all-to-all" in p.stdout
    out = run_cli_json("compare", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--gpus", "8",
                       "--global-batch", "64", "--strategy", "dp=8", "--strategy", "dp=8,ep=4", "--no-optimum",
                       "--out", str(tmp_path / "cmp2"))
    rows = {r["name"]: r for r in out["strategies"]}
    assert rows["dp=8,ep=4"]["layout"] == "dp8 tp1 pp1 ep4 mb1"
    assert rows["dp=8,ep=4"]["time_s"]["ep_comm"] > 0 == rows["dp=8"]["time_s"]["ep_comm"]


# ---------------- the executor's dry run ----------------


@pytest.mark.slow  # the dry-run spread (tests/test_dry_run.py) covers MoE in the default suite
def test_dry_run_of_an_expert_parallel_plan_matches_the_prediction(tmp_path):
    """mixtral-tiny dp2 ep2 (benchmarks/bench_dry_run.py's first MoE plan): the executor's own code traced at
    full size agrees with the cost model — tensors within 10%, every kind of traffic within 5%, the
    all-to-all exactly (4 exchanges of tokens x k x h x 2 bytes per layer and micro-batch, plus the counts)."""
    import importlib.util

    from conftest import ROOT
    from paraplan.executor.dry_run import dry_run
    from paraplan.executor.job import Job

    spec_ = importlib.util.spec_from_file_location("bench_dry_run", ROOT / "benchmarks" / "bench_dry_run.py")
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    plan = str(tmp_path / "plan.json")
    run_cli_json("simulate", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "2",
                 "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "2", "--write-plan", plan)
    result = dry_run(Job.load(plan), "cuda").to_dict()
    (rank,) = result["ranks"]
    peak, tensors, traffic, flops = bench.errors(rank)
    assert abs(peak) <= 0.10 and abs(tensors) <= 0.10 and traffic <= 0.05, (peak, tensors, traffic)
    assert abs(flops) <= 0.05, flops  # the experts' FLOPs as the active ones priced (balanced routing)
    layers, micro_batches, tokens, k, h = 4, 2, 2 * 128, 2, 128
    expected = layers * micro_batches * (4 * tokens * k * h * 2 + 4 * 8)
    assert rank["comm_bytes"]["all_to_all"] == rank["predicted_comm_bytes"]["all_to_all"] == expected


# ---------------- Megatron-Core's fused MoE block (planner/fused_moe.py) ----------------


def test_fused_moe_block_bytes_follow_the_kernel_accounting():
    """Mixtral 8x7B (h 4096, 8 SwiGLU experts of f 14336, top-2): per token, the router's input and fp32 scores
    (2h + 4E), per routed copy the two expert GEMMs' inputs, the weighted activation's input and its fp32
    probability (2h + 2·2f + 4 + 2f); the forward's non-GEMM kernels: top-k softmax 8E, permute 2h + 2kh,
    activation k·(2·2f + 2f), unpermute 2kh + 2h, and with the all-to-all dispatcher and several local experts
    the sort and unsort (4kh each)."""
    from paraplan.models import load_model_spec
    from paraplan.planner import fused_moe

    spec = load_model_spec("mixtral-8x7b")
    h, f, k, e = 4096, 14336, 2, 8
    got = fused_moe.block_bytes(spec, 2, "alltoall")
    assert got.saved == 2 * h + 4 * e + k * (2 * h + 4 * f + 4 + 2 * f)
    fwd_no_sort = 8 * e + 2 * h + 2 * k * h + k * (4 * f + 2 * f) + 2 * k * h + 2 * h
    assert got.fwd == fwd_no_sort + 8 * k * h
    assert fused_moe.block_bytes(spec, 1, "alltoall").fwd == fwd_no_sort  # one local expert: nothing to sort
    assert fused_moe.block_bytes(spec, 2, "hybridep").fwd == fwd_no_sort  # DeepEP writes expert order
    bwd = fused_moe.block_bytes(spec, 1, "alltoall").bwd
    assert bwd == (2 * h + 2 * k * h) + k * (8 * f + 2 * f) + (2 * k * h + 2 * h) + 12 * e


def test_megatron_core_moe_layer_keeps_the_fused_count_not_the_eager_trace():
    """Under --framework megatron-core a MoE layer keeps what TE's and Megatron's fused modules save (attention
    as a dense layer's, the pre-MLP norm's input, the MoE block: fused_moe), far less than the eager trace of
    this executor's block (which keeps every norm, rotary and SwiGLU intermediate)."""
    from paraplan.planner import fused_moe
    from paraplan.planner.fused_activations import fused_layer_bytes

    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 1024, nodes=2, framework="megatron-core")
    spec = work.spec
    s, h, a, kv, d = spec.seq_length, 2048, 32, 4, 128
    attention = 2 * (a * d + 2 * kv * d) + 2 * a * d + 2 * (a * d + kv * d)  # + the q/k norms' inputs
    moe_saved = fused_moe.block_bytes(spec, 8, "alltoall").saved
    assert fused_layer_bytes(spec, s, 1, False, "none", moe_layer=True) == s * (6 * h + attention + moe_saved)
    assert fused_layer_bytes(spec, s, 2, True, "none", moe_layer=True) == s * (6 * h + attention + moe_saved) / 2
    assert fused_layer_bytes(spec, s, 1, False, "full", moe_layer=True) == 2 * h * s
    traced = _layer(work).activation_bytes_selective  # what it keeps without recomputation, flash attention
    assert fused_layer_bytes(spec, s, 1, False, "none", moe_layer=True) < 0.6 * traced


def test_published_qwen3_30b_a3b_layout_fits_under_megatron_core():
    """Megatron-Bridge's H100 table (26.04, benchmarks/data/published_moe.yaml): Qwen3-30B-A3B on 16 H100s,
    ep16, micro-batch 1, 4096 tokens, FP8, no recomputation (the recipe sets recompute_granularity None) ran,
    so it must be predicted to fit; its MoE kernels' traffic is priced unscaled by the fused-kernel factor."""
    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 1024, nodes=2, framework="megatron-core", seq_length=4096)
    lay = Layout(dp=16, tp=1, pp=1, ep=16, micro_batch=1, global_batch=1024, zero=1, dtype="fp8")
    model = CostModel(work)
    pred = model.evaluate(lay, default_stages(model, lay))
    assert pred.fits, pred.peak_memory_gib
    traced = Workload.create("qwen3-30b-a3b", "dgx-h100", 1024, nodes=2, seq_length=4096,
                             framework=work.framework.replace(moe_kernels="traced"))
    traced_model = CostModel(traced)
    assert traced_model.evaluate(lay, default_stages(traced_model, lay)).iteration_time_s < pred.iteration_time_s


def test_fp8_experts_are_cast_and_kept_as_fp8_copies_under_transformer_engine():
    """TE's GroupedLinear runs the experts in FP8: per token k copies through h -> up and f -> h, inputs kept as
    FP8 (1 byte less each); this executor's stacked experts are not converted (only attention's linears)."""
    from paraplan.models import load_model_spec
    from paraplan.planner import fp8

    spec = load_model_spec("mixtral-8x7b")
    h, f, k, a, kv, d = 4096, 14336, 2, 32, 8, 128
    attention_inputs = h + a * d
    plain = fp8.layer_linears(spec, 1, False, moe_layer=True, experts=False)
    assert plain.saved_inputs == attention_inputs and plain.linears == 2
    te = fp8.layer_linears(spec, 1, False, moe_layer=True, experts=True)
    assert te.saved_inputs == attention_inputs + k * (h + f)
    assert te.grad_outputs == (a + 2 * kv) * d + h + k * (2 * f + h)
    dense = fp8.layer_linears(spec, 1, False, moe_layer=False)  # a dense layer of an MoE model has its MLP
    assert dense.linears == 4


def test_fp8_reaches_the_experts_only_where_the_stack_converts_them():
    """Under --dtype fp8 TE's GroupedLinear runs the routed experts in FP8 (megatron-core); this executor's
    stacked expert weights are not nn.Linear modules, so torchao's float8 conversion leaves them bf16: each
    routed GEMM is then priced at the bf16 rate and nothing else changes."""
    from paraplan.planner import compute

    work = Workload.create("mixtral-8x7b", "dgx-h100", 512, nodes=8)
    gpu = work.cluster.gpu
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=8, dtype="fp8")
    view = moe.rank_view(_layer(work), lay, work.framework, work.spec)
    routed = [f for f, m in zip(view.fwd_ops.gemm_flops, view.fwd_ops.gemm_moe, strict=True) if m == 2]
    assert len(routed) == 3  # one expert per rank (8 / ep 8), its three SwiGLU GEMMs
    fp8 = compute.estimate_pass_times(view, 1, 1, False, gpu, "fp8", "flash", fp8_experts=True)
    bf16 = compute.estimate_pass_times(view, 1, 1, False, gpu, "fp8", "flash", fp8_experts=False)
    gap = sum(compute.gemm_seconds(f, gpu, "bf16") - compute.gemm_seconds(f, gpu, "fp8") for f in routed)
    assert gap > 0
    assert bf16.fwd - fp8.fwd == pytest.approx(gap)
    assert bf16.bwd_weight - fp8.bwd_weight == pytest.approx(gap)  # one weight-gradient GEMM per forward GEMM
    assert not FRAMEWORKS["paraplan"].fp8_experts and FRAMEWORKS["megatron-core"].fp8_experts


def test_megatron_core_mla_keeps_what_its_modules_save():
    """Multi-head latent attention as Megatron-Core builds it (planner/fused_activations.py's mla_bytes), per
    token, with DeepSeek-V3's config.json: h 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
    qk_rope 64, v_head 128. Replicated (split by t under SP): the input norm's input and output, 2 x 2·7168, and
    the two latents before and after their norms, 4 x (1536 + 512) = 36,864 bytes. Sharded over t: query and key
    (128 heads x 192), value and the kernel's output (128 x 128), 2 bytes each = 163,840 bytes. Selective
    recomputation repeats the up-projections (Megatron-Core's mla_up_proj): of the sharded part only the kernel's
    output stays, 2 x 128 x 128 = 32,768 bytes."""
    from paraplan.models import load_model_spec
    from paraplan.planner.fused_activations import fused_layer_bytes, mla_bytes

    spec = load_model_spec("deepseek-v3")
    assert mla_bytes(spec) == (36864, 163840)
    assert mla_bytes(spec, "selective") == (36864, 32768)
    tokens, h = 4096, spec.hidden_size
    # an MoE layer under MLP recomputation adds the pre-MLP norm's input and output (2h each, split by t with SP)
    mlp = fused_layer_bytes(spec, tokens, 2, True, "mlp", moe_layer=True)
    assert mlp == pytest.approx(tokens * (36864 + 4 * h + 163840) / 2)


@pytest.mark.parametrize("pp, recompute", [(8, "mlp"), (16, "none")])
def test_deepseek_v3_published_h100_layouts_fit(pp, recompute):
    """NVIDIA's dgxc-benchmarking DeepSeek-V3 H100 layouts (benchmarks/data/published_moe.yaml: 512 and 1024
    GPUs, dp32 tp2 ep64 mb1, sequence 4096, bf16) ran on 80 GB GPUs, so they must be predicted to fit: the
    1024-GPU one (pp16) without recomputation, the 512-GPU one (pp8, twice the layers per rank) with the MoE
    blocks recomputed (its recipe's recompute_modules include moe)."""
    work = Workload.create("deepseek-v3", "dgx-h100", 4096, nodes=32 * pp // 4, framework="megatron-core")
    lay = Layout(dp=32, tp=2, pp=pp, ep=64, micro_batch=1, global_batch=4096, zero=1, sequence_parallel=True,
                 recompute=recompute)
    model = CostModel(work)
    pred = model.evaluate(lay, default_stages(model, lay))
    assert pred.fits, pred.peak_memory_gib


def test_all_to_all_overlap_prices_a_layout_the_same_whichever_was_priced_first():
    """Whether Megatron-Core's all-to-all overlap applies depends on the layout's schedule and micro-batches (moe.
    a2a_overlap_applies), so block costs cached for one layout must not serve another that differs there: a
    1F1B pipeline (no overlap) priced first must leave an interleaved one's price and bound as a fresh model gives."""
    from paraplan.planner.framework import framework

    work = Workload.create("mixtral-8x7b", "dgx-h100", 256, nodes=8,
                           framework=framework("megatron-core", moe_a2a_overlap=True))
    base = Layout(dp=16, tp=1, pp=4, micro_batch=1, global_batch=256, ep=8, dtype="bf16", zero=1)
    plain, interleaved = base.replace(schedule="1f1b"), base.replace(schedule="interleaved-1f1b", virtual_stages=2)
    assert not moe.a2a_overlap_applies(work.framework, plain) and moe.a2a_overlap_applies(work.framework, interleaved)
    modes = ("none", "full")
    fresh = CostModel(work)
    want = (lower_bound(fresh, interleaved, modes)[0],
            fresh.evaluate(interleaved, default_stages(fresh, interleaved)).iteration_time_s)
    shared = CostModel(work)
    lower_bound(shared, plain, modes)
    shared.evaluate(plain, default_stages(shared, plain))
    got = (lower_bound(shared, interleaved, modes)[0],
           shared.evaluate(interleaved, default_stages(shared, interleaved)).iteration_time_s)
    assert got == want


def test_overlapped_all_to_all_slows_the_compute_it_runs_beside():
    """An all-to-all hidden behind another micro-batch's compute holds COMM_SMS (20: DeepSeek-V3's report, Sec.
    3.2.2) of the GPU's SMs while it runs, so that compute keeps r = 1 - 20/132 of an H100: an exchange of A
    seconds beside C seconds of compute costs A - C where A·r >= C (the compute ends under it), else A·(1 - r)."""
    r = 1 - moe.COMM_SMS / 132
    assert moe.overlapped_exposure(10.0, 2.0, 132) == pytest.approx(8.0)
    assert moe.overlapped_exposure(2.0, 10.0, 132) == pytest.approx(2.0 * (1 - r))
    assert moe.overlapped_exposure(5.0, 5.0 * r, 132) == pytest.approx(5.0 * (1 - r))  # both cases agree there
    assert moe.overlapped_exposure(2.0, 10.0, 0) == 0.0  # no SM count: the exchange hides for free
    assert moe.overlapped_exposure(10.0, 2.0, 0) == pytest.approx(8.0)
    from paraplan.hardware_specs import load_gpu

    assert load_gpu("h100-sxm-80gb").sm_count == 132 and load_gpu("a100-80gb").sm_count == 108


def _fidelity_moe():
    """benchmarks/fidelity_moe.py as a module (it is a script, not a package)."""
    import importlib.util

    from conftest import ROOT

    found = importlib.util.spec_from_file_location("fidelity_moe", ROOT / "benchmarks" / "fidelity_moe.py")
    fid = importlib.util.module_from_spec(found)
    found.loader.exec_module(fid)
    return fid


def test_paired_overlap_efficiency_is_its_fit_rows_and_not_the_shared_experts():
    """PAIRED_OVERLAP_EFFICIENCY is fitted on one published run (benchmarks/fidelity_moe.py FIT): Megatron-Bridge
    26.04's Qwen3-235B-A22B on 256 H100s with its recipe's all-to-all overlap, 77.741 s a step (its table: 1,686
    tokens/s/GPU, 8,192 x 4,096 tokens). It prices that row within 1%; the shared experts' stream
    (moe_shared_expert_overlap) keeps the SM share alone."""
    fid = _fidelity_moe()
    row = {r["id"]: r for r in fid.rows()}["mbridge-26.04-h100-qwen3_235b_a22b-fp8-256gpu"]
    assert row["id"] in fid.FIT
    (lay, pred), why = fid.predict(row)
    assert why == "" and lay.ep == 32 and fid.recipe(row)["moe_a2a_overlap"]
    assert pred.iteration_time_s == pytest.approx(fid.published_step(row), rel=0.01)  # refit where this moves
    assert fid.published_step(row) == pytest.approx(8192 * 4096 / (1686 * 256), rel=1e-3)
    r = 1 - moe.COMM_SMS / 132
    assert moe.shared_expert_exchanges(2.0, (5.0, 5.0), 132) == pytest.approx((2 * 2 * (1 - r), 2 * 2 * (1 - r)))


def test_overlapped_exchanges_pair_with_the_stretches_megatron_schedules_beside_them():
    """Megatron-Core's overlap_moe_expert_parallel_comm (model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.
    run) runs a layer's forward of one micro-batch beside its backward of another in three phases: combine_bwd
    beside pre_dispatch_fwd; dispatch_fwd beside mlp_bwd, then dispatch_bwd beside mlp_bwd_dw + mlp_fwd; combine_fwd
    beside pre_dispatch_bwd. Each exchange hides behind its own stretch only: a long exchange beside a short
    stretch shows even where the opposite pass as a whole would cover it."""
    from paraplan.planner.compute import PassTimes

    # forward 4 ms of which the MoE block 3; backward input 8 (MLP share 3/4: 6, attention 2), weight 4 (MLP 3)
    times = PassTimes(fwd=4.0, bwd_input=8.0, bwd_weight=4.0, core_fwd=0.5, mlp_fwd=3.0)
    eff = moe.PAIRED_OVERLAP_EFFICIENCY
    r = (1 - moe.COMM_SMS / 132) * eff  # the compute's share beside an exchange, the fitted contention too
    ov = lambda a, c: a - c if a * r >= c else a * (1 - r)  # noqa: E731 (overlapped_exposure, spelled out)
    one = 2.5
    fwd, bwd = moe.overlapped_layer_exchanges(one, times, 132)
    assert fwd == pytest.approx(ov(one, 6.0) + ov(one, 2.0))  # dispatch_fwd | mlp_bwd; combine_fwd | pre_dispatch_bwd
    assert bwd == pytest.approx(ov(one, 1.0) + ov(one, 3.0 + 3.0))  # combine_bwd | pre_dispatch_fwd; dispatch_bwd |
    # the attention's 1 ms of forward cannot hide a 2.5 ms combine: 1.5 ms of it shows
    assert ov(one, 1.0) == pytest.approx(1.5)
    # against the whole opposite pass each way (2 x 2.5 ms beside 12 ms and beside 4 ms) less would show
    assert fwd + bwd > moe.overlapped_exposure(2 * one, 12.0, 132, eff) + moe.overlapped_exposure(2 * one, 4.0, 132,
                                                                                                  eff)
    assert moe.overlapped_layer_exchanges(one, None, 132) == (2 * one, 2 * one)  # no compute beside: all shows


def test_warm_up_and_cool_down_passes_run_their_exchanges_alone():
    """Megatron-Core pairs a forward with another micro-batch's backward only in the steady state. Without a
    pipeline (combined_1f1b.py, combined_1f1b_schedule_for_no_pipelining) the first forward and the last backward
    run alone: of m = 8 micro-batches, 7/8 of the passes are paired. Interleaved (schedules.py,
    get_pp_rank_microbatches with the overlap): rank r's warm-up is 2(p - r - 1) + (v - 1)p + 1 forwards, with as
    many cool-down backwards; p 4, v 2, m 8: 11, 9, 7, 5 of each rank's 16 chunk passes, so half of all are paired.
    A block's exchanges then cost that share hidden (overlapped_layer_exchanges) and the rest in full."""
    from paraplan.planner.compute import PassTimes
    from paraplan.planner.framework import framework

    fw = framework("megatron-core", moe_a2a_overlap=True)
    flat = Layout(dp=32, tp=1, pp=1, micro_batch=1, global_batch=256, ep=8, dtype="bf16", zero=1)
    assert moe.paired_share(fw, flat) == pytest.approx(7 / 8)
    deep = Layout(dp=8, tp=1, pp=4, micro_batch=1, global_batch=64, ep=8, dtype="bf16", zero=1,
                  schedule="interleaved-1f1b", virtual_stages=2)
    assert deep.num_micro_batches == 8
    assert moe.paired_share(fw, deep) == pytest.approx(1 - (11 + 9 + 7 + 5) / (4 * 16))
    assert moe.paired_share(fw, deep.replace(global_batch=8)) == 0.0  # m 1: nothing to pair (no overlap at all)
    assert moe.paired_share(framework("megatron-core"), flat) == 0.0  # the overlap off
    # the priced exchanges: the paired share hidden, the rest whole
    work = Workload.create("mixtral-8x7b", "dgx-h100", 64, nodes=8, framework=fw)
    model = CostModel(work)
    layer = next(x for x in work.profile("bf16").layers if moe.is_moe(x))
    place = layout_placement(work.cluster, deep)
    times = PassTimes(fwd=4e-3, bwd_input=8e-3, bwd_weight=4e-3, core_fwd=5e-4, mlp_fwd=3e-3)
    got = moe.layer_cost(model, layer, deep, place, 1.0, "none", times)
    alone = moe.layer_cost(model, layer, deep, place, 1.0, "none", None)  # no compute beside: every exchange whole
    one = alone.bwd / 2
    hidden_fwd, hidden_bwd = moe.overlapped_layer_exchanges(one, times, 132)
    q = moe.paired_share(fw, deep)
    assert got.fwd == pytest.approx(alone.fwd - 2 * one + q * hidden_fwd + (1 - q) * 2 * one)
    assert got.bwd == pytest.approx(q * hidden_bwd + (1 - q) * 2 * one)


def test_shared_experts_run_beside_the_exchanges_where_megatron_overlaps_them():
    """Megatron-Core's moe_shared_expert_overlap (token_dispatcher.py, MoEAlltoAllTokenDispatcher) runs the shared
    experts' first GEMM beside the dispatch all-to-all and their second beside the combine, on a stream of their
    own; the backward keeps the pairing (combine beside the second GEMM's two gradient GEMMs, dispatch beside the
    first's). Each exchange then adds what overlapped_exposure says of it beside its GEMMs. Llama 4 Maverick (h
    5120, one shared expert of 8192, gated: its GEMMs 2·t·5120·16384 and 2·t·8192·5120 FLOPs for t tokens) at
    ep 8: the layer's exchanges cost that, not four whole ones; a model without shared experts, and the switch
    off, keep four whole ones. Megatron-Core refuses the switch beside overlap_moe_expert_parallel_comm, and this
    executor runs neither: both refused in one line."""
    from paraplan.hardware_specs import load_gpu
    from paraplan.planner.compute import gemm_seconds
    from paraplan.planner.framework import framework

    gpu = load_gpu("h100-sxm-80gb")
    fc1, fc2 = moe.shared_expert_gemms(load_model_spec("llama4-maverick"), 4096.0, gpu, "bf16")
    assert fc1 == pytest.approx(gemm_seconds(2 * 4096 * 5120 * 16384, gpu, "bf16"))
    assert fc2 == pytest.approx(gemm_seconds(2 * 4096 * 8192 * 5120, gpu, "bf16"))
    ov = lambda a, c: moe.overlapped_exposure(a, c, 132)  # noqa: E731
    assert moe.shared_expert_exchanges(1e-3, (fc1, fc2), 132) == pytest.approx(
        (ov(1e-3, fc1) + ov(1e-3, fc2), ov(1e-3, 2 * fc2) + ov(1e-3, 2 * fc1)))
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, ep=8, dtype="bf16", zero=1)
    for name, shared in (("llama4-maverick", True), ("mixtral-8x7b", False)):
        costs = {}
        for on in (False, True):
            work = Workload.create(name, "dgx-h100", 64, nodes=1, seq_length=4096,
                                   framework=framework("megatron-core", moe_shared_expert_overlap=on))
            layer = next(x for x in work.profile("bf16").layers if moe.is_moe(x))
            costs[on] = moe.layer_cost(CostModel(work), layer, lay, layout_placement(work.cluster, lay), 1.0, "none")
        one = costs[False].bwd / 2  # without the switch: both backward exchanges whole
        if shared:
            tokens = 4096.0  # one sequence of 4096 on this rank (tp 1)
            gemms = moe.shared_expert_gemms(work.spec, tokens, gpu, "bf16")
            fwd, bwd = moe.shared_expert_exchanges(one, gemms, 132)
            assert costs[True].bwd == pytest.approx(bwd) and costs[True].fwd == pytest.approx(
                costs[False].fwd - 2 * one + fwd)
            assert costs[True].seconds < costs[False].seconds
        else:
            assert costs[True] == costs[False]
    with pytest.raises(PlanError, match="cannot both be on"):
        framework("megatron-core", moe_shared_expert_overlap=True, moe_a2a_overlap=True)
    with pytest.raises(PlanError, match="--moe-shared-expert-overlap"):
        framework("paraplan", moe_shared_expert_overlap=True)


def test_fp8_experts_behind_the_all_to_all_dispatcher_pad_their_tokens():
    """Megatron-Core's grouped FP8 GEMM wants each expert's tokens in multiples of 16 rows: behind the all-to-all
    dispatcher TE's Fp8Padding copies the permuted tokens into a padded buffer and Fp8Unpadding copies the
    outputs back (megatron/core/transformer/moe/experts.py), 2h bytes read and written per routed copy each way,
    so 8kh more per token in each pass; HybridEP pads inside its dispatch, and 16-bit experts need none."""
    from paraplan.models import load_model_spec
    from paraplan.planner import fused_moe

    spec = load_model_spec("qwen3-30b-a3b")
    h, k = spec.hidden_size, spec.top_k
    plain = fused_moe.block_bytes(spec, 8, "alltoall")
    padded = fused_moe.block_bytes(spec, 8, "alltoall", fp8=True)
    assert (padded.fwd - plain.fwd, padded.bwd - plain.bwd, padded.saved) == (8 * k * h, 8 * k * h, plain.saved)
    assert fused_moe.block_bytes(spec, 8, "hybridep", fp8=True) == fused_moe.block_bytes(spec, 8, "hybridep")


def test_fidelity_rows_take_their_own_published_switches():
    """benchmarks/fidelity_moe.py prices a row with the settings it publishes where it does (the model zoo's
    dispatcher per row, its "+1f1b overlap" note, Megatron FSDP as ZeRO-3, its full recomputation), and its
    release's recipe (RECIPES) only where it publishes none; a Llama 4 Maverick row is priced with the 48-layer
    preset (experts in every other layer)."""
    fid = _fidelity_moe()
    rows = {r["id"]: r for r in fid.rows()}
    zoo = "mcore-moe-modelzoo-h100-bf16-qwen3-235b-a22b-256gpu-"
    assert fid.recipe(rows[zoo + "deepep-tp2pp8ep32"]) == dict(moe_dispatcher="hybridep", moe_a2a_overlap=False)
    assert fid.recipe(rows[zoo + "deepep-tp2pp8ep32-1f1b-overlap"]) == dict(moe_dispatcher="hybridep",
                                                                            moe_a2a_overlap=True)
    assert fid.recipe(rows[zoo + "a2a-tp2pp32ep8"])["moe_dispatcher"] == "alltoall"
    fsdp = rows[zoo + "deepep-tp2pp1ep8-fsdp"]
    assert fid.layout_of(fsdp).zero == 3 and fid.layout_of(rows[zoo + "deepep-tp2pp8ep32"]).zero == 1
    (lay, _), why = fid.predict(fsdp)
    assert why == "" and lay.recompute == "full"  # as published ("full"), not the lightest that fits
    assert fid.recipe(rows["mbridge-26.04-h100-qwen3_235b_a22b-fp8-256gpu"]) == {**fid.RECIPES[
        ("qwen3-235b-a22b", 2, 8, 32)], "fp8_recipe": "tensorwise"}  # its release's H100 FP8 recipe: FP8_CS
    # at 25.09 the MoE models' H100 performance matrices list only fp8_cs; bf16 rows have no FP8 recipe
    # 25.09 ran Qwen3 without the all-to-all overlap later recipes turn on (RECIPES_25_09)
    assert fid.recipe(rows["mbridge-25.09-h100-qwen3_235b_a22b-tokendrop-fp8-256gpu"]) == dict(
        grad_reduce_in_fp32=False, fp8_recipe="tensorwise", moe_capacity_factor=1.0, moe_pad_to_capacity=True)
    assert "fp8_recipe" not in fid.recipe(rows["mbridge-26.04-h100-gpt-oss-120b-bf16-64gpu"])
    # GPT-OSS-120B's H100 recipe names its recomputation (layernorm, moe_act); 25.11's table cells (MBS 4) contradict
    # the release's recipe (MBS 1): priced as run
    (lay, _), _ = fid.predict(rows["mbridge-26.04-h100-gpt-oss-120b-bf16-64gpu"])
    assert lay.recompute == "norm+act"
    assert fid.layout_of(rows["mbridge-25.11-h100-gpt-oss-120b-bf16-64gpu"]).micro_batch == 1
    spec, _ = fid.model_of(rows["dgxc-v25.05-llama4-maverick-400b-bf16-512gpu"])
    assert spec.num_layers == 48 and spec.num_moe_layers == 24 and spec.seq_length == 8192
    # NeMo Automodel's rows: its profile, FSDP2 resharding after forward (ZeRO-3) only without a pipeline (at the
    # rows' commit), full-block checkpointing, its configs' EP where the table prints none
    auto = rows["automodel-h100-bf16-deepseek-v3-256gpu"]
    assert fid.recipe(auto) == dict(moe_routing="consecutive") and fid.layout_of(auto).zero == 2
    assert fid.layout_of(rows["automodel-h100-bf16-qwen3-30b-a3b-8gpu"]).zero == 3
    oss = rows["automodel-h100-bf16-gpt-oss-20b-8gpu"]
    (lay, pred), why = fid.predict(oss)
    assert why == "" and lay.recompute == "full" and (lay.ep, lay.zero) == (8, 3)
    from paraplan.planner.api import simulate

    spec, _ = fid.model_of(oss)
    work = Workload.create(spec, "dgx-h100", lay.global_batch, nodes=1, framework="nemo-automodel",
                           moe_routing="consecutive")
    assert pred.iteration_time_s == pytest.approx(simulate(work, lay, event_sim=False)[0].iteration_time_s, rel=1e-12)
    kimi, _ = fid.model_of(rows["automodel-h100-bf16-kimi-k2-256gpu"])
    from paraplan.models.param_count import count_active_parameters, count_parameters

    # Kimi K2: 1T parameters, 32B active (moonshotai/Kimi-K2 README)
    assert count_parameters(kimi) == pytest.approx(1.04e12, rel=0.02)
    assert count_active_parameters(kimi) == pytest.approx(32.6e9, rel=0.02)


def test_token_dropping_caps_the_most_loaded_rank_at_the_capacity():
    """--moe-capacity-factor c (Megatron-Core's moe_expert_capacity_factor): no expert takes more than c times
    its mean share, so the most loaded rank's routed work is min(imbalance, c) times the mean; padded to
    capacity (--moe-pad-to-capacity) it is c exactly, and its all-to-alls carry the padding. Under forced
    balancing (megatron-core's imbalance 1.0) c = 1 prices as dropless; this executor routes dropless only."""
    from paraplan.planner.framework import framework

    core = framework("megatron-core")
    assert moe.routed_load(core) == 1.0
    assert moe.routed_load(core.replace(moe_imbalance=1.25, moe_capacity_factor=1.1)) == 1.1
    assert moe.routed_load(core.replace(moe_imbalance=1.25, moe_capacity_factor=1.5)) == 1.25
    assert moe.routed_load(core.replace(moe_imbalance=1.25, moe_capacity_factor=1.5, moe_pad_to_capacity=True)) == 1.5
    args = ["simulate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
            "--seq-len", "1024", "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1",
            "--zero", "1", "--framework", "megatron-core"]
    plain = run_cli_json(*args)
    same = run_cli_json(*args, "--moe-capacity-factor", "1.0", "--moe-pad-to-capacity")
    assert same["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-12)
    padded = run_cli_json(*args, "--moe-capacity-factor", "1.5", "--moe-pad-to-capacity")
    assert padded["time_s"]["ep_comm"] == pytest.approx(1.5 * plain["time_s"]["ep_comm"], rel=1e-9)
    assert padded["iteration_time_s"] > plain["iteration_time_s"]
    # the padded copies are kept for backward too: each MoE layer's routed part of fused_moe.saved_bytes,
    # k·(2h + 2·up + 4 + 2f) per token, grows by half (the QA's C=3 kept 30 GiB of activations, as dropless)
    from paraplan.planner import fused_moe

    spec = load_model_spec("mixtral-8x7b")
    f, up, _, _ = fused_moe.expert_widths(spec)
    per_copy = spec.top_k * (2 * spec.hidden_size + 2 * up + 4 + 2 * f)
    assert fused_moe.saved_bytes(spec, 1.5) - fused_moe.saved_bytes(spec) == pytest.approx(0.5 * per_copy)
    grown = (padded["memory_gib"]["activations"] - plain["memory_gib"]["activations"]) * 2**30
    tokens = 1024 * spec.num_moe_layers  # one micro-batch in flight (pp 1): its 1,024 tokens through every layer
    assert grown == pytest.approx(0.5 * per_copy * tokens, rel=1e-6)
    p = run_cli(*args[:-2], "--moe-capacity-factor", "1.0")  # --framework paraplan: this executor
    assert p.returncode == 2 and "--moe-capacity-factor" in p.stderr and "dropless" in p.stderr


def test_breakdown_has_no_negative_float_residue_where_only_experts_communicate():
    """tp comm is what the blocks' communication leaves after cp and ep: with tp 1 and ep 8 that is nothing, and
    the breakdown says 0, not -2e-16 (compare printed "tp -2.22e-16")."""
    out = run_cli_json("simulate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "2",
                       "--global-batch", "64", "--seq-len", "1024", "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "8",
                       "--micro-batch", "1", "--zero", "3")
    assert out["time_s"]["ep_comm"] > 0 and all(v >= 0 for v in out["time_s"].values()), out["time_s"]
    assert out["time_s"]["tp_comm"] == 0.0


def test_dropped_tokens_do_no_model_work():
    """With a capacity factor c < 1 the routed experts compute at most c of their tokens: the model FLOPs (and the
    MFU) count that share of their work, 2·s·k·(3·h·f) per MoE layer per sample for Mixtral's SwiGLU experts
    (before, c = 0.1 showed an MFU of 128%)."""
    spec = load_model_spec("mixtral-8x7b")
    lay = Layout(dp=16, tp=1, pp=1, micro_batch=1, global_batch=64, zero=3, ep=8)

    def model_flops(**switches) -> float:
        work = Workload.create("mixtral-8x7b", "dgx-h100", 64, nodes=2, framework="megatron-core", **switches)
        model = CostModel(work)
        pred = model.evaluate(lay, default_stages(model, lay))
        assert pred.mfu < 1
        return pred.model_tflops_per_gpu * 1e12 * pred.iteration_time_s * lay.num_gpus

    routed = 2 * spec.seq_length * spec.top_k * 3 * spec.hidden_size * spec.ffn_hidden_size * spec.num_layers
    dropless, dropping = model_flops(), model_flops(moe_capacity_factor=0.1)
    assert dropless - dropping == pytest.approx(3 * 64 * routed * 0.9, rel=1e-6)


def test_token_destinations_count_the_blocks_a_tokens_experts_fall_in():
    """Uniform routing: the mean number of the g blocks of E/g consecutive experts that k experts drawn at random
    (without replacement) touch, enumerated over every k-subset here; g·(1 - C(E - E/g, k)/C(E, k)) in the code.
    Consecutive routing (NeMo Automodel's FakeBalancedGate: token t takes experts t·k ... t·k + k - 1 mod E):
    Qwen3-30B-A3B's 8 experts of a token lie on one of 8 ranks (16 experts each), DeepSeek-V3's on 2 of 64 (4
    each), Kimi K2's on 1 or 2 of 32 (12 each: 4/3 on average)."""
    for experts, k, groups in ((8, 2, 4), (12, 3, 3), (16, 4, 8)):
        per = experts // groups
        subsets = list(itertools.combinations(range(experts), k))
        exact = sum(len({e // per for e in c}) for c in subsets) / len(subsets)
        assert moe.token_destinations(experts, k, groups) == pytest.approx(exact, rel=1e-12)
    assert moe.token_destinations(128, 8, 8, "consecutive") == 1.0
    assert moe.token_destinations(256, 8, 64, "consecutive") == 2.0
    assert moe.token_destinations(384, 8, 32, "consecutive") == pytest.approx(4 / 3)
    assert moe.token_destinations(256, 8, 1) == moe.token_destinations(256, 8, 1, "consecutive") == 1.0


def test_group_limited_routing_sends_to_fewer_nodes():
    """DeepSeek-V3's node-limited routing (Sec. 2.1.2: "each token will be sent to at most M = 4 nodes"; n_group 8,
    topk_group 4): under force-balanced (i.i.d.) scores the blocks a token's 8 experts reach, sampled by the cost
    model, agree with the executor's router (models.moe.group_limited_topk) drawn here from another seed; with
    every group allowed they are the uniform closed form; a deduplicating dispatch across 8 nodes moves fewer
    bytes over the network. The alltoall dispatcher, one copy per routed expert, is unchanged."""
    import torch

    from paraplan.models.moe import group_limited_topk

    torch.manual_seed(1)
    idx = group_limited_topk(torch.rand(4096, 256), 8, 8, 4)  # (T, 8)
    for blocks in (8, 16, 64):
        drawn = sum(len({min(e // (256 // blocks), blocks - 1) for e in row}) for row in idx.tolist()) / len(idx)
        assert moe.token_destinations(256, 8, blocks, "uniform", (8, 4)) == pytest.approx(drawn, rel=0.02)
        assert moe.token_destinations(256, 8, blocks, "uniform", (8, 4)) < moe.token_destinations(256, 8, blocks)
    assert moe.token_destinations(256, 8, 8, "uniform", (8, 4)) <= 4
    assert moe.token_destinations(256, 8, 8, "uniform", (8, 8)) == \
        pytest.approx(moe.token_destinations(256, 8, 8), rel=0.02)
    assert moe.token_destinations(256, 8, 8, "consecutive", (8, 4)) == moe.token_destinations(256, 8, 8, "consecutive")
    # DeepSeek-V2's group_limited_greedy (160 experts, 8 groups, 3 chosen by their best score, k = 6): the same check
    greedy = group_limited_topk(torch.rand(4096, 160), 6, 8, 3, "max")  # (T, 6)
    drawn = sum(len({e // 20 for e in row}) for row in greedy.tolist()) / len(greedy)
    assert moe.token_destinations(160, 6, 8, "uniform", (8, 3, "max")) == pytest.approx(drawn, rel=0.02)
    assert moe.token_destinations(160, 6, 8, "uniform", (8, 3, "max")) <= 3
    from paraplan.planner.api import simulate

    lay = Layout(dp=64, tp=1, pp=1, ep=64, micro_batch=1, global_batch=64, zero=3, recompute="full")
    v3 = load_model_spec("deepseek-v3")
    sent = {}
    for name, spec in (("limited", v3), ("free", v3.replace(moe_router_num_groups=1, moe_router_group_topk=1))):
        for dispatcher in ("hybridep", "alltoall"):
            work = Workload.create(spec, "dgx-h100", 64, nodes=8, framework="megatron-core",
                                   moe_dispatcher=dispatcher)
            sent[name, dispatcher] = simulate(work, lay, event_sim=False)[0].rank_comm_bytes[0]["all_to_all"]
    assert sent["limited", "alltoall"] == sent["free", "alltoall"]
    ratio = moe.token_destinations(256, 8, 64, "uniform", (8, 4)) / moe.token_destinations(256, 8, 64)
    assert sent["limited", "hybridep"] / sent["free", "hybridep"] == pytest.approx(ratio, rel=1e-3)


def test_deduplicated_dispatch_sends_a_token_once_per_gpu_and_node():
    """DeepEP / HybridEP send a token once to each GPU holding any of its experts (not once per expert), across
    nodes once per node: inside one node, tokens x destinations x (n-1)/n x bytes over NVLink plus its latency."""
    cluster = Workload.create("qwen3-30b-a3b", "dgx-h100", 64).cluster
    from paraplan.planner.placement import consecutive_group

    span = consecutive_group(cluster, 8, 1)
    tokens, token_bytes = 16384, 2048 * 2
    link = cluster.intra_node
    for routing in ("uniform", "consecutive"):
        ranks = moe.token_destinations(128, 8, 8, routing)
        expected = tokens * ranks * token_bytes * 7 / 8 / link.bandwidth_Bps + link.latency_s
        assert moe.deduplicated_dispatch(tokens, token_bytes, 128, 8, span, cluster, 0, routing) == \
            pytest.approx(expected, rel=1e-12)
    args = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
            "--seq-len", "1024", "--dp", "8", "--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1",
            "--zero", "2", "--framework", "nemo-automodel"]
    uniform, consecutive = run_cli_json(*args), run_cli_json(*args, "--moe-routing", "consecutive")
    assert consecutive["time_s"]["ep_comm"] < uniform["time_s"]["ep_comm"] / 3


def test_a_deduplicating_dispatcher_s_bytes_follow_what_it_sends():
    """The all-to-all bytes a prediction reports are the copies it prices: one per routed expert (alltoall), one
    per GPU holding any of a token's experts (hybridep: token_destinations, under the routing); the ratio of the
    two is destinations / k (the small count exchange aside)."""
    args = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "32",
            "--seq-len", "1024", "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "16", "--micro-batch", "2",
            "--zero", "3", "--framework", "nemo-automodel"]
    sent = {}
    for name, extra in (("alltoall", ["--moe-dispatcher", "alltoall"]), ("uniform", []),
                        ("consecutive", ["--moe-routing", "consecutive"])):
        sent[name] = run_cli_json(*args, *extra)["rank_comm_bytes"][0]["all_to_all"]
    for name in ("uniform", "consecutive"):
        assert sent[name] / sent["alltoall"] == pytest.approx(moe.token_destinations(128, 8, 16, name) / 8, rel=1e-3)


def test_nemo_automodel_runs_zero_2_and_3_only():
    """Automodel shards with FSDP2 (reshard_after_forward False or True: ZeRO-2 or 3): the search offers nothing
    else over data parallelism, and a layout asking for ZeRO 0 or 1 there is refused in one line."""
    from paraplan.planner.search import enumerate_layouts

    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, seq_length=8192, nodes=1, framework="nemo-automodel")
    every = enumerate_layouts(work, 8, "bf16")
    assert {x.zero for x in every if x.dp > 1} == {2, 3}
    model = CostModel(work)
    # context parallelism without data parallelism keeps ZeRO 0 (the stages apply over dp, as enumerated): not refused
    alone = [x for x in every if x.dp == 1 and x.cp > 1 and x.schedule == "1f1b"]
    assert alone and all(x.zero == 0 for x in alone)
    validate_layout(model, alone[0])
    p = run_cli("simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
                "--seq-len", "1024", "--dp", "8", "--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1",
                "--zero", "1", "--framework", "nemo-automodel")
    assert p.returncode == 2 and "the nemo-automodel stack runs ZeRO 2 or 3 over data parallelism, not 1" in p.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_nemo_automodel_s_loss_runs_on_the_16_bit_logits(tp):
    """NeMo Automodel's benchmark configs compute the loss on the logits' own dtype (MaskedCrossEntropy with
    fp32_upcast false: F.cross_entropy on the bf16 logits, made whole by DTensor.full_tensor where vocabulary-sharded),
    its recipe keeping the model's output through the backward (memory.loss_bytes): against the same stack with this
    executor's fp32 loss, the head block keeps 2·T·V·(1 - 1/t) bytes more (the whole 16-bit log-probabilities and the
    output, less the fp32 shard the profile saved: nothing more at t = 1, and without a pipeline the fp32 loss keeps
    no logits) and its working set is 4·T·V (two whole 16-bit gradients) where the fp32 loss's is 8·T·V/t (t = 1) or
    12·T·V/t. T tokens a micro-batch, V the vocabulary."""
    automodel = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, seq_length=1024, framework="nemo-automodel")
    upcast = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, seq_length=1024,
                             framework=FRAMEWORKS["nemo-automodel"].replace(loss_logits="fp32"))
    lay = Layout(dp=8 // tp, tp=tp, pp=1, ep=8 // tp, micro_batch=2, global_batch=64, zero=3, recompute="full")
    heads = [CostModel(w).stage_costs(lay, default_stages(CostModel(w), lay))[0] for w in (automodel, upcast)]
    T, V = 2 * 1024, automodel.spec.vocab_size
    assert heads[0].loss_held - heads[1].loss_held == pytest.approx(2 * T * V * (1 - 1 / tp), rel=1e-9)
    assert heads[0].loss_working == pytest.approx(4 * T * V, rel=1e-9)
    assert heads[1].loss_working == pytest.approx((8 if tp == 1 else 12) * T * V / tp, rel=1e-9)


def test_nemo_automodel_s_published_qwen3_30b_run_on_8_gpus_fits():
    """The NeMo Automodel H100 table's Qwen3-30B-A3B row (8 GPUs, ep8, micro-batch 4 of 4,096 tokens, FSDP2 with
    reshard_after_forward, activation checkpointing: benchmarks/data/published_moe.yaml) ran: priced with its 16-bit
    loss it fits (with this executor's fp32 loss, 8·T·V = 18.5 GiB of working set at T = 16,384 and V = 151,936, it
    was priced at 86.7 GiB, out of memory)."""
    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 512, seq_length=4096, framework="nemo-automodel",
                           moe_routing="consecutive")
    model = CostModel(work)
    lay = Layout(dp=8, tp=1, pp=1, ep=8, micro_batch=4, global_batch=512, zero=3, recompute="full")
    pred = model.evaluate(lay, default_stages(model, lay))
    assert pred.fits and pred.peak_memory_gib < 80


def test_hybridep_gathers_every_rank_s_routing_map_each_forward():
    """HybridEP's dispatch (Megatron-Core's flex dispatcher) first all-gathers the ep group's routing maps, one bool
    per token and expert (DeepEP hybrid_ep_buffer.py: all_gather_into_tensor; the backward reuses the handle): ep x
    T x E bytes gathered each forward, again under full recomputation; the all-to-all dispatcher sends none."""
    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, nodes=2, framework="megatron-core",
                           moe_dispatcher="hybridep")
    model, layer = CostModel(work), _layer(work)
    lay = Layout(dp=16, tp=1, pp=1, ep=16, micro_batch=1, global_batch=64, zero=1)
    place = layout_placement(work.cluster, lay)
    tokens = work.tokens_per_sample  # one sequence, tp 1
    expected = 16 * tokens * 128
    assert moe.layer_cost(model, layer, lay, place, 1, "none").traffic["all_gather"] == expected
    assert moe.layer_cost(model, layer, lay, place, 1, "full").traffic["all_gather"] == 2 * expected
    plain = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, nodes=2, framework="megatron-core",
                            moe_dispatcher="alltoall")
    assert "all_gather" not in moe.layer_cost(CostModel(plain), layer, lay, place, 1, "none").traffic


def test_current_scaling_casts_grouped_expert_operands_one_expert_at_a_time():
    """TE's GroupedLinear quantises its per-expert splits one by one under per-tensor current scaling (split_quantize;
    only delayed scaling has the fused multi-tensor cast: transformer_engine/pytorch/csrc/extensions/cast.cpp), three
    kernels each: with E/ep experts on a rank, fc1's and fc2's operands take 2 x (E/ep - 1) casts more per pass
    than one grouped tensor would; delayed scaling's do not grow."""
    from paraplan.planner import fp8
    from paraplan.planner.framework import framework

    spec = load_model_spec("qwen3-30b-a3b")
    kernel, hbm, tokens = 1e-5, 1e12, 4096
    current = framework("megatron-core", fp8_recipe="tensorwise")
    one = fp8.cast_seconds(spec, current, tokens, 1, False, hbm, kernel, True, 1)
    eight = fp8.cast_seconds(spec, current, tokens, 1, False, hbm, kernel, True, 8)
    for f_or_b in (0, 1):  # forward: the inputs; backward: the output gradients
        assert eight[f_or_b] - one[f_or_b] == pytest.approx(2 * 7 * 3 * kernel)
    delayed = framework("megatron-core")
    assert fp8.cast_seconds(spec, delayed, tokens, 1, False, hbm, kernel, True, 8) == \
        fp8.cast_seconds(spec, delayed, tokens, 1, False, hbm, kernel, True, 1)


def test_megatron_core_adds_expert_biases_expert_by_expert():
    """Megatron-Core's TEGroupedMLP._apply_bias (a329dd6d .. 883533e0) adds the second expert linear's bias expert
    by expert, ``cat([t + b * p]).to(dtype)``: per routed copy 28h bytes forward and 40h backward
    (fused_moe.EXPERT_BIAS_BYTES, its docstring counts them), and 2 kernels a local expert + 2 forward, 5 + 2
    backward. Priced on the megatron-core stack only (Framework.moe_bias_per_expert); none without expert biases."""
    from paraplan.planner import fused_moe
    from paraplan.planner.layout import Layout

    spec = load_model_spec("qwen3-30b-a3b")
    biased = spec.replace(expert_bias=True)
    lay = Layout(dp=16, tp=1, pp=1, ep=16, micro_batch=1, global_batch=1024, dtype="bf16")
    fw = FRAMEWORKS["megatron-core"]
    tokens, hbm, kernel = 4096.0, 3.0e12, 4e-6
    plain_f, plain_b = moe.fused_kernel_seconds(spec, lay, fw, tokens, hbm, kernel)
    got_f, got_b = moe.fused_kernel_seconds(biased, lay, fw, tokens, hbm, kernel)
    copies, h, local = tokens * spec.top_k, spec.hidden_size, spec.num_experts // lay.ep
    assert got_f - plain_f == pytest.approx(28 * h * copies / hbm + (2 * local + 2) * kernel)
    assert got_b - plain_b == pytest.approx(40 * h * copies / hbm + (5 * local + 2) * kernel)
    assert fused_moe.expert_bias_bytes(spec) == (0.0, 0.0)
    automodel = FRAMEWORKS["nemo-automodel"]  # its experts' biases: not the per-expert loop
    assert moe.fused_kernel_seconds(biased, lay, automodel, tokens, hbm, kernel) == \
        moe.fused_kernel_seconds(spec, lay, automodel, tokens, hbm, kernel)


def test_simulate_says_when_the_all_to_all_overlap_it_was_given_hides_nothing():
    """--moe-a2a-overlap on a layout Megatron-Core would not overlap (full recomputation, a plain 1F1B pipeline) is
    priced without it, and simulate says so instead of dropping the switch silently (QA round 8)."""
    from paraplan.planner.api import simulate
    from paraplan.planner.framework import framework

    work = Workload.create("mixtral-8x7b", "dgx-h100", 256, nodes=8,
                           framework=framework("megatron-core", moe_a2a_overlap=True))
    base = Layout(dp=16, tp=1, pp=4, micro_batch=1, global_batch=256, ep=8, zero=1, schedule="interleaved-1f1b",
                  virtual_stages=2)
    for lay, silent in ((base, True), (base.replace(recompute="full"), False),
                        (base.replace(schedule="1f1b", virtual_stages=1), False)):
        pred, _ = simulate(work, lay, event_sim=False)
        assert silent == (not any(n.startswith("--moe-a2a-overlap does not apply") for n in pred.notes))


@pytest.mark.parametrize("mode", ["mlp", "full"])
def test_recomputed_flops_are_the_work_done_not_the_busiest_ranks(mode):
    """What recomputation adds to the hardware FLOPs (HFU, the dry run's count) is the work every rank reruns: the
    experts at their balanced load, though their times carry the most loaded rank's imbalance (Framework.moe_imbalance
    1.25 here, moe.rank_view), for the MLP sublayer (mlp) as for the whole layer (full). The times keep it: the MoE
    block's rerun is dearer than its share of the FLOPs."""
    work = Workload.create("mixtral-8x7b", "dgx-h100", 512, nodes=8)
    assert moe.routed_load(work.framework) == 1.25 and moe.routed_work(work.framework) == 1.0
    model = CostModel(work)
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=512, ep=8, recompute=mode)
    place = layout_placement(work.cluster, lay)
    layers = work.profile("bf16").layers
    i = next(j for j, x in enumerate(layers) if x.kind == "transformer_layer")
    ops = layers[i].fwd_ops
    mlp = sum(f for f, x in zip(ops.gemm_flops, ops.gemm_mlp, strict=True) if x)  # the profile's: balanced experts
    cost = model.block_cost(i, lay, place, mode)
    assert cost.recompute_flops == pytest.approx(mlp if mode == "mlp" else layers[i].fwd_flops, rel=1e-12)
    even = dataclasses.replace(work, framework=dataclasses.replace(work.framework, moe_imbalance=1.0))
    balanced = CostModel(even).block_cost(i, lay, place, mode)
    assert balanced.recompute_flops == pytest.approx(cost.recompute_flops, rel=1e-12)
    assert cost.recompute > balanced.recompute * 1.05  # the time: the busiest rank's experts


@pytest.mark.parametrize("framework_name", ["paraplan", "megatron-core"])
def test_full_recomputation_counts_mla_down_projections_where_they_run(framework_name):
    """Full recomputation reruns a layer's forward on each of the t tensor-parallel ranks as it ran. This executor runs
    MLA's replicated down-projections (2·s·h·(1536 + 512 + 64) FLOPs a sample, DeepSeek-V2 Sec. 2.1) whole on every
    rank: the group's rerun FLOPs (what HFU counts) are the layer's forward plus (t - 1) times the down-projections'
    share of it, less the MLP's last GEMM, which its early-stopping checkpoint skips (Framework.recompute_early_stop).
    Megatron-Core runs them on each rank's sequence shard under sequence parallelism: the forward once, no skip."""
    work = Workload.create("deepseek-v3", "dgx-h100", 64, framework=framework_name)
    lay = Layout(dp=32, tp=2, pp=1, micro_batch=1, global_batch=64, recompute="full", sequence_parallel=True)
    layers = work.profile("bf16").layers
    i = next(j for j, x in enumerate(layers) if x.kind == "transformer_layer")  # a dense MLA layer
    ops = layers[i].fwd_ops
    gemms = sum(ops.gemm_flops)
    down = 2 * work.seq_length * 7168 * (1536 + 512 + 64)
    cost = CostModel(work).block_cost(i, lay, layout_placement(work.cluster, lay), "full")
    if framework_name == "megatron-core":
        assert cost.recompute_flops == pytest.approx(layers[i].fwd_flops, rel=1e-12)
        return
    skipped = [f for f, x in zip(ops.gemm_flops, ops.gemm_mlp, strict=True) if x][-1]
    assert skipped == 2 * work.seq_length * 18432 * 7168  # w2: ffn 18432 -> hidden 7168
    assert cost.recompute_flops == pytest.approx(layers[i].fwd_flops * (1 + (lay.tp - 1) * down / gemms) - skipped,
                                                 rel=1e-12)

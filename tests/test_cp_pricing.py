"""Context parallelism in the cost model (planner/context_parallel.py): each rank prices 1/cp of every sequence,
the K/V exchange by framework (all-gather, ring, overlapped all-gather), memory and ZeRO over dp x cp, and the
search's cp degrees. The executor's own trace of cp plans is checked in tests/test_dry_run.py (the spread)."""

from __future__ import annotations

import pytest

from paraplan.hardware_specs import GroupSpan
from paraplan.planner import comm, context_parallel
from paraplan.planner.costmodel import CostModel, default_stages
from paraplan.planner.framework import framework
from paraplan.planner.layout import Layout
from paraplan.planner.memory import state_bytes
from paraplan.planner.placement import cp_group, layout_placement
from paraplan.planner.search import enumerate_layouts
from paraplan.planner.workload import Workload

MODEL = "benchmarks/data/llama-small.yaml"  # h 1024, 16 heads of 64, 8 K/V heads, s 1024
MIB = 2**20


def _model(fw: str = "paraplan", seq: int | None = None) -> CostModel:
    return CostModel(Workload.create(MODEL, "dgx-h100", 64, seq_length=seq, framework=fw))


def _lay(**kw) -> Layout:
    base = dict(dp=1, tp=1, pp=1, cp=2, micro_batch=4, global_batch=64)
    return Layout(**{**base, **kw})


def test_kv_elements_per_token():
    spec = _model().work.spec
    # exchanged: 8 K/V heads x 64 for K and V, over t; saved by attention: repeated to the 16 query heads
    assert context_parallel.kv_elements(spec, 1) == (2 * 8 * 64, 2 * 16 * 64)
    assert context_parallel.kv_elements(spec, 2) == (8 * 64, 16 * 64)


def test_all_gather_form_bytes_time_and_memory():
    """This executor (Llama 3 Sec. 3.3.2): two all-gathers of the whole sequences' K and V, their gradients
    reduce-scattered; the attention kernel keeps the whole K/V (repeated to every head): (1 - 1/cp) of it beyond
    the rank's 1/cp share."""
    model = _model()
    lay = _lay()
    place = layout_placement(model.work.cluster, lay)
    full = 4 * 1024 * (2 * 8 * 64) * 2  # b·s·(K + V elements per token)·2 bytes = 8 MiB
    assert full == 8 * MIB
    nv = model.work.cluster.intra_node
    gather = 2 * ((2 - 1) / 2 * (full / 2) / nv.bandwidth_Bps + (2 - 1) * nv.latency_s)  # ring, K then V
    c = context_parallel.layer_cost(model, lay, place, "none", 2, core_fwd=1.0)
    assert c.traffic == {"all_gather": full, "reduce_scatter": full}
    assert c.fwd == pytest.approx(gather) and c.bwd == pytest.approx(gather)
    assert c.saved_bytes == pytest.approx(4 * 1024 * (2 * 16 * 64) * 2 * (1 - 1 / 2))
    full_rc = context_parallel.layer_cost(model, lay, place, "full", 2, core_fwd=1.0)
    assert full_rc.traffic["all_gather"] == 2 * full and full_rc.bwd == pytest.approx(2 * gather)
    # selective recomputation checkpoints the core alone: it keeps the core's inputs, the same whole K/V, and the
    # gather is not repeated in backward
    sel = context_parallel.layer_cost(model, lay, place, "selective", 2, core_fwd=1.0)
    assert sel.saved_bytes == c.saved_bytes and sel.traffic == c.traffic and sel.bwd == c.bwd


def test_ring_form_hides_behind_attention():
    """Megatron-Core (TE ring, Liu et al. 2023): cp-1 steps each passing a chunk of K/V (backward: K/V and their
    gradients), overlapped with the attention of cp-1 of the cp chunks."""
    model = _model("megatron-core")
    lay = _lay(cp=4)
    place = layout_placement(model.work.cluster, lay)
    chunk = 8 * MIB / 4
    hidden = context_parallel.layer_cost(model, lay, place, "none", 2, core_fwd=1.0)
    assert hidden.fwd == 0.0 and hidden.bwd == 0.0 and hidden.saved_bytes == 0.0
    assert hidden.traffic == {"send_recv": 2 * 3 * chunk + 2 * 2 * 3 * chunk}  # sent + received
    bare = context_parallel.layer_cost(model, lay, place, "none", 2, core_fwd=0.0)
    nv = model.work.cluster.intra_node
    assert bare.fwd == pytest.approx(3 * (nv.latency_s + chunk / nv.bandwidth_Bps))
    assert bare.bwd == pytest.approx(3 * (nv.latency_s + 2 * chunk / nv.bandwidth_Bps))
    sel = context_parallel.layer_cost(model, lay, place, "selective", 2, core_fwd=0.0)
    assert sel.bwd == pytest.approx(bare.bwd + bare.fwd)  # recomputed attention runs the ring again


def test_overlapped_all_gather_form():
    """torch's context_parallel (rotate 'allgather', torchtitan): one all-gather hidden behind the local 1/cp of
    the attention."""
    model = _model("torchtitan")
    lay = _lay()
    place = layout_placement(model.work.cluster, lay)
    gather = 2 * comm.gather(4 * MIB, cp_group(model.work.cluster, lay), model.work.cluster,
                             place.gpus_per_node_busy)
    c = context_parallel.layer_cost(model, lay, place, "none", 2, core_fwd=1e-4)
    assert c.fwd == pytest.approx(max(0.0, gather - 1e-4 / 2))
    assert c.bwd == pytest.approx(max(0.0, gather - 2e-4 / 2))


def test_ring_across_nodes_shares_the_network_among_its_node_leaving_senders():
    """cp 4 at tp 4 on 8-GPU nodes: rings 0-4-8-12 (and 1-5-9-13, ...) leave node 0 from ranks 4-7 alone, so
    each of those 4 senders gets a quarter of the node's network, not an eighth; a step of the ring is then one
    chunk over that share (Megatron-Core's ring, forward with nothing to hide behind)."""
    from paraplan.planner.placement import ring_senders

    model = _model("megatron-core")
    cluster = model.work.cluster
    assert ring_senders(cluster, 4, 4) == 4 and ring_senders(cluster, 2, 4) == 0 and ring_senders(cluster, 2, 8) == 8
    lay = _lay(cp=4, tp=4)
    place = layout_placement(cluster, lay)
    bare = context_parallel.layer_cost(model, lay, place, "none", 2, core_fwd=0.0)
    chunk = 8 * MIB / 4 / 4  # the K/V of one tensor-parallel rank (a quarter of the heads), a quarter of it
    share = comm.network_share(cluster, 4)
    assert bare.fwd == pytest.approx(3 * (share.latency_s + chunk / share.bandwidth_Bps))


def test_cp_group_sits_tp_apart():
    cluster = _model().work.cluster
    assert cp_group(cluster, _lay(cp=2, tp=4)) == GroupSpan(size=2, nodes=1, max_per_node=2)
    # all 8 GPUs of each node are in groups that leave it: they share its network
    assert cp_group(cluster, _lay(cp=4, tp=4)) == GroupSpan(size=4, nodes=2, max_per_node=2, senders_per_node=8)
    # the data-parallel group of a cp layout: its dp x cp ranks
    assert layout_placement(cluster, _lay(dp=2, cp=4, tp=1)).dp.size == 8


def test_a_rank_computes_one_cp_th_of_each_sequence():
    """Every token-wise op runs on s/cp tokens and attention on s/cp queries: under a ring (Megatron-Core) a
    layer's compute and activations with b sequences over cp ranks are those of b/cp sequences without cp. This
    executor's all-gather form keeps the whole sequence's K/V, and its attention takes an explicit mask, which
    no kernel skips the causal half of (context_parallel.attention_work_fraction)."""
    with_cp, without = _lay(cp=2, micro_batch=4), _lay(cp=1, micro_batch=2)
    for fw in ("megatron-core", "paraplan"):
        model = _model(fw)
        cluster = model.work.cluster
        a = model.block_cost(1, with_cp, layout_placement(cluster, with_cp), "none")
        b = model.block_cost(1, without, layout_placement(cluster, without), "none")
        assert a.output_bytes == b.output_bytes  # the pipeline's boundary: the rank's tokens
        assert b.cp_time == 0 and b.cp_send_recv == 0
        if fw == "megatron-core":  # a ring: P2P traffic, mostly hidden behind this layer's attention
            assert a.cp_send_recv > 0
            assert (a.fwd, a.bwd_input, a.bwd_weight) == pytest.approx((b.fwd, b.bwd_input, b.bwd_weight))
            assert a.act_bytes == pytest.approx(b.act_bytes)
        else:
            assert a.cp_time > 0
            assert a.bwd_weight == pytest.approx(b.bwd_weight)  # the linears' weight gradients
            assert a.fwd > b.fwd  # the masked attention does its whole s/cp x s share
            assert a.act_bytes == pytest.approx(b.act_bytes + 4 * 1024 * (2 * 16 * 64) * 2 / 2)  # + whole K/V kept


def test_zero_and_gradients_over_dp_times_cp():
    lay = _lay(dp=2, cp=4, zero=1)
    assert lay.data_ranks == 8
    assert state_bytes(framework("megatron-core"), lay).optimizer == pytest.approx(12 / 8)
    pred = _model().evaluate(lay, default_stages(_model(), lay))
    params = pred.stages[0].params
    # ZeRO 1 in this executor: all-reduce of fp32 gradients over the 8 data ranks, then the owners' broadcasts
    assert pred.rank_comm_bytes[0]["all_reduce"] == pytest.approx(4 * params)
    assert pred.time_s["cp_comm"] > 0


def test_search_enumerates_cp_where_the_sequence_allows():
    short = enumerate_layouts(_model().work, 16, "bf16")
    assert {x.cp for x in short} == {1}  # 1024 tokens: no rank would keep SEARCH_MIN_TOKENS
    long = enumerate_layouts(_model(seq=8192).work, 16, "bf16")
    assert {x.cp for x in long} == {1, 2, 4}  # 8192 / cp >= 2048
    assert all(x.num_gpus == 16 for x in long)
    assert any(x.cp == 4 and x.tp == 2 and x.dp == 2 for x in long)


def test_a_shared_cost_model_prices_each_job_size_on_its_own_groups():
    """Context-parallel groups of 3 ranks, 2 apart, on 8-GPU nodes sit differently in a 12-GPU job than in a 24-GPU
    one (groups are placed within the job's ranks): one cost model pricing both (the scaling chart's re-plans share
    the search's) gives each what a fresh model gives it, in either order."""
    work = Workload.create("llama2-7b", "dgx-h100", 24, seq_length=3072, nodes=3, framework="megatron-core")
    big = Layout(dp=2, tp=2, pp=2, cp=3, micro_batch=1, global_batch=24)
    small = big.replace(dp=1)

    def cp_seconds(model, lay):
        return model.evaluate(lay, default_stages(model, lay)).time_s["cp_comm"]

    fresh = {lay: cp_seconds(CostModel(work), lay) for lay in (big, small)}
    assert fresh[big] != fresh[small]
    for order in ((big, small), (small, big)):
        shared = CostModel(work)
        for lay in order:
            assert cp_seconds(shared, lay) == pytest.approx(fresh[lay], rel=1e-12)

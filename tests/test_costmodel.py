"""Cost-model formulas pinned to their sources, and the simulator against the closed forms."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from conftest import run_cli
from paraplan.hardware_specs import GroupSpan, LinkSpec, load_cluster
from paraplan.models import load_model_spec
from paraplan.planner import comm
from paraplan.planner.api import simulate
from paraplan.planner.costmodel import CostModel, balanced_stages, default_stages
from paraplan.planner.layout import Layout
from paraplan.planner.memory import layer_activation_bytes, model_state_bytes
from paraplan.planner.placement import layout_placement, placement
from paraplan.planner.schedules import closed_form_makespan, in_flight
from paraplan.planner.simulator import build_graph, graph_makespan, simulate_pipeline
from paraplan.planner.workload import Workload
from paraplan.profiler import profile_model

# ---------------- pipeline schedules ----------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32), (4, 3)])
def test_gpipe_1f1b_bubble_fraction(schedule, p, m):
    """Bubble fraction (p-1)/(m+p-1) (Huang et al. 2019 Sec. 2.3; Narayanan et al. 2021 Sec. 2.2.1)."""
    t = 3.0  # forward 1 + backward 2 per stage and micro-batch
    sim = simulate_pipeline(schedule, p, 1, m, [1.0] * p, [2.0] * p, [0.0] * p).makespan
    bubble = (sim - m * t) / sim
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert closed_form_makespan(schedule, p, 1, m, [t] * p, [1.0] * p, [0.0] * p) == pytest.approx(sim)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 12), (8, 2, 16), (2, 4, 8)])
def test_interleaved_bubble_divided_by_v(p, v, m):
    """Interleaved 1F1B: bubble time (p-1)/v x the stage time, i.e. fraction (p-1)/(v m) of the ideal
    (Narayanan et al. 2021, Sec. 2.2.2)."""
    t = 3.0  # one rank's forward+backward per micro-batch over all its v chunks
    n = p * v
    sim = simulate_pipeline("interleaved-1f1b", p, v, m, [1.0 / v] * n, [2.0 / v] * n, [0.0] * n).makespan
    assert (sim - m * t) / (m * t) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                        ("zb-v", 2)])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_factor", [1, 2, 4])
@pytest.mark.parametrize("fbw", [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (0.6, 1.2, 0.9)])
def test_closed_form_agrees_with_simulator_on_uniform_stages(schedule, v, p, m_factor, fbw):
    m = m_factor * p
    f, b, w = fbw
    n = p * v
    sim = simulate_pipeline(schedule, p, v, m, [f] * n, [b] * n, [w] * n).makespan
    closed = closed_form_makespan(schedule, p, v, m, [v * (f + b + w)] * p, [v * f] * p, [v * w] * p)
    assert closed == pytest.approx(sim, rel=0.01)


def _uneven_rounds(p: int, v: int, seed: int) -> tuple[list[float], list[float], list[float]]:
    """Chunks of 2 or 3 layers (forward 1, backward 2 per layer) dealt so that every rank holds the same layers but
    the rounds of chunks differ: the closed form's ranks are alike, the schedule's rounds are not."""
    rng = random.Random(seed)
    layers = [[2] * (v // 2) + [3] * (v - v // 2) for _ in range(p)]  # per rank, its chunks' layers
    for row in layers:
        rng.shuffle(row)
    sizes = [layers[s % p][s // p] for s in range(p * v)]  # stage s = chunk s // p of rank s % p
    return [1.0 * k for k in sizes], [2.0 * k for k in sizes], [0.0] * (p * v)


@pytest.mark.parametrize("p,v,m", [(4, 2, 16), (8, 4, 64), (8, 3, 48), (16, 2, 64)])
def test_interleaved_rounds_of_unequal_chunks_are_priced(p, v, m):
    """Interleaved 1F1B runs its chunks in lock-step rounds: where a round's chunks differ, ranks wait for the slower
    chunks before them even when every rank's chunks sum alike. closed_form_makespan (the ranks' sums) misses it;
    with schedules.rounds_excess (the schedule simulated for 4p micro-batches, its steady state extended to m) the
    closed form comes within 2% under and 1% over the event simulation of all m (the sums alone: 3-13% under), and
    the excess stays within its bounds: at least 0, at most m x (the sum of each round's slowest chunk - the slowest
    rank) and the closed form's bubble."""
    from paraplan.planner.schedules import rounds_excess

    for seed in range(3):
        tf, tb, tw = _uneven_rounds(p, v, seed)
        ranks = [[s for s in range(p * v) if s % p == r] for r in range(p)]
        rank_time = [sum(tf[s] + tb[s] + tw[s] for s in stages) for stages in ranks]
        sums = closed_form_makespan("interleaved-1f1b", p, v, m, rank_time,
                                    [sum(tf[s] for s in stages) for stages in ranks], [0.0] * p)
        excess = rounds_excess(p, v, m, tf, tb, tw, max(rank_time), sums)
        sim = simulate_pipeline("interleaved-1f1b", p, v, m, tf, tb, tw).makespan
        rounds = sum(max(tf[s] + tb[s] for s in range(j * p, (j + 1) * p)) for j in range(v))
        assert sums < sim * 0.98  # what the ranks' sums miss
        assert 0.0 <= excess <= m * (rounds - max(rank_time)) + (p - 1) * rounds
        assert sim * 0.98 <= sums + excess <= sim * 1.01, (seed, sums, excess, sim)


def test_interleaved_rounds_excess_is_nothing_on_alike_rounds():
    """Every round's chunks alike (one stage time per round, or all alike): no excess, the closed form as before
    (so the uniform-stage formulas above hold exactly)."""
    from paraplan.planner.schedules import rounds_excess

    p, v, m = 8, 3, 32
    per_round = [1.0, 2.0, 1.5]
    tf = [per_round[s // p] for s in range(p * v)]
    tb = [2 * x for x in tf]
    assert rounds_excess(p, v, m, tf, tb, [0.0] * (p * v), 3 * sum(per_round), 1.0) == 0.0
    assert rounds_excess(p, v, m, [1.0] * (p * v), [2.0] * (p * v), [0.0] * (p * v), 3.0 * v, 1.0) == 0.0


def test_zero_bubble_v_beats_1f1b_when_passes_balance():
    """ZB-V (Qi et al. 2024, Sec. 6) fills the bubble with deferred weight-gradient passes."""
    p, m = 4, 16
    zbv = simulate_pipeline("zb-v", p, 2, m, [0.5] * 8, [0.5] * 8, [0.5] * 8).makespan
    one = simulate_pipeline("1f1b", p, 1, m, [1.0] * p, [1.0] * p, [1.0] * p).makespan
    assert zbv < one and (zbv - m * 3.0) / (m * 3.0) < 0.5 * (p - 1) / m


def test_simulator_equals_networkx_longest_path_on_uneven_stages():
    rng = random.Random(0)
    for schedule, p, v, m in [("1f1b", 4, 1, 7), ("gpipe", 3, 1, 5), ("interleaved-1f1b", 4, 2, 8), ("zb-v", 3, 2, 7)]:
        n = p * v
        tf, tb, tw = ([rng.uniform(0.2, 2) for _ in range(n)] for _ in range(3))
        fast = simulate_pipeline(schedule, p, v, m, tf, tb, tw).makespan
        assert fast == pytest.approx(graph_makespan(build_graph(schedule, p, v, m, tf, tb, tw)))


def test_simulated_timeline_is_the_task_graphs_earliest_schedule():
    """Each timeline bar is one task of the graph (build_graph), on its stage's rank, starting when its last
    predecessor (its data dependency, its rank's task before) ends and lasting its duration: the chart draws what
    the makespan is made of. The ranks' bars come in their schedule's order, one after another."""
    import networkx as nx

    from paraplan.planner.schedules import stage_rank

    rng = random.Random(3)
    for schedule, p, v, m in [("1f1b", 4, 1, 7), ("gpipe", 3, 1, 5), ("interleaved-1f1b", 4, 2, 8), ("zb-v", 3, 2, 7)]:
        n = p * v
        tf, tb, tw = ([rng.uniform(0.2, 2) for _ in range(n)] for _ in range(3))
        g = build_graph(schedule, p, v, m, tf, tb, tw)
        finish = {}
        for node in nx.topological_sort(g):
            finish[node] = max((finish[q] for q in g.predecessors(node)), default=0.0) + g.nodes[node]["duration"]
        bars = simulate_pipeline(schedule, p, v, m, tf, tb, tw, keep_timeline=True).timeline
        assert len(bars) == g.number_of_nodes()
        for bar in bars:
            task = (bar.kind, bar.stage, bar.micro_batch)
            assert bar.rank == stage_rank(schedule, bar.stage, p)
            assert bar.end == pytest.approx(finish[task])
            assert bar.end - bar.start == pytest.approx(g.nodes[task]["duration"])
        for r in range(p):
            mine = [b for b in bars if b.rank == r]
            assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def test_in_flight_micro_batches():
    """1F1B: stage r holds min(p - r, m) micro-batches (Narayanan et al. 2021); GPipe holds all m;
    interleaved rank 0 holds (v-1)·p + 2(p-1) + 1 chunk-micro-batches (torch's warm-up), i.e.
    Korthikanti et al.'s factor 1 + (p-1)/(p v) on L/p layers' activations."""
    assert [sum(d.values()) for d in in_flight("1f1b", 4, 1, 8)] == [4, 3, 2, 1]
    assert [sum(d.values()) for d in in_flight("gpipe", 4, 1, 8)] == [8] * 4
    p, v = 4, 2
    rank0 = sum(in_flight("interleaved-1f1b", p, v, 16)[0].values())
    assert rank0 == (v - 1) * p + 2 * (p - 1) + 1
    assert rank0 / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


# ---------------- communication ----------------

LINK = LinkSpec(name="x", kind="x", bandwidth_GBps=100.0, latency_us=0.0)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_all_reduce_formula(n):
    """Ring all-reduce moves 2(n-1)/n x M per rank (Patarasuk & Yuan 2009); all-gather (n-1)/n x M."""
    m = 1e9
    assert comm.ring_all_reduce(m, n, LINK) == pytest.approx(2 * (n - 1) / n * m / 100e9)
    assert comm.ring_gather(m, n, LINK) == pytest.approx((n - 1) / n * m / 100e9)
    lat = LinkSpec(name="y", kind="y", bandwidth_GBps=1e9, latency_us=10.0)
    assert comm.ring_all_reduce(1.0, n, lat) == pytest.approx(2 * (n - 1) * 10e-6, rel=1e-3)


def test_hierarchical_all_reduce_across_nodes():
    """Across nodes: reduce-scatter and all-gather inside each node, then r parallel rings across
    nodes on 1/r of the data, each GPU with its share of the node's NICs."""
    c = load_cluster("dgx-h100", nodes=4)
    span = GroupSpan(size=32, nodes=4, max_per_node=8)
    m = 8e9
    intra = c.intra_node.bandwidth_Bps
    share = c.inter_node.bandwidth_Bps / 8
    expected_bw = 2 * (7 / 8) * m / intra + 2 * (3 / 4) * (m / 8) / share
    got = comm.all_reduce(m, span, c, busy=8)
    assert got == pytest.approx(expected_bw, rel=0.01)  # latency is microseconds against seconds


def test_placement_keeps_tp_inside_a_node():
    c = load_cluster("dgx-a100-80gb", nodes=8)
    pl = placement(c, dp=8, tp=8, pp=1)
    assert not pl.tp.crosses_nodes and pl.dp.crosses_nodes and pl.dp.max_per_node == 1
    pl = placement(c, dp=2, tp=4, pp=8)
    assert not pl.tp.crosses_nodes and not pl.dp.crosses_nodes and pl.pp_cross_node


def test_groups_that_straddle_nodes_are_priced_by_the_worst(write):
    """tp 4 on 6-GPU nodes: ranks 4-7 span two nodes (2 + 2) while 0-3 do not; each kind of group is priced by
    its worst-placed one, with the node's network shared by the GPUs in groups that leave it (2 of 6), so the
    tensor-parallel time is that of a cluster of 2-GPU nodes (every group 2 + 2, 2 senders a node)."""
    from paraplan.planner.placement import consecutive_group

    links = "intra_node: {bandwidth_GBps: 450, latency_us: 2}\ninter_node: {bandwidth_GBps: 12.5, latency_us: 10}\n"
    files = [write(f"{name}.yaml", f"name: {name}\ngpu: h100-sxm-80gb\nnodes: {n}\ngpus_per_node: {g}\n{links}")
             for name, n, g in (("odd6", 4, 6), ("two2", 12, 2))]
    odd, pairs = (load_cluster(f) for f in files)
    pl = placement(odd, dp=6, tp=4, pp=1)
    assert pl.tp == GroupSpan(size=4, nodes=2, max_per_node=2, senders_per_node=2)
    assert pl.dp.size == 6 and pl.dp.crosses_nodes
    assert consecutive_group(odd, 4) == pl.tp  # expert-parallel groups of 4: the same worst group
    assert not consecutive_group(odd, 4, world=4).crosses_nodes  # a 4-GPU job has no group on ranks 4-7
    m = 1e9
    assert comm.all_reduce(m, pl.tp, odd, busy=6) == comm.all_reduce(m, placement(pairs, 6, 4, 1).tp, pairs, busy=2)
    aligned = placement(load_cluster("dgx-a100-80gb", nodes=8), dp=8, tp=8, pp=1)
    assert aligned.dp.senders_per_node == 8  # every GPU's group leaves its node: all share the network
    # end to end: simulate prices the straddling groups (they were priced as if inside a node)
    sim = lambda c: json.loads(run_cli("simulate", "--model", "llama2-13b", "--cluster", c, "--global-batch", "96",
                                       "--dp", "6", "--tp", "4", "--pp", "1", "--micro-batch", "1", "--zero", "1",
                                       "--sequence-parallel", "--json").stdout)["time_s"]["tp_comm"]
    assert sim(files[0]) == pytest.approx(sim(files[1]), rel=1e-9)


def test_a_group_split_unevenly_is_paced_by_its_emptiest_node(write):
    """dp 5 on 4-GPU nodes: ranks 0-3 on one node, rank 4 alone on the next. Across nodes each node's ranks carry
    1/(its ranks) of the data, the lone rank all of it: the all-reduce takes at least as long as one between two
    lone ranks on those nodes (it was priced as if each node carried a quarter)."""
    links = "intra_node: {bandwidth_GBps: 450, latency_us: 2}\ninter_node: {bandwidth_GBps: 50, latency_us: 5}\n"
    c = load_cluster(write("quad.yaml", f"name: quad\ngpu: h100-sxm-80gb\nnodes: 2\ngpus_per_node: 4\n{links}"))
    span = placement(c, dp=5, tp=1, pp=1).dp
    assert (span.size, span.nodes, span.max_per_node, span.fewest_per_node) == (5, 2, 4, 1)
    m = 1e9
    lone = dataclasses.replace(span, size=2, max_per_node=1, min_per_node=0)
    assert comm.all_reduce(m, span, c, busy=4) >= comm.all_reduce(m, lone, c, busy=4)
    assert comm.gather(m, span, c, busy=4) >= comm.gather(m, lone, c, busy=4)
    even = placement(c, dp=8, tp=1, pp=1).dp  # 4 + 4: a quarter each
    assert even.min_per_node == 0 and even.fewest_per_node == 4
    assert comm.all_reduce(m, even, c, busy=4) < comm.all_reduce(m, lone, c, busy=4)


def test_pipeline_boundaries_are_priced_each_as_placed(write):
    """tp 2, pp 8 on 8-GPU nodes: four stages a node; only the boundary between stages 3 and 4 leaves the node
    (ranks 6, 7 send to 8, 9), and the interleaved schedule's wrap from rank 7 back to rank 0. Stage 3 sends its
    output across nodes and its gradient back over NVLink, stage 4 the reverse; every other send stays on NVLink.
    A send across shares the node's network with the 2 ranks sending out of it at once."""
    links = "intra_node: {bandwidth_GBps: 450, latency_us: 2}\ninter_node: {bandwidth_GBps: 50, latency_us: 5}\n"
    eight = load_cluster(write("eight8.yaml", f"name: eight8\ngpu: h100-sxm-80gb\nnodes: 2\ngpus_per_node: 8\n{links}"))
    pl = placement(eight, dp=1, tp=2, pp=8)
    assert pl.pp_crossings == (False, False, False, True, False, False, False, True)
    assert pl.pp_cross_node and pl.pp_senders_per_node == 2
    assert pl.crosses(3, 4) and pl.crosses(4, 3) and pl.crosses(7, 0) and not pl.crosses(2, 3)
    assert not placement(eight, dp=1, tp=2, pp=4).pp_cross_node  # 8 GPUs: one node
    # 6-GPU nodes, 4 ranks a stage, 3 stages: ranks 2-5 send to 6-9 on the next node (4 senders on node 0)
    odd = load_cluster(write("odd6.yaml", f"name: odd6\ngpu: h100-sxm-80gb\nnodes: 2\ngpus_per_node: 6\n{links}"))
    assert placement(odd, dp=2, tp=2, pp=3).pp_senders_per_node == 4
    model = CostModel(Workload.create("llama2-7b", eight, global_batch=16))
    lay = Layout(dp=1, tp=2, pp=8, micro_batch=1, global_batch=16, schedule="1f1b")
    stages = default_stages(model, lay)
    costs = model.stage_costs(lay, stages)
    table = model.block_table(lay, pl, "none")
    assert len({table.costs[b[-1]].output_bytes for b in stages[:-1]}) == 1  # every boundary: the hidden states
    nbytes = table.costs[stages[0][-1]].output_bytes
    near, far = comm.p2p(nbytes, False, eight, 2), comm.p2p(nbytes, True, eight, 2)
    assert far > 5 * near
    fwd = [c.p2p_fwd for c in costs]
    bwd = [c.p2p_bwd for c in costs]
    assert fwd == pytest.approx([near, near, near, far, near, near, near, 0.0])
    assert bwd == pytest.approx([0.0, near, near, near, far, near, near, near])


def test_parameter_server_grows_with_workers_ring_stays_flat():
    """PS (Li et al. 2014): a server moves workers·M/k each way; ring all-reduce 2(n-1)/n·M."""
    c = load_cluster("dgx-h100", nodes=16)
    m = 1e9
    ps = [comm.parameter_server_sync(m, n, 1, c, all_in_one_node=False, worker_busy=8) for n in (8, 32, 128)]
    rings = [comm.all_reduce(m, GroupSpan(n, n // 8, 8), c, busy=8) for n in (32, 64, 128)]
    assert ps[2] > 10 * ps[0]  # 16x the workers: ~16x the time through one server
    assert max(rings) < 1.2 * min(rings)  # 4x the workers: (k-1)/k of the bandwidth term only
    assert comm.parameter_server_sync(m, 32, 4, c, False, 8) < comm.parameter_server_sync(m, 32, 1, c, False, 8)


# ---------------- memory ----------------


def test_zero_model_states_match_rajbhandari_figure_1():
    """ZeRO (Rajbhandari et al. 2020), Fig. 1: Ψ = 7.5B parameters, N_d = 64, K = 12:
    baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    psi, nd = 7.5e9, 64
    totals = [sum(model_state_bytes(psi, "bf16", z, nd)) / 1e9 for z in (0, 1, 2, 3)]
    assert totals == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)
    w, g, o = model_state_bytes(psi, "fp32", 0, 1)
    assert (w, g, o) == (4 * psi, 4 * psi, 8 * psi)


@pytest.fixture(scope="module")
def gpt_layer():
    prof = profile_model(load_model_spec("gpt3-1.3b"), "meta", micro_batch=1, dtype="fp16")
    return prof.layers[1]


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_six_activation_cases(gpt_layer, t):
    """Korthikanti et al. 2022, Table 2 (bytes per layer, fp16, 1-byte dropout masks); the paper
    ignores LayerNorm statistics (2 x 2 x 4·s·b bytes here, replicated)."""
    spec = load_model_spec("gpt3-1.3b")
    s, h, a = spec.seq_length, spec.hidden_size, spec.num_attention_heads
    b = 2
    sbh = s * b * h
    ln = 2 * 2 * 4 * s * b
    act = lambda sp, rec: layer_activation_bytes(gpt_layer, b, t, sp, rec, "unfused")
    if t == 1:
        assert act(False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h) + ln)
    assert act(False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)) + ln)
    if t > 1:
        assert act(True, "none") == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)) + ln / t)
        assert act(True, "selective") == pytest.approx(sbh * 34 / t + ln / t)
    assert act(False, "selective") == pytest.approx(sbh * (10 + 24 / t) + ln)
    assert layer_activation_bytes(gpt_layer, b, 1, False, "full", "unfused") == pytest.approx(2 * sbh)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_a_flash_layer_keeps_what_is_priced(name):
    """One transformer layer run forward on the CPU (bf16, the fused attention kernel, real tensors): the bytes of
    the distinct tensors autograd saves for its backward, the weights apart, are the price of a layer without
    recomputation (memory.layer_activation_bytes) and the kernel's log-sum-exp (at most b·a·s fp32), which the price
    leaves out. The kernel saves its output, and the output projection its input: one tensor (the kernel writes
    (b, s, a, d) and returns it transposed, so the layer's transpose-and-reshape is a view); priced twice before
    this stop, 5% of llama-tiny's layer. One sample: the rotary tables a llama layer saves (4·s·d 16-bit, whatever
    the micro-batch) are priced per sample, b times (0.5% of a llama2-70b layer at b = 1)."""
    import torch

    from paraplan.models.transformer import TransformerLayer

    spec = load_model_spec(name)
    b, s = 1, spec.seq_length
    layer = TransformerLayer(spec).to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)  # (b, s, h)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    profile = profile_model(spec, "meta", micro_batch=1, dtype="bf16").layers[1]
    unpriced = sum(saved.values()) - layer_activation_bytes(profile, b, 1, False, "none", "flash")
    assert 0 < unpriced <= b * spec.num_attention_heads * s * 4  # the log-sum-exp


# ---------------- whole predictions ----------------


def _predict(model, cluster, gb, nodes=None, framework="paraplan", **layout):
    work = Workload.create(model, cluster, gb, nodes=nodes, framework=framework)
    lay = Layout(global_batch=gb, **layout)
    return simulate(work, lay)[0], work


def test_mfu_and_hfu_follow_korthikanti_appendix_a():
    """Model FLOPs 72·B·L·s·h²(1 + s/(6h) + V/(12hL)) (Korthikanti et al. 2022, Eq. 7; MFU and HFU as in
    Chowdhery et al. 2022: FLOPs / (iteration time x GPUs x peak)).

    Hardware FLOPs add the recomputed forward work (DESIGN.md): selective recomputation repeats
    QK^T and the attention-weighted V, 4·b·s²·h per layer and micro-batch. (Korthikanti's Eq. 8,
    72·B·L·s·h²(1 + s/(3h) + ...), adds 12·B·L·s²·h, three times that forward work; we count the
    forward work once, as the definition says.)"""
    pred, work = _predict("gpt3-1.3b", "dgx-a100-80gb", 32, nodes=1, dp=2, tp=2, pp=2, micro_batch=2,
                          recompute="selective")
    spec = work.spec
    B, L, s, h, V = 32, spec.num_layers, spec.seq_length, spec.hidden_size, spec.vocab_size
    model = 72 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    hw = model + 4 * B * s * s * h * L
    denom = pred.iteration_time_s * 8 * 312e12
    assert pred.mfu == pytest.approx(model / denom, rel=1e-6)
    assert pred.hfu == pytest.approx(hw / denom, rel=1e-6)
    # Narayanan et al. 2021 Eq. 3 counts Megatron's full recomputation: 96·B·s·l·h²(1 + s/(6h) + V/(16lh)).
    nar = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    for framework, skipped in (("megatron-2021", 0), ("paraplan", 8 * B * s * L * h * h)):
        # this executor's early-stopping checkpoint does not rerun the MLP's down projection: 2·s·4h·h FLOPs per
        # layer and sample (tests/test_executor_units.py counts the matmuls it reruns)
        full, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 32, nodes=1, framework=framework, dp=2, tp=2, pp=2,
                           micro_batch=2, recompute="full")
        done = full.hardware_tflops_per_gpu * 1e12 * full.iteration_time_s * 8
        assert done == pytest.approx(nar - skipped, rel=1e-6)


def test_175b_replicated_does_not_fit_and_says_so():
    pred, _ = _predict("gpt3-175b", "dgx-a100-80gb", 8, dp=8, tp=1, pp=1, micro_batch=1)
    assert not pred.fits and pred.peak_memory_gib > 16 * 174e9 / 2**30 / 1.01


@pytest.mark.parametrize("framework_name, sp, expected", [
    # Megatron-Core (multi_latent_attention.py): duplicated down-projections on the sequence shard; the
    # column-parallel up-projections gather the latents (SP) and reduce their gradients (RS with SP, AR without)
    ("megatron-core", True, [("all_gather", "fwd", "L"), ("reduce_scatter", "fwd", "O"), ("all_gather", "bwd", "O"),
                             ("reduce_scatter", "bwd", "L")]),
    ("megatron-core", False, [("all_reduce", "fwd", "O"), ("all_reduce", "bwd", "L")]),
    # this executor (executor/tensor_parallel.py): the hidden gathered, the latents' gradients all-reduced
    ("paraplan", True, [("all_gather", "fwd", "I"), ("reduce_scatter", "fwd", "O"), ("all_gather", "bwd", "O"),
                        ("all_reduce", "bwd", "L")]),
    # torchtitan's NoParallel down-projections: the input's gradient reduced at the hidden width, as any region
    ("torchtitan", True, [("all_gather", "fwd", "I"), ("reduce_scatter", "fwd", "O"), ("all_gather", "bwd", "O"),
                          ("reduce_scatter", "bwd", "I")]),
])
def test_mla_attention_region_collectives(framework_name, sp, expected):
    """DeepSeek-V3's MLA attention under tensor parallelism: the input side of its region moves the latents
    (q_lora_rank 1536 + kv_lora_rank 512 + rope 64 = 2112 per token, against the hidden 7168) where the stack
    reduces them there (Framework.mla_tp_input)."""
    work = Workload.create("deepseek-v3", "dgx-h100", 64, framework=framework_name)
    model = CostModel(work)
    layer = next(x for x in work.profile("bf16").layers if x.kind == "transformer_layer")
    _, ib, ob, _ = next(r for r in layer.region_io if r[0] == "region")
    size = {"I": ib, "O": ob, "L": ib * 2112 / 7168}
    got = [(c.op, c.phase, c.bytes) for c in model._tp_collectives(layer, sp)][:len(expected)]
    assert got == [(op, phase, pytest.approx(size[k])) for op, phase, k in expected]


def test_mla_up_projection_recomputation_reruns_the_latents_gather():
    """Megatron-Core's selective recomputation of MLA (recompute_modules mla_up_proj) checkpoints the up-projections,
    whose column-parallel linears all-gather the latents under sequence parallelism: the backward runs that gather
    again (tensor-parallel bytes grow by the latents, 2112 of every token's 7168 hidden), this executor's
    prologue recomputation does not (the hidden is gathered before its checkpoint)."""
    for name, extra in (("megatron-core", 2112 / 7168), ("paraplan", 0.0)):
        work = Workload.create("deepseek-v3", "dgx-h100", 64, framework=name)
        model = CostModel(work)
        lay = Layout(dp=4, tp=2, pp=1, micro_batch=1, global_batch=64, sequence_parallel=True)
        place = layout_placement(work.cluster, lay)
        i = next(j for j, x in enumerate(work.profile("bf16").layers) if x.kind == "transformer_layer")
        plain, selective = (model.block_cost(i, lay, place, mode).tp_traffic for mode in ("none", "selective"))
        _, ib, _, _ = next(r for r in work.profile("bf16").layers[i].region_io if r[0] == "region")
        assert selective[1] - plain[1] == pytest.approx(extra * ib, rel=1e-9)  # all_gather (TP_KINDS order)
        assert (selective[0], selective[2]) == (plain[0], plain[2])


@pytest.mark.parametrize("sp", [True, False])
def test_mla_down_projections_are_divided_only_on_the_sequence_shard(sp):
    """MLA's down-projections (wq_a: h -> q_lora_rank; wkv_a: h -> kv_lora_rank + rope; DeepSeek-V2 Sec. 2.1) stay
    replicated under tensor parallelism: the profile leaves their 2·s·h·1536 and 2·s·h·(512 + 64) forward FLOPs a
    sample undivided. Megatron-Core's duplicated linears run on each rank's sequence shard under sequence parallelism
    (Framework.mla_tp_input "latent"): each GEMM, forward and both backward ones, priced at 1/tp of its FLOPs; without
    sequence parallelism, and in this executor and torchtitan (the hidden gathered first), whole."""
    from paraplan.planner.compute import gemm_seconds

    work = Workload.create("deepseek-v3", "dgx-h100", 64, framework="megatron-core")
    layers = work.profile("bf16").layers
    i = next(j for j, x in enumerate(layers) if x.kind == "transformer_layer")  # a dense MLA layer
    ops = layers[i].fwd_ops
    s, h = work.seq_length, 7168
    marks = ops.gemm_moe or [0] * len(ops.gemm_flops)
    replicated = [f for f, sharded, m in zip(ops.gemm_flops, ops.gemm_sharded, marks, strict=True)
                  if not sharded and not m]
    assert sorted(replicated) == sorted([2 * s * h * 1536, 2 * s * h * (512 + 64)])
    lay = Layout(dp=32, tp=2, pp=1, micro_batch=1, global_batch=64, sequence_parallel=sp)
    place = layout_placement(work.cluster, lay)
    whole = dataclasses.replace(work, framework=dataclasses.replace(work.framework, mla_tp_input="mixed"))
    mega, executor = (CostModel(w)._block_base(i, lay, place)[1] for w in (work, whole))
    gap = sum(gemm_seconds(f, work.cluster.gpu, "bf16") - gemm_seconds(f / 2, work.cluster.gpu, "bf16")
              for f in replicated) if sp else 0.0
    assert gap >= 0
    for part in ("fwd", "bwd_input", "bwd_weight"):
        assert getattr(executor, part) - getattr(mega, part) == pytest.approx(gap, rel=1e-9, abs=1e-15)


def test_gradients_netted_against_the_first_backward_say_so():
    """With one micro-batch the activation peak comes before any gradient exists: the breakdown shows only the
    gradients beyond the activations the first backward frees (memory.rank_memory) — a small or zero "grads" that
    reads like a bug unless the prediction says why. With gradients accumulated from earlier micro-batches the
    breakdown holds them whole and no such note is given."""
    one, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 16, nodes=2, dp=16, tp=1, pp=1, micro_batch=1)
    many, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 128, nodes=2, dp=16, tp=1, pp=1, micro_batch=1)
    netted = [n for n in one.notes if "first backward frees" in n]
    assert len(netted) == 1 and f"grads {one.memory_gib['grads']:.1f} GiB" in netted[0]
    assert one.memory_gib["grads"] < many.memory_gib["grads"]
    assert not any("first backward frees" in n for n in many.notes)
    # Megatron's gradient buffer exists from the wrap on (param_and_grad_buffer.py): whole at every peak, no note
    mega, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 16, nodes=2, dp=16, tp=1, pp=1, micro_batch=1,
                       framework="megatron-core")
    mega_many, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 128, nodes=2, dp=16, tp=1, pp=1, micro_batch=1,
                            framework="megatron-core")
    assert mega.memory_gib["grads"] == pytest.approx(mega_many.memory_gib["grads"]) and mega.memory_gib["grads"] > 0
    assert not any("first backward frees" in n for n in mega.notes)


def test_gradient_accumulation_syncs_once_per_iteration():
    """One gradient all-reduce per iteration whatever the micro-batch count (issue 4)."""
    a, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 16, nodes=2, dp=16, tp=1, pp=1, micro_batch=1)
    b, _ = _predict("gpt3-1.3b", "dgx-a100-80gb", 128, nodes=2, dp=16, tp=1, pp=1, micro_batch=1)
    assert b.time_s["compute"] == pytest.approx(8 * a.time_s["compute"], rel=0.01)
    assert b.time_s["dp_comm"] <= a.time_s["dp_comm"] * 1.0001


SLOW_NET = """name: slow
gpu: a100-80gb
nodes: 8
gpus_per_node: 1
intra_node: {bandwidth_GBps: 300, latency_us: 0}
inter_node: {bandwidth_GBps: 0.05, latency_us: 0}
"""


def test_zero3_moves_one_and_a_half_times_plain_dp(write):
    """ZeRO-3: all-gather parameters in forward and backward, reduce-scatter gradients = 1.5x the
    all-reduce volume (Rajbhandari et al. 2020, Sec. 7.2.2). Priced without overlap on a network so
    slow that compute hides nothing, so the exposed times compare as the volumes do."""
    work = Workload.create("gpt3-1.3b", write("slow.yaml", SLOW_NET), 8, framework="megatron-2021")
    model = CostModel(work)
    times = {}
    for z in (0, 3):
        lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=8, zero=z)
        times[z] = model.evaluate(lay, default_stages(model, lay)).time_s["dp_comm"]
    assert times[3] / times[0] == pytest.approx(1.5, rel=0.02)


def test_executor_zero3_moves_what_its_all_reduce_moves(write):
    """This executor (executor/data_parallel.py) reduces gradients in fp32 but gathers bf16 weights: ZeRO-3's
    reduce-scatter (4 B) and two all-gathers (2 x 2 B) per parameter carry what the fp32 all-reduce of
    ZeRO-0 carries (2 x 4 B: ring reduce-scatter + all-gather), so on a network that hides nothing the
    two take the same time (one micro-batch)."""
    work = Workload.create("gpt3-1.3b", write("slow.yaml", SLOW_NET), 8, overlap_dp=False)
    model = CostModel(work)
    times = {}
    for z in (0, 3):
        lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=8, zero=z)
        times[z] = model.evaluate(lay, default_stages(model, lay)).time_s["dp_comm"]
    assert times[3] / times[0] == pytest.approx(1.0, rel=0.02)


def test_balanced_stages_minimise_the_heaviest():
    w = [5, 1, 1, 1, 1, 1, 5]
    st = balanced_stages(w, 3)
    assert [i for s in st for i in s] == list(range(7)) and max(sum(w[i] for i in s) for s in st) == 5
    assert len(balanced_stages([1.0] * 4, 4)) == 4


def test_balanced_split_against_every_split():
    """On random small instances the bottleneck split's heaviest stage is the least of all contiguous splits
    (to the binary search's 1e-6), and it covers every block once in k non-empty stages."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        w = [rng.choice([rng.random(), 1.0, 0.5, 2.0]) for _ in range(n)]
        best = min(max(sum(w[a:b]) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                   for cuts in itertools.combinations(range(1, n), k - 1))
        split = balanced_stages(w, k)
        assert [i for s in split for i in s] == list(range(n)) and len(split) == k and all(split)
        assert max(sum(w[i] for i in s) for s in split) <= best * (1 + 2e-6)


def test_uneven_stages_event_simulation_beats_nothing_closed_form_on_uniform():
    work = Workload.create("gpt-tiny", "local", 8)
    model = CostModel(work)
    lay = Layout(dp=1, tp=1, pp=2, micro_batch=1, global_batch=8, schedule="1f1b", dtype="fp32")
    even = [[0, 1, 2], [3, 4, 5]]
    uneven = [[0, 1, 2, 3, 4], [5]]
    a = model.evaluate(lay, even, simulate=True).iteration_time_s
    b = model.evaluate(lay, uneven, simulate=True).iteration_time_s
    assert b > a  # four layers on one stage are slower than two and two


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_stage_costs_are_each_stages_own_and_count_every_send_twice(schedule, v):
    """A stage's costs depend on its own blocks, mode and sender only: a split priced after many others (its stages
    reused from them) equals the same split priced by a fresh model; the blocks' sums add up to the whole model's,
    and every boundary between stages on different ranks is counted on both sides, 2 x its bytes each (the
    activation one way, its gradient back)."""
    work = Workload.create("llama2-7b", "dgx-h100", 64)
    lay = Layout(dp=4, tp=2, pp=4, virtual_stages=v, micro_batch=1, global_batch=64, schedule=schedule, dtype="bf16")
    n, stages_n = len(work.profile("bf16").layers), lay.num_stages
    rng = random.Random(1)
    used = CostModel(work)
    splits = []
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, n), stages_n - 1))
        splits.append(([list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n], strict=True)],
                       [rng.choice(("none", "selective", "full")) for _ in range(stages_n)]))
    for stages, modes in splits:
        used.stage_costs(lay, stages, modes)
    stages, modes = splits[-1]
    assert used.stage_costs(lay, stages, modes) == CostModel(work).stage_costs(lay, stages, modes)
    costs = CostModel(work).stage_costs(lay, stages, ["none"] * stages_n)
    whole = CostModel(work).stage_costs(lay.replace(pp=1, dp=16, virtual_stages=1, schedule="1f1b"),
                                        [list(range(n))], ["none"])[0]
    assert sum(c.fwd for c in costs) == pytest.approx(whole.fwd)
    assert sum(c.params for c in costs) == pytest.approx(whole.params)
    table = CostModel(work).block_table(lay, placement(work.cluster, 4, 2, 4), "none")
    across = [s for s in range(stages_n - 1) if costs[s].rank != costs[s + 1].rank]
    expected = 4 * sum(table.costs[stages[s][-1]].output_bytes for s in across)
    assert sum(c.p2p_bytes for c in costs) == pytest.approx(expected)  # cp = 1: no context-parallel exchange


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                        ("interleaved-1f1b", 8), ("zb-v", 2)])
def test_in_flight_shortcut_matches_the_full_walk(schedule, v):
    """The truncated m and the closed forms (schedules._in_flight_at_warm_up) give what walking every order does;
    peak_holdings' truncated walk the same moments as the whole one."""
    from paraplan.planner.schedules import _in_flight, _peak_holdings, peak_holdings

    for p in (1, 2, 3, 4, 8):
        for m in range(1, 6 * p + 1):
            if schedule == "interleaved-1f1b" and m % max(1, m // p):
                continue
            assert in_flight(schedule, p, v, m) == _in_flight(schedule, p, v, m)
            if v > 1:
                assert peak_holdings(schedule, p, v, m) == _peak_holdings(schedule, p, v, m)


@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-1f1b", 6),
                                        ("zb-v", 2), ("1f1b", 1)])
def test_peak_holdings_give_the_simulated_activation_peak(schedule, v):
    """Whatever each stage keeps per micro-batch (a chunk recomputed beside one that is not), a rank's activation
    peak is the most over schedules.peak_holdings — what the event simulation's memory curve reaches — though
    in_flight's single moment (the most micro-batches held) can fall short of it."""
    import random

    from paraplan.planner.schedules import peak_holdings, rank_stages
    from paraplan.planner.simulator import simulate_pipeline

    rng = random.Random(7)
    short_of_it = 0
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p, 4 * p + (0 if schedule == "interleaved-1f1b" else 1)):
            n = p * v
            acts = [rng.choice((1.0, 0.2, 5.0)) * rng.uniform(0.5, 1.5) for _ in range(n)]
            sim = simulate_pipeline(schedule, p, v, m, [1.0] * n, [2.0] * n, [1.0] * n, act_bytes=acts)
            holdings, flights = peak_holdings(schedule, p, v, m), in_flight(schedule, p, v, m)
            for r in range(p):
                stages = rank_stages(schedule, r, p, v)
                peak = max(sum(h.get(s, 0) * acts[s] for s in stages) for h in holdings[r])
                assert peak == pytest.approx(sim.peak_activation_bytes[r], rel=1e-9), (p, m, r)
                short_of_it += sum(flights[r].get(s, 0) * acts[s] for s in stages) < peak * (1 - 1e-9)
    assert short_of_it > 0 or v == 1


def test_zero_bubble_peaks_count_the_gradients_kept_for_the_weight_backward():
    """In zb-v a stage's input backward (B) leaves gradients until its weight backward (W) frees them with the
    activations (torch's stage_backward_input keeps param_group["grads"]), and its W leaves 16-bit weight gradients
    until its next B folds them into the fp32 sums (FSDP2): the rank's peak over schedules.peak_holdings, each
    moment's micro-batches between B and W under pending_key and its unfolded stages under unfolded_key, equals the
    event simulation's memory walk with all three, its unfolded part too; and the pending bytes raise the peak of
    some rank (the V's turning ranks, whose cool-down runs input backwards first)."""
    import random

    from paraplan.planner.schedules import peak_holdings, pending_key, rank_stages, unfolded_key
    from paraplan.planner.simulator import simulate_pipeline

    rng = random.Random(11)
    raised = 0
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p + 1):
            n = 2 * p
            acts = [rng.uniform(0.5, 5.0) for _ in range(n)]
            pending = [rng.uniform(0.1, 2.0) for _ in range(n)]
            unfolded = [rng.uniform(0.0, 8.0) for _ in range(n)]
            times = ([1.0] * n, [2.0] * n, [1.0] * n)
            sim = simulate_pipeline("zb-v", p, 2, m, *times, act_bytes=acts, dw_pending=pending, unfolded=unfolded)
            lean = simulate_pipeline("zb-v", p, 2, m, *times, act_bytes=acts)
            for r, moments in enumerate(peak_holdings("zb-v", p, 2, m)):
                stages = rank_stages("zb-v", r, p, 2)
                parts = [(sum(h.get(s, 0) * acts[s] + h.get(pending_key(s, p, 2), 0) * pending[s] for s in stages),
                          sum(h.get(unfolded_key(s, p, 2), 0) * unfolded[s] for s in stages)) for h in moments]
                top = max(parts, key=sum)
                assert sum(top) == pytest.approx(sim.peak_activation_bytes[r] + sim.peak_unfolded_bytes[r], rel=1e-9)
                assert top[1] == pytest.approx(sim.peak_unfolded_bytes[r], rel=1e-9, abs=1e-12), (p, m, r)
                raised += sim.peak_activation_bytes[r] > lean.peak_activation_bytes[r] + 1e-9
    assert raised


def test_zero_bubble_stages_keep_their_blocks_output_gradients():
    """StageCost.dw_pending on a zb-v layout: an inner stage keeps, per micro-batch, its blocks' weight-carrying
    outputs' gradients (memory.pending_weight_grad_bytes: column-parallel ones split over tp, row-parallel partial
    sums whole, the norms' split over the sequence under SP) and the gradient received for its output; the first
    stage only that gradient (torch runs its whole backward at W); the last only what exceeds the loss backward's
    working set (it runs W right after B)."""
    from paraplan.planner.costmodel import even_stages
    from paraplan.planner.memory import pending_weight_grad_bytes
    from paraplan.planner.search import enumerate_layouts

    work = Workload.create("llama2-7b", "dgx-h100", 64)
    model = CostModel(work)
    lay = next(x for x in enumerate_layouts(work, 8, "bf16") if x.short() == "dp1 tp2 pp4 mb1 zb-vx2 sp")
    stages = even_stages(model, lay)
    costs = model.stage_costs(lay, stages)
    layer = work.profile("bf16").layers[1]
    split, whole = layer.weight_output_bytes_sharded, layer.weight_output_bytes_whole
    per_layer = split / 2 + whole + (layer.weight_output_bytes - split - whole) / 2
    assert pending_weight_grad_bytes(layer, 1, 2, True) == per_layer
    boundary = layer.output_bytes / 2  # the hidden state, split over the sequence
    inner = costs[3]
    assert inner.dw_pending == pytest.approx(len(inner.blocks) * per_layer + boundary, rel=1e-12)
    assert costs[0].dw_pending == pytest.approx(boundary, rel=1e-12)
    head = model.block_cost(len(work.profile("bf16").layers) - 1, lay, layout_placement(work.cluster, lay), "none")
    last = costs[-1]
    blocks = sum(model.block_cost(i, lay, layout_placement(work.cluster, lay), "none").dw_pending for i in last.blocks)
    assert last.dw_pending == pytest.approx(max(0.0, blocks - head.act_working), rel=1e-12)


def test_zero_bubble_unfolded_gradients_skip_the_first_stage():
    """ZB-V under ZeRO-2 in bf16 sums its gradients unsharded in fp32 (4 B a parameter) and holds a stage's 16-bit
    gradients (2 B) only from its W to its next B (StateBytes.unfolded); the first stage's W is its whole backward,
    whose FSDP2 post-backward folds them at once: none there. 1F1B reduce-scatters every micro-batch instead: 4/dp
    B a parameter, nothing unfolded."""
    from paraplan.planner import moe
    from paraplan.planner.costmodel import even_stages, unfolded_bytes
    from paraplan.planner.memory import state_bytes

    work = Workload.create("llama2-7b", "dgx-h100", 64)
    model = CostModel(work)
    lay = Layout(dp=2, tp=2, pp=4, micro_batch=1, global_batch=64, schedule="zb-v", virtual_stages=2, zero=2,
                 sequence_parallel=True)
    states = (state_bytes(work.framework, lay), moe.expert_states(work.framework, lay))
    assert (states[0].grads, states[0].unfolded) == (4.0, 2.0)
    costs = model.stage_costs(lay, even_stages(model, lay))
    got = unfolded_bytes(costs, tuple(range(len(costs))), states)
    assert got[0] == 0.0
    assert all(got[s] == pytest.approx(2.0 * costs[s].params, rel=1e-12) for s in range(1, len(costs)))
    plain = state_bytes(work.framework, lay.replace(schedule="1f1b", virtual_stages=1))
    assert (plain.grads, plain.unfolded) == (2.0, 0.0)


def _block(model: str, framework: str, mode: str, **layout):
    from paraplan.planner.placement import layout_placement

    work = Workload.create(model, "dgx-h100", 64, framework=framework)
    lay = Layout(**{"dp": 1, "tp": 2, "pp": 1, "micro_batch": 1, "global_batch": 64, "sequence_parallel": True,
                    **layout, "recompute": mode})
    return CostModel(work).block_cost(1, lay, layout_placement(work.cluster, lay), mode)


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b"])
def test_mlp_recomputation_keeps_what_megatron_core_keeps(name):
    """--recompute mlp under megatron-core (Transformer Engine's fused modules, planner/fused_activations.py):
    per token a dense layer keeps its attention's norm + QKV pair (4h), the checkpointed MLP's input (2h) and
    the attention's Q, K, V and output (2(a·d + 2·kv·d) + 2·a·d), the norms' part split by t under SP; the
    MLP's 2·up + 2·ffn bytes are gone. Megatron's checkpoint reruns the MLP's whole forward: its GEMMs (3 of a
    SwiGLU layer's 7 linears, 2·h·f FLOPs each per token) and its tensor-parallel all-gather again. Llama 3 8B
    shares each of its 8 K/V heads among 4 query heads: K and V are kept as projected (kv heads each)."""
    spec = load_model_spec(name)
    h, a, kv, d, t, s = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_dim, 2, spec.seq_length
    attention = 2 * (a * d + 2 * kv * d) + 2 * a * d
    none, mlp, full = (_block(name, "megatron-core", u) for u in ("none", "mlp", "full"))
    assert mlp.act_bytes == pytest.approx(s * (6 * h / t + attention / t))
    assert full.act_bytes < mlp.act_bytes < none.act_bytes
    assert mlp.act_working == pytest.approx(none.act_bytes - mlp.act_bytes)  # the MLP's own, while it reruns
    assert mlp.recompute_flops == pytest.approx(3 * 2 * s * h * spec.ffn_size)
    assert 0 < mlp.recompute < full.recompute and full.recompute == pytest.approx(full.fwd)
    assert none.tp_bwd < mlp.tp_bwd < full.tp_bwd


@pytest.mark.parametrize("model, framework, layout", [
    ("deepseek-v3", "megatron-core", dict(tp=1, sequence_parallel=False, dp=8, ep=8)),
    ("llama2-7b", "megatron-core", {}), ("llama2-7b", "paraplan", {})])
def test_selective_and_mlp_recomputation_together_are_the_union_of_each(model, framework, layout):
    """--recompute selective+mlp (Megatron-Core's recompute_modules core_attn/mla_up_proj with mlp and moe, as
    NVIDIA's DeepSeek-V3 recipes run): the two checkpoints cover disjoint tensors (the attention core's and its
    prologue's; the MLP sublayer's), so the layer keeps what none keeps less what each drops, reruns what each
    reruns (time and FLOPs add up), and repeats the MoE block's all-to-alls as mlp does."""
    none, sel, mlp, both = (_block(model, framework, u, **layout)
                            for u in ("none", "selective", "mlp", "selective+mlp"))
    assert both.act_bytes == pytest.approx(none.act_bytes - (none.act_bytes - sel.act_bytes)
                                           - (none.act_bytes - mlp.act_bytes), rel=1e-12)
    # (with a flash kernel and no prologue, selective drops nothing under Transformer Engine: both == mlp there)
    assert both.act_bytes <= min(sel.act_bytes, mlp.act_bytes) and (model != "deepseek-v3" or both.act_bytes < min(
        sel.act_bytes, mlp.act_bytes))
    assert both.recompute == pytest.approx(sel.recompute + mlp.recompute, rel=1e-12)
    assert both.recompute_flops == pytest.approx(sel.recompute_flops + mlp.recompute_flops, rel=1e-12)
    assert both.a2a_bytes == pytest.approx(mlp.a2a_bytes) and both.ep_time == pytest.approx(mlp.ep_time)
    assert both.act_working == pytest.approx(sel.act_bytes - both.act_bytes)  # the MLP's, while it reruns


def test_early_stopping_checkpoint_skips_the_last_mlp_linear():
    """This executor's checkpoint (torch non-reentrant, early stop: tests/test_executor_units.py counts the
    matmuls) does not rerun a pre-norm layer's MLP down projection, under full or MLP recomputation;
    Megatron-Core's does. The skipped GEMM has 2·h·f FLOPs per token."""
    spec = load_model_spec("llama2-7b")
    down = 2 * spec.seq_length * spec.hidden_size * spec.ffn_size
    for mode in ("full", "mlp"):
        ours, megatron = _block("llama2-7b", "paraplan", mode), _block("llama2-7b", "megatron-core", mode)
        assert megatron.recompute_flops - ours.recompute_flops == pytest.approx(down)
    full = _block("llama2-7b", "paraplan", "full")
    assert full.recompute < full.fwd


def test_mlp_recomputation_of_an_moe_block_repeats_its_all_to_alls():
    """Recomputing an MoE block (Megatron-Core's recompute_modules moe) reruns its dispatch and combine:
    the all-to-all traffic of full recomputation, none of the attention's recomputation."""
    none, mlp, full = (_block("mixtral-8x7b", "megatron-core", u, tp=1, sequence_parallel=False, dp=8, ep=8)
                       for u in ("none", "mlp", "full"))
    assert mlp.a2a_bytes == pytest.approx(full.a2a_bytes) and mlp.a2a_bytes > none.a2a_bytes
    assert mlp.ep_time == pytest.approx(full.ep_time) and mlp.ep_time > none.ep_time
    assert full.act_bytes < mlp.act_bytes < none.act_bytes and mlp.recompute < full.recompute


def test_executor_interleaved_zero3_prices_the_runtimes_pending_gathers():
    """Under this executor's interleaved schedule torch's multi-stage runtime issues the all-gathers of whole chunks
    (UNSHARD actions, three chunks active) and each output stays until the chunk's next op: with v <= 3 chunks a rank
    gathers all of them at the step's first op, before any activation or gradient (start_weights: 2 B per parameter
    in bf16, then; none later); with v > 3 the first op gathers three of them (2 x 3 / v B per parameter), and each
    later moment the chunks pending then, 2 B per parameter of each (chunk_gather, priced per moment: the weights
    stay the sharded fp32, 4/dp B). 1F1B's ZeRO-3 gathers a unit at a time, and other stacks keep ZeRO's
    accounting."""
    from paraplan.planner.framework import framework
    from paraplan.planner.memory import rank_memory, state_bytes

    fw = framework("paraplan")
    lay = Layout(dp=16, tp=2, pp=2, micro_batch=1, global_batch=512, schedule="interleaved-1f1b", virtual_stages=6,
                 zero=3)
    one_f_one_b = state_bytes(fw, lay.replace(schedule="1f1b", virtual_stages=1))
    assert one_f_one_b.weights == pytest.approx(4 / 16) and one_f_one_b.start_weights == 0.0
    six = state_bytes(fw, lay)
    assert six.weights == pytest.approx(4 / 16) and six.start_weights == pytest.approx(2 * 3 / 6)
    assert six.chunk_gather == 2.0 and one_f_one_b.chunk_gather == 0.0
    assert six.unit_weights == one_f_one_b.unit_weights == 4.0
    two = state_bytes(fw, lay.replace(virtual_stages=2))
    assert two.weights == pytest.approx(4 / 16) and two.start_weights == 2.0 and two.chunk_gather == 0.0
    # the step's first moment: weights with every chunk gathered, the optimizer's states; no gradient, no activation
    gpu = load_cluster("dgx-h100").gpu
    params = 1e9
    first = rank_memory(two, params, 0.0, 1e6, gpu, staged_params=0.0)
    assert first["params"] == pytest.approx(params * (4 / 16 + 2)) and first["grads"] == 0.0
    assert first["activations"] == 0.0 and first["optimizer"] == pytest.approx(params * two.optimizer)
    busy = rank_memory(two, params, 0.0, 40e9, gpu, staged_params=0.0)  # activations beyond the gathers: that moment
    assert busy["activations"] == 40e9 and busy["params"] == pytest.approx(params * 4 / 16)
    megatron = framework("megatron-core")
    assert state_bytes(megatron, lay).weights == state_bytes(megatron, lay.replace(schedule="1f1b",
                                                                                   virtual_stages=1)).weights
    assert state_bytes(megatron, lay).chunk_gather == 0.0


def _torch_interleaved_lowering(pp: int, v: int, m: int, r: int):
    """Rank r's actions under torch's multi-stage runtime: ScheduleInterleaved1F1B's order lowered by
    _add_unshard_reshard (its order alone: no stages, no process group)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    sched = object.__new__(torch_schedules.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return torch_schedules, torch_schedules._add_unshard_reshard(sched._calculate_single_rank_operations(r))


@pytest.mark.parametrize("pp,v,m", [(2, 4, 32), (2, 6, 32), (4, 4, 16), (2, 5, 12), (4, 6, 8), (8, 4, 24),
                                    (3, 5, 7), (2, 6, 64), (4, 8, 40), (3, 4, 9)])
def test_runtime_gathers_follow_torchs_own_lowering(pp, v, m):
    """schedules.runtime_gathers walks the runtime's window itself; here torch's own lowering (_add_unshard_reshard
    on ScheduleInterleaved1F1B's order) is walked: an UNSHARD leaves its chunk's gathers pending until the chunk's
    next compute (a RESHARD leaves a pending all-gather's output alone). Before every compute op, the same chunks
    are pending."""
    from paraplan.planner.schedules import runtime_gathers

    for r, flags in enumerate(runtime_gathers(pp, v, m)):
        torch_schedules, actions = _torch_interleaved_lowering(pp, v, m, r)
        pending, theirs = set(), []
        for a in actions:
            if a.computation_type == torch_schedules.UNSHARD:
                pending.add(a.stage_index)
            elif a.computation_type in (torch_schedules.FORWARD, torch_schedules.FULL_BACKWARD):
                theirs.append(sorted((s - r) // pp for s in pending))
                pending.discard(a.stage_index)
        assert [[c for c in range(v) if row[c]] for row in flags.tolist()] == theirs, r


def test_gather_moments_find_the_traced_peaks():
    """llama2-70b dp16 tp2 pp2, interleaved 1F1B with v = 4 chunks of 10 layers a rank, 32 micro-batches, ZeRO-3, full
    recomputation, traced (executor/trace.py's live tensors at each rank's peak): rank 0's peak came in the cool-down
    holding 6 chunk micro-batches of its most 9, with three chunks gathered (10 layers copied out, 20 layers'
    all-gather outputs pending); rank 1's with two chunks' gathers, its three-chunk moments all in the warm-up,
    before any gradient exists. With a chunk's gathered weights (8.56 GB) worth ~13 chunk micro-batches of
    checkpoints (0.67 GB each), schedules.peak_holdings' moments say the same; and from 3·pp micro-batches on
    (m a multiple of pp) the moments no longer change. Rank 0 held three reduce buffers then (fp32, 4 B per parameter
    of a unit): its first chunk's root unit's (the embedding's 0.5 GB), and a layer unit's for each of the next two
    chunks; its last chunk, past its last backward, none."""
    from paraplan.planner.schedules import _gather_holdings, buffer_key, gathered_key, late_key, peak_holdings

    pp, v, m = 2, 4, 32
    chunk, micro = 8.56, 0.67

    def heaviest(moments, late):
        return max((h for h in moments if bool(h.get(late_key(pp, v))) == late),
                   key=lambda h: sum(micro * h.get(s, 0) + chunk * h.get(gathered_key(s, pp, v), 0)
                                     for s in range(pp * v)))

    def counts(h):
        return (sum(h.get(s, 0) for s in range(pp * v)), sum(h.get(gathered_key(s, pp, v), 0) for s in range(pp * v)))

    rank0, rank1 = peak_holdings("interleaved-1f1b", pp, v, m, gathers=True)
    assert counts(heaviest(rank0, late=True)) == (6, 3)
    assert max(counts(h)[0] for h in rank0) == 9
    assert counts(heaviest(rank1, late=True))[1] == 2
    assert counts(heaviest(rank1, late=False))[1] == 3
    # a chunk keeps a reduce buffer from its first backward to its last: none before the first, all four at most
    for moments in (rank0, rank1):
        assert all(not h.get(buffer_key(s, pp, v)) for h in moments if not h.get(late_key(pp, v)) for s in range(8))
        assert max(sum(h.get(buffer_key(s, pp, v), 0) for s in range(8)) for h in moments) == v
    assert [c for c in range(v) if heaviest(rank0, late=True).get(buffer_key(2 * c, pp, v))] == [0, 1, 2]
    for p, chunks in ((2, 4), (3, 5), (4, 6), (8, 4)):
        assert all(_gather_holdings(p, chunks, k * p) == _gather_holdings(p, chunks, 3 * p) for k in (4, 5, 7))
    # the cost model's price of that plan: the sharded fp32 weights, two gathered layer units and the root unit
    # (memory.rank_memory), and at the peak three gathered chunks on rank 0, two on rank 1 (2 B per parameter)
    model = CostModel(Workload.create("llama2-70b", "dgx-h100", 512))
    lay = Layout(dp=16, tp=2, pp=2, micro_batch=1, global_batch=512, schedule="interleaved-1f1b", virtual_stages=v,
                 zero=3, recompute="full")
    stages = default_stages(model, lay)
    costs = model.stage_costs(lay, stages, ["full"] * lay.num_stages)
    pred = model.evaluate(lay, stages, ["full"] * lay.num_stages)
    for r, gathered in ((0, 3), (1, 2)):
        mine = [costs[s] for s in range(r, pp * v, pp)]
        assert len({c.params - c.root_params for c in mine}) == 1  # chunks of 10 layers, the roots apart
        fixed = sum(c.params for c in mine) * 4 / 16 + 2 * 2 * max(c.largest_unit for c in mine) \
            + 2 * sum(c.root_params for c in mine)
        params = pred.rank_memory_breakdown_gib[r]["params"] * 2**30
        assert params == pytest.approx(fixed + 2 * gathered * (mine[1].params - mine[1].root_params), rel=1e-9)
    # rank 0's gradients: the fp32 shards (4 / dp B per parameter) and the three buffers traced
    mine = [costs[s] for s in range(0, pp * v, pp)]
    grads = pred.rank_memory_breakdown_gib[0]["grads"] * 2**30
    assert mine[0].root_params and mine[1].largest_reduce_unit > mine[0].root_params  # the embedding's is smaller
    assert grads == pytest.approx(sum(c.params for c in mine) * 4 / 16
                                  + 4 * (mine[0].root_params + 2 * mine[1].largest_reduce_unit), rel=1e-9)


def test_pipelined_zero2_holds_one_reduce_buffer_per_chunk():
    """FSDP2 keeps each root's last reduce-scatter input (fp32, 4 B per parameter of the unit) until its next
    backward unless that backward is the step's last (torch/distributed/fsdp/_fully_shard/_fsdp_state.py,
    _root_post_backward_final_callback); the pipeline stages mark every other backward not last, so each chunk on a
    rank holds one: its root unit's (embedding, head) or a layer's. Without a pipeline the final callback frees it,
    and ZB-V reduces once, after the last backward."""
    from paraplan.planner.framework import framework
    from paraplan.planner.memory import staged_unit_params, state_bytes

    fw = framework("paraplan")
    interleaved = Layout(dp=2, tp=1, pp=2, micro_batch=1, global_batch=16, schedule="interleaved-1f1b",
                         virtual_stages=2, zero=2)
    held = state_bytes(fw, interleaved)
    assert held.staging_held and held.unit_grads == 4.0
    # two chunks: one whose root unit (an embedding of 25) outweighs the largest layer unit (10), one without a root
    assert staged_unit_params(held, 10.0, [25.0, 0.0]) == 35.0
    assert staged_unit_params(held, 10.0, [0.0, 0.0, 0.0, 0.0]) == 40.0  # four chunks of layers
    for lay in (interleaved.replace(pp=1, schedule="1f1b", virtual_stages=1),
                interleaved.replace(schedule="zb-v"), interleaved.replace(zero=1)):
        assert not state_bytes(fw, lay).staging_held
        assert staged_unit_params(state_bytes(fw, lay), 10.0, [25.0, 0.0]) == 10.0  # the unit being reduced
    assert not state_bytes(framework("megatron-core"), interleaved).staging_held


@pytest.mark.parametrize("pp,v,m", [(2, 4, 16), (8, 4, 32), (2, 6, 16), (4, 8, 8), (4, 5, 12), (3, 4, 7), (2, 3, 16),
                                    (2, 4, 64), (3, 5, 41), (4, 6, 50), (8, 5, 120)])  # the last four extended
def test_runtime_unshards_count_torchs_own_lowering(pp, v, m):
    """torch's multi-stage pipeline runtime adds UNSHARD/RESHARD actions to each rank's compute order
    (pipelining/schedules.py _add_unshard_reshard, three chunks active): schedules.runtime_unshards, the all-gathers
    per chunk a step, is torch's own count on ScheduleInterleaved1F1B's order (one per chunk with three or fewer)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from paraplan.planner.schedules import runtime_unshards

    sched = object.__new__(torch_schedules.ScheduleInterleaved1F1B)  # its order alone: no stages, no process group
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    unshards = sum(a.computation_type == torch_schedules.UNSHARD for r in range(pp)
                   for a in torch_schedules._add_unshard_reshard(sched._calculate_single_rank_operations(r)))
    assert runtime_unshards("interleaved-1f1b", pp, v, m) == pytest.approx(unshards / (pp * v), rel=1e-12)
    assert (unshards == pp * v) == (v <= 3)


@pytest.mark.parametrize("pp,v,m", [(2, 4, 16), (8, 4, 32), (3, 4, 7), (4, 6, 50), (2, 3, 5), (4, 2, 6), (8, 6, 256),
                                    (4, 3, 10), (3, 2, 3), (4, 4, 12)])
def test_interleaved_order_is_torchs_own(pp, v, m):
    """schedules.rank_orders' interleaved order (built in closed form, schedules._interleaved_arrays) is the compute
    order torch's ScheduleInterleaved1F1B gives each rank, op for op, micro-batch counts multiple of pp or not."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from paraplan.planner.schedules import rank_orders

    sched = object.__new__(torch_schedules.ScheduleInterleaved1F1B)  # its order alone: no stages, no process group
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    kinds = {torch_schedules.FORWARD: "F", torch_schedules.FULL_BACKWARD: "B"}
    for r in range(pp):
        theirs = [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
                  for a in sched._calculate_single_rank_operations(r) if a is not None]
        assert list(rank_orders("interleaved-1f1b", pp, v, m)[r]) == theirs, r


def test_runtime_unshards_extended_past_the_warm_up_equals_the_full_walk():
    """Past its warm-up runtime_unshards extends two walked counts of m's residue mod pp linearly (the order repeats
    a round of pp micro-batches a chunk); every count, multiple of pp or not, equals walking the order."""
    from paraplan.planner.schedules import _unshards_walked, runtime_unshards

    for pp, v in ((2, 4), (2, 7), (3, 5), (4, 4), (4, 6), (8, 5)):
        for m in range(pp, (pp + 3) * pp):
            assert runtime_unshards("interleaved-1f1b", pp, v, m) * pp * v == pytest.approx(
                _unshards_walked("interleaved-1f1b", pp, v, m), rel=1e-12), (pp, v, m)


def test_interleaved_zero2_gathers_each_chunk_as_often_as_the_runtime_unshards_it():
    """An FSDP2 ZeRO-2 stack (this executor) under interleaving of four chunks a rank gathers them again as the
    runtime reshards them (mixtral-8x7b dp32 pp2 x4: the dry run traced 54 and 42 GB of all-gathers a rank where
    one gather a step priced 7.2): the weights' all-gather bytes are runtime_unshards times one gather's."""
    from paraplan.planner.schedules import runtime_unshards

    work = Workload.create("llama2-7b", "dgx-h100", 64, nodes=2)
    gathered = {}
    for v in (2, 4):
        lay = Layout(dp=8, tp=1, pp=2, micro_batch=1, global_batch=64, schedule="interleaved-1f1b", virtual_stages=v,
                     zero=2)
        pred, _ = simulate(work, lay, [list(range(i * 34 // (2 * v), (i + 1) * 34 // (2 * v))) for i in range(2 * v)])
        gathered[v] = [r["all_gather"] for r in pred.rank_comm_bytes]
    assert runtime_unshards("interleaved-1f1b", 2, 4, 8) > 1
    for two, four in zip(gathered[2], gathered[4], strict=True):
        assert four == pytest.approx(two * runtime_unshards("interleaved-1f1b", 2, 4, 8), rel=1e-9)

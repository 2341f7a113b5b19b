"""Hardware specs: every shipped spec loads; the loader is strict; topology answers placement questions."""

from __future__ import annotations

import pytest

from paraplan.hardware_specs import (
    HardwareSpecError,
    group_span,
    load_cluster,
    load_gpu,
    load_link,
    names,
    path_link,
)


def test_every_shipped_spec_loads():
    assert {"v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200-141gb", "l40s-48gb", "mi300x-192gb",
            "cpu"} <= set(names("gpu"))
    assert {"dgx-a100-80gb", "dgx-h100", "dgx-h200", "local"} <= set(names("cluster"))
    for n in names("gpu"):
        load_gpu(n)
    for n in names("link"):
        load_link(n)
    for n in names("cluster"):
        load_cluster(n)


def test_datasheet_figures():
    # NVIDIA A100 datasheet: 312 TFLOPS dense BF16, 2,039 GB/s on the 80 GB SXM part.
    a100 = load_gpu("a100-80gb")
    assert a100.peak_flops("bf16") == 312e12 and a100.hbm_GBps == 2039
    # NVIDIA H100 SXM datasheet: 989.5 TFLOPS dense BF16 (1,979 with sparsity).
    assert load_gpu("h100-sxm-80gb").peak_tflops["bf16"] == 989.5
    with pytest.raises(HardwareSpecError, match="no bf16 support"):
        load_gpu("v100-32gb").peak_flops("bf16")


def test_named_link_counts_nics():
    # DGX H100: 8 ConnectX-7 NDR ports of 50 GB/s = 400 GB/s per node per direction.
    c = load_cluster("dgx-h100")
    assert c.inter_node.bandwidth_GBps == 400 and c.intra_node.bandwidth_GBps == 450


def test_nodes_override():
    assert load_cluster("dgx-a100-80gb", nodes=384).num_gpus == 3072


def _cluster_yaml(write, text):
    return write("c.yaml", text)


GOOD = """name: mine
gpu: {name: g, memory_GiB: 16, hbm_GBps: 900, peak_tflops: {fp32: 10, tf32: null, bf16: 100, fp16: 100, fp8: null}}
nodes: 2
gpus_per_node: 4
intra_node: {bandwidth_GBps: 100, latency_us: 2}
inter_node: {bandwidth_GBps: 25, latency_us: 5}
"""


def test_inline_cluster(write):
    c = load_cluster(_cluster_yaml(write, GOOD))
    assert c.num_gpus == 8 and c.gpu.memory_GiB == 16 and c.inter_node.bandwidth_GBps == 25


@pytest.mark.parametrize("edit,fragment", [
    (("gpus_per_node: 4", "gpus_per_node: 4\nnics: 2"), "unknown key 'nics'"),
    (("nodes: 2\n", ""), "missing key 'nodes'"),
    (("hbm_GBps: 900", "hbm_GBs: 900"), "unknown key 'hbm_GBs'"),
    (("latency_us: 5", "latency_us: -5"), "must be zero or more"),
    (("fp8: null", "fp8: fast"), "'peak_tflops.fp8' must be a number"),
    (("gpus_per_node: 4", "gpus_per_node: 0"), "gpus_per_node"),
    (("gpu: {", "gpu: no-such-gpu\nx: {"), "unknown"),
    (("hbm_GBps: 900", "hbm_GBps: 900, sm_count: 1.5"), "'sm_count' must be a whole number"),
    (("bf16: 100", "bf16: .nan"), "'peak_tflops.bf16' must be a finite number"),  # was an AssertionError
    (("memory_GiB: 16", "memory_GiB: .inf"), "'memory_GiB' must be a finite number"),  # every layout "fit"
])
def test_loader_refuses_bad_specs(write, edit, fragment):
    path = _cluster_yaml(write, GOOD.replace(*edit))
    with pytest.raises(HardwareSpecError) as e:
        load_cluster(path)
    assert fragment in str(e.value)
    assert "c.yaml" in str(e.value) or "unknown gpu spec" in str(e.value)


def test_unknown_cluster_suggests():
    with pytest.raises(HardwareSpecError, match="dgx-h100"):
        load_cluster("dgx-h10")


def test_topology_placement():
    c = load_cluster("dgx-h100", nodes=2)
    g = c.topology()
    assert sum(1 for _, d in g.nodes(data=True) if d.get("kind") == "gpu") == 16
    assert path_link(g, 0, 7).kind == "nvswitch" and path_link(g, 0, 7).bandwidth_GBps == 450
    cross = path_link(g, 0, 8)
    assert cross.kind == "infiniband" and cross.bandwidth_GBps == 50  # one NIC's share
    span = group_span(c, [0, 8])
    assert span.crosses_nodes and span.nodes == 2 and span.max_per_node == 1
    assert not group_span(c, list(range(8))).crosses_nodes


def test_efficiency_curve_interpolates_in_log_flops():
    eff = load_gpu("a100-80gb").efficiency
    lo, hi = eff.matmul_fraction(1e9, "bf16"), eff.matmul_fraction(1e10, "bf16")
    mid = eff.matmul_fraction(10 ** 9.5, "bf16")
    assert lo < mid < hi and abs(mid - (lo + hi) / 2) < 1e-9
    assert eff.matmul_fraction(1e20, "bf16") == eff.matmul[("default")][-1][1]


def test_a_cluster_written_back_keeps_its_gpu_s_sm_count(tmp_path):
    """Specs written back (calibrate, validate --update-spec) carry sm_count: the overlapped all-to-all's price
    needs it (planner/moe.py)."""
    import yaml

    from paraplan.hardware_specs import cluster_mapping

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster_mapping(load_cluster("dgx-h100"))))
    assert load_cluster(str(path)).gpu.sm_count == 132


def test_a_one_node_cluster_may_leave_the_network_out(write):
    """A workstation's spec needs no inter_node: one node never sends across nodes. It refuses more nodes (and a
    spec of several nodes still needs its network) in one line; written back (a plan's cluster_spec) it stays
    without one."""
    from paraplan.hardware_specs import cluster_from_mapping, cluster_mapping
    from paraplan.hardware_specs.specs import HardwareSpecError

    body = "name: ws\ngpu: h100-sxm-80gb\ngpus_per_node: 4\nintra_node: {bandwidth_GBps: 300, latency_us: 2}\n"
    ws = load_cluster(write("ws.yaml", "nodes: 1\n" + body))
    assert ws.num_gpus == 4 and not ws.networked
    with pytest.raises(HardwareSpecError, match="one node without an inter_node link: give its network"):
        ws.with_nodes(2)
    with pytest.raises(HardwareSpecError, match="missing key 'inter_node'"):
        load_cluster(write("two.yaml", "nodes: 2\n" + body))
    again = cluster_from_mapping(cluster_mapping(ws), "round trip")
    assert "inter_node" not in cluster_mapping(ws) and not again.networked and again.num_gpus == 4

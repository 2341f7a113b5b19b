"""Collective and point-to-point times on a cluster (α–β model: time = latency + bytes / bandwidth).

Sources of the formulas:
- Ring all-reduce: 2(n-1)/n · M / B of traffic per rank and 2(n-1) latency steps (Patarasuk & Yuan 2009,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations"; Thakur et al. 2005).
- Ring reduce-scatter and all-gather: (n-1)/n · M / B and (n-1) steps each (Thakur et al. 2005).
- Tree all-reduce (NCCL's double binary tree, Sanders et al. 2009): ~2·M / B, 2·log2(n) latency steps.
- Hierarchical collectives when a group spans nodes (as NCCL does): reduce-scatter inside the node,
  all-reduce of the 1/r shard across nodes (r = the group's ranks per node, each with its own shard in
  parallel; where nodes hold unequal shares (4 + 1), the node with the fewest ranks sends the largest shards,
  and it sets the pace), all-gather inside the node. The node's NICs are shared by every GPU of the node that
  sends across the network at the same time (``busy`` GPUs per node).
- Parameter server (Li et al. 2014, OSDI): N workers push their gradient to k servers holding 1/k of the
  parameters each and pull the parameters back; each server moves N·M/k bytes each way through its link.
M is the full message in bytes; B a link's achieved bytes/s.
"""

from __future__ import annotations

import math

from paraplan.hardware_specs import ClusterSpec, GroupSpan, LinkSpec


def network_share(cluster: ClusterSpec, busy: int) -> LinkSpec:
    """What one GPU gets of its node's network when ``busy`` GPUs of the node send at once."""
    inter = cluster.inter_node
    return LinkSpec(name=f"{inter.name}/{busy}", kind=inter.kind, bandwidth_GBps=inter.bandwidth_GBps / max(busy, 1),
                    latency_us=inter.latency_us, efficiency=inter.efficiency)


def senders(span: GroupSpan, busy: int) -> int:
    """The GPUs of a node sharing its network for a collective over groups placed as ``span``: the node's busy
    GPUs, or fewer where only some of its GPUs are in groups that leave the node (GroupSpan.senders_per_node)."""
    return min(busy, span.senders_per_node) if span.senders_per_node else busy


def ring_all_reduce(nbytes: float, n: int, link: LinkSpec) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s


def tree_all_reduce(nbytes: float, n: int, link: LinkSpec) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * nbytes / link.bandwidth_Bps + 2 * math.ceil(math.log2(n)) * link.latency_s


def ring_gather(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-gather or reduce-scatter of a full tensor of ``nbytes`` (each rank holds 1/n)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth_Bps + (n - 1) * link.latency_s


def all_reduce(nbytes: float, span: GroupSpan, cluster: ClusterSpec, busy: int) -> float:
    """All-reduce over a group placed as ``span``: ring or tree (the faster), hierarchical across nodes."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    if not span.crosses_nodes:
        return min(ring_all_reduce(nbytes, span.size, cluster.intra_node),
                   tree_all_reduce(nbytes, span.size, cluster.intra_node))
    r, k, fewest = span.max_per_node, span.nodes, span.fewest_per_node
    net = network_share(cluster, senders(span, busy))
    inside = 2 * ring_gather(nbytes, r, cluster.intra_node)  # reduce-scatter + all-gather in the node
    across = min(ring_all_reduce(nbytes / fewest, k, net), tree_all_reduce(nbytes / fewest, k, net))
    return inside + across


def gather(nbytes: float, span: GroupSpan, cluster: ClusterSpec, busy: int) -> float:
    """All-gather or reduce-scatter of a full tensor of ``nbytes`` over a group placed as ``span``."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    if not span.crosses_nodes:
        return ring_gather(nbytes, span.size, cluster.intra_node)
    r, k = span.max_per_node, span.nodes
    return ring_gather(nbytes, r, cluster.intra_node) + ring_gather(nbytes / span.fewest_per_node, k,
                                                                    network_share(cluster, senders(span, busy)))


def collective(op: str, nbytes: float, span: GroupSpan, cluster: ClusterSpec, busy: int) -> float:
    if op == "all_reduce":
        return all_reduce(nbytes, span, cluster, busy)
    if op in ("all_gather", "reduce_scatter"):
        return gather(nbytes, span, cluster, busy)
    raise AssertionError(f"unknown collective {op}")


def p2p(nbytes: float, cross_node: bool, cluster: ClusterSpec, busy: int) -> float:
    """One send/receive of ``nbytes`` between two ranks."""
    if nbytes <= 0:
        return 0.0
    link = network_share(cluster, busy) if cross_node else cluster.intra_node
    return link.latency_s + nbytes / link.bandwidth_Bps


def parameter_server_sync(nbytes: float, workers: int, servers: int, cluster: ClusterSpec,
                          all_in_one_node: bool, worker_busy: int) -> float:
    """Synchronous push of gradients and pull of parameters through ``servers`` parameter servers.

    Each server's link carries workers·M/servers bytes in (push) and out (pull); each worker's link
    carries M each way. The slower of the two bounds each phase; push and pull run one after the other.
    A server handles its workers' messages one after another (workers/servers latencies per phase).
    Across nodes a server has its node's network to itself; workers share theirs with their node peers.
    """
    if workers <= 0 or nbytes <= 0:
        return 0.0
    server_link = cluster.intra_node if all_in_one_node else network_share(cluster, 1)
    worker_link = cluster.intra_node if all_in_one_node else network_share(cluster, worker_busy)
    server_side = workers * nbytes / servers / server_link.bandwidth_Bps
    worker_side = nbytes / worker_link.bandwidth_Bps
    return 2 * (max(server_side, worker_side) + server_link.latency_s * workers / servers)

"""The cluster as a graph: GPUs, the node's switch fabric, NICs and the network switch.

Vertices: ``gpu{r}`` (global rank r, attributes ``node`` and ``local_rank``), ``fabric{n}`` (the
node's NVSwitch / PCIe switch / shared memory), ``nic{n}.{i}`` and ``network``. Edges carry
``bandwidth_GBps``, ``latency_us`` and ``kind``; each hop holds half its link's latency, so a route
GPU-fabric-GPU costs one intra-node latency and GPU-...-network-...-GPU adds one network latency.
Later parts ask it which ranks share a node and what link a group's traffic crosses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .specs import ClusterSpec, LinkSpec

if TYPE_CHECKING:  # networkx is imported where a graph is built: planning never needs one
    import networkx as nx


def build_topology(cluster: ClusterSpec) -> nx.Graph:
    import networkx as nx

    g = nx.Graph(name=cluster.name)
    g.add_node("network", kind="switch")
    nic_bw = cluster.inter_node.bandwidth_GBps / cluster.nics_per_node
    for n in range(cluster.nodes):
        fabric = f"fabric{n}"
        g.add_node(fabric, kind=cluster.intra_node.kind, node=n)
        for i in range(cluster.nics_per_node):
            nic = f"nic{n}.{i}"
            g.add_node(nic, kind="nic", node=n)
            g.add_edge(fabric, nic, bandwidth_GBps=nic_bw, latency_us=0.0, kind=cluster.inter_node.kind)
            g.add_edge(nic, "network", bandwidth_GBps=nic_bw, latency_us=cluster.inter_node.latency_us / 2,
                       kind=cluster.inter_node.kind)
        for local in range(cluster.gpus_per_node):
            r = n * cluster.gpus_per_node + local
            g.add_node(f"gpu{r}", kind="gpu", node=n, local_rank=local)
            g.add_edge(f"gpu{r}", fabric, bandwidth_GBps=cluster.intra_node.bandwidth_GBps,
                       latency_us=cluster.intra_node.latency_us / 2, kind=cluster.intra_node.kind)
    return g


@dataclass(frozen=True)
class GroupSpan:
    """Where a communication group's ranks sit: how many nodes, and the most ranks on one node;
    ``senders_per_node``: of a node's GPUs, the most that send across nodes at once in groups of this kind (0: not
    known, every busy GPU of the node; fewer where some groups of the kind stay inside their node);
    ``min_per_node``: the fewest ranks on one of its nodes where they differ (4 + 1), 0 where every node holds
    ``max_per_node`` of them."""

    size: int
    nodes: int
    max_per_node: int
    senders_per_node: int = 0
    min_per_node: int = 0

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def fewest_per_node(self) -> int:
        """The fewest ranks on one node: across nodes, each of them carries 1/fewest of the data."""
        return self.min_per_node or self.max_per_node

    @staticmethod
    def of_counts(per_node: Counter) -> GroupSpan:
        """The span of a group with ``per_node`` ranks on each node it touches."""
        most, least = max(per_node.values()), min(per_node.values())
        return GroupSpan(size=sum(per_node.values()), nodes=len(per_node), max_per_node=most,
                         min_per_node=least if least != most else 0)


def group_span(cluster: ClusterSpec, ranks: list[int]) -> GroupSpan:
    return GroupSpan.of_counts(Counter(cluster.node_of(r) for r in ranks))


def path_link(graph: nx.Graph, a: int, b: int) -> LinkSpec:
    """The route between ranks a and b as one link: its slowest hop's bandwidth, summed latency."""
    import networkx as nx

    path = nx.shortest_path(graph, f"gpu{a}", f"gpu{b}")
    edges = [graph.edges[u, v] for u, v in zip(path, path[1:], strict=False)]
    slowest = min(edges, key=lambda e: e["bandwidth_GBps"])
    return LinkSpec(name=f"gpu{a}-gpu{b}", kind=slowest["kind"], bandwidth_GBps=slowest["bandwidth_GBps"],
                    latency_us=sum(e["latency_us"] for e in edges))

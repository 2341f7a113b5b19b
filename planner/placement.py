"""Where each rank of a layout sits, and which groups cross nodes.

Ranks are placed tensor-parallel innermost, then data-parallel, then pipeline (Megatron-LM's order):
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. With tp <= GPUs per node a tensor-parallel group
never leaves its node; data-parallel groups come next, pipeline neighbours are the farthest apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from paraplan.hardware_specs import ClusterSpec, GroupSpan


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


@dataclass(frozen=True)
class Placement:
    """Group spans of a layout on a cluster (every group of a kind is placed alike)."""

    tp: GroupSpan
    dp: GroupSpan
    pp_cross_node: bool  # do pipeline neighbours sit on different nodes
    gpus_per_node_busy: int  # GPUs per node that take part (sharing the node's NICs)


def placement(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> Placement:
    return _placement(cluster.gpus_per_node, cluster.nodes, dp, tp, pp)


def layout_placement(cluster: ClusterSpec, lay) -> Placement:
    """The placement of a layout whose data-parallel groups are its dp x cp ranks: context-parallel ranks sit
    between tensor- and data-parallel ones (the executor's mesh (pp, dp, cp, tp), Megatron-Core's tp-cp-dp-pp
    order), so the ranks that share a model chunk are consecutive tensor-parallel groups, as dp alone is."""
    return placement(cluster, lay.dp * lay.cp, lay.tp, lay.pp)


def cp_group(cluster: ClusterSpec, lay) -> GroupSpan:
    """Where a context-parallel group sits: cp ranks ``tp`` apart (tensor parallelism innermost)."""
    return consecutive_group(cluster, lay.cp, lay.tp)


@lru_cache(maxsize=4096)
def _placement(gpus_per_node: int, nodes: int, dp: int, tp: int, pp: int) -> Placement:
    node_of = lambda rank: rank // gpus_per_node
    tp_group = [rank_of(t, 0, 0, tp, dp) for t in range(tp)]
    dp_group = [rank_of(0, d, 0, tp, dp) for d in range(dp)]
    cross = pp > 1 and node_of(rank_of(0, 0, 0, tp, dp)) != node_of(rank_of(0, 0, 1, tp, dp))
    busy = min(gpus_per_node, dp * tp * pp)
    return Placement(tp=_span(tp_group, node_of), dp=_span(dp_group, node_of), pp_cross_node=cross,
                     gpus_per_node_busy=busy)


def _span(ranks: list[int], node_of) -> GroupSpan:
    per_node = Counter(node_of(r) for r in ranks)
    return GroupSpan(size=len(ranks), nodes=len(per_node), max_per_node=max(per_node.values()))


def consecutive_group(cluster: ClusterSpec, size: int, stride: int = 1) -> GroupSpan:
    """Where a group of ``size`` ranks 0, stride, 2·stride, ... sits (hybrid parallelism's classifier
    groups are consecutive ranks; the ranks holding the same classifier shard are ``stride`` apart)."""
    return _span_cached(cluster.gpus_per_node, size, stride)


@lru_cache(maxsize=4096)
def _span_cached(gpus_per_node: int, size: int, stride: int) -> GroupSpan:
    return _span([i * stride for i in range(size)], lambda rank: rank // gpus_per_node)

"""Where each rank of a layout sits, and which groups cross nodes.

Ranks are placed tensor-parallel innermost, then data-parallel, then pipeline (Megatron-LM's order):
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. With tp dividing the GPUs per node a tensor-parallel group
never leaves its node; data-parallel groups come next, pipeline neighbours are the farthest apart. Where a
degree does not divide the GPUs per node (6-GPU nodes and tp 4), groups of one kind sit differently (ranks 4-7
span two nodes, 0-3 do not): each kind is priced by its worst-placed group, the one every step waits for.
Pipeline boundaries each as placed: where several stages share a node (tp 2, pp 8 on 8-GPU nodes: four stages a
node) the boundaries between them stay on NVLink and one in four leaves the node, through the node's network shared
by the ranks that send out of it at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from paraplan.hardware_specs import ClusterSpec, GroupSpan


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


@dataclass(frozen=True)
class Placement:
    """Group spans of a layout on a cluster: of each kind the worst-placed group (most nodes, then fewest ranks
    on one node; where the degrees divide the GPUs per node every group of a kind is placed alike)."""

    tp: GroupSpan
    dp: GroupSpan
    pp_cross_node: bool  # do some pipeline neighbours sit on different nodes
    gpus_per_node_busy: int  # GPUs per node that take part (sharing the node's NICs)
    pp_senders_per_node: int = 0  # of them, the most on one node whose next stage sits on another (0: none leaves)
    pp_crossings: tuple[bool, ...] = ()  # per pipeline rank r: does its boundary with rank r + 1 (mod pp) leave a node

    def crosses(self, a: int, b: int) -> bool:
        """Does a send between pipeline ranks ``a`` and ``b`` leave a node? Neighbours (mod pp, the interleaved
        schedule's wrap from the last rank to the first included): their boundary's own placement; any other pair
        (no schedule here sends between them): where any boundary does."""
        pp = len(self.pp_crossings)
        if a == b or pp == 0:
            return False
        if (a + 1) % pp == b:
            return self.pp_crossings[a]
        if (b + 1) % pp == a:
            return self.pp_crossings[b]
        return self.pp_cross_node


def placement(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> Placement:
    return _placement(cluster.gpus_per_node, cluster.nodes, dp, tp, pp)


def layout_placement(cluster: ClusterSpec, lay) -> Placement:
    """The placement of a layout whose data-parallel groups are its dp x cp ranks: context-parallel ranks sit
    between tensor- and data-parallel ones (the executor's mesh (pp, dp, cp, tp), Megatron-Core's tp-cp-dp-pp
    order), so the ranks that share a model chunk are consecutive tensor-parallel groups, as dp alone is."""
    return placement(cluster, lay.dp * lay.cp, lay.tp, lay.pp)


def cp_group(cluster: ClusterSpec, lay) -> GroupSpan:
    """Where a context-parallel group sits: cp ranks ``tp`` apart (tensor parallelism innermost)."""
    return consecutive_group(cluster, lay.cp, lay.tp, lay.num_gpus)


@lru_cache(maxsize=4096)
def _placement(gpus_per_node: int, nodes: int, dp: int, tp: int, pp: int) -> Placement:
    world = dp * tp * pp
    busy = min(gpus_per_node, world)
    senders = _stage_senders(gpus_per_node, tp * dp, world) if pp > 1 else 0
    return Placement(tp=_groups_span(gpus_per_node, tp, 1, _reach(tp, gpus_per_node, world)),
                     dp=_groups_span(gpus_per_node, dp, tp, _reach(tp * dp, gpus_per_node, world)),
                     pp_cross_node=senders > 0, gpus_per_node_busy=busy, pp_senders_per_node=senders,
                     pp_crossings=_stage_crossings(gpus_per_node, tp * dp, pp) if pp > 1 else ())


def _stage_crossings(gpus_per_node: int, stage_ranks: int, pp: int) -> tuple[bool, ...]:
    """Per pipeline rank r, whether some rank of stage r's ``stage_ranks`` has its counterpart in rank r + 1's (mod
    pp) on another node. A stage of a node or more always does (its counterpart is at least a node further on)."""
    if stage_ranks >= gpus_per_node:
        return (True,) * pp
    node = lambda r: r // gpus_per_node  # noqa: E731
    return tuple(any(node(r * stage_ranks + x) != node((r + 1) % pp * stage_ranks + x) for x in range(stage_ranks))
                 for r in range(pp))


@lru_cache(maxsize=4096)
def _stage_senders(gpus_per_node: int, stage_ranks: int, world: int) -> int:
    """The most ranks of one node whose counterpart in the next pipeline stage (``stage_ranks`` further on) sits on
    another node: those share the node's network when the stages send at once. 0 where no boundary leaves a node
    (the whole pipeline on one). The pattern repeats every lcm(stage_ranks, GPUs per node) ranks. The interleaved
    schedule's wrap (the last stage's ranks back to the first's) is left out: its senders sit on the last node, which
    no forward boundary leaves, and number at most stage_ranks (or the node's GPUs), as many as at any node edge."""
    end = min(world - stage_ranks, _period(stage_ranks, gpus_per_node))
    out = Counter(r // gpus_per_node for r in range(end) if r // gpus_per_node != (r + stage_ranks) // gpus_per_node)
    return max(out.values(), default=0)


def _period(block: int, gpus_per_node: int) -> int:
    return block * gpus_per_node // math.gcd(block, gpus_per_node)


def _span(ranks: list[int], node_of) -> GroupSpan:
    return GroupSpan.of_counts(Counter(node_of(r) for r in ranks))


def _worst(groups, node_of) -> GroupSpan:
    """The span of the worst-placed of ``groups`` (lists of ranks): on the most nodes, then with the fewest ranks
    on one node (each of them carries that much more through the network), then on its fullest; with the most GPUs
    of one node in groups that leave their node (what shares that node's network when every group of the kind
    communicates at once)."""
    spans, crossing = [], Counter()
    for g in groups:
        span = _span(g, node_of)
        spans.append(span)
        if span.crosses_nodes:
            crossing.update(node_of(r) for r in g)
    worst = max(spans, key=lambda s: (s.nodes, -s.fewest_per_node, -s.max_per_node))
    return dataclasses.replace(worst, senders_per_node=max(crossing.values(), default=0))


def consecutive_group(cluster: ClusterSpec, size: int, stride: int = 1, world: int | None = None) -> GroupSpan:
    """Where a group of ``size`` ranks j, j + stride, j + 2·stride, ... sits (hybrid parallelism's classifier
    groups are consecutive ranks; the ranks holding the same classifier shard are ``stride`` apart), the
    worst-placed of such groups: blocks of size·stride ranks, each holding ``stride`` of them, among the job's
    ``world`` ranks (None: as if it went on; a job of 4 ranks on 6-GPU nodes has no group straddling two nodes)."""
    return _groups_span(cluster.gpus_per_node, size, stride, _reach(size * stride, cluster.gpus_per_node, world))


def _reach(block: int, gpus_per_node: int, world: int | None) -> int:
    """How far the groups' pattern need be looked at: it repeats every lcm(block, GPUs per node) ranks."""
    period = _period(block, gpus_per_node)
    return period if world is None else min(world, period)


def ring_senders(cluster: ClusterSpec, size: int, stride: int = 1, world: int | None = None) -> int:
    """The most ranks of one node that send to another node at once when every group of :func:`consecutive_group`
    passes data round its ring (each rank to the next of its group, the last to the first: context parallelism's
    K/V ring). Only a group's node-leaving edges use the network: cp 4 at stride 4 on 8-GPU nodes has 4 such
    senders a node, not all 8 GPUs of groups that leave it. ``world``: as consecutive_group's."""
    return _ring_senders(cluster.gpus_per_node, size, stride, _reach(size * stride, cluster.gpus_per_node, world))


@lru_cache(maxsize=4096)
def _ring_senders(gpus_per_node: int, size: int, stride: int, reach: int) -> int:
    out: Counter = Counter()
    for ring in _groups(size, stride, reach):
        out.update(r // gpus_per_node for r, nxt in zip(ring, ring[1:] + ring[:1], strict=True)
                   if r // gpus_per_node != nxt // gpus_per_node)
    return max(out.values(), default=0)


@lru_cache(maxsize=4096)
def _groups_span(gpus_per_node: int, size: int, stride: int, reach: int) -> GroupSpan:
    """The worst-placed group (:func:`_worst`) of the groups of :func:`_groups` up to rank ``reach`` (:func:`_reach`:
    the job's ranks, or as far as the pattern needs: it repeats after lcm(block, GPUs per node) ranks)."""
    return _worst(_groups(size, stride, reach), lambda rank: rank // gpus_per_node)


def _groups(size: int, stride: int, reach: int):
    """The groups of ``size`` ranks ``stride`` apart, ``stride`` of them in each block of size·stride consecutive
    ranks, in the blocks that start below ``reach``."""
    block = size * stride
    return ([b + j + i * stride for i in range(size)] for b in range(0, reach, block) for j in range(stride))

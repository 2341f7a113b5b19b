"""Tied embedding and LM head split across pipeline stages (Megatron-LM's approach).

When the plan puts the token embedding and the tied output projection in different stages, each of
those stages keeps its own copy, initialised identically (chunks.materialize). After backward their
gradients are summed, so both copies take the same optimizer step and stay equal: the model trains
exactly as if the weight were one tensor. Across pipeline ranks the sum is an all-reduce in a group
of the two end ranks (one such group per data/context/tensor-parallel position); when both stages sit on
the same rank (the V of ZB-V) it is a local add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paraplan.models import ModelSpec, tied_aliases

from .chunks import Chunk
from .optim import local
from .parallel_dims import ParallelDims


@dataclass
class TiedSync:
    """The tied copies this rank holds and the group that sums their gradients with the other end."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None  # None: no peer rank (both copies local, or none)

    @torch.no_grad()
    def sync_grads(self) -> None:
        held = [p for p in self.params if p.grad is not None]
        for p in held:  # a vocab-parallel embedding's gradient may come back replicated: shard it like p
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local(p.grad) for p in held]  # same shapes: the copies are sharded alike
        if not grads:
            return
        total = grads[0].clone() if len(grads) == 1 else torch.stack(grads).sum(0)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            g.copy_(total)


def stage_of(param_fqn: str, stages: list[list[str]]) -> int:
    """The stage whose blocks hold parameter ``param_fqn``."""
    for i, blocks in enumerate(stages):
        if any(param_fqn.startswith(b + ".") for b in blocks):
            return i
    raise AssertionError(f"no stage holds {param_fqn}")


def build_tied_syncs(chunks: list[Chunk], spec: ModelSpec, dims: ParallelDims, stages: list[list[str]],
                     stage_rank, rank: int, timeout) -> list[TiedSync]:
    """Collective (every rank calls it): the tied-weight gradient syncs this rank takes part in.

    ``stage_rank(stage)`` gives the pipeline rank that runs a stage. A sync is needed only where a
    tied pair is split over two stages.
    """
    syncs = []
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
    cp_rank = dims.cp_rank(rank)
    for alias, target in tied_aliases(spec).items():
        a, b = stage_of(target, stages), stage_of(alias, stages)
        if a == b:
            continue  # one chunk holds both: they are the same Parameter
        ends = sorted({stage_rank(a), stage_rank(b)})
        group = None
        if len(ends) == 2:  # every rank creates every group, in the same order (c10d's rule)
            for d in range(dims.dp):
                for c in range(dims.cp):
                    for t in range(dims.tp):
                        g = dist.new_group([dims.rank(p, d, t, c) for p in ends], timeout=timeout)
                        if (d, c, t) == (dp_rank, cp_rank, tp_rank) and pp_rank in ends:
                            group = g
        params = []
        for name in (target, alias):
            for chunk in chunks:
                try:
                    params.append(chunk.module.get_parameter(name))
                except AttributeError:
                    continue
        if params:
            syncs.append(TiedSync(params=params, group=group))
    return syncs

"""The optimizer: AdamW with fixed settings, and ZeRO stage 1's sharded optimizer states.

Settings are fixed (no schedule, no clipping) so a run is a deterministic function of the plan:
the tests replay the same updates in one process and compare losses.

:class:`ShardedOptimizer` is ZeRO-1 (Rajbhandari et al. 2020): gradients stay replicated (DDP
all-reduces them), but each data-parallel rank keeps the AdamW moments of, and updates, only its own
share of the parameters; each owner then broadcasts its updated parameters to the others. It works
on local shards, so it composes with tensor-parallel (DTensor) parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with the executor's fixed settings. torch's default implementation for plain tensors; a
    per-tensor loop when DTensors are present (one foreach call may not mix meshes or plain tensors)."""
    params = list(params)
    foreach = False if any(isinstance(p, DTensor) for p in params) else None
    return torch.optim.AdamW(params, foreach=foreach, **ADAMW)


def partition(params: list[nn.Parameter], parts: int) -> list[int]:
    """Owner (0 .. parts-1) of each parameter: greedy by size, largest first, so shares are balanced."""
    owner = [0] * len(params)
    load = [0] * parts
    for i in sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += local(params[i]).numel()
    return owner


class ShardedOptimizer:
    """ZeRO-1 over the data-parallel group ``group``: AdamW states for this rank's share only.

    Expert-parallel experts (``expert_params``) are replicated over another group, the expert-data-parallel
    ``expert_group``: they are shared out over it instead. ``owner[i]`` is the rank in ``group`` owning
    ``params[i]``; for an expert parameter it is this rank's own when this rank owns it, else -1 (so
    ``owner[i] == rank`` says which states this rank keeps, for either kind)."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 expert_params: Iterable[nn.Parameter] = (), expert_group: dist.ProcessGroup | None = None):
        expert_ids = {id(p) for p in expert_params}
        params = list(params)
        dense = [p for p in params if id(p) not in expert_ids]
        experts = [p for p in params if id(p) in expert_ids]
        self.params = dense + experts
        self.group = group
        self.rank = dist.get_rank(group)
        self._sections = [(dense, group, partition(dense, dist.get_world_size(group)))]
        self.owner = list(self._sections[0][2])
        if experts:
            owners = partition(experts, dist.get_world_size(expert_group))
            self._sections.append((experts, expert_group, owners))
            mine = dist.get_rank(expert_group)
            self.owner += [self.rank if o == mine else -1 for o in owners]
        kept = [p for p, o in zip(self.params, self.owner, strict=True) if o == self.rank]
        self.inner = adamw(kept) if kept else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        for params, group, owners in self._sections:
            if dist.get_world_size(group) == 1:
                continue
            for r in range(dist.get_world_size(group)):  # one broadcast per owner: its params, flattened
                owned = [local(p) for p, o in zip(params, owners, strict=True) if o == r]
                if not owned:
                    continue
                flat = torch.cat([t.reshape(-1) for t in owned])  # (sum of numels,)
                dist.broadcast(flat, group=group, group_src=r)
                offset = 0
                for t in owned:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()



def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (local shards): what ZeRO 1-3 divide by dp. A
    parameter-server worker holds none (its servers do)."""
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return 0
    return sum(local(t).numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))

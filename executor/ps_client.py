"""A worker's end of the parameter-server protocol (:mod:`.ps_protocol`), in the optimizer's place.

The trainer calls ``step()`` after a step's backward as it would an optimizer's: the worker pushes
its flattened gradient, one contiguous shard to each server, posts the receives for the servers'
replies, and loads the replies the protocol says the next step runs on (those to this push when
sync; those to the push s steps back when the staleness bound is s). ``finish()`` drains the replies
still in flight, leaving the freshest parameters in the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .ps_protocol import PSRoles, flat_grads, load_flat, shard_bounds


class PSClient:
    def __init__(self, params: list[nn.Parameter], roles: PSRoles):
        self.params = list(params)
        self.roles = roles
        self.bounds = shard_bounds(sum(p.numel() for p in self.params), roles.servers)
        self.pushed = 0
        self._pending: dict[int, tuple[torch.Tensor, list, list[torch.Tensor], list]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Push this step's gradients; load the replies the next step runs on."""
        t = self.pushed
        flat = flat_grads(self.params)  # (P,) kept alive until the sends complete
        sends, replies, recvs = [], [], []
        for j, (lo, hi) in enumerate(self.bounds):
            server = self.roles.server_rank(j)
            reply = torch.empty(hi - lo, dtype=torch.float32, device=flat.device)  # (shard_j,)
            # send first: nccl runs one pair's operations in issue order, and the server answers only
            # after this push; the receive is still posted before any waiting, so gloo matches it too
            sends.append(dist.isend(flat[lo:hi], dst=server, tag=t))
            recvs.append(dist.irecv(reply, src=server, tag=t))
            replies.append(reply)
        self._pending[t] = (flat, sends, replies, recvs)
        self.pushed += 1
        need = self.roles.reply_needed_after_push(t)
        if need is not None:
            self._load(need)

    def finish(self) -> None:
        """Wait for every reply still in flight; the model ends with the newest parameters."""
        for t in sorted(self._pending):
            self._load(t)

    def _load(self, t: int) -> None:
        _, sends, replies, recvs = self._pending.pop(t)
        for work in [*sends, *recvs]:
            work.wait()
        load_flat(self.params, torch.cat(replies))  # (P,)

"""A parameter-server rank: holds one shard of the parameters and their AdamW state, and serves the
workers' pushes in the order :mod:`.ps_protocol` fixes (sync rounds, or one push at a time when async).

A server builds the whole model once to draw the reference initial values (so they never depend on
the layout), keeps its contiguous shard of the flattened parameters in fp32 and frees the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .chunks import build_chunks, materialize
from .job import Job
from .optim import adamw
from .ps_protocol import PSRoles, flat_params, shard_bounds


class ParameterServer:
    def __init__(self, job: Job, rank: int, device: torch.device):
        self.roles = PSRoles.of(job.layout)
        self.rank = rank
        self.device = device
        (chunk,) = build_chunks(job.spec, job.plan.stages, job.layout.schedule, 0, 1)  # the whole model
        materialize(chunk.module, job.spec, job.plan.seed, device)
        flat = flat_params(list(chunk.module.parameters()))  # (P,)
        lo, hi = shard_bounds(flat.numel(), self.roles.servers)[self.roles.server_index(rank)]
        self.shard = nn.Parameter(flat[lo:hi].clone())  # (hi - lo,) fp32
        del chunk, flat
        self.optimizer = adamw([self.shard])
        self._sends: list[tuple[torch.Tensor, object]] = []  # replies in flight, with their buffers

    def serve(self, steps: int, on_step: Callable[[int], None] = lambda t: None) -> None:
        """Serve ``steps`` steps of every worker, then wait until every reply has gone out."""
        for t in range(steps):
            on_step(t)
            self._flush()
            grads = self._receive(t)
            if self.roles.staleness == 0:
                total = grads[0].wait_value().clone()
                for g in grads[1:]:
                    total += g.wait_value()  # worker order: deterministic
                self._apply(total / self.roles.workers)
                snapshot = self.shard.detach().clone()
                for w in range(self.roles.workers):
                    self._reply(w, t, snapshot)
            else:
                for w, g in enumerate(grads):  # one update per push, in worker order
                    self._apply(g.wait_value() / self.roles.workers)
                    self._reply(w, t, self.shard.detach().clone())
        self._flush()

    def _receive(self, t: int) -> list[_Incoming]:
        """Post a receive for every worker's push of step ``t`` (transfers overlap; applied in order)."""
        out = []
        for w in range(self.roles.workers):
            buf = torch.empty_like(self.shard, requires_grad=False)  # (shard,)
            out.append(_Incoming(buf, dist.irecv(buf, src=w, tag=t)))
        return out

    @torch.no_grad()
    def _apply(self, grad: torch.Tensor) -> None:
        self.shard.grad = grad
        self.optimizer.step()
        self.shard.grad = None

    def _reply(self, worker: int, t: int, snapshot: torch.Tensor) -> None:
        self._sends.append((snapshot, dist.isend(snapshot, dst=worker, tag=t)))

    def _flush(self) -> None:
        for _, work in self._sends:
            work.wait()
        self._sends.clear()


class _Incoming:
    """A posted receive and its buffer."""

    def __init__(self, buf: torch.Tensor, work):
        self.buf, self.work = buf, work

    def wait_value(self) -> torch.Tensor:
        self.work.wait()
        return self.buf

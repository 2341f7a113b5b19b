"""The parameter-server protocol (``dp_mode: ps``): who is who, how parameters are cut, what goes over the wire.

Roles. The plan's ``dp`` = N ranks 0 .. N-1 are workers (tp = pp = 1); the ``ps_servers`` = k ranks
N .. N+k-1 are servers (``Layout.world_size = N + k``). Workers hold a full copy of the model, compute
gradients on their data-parallel slice of each global batch (:mod:`.batches`, exactly as data
parallelism with dp = N) and never run an optimizer; servers hold the parameters, sharded, and run
AdamW (the executor's settings, fp32) on their shard.

Sharding. Every rank flattens the model's parameters in ``model.parameters()`` order (the same on
every rank: the model is built from the spec) into one vector of P elements; server j holds elements
``[j*P//k, (j+1)*P//k)``. Contiguous shards make a push or a pull one message per (worker, server)
pair, and shard sizes differ by at most one element, so every server link carries the same bytes
(what the cost model assumes). A cut may fall inside a parameter: AdamW is elementwise, so where it
falls never changes an update.

Messages (point-to-point, gloo or nccl, over the default group). At step t worker w sends server j its
gradient shard (tag t), the gradient of the mean loss over its own samples of step t (accumulated
over its micro-batches), and server j answers with its parameter shard (tag t), "the reply to push
(w, t)". Workers post the receive for a reply right after the push, before waiting on anything, so a
server's send is always matched; every pair's messages go in issue order (what nccl, which ignores
tags, needs).

Sync mode (``ps_staleness`` s = 0). Server j, in round t, receives the N workers' shards of step t,
sums them in worker order and divides by N, takes one AdamW step and sends the new shard to every
worker. A worker waits for the replies to its push t before starting step t+1. Every step therefore
applies exactly the gradient of the global batch's mean loss once, as ring all-reduce data
parallelism with dp = N does: the losses match that run (tests/test_executor_ps.py).

Async mode with staleness bound s >= 1 (bounded staleness, deterministic):

- Server j applies pushes one at a time, in the fixed order (t, w) = (0, 0), (0, 1), ..., (0, N-1),
  (1, 0), ...: push (w, t) is one AdamW step on gradient / N, and right after it the server sends
  worker w its shard as it then stands (the reply to push (w, t)). A push that arrives early waits
  for its turn.
- Worker w starts step t with the parameters of the replies to its push t-1-s (the initial,
  reference-initialised parameters while t-1-s < 0). So at most its last s pushes are missing from
  the parameters it computes with; with s = 1 it pushes step t-1 and starts step t at once,
  overlapping that round trip with compute.
- Hence the parameters of (w, t) are every server's state right after push (w, t-1-s): they hold
  every worker's pushes of steps <= t-2-s and, of step t-1-s, those of workers 0 .. w. A worker can
  start step t only once all workers have pushed step t-2-s, so no worker runs more than s + 1 steps
  ahead of the slowest (stale synchronous parallel with slack s + 1).
- The fixed order makes a run deterministic: the same plan gives the same losses however the
  processes are scheduled, and a one-process replay of these rules gives them too (the test does).
- Losses are reduced over the workers once, after the last step (a per-step all-reduce would make
  the workers wait for each other); each step's figure is still the mean over all N workers' samples
  of that step, each computed with the parameters that worker had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paraplan.planner.layout import Layout


@dataclass(frozen=True)
class PSRoles:
    """The ranks of a parameter-server run and its staleness bound."""

    workers: int  # N, ranks 0 .. N-1
    servers: int  # k, ranks N .. N+k-1
    staleness: int  # s: 0 = sync

    @classmethod
    def of(cls, layout: Layout) -> PSRoles:
        return cls(workers=layout.num_gpus, servers=layout.ps_servers, staleness=layout.ps_staleness)

    @property
    def world_size(self) -> int:
        return self.workers + self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def server_rank(self, j: int) -> int:
        return self.workers + j

    def server_index(self, rank: int) -> int:
        return rank - self.workers

    def reply_needed_after_push(self, t: int) -> int | None:
        """Whose reply a worker loads after pushing step ``t``: that of push t - s (None: none yet), so
        that step t+1 runs on the replies to push (t+1)-1-s."""
        need = t - self.staleness
        return need if need >= 0 else None


def shard_bounds(total: int, servers: int) -> list[tuple[int, int]]:
    """[lo, hi) of each server's shard of a flat vector of ``total`` elements: contiguous, in server
    order, sizes differing by at most one."""
    return [(j * total // servers, (j + 1) * total // servers) for j in range(servers)]


def flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters as one fp32 vector, (P,)."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients as one fp32 vector, (P,); a parameter without a gradient contributes zeros."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


@torch.no_grad()
def load_flat(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy a (P,) vector back into the parameters, in place."""
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    assert offset == flat.numel(), (offset, flat.numel())

"""Context parallelism: each sequence split over the cp ranks of its data-parallel replica (issue 14).

Which tokens (Llama 3 paper, arXiv 2407.21783 Sec. 3.3.2): with causal attention the sequence is cut into
2·cp equal chunks and cp rank c holds chunks c and 2·cp-1-c, so every rank has as many early (cheap) as
late (expensive) queries; non-causal models (BERT) hold plain consecutive chunks, chunk c on rank c.
Everything token-wise (embedding, norms, MLPs, experts, the head and the loss) runs on the local tokens;
learned and rotary positions are the tokens' global ones (:class:`ContextShard` on the embedding and
attention modules, models.transformer.SequenceShard).

Attention (the Llama 3 form): each rank all-gathers the keys and values of its group (after the rotary
embedding, before grouped-query heads are repeated), and its local queries attend all of them under the
mask "key position <= query position"; the all-gather's backward is a reduce-scatter of dK and dV, so
every rank gets the gradient of its own keys and values from every rank's queries. This form runs on any
device with gloo or nccl (torch's ``context_parallel`` has no CPU sharding rule for SDPA); a ring would
overlap the exchange with compute, the all-gather keeps it simple and exact.

The loss of a cp rank is the mean over its tokens; the cp ranks of a replica hold equally many, so the
mean of their means is the sequence's mean. Gradients are averaged over dp x cp (the data mesh flattens
them: parallel_dims.py), which is exactly that mean's gradient. Under tensor parallelism with sequence
parallelism the local tokens are split again over tp; pipeline stages exchange the local (b, s/cp, h)
(or (b, s/(cp·t), h)) residual stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def chunk_positions(seq_length: int, cp: int, cp_rank: int, causal: bool) -> torch.Tensor:
    """(s/cp,) int64: the positions of the sequence cp rank ``cp_rank`` holds, ascending."""
    if cp == 1:
        return torch.arange(seq_length)
    if not causal:
        size = seq_length // cp
        return torch.arange(cp_rank * size, (cp_rank + 1) * size)
    size = seq_length // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * size, (cp_rank + 1) * size), torch.arange(late * size, (late + 1) * size)])


class ContextShard:
    """models.transformer.SequenceShard for cp rank ``cp_rank`` of ``group``: its positions, the gathered
    keys' positions (rank order) and the causal mask between them."""

    def __init__(self, group: dist.ProcessGroup, cp: int, cp_rank: int, seq_length: int, causal: bool):
        self.group, self.cp = group, cp
        self._local = chunk_positions(seq_length, cp, cp_rank, causal)  # (s/cp,)
        gathered = torch.cat([chunk_positions(seq_length, cp, r, causal) for r in range(cp)])  # (s,) rank order
        self._mask = self._local[:, None] >= gathered[None, :]  # (s/cp, s) bool
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self._local.to(device), self._mask.to(device))
        return self._on[device]

    def positions(self, device: torch.device) -> torch.Tensor:
        return self._tensors(device)[0]

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        return self._tensors(device)[1]

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # (b, a, s/cp, d) -> (b, a, s, d)
        return _GatherKV.apply(x, self.group, self.cp)

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of (b, s) token ids or targets -> (b, s/cp)."""
        return x[:, self._local.to(x.device)]


class _GatherKV(torch.autograd.Function):
    """Forward: (b, a, s/cp, d) all-gathered over the cp group into (b, a, s, d), ranks in order along the
    sequence; backward: the gradient reduce-scattered (summed over the ranks whose queries used the keys)."""

    @staticmethod
    def forward(ctx, x, group, cp: int):
        ctx.group, ctx.cp = group, cp
        x = x.transpose(0, 2).contiguous()  # (s/cp, a, b, d): the sequence first, so ranks' blocks are contiguous
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))  # (s, a, b, d)
        dist.all_gather_single(out, x, group=group)
        return out.transpose(0, 2)  # (b, a, s, d)

    @staticmethod
    def backward(ctx, grad):  # (b, a, s, d) -> (b, a, s/cp, d)
        grad = grad.transpose(0, 2).contiguous()  # (s, a, b, d)
        out = grad.new_empty((grad.shape[0] // ctx.cp, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad, group=ctx.group)  # reduce_scatter_tensor, renamed in torch 2.1x
        return out.transpose(0, 2), None, None


def apply_cp(module: nn.Module, shard: ContextShard) -> None:
    """Give the embedding and every attention module of ``module`` (a chunk, on meta or not) the shard."""
    from paraplan.models.transformer import Attention, Embedding, LatentAttention

    for mod in module.modules():
        if isinstance(mod, Embedding | Attention | LatentAttention):
            mod.sequence_shard = shard

"""Expert parallelism, and the MoE block under tensor and context parallelism.

Folding (Megatron-Core's MoE parallel folding; the mesh is parallel_dims.py's): within a pipeline stage the
dp x cp x tp ranks are numbered ``i = tp_rank + tp * (cp_rank + cp * dp_rank)`` and cut as expert tensor
parallelism innermost (etp, not executed yet: etp = 1), then expert parallelism (ep: consecutive ranks, so
an ep group is a tensor-parallel group first), then expert data parallelism (edp = dp·cp·tp / ep). Rank
``ep_rank`` holds the routed experts ``[ep_rank·E/ep, (ep_rank+1)·E/ep)``: the stacked (E, in, out) weights
become DTensors sharded over the ep mesh on dim 0 (whole experts), so initialisation, FSDP2 and DCP see
the whole model's tensors.

Dispatch (:class:`AllToAllDispatch`, swapped into each ``MoE.dispatch``): the router's (token, slot) pairs
are sorted by expert, hence by owning rank; the tokens per expert are exchanged (one all-to-all of E
counts), then the tokens (``all_to_all_single`` with uneven splits); the received rows are regrouped by
local expert, run through the local experts, put back in arrival order and returned by the reverse
all-to-all, then weighted and summed per token as in ``models.moe.local_dispatch``. Autograd runs
through both token all-to-alls (the backward of one is the other with the splits swapped). On fake
tensors (the dry run) routing is balanced and every rank routes the same number of tokens, so the counts
a rank receives are its own, read without values.

The MoE block under tensor parallelism: every tensor-parallel rank runs the block (router, auxiliary
loss, routed and shared experts) on its own 1/t of the sequence: with sequence parallelism that is the
sequence shard it already holds; without, the block takes its shard of the (replicated) input and
all-gathers its output (backward: the shards' input gradients all-gathered, the output gradient — the
same on every rank — sliced). Tokens are then never routed twice, and each expert sees every token
exactly once over the stage. The block's replicated weights (router gate, shared experts, and routed
experts when ep = 1) see only 1/t of the tokens, so their gradients are summed over the tensor-parallel
group after the backward (:class:`SumGrads`); the sequence-wise auxiliary loss counts tokens per expert
over the whole sequence (``models.moe.SequenceShards``).

Gradients of expert-parallel experts: each owner accumulates the gradient of every token routed to its
experts from its ep group; FSDP2 / replicate average over the edp group; since every token of the stage
is seen once, the sum over the stage's ranks is dp·cp times the gradient of the mean loss, so the edp
average is multiplied by edp / (dp·cp) = tp / ep (:class:`ScaleGrads`; Megatron-Core scales expert
gradients by 1 / data-parallel size the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .optim import local


class AllToAllDispatch:
    """``MoE.dispatch`` over the ``ep`` ranks of ``group``: x (T, h), expert_idx / weights (T, k), counts (E,)
    python ints, experts holding this rank's E/ep experts -> (T, h)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, ep_rank: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, counts: list[int],
                 experts: nn.Module) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        from paraplan.models.moe import has_no_values

        k, ep = expert_idx.shape[1], self.ep
        per_rank = len(counts) // ep  # experts per ep rank
        order = torch.argsort(expert_idx.reshape(-1), stable=True)  # (T·k,) slots grouped by expert, hence by owner
        token = order // k  # (T·k,) the token of each slot
        received_counts = self._exchange_counts(counts, x.device, per_rank, values=not has_no_values(x))
        send_splits = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]
        recv_splits = [sum(row) for row in received_counts]
        rows = all_to_all_single_autograd(x[token], recv_splits, send_splits, self.group)  # (N, h) by source
        # regroup the received rows by local expert (stable: within an expert, by source rank)
        blocks = torch.tensor(received_counts, dtype=torch.long, device=x.device).reshape(-1)  # (ep·E_local,)
        expert_of_row = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(
            blocks, output_size=sum(recv_splits))  # (N,)
        perm = torch.argsort(expert_of_row, stable=True)  # (N,)
        per_expert = [sum(row[e] for row in received_counts) for e in range(per_rank)]
        out = experts(rows[perm], per_expert)  # (N, h) grouped by local expert
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=x.device))
        back = all_to_all_single_autograd(out[inverse], send_splits, recv_splits, self.group)  # (T·k, h) as sent
        back = back * weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)  # (T·k, h) weighted
        return torch.zeros_like(x).index_add_(0, token, back)  # (T, h) summed over each token's k slots

    def _exchange_counts(self, counts: list[int], device: torch.device, per_rank: int,
                         values: bool) -> list[list[int]]:
        """received[r][e]: tokens ep rank r sends to this rank's local expert e (one all-to-all of E ints)."""
        sent = torch.tensor(counts, dtype=torch.long, device=device)  # (E,) in owner order
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        if not values:  # fake tensors: balanced routing, the same counts on every rank
            mine = counts[self.ep_rank * per_rank:(self.ep_rank + 1) * per_rank]
            return [list(mine) for _ in range(self.ep)]
        return got.view(self.ep, per_rank).tolist()


def moe_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, MoE block) pairs of ``module``."""
    from paraplan.models.moe import MoE

    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The routed experts (GroupedExperts) of every MoE block of ``module``."""
    return [m.experts for _, m in moe_modules(module)]


def shard_experts(module: nn.Module, ep_mesh, ep_rank: int) -> None:
    """Expert parallelism on ``module`` (a chunk on the meta device): each MoE block's routed experts become
    DTensors sharded over ``ep_mesh`` on dim 0, and its dispatch the all-to-all one."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for _, moe in moe_modules(module):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        moe.dispatch = AllToAllDispatch(ep_mesh.get_group(), ep_mesh.size(), ep_rank)


@dataclass
class SequenceSplit:
    """How each rank's MoE blocks see part of every sequence: over ``parts`` ranks of ``group`` (tensor- and
    context-parallel ranks), whose gradients are averaged over ``averaged`` of them (the cp ranks)."""

    group: dist.ProcessGroup
    parts: int
    averaged: int = 1

    def sum_parts(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t


def split_moe_tokens(module: nn.Module, tp_mesh, sequence_parallel: bool, split: SequenceSplit | None) -> None:
    """The MoE blocks of ``module`` under tensor / context parallelism (module docstring): without sequence
    parallelism each tensor-parallel rank takes its 1/t of the sequence in and all-gathers the block's
    output; the auxiliary loss sums tokens per expert over ``split``."""
    from paraplan.models.moe import SequenceShards

    for _, moe in moe_modules(module):
        if split is not None:
            moe.sequence_shards = SequenceShards(parts=split.parts, sum_parts=split.sum_parts,
                                                 grad_factor=float(split.averaged))
        if tp_mesh is not None and tp_mesh.size() > 1 and not sequence_parallel:
            share = (tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank())
            moe.register_forward_pre_hook(lambda _, args, share=share: (_SliceSequence.apply(args[0], *share),))
            moe.register_forward_hook(lambda _, args, out, share=share: _GatherSequence.apply(out, *share))


def tp_partial_moe_params(module: nn.Module, expert_parallel: bool) -> list[str]:
    """Names (in ``module``) of the MoE weights replicated over tensor-parallel ranks that each see 1/t of the
    tokens: the router gate, the shared experts, and the routed experts unless they are expert-parallel."""
    names = []
    for name, moe in moe_modules(module):
        for pname, _ in moe.named_parameters():
            if expert_parallel and pname.startswith("experts."):
                continue
            names.append(f"{name}.{pname}")
    return names


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, parts: int) -> torch.Tensor:
    """All-gather (b, s/t, ...) shards into (b, s, ...), rank order along the sequence."""
    out = x.new_empty((parts * x.shape[0], *x.shape[1:]))  # (t·b, s/t, ...)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(parts, *x.shape).transpose(0, 1).reshape(x.shape[0], -1, *x.shape[2:])  # (b, s, ...)


class _SliceSequence(torch.autograd.Function):
    """Forward: this rank's 1/t of the sequence (dim 1) of a tensor every rank holds whole; backward: the
    ranks' shard gradients all-gathered into the whole tensor's gradient."""

    @staticmethod
    def forward(ctx, x, group, parts: int, rank: int):  # (b, s, h) -> (b, s/t, h)
        ctx.group, ctx.parts = group, parts
        return x.chunk(parts, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # (b, s/t, h) -> (b, s, h)
        return gather_sequence(grad, ctx.group, ctx.parts), None, None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: the ranks' sequence shards all-gathered; backward: the whole output's gradient, the same on
    every rank (replicated activations), sliced to this rank's shard."""

    @staticmethod
    def forward(ctx, x, group, parts: int, rank: int):  # (b, s/t, h) -> (b, s, h)
        ctx.parts, ctx.rank = parts, rank
        return gather_sequence(x, group, parts)

    @staticmethod
    def backward(ctx, grad):  # (b, s, h) -> (b, s/t, h)
        return grad.chunk(ctx.parts, dim=1)[ctx.rank].contiguous(), None, None, None


@dataclass
class SumGrads:
    """Sums the gradients of ``params`` over ``group`` after the step's backward (one flat all-reduce):
    replicated weights that each rank of the group used on its own part of the tokens or heads."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup

    @torch.no_grad()
    def sync_grads(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@dataclass
class ScaleGrads:
    """Multiplies the gradients of ``params`` by ``factor`` after the step's backward (expert gradients:
    tp / ep, see the module docstring)."""

    params: list[nn.Parameter]
    factor: float

    @torch.no_grad()
    def sync_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                local(p.grad).mul_(self.factor)

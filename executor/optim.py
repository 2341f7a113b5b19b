"""The optimizer: AdamW with fixed settings, and ZeRO stage 1's sharded optimizer states.

Settings are fixed (no schedule, no clipping) so a run is a deterministic function of the plan:
the tests replay the same updates in one process and compare losses.

:class:`ShardedOptimizer` is ZeRO-1 (Rajbhandari et al. 2020): gradients stay replicated (DDP
all-reduces them), but each data-parallel rank keeps the AdamW moments of, and updates, only its own
share of the parameters, an even cut of them laid end to end (a tensor may be split, as in Megatron's
distributed optimizer: whole tensors would leave a rank with a large embedding far over its share);
each owner then broadcasts its updated share to the others. It works on local shards, so it composes
with tensor-parallel (DTensor) parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
# ZeRO-1 checkpoints move a parameter's state between ranks in runs of this many elements (64 MiB per fp32
# moment): a rank that does not save the parameter holds no more of it than that
CHECKPOINT_CHUNK = 1 << 24


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with the executor's fixed settings: torch's foreach implementation for plain tensors, on every device
    (torch's default on GPUs; on a CPU it would loop one tensor at a time, so the dry run would trace another
    step than a GPU runs: one temporary copy of every second moment, memory.step_bytes); a per-tensor loop when
    DTensors are present (one foreach call may not mix meshes or plain tensors)."""
    params = list(params)
    foreach = not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, foreach=foreach, **ADAMW)


def partition(params: list[nn.Parameter], parts: int) -> list[int]:
    """Owner (0 .. parts-1) of each parameter, whole: greedy by size, largest first, so shares are balanced
    as whole tensors allow. ZeRO-1's checkpoints: the rank that saves and loads a parameter's state."""
    owner = [0] * len(params)
    load = [0] * parts
    for i in sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += local(params[i]).numel()
    return owner


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of parameter ``index``'s local tensor, flattened: one rank's part of it."""

    index: int
    start: int
    stop: int


def flat_shares(sizes: list[int], parts: int) -> list[list[Piece]]:
    """Each part's pieces of the parameters laid end to end (``sizes``: their local element counts): part r
    owns elements ``r*s .. (r+1)*s`` of the concatenation, ``s = ceil(total / parts)``, so every share is
    even whatever the tensors' sizes (Megatron's distributed optimizer; the cost model's moments / dp)."""
    share = -(-sum(sizes) // parts)
    pieces: list[list[Piece]] = [[] for _ in range(parts)]
    offset = 0
    for index, size in enumerate(sizes):
        at = 0
        while at < size:
            r = (offset + at) // share
            stop = min(size, (r + 1) * share - offset)
            pieces[r].append(Piece(index, at, stop))
            at = stop
        offset += size
    return pieces


class ShardedOptimizer:
    """ZeRO-1 over the data-parallel group ``group``: AdamW states for this rank's even share only.

    The parameters' local tensors are laid end to end and cut into ``dp`` equal shares (:func:`flat_shares`),
    so a tensor may be split over ranks. Each rank's AdamW works on views of its pieces (no copy of the
    weights): it reads the pieces of the gradients and updates the pieces in place, then each owner
    broadcasts its share. Expert-parallel experts (``expert_params``) are replicated over another group, the
    expert-data-parallel ``expert_group``: they are shared out over it instead. Checkpoints keep one whole
    state per parameter (:meth:`whole_states`, :meth:`load_whole_states`)."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 expert_params: Iterable[nn.Parameter] = (), expert_group: dist.ProcessGroup | None = None):
        expert_ids = {id(p) for p in expert_params}
        params = list(params)
        dense = [p for p in params if id(p) not in expert_ids]
        experts = [p for p in params if id(p) in expert_ids]
        self.params = dense + experts
        self._sections = [_Section(dense, group)] + ([_Section(experts, expert_group)] if experts else [])
        self.views = [v for s in self._sections for v in s.views]
        self.inner = adamw(self.views) if self.views else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for v in self.views:
            v.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for section in self._sections:
            section.point_grads()
        if self.inner is not None:
            self.inner.step()
        for section in self._sections:
            section.share_updates()

    def whole_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Collective: id(parameter) -> its whole AdamW state (shaped like it, a DTensor for a DTensor
        parameter), for the parameters this rank saves in a checkpoint; each parameter is saved by one
        rank of its group, the greedy :func:`partition`'s owner, so the states are whole in the file."""
        return {k: v for s in self._sections for k, v in s.gather(self.inner).items()}

    def saved_params(self) -> list[nn.Parameter]:
        """The parameters whose whole state this rank saves and loads."""
        return [p for s in self._sections for p, o in zip(s.params, s.saver, strict=True) if o == s.rank]

    def load_whole_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Collective: each saver sends the whole states it loaded; every rank keeps its pieces."""
        for section in self._sections:
            section.scatter(states, self.inner)


class _Section:
    """The parameters one group shares out: their pieces on this rank, as parameters AdamW can update."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params, self.group = params, group
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shares = flat_shares([local(p).numel() for p in params], size)
        self.saver = partition(params, size)
        self.views = [nn.Parameter(self._flat(piece.index)[piece.start:piece.stop]) for piece in self.shares[self.rank]]
        self._mine: dict[int, list[tuple[Piece, nn.Parameter]]] = {}  # parameter index -> this rank's pieces of it
        for piece, view in zip(self.shares[self.rank], self.views, strict=True):
            self._mine.setdefault(piece.index, []).append((piece, view))

    def _flat(self, index: int) -> torch.Tensor:
        t = local(self.params[index]).detach()
        assert t.is_contiguous(), "ZeRO-1 pieces are views of contiguous parameters"
        return t.view(-1)  # (numel,)

    def point_grads(self) -> None:
        """Each view's gradient: the same elements of its parameter's gradient (none when it has none)."""
        for piece, view in zip(self.shares[self.rank], self.views, strict=True):
            grad = self.params[piece.index].grad
            view.grad = None if grad is None else local(grad).reshape(-1)[piece.start:piece.stop]

    def share_updates(self) -> None:
        """One broadcast per owner: its updated pieces, flattened, copied into the same elements here."""
        if len(self.shares) == 1:
            return
        for r, pieces in enumerate(self.shares):
            if not pieces:
                continue
            if r == self.rank:
                flat = torch.cat([self._flat(pc.index)[pc.start:pc.stop] for pc in pieces])  # (share,)
            else:
                flat = torch.empty(sum(pc.stop - pc.start for pc in pieces), dtype=self.params[pieces[0].index].dtype,
                                   device=local(self.params[pieces[0].index]).device)
            dist.broadcast(flat, group=self.group, group_src=r)
            if r != self.rank:
                offset = 0
                for pc in pieces:
                    n = pc.stop - pc.start
                    self._flat(pc.index)[pc.start:pc.stop].copy_(flat[offset:offset + n])
                    offset += n

    def _chunks(self, p: nn.Parameter):
        """``p``'s flattened elements in runs of at most CHECKPOINT_CHUNK, so that no rank holds a whole
        tensor's state but the one saving it."""
        n = local(p).numel()
        return [(a, min(n, a + CHECKPOINT_CHUNK)) for a in range(0, n, CHECKPOINT_CHUNK)]

    def _overlaps(self, index: int, a: int, b: int):
        """(view, start and stop in the view, start and stop in ``a:b``) of each of this rank's pieces of parameter
        ``index`` that elements ``a:b`` of the parameter overlap."""
        for pc, v in self._mine.get(index, ()):
            lo, hi = max(pc.start, a), min(pc.stop, b)
            if lo < hi:
                yield v, lo - pc.start, hi - pc.start, lo - a, hi - a

    def gather(self, inner) -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for index, p in enumerate(self.params):
            steps = torch.zeros(2, dtype=torch.float64)  # (sum of the pieces' steps, pieces with a state)
            for _, v in self._mine.get(index, ()):
                if inner.state.get(v):
                    steps += torch.tensor([float(inner.state[v]["step"]), 1.0], dtype=torch.float64)
            dist.all_reduce(steps, group=self.group)
            if steps[1] == 0:  # no piece has a state yet (never stepped)
                continue
            saver = self.saver[index] == self.rank
            whole = torch.empty(2, local(p).numel(), dtype=p.dtype, device=local(p).device) if saver else None
            for a, b in self._chunks(p):
                buf = torch.zeros(2, b - a, dtype=p.dtype, device=local(p).device)  # (moments, chunk)
                for v, s0, s1, c0, c1 in self._overlaps(index, a, b):
                    state = inner.state.get(v)
                    if state:
                        buf[0, c0:c1] = state["exp_avg"][s0:s1]
                        buf[1, c0:c1] = state["exp_avg_sq"][s0:s1]
                dist.reduce(buf, group=self.group, group_dst=self.saver[index])
                if saver:
                    whole[:, a:b] = buf
            if saver:
                out[id(p)] = {"step": torch.tensor(float(steps[0] / steps[1]), dtype=torch.float32),
                              "exp_avg": _like(p, whole[0]), "exp_avg_sq": _like(p, whole[1])}
        return out

    def scatter(self, states: dict[int, dict[str, torch.Tensor]], inner) -> None:
        for index, p in enumerate(self.params):
            saver = self.saver[index]
            step = torch.tensor([float(states[id(p)]["step"]) if saver == self.rank else 0.0], dtype=torch.float64)
            dist.broadcast(step, group=self.group, group_src=saver)
            for _, v in self._mine.get(index, ()):
                inner.state[v] = {"step": torch.tensor(float(step[0]), dtype=torch.float32),
                                  "exp_avg": torch.empty_like(v), "exp_avg_sq": torch.empty_like(v)}
            for a, b in self._chunks(p):
                if saver == self.rank:
                    buf = torch.stack([local(states[id(p)][k]).reshape(-1)[a:b] for k in ("exp_avg", "exp_avg_sq")])
                else:
                    buf = torch.empty(2, b - a, dtype=p.dtype, device=local(p).device)  # (moments, chunk)
                dist.broadcast(buf, group=self.group, group_src=saver)
                for v, s0, s1, c0, c1 in self._overlaps(index, a, b):
                    inner.state[v]["exp_avg"][s0:s1] = buf[0, c0:c1]
                    inner.state[v]["exp_avg_sq"][s0:s1] = buf[1, c0:c1]


def _like(p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (numel,) shaped like ``p``'s local tensor; a DTensor placed like ``p`` when it is one."""
    t = flat.view_as(local(p))
    if isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return t


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (local shards): what ZeRO 1-3 divide by dp. A
    parameter-server worker holds none (its servers do)."""
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return 0
    return sum(local(t).numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))

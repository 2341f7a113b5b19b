"""ZeRO-1's sharded AdamW (executor/optim.ShardedOptimizer) on 2 ranks (CPU, gloo): even shares that split a
tensor between the ranks, the same updates as one AdamW over everything, and whole per-parameter states for a
checkpoint (gathered and handed back in runs of CHECKPOINT_CHUNK elements, made small here so that a tensor
crosses several runs and a run crosses the ranks' boundary)."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned_rank import exit_passed_rank
from torch import nn

from paraplan.executor import optim
from paraplan.executor.machine import free_port

SHAPES = [(37, 5), (11,), (64, 3), (7,)]  # 395 elements: rank 0 owns 198 of them, two of (64, 3)
STEPS = 2


def test_even_shares_cover_every_element_once():
    sizes = [math.prod(shape) for shape in SHAPES]
    shares = optim.flat_shares(sizes, 2)
    assert [sum(p.stop - p.start for p in share) for share in shares] == [198, 197]
    covered = sorted((p.index, i) for share in shares for p in share for i in range(p.start, p.stop))
    assert covered == [(k, i) for k, n in enumerate(sizes) for i in range(n)]
    assert [(p.index, p.start, p.stop) for p in shares[1]][0] == (2, 2, 192)  # 198 - 185 - 11 = 2


def test_updates_and_checkpoint_states_equal_one_adamw(tmp_path):
    mp.spawn(_rank, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    params = [nn.Parameter(w.clone()) for w in _weights()]
    ref = optim.adamw(params)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        ref.step()
    got = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    for r in range(2):
        for p, q in zip(params, got[r]["params"], strict=True):
            torch.testing.assert_close(q, p.detach(), rtol=0, atol=1e-7)
    saved = {i: s for g in got for i, s in g["states"].items()}
    assert sorted(saved) == list(range(len(params)))  # every parameter's state saved whole, by one rank
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved[i][key], ref.state[p][key], rtol=0, atol=1e-9, msg=f"{i} {key}")
    for r in range(2):
        assert got[r]["reloaded_equal"], r  # handed back into a fresh optimizer, every piece's state as before
        assert got[r]["state_bytes"] == 2 * 4 * (198 if r == 0 else 197) + 4 * got[r]["pieces"]


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=gen) for shape in SHAPES]


def _rank(rank: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        optim.CHECKPOINT_CHUNK = 50  # runs of 50: (37, 5) in four, and one run holds both ranks' parts of (64, 3)
        params = [nn.Parameter(w.clone()) for w in _weights()]
        opt = optim.ShardedOptimizer(params, dist.group.WORLD)
        for step in range(STEPS):
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g
            opt.step()
        states = opt.whole_states()
        fresh = optim.ShardedOptimizer(params, dist.group.WORLD)
        fresh.load_whole_states(states)
        keys = ("exp_avg", "exp_avg_sq", "step")
        reloaded_equal = all(torch.equal(fresh.inner.state[b][k], opt.inner.state[a][k])
                             for a, b in zip(opt.views, fresh.views, strict=True) for k in keys)
        index = {id(p): i for i, p in enumerate(params)}
        torch.save({"params": [p.detach().clone() for p in params],
                    "states": {index[k]: {n: t.clone() for n, t in s.items()} for k, s in states.items()},
                    "reloaded_equal": reloaded_equal, "state_bytes": optim.optimizer_state_bytes(opt),
                    "pieces": len(opt.views)}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_passed_rank()

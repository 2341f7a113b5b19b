"""The vocabulary-parallel embedding (executor/tensor_parallel.VocabParallelEmbedding) on 2 ranks (CPU, gloo): its
lookup and its weight gradient equal a plain embedding's over the whole vocabulary. The executor's loss tests
cannot show this: their tokens are UTF-8 bytes (ids below 256), which all fall in the first rank's rows."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from spawned_rank import exit_passed_rank
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from paraplan.executor.machine import free_port
from paraplan.executor.tensor_parallel import VocabParallelEmbedding

HIDDEN = 16


@pytest.mark.parametrize("vocab", [1024, 1021])  # even shards, and torch.chunk's uneven ones (511 and 510 rows)
def test_lookup_and_gradient_equal_the_whole_embedding(tmp_path, vocab):
    mp.spawn(_rank, args=(vocab, free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    weight, ids, upstream = _draws(vocab)
    weight.requires_grad_()
    out = F.embedding(ids, weight)
    (out * upstream).sum().backward()
    rows = -(-vocab // 2)
    for rank in range(2):
        got = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        assert torch.allclose(got["out"], out.detach(), atol=1e-6), rank
        lo, hi = rank * rows, min(vocab, (rank + 1) * rows)
        assert got["placements"] == (Shard(0),)  # the gradient is sharded like the weight: no (V, h) copy
        assert got["grad"].shape == (hi - lo, HIDDEN)
        assert torch.allclose(got["grad"], weight.grad[lo:hi], atol=1e-6), rank


def _draws(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same on every rank and in the test: the whole weight (V, h), token ids (b, s) over the whole vocabulary and
    the output's gradient (b, s, h)."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(vocab, HIDDEN, generator=gen), torch.randint(0, vocab, (4, 64), generator=gen),
            torch.randn(4, 64, HIDDEN, generator=gen))


def _rank(rank: int, vocab: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        whole, ids, upstream = _draws(vocab)
        module = nn.Embedding(vocab, HIDDEN)
        with torch.no_grad():
            module.weight.copy_(whole)
        mesh = init_device_mesh("cpu", (2,))
        parallelize_module(module, mesh, VocabParallelEmbedding())
        out = module(ids)  # (b, s, h) on every rank
        (out * upstream).sum().backward()
        grad = module.weight.grad
        assert isinstance(grad, DTensor)
        torch.save({"out": out.detach(), "grad": grad.to_local().clone(), "placements": tuple(grad.placements)},
                   os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_passed_rank()

"""Hybrid per-layer parallelism: a data-parallel trunk and a class-sharded classifier (``head_parallel`` k).

For resnet, vgg and mlp models (tp = pp = 1): the dp = N ranks all run the trunk (every block before
``head``) data-parallel on their own samples, and groups of k consecutive ranks ``[g*k, (g+1)*k)``
share one classifier, rank ``g*k + j`` holding shard j of ``head.fc`` (:mod:`.class_sharded`). The
G = N/k ranks ``j, j+k, j+2k, ...`` hold replicas of shard j. One (G, k) DeviceMesh names the two kinds
of group: ``"shard"`` (the k ranks of one classifier) and ``"replica"`` (the G copies of one shard).

Gradients of the global mean loss L = (1/G) sum_g L_g (L_g: the mean over group g's samples; groups
see equally many). Every gradient a rank's backward leaves is k x dL_g along its own path
(class_sharded.py), so:

- trunk: DDP's mean over all N = G*k ranks gives (1/N) * k * sum_g dL_g/dtheta = dL/dtheta;
- head shard j: the sum over its G replicas divided by N gives (1/G) sum_g dL_g/dW_j = dL/dW_j.

With several micro-batches the trainer divides each one's loss by their number and DDP and the head
sync reduce after the last only. The loss logged is the trainer's usual mean over all N ranks'
shares: every rank of a group holds L_g, so that is the mean over groups, the global mean.

Weights never depend on the layout: the trunk is initialised as everywhere (chunks.materialize) and a
head shard is rows of the full reference value of ``head.fc.weight`` / ``head.fc.bias``.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from paraplan.models import ModelSpec, parameter_generator, reference_init

from .chunks import build_chunks, materialize
from .class_sharded import ShardedClassifier, sharded_cross_entropy
from .data_parallel import apply_ddp
from .job import Job
from .optim import adamw
from .parallel_dims import set_group_timeout
from .rank_model import RankModel, mixed_precision_dtype

HEAD = "head"  # the classifier block of the resnet, vgg and mlp families; its Linear is head.fc


class HybridClassifierModel(nn.Module):
    """The trunk (data-parallel) followed by this rank's classifier shard: (b, ...) -> (k*b, C/k)."""

    def __init__(self, trunk: nn.Module, head: ShardedClassifier):
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))

    @contextlib.contextmanager
    def no_sync(self):
        """Hold the trunk's gradient all-reduce (all micro-batches but the last); the head syncs once
        per step anyway (HeadGradSync)."""
        no_sync = getattr(self.trunk, "no_sync", None)
        with no_sync() if no_sync is not None else contextlib.nullcontext():
            yield


class HeadGradSync:
    """Sum a head shard's gradients over its replicas and divide by dp (see the module docstring)."""

    def __init__(self, head: nn.Module, replica_group, dp: int):
        self.params = list(head.parameters())
        self.group, self.dp = replica_group, dp

    @torch.no_grad()
    def sync_grads(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # (numel of the shard,)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, group=self.group)
        flat /= self.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def init_head_shard(fc: nn.Linear, seed: int, classes: tuple[int, int], num_classes: int) -> None:
    """Rows ``classes`` of the full reference initial values of head.fc, into this shard's Linear."""
    lo, hi = classes
    with torch.no_grad():
        for pname, p in fc.named_parameters():
            shape = (num_classes, *p.shape[1:])
            full = reference_init(fc, pname, torch.Size(shape), parameter_generator(seed, f"{HEAD}.fc.{pname}"))
            p.copy_(full[lo:hi])


def head_mesh(dp: int, k: int, device_type: str, timeout: timedelta | None):
    """The (G, k) mesh ("replica", "shard") over the N data-parallel ranks."""
    mesh = init_device_mesh(device_type, (dp // k, k), mesh_dim_names=("replica", "shard"))
    if timeout is not None:
        for axis in ("replica", "shard"):
            set_group_timeout(mesh[axis].get_group(), timeout)
    return mesh


def split_head(spec: ModelSpec, stages: list[list[str]]):
    """The whole model on meta, cut into its trunk (every block before ``head``) and the head's shape:
    (chunk holding the trunk, in_features, pool)."""
    (chunk,) = build_chunks(spec, stages, "1f1b", 0, 1)
    assert chunk.blocks[-1] == HEAD, chunk.blocks
    head = chunk.module.get_submodule(HEAD)
    in_features, pool = head.fc.in_features, head.pool
    chunk.module.keep_only(chunk.blocks[:-1])
    return chunk, in_features, pool


def build_hybrid_rank_model(job: Job, rank: int, device: torch.device, timeout: timedelta | None,
                            on_phase=lambda phase: None) -> RankModel:
    lay, spec = job.layout, job.spec
    k = lay.head_parallel
    on_phase("mesh")
    mesh = job.dims.build_mesh(device.type, timeout)
    hmesh = head_mesh(lay.dp, k, device.type, timeout)
    shard_group, replica_group = hmesh["shard"].get_group(), hmesh["replica"].get_group()
    mp_dtype = mixed_precision_dtype(job, device.type)

    on_phase("model")
    chunk, in_features, pool = split_head(spec, job.plan.stages)
    materialize(chunk.module, spec, job.plan.seed, device)
    trunk = apply_ddp(chunk.module, mesh["dp"], device)  # head_parallel divides dp, so dp > 1
    with torch.device(device):
        head = ShardedClassifier(in_features, spec.num_classes, k, rank % k, pool, shard_group)
    init_head_shard(head.fc, job.plan.seed, head.classes, spec.num_classes)
    model = HybridClassifierModel(trunk, head)

    on_phase("optimizer")
    optimizer = adamw([*trunk.parameters(), *head.parameters()])
    loss_fn = functools.partial(sharded_cross_entropy, classes=head.classes, group=shard_group)
    return RankModel(job=job, rank=rank, device=device, mesh=mesh, chunks=[chunk], trained=[model],
                     optimizer=optimizer, schedule=None, grad_syncs=[HeadGradSync(head, replica_group, lay.dp)],
                     autocast_dtype=mp_dtype, loss_fn=loss_fn)

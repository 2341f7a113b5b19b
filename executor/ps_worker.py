"""Build a parameter-server worker's share of a plan (:mod:`.ps_protocol`): the whole model (tp = pp
= 1), reference-initialised exactly as the servers initialise their shards, no data-parallel wrapper
(gradients leave through the servers, not an all-reduce), and a :class:`.ps_client.PSClient` in the
optimizer's place. The workers' process group carries the loss reduction; servers never join it."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .chunks import build_chunks, materialize
from .job import Job
from .parallel_dims import set_group_timeout
from .ps_client import PSClient
from .ps_protocol import PSRoles
from .rank_model import RankModel, mixed_precision_dtype


def worker_group(roles: PSRoles, timeout: timedelta | None):
    """The workers' process group. Every rank, servers too, must call this, at the same point: torch
    names groups by a per-process counter (group-local creation deadlocks once several plans run in
    the same processes with different members)."""
    group = dist.new_group(list(range(roles.workers)))
    if timeout is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        set_group_timeout(group, timeout)
    return group


def build_ps_worker(job: Job, rank: int, device: torch.device, timeout: timedelta | None,
                    on_phase=lambda phase: None) -> RankModel:
    roles = PSRoles.of(job.layout)
    on_phase("mesh")
    group = worker_group(roles, timeout)
    on_phase("model")
    chunks = build_chunks(job.spec, job.plan.stages, job.layout.schedule, 0, 1)  # one chunk: the whole model
    (chunk,) = chunks
    materialize(chunk.module, job.spec, job.plan.seed, device)
    on_phase("optimizer")
    client = PSClient(list(chunk.module.parameters()), roles)
    autocast = mixed_precision_dtype(job, device.type)
    return RankModel(job=job, rank=rank, device=device, mesh=None, chunks=chunks, trained=[chunk.module],
                     optimizer=client, schedule=None, autocast_dtype=autocast, loss_group=group,
                     deferred_loss=roles.staleness > 0)

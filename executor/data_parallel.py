"""Data parallelism by ZeRO stage (Rajbhandari et al. 2020), applied to each chunk after TP and AC.

- ZeRO 0 and 1: parameters and gradients replicated, gradients all-reduced in backward. Without
  pipeline or tensor parallelism that is DistributedDataParallel (bucketed, overlapped with
  backward); otherwise the FSDP2-based ``replicate``, which composes with DTensor parameters and
  with every pipeline schedule (DDP's reducer breaks when a rank runs several chunks, as in
  interleaved 1F1B). ZeRO 1 adds the sharded optimizer of :mod:`.optim` on top.
- ZeRO 2: FSDP2 ``fully_shard`` with ``reshard_after_forward=False``: gradients and optimizer states
  sharded, parameters gathered once per step and kept until backward is done.
- ZeRO 3: FSDP2 ``fully_shard``: parameters resharded after forward and gathered again in backward.

FSDP2 shards each transformer layer as its own unit (its all-gather overlaps the previous layer's
compute), then the chunk's remaining parameters (embedding, head) as the root unit, so a tied
embedding/head pair inside one chunk is one parameter of one unit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_dp(module: nn.Module, zero: int, dp_mesh: DeviceMesh, device: torch.device,
             mp_dtype: torch.dtype | None, pipelined: bool) -> nn.Module:
    """Wrap ``module`` for data parallelism over ``dp_mesh``; returns the module to train."""
    if dp_mesh.size() == 1:
        return module
    if zero <= 1:
        if pipelined or has_dtensor_params(module):
            return _replicate(module, dp_mesh, mp_dtype)
        return _ddp(module, dp_mesh, device)
    return _fully_shard(module, dp_mesh, reshard_after_forward=zero == 3, mp_dtype=mp_dtype)


def _mp_policy(mp_dtype: torch.dtype | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)


def _replicate(module: nn.Module, dp_mesh: DeviceMesh, mp_dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(module, mesh=dp_mesh, mp_policy=_mp_policy(mp_dtype))


def _ddp(module: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group())


def _fully_shard(module: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool,
                 mp_dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    policy = _mp_policy(mp_dtype)
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        for layer in layers.values():
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


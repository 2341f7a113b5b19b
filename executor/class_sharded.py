"""A classifier sharded by class over a group of k ranks, and its softmax cross-entropy computed across
the shards without gathering the logits (hybrid parallelism: data-parallel trunk, model-parallel head).

Rank j of a group holds rows ``[j*C/k, (j+1)*C/k)`` of the classifier ``head.fc`` (weight (C, d), bias
(C,)). Per micro-batch each rank brings its own b samples' features; they are all-gathered in the group
(X: (k*b, d), ranks in group order), each rank computes its slice of the logits for all k*b samples
(X W_j^T + b_j: (k*b, C/k)), and the loss needs only (k*b,)-sized reductions: the row maxima (MAX,
detached: the loss does not depend on them), the sums of exponentials (SUM) and the target logit,
which exactly one shard holds (SUM of the masked picks). Every rank of the group ends with the same
loss, the mean over the group's k*b samples.

Gradients. The collectives here are autograd-aware: the backward of an all-reduce (SUM) all-reduces the
incoming gradients, that of the all-gather reduce-scatters (sums) them. Each of the k ranks backpropagates
its own copy of the group loss L_g, so the backward sums k identical contributions: every gradient
a rank ends with (its features', hence its trunk's, and its head shard's) is k x the gradient of L_g
along its own path. :mod:`.hybrid` turns that into the gradient of the global mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: reduce-scatter (sum) of the gradient.

    (torch.distributed.nn.functional.all_gather's gloo backward addresses ranks by group rank where
    torch's scatter wants global ranks, so it fails for a group that does not start at rank 0.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # (b, d) -> (k*b, d)
        ctx.group = group
        k = dist.get_world_size(group)
        out = x.new_empty((k * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # (k*b, d) -> (b, d)
        k = dist.get_world_size(ctx.group)
        gx = grad.new_empty((grad.shape[0] // k, *grad.shape[1:]))
        dist.reduce_scatter_single(gx, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return gx, None


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """(b, ...) on each of the group's k ranks -> (k*b, ...) in group-rank order, autograd-aware."""
    return _GatherRows.apply(x, group)


class ShardedClassifier(nn.Module):
    """This rank's rows of the classifier, applied to the whole group's features.

    ``fc`` is ``nn.Linear(d, C/k)``; its values are set by :func:`.hybrid.init_head_shard` (rows of the
    full reference initialisation). ``pool``: global-average-pool feature maps first (ResNet's head).
    """

    def __init__(self, in_features: int, num_classes: int, shards: int, index: int, pool: bool, group):
        super().__init__()
        assert num_classes % shards == 0, (num_classes, shards)
        self.num_classes, self.shards, self.index, self.pool, self.group = num_classes, shards, index, pool, group
        self.fc = nn.Linear(in_features, num_classes // shards)

    @property
    def classes(self) -> tuple[int, int]:
        """[lo, hi): the classes whose logits this shard computes."""
        per = self.num_classes // self.shards
        return self.index * per, (self.index + 1) * per

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, c, H, W) or (b, d) -> (k*b, C/k)
        if self.pool:
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (b, d)
        return self.fc(gather_rows(x, self.group))  # (k*b, d) @ (d, C/k)


def sharded_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, classes: tuple[int, int],
                          group) -> torch.Tensor:
    """Mean softmax cross-entropy over the group's k*b samples, from class-sharded logits.

    logits: (k*b, C/k), this rank's classes ``[lo, hi)`` for all of the group's samples; labels: (b,),
    this rank's own samples (gathered here, in the same order as the features). Returns the same scalar
    on every rank of the group.
    """
    lo, hi = classes
    logits = logits.float()
    targets = labels.new_empty(logits.shape[0])  # (k*b,)
    dist.all_gather_single(targets, labels.contiguous(), group=group)
    row_max = logits.detach().max(dim=1).values  # (k*b,)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]  # (k*b, C/k)
    sum_exp = all_reduce(shifted.exp().sum(dim=1), op=dist.ReduceOp.SUM, group=group)  # (k*b,)
    local = targets - lo  # (k*b,) the target's column here, if this shard owns it
    owned = (local >= 0) & (local < hi - lo)
    picked = shifted.gather(1, local.clamp(0, hi - lo - 1)[:, None]).squeeze(1) * owned  # (k*b,)
    target = all_reduce(picked, op=dist.ReduceOp.SUM, group=group)  # (k*b,) shifted target logit
    return (sum_exp.log() - target).mean()

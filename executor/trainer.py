"""One obvious training loop (nanoGPT's spirit): batch, forward/backward, gradient syncs, step, loss.

With pp > 1 the pipeline schedule runs forward and backward over the micro-batches; with pp = 1 the
loop accumulates gradients over the plan's micro-batches itself (each micro-batch's mean loss
divided by their number), letting DDP/FSDP reduce only after the last one. Either way the gradient
of a step is that of the global batch's mean loss (MoE auxiliary losses, which join the backward on
their own, get the same 1/m: ``set_aux_loss_scale``), and the loss logged is the mean over every
sample of the global batch (one all-reduce of each last-stage rank's share).

The rank model decides the rest: its loss function (a class-sharded classifier's cross-entropy,
hybrid.py), the gradient syncs to run before the update (tied copies, the head's replicas), and what
``optimizer.step()`` does (AdamW, ZeRO-1's sharded AdamW, or a parameter-server worker's push and
pull, ps_client.py). With asynchronous parameter servers the workers must not wait for each other,
so the per-step losses are reduced once, in :meth:`Trainer.finish`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paraplan.models import loss_function, set_aux_loss_scale

from .batches import BatchSource
from .data_parallel import syncs_every_micro_batch
from .rank_model import RankModel
from .tensor_parallel import loss_parallel_context


@dataclass
class StepResult:
    step: int
    loss: float
    time_s: float


@dataclass
class Trainer:
    rm: RankModel
    source: BatchSource
    results: list[StepResult] = field(default_factory=list)
    _shares: list[torch.Tensor] = field(default_factory=list)  # per step: this rank's share of the mean loss

    @classmethod
    def create(cls, rm: RankModel) -> Trainer:
        job = rm.job
        _, dp_rank, _ = rm.coords
        source = BatchSource(spec=job.spec, seed=job.plan.seed, global_batch=job.layout.global_batch,
                             seq_length=job.seq_length, dp=job.layout.dp, dp_rank=dp_rank)
        return cls(rm=rm, source=source)

    def step(self, k: int) -> StepResult:
        """Train step ``k`` (0-based); every rank returns the same global mean loss."""
        rm = self.rm
        start = time.perf_counter()
        losses = self.train_step(k)
        share = self._share(losses)
        loss = self._local_mean(share) if rm.deferred_loss else self._global_mean([share])[0]
        result = StepResult(step=k, loss=loss, time_s=time.perf_counter() - start)
        self.results.append(result)
        self._shares.append(share)
        return result

    def train_step(self, k: int) -> list[torch.Tensor]:
        """Forward, backward, gradient syncs and the update of step ``k``; this rank's micro-batch losses
        (read by nobody yet: the dry run stops here, its tensors being fake)."""
        rm = self.rm
        inputs, targets = (t.to(rm.device) for t in self.source.batch(k))  # (B/dp, s) each
        if rm.job.layout.cp > 1:  # context parallelism: this rank's positions of every sequence, (B/dp, s/cp)
            keep = context_positions(rm).to(rm.device)
            inputs, targets = inputs[:, keep], targets[:, keep]
        with self._step_context():
            losses = self._pipeline(inputs, targets) if rm.schedule is not None else self._accumulate(inputs, targets)
        for sync in rm.grad_syncs:
            sync.sync_grads()
        rm.optimizer.step()
        rm.optimizer.zero_grad(set_to_none=True)
        return losses

    def finish(self) -> None:
        """After the last step: drain the optimizer's messages in flight (parameter servers), and turn
        deferred per-step losses into global means with one reduction."""
        finish = getattr(self.rm.optimizer, "finish", None)
        if finish is not None:
            finish()
        if self.rm.deferred_loss and self.results:
            means = self._global_mean(self._shares)
            self.results = [StepResult(step=r.step, loss=m, time_s=r.time_s)
                            for r, m in zip(self.results, means, strict=True)]

    def _step_context(self):
        """What forward and backward run under: torch's loss_parallel with tensor parallelism (the
        vocabulary-sharded cross-entropy's backward), and autocast where the rank model asks for it."""
        stack = contextlib.ExitStack()
        stack.enter_context(loss_parallel_context(self.rm.job.layout.tp > 1))
        if self.rm.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.rm.device.type, dtype=self.rm.autocast_dtype))
        return stack

    def _pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        rm, losses = self.rm, []
        set_aux_loss_scale(1.0)  # MoE: each micro-batch's loss goes into backward as it is (the schedule scales grads)
        args = (inputs,) if rm.has_first_stage else ()
        rm.schedule.step(*args, target=targets if rm.has_last_stage else None, losses=losses,
                         return_outputs=False)
        return [x.detach() for x in losses] if rm.has_last_stage else []

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        rm = self.rm
        (model,) = rm.trained
        loss_fn = rm.loss_fn or loss_function(rm.job.spec)
        m = rm.job.layout.num_micro_batches
        losses = []
        every = syncs_every_micro_batch(rm.job.layout.zero)  # ZeRO 2/3: sharded gradients (data_parallel.py)
        set_aux_loss_scale(1 / m)  # MoE auxiliary losses scaled like the micro-batch losses they ride with
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m), strict=True)):  # contiguous
            last = i == m - 1
            with _gradient_sync(model, enabled=every or last, reshard=rm.job.layout.zero == 3 or last):
                loss = loss_fn(model(x), y)  # the micro-batch's mean
                (loss / m).backward()
            losses.append(loss.detach())
        return losses

    def _share(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the global mean loss: last-stage ranks of tensor rank 0 contribute the
        sum of their micro-batch means over (micro-batches x dp x cp); the shares of all ranks add up to it
        (cp ranks hold equally many tokens of each sequence, so the mean of their means is the mean)."""
        rm = self.rm
        _, _, tp_rank = rm.coords
        lay = rm.job.layout
        share = torch.zeros((), dtype=torch.float64, device=rm.device)
        if losses and tp_rank == 0:
            share += torch.stack(losses).double().sum() / (lay.num_micro_batches * lay.dp * lay.cp)
        return share

    def _local_mean(self, share: torch.Tensor) -> float:
        """The mean loss over this rank's own samples (shown while the global mean is deferred)."""
        return float(share.item()) * self.rm.job.layout.dp

    def _global_mean(self, shares: list[torch.Tensor]) -> list[float]:
        """Mean loss over the global batch, per step: one all-reduce of the shares over the loss group."""
        total = torch.stack(shares)  # (steps,) float64
        dist.all_reduce(total, group=self.rm.loss_group)
        return [float(x) for x in total.tolist()]


def context_positions(rm: RankModel) -> torch.Tensor:
    """(s/cp,) the positions of every sequence this rank trains on under context parallelism."""
    from .context_parallel import chunk_positions

    job = rm.job
    return chunk_positions(job.seq_length, job.layout.cp, job.dims.cp_rank(rm.rank), job.spec.causal)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool, reshard: bool = True):
    """Reduce gradients across data-parallel ranks in this micro-batch's backward (``enabled``), and free
    FSDP's gathered weights after it (``reshard``; ZeRO 2 keeps them until the step's last backward)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from .hybrid import HybridClassifierModel

    if isinstance(model, DistributedDataParallel | HybridClassifierModel) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        model.set_reshard_after_backward(reshard)
        yield
    else:
        yield

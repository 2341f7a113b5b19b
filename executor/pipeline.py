"""Pipeline parallelism with torch.distributed.pipelining: one PipelineStage per local chunk and the
plan's schedule over the plan's micro-batches.

Schedules: ``gpipe`` -> ScheduleGPipe, ``1f1b`` -> Schedule1F1B (one stage per rank),
``interleaved-1f1b`` -> ScheduleInterleaved1F1B (``virtual_stages`` chunks per rank, round-robin),
``zb-v`` -> ScheduleZBVZeroBubble (two chunks per rank in a V, backward split into input and weight
gradients). The loss function returns each micro-batch's mean loss and the schedule divides the
accumulated gradients by the number of micro-batches (``scale_grads=True``), so a step's gradient is
that of the mean loss over the replica's whole batch, as without a pipeline.

Every stage is given the shapes it receives and sends (``input_args`` / ``output_args``), so the
schedule needs no run-time shape exchange: the boundary is the (b, s, h) residual stream in the
compute dtype, sequence-sharded (b, s/t, h) under sequence parallelism, and (b, s/cp, h) or (b, s/(cp·t), h)
under context parallelism (a rank's own positions of each sequence).

Data parallelism inside the pipeline follows data_parallel.py's rules: ZeRO 2/3 stages reduce-scatter
every micro-batch's gradients (torch's stages would defer them all to the end of the step, keeping
unsharded fp32 gradients meanwhile) — except under ZB-V, whose separate weight-gradient pass runs after
FSDP's post-backward hook, so there the gradients are accumulated and reduced once, after the last
micro-batch, as torch does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from .data_parallel import syncs_every_micro_batch
from .job import Job

SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble}


@contextmanager
def _no_recv_buffers():
    """While torch's stage sets up its receive descriptors: record each tensor's metadata, allocate nothing."""
    from torch.distributed.pipelining import stage as torch_stage

    make = torch_stage._make_tensor_from_meta  # torch 2.13's name; an upgrade that renames it fails here
    torch_stage._make_tensor_from_meta = lambda meta, device: None
    try:
        yield
    finally:
        torch_stage._make_tensor_from_meta = make


# torch 2.13's PipelineStage methods JustInTimeStage overrides: were one renamed, torch would allocate every
# buffer again without a word, so an upgrade that renames one stops here instead
_RECV_HOOKS = ("_setup_forward_recv_info", "_create_grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops",
               "set_local_bwd_input", "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
assert all(hasattr(PipelineStage, name) for name in _RECV_HOOKS), "torch's PipelineStage changed: see JustInTimeStage"


class JustInTimeStage(PipelineStage):
    """A stage that allocates each receive buffer when its receive is posted and lets it go once the
    micro-batch's computation has taken it.

    torch's PipelineStage (2.13) allocates at set-up one activation buffer (every stage but the first) and one
    gradient buffer (every stage but the last) per micro-batch, and keeps them all for the whole run
    (pytorch/pytorch#136380): 2·M boundaries per middle stage, 8 GiB for the README's llama2-70b plan (M = 256
    micro-batches, boundaries of 16 MiB: 1 x 4096/(cp2·tp2) tokens x 8192 x 2 B), which would not have fitted its
    80 GiB; the cost model does not price them and the dry run, tracing a few micro-batches, did not see them.
    Here a buffer lives from its receive until the forward (the stage input, then kept by autograd while the
    micro-batch is in flight, as the cost model counts it) or backward that consumes it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._losses: dict[int, torch.Tensor] = {}  # micro-batch -> its loss, until its backward is done

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        with _no_recv_buffers():
            super()._setup_forward_recv_info(num_microbatches, has_backward)

    def _create_grad_recv_info(self, act_send_info: dict):
        with _no_recv_buffers():
            return super()._create_grad_recv_info(act_send_info)

    def _allocate(self, infos) -> None:
        from torch.distributed.pipelining._utils import _make_tensor_from_meta

        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    @staticmethod
    def _release(infos) -> None:
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        infos = self.grad_recv_info[mb_index]  # torch zeroes the buffer of a gradient that is None: one is needed
        self._allocate([info for info, g in zip(infos, next_stage_bwd_outputs, strict=False) if g is None])
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._release(self.args_recv_info.get(fwd_chunk_id, ()))
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        self._release(self.grad_recv_info.get(bwd_chunk_id, ()))
        if loss is not None:
            self._losses[bwd_chunk_id] = loss
            if full_backward:
                self._let_go_of_graph(bwd_chunk_id)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._let_go_of_graph(bwd_chunk_id)
        return out

    def _let_go_of_graph(self, bwd_chunk_id: int) -> None:
        """The last stage: the schedule keeps each micro-batch's loss until the step ends, and through the loss's
        autograd graph the stage input, a leaf requiring its gradient (the graph's AccumulateGrad node holds it):
        one boundary per micro-batch. Once the backward is done the loss is only a number: detach it."""
        loss = self._losses.pop(bwd_chunk_id, None)
        if loss is not None and not loss._is_view():
            loss.detach_()


class ShardedGradStage(JustInTimeStage):
    """A stage whose FSDP2 module reduce-scatters gradients after every micro-batch's full backward
    (ZeRO 2 keeps its gathered weights until the step's last backward; ZeRO 3 reshards after each)."""

    def __init__(self, *args, reshard_after_backward: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self._reshard_each = reshard_after_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        from torch.distributed.fsdp import FSDPModule

        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(last_backward)
        self.submod.set_reshard_after_backward(self._reshard_each or last_backward)
        self.submod.set_requires_gradient_sync(True)
        from torch.distributed.pipelining.stage import stage_backward

        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def stage_io(job: Job, stage: int, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of what stage ``stage`` receives and sends, per micro-batch (requiring gradients where
    a gradient flows back)."""
    lay, spec = job.layout, job.spec
    first, last = stage == 0, stage == job.num_stages - 1
    if not spec.is_transformer:  # resnet / vgg / mlp: the blocks' own output shapes, found on meta
        shapes, input_meta = _block_outputs(job)
        blocks = job.plan.stages[stage]
        prev = job.plan.stages[stage - 1][-1] if not first else None
        inputs = input_meta if first else _meta(shapes[prev], compute_dtype)
        return inputs, _meta(shapes[blocks[-1]], compute_dtype)
    b, s = lay.micro_batch, job.seq_length // lay.cp  # context parallelism: this rank's s/cp tokens
    s_local = s // lay.tp if lay.sequence_parallel else s
    hidden = _meta((b, s_local, spec.hidden_size), compute_dtype)  # (b, s or s/t, h)
    inputs = torch.empty(b, s, dtype=torch.long, device="meta") if first else hidden  # (b, s) token ids
    outputs = _meta((b, s, spec.vocab_size // lay.tp), compute_dtype) if last else hidden  # (b, s, V/t) logits
    return inputs, outputs


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)


def _block_outputs(job: Job) -> tuple[dict[str, tuple[int, ...]], torch.Tensor]:
    """Each block's output shape for one micro-batch (a forward of the whole model on meta), and the
    model's input as a meta tensor."""
    from paraplan.models import build_model, sample_batch

    model = build_model(job.spec, "meta")
    x, _ = sample_batch(job.spec, job.layout.micro_batch, torch.Generator().manual_seed(0), job.seq_length)
    x = x.to("meta")
    inputs, shapes = x, {}
    with torch.no_grad():
        for name in model.block_names:
            x = model.get_submodule(name)(x)
            shapes[name] = tuple(x.shape)
    return shapes, inputs


def build_schedule(modules: list[tuple[int, nn.Module]], job: Job, pp_mesh: DeviceMesh, device: torch.device,
                   loss_fn: Callable, compute_dtype: torch.dtype):
    """The schedule that runs this rank's ``(stage index, module)`` pairs (ascending stage order)."""
    lay = job.layout
    group = pp_mesh.get_group()
    sharded = syncs_every_micro_batch(lay.zero) and lay.dp > 1 and lay.schedule != "zb-v"
    stages = []
    for index, module in modules:
        inputs, outputs = stage_io(job, index, compute_dtype)
        kwargs = dict(input_args=(inputs,), output_args=(outputs,), group=group)
        if sharded:
            stages.append(ShardedGradStage(module, index, job.num_stages, device, reshard_after_backward=lay.zero == 3,
                                           **kwargs))
        else:
            stages.append(JustInTimeStage(module, index, job.num_stages, device, **kwargs))
    m = lay.num_micro_batches
    if lay.schedule in SINGLE:
        assert len(stages) == 1, f"{lay.schedule} runs one stage per rank"
        return SINGLE[lay.schedule](stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
    return MULTI[lay.schedule](stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)

"""Tensor parallelism: the model's TP plan (models.tp_plan) turned into DTensor parallel styles.

Megatron-LM's layout (Shoeybi et al. 2019): Q/K/V and the first MLP linears column-parallel (whole
heads per rank), the attention output and second MLP linear row-parallel (one all-reduce each in
forward), the token embedding sharded over the vocabulary (VocabParallelEmbedding: a masked lookup
in this rank's rows and an all-reduce) and the output projection column-parallel over the vocabulary,
its logits left sharded over the vocabulary: the cross-entropy runs vocab-parallel (torch's
``loss_parallel``: each rank reduces its slice's max and sum of exponentials over the group, so the
(b, s, V) logits are never gathered; Megatron's vocab-parallel cross-entropy).

With sequence parallelism (Korthikanti et al. 2022) the residual stream between the parallel regions
stays sharded over the sequence: norms run on their sequence shard (SequenceParallel), each region
(attention, MLP) all-gathers its input over the sequence (PrepareModuleInput) and its row-parallel
output reduce-scatters back (RowwiseParallel with Shard(1) output). Every style hands plain local
tensors between modules, so the model code, residual adds and pipeline sends see ordinary tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from paraplan.models import ModelSpec, tp_plan, tp_style
from paraplan.models.moe import MoE
from paraplan.models.transformer import Attention, LatentAttention

from .errors import ExecutionError

SEQ = Shard(1)  # activations (b, s, h) sharded over the sequence


def parallel_style(style: str, sequence_parallel: bool) -> ParallelStyle | None:
    """The DTensor style for one of the zoo's TP styles (None: the module stays replicated)."""
    sp = sequence_parallel
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=SEQ if sp else Replicate())
    if style == "vocab_embedding":  # lookup of the local vocabulary slice, then an all-reduce
        return VocabParallelEmbedding()
    if style == "vocab_head":  # logits stay sharded over the vocabulary: the loss runs under loss_parallel
        return ColwiseParallel(input_layouts=SEQ if sp else Replicate(), output_layouts=Shard(-1),
                               use_local_output=False)
    if style == "norm":
        return SequenceParallel(use_local_output=True) if sp else None
    if style == "replicated":  # run whole inside its region (MLA's down-projections and latent norms)
        return None
    if style == "region":
        # The region's input enters as one replicated DTensor that all its column-parallel linears share, so
        # their input gradients add up before a single collective in backward (Megatron's f operator):
        # the sequence all-gather's reduce-scatter under SP, one all-reduce without (a plain tensor would
        # give each of Q, K and V its own all-reduce).
        return PrepareModuleInput(input_layouts=(SEQ if sp else Replicate(),), desired_input_layouts=(Replicate(),))
    raise ExecutionError(f"tensor-parallel style {style!r} is not supported by the executor yet")


class VocabParallelEmbedding(ParallelStyle):
    """An ``nn.Embedding`` sharded over the vocabulary (its weight a Shard(0) DTensor), looked up as Megatron-LM's
    VocabParallelEmbedding does: each rank looks up the token ids in its own rows (those outside give zeros) and one
    all-reduce sums the ranks' partial lookups; in backward the gradient of the (b, s, h) output reaches each rank
    whole and the lookup's backward writes this rank's (V/t, h) rows alone.

    Torch's RowwiseParallel on an embedding ran the backward through DTensor, which computed the weight's gradient
    over the whole vocabulary, (V, h) on every rank, and kept it as a replicated gradient: under ZeRO 0/1 it stayed
    there, t times the shard, until the optimizer step (the dry run of llama-tiny at dp2 tp2 traced 262,144 B of
    gradients more than its sharded weight's; llama2-70b's 32,000 x 8,192 embedding at tp8: 0.98 GiB of fp32 gradient
    instead of 0.12), and under ZeRO 2/3 it was a (V, h) buffer during every embedding backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise ExecutionError(f"vocabulary-parallel embedding: expected a plain nn.Embedding, got {module!r}")
        if not isinstance(module.weight, DTensor):
            module.register_parameter("weight", nn.Parameter(
                distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=module.weight.requires_grad))
        elif tuple(module.weight.placements) != (Shard(0),):  # distributed already (a weight shared with a module
            # parallelized first): the lookup reads it as rows of the vocabulary
            raise ExecutionError(f"vocabulary-parallel embedding: its weight is already distributed as "
                                 f"{module.weight.placements}, not over the vocabulary (Shard(0))")
        module.forward = functools.partial(_vocab_parallel_lookup, module)
        return module


def _vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """(b, s) token ids, the same on every tensor-parallel rank -> (b, s, h) embeddings, the same on every rank.
    ``module.weight`` is read at each call: FSDP2 swaps in its gathered copy (still sharded over the vocabulary)."""
    weight = module.weight  # (V, h) DTensor, Shard(0) over the tensor-parallel mesh
    mesh = weight.device_mesh
    local = weight.to_local()  # (V/t, h): this rank's rows (torch.chunk's split: the last rank may hold fewer)
    start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
    outside = (ids < start) | (ids >= start + local.shape[0])  # (b, s)
    rows = F.embedding((ids - start).masked_fill(outside, 0), local)  # (b, s, h)
    return _SumOverRanks.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), mesh)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the all-reduce (sum) of the ranks' partial lookups. Backward: the output's gradient as it comes,
    identical on every rank (Megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        return funcol.wait_tensor(funcol.all_reduce(partial, "sum", mesh))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tp_module_plan(module: nn.Module, spec: ModelSpec, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module FQN -> style for the modules this chunk holds."""
    patterns = tp_plan(spec)
    plan: dict[str, ParallelStyle] = {}
    for name, _ in module.named_modules():
        style = tp_style(patterns, name) if name else None
        made = parallel_style(style, sequence_parallel) if style else None
        if made is not None:
            plan[name] = made
        if style == "vocab_embedding" and sequence_parallel:
            # The embedding block may add positions after the lookup, so the block's output (not the
            # lookup's) enters the sequence-parallel region: keep this rank's sequence shard of it.
            parent = name.rpartition(".")[0]
            plan[parent] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=SEQ)
    if sequence_parallel:
        plan.update({name: SequenceParallel(use_local_output=True)
                     for name in _unplanned_in_sequence_region(module, patterns)})
    if spec.mla:  # its replicated down-projections and norms take the (gathered) sequence as a plain tensor
        for name, mod in module.named_modules():
            if isinstance(mod, LatentAttention) and name in plan:
                plan[name] = PrepareModuleInput(input_layouts=(SEQ if sequence_parallel else Replicate(),),
                                                desired_input_layouts=(Replicate(),), use_local_output=True)
    return plan


def _unplanned_in_sequence_region(module: nn.Module, patterns: dict[str, str]) -> list[str]:
    """Modules with weights of their own that the TP plan leaves replicated but that run on the
    sequence shard (e.g. BERT's head.transform). Each rank would see only its tokens' gradient, so
    they run as SequenceParallel too: replicated DTensor weights whose gradients are all-reduced.

    Not so inside attention (its input is gathered over the sequence first: MLA's down-projections and
    norms see the whole sequence and get whole, equal gradients; Qwen3's q_norm/k_norm see this rank's
    heads, see :func:`tp_partial_params`) nor inside MoE blocks (expert_parallel.py's token shares)."""
    embed_blocks = {n.rpartition(".")[0] for n, _ in module.named_modules()
                    if n and tp_style(patterns, n) == "vocab_embedding"}
    own_rules = [n for n, m in module.named_modules() if isinstance(m, Attention | LatentAttention | MoE)]
    out = []
    for name, mod in module.named_modules():
        if not name or not any(True for _ in mod.parameters(recurse=False)):
            continue
        if any(name == b or name.startswith(b + ".") for b in embed_blocks):
            continue  # runs before the sequence is split
        if any(name.startswith(b + ".") for b in own_rules):
            continue
        if _covered(name, patterns):
            continue
        out.append(name)
    return out


def tp_partial_params(module: nn.Module) -> list[str]:
    """Names (in ``module``) of replicated weights whose gradient on a tensor-parallel rank covers only its
    own heads: Qwen3's per-head q_norm / k_norm (one weight shared by all heads). Summed over tp after
    the backward, sequence parallel or not."""
    names = []
    for name, mod in module.named_modules():
        if isinstance(mod, Attention) and mod.q_norm is not None:
            names += [f"{name}.{n}" for n in ("q_norm.weight", "k_norm.weight")]
    return names


def share_rope_key(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """MLA's rotary key is one per token, used by every head: a tensor-parallel rank's gradient of it covers
    its own heads only, so it is summed over the ranks (identity forward, all-reduce backward) before it
    flows into the replicated ``wkv_a``."""
    group = tp_mesh.get_group()
    for mod in module.modules():
        if isinstance(mod, LatentAttention):
            mod.shared_key = lambda k, g=group: _SumGradOver.apply(k, g)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward: the gradient all-reduced (summed) over ``group`` (Megatron's f operator)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _covered(name: str, patterns: dict[str, str]) -> bool:
    """Whether the plan gives ``name`` or one of its parents a style of its own."""
    parts = name.split(".")
    return any(tp_style(patterns, ".".join(parts[:i])) in ("colwise", "rowwise", "vocab_embedding", "vocab_head",
                                                              "norm")
               for i in range(len(parts), 0, -1))


def apply_tp(module: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``module`` (a chunk, still on the meta device) over ``tp_mesh`` in place."""
    if not spec.is_transformer:
        raise ExecutionError(f"{spec.name}: tensor parallelism is executed for transformers only "
                             f"(family {spec.family})")
    parallelize_module(module, tp_mesh, tp_module_plan(module, spec, sequence_parallel))
    if spec.mla:
        share_rope_key(module, tp_mesh)



def tp_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``loss_fn`` on vocabulary-sharded logits (a DTensor), returning the micro-batch's mean loss as a
    plain tensor. It runs, and its backward runs, under :func:`loss_parallel_context`, which the
    trainer's step enters (torch's loss_parallel does not nest)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (b, s, V/t) DTensor, (b, s)
        if isinstance(logits, DTensor) and not isinstance(targets, DTensor):  # every rank holds all targets
            targets = DTensor.from_local(targets, logits.device_mesh, [Replicate()], run_check=False)
        loss = loss_fn(logits, targets)  # a replicated DTensor
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss  # not a view: schedules detach_ it

    return loss


def loss_parallel_context(tensor_parallel: bool):
    """The context a step's forward and backward run in: torch's ``loss_parallel`` under tensor parallelism."""
    if not tensor_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()

"""Trace one block on the meta device: FLOPs, kernels, memory traffic and saved activations.

FLOPs come from torch's own counter (``torch.utils.flop_counter``): totals from
``FlopCounterMode`` and, per kernel, the same ``flop_registry`` formulas. Saved activations come
from autograd's saved-tensor hooks, deduplicated by storage, parameters excluded. Every tensor an
op produces is tagged with whether it came from a tensor-parallel-sharded module (the nearest
enclosing module with a TP style in the model's plan), which is how the tensor-parallel view splits
FLOPs and saved bytes per rank (Korthikanti et al. 2022, Sec. 4.1: the parts inside the TP regions
are divided by t, the rest is replicated unless sequence parallelism splits it too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from paraplan.models import in_attention_core, in_attention_prologue, unfused_attention
from paraplan.models.moe import GroupedExperts, MoE

from .records import OpMix

SHARDED_STYLES = {"colwise", "rowwise", "region", "vocab_head", "vocab_embedding", "class_sharded"}


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _OpRecorder(TorchDispatchMode):
    """Records each kernel's FLOPs (torch's formulas) or bytes moved, and who produced each tensor."""

    def __init__(self, sharded_now: Callable[[], bool], moe_now: Callable[[], int] = lambda: 0,
                 mlp_now: Callable[[], bool] = lambda: False, replicated_now: Callable[[], bool] = lambda: False,
                 weights: frozenset[int] = frozenset(), split_now: Callable[[], str] = lambda: "replicated"):
        super().__init__()
        # Weight-carrying ops (an input derived from the block's parameters alone, another not): the bytes of their
        # outputs, per how a tensor-parallel rank holds them (split_now's "split" | "whole" | "replicated"), counted
        # while ``counting_weight_ops`` (the forward). Their output gradients are what torch's input backward keeps
        # for the deferred weight backward (pipelining/_backward.py, param_group["grads"]).
        self.weight_derived: set[int] = set(weights)  # storages of parameters and what only they made (casts)
        self.split_now = split_now
        self.counting_weight_ops = True
        self.weight_op_bytes: dict[str, int] = {"split": 0, "whole": 0, "replicated": 0}
        self.sharded_now = sharded_now
        self.moe_now = moe_now  # 0 outside an MoE block, 1 inside it, 2 inside its routed experts
        self.mlp_now = mlp_now  # inside the layer's MLP sublayer (dense MLP or MoE block)
        self.replicated_now = replicated_now  # inside a module the tensor-parallel plan leaves whole ("replicated")
        self.moe_of: dict[int, int] = {}  # storage -> where it was produced (moe_now's values)
        self.in_mlp: set[int] = set()  # storages produced inside the MLP sublayer
        self.in_replicated: set[int] = set()  # storages produced inside a "replicated" module (MLA's latents)
        self.mix = OpMix()
        self.producer: dict[int, tuple[bool, bool]] = {}  # storage -> (sharded, produced in attention core)
        self.core_inputs: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, sharded) fed into the core
        # the attention's prologue (models.in_attention_prologue): storages it produced, and those fed into it from
        # outside, storage -> (bytes, sharded)
        self.in_prologue: set[int] = set()
        self.prologue_inputs: dict[int, tuple[int, bool]] = {}
        self.keep_alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or func.overloadpacket in (torch.ops.aten.detach,):
            return out
        sharded, core, moe, mlp = self.sharded_now(), in_attention_core(), self.moe_now(), self.mlp_now()
        whole = self.replicated_now()
        prologue = in_attention_prologue()
        outs, ins = _tensors(out), _tensors(args)
        packet = func.overloadpacket
        if self.counting_weight_ops and ins:
            from_weights = [_storage_key(t) in self.weight_derived for t in ins]
            if all(from_weights):
                self.weight_derived.update(_storage_key(t) for t in outs)
            elif any(from_weights):
                # the op's first output: a norm's statistics get no gradient. RMSNorm decomposed (meta, CPU: what
                # the dry run traces) scales an fp32 intermediate by its weight; a GPU's fused kernel writes 16 bits
                self.weight_op_bytes[self.split_now()] += _nbytes(outs[:1])
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)  # the formula FlopCounterMode uses
            if prologue:
                self.mix.prologue_gemm_flops.append(int(flops))
                self.mix.prologue_gemm_sharded.append(sharded)
            self.mix.gemm_flops.append(int(flops))
            self.mix.gemm_sharded.append(sharded)
            self.mix.gemm_core.append(core)
            self.mix.gemm_moe.append(moe)
            self.mix.gemm_mlp.append(mlp)
            if core:
                self.mix.core_scores_bytes = max(self.mix.core_scores_bytes, _nbytes(outs))
        else:
            moved = _nbytes(ins) + _nbytes(outs)
            self.mix.other_bytes += moved
            self.mix.other_bytes_sharded += moved if sharded else 0
            self.mix.other_bytes_core += moved if core else 0
            self.mix.other_bytes_moe += moved if moe else 0
            self.mix.other_bytes_expert += moved if moe == 2 else 0
            self.mix.other_bytes_mlp += moved if mlp else 0
            self.mix.other_bytes_prologue += moved if prologue else 0
        self.mix.kernels += 1
        self.mix.kernels_prologue += int(prologue)
        self.mix.kernels_mlp += int(mlp)
        self.mix.kernels_core += int(core)
        self.mix.kernels_moe += int(moe > 0)
        self.mix.kernels_expert += int(moe == 2)
        if core:
            for t in ins:
                key = _storage_key(t)
                if not self.producer.get(key, (False, False))[1]:
                    self.core_inputs[key] = (t.untyped_storage().nbytes(), self.producer.get(key, (sharded, False))[0])
        if prologue:
            for t in ins:
                key = _storage_key(t)
                if key not in self.in_prologue:
                    made_sharded = self.producer.get(key, (sharded, False))[0]
                    self.prologue_inputs[key] = (t.untyped_storage().nbytes(), made_sharded)
        for t in outs:
            self.producer[_storage_key(t)] = (sharded, core)
            if prologue:
                self.in_prologue.add(_storage_key(t))
            self.moe_of[_storage_key(t)] = moe
            if mlp:
                self.in_mlp.add(_storage_key(t))
            if whole:
                self.in_replicated.add(_storage_key(t))
            self.keep_alive.append(t)
        return out


@dataclass
class BlockTrace:
    outputs: Any
    fwd_flops: int
    bwd_flops: int
    fwd_ops: OpMix
    bwd_ops: OpMix
    saved_bytes: int
    saved_bytes_sharded: int
    saved_bytes_selective: int
    saved_bytes_selective_sharded: int
    input_bytes: int
    output_bytes: int
    region_io: list[tuple[str, int, int, int]] = field(default_factory=list)  # (style, in/out bytes, tokens)
    saved_bytes_moe: int = 0  # saved inside MoE blocks (none of it in the attention core: selective keeps it)
    saved_bytes_mlp: int = 0  # saved tensors the MLP sublayer produced (what recomputing it drops)
    saved_bytes_mlp_sharded: int = 0
    # what selective recomputation drops besides, where it repeats the attention's prologue (0 without one)
    saved_bytes_prologue: int = 0
    saved_bytes_prologue_sharded: int = 0
    # of saved_bytes, saved_bytes_selective and saved_bytes_prologue: what modules the tensor-parallel plan leaves
    # whole produced (MLA's latents, from its down-projections and latent norms; 0 without such modules)
    saved_bytes_whole: int = 0
    saved_bytes_selective_whole: int = 0
    saved_bytes_prologue_whole: int = 0
    # outputs of the forward's weight-carrying ops, by how a tensor-parallel rank holds them (_OpRecorder)
    weight_op_bytes: dict[str, int] = field(default_factory=dict)


class _ModuleStack:
    """Which TP style encloses the running code: hooks push/pop module names during forward."""

    def __init__(self, block: nn.Module, block_fqn: str, style_of: Callable[[str], str | None]):
        self.stack: list[str | None] = []
        self.handles = []
        self.region_io: list[tuple[str, int, int, int]] = []
        self.moe: list[int] = []  # 1 inside an MoE block, 2 inside its routed experts (innermost last)
        self.mlp_depth = 0  # > 0 inside the layer's MLP sublayer (the transformer layer's ``mlp`` or ``moe``)
        ffn = getattr(block, "ffn_name", None)  # models/transformer.py's TransformerLayer names its MLP sublayer
        for name, mod in block.named_modules():
            fqn = f"{block_fqn}.{name}" if name else block_fqn
            style = style_of(fqn)
            self.handles.append(mod.register_forward_pre_hook(self._push(style)))
            self.handles.append(mod.register_forward_hook(self._pop(style)))
            if ffn is not None and name == ffn:
                self.handles.append(mod.register_forward_pre_hook(self._enter_mlp))
                self.handles.append(mod.register_forward_hook(self._leave_mlp))
            tag = 2 if isinstance(mod, GroupedExperts) else 1 if isinstance(mod, MoE) else 0
            if tag:
                self.handles.append(mod.register_forward_pre_hook(self._enter_moe(tag)))
                self.handles.append(mod.register_forward_hook(self._leave_moe))

    def _push(self, style):
        def hook(mod, args):
            self.stack.append(style)
        return hook

    def _pop(self, style):
        def hook(mod, args, out):
            self.stack.pop()
            if style in ("region", "vocab_embedding", "vocab_head", "class_sharded"):
                ins = _tensors(args)
                tokens = ins[0].numel() // max(ins[0].shape[-1], 1) if ins and ins[0].dim() > 1 else 0
                self.region_io.append((style, _nbytes(ins), _nbytes(_tensors(out)), tokens))
        return hook

    def _enter_moe(self, tag: int):
        def hook(mod, args):
            self.moe.append(tag)
        return hook

    def _leave_moe(self, mod, args, out) -> None:
        self.moe.pop()

    def _enter_mlp(self, mod, args) -> None:
        self.mlp_depth += 1

    def _leave_mlp(self, mod, args, out) -> None:
        self.mlp_depth -= 1

    def mlp_now(self) -> bool:
        return self.mlp_depth > 0

    def moe_now(self) -> int:
        """0 outside an MoE block, 1 inside it (router, dispatch, shared experts), 2 in its routed experts."""
        return self.moe[-1] if self.moe else 0

    def sharded(self) -> bool:
        for style in reversed(self.stack):
            if style is not None and style != "norm":
                return style in SHARDED_STYLES
        return False

    def output_split(self) -> str:
        """How a tensor-parallel rank holds what the running op makes: "split" over the group (a column-parallel or
        head-sharded module's output, anything inside an MoE block, which each rank runs on its 1/t of the tokens),
        "whole" (a row-parallel module's partial sums before their reduction, a module left whole), or "replicated"
        (the rest: split over the sequence only under sequence parallelism)."""
        style = next((s for s in reversed(self.stack) if s is not None and s != "norm"), None)
        if style in ("rowwise", "vocab_embedding", "replicated"):
            return "whole"
        return "split" if self.moe_now() or style in SHARDED_STYLES else "replicated"

    def replicated(self) -> bool:
        """Inside a module the tensor-parallel plan leaves whole on every rank (style "replicated")?"""
        return next((style == "replicated" for style in reversed(self.stack) if style is not None), False)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def trace_block(block: nn.Module, block_fqn: str, inputs: tuple, style_of: Callable[[str], str | None],
                loss_fn: Callable[[Any], torch.Tensor] | None = None) -> BlockTrace:
    """Run ``block(*inputs)`` forward and backward on the meta device and account for everything.

    ``loss_fn`` turns the block's output into the scalar whose backward is traced (the model's loss
    for the last block); otherwise the backward starts from a gradient of ones on the outputs.
    """
    weights = frozenset(_storage_key(p) for p in block.parameters())
    params = set(weights) | {_storage_key(b) for b in block.buffers()}
    stack = _ModuleStack(block, block_fqn, style_of)
    recorder = _OpRecorder(stack.sharded, stack.moe_now, stack.mlp_now, stack.replicated, weights, stack.output_split)
    saved: dict[int, tuple[int, bool, bool]] = {}  # storage -> (bytes, sharded, produced in attention core)
    saved_in_moe: set[int] = set()  # storages an MoE block saved (it sees its own tokens: see planner/moe.py)

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key not in params and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), *recorder.producer.get(key, (False, False)))
            if stack.moe_now():
                saved_in_moe.add(key)
        return t

    try:
        with FlopCounterMode(display=False) as counter, unfused_attention():
            with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outputs = block(*inputs)
                # A vocabulary- or class-sharded head computes its loss shard by shard (Megatron's
                # parallel cross-entropy): what the loss saves is sharded like the logits.
                head_styles = [r[0] for r in stack.region_io if r[0] in ("vocab_head", "class_sharded")]
                stack.stack.append(head_styles[-1] if head_styles else None)
                root = loss_fn(outputs) if loss_fn is not None else None
                stack.stack.pop()
            fwd_flops = counter.get_total_flops()
            fwd_mix = recorder.mix
            recorder.mix = OpMix()
            recorder.counting_weight_ops = False
            with recorder:
                if root is not None:
                    root.backward()
                else:
                    outs = [t for t in _tensors(outputs) if t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            bwd_flops = counter.get_total_flops() - fwd_flops
    finally:
        stack.remove()
    # Selective recomputation (Korthikanti et al. 2022, Sec. 5) drops what the attention core saved and
    # keeps the core's inputs (Q, K, V) instead, where nothing else already saves them.
    # Recomputing the MLP sublayer (Megatron-Core's recompute_modules mlp / moe) drops what it produced and
    # saved; its input, produced before it, stays as the checkpoint's input.
    mlp_dropped = [saved[key][:2] for key in saved if key in recorder.in_mlp]
    # kept tensors as (storage, bytes, sharded)
    kept = [(key, b, s) for key, (b, s, core) in saved.items() if not core]
    kept += [(key, b, s) for key, (b, s) in recorder.core_inputs.items() if key not in saved and key not in params]
    # Where the attention has a prologue (MLA's up-projection, Qwen3's query/key norms: models.in_attention_prologue)
    # it repeats that too (executor/checkpointing.py): what it produced is dropped (the core's queries, keys and
    # values among it), what it reads is kept.
    prologue = recorder.in_prologue
    kept_prologue = [(key, b, s) for key, (b, s, core) in saved.items() if not core and key not in prologue]
    kept_prologue += [(key, b, s) for key, (b, s) in {**recorder.core_inputs, **recorder.prologue_inputs}.items()
                      if key not in saved and key not in params and key not in prologue]
    # of each sum, what modules left whole produced (MLA's latents): under sequence parallelism this executor runs
    # them on the gathered sequence, so they stay whole where the rest of the replicated part is split
    whole = recorder.in_replicated

    def sums(items) -> tuple[int, int, int]:  # all, sharded, whole
        return (sum(b for _, b, _ in items), sum(b for _, b, s in items if s),
                sum(b for key, b, _ in items if key in whole))

    saved_all, saved_sharded, saved_whole = sums([(key, b, s) for key, (b, s, _) in saved.items()])
    (kept_all, kept_sharded, kept_whole), (left_all, left_sharded, left_whole) = sums(kept), sums(kept_prologue)
    return BlockTrace(
        outputs=outputs, fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_ops=fwd_mix, bwd_ops=recorder.mix,
        saved_bytes=saved_all, saved_bytes_sharded=saved_sharded,
        saved_bytes_selective=kept_all, saved_bytes_selective_sharded=kept_sharded,
        input_bytes=_nbytes(_tensors(inputs)), output_bytes=_nbytes(_tensors(outputs)), region_io=stack.region_io,
        saved_bytes_moe=sum(saved[key][0] for key in saved_in_moe),
        saved_bytes_mlp=sum(b for b, _ in mlp_dropped), saved_bytes_mlp_sharded=sum(b for b, s in mlp_dropped if s),
        saved_bytes_prologue=kept_all - left_all, saved_bytes_prologue_sharded=kept_sharded - left_sharded,
        saved_bytes_whole=saved_whole,
        saved_bytes_selective_whole=kept_whole, saved_bytes_prologue_whole=kept_whole - left_whole,
        weight_op_bytes=dict(recorder.weight_op_bytes))

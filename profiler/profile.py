"""Profile a model block by block: the ModelProfile the planner and simulator consume.

Counting (FLOPs, kernels, bytes, saved activations) always runs on the meta device, so any size
profiles in seconds without allocating; repeated identical blocks (same class, parameter shapes
and input shapes) are traced once and the record reused. On ``cpu``/``cuda`` each distinct block is
also materialised alone on the device and timed, so even a block of a model too big for the device
can be timed as long as one block fits.
"""

from __future__ import annotations

import copy
import hashlib
import os
import platform
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraplan.models import (
    CallableSpec,
    ModelSpec,
    ModelSpecError,
    balanced_routing,
    build_model,
    example_at_batch,
    load_callable_model,
    loss_function,
    parameter_generator,
    reference_init,
    sample_batch,
    tp_plan,
    tp_style,
)

from .api import default_dtype
from .errors import ProfileError
from .records import LayerProfile, ModelProfile
from .timing import time_block
from .tp_view import tp_view
from .tracing import BlockTrace, trace_block

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_MICRO_BATCH = 1 << 16
PARAM_SHARDED = {"colwise": ("weight", "bias"), "rowwise": ("weight",), "vocab_embedding": ("weight",),
                 "vocab_head": ("weight", "bias"), "class_sharded": ("weight", "bias")}


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or "cpu"
    return "meta"


def _signature(block: nn.Module, inputs: tuple) -> str:
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters())
    shapes = tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)
    # hashlib, not hash(): str hashes are salted per process, and signatures outlive it (the profile cache,
    # measured block times)
    digest = hashlib.sha1(repr((params, shapes)).encode()).hexdigest()[:8]
    return f"{type(block).__name__}|{digest}"


def _detach_inputs(x: Any) -> tuple:
    xs = x if isinstance(x, tuple) else (x,)
    out = []
    for t in xs:
        if isinstance(t, torch.Tensor):
            t = t.detach()
            if t.is_floating_point():
                t.requires_grad_(True)
        out.append(t)
    return tuple(out)


def _params_by_split(block: nn.Module, fqn: str, style_of: Callable[[str], str | None]):
    """Each parameter of one block with whether tensor parallelism splits it (its module's style, PARAM_SHARDED)."""
    for mod_name, mod in block.named_modules():
        style = style_of(f"{fqn}.{mod_name}" if mod_name else fqn)
        for pname, p in mod.named_parameters(recurse=False):
            yield p, pname in PARAM_SHARDED.get(style or "", ())


def _param_bytes(block: nn.Module, fqn: str, style_of: Callable[[str], str | None]) -> tuple[int, int, int]:
    """(parameters, bytes, bytes a tensor-parallel rank splits) of one block."""
    n = total = sharded = 0
    for p, split in _params_by_split(block, fqn, style_of):
        n += p.numel()
        total += p.numel() * p.element_size()
        if split:
            sharded += p.numel() * p.element_size()
    return n, total, sharded


def _largest_params(block: nn.Module, fqn: str, style_of: Callable[[str], str | None]) -> tuple[int, int, int]:
    """Elements of the block's largest parameter tensor that tensor parallelism splits, of its largest kept whole
    (both outside its routed experts), and of its largest routed-expert tensor."""
    experts = {id(p) for m in _moes(block) for p in m.experts.parameters()}
    split = whole = expert = 0
    for p, is_split in _params_by_split(block, fqn, style_of):
        if id(p) in experts:
            expert = max(expert, p.numel())
        elif is_split:
            split = max(split, p.numel())
        else:
            whole = max(whole, p.numel())
    return split, whole, expert


def _moes(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "inactive_parameters") and hasattr(m, "experts")]


def _expert_params(module: nn.Module) -> tuple[int, int]:
    """(routed-expert parameters, those a token does not use) of the MoE blocks in ``module``."""
    moes = _moes(module)
    return (sum(p.numel() for m in moes for p in m.experts.parameters()),
            sum(m.inactive_parameters() for m in moes))


def _free_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def _materialise(meta_block: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    block = copy.deepcopy(meta_block).to_empty(device=device)
    with torch.no_grad():
        for mod_name, mod in block.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                p.copy_(reference_init(mod, pname, p.shape, parameter_generator(0, f"{mod_name}.{pname}")))
            if isinstance(mod, nn.BatchNorm2d):
                mod.reset_running_stats()
    return block.to(dtype)


def _real_inputs(meta_inputs: tuple, first_inputs: tuple | None, device: torch.device) -> tuple:
    """Device tensors shaped like the traced inputs (the model's real batch for the first block)."""
    if first_inputs is not None:
        return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in first_inputs)
    g = torch.Generator().manual_seed(0)
    out = []
    for t in meta_inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g).to(device=device, dtype=t.dtype).requires_grad_(True))
        elif isinstance(t, torch.Tensor):
            out.append(torch.zeros(t.shape, dtype=t.dtype, device=device))
        else:
            out.append(t)
    return tuple(out)


def _as_model_dtype(inputs: tuple, dtype: torch.dtype) -> tuple:
    """Floating-point inputs in the model's dtype (images and features are sampled in fp32; a bf16 model's
    first convolution or linear refuses them), integer inputs (token ids, labels) as they are."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


class _Workload:
    """A model made ready for block-by-block profiling: blocks, their meta inputs, the loss."""

    def __init__(self, spec: ModelSpec, micro_batch: int, dtype: torch.dtype):
        self.spec = spec
        if isinstance(spec, CallableSpec):
            custom = load_callable_model(spec)
            self.real_model = custom.module
            self.model = copy.deepcopy(custom.module).to("meta").to(dtype)
            self.block_names = custom.block_names
            self.first_inputs = _as_model_dtype(example_at_batch(custom.example_input, micro_batch), dtype)
            self.targets = None
            self.style_of: Callable[[str], str | None] = lambda fqn: None
            self.kinds = {n: type(self.model.get_submodule(n)).__name__ for n in self.block_names}
            self.loss = None
        else:
            self.real_model = None
            self.model = build_model(spec, "meta").to(dtype)
            self.block_names = self.model.block_names
            inputs, targets = sample_batch(spec, micro_batch, torch.Generator().manual_seed(0))
            self.first_inputs = _as_model_dtype((inputs,), dtype)
            self.targets = targets
            plan = tp_plan(spec)
            self.style_of = lambda fqn: tp_style(plan, fqn)
            self.kinds = self.model.block_kinds
            loss, meta_targets = loss_function(spec), targets.to("meta")
            self.loss = lambda out: loss(out, meta_targets)
        self.num_parameters = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        self.num_active_parameters = self.num_parameters - _expert_params(self.model)[1]

    def captured_inputs(self) -> dict[str, tuple]:
        """Each block's meta inputs, from one forward pass over the whole model with pre-hooks."""
        captured: dict[str, tuple] = {}
        handles = [self.model.get_submodule(n).register_forward_pre_hook(
            lambda mod, args, n=n: captured.setdefault(n, _detach_inputs(args))) for n in self.block_names]
        try:
            with torch.no_grad():
                self.model(*[t.to("meta") if isinstance(t, torch.Tensor) else t for t in self.first_inputs])
        finally:
            for h in handles:
                h.remove()
        missing = [n for n in self.block_names if n not in captured]
        if missing:
            raise ProfileError(f"block {missing[0]!r} did not run in the model's forward pass")
        return captured


def _trace_layer(work: _Workload, name: str, inputs: tuple, last: bool, seen_params: set[int],
                 tp_degrees: list[int]) -> tuple[LayerProfile, BlockTrace]:
    block = work.model.get_submodule(name)
    trace = trace_block(block, name, inputs, work.style_of, loss_fn=work.loss if last else None)
    params, pbytes, psharded = _param_bytes(block, name, work.style_of)
    tied = sum(p.numel() for p in block.parameters() if id(p) in seen_params)
    experts, inactive = _expert_params(block)
    largest_split, largest_whole, largest_expert = _largest_params(block, name, work.style_of)
    layer = LayerProfile(
        name=name, kind=work.kinds.get(name, type(block).__name__), params=params, param_bytes=pbytes,
        fwd_flops=trace.fwd_flops, bwd_flops=trace.bwd_flops, activation_bytes=trace.saved_bytes,
        output_bytes=trace.output_bytes, input_bytes=trace.input_bytes, signature=_signature(block, inputs),
        tied_params=tied, fwd_ops=trace.fwd_ops, bwd_ops=trace.bwd_ops, param_bytes_sharded=psharded,
        activation_bytes_sharded=trace.saved_bytes_sharded, activation_bytes_selective=trace.saved_bytes_selective,
        activation_bytes_selective_sharded=trace.saved_bytes_selective_sharded, region_io=trace.region_io,
        expert_params=experts, inactive_params=inactive, activation_bytes_moe=trace.saved_bytes_moe,
        moe_params=sum(p.numel() for m in _moes(block) for p in m.parameters()),
        mlp_dropped_bytes=trace.saved_bytes_mlp, mlp_dropped_bytes_sharded=trace.saved_bytes_mlp_sharded,
        prologue_dropped_bytes=trace.saved_bytes_prologue,
        prologue_dropped_bytes_sharded=trace.saved_bytes_prologue_sharded,
        activation_bytes_whole=trace.saved_bytes_whole,
        activation_bytes_selective_whole=trace.saved_bytes_selective_whole,
        prologue_dropped_bytes_whole=trace.saved_bytes_prologue_whole,
        weight_output_bytes=sum(trace.weight_op_bytes.values()),
        weight_output_bytes_sharded=trace.weight_op_bytes.get("split", 0),
        weight_output_bytes_whole=trace.weight_op_bytes.get("whole", 0), largest_split_param=largest_split,
        largest_whole_param=largest_whole, largest_expert_param=largest_expert)
    for t in tp_degrees:
        layer.tp_views[t] = tp_view(
            t, fwd_flops=trace.fwd_flops, bwd_flops=trace.bwd_flops, gemm_flops=trace.fwd_ops.gemm_flops,
            gemm_sharded=trace.fwd_ops.gemm_sharded, param_bytes=pbytes, param_bytes_sharded=psharded,
            saved_bytes=trace.saved_bytes, saved_bytes_sharded=trace.saved_bytes_sharded, region_io=trace.region_io)
    return layer, trace


def _profile_model(spec: ModelSpec, device: str, micro_batch: int, seq_length: int | None, dtype: str | None,
                   tp_degrees: list[int] | None, warmup: int, repeats: int) -> ModelProfile:
    if micro_batch <= 0 or micro_batch > MAX_MICRO_BATCH:
        raise ProfileError(f"--micro-batch {micro_batch} is out of range (1..{MAX_MICRO_BATCH})")
    if seq_length is not None:
        if not spec.is_transformer:
            raise ProfileError(f"--seq-len applies to language models; {spec.name} is a {spec.family}")
        spec = spec.replace(seq_length=seq_length)
    dtype = dtype or default_dtype(device)
    if dtype not in TORCH_DTYPES:
        raise ProfileError(f"--dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda: no CUDA device is available on this machine (try --device meta or cpu)")
    if device not in ("meta", "cpu", "cuda"):
        raise ProfileError(f"--device {device!r} is not one of meta, cpu, cuda")
    tp_degrees = sorted(set(tp_degrees or []))
    if any(t <= 0 for t in tp_degrees):
        raise ProfileError("--tp degrees must be positive")
    torch_dtype = TORCH_DTYPES[dtype]
    # Counting runs on meta, with mixture-of-experts routing perfectly balanced (models/moe.py): each expert
    # gets tokens·k/E, so FLOPs count the active experts only and every run counts the same.
    with balanced_routing():
        try:
            work = _Workload(spec, micro_batch, torch_dtype)
            captured = work.captured_inputs()
        except (ProfileError, ModelSpecError):
            raise
        except Exception as e:  # the model itself failed to run: the user's to fix, one line
            raise ProfileError(f"{spec.name}: the model's forward pass failed on the meta device "
                               f"({type(e).__name__}: {e})") from None
        layers = _trace_layers(work, captured, tp_degrees, spec.name)

    if device != "meta":
        _time_layers(work, layers, captured, torch.device(device), torch_dtype, warmup, repeats)
    return ModelProfile(
        model=spec.name, family=spec.family, spec=spec.to_dict(), micro_batch=micro_batch,
        seq_length=getattr(spec, "seq_length", None) if spec.is_transformer else None, dtype=dtype, device=device,
        device_name=_device_name(device), num_parameters=work.num_parameters,
        vocab_size=getattr(spec, "vocab_size", None), layers=layers,
        num_active_parameters=work.num_active_parameters)


def _trace_layers(work: _Workload, captured: dict[str, tuple], tp_degrees: list[int],
                  model_name: str) -> list[LayerProfile]:
    """Each block's record; a block identical to one already traced (same signature) reuses its record."""
    layers: list[LayerProfile] = []
    traced: dict[str, LayerProfile] = {}
    seen_params: set[int] = set()
    for i, name in enumerate(work.block_names):
        inputs = captured[name]
        last = i == len(work.block_names) - 1
        block = work.model.get_submodule(name)
        sig = _signature(block, inputs)
        if sig in traced and not last:
            layer = copy.deepcopy(traced[sig])
            layer.name = name
        else:
            try:
                layer, _ = _trace_layer(work, name, inputs, last, seen_params, tp_degrees)
            except Exception as e:
                raise ProfileError(f"{model_name}: tracing block {name!r} failed ({type(e).__name__}: {e})") from None
            traced.setdefault(sig, layer)
        seen_params.update(id(p) for p in block.parameters())
        layers.append(layer)
    return layers


def _runner(block: nn.Module, inputs: tuple, loss: Callable | None = None, targets=None) -> Callable[[], Any]:
    """What one timed step runs: the block (and, for the last block, the model's loss)."""
    if loss is None:
        return lambda: block(*inputs)
    return lambda: loss(block(*inputs), targets)


def _time_layers(work: _Workload, layers: list[LayerProfile], captured: dict[str, tuple], device: torch.device,
                 dtype: torch.dtype, warmup: int, repeats: int) -> None:
    """Time each distinct block alone on the device; identical blocks share the measurement."""
    free = _free_host_bytes() if device.type == "cpu" else torch.cuda.mem_get_info(device)[0]
    for layer in layers:  # weights, their gradients and an fp32 copy while initialising; activations; outputs
        need = layer.param_bytes * 3 + layer.activation_bytes + layer.output_bytes * 2
        if need > free:
            raise ProfileError(f"block {layer.name} needs about {need / 2**30:.1f} GiB to time on {device.type}, "
                               f"{free / 2**30:.1f} GiB is free; profile on meta or use a smaller --micro-batch")
    timed: dict[str, tuple[float, float, int | None]] = {}
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        if layer.signature in timed and not last:
            layer.fwd_ms, layer.bwd_ms, layer.peak_memory_bytes = timed[layer.signature]
            continue
        if work.real_model is not None:
            block = work.real_model.get_submodule(layer.name).to(device=device, dtype=dtype)
        else:
            block = _materialise(work.model.get_submodule(layer.name), device, dtype)
        first = work.first_inputs if i == 0 else None
        inputs = _real_inputs(captured[layer.name], first, device)
        run = _runner(block, inputs, loss_function(work.spec), work.targets.to(device)) if last and work.loss \
            else _runner(block, inputs)
        try:
            result = time_block(run, device, warmup=warmup, repeats=repeats)
        except torch.OutOfMemoryError:
            raise ProfileError(f"block {layer.name} ran out of {device.type} memory; "
                               "use a smaller --micro-batch") from None
        layer.fwd_ms, layer.bwd_ms, layer.peak_memory_bytes = result
        timed.setdefault(layer.signature, result)
        del block

"""A user's own model: ``--model package.module:callable``.

The callable takes no arguments and returns ``(module, example_input, block_names)``: an
``nn.Module``, one example input tensor (or a tuple of tensors) whose first dimension is the batch (the
profile resizes it to ``--micro-batch``, repeating its rows), and the ordered module names (FQNs) of the blocks a
pipeline may cut between, which together must hold every parameter of the model. The user asked for their code to be
imported by naming it; data files (YAML/JSON) are never executed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .errors import ModelSpecError
from .specs import ModelSpec


@dataclass(frozen=True)
class CallableSpec(ModelSpec):
    target: str = ""


@dataclass
class CustomModel:
    module: Any
    example_input: Any
    block_names: list[str]


def load_callable_model(spec: CallableSpec) -> CustomModel:
    """Import and call the user's callable, checking what it returns; any failure is one line."""
    import torch
    from torch import nn

    mod_name, _, attr = spec.target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's import failing is their error, reported in one line
        raise ModelSpecError(f"--model {spec.target}: cannot import {mod_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise ModelSpecError(f"--model {spec.target}: {mod_name!r} has no callable {attr!r}")
    try:
        result = fn()
    except Exception as e:
        raise ModelSpecError(f"--model {spec.target}: the callable raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ModelSpecError(f"--model {spec.target}: must return (module, example_input, block_names)")
    module, example, blocks = result
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"--model {spec.target}: first item must be an nn.Module, got {type(module).__name__}")
    inputs = example if isinstance(example, tuple) else (example,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ModelSpecError(f"--model {spec.target}: example_input must be a tensor or a tuple of tensors")
    if not isinstance(blocks, list | tuple) or not blocks or not all(isinstance(b, str) for b in blocks):
        raise ModelSpecError(f"--model {spec.target}: block_names must be a non-empty list of module names")
    names = dict(module.named_modules())
    missing = [b for b in blocks if b not in names]
    if missing:
        raise ModelSpecError(f"--model {spec.target}: block {missing[0]!r} is not a submodule of the model")
    if len(set(blocks)) != len(blocks):
        raise ModelSpecError(f"--model {spec.target}: block_names lists a module twice")
    covered = {id(p) for b in blocks for p in names[b].parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in covered]
    if outside:  # its compute would be left out of every block: the profile would be silently short
        raise ModelSpecError(f"--model {spec.target}: block_names leave parameter {outside[0]!r} (and "
                             f"{len(outside) - 1} more) outside every block; list blocks that cover the whole model")
    return CustomModel(module, example, list(blocks))


def example_at_batch(example: Any, micro_batch: int) -> tuple:
    """The example input (a tensor or a tuple of tensors) with its first dimension, the batch, made ``micro_batch``
    rows long, its rows repeated in turn (a profile is per micro-batch, whatever the example's batch)."""
    import torch

    inputs = example if isinstance(example, tuple) else (example,)
    return tuple(t[torch.arange(micro_batch) % t.shape[0]] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0]
                 else t for t in inputs)

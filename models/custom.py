"""A user's own model: ``--model package.module:callable``.

The callable takes no arguments and returns ``(module, example_input, block_names)``: an
``nn.Module``, one example input tensor (or a tuple of tensors) for one micro-batch, and the ordered
module names (FQNs) of the blocks a pipeline may cut between. The user asked for their code to be
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
    return CustomModel(module, example, list(blocks))

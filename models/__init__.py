"""The model zoo: spec dataclasses, presets, loaders and torch builders for every family.

Specs, presets and loaders are plain Python; the torch builders are imported on first use (PEP 562),
so planning from a cached profile never pays for importing torch.
"""

import importlib

from .custom import CallableSpec, example_at_batch, load_callable_model
from .errors import ModelSpecError
from .loading import load_model_spec, parse_data_file
from .param_count import count_active_parameters, count_parameters, latent_down_params, mtp_params
from .presets import PRESETS
from .specs import (
    FAMILIES,
    MLPSpec,
    ModelSpec,
    ResNetSpec,
    TransformerSpec,
    VGGSpec,
    spec_from_mapping,
    tokens_per_sample,
)

# name -> the submodule (needing torch) that defines it
_LAZY = {
    **dict.fromkeys(("block_names", "build_model", "initialize", "loss_function", "parameter_generator",
                     "reference_init", "sample_batch", "tied_aliases", "tp_plan", "tp_style"), "registry"),
    "CustomModel": "custom", "StagedModel": "staged",
    "in_attention_core": "transformer", "in_attention_prologue": "transformer", "unfused_attention": "transformer",
    **dict.fromkeys(("MoE", "balanced_routing", "collect_aux_losses", "local_dispatch", "routes_balanced",
                     "set_aux_loss_scale"), "moe"),
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CallableSpec", "CustomModel", "FAMILIES", "MLPSpec", "MoE", "ModelSpec", "ModelSpecError", "PRESETS",
    "ResNetSpec", "StagedModel", "TransformerSpec", "VGGSpec", "balanced_routing", "block_names", "build_model",
    "collect_aux_losses", "count_active_parameters", "count_parameters", "latent_down_params", "local_dispatch",
    "mtp_params",
    "routes_balanced", "set_aux_loss_scale",
    "initialize", "parameter_generator", "tied_aliases",
    "example_at_batch", "load_callable_model", "load_model_spec", "loss_function", "parse_data_file", "reference_init",
    "sample_batch",
    "spec_from_mapping", "tokens_per_sample", "tp_plan", "tp_style", "unfused_attention", "in_attention_core",
    "in_attention_prologue",
]

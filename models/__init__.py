"""The model zoo: spec dataclasses, presets, loaders and torch builders for every family."""

from .custom import CallableSpec, CustomModel, load_callable_model
from .errors import ModelSpecError
from .loading import load_model_spec, parse_data_file
from .param_count import count_parameters
from .presets import PRESETS
from .registry import (
    block_names,
    build_model,
    initialize,
    loss_function,
    parameter_generator,
    reference_init,
    sample_batch,
    tied_aliases,
    tokens_per_sample,
    tp_plan,
    tp_style,
)
from .specs import FAMILIES, MLPSpec, ModelSpec, ResNetSpec, TransformerSpec, VGGSpec, spec_from_mapping
from .staged import StagedModel
from .transformer import in_attention_core, unfused_attention

__all__ = [
    "CallableSpec", "CustomModel", "FAMILIES", "MLPSpec", "ModelSpec", "ModelSpecError", "PRESETS", "ResNetSpec",
    "StagedModel", "TransformerSpec", "VGGSpec", "block_names", "build_model", "count_parameters",
    "initialize", "parameter_generator", "tied_aliases",
    "load_callable_model", "load_model_spec", "loss_function", "parse_data_file", "reference_init", "sample_batch",
    "spec_from_mapping", "tokens_per_sample", "tp_plan", "tp_style", "unfused_attention", "in_attention_core",
]

"""Every preset of the zoo profiles in every training dtype: on meta all of them, on a CPU the tiny ones.

The presets are read from ``paraplan.models.PRESETS`` when the tests are collected, so presets added
later (mixtures of experts, say) are covered without touching this file. Expected figures come from
definitions, not from earlier runs: the parameter count from the closed-form counts of
models/param_count.py, bytes per parameter from the dtype's width, and the first block's input from
the sample batch's shape (token ids are int64; images and features arrive in the model's dtype).
"""

from __future__ import annotations

import math

import pytest

from paraplan.models import PRESETS, load_model_spec
from paraplan.models.param_count import count_parameters
from paraplan.profiler import profile_model

DTYPES = ("bf16", "fp16", "fp32")
WIDTH = {"bf16": 2, "fp16": 2, "fp32": 4}
TINY = 10_000_000  # parameters: presets small enough to time on a CPU in a test
CPU_PRESETS = [name for name in PRESETS if count_parameters(load_model_spec(name)) < TINY]
MANY_EXPERTS = 16  # tracing routes tokens expert by expert: presets with more take seconds per profile on meta


def meta_cases() -> list:
    """Every (preset, dtype); the many-expert presets' non-default dtypes are marked slow (5-10 s each)."""
    cases = []
    for name in PRESETS:
        heavy = (getattr(load_model_spec(name), "num_experts", 0) or 0) > MANY_EXPERTS
        for dtype in DTYPES:
            marks = [pytest.mark.slow] if heavy and dtype != "bf16" else []
            cases.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return cases


def first_input_bytes(spec, dtype: str, micro_batch: int) -> int:
    """Bytes of the model's input batch as the first block sees it (models/registry.py sample_batch)."""
    if spec.is_transformer:
        return micro_batch * spec.seq_length * 8  # token ids, int64
    if spec.family in ("resnet", "vgg"):
        return micro_batch * 3 * spec.image_size ** 2 * WIDTH[dtype]  # (b, 3, H, W) images
    return micro_batch * spec.input_size * WIDTH[dtype]  # mlp: (b, input_size) features


def check_profile(name: str, dtype: str, prof) -> None:
    spec = load_model_spec(name)
    assert prof.dtype == dtype
    assert prof.num_parameters == count_parameters(spec)
    first = prof.layers[0]
    assert first.input_bytes == first_input_bytes(spec, dtype, prof.micro_batch)
    for layer in prof.layers:
        # untied parameters are stored once per layer in the model's dtype
        assert layer.param_bytes == layer.params * WIDTH[dtype], layer.name
        assert layer.fwd_flops >= 0 and layer.bwd_flops >= 0
    assert sum(x.fwd_flops for x in prof.layers) > 0


def test_the_zoo_has_the_families_it_promises():
    families = {load_model_spec(n).family for n in PRESETS}
    assert {"gpt", "llama", "bert", "resnet", "vgg", "mlp"} <= families
    assert CPU_PRESETS, "no preset is small enough for the CPU profiles"


@pytest.mark.parametrize(("name", "dtype"), meta_cases())
def test_every_preset_profiles_on_meta(name, dtype):
    check_profile(name, dtype, profile_model(name, "meta", dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CPU_PRESETS)
def test_tiny_presets_profile_on_cpu(name, dtype):
    prof = profile_model(name, "cpu", dtype=dtype, warmup=1, repeats=1)
    check_profile(name, dtype, prof)
    for layer in prof.layers:
        assert layer.fwd_ms is not None and math.isfinite(layer.fwd_ms) and layer.fwd_ms >= 0
        assert layer.bwd_ms is not None and math.isfinite(layer.bwd_ms) and layer.bwd_ms >= 0


def test_vgg16_input_arrives_in_the_models_dtype():
    """The reported failure: vgg16's first convolution has a bias, and a bf16 bias refuses an fp32 image."""
    prof = profile_model("vgg16", "meta", dtype="bf16")
    conv = prof.layers[0]
    # 3x3 convolution, 3 -> 64 channels, 224x224 output: 2 FLOPs per multiply-add
    assert conv.fwd_flops == 2 * 3 * 3 * 3 * 64 * 224 * 224
    assert conv.input_bytes == 3 * 224 * 224 * 2

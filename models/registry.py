"""One interface over every family: build the module, list its blocks, its TP plan, a batch, the loss.

Later parts (profiler, planner, executor) go through these functions only, never through the
family modules, so adding a family is one entry here.
"""

from __future__ import annotations

import contextlib
import fnmatch
import zlib
from collections.abc import Callable

import torch
from torch import nn

from .cnn import VGG, ResNet, classifier_loss, classifier_tp_plan, image_batch
from .errors import ModelSpecError
from .mlp import MLP, feature_batch
from .specs import MLPSpec, ModelSpec, ResNetSpec, TransformerSpec, VGGSpec
from .staged import StagedModel
from .transformer import Transformer, transformer_batch, transformer_loss, transformer_tp_plan


@contextlib.contextmanager
def _skip_init():
    """Make torch.nn.init a no-op while building on the meta device: values there mean nothing, and
    some init kernels import torch's compiler stack on meta (over a second for nothing)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def build_model(spec: ModelSpec, device: str | torch.device = "cpu") -> StagedModel:
    """The family's module, built on ``device`` (``meta`` allocates nothing: any size builds)."""
    skip = _skip_init() if torch.device(device).type == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        if isinstance(spec, TransformerSpec):
            return Transformer(spec)
        if isinstance(spec, ResNetSpec):
            return ResNet(spec)
        if isinstance(spec, VGGSpec):
            return VGG(spec)
        if isinstance(spec, MLPSpec):
            return MLP(spec)
    raise ModelSpecError(f"{spec.name}: family {spec.family!r} has no built-in module")


def block_names(spec: ModelSpec) -> list[str]:
    """The ordered pipeline-splittable blocks (FQNs) of the family's module."""
    return build_model(spec, "meta").block_names


def tp_plan(spec: ModelSpec) -> dict[str, str]:
    """FQN pattern (``*`` matches a layer index) -> tensor-parallel style; see transformer_tp_plan."""
    if isinstance(spec, TransformerSpec):
        return transformer_tp_plan(spec)
    return classifier_tp_plan()


def tp_style(plan: dict[str, str], fqn: str) -> str | None:
    """The style the plan gives module ``fqn`` (patterns matched with fnmatch), or None."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return style
    return None


def sample_batch(spec: ModelSpec, batch: int, generator: torch.Generator,
                 seq_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (inputs, targets) pair of ``batch`` samples, on CPU."""
    if isinstance(spec, TransformerSpec):
        return transformer_batch(spec, batch, generator, seq_length)
    if isinstance(spec, ResNetSpec | VGGSpec):
        return image_batch(spec.image_size, spec.num_classes, batch, generator)
    if isinstance(spec, MLPSpec):
        return feature_batch(spec, batch, generator)
    raise ModelSpecError(f"{spec.name}: family {spec.family!r} has no sample batches")


def loss_function(spec: ModelSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return transformer_loss if isinstance(spec, TransformerSpec) else classifier_loss


def reference_init(module: nn.Module, param_name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``param_name`` of ``module``, on CPU, fp32.

    Weights of linears and embeddings: N(0, 0.02) (GPT-2/Megatron); convolutions: Kaiming normal,
    fan-out (torchvision); norms: weight 1, bias 0; every bias (a module's BIASES too): 0. Drawn from
    ``generator``, which the caller seeds from the run's seed and the parameter's FQN, so values never depend on
    sharding.
    """
    if param_name == "bias" or param_name in getattr(module, "BIASES", ()):
        return torch.zeros(shape)
    if isinstance(module, nn.LayerNorm | nn.RMSNorm | nn.BatchNorm2d):
        return torch.ones(shape)
    if isinstance(module, nn.Conv2d):
        fan_out = shape[0] * shape[2] * shape[3]
        return torch.randn(shape, generator=generator) * (2.0 / fan_out) ** 0.5
    return torch.randn(shape, generator=generator) * 0.02


def tied_aliases(spec: ModelSpec) -> dict[str, str]:
    """Parameter FQNs that are the same tensor as another (tied LM head -> token embedding)."""
    if isinstance(spec, TransformerSpec) and spec.tied:
        return {"head.proj.weight": "embed.tok.weight"}
    return {}


def parameter_generator(seed: int, fqn: str) -> torch.Generator:
    """The generator that draws parameter ``fqn``'s initial value: a function of seed and name only."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()) + (seed << 32))


def initialize(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Give every (plain, unsharded) parameter its reference value; reset norm statistics.

    Values depend only on ``seed`` and the parameter's FQN in the whole model (tied copies use the
    name of the tensor they are tied to), so a pipeline stage gets the same weights the whole
    model would have. Sharded (DTensor) parameters are the executor's business.
    """
    aliases = tied_aliases(spec)
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                fqn = aliases.get(fqn, fqn)
                p.copy_(reference_init(mod, pname, p.shape, parameter_generator(seed, fqn)))
            if isinstance(mod, nn.BatchNorm2d):
                mod.reset_running_stats()

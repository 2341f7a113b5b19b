"""Model spec dataclasses, one per family, with strict validation.

A spec is pure data: sizes and switches, no torch. Every family's spec is built from a mapping
(YAML, preset, HF config) by :func:`spec_from_mapping`, which rejects unknown and missing keys,
wrong types and absurd sizes with the source and the field named.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import ModelSpecError

TRANSFORMER_FAMILIES = ("gpt", "llama", "bert")
CNN_FAMILIES = ("resnet", "vgg")
FAMILIES = TRANSFORMER_FAMILIES + CNN_FAMILIES + ("mlp",)

# Upper bounds that catch typos (an extra zero or three), far above any real model.
_LIMITS = {
    "num_layers": 4096,
    "hidden_size": 1 << 20,
    "num_attention_heads": 1 << 16,
    "num_kv_heads": 1 << 16,
    "ffn_hidden_size": 1 << 23,
    "vocab_size": 1 << 26,
    "seq_length": 1 << 24,
    "num_classes": 1 << 28,
    "image_size": 8192,
    "input_size": 1 << 26,
    "hidden_sizes": 1 << 24,
}


@dataclass(frozen=True)
class ModelSpec:
    """Fields every family has. ``name`` is the preset name or the file's stem."""

    name: str
    family: str

    is_transformer: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed, validated again."""
        return spec_from_mapping({**self.to_dict(), **changes}, source=self.name)


@dataclass(frozen=True)
class TransformerSpec(ModelSpec):
    """GPT (pre-LN, GELU MLP, learned positions), LLaMA (RMSNorm, SwiGLU, RoPE, GQA) or BERT
    (post-LN encoder with an MLM head). Megatron-style field names (DESIGN.md)."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    vocab_size: int = 0
    seq_length: int = 0
    num_kv_heads: int | None = None  # default: num_attention_heads (plain multi-head attention)
    ffn_hidden_size: int | None = None  # default: 4 * hidden (llama: give its SwiGLU size)
    tied_embeddings: bool | None = None  # default: true for gpt and bert, false for llama

    is_transformer: ClassVar[bool] = True
    required: ClassVar[tuple[str, ...]] = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                           "seq_length")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def causal(self) -> bool:
        """Decoder (causal) attention: gpt and llama; bert attends both ways."""
        return self.family != "bert"

    @property
    def tied(self) -> bool:
        if self.tied_embeddings is None:
            return self.family in ("gpt", "bert")
        return self.tied_embeddings

    def validate(self, source: str) -> None:
        h, a = self.hidden_size, self.num_attention_heads
        if h % a:
            raise ModelSpecError(f"{source}: num_attention_heads ({a}) must divide hidden_size ({h})")
        if a % self.kv_heads:
            raise ModelSpecError(f"{source}: num_kv_heads ({self.kv_heads}) must divide num_attention_heads ({a})")
        if self.family == "llama" and self.head_dim % 2:
            raise ModelSpecError(f"{source}: llama's rotary embedding needs an even head size, got {self.head_dim}")


@dataclass(frozen=True)
class ResNetSpec(ModelSpec):
    """torchvision's ResNet (He et al. 2016): depth 18/34 basic blocks, 50/101/152 bottlenecks."""

    depth: int = 50
    num_classes: int = 1000
    image_size: int = 224

    required: ClassVar[tuple[str, ...]] = ("depth",)
    DEPTHS: ClassVar[dict[int, tuple[str, tuple[int, ...]]]] = {
        18: ("basic", (2, 2, 2, 2)),
        34: ("basic", (3, 4, 6, 3)),
        50: ("bottleneck", (3, 4, 6, 3)),
        101: ("bottleneck", (3, 4, 23, 3)),
        152: ("bottleneck", (3, 8, 36, 3)),
    }

    def validate(self, source: str) -> None:
        if self.depth not in self.DEPTHS:
            raise ModelSpecError(f"{source}: depth must be one of {sorted(self.DEPTHS)} for resnet, got {self.depth}")
        if self.image_size < 32:
            raise ModelSpecError(f"{source}: image_size must be at least 32 for resnet, got {self.image_size}")


@dataclass(frozen=True)
class VGGSpec(ModelSpec):
    """torchvision's VGG without batch norm (Simonyan & Zisserman 2015), configurations A/B/D/E."""

    depth: int = 16
    num_classes: int = 1000
    image_size: int = 224

    required: ClassVar[tuple[str, ...]] = ("depth",)
    CONFIGS: ClassVar[dict[int, tuple[Any, ...]]] = {
        11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
        13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
        16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
        19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
    }

    def validate(self, source: str) -> None:
        if self.depth not in self.CONFIGS:
            raise ModelSpecError(f"{source}: depth must be one of {sorted(self.CONFIGS)} for vgg, got {self.depth}")
        if self.image_size < 32:
            raise ModelSpecError(f"{source}: image_size must be at least 32 for vgg, got {self.image_size}")


@dataclass(frozen=True)
class MLPSpec(ModelSpec):
    """A multi-layer perceptron classifier: Linear+ReLU per hidden size, then a Linear classifier."""

    input_size: int = 0
    hidden_sizes: tuple[int, ...] = field(default_factory=tuple)
    num_classes: int = 0

    required: ClassVar[tuple[str, ...]] = ("input_size", "hidden_sizes", "num_classes")

    def validate(self, source: str) -> None:
        if not self.hidden_sizes:
            raise ModelSpecError(f"{source}: hidden_sizes must list at least one width")


SPEC_CLASSES: dict[str, type[ModelSpec]] = {
    "gpt": TransformerSpec, "llama": TransformerSpec, "bert": TransformerSpec,
    "resnet": ResNetSpec, "vgg": VGGSpec, "mlp": MLPSpec,
}


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _check_int(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelSpecError(f"{source}: field '{key}' must be a whole number, got {value!r}")
    if value <= 0:
        raise ModelSpecError(f"{source}: field '{key}' must be positive, got {value}")
    limit = _LIMITS.get(key)
    if limit is not None and value > limit:
        raise ModelSpecError(f"{source}: field '{key}' = {value} is absurdly large (limit {limit})")
    return value


def spec_from_mapping(data: Any, source: str) -> ModelSpec:
    """Validate a mapping (parsed YAML/JSON or a preset) into the family's spec dataclass."""
    if not isinstance(data, dict):
        raise ModelSpecError(f"{source}: a model spec must be a mapping of fields, got {type(data).__name__}")
    family = data.get("family")
    if family is None:
        raise ModelSpecError(f"{source}: missing field 'family' (one of {', '.join(FAMILIES)})")
    if family not in SPEC_CLASSES:
        raise ModelSpecError(f"{source}: unknown family {family!r}{_suggest(str(family), list(FAMILIES))}; "
                             f"known: {', '.join(FAMILIES)}")
    cls = SPEC_CLASSES[family]
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        k = unknown[0]
        raise ModelSpecError(f"{source}: unknown field '{k}' for family {family}{_suggest(str(k), names)}")
    missing = [k for k in cls.required if k not in data]
    if missing:
        raise ModelSpecError(f"{source}: missing field '{missing[0]}' for family {family}")
    values: dict[str, Any] = {"name": str(data.get("name") or source), "family": family}
    for f in dataclasses.fields(cls):
        if f.name in ("name", "family") or f.name not in data:
            continue
        v = data[f.name]
        if f.name == "tied_embeddings":
            if v is not None and not isinstance(v, bool):
                raise ModelSpecError(f"{source}: field 'tied_embeddings' must be true or false, got {v!r}")
        elif f.name == "hidden_sizes":
            if not isinstance(v, list | tuple):
                raise ModelSpecError(f"{source}: field 'hidden_sizes' must be a list of widths, got {v!r}")
            v = tuple(_check_int(source, "hidden_sizes", x) for x in v)
        elif v is None and f.default is None:
            pass
        else:
            v = _check_int(source, f.name, v)
        values[f.name] = v
    spec = cls(**values)
    spec.validate(source)
    return spec


def tokens_per_sample(spec: ModelSpec, seq_length: int | None = None) -> int:
    """Tokens a sample carries (sequence length for language models, 1 otherwise)."""
    if isinstance(spec, TransformerSpec):
        return seq_length or spec.seq_length
    return 1

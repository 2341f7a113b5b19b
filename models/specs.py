"""Model spec dataclasses, one per family, with strict validation.

A spec is pure data: sizes and switches, no torch. Every family's spec is built from a mapping
(YAML, preset, HF config) by :func:`spec_from_mapping`, which rejects unknown and missing keys,
wrong types and absurd sizes with the source and the field named.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
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
    "head_dim": 1 << 16,
    "sliding_window": 1 << 24,
    "num_experts": 1 << 16,
    "experts_per_token": 1 << 16,
    "moe_ffn_hidden_size": 1 << 23,
    "num_shared_experts": 1 << 10,
    "dense_layers": 4096,
    "moe_layer_step": 4096,
    "mtp_layers": 64,
    "q_lora_rank": 1 << 20,
    "kv_lora_rank": 1 << 20,
    "qk_nope_head_dim": 1 << 16,
    "qk_rope_head_dim": 1 << 16,
    "v_head_dim": 1 << 16,
    "moe_router_num_groups": 1 << 16,
    "moe_router_group_topk": 1 << 16,
}
SCORE_FUNCTIONS = ("softmax", "sigmoid")
# how group-limited routing scores a group: the sum of its top k / group_topk scores (Megatron-Core's
# group_limited_topk; DeepSeek-V3's top-2 sum at its k / group_topk = 2) or its best score (DeepSeek-V2's
# group_limited_greedy)
GROUP_SCORES = ("top-sum", "max")
# Transformer fields added with mixture-of-experts support: left out of to_dict() at their defaults.
_OPTIONAL_FIELDS = frozenset({
    "qk_norm", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers",
    "num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts", "dense_layers",
    "moe_layer_step", "moe_score_function", "moe_norm_topk", "moe_routed_scaling_factor", "moe_aux_loss_coeff",
    "sliding_window", "qkv_bias", "expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_group_score", "moe_router_expert_bias"})
_BOOL_FIELDS = frozenset({"qk_norm", "moe_norm_topk", "qkv_bias", "expert_bias", "moe_router_expert_bias"})
_ZERO_OK_FIELDS = frozenset({"num_experts", "num_shared_experts", "dense_layers", "mtp_layers"})


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
    ffn_hidden_size: int | None = None  # default: 4 * hidden (llama: its SwiGLU rule, ffn_size)
    tied_embeddings: bool | None = None  # default: true for gpt and bert, false for llama
    # Attention variants. head_dim: default hidden / heads (Qwen3 gives its own); with MLA, the Q/K head
    # size qk_nope_head_dim + qk_rope_head_dim. qk_norm: RMSNorm on each head's query and key (Qwen3).
    head_dim: int | None = None
    qk_norm: bool = False
    qkv_bias: bool = False  # biases on the query, key and value projections of a llama layer (Qwen2, Qwen2.5)
    # attention over the last sliding_window tokens only (Mistral's): not modelled, so only sequences it covers
    # are planned (planner/workload.py refuses longer ones); None: full causal attention
    sliding_window: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 Sec. 2.1): on when kv_lora_rank is set.
    q_lora_rank: int | None = None  # None: queries projected directly (V2-Lite), else through this rank
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mtp_layers: int = 0  # DeepSeek-V3's multi-token-prediction modules (counted, not built: models/moe.py)
    # Mixture of experts (Megatron-Core names; see models/moe.py). num_experts 0 = dense.
    num_experts: int = 0
    experts_per_token: int | None = None  # top-k routed experts per token
    moe_ffn_hidden_size: int | None = None  # one routed expert's FFN size (default: ffn_hidden_size)
    num_shared_experts: int = 0  # experts every token goes through (DeepSeek), each moe_ffn_hidden_size wide
    dense_layers: int = 0  # the first k layers keep a dense MLP (DeepSeek-V3's first_k_dense_replace)
    # past them, every moe_layer_step-th layer has experts, the others a dense MLP: layer i (0-based) when
    # (i + 1) % moe_layer_step == 0 (Llama 4's interleave_moe_layer_step, Qwen's decoder_sparse_step)
    moe_layer_step: int = 1
    moe_score_function: str = "softmax"  # router scores: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = True  # renormalise the k selected scores to sum to 1
    moe_routed_scaling_factor: float = 1.0  # DeepSeek-V3 multiplies the routed output by 2.5
    moe_aux_loss_coeff: float = 0.01  # sequence-wise load-balancing loss weight (alpha); 0 turns it off
    # biases on every routed expert's linear layers and on the router (GPT-OSS); shared experts have none
    expert_bias: bool = False
    # group-limited routing (DeepSeek-V3's node-limited routing, arXiv 2412.19437 Sec. 2.1.2; HF n_group /
    # topk_group; Megatron-Core's moe_router_num_groups / moe_router_group_topk): the experts in num_groups equal
    # blocks, each token's k experts chosen within the group_topk blocks of highest summed top-(k / group_topk)
    # scores (DeepSeek-V2's group_limited_greedy: of highest best score, moe_router_group_score "max"). 1 / 1: no limit
    moe_router_num_groups: int = 1
    moe_router_group_topk: int = 1
    moe_router_group_score: str = "top-sum"  # GROUP_SCORES
    # auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 Sec. 2.1.2; Wang et al., arXiv 2408.15664): a bias
    # per routed expert added to its score for the top-k choice alone, moved each step against the expert's load (HF
    # topk_method "noaux_tc", e_score_correction_bias; Megatron-Core's moe_router_enable_expert_bias). No time or
    # memory worth pricing; the exports pass it on. paraplan's executor balances with the sequence-wise loss alone
    moe_router_expert_bias: bool = False

    is_transformer: ClassVar[bool] = True
    required: ClassVar[tuple[str, ...]] = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                           "seq_length")

    def __post_init__(self) -> None:
        if self.head_dim is None and self.num_attention_heads > 0:  # the effective head size, always an int
            object.__setattr__(self, "head_dim", self._default_head_dim())

    def _default_head_dim(self) -> int:
        if self.mla:
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        """The fields, leaving out the attention and MoE ones at their defaults: a dense model's dict (its
        profile-cache key, a plan's ``model_spec``, saved measurements) reads as it did before they existed."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in _OPTIONAL_FIELDS and d[f.name] == f.default:
                del d[f.name]
        if d.get("head_dim") == self._default_head_dim():
            del d["head_dim"]
        return d

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """The MLP's width: as given, else 4h (GPT, BERT), or for LLaMA's SwiGLU MLP its own rule, 2/3 of 4h rounded
        up to a multiple of 256 (Meta's llama model.py, multiple_of 256: 11008 at h 4096, 13824 at 5120)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.family == "llama":
            return -(-(8 * self.hidden_size // 3) // 256) * 256
        return 4 * self.hidden_size

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_ffn_size(self) -> int:
        """One routed (or shared) expert's FFN size; Megatron's default is the dense ffn_hidden_size."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def top_k(self) -> int:
        return self.experts_per_token or 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has routed experts instead of a dense MLP."""
        return self.is_moe and index >= self.dense_layers and (index + 1) % self.moe_layer_step == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

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
        if h % a and self.head_dim == h // a and not self.mla:  # an explicit head_dim need not divide h
            raise ModelSpecError(f"{source}: num_attention_heads ({a}) must divide hidden_size ({h})")
        if a % self.kv_heads:
            raise ModelSpecError(f"{source}: num_kv_heads ({self.kv_heads}) must divide num_attention_heads ({a})")
        self._validate_mla(source)
        rotary = self.qk_rope_head_dim if self.mla else self.head_dim
        if self.family == "llama" and rotary % 2:
            raise ModelSpecError(f"{source}: llama's rotary embedding needs an even head size, got {rotary}")
        if self.qkv_bias and (self.family != "llama" or self.mla):
            raise ModelSpecError(f"{source}: field 'qkv_bias' applies to llama layers with plain attention "
                                 f"(gpt and bert have biases everywhere; latent attention none), not "
                                 f"{'latent attention' if self.mla else self.family}")
        self._validate_moe(source)

    def _validate_mla(self, source: str) -> None:
        mla_fields = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.mla:
            given = [k for k in mla_fields if getattr(self, k) is not None]
            if given:
                raise ModelSpecError(f"{source}: field '{given[0]}' belongs to multi-head latent attention, "
                                     "which needs kv_lora_rank")
            return
        if self.family != "llama":
            raise ModelSpecError(f"{source}: multi-head latent attention (kv_lora_rank) needs family llama "
                                 f"(its decoupled rotary embedding), got {self.family}")
        for k in mla_fields[1:]:
            if getattr(self, k) is None:
                raise ModelSpecError(f"{source}: multi-head latent attention (kv_lora_rank) needs field '{k}'")
        if self.num_kv_heads not in (None, self.num_attention_heads):
            raise ModelSpecError(f"{source}: field 'num_kv_heads' does not apply to multi-head latent attention "
                                 "(every head reads the shared latent)")
        if self.head_dim != self._default_head_dim():
            raise ModelSpecError(f"{source}: field 'head_dim' must be qk_nope_head_dim + qk_rope_head_dim "
                                 f"({self._default_head_dim()}) with multi-head latent attention, got {self.head_dim}")

    def _validate_moe(self, source: str) -> None:
        moe_only = {"experts_per_token": None, "moe_ffn_hidden_size": None, "num_shared_experts": 0,
                    "dense_layers": 0, "moe_layer_step": 1, "expert_bias": False, "moe_router_num_groups": 1,
                    "moe_router_group_topk": 1, "moe_router_group_score": "top-sum",
                    "moe_router_expert_bias": False}
        if not self.is_moe:
            given = [k for k, default in moe_only.items() if getattr(self, k) != default]
            if given:
                raise ModelSpecError(f"{source}: field '{given[0]}' needs num_experts > 0 (a mixture of experts)")
            return
        k, e = self.experts_per_token, self.num_experts
        if k is None:
            raise ModelSpecError(f"{source}: a mixture of experts (num_experts {e}) needs field 'experts_per_token'")
        if k > e:
            raise ModelSpecError(f"{source}: field 'experts_per_token' ({k}) exceeds num_experts ({e})")
        if self.dense_layers >= self.num_layers:
            raise ModelSpecError(f"{source}: field 'dense_layers' ({self.dense_layers}) must be less than "
                                 f"num_layers ({self.num_layers}): at least one layer has experts")
        if not self.num_moe_layers:
            raise ModelSpecError(f"{source}: field 'moe_layer_step' ({self.moe_layer_step}) leaves no layer with "
                                 f"experts among the {self.num_layers} (past the {self.dense_layers} dense ones)")
        if self.moe_score_function not in SCORE_FUNCTIONS:
            raise ModelSpecError(f"{source}: field 'moe_score_function' must be one of "
                                 f"{', '.join(SCORE_FUNCTIONS)}, got {self.moe_score_function!r}")
        if self.moe_router_expert_bias and self.moe_score_function != "sigmoid":
            raise ModelSpecError(f"{source}: field 'moe_router_expert_bias' needs moe_score_function sigmoid (the "
                                 "bias moves sigmoid scores, as in DeepSeek-V3 and Megatron-Core), got "
                                 f"{self.moe_score_function!r}")
        if self.moe_router_group_score not in GROUP_SCORES:
            raise ModelSpecError(f"{source}: field 'moe_router_group_score' must be one of {', '.join(GROUP_SCORES)}, "
                                 f"got {self.moe_router_group_score!r}")
        g, m = self.moe_router_num_groups, self.moe_router_group_topk
        if e % g:
            raise ModelSpecError(f"{source}: field 'moe_router_num_groups' ({g}) must divide num_experts ({e})")
        if m > g:
            raise ModelSpecError(f"{source}: field 'moe_router_group_topk' ({m}) exceeds moe_router_num_groups ({g})")
        if self.moe_router_group_score != "top-sum" and g == 1:
            raise ModelSpecError(f"{source}: field 'moe_router_group_score' needs moe_router_num_groups > 1 "
                                 "(group-limited routing)")
        if g > 1 and not m <= k <= m * (e // g):
            raise ModelSpecError(f"{source}: experts_per_token ({k}) must be between moe_router_group_topk ({m}) and "
                                 f"the experts of the groups chosen ({m} x {e // g}): each chosen group gives one "
                                 "at least")

    @property
    def routing_groups(self) -> tuple[int, int]:
        """(groups, groups chosen per token) of group-limited routing; (1, 1) without."""
        return self.moe_router_num_groups, self.moe_router_group_topk

    @property
    def routing_limit(self) -> tuple[int, int, str]:
        """routing_groups with how a group is scored (moe_router_group_score)."""
        return self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_group_score


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
        least = "zero or more" if key in _ZERO_OK_FIELDS else "positive"
        raise ModelSpecError(f"{source}: field '{key}' must be {least}, got {value}")
    limit = _LIMITS.get(key)
    if limit is not None and value > limit:
        raise ModelSpecError(f"{source}: field '{key}' = {value} is absurdly large (limit {limit})")
    return value


def _check_float(source: str, key: str, value: Any, zero_ok: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelSpecError(f"{source}: field '{key}' must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ModelSpecError(f"{source}: field '{key}' must be {'non-negative' if zero_ok else 'positive'}, "
                             f"got {value}")
    return float(value)


def spec_from_mapping(data: Any, source: str) -> ModelSpec:
    """Validate a mapping (parsed YAML/JSON or a preset) into the family's spec dataclass."""
    if not isinstance(data, dict):
        raise ModelSpecError(f"{source}: a model spec must be a mapping of fields, got {type(data).__name__}")
    family = data.get("family")
    if family is None:
        raise ModelSpecError(f"{source}: missing field 'family' (one of {', '.join(FAMILIES)})")
    if not isinstance(family, str) or family not in SPEC_CLASSES:
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
        elif f.name in _BOOL_FIELDS:
            if not isinstance(v, bool):
                raise ModelSpecError(f"{source}: field '{f.name}' must be true or false, got {v!r}")
        elif f.name in ("moe_score_function", "moe_router_group_score"):
            choices = SCORE_FUNCTIONS if f.name == "moe_score_function" else GROUP_SCORES
            if v not in choices:
                raise ModelSpecError(f"{source}: field '{f.name}' must be one of {', '.join(choices)}, got {v!r}")
        elif f.name in ("moe_aux_loss_coeff", "moe_routed_scaling_factor"):
            v = _check_float(source, f.name, v, zero_ok=f.name == "moe_aux_loss_coeff")
        elif f.name in _ZERO_OK_FIELDS:
            v = 0 if v == 0 and not isinstance(v, bool) else _check_int(source, f.name, v)
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

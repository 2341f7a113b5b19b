"""Which torchtitan 0.2.2 model trains the plan's model, and the module that registers it with the plan's shape.

torchtitan builds a model from a registered train spec and flavor (``[model] name``, ``flavor``). A model with
the shape of one of its llama3 flavors (8B, 70B, 405B, debugmodel) uses that flavor. Any other model gets a
small Python module written beside the job file: torchtitan imports it before building the model
(``[experimental] custom_import``, train.py) and it registers, with ``register_train_spec``, the train spec of
the torchtitan model that expresses the plan's model exactly, holding one flavor with the plan's shape:

- llama3: dense LLaMA (RMSNorm, SwiGLU, RoPE, GQA), untied, head size hidden / heads; the SwiGLU width through
  ``multiple_of`` / ``ffn_dim_multiplier`` (torchtitan derives it from the hidden size), RoPE scaling off.
- llama4: a mixture of experts in every layer, same attention as llama3 (``interleave_moe_layer_step`` 1,
  ``auto_scale_hidden_dim`` off, the expert width through ``multiple_of`` / ``ffn_dim_multiplier``); or in every
  n-th layer (the plan's moe_layer_step, Llama 4 Maverick), the dense width through those two and the experts'
  derived from it (``auto_scale_hidden_dim``: divided by top-k + shared experts), where that gives the plan's.
- qwen3: what llama3 and llama4 lack: tied embeddings, q/k RMSNorm, a head size other than hidden / heads
  (dense, or experts in every layer). torchtitan 0.2.2's qwen3 has no pipeline parallelism.
- deepseek_v3: multi-head latent attention, dense or with dense first layers and (shared) experts.

- gpt (learned positions, LayerNorm, GELU MLP, biases), which no torchtitan model has: paraplan's own, as a
  torchtitan model (executor/torchtitan_gpt.py: torchtitan's module names, llama3's train spec around it), which
  the module registers; the machines running torchtitan need paraplan installed. Not with context parallelism
  (learned positions) or, tied, with pipeline parallelism.

The flavor takes RoPE base and RMSNorm eps from the plan's HF config.json where there is one (Llama
3.1-style RoPE scaling too, for llama3/llama4), else paraplan's LLaMA's: base 10000 without scaling, eps 1e-5
(models/transformer.py). Refused: bert (a bidirectional encoder): no torchtitan 0.2.2 model trains one, and
training another would void the plan's parameter count, memory and time; what no torchtitan model combines
(e.g. tied embeddings with pipeline parallelism, dense first layers without latent attention) is refused naming
the combination.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from dataclasses import dataclass, field

from paraplan.models import TransformerSpec, count_parameters
from paraplan.models.presets import LLAMA31_SCALING, PUBLISHED_NUMERICS

from ..plan import Plan, hf_numerics
from .common import ExportRefused

TARGET = "torchtitan"
TORCHTITAN_SOURCE = "torchtitan 0.2.2"
# registered llama3 flavor -> (layers, hidden, heads, kv heads, SwiGLU ffn size as built, vocabulary), HF assets
FLAVORS = {
    "debugmodel": ((6, 256, 16, 16, 768, 2048), "./tests/assets/tokenizer"),
    "8B": ((32, 4096, 32, 8, 14336, 128256), "./assets/hf/Llama-3.1-8B"),
    "70B": ((80, 8192, 64, 8, 28672, 128256), "./assets/hf/Llama-3.1-70B"),
    "405B": ((126, 16384, 128, 8, 53248, 128256), "./assets/hf/Llama-3.1-405B"),
}
ROPE_THETA, NORM_EPS = 10000.0, 1e-5  # paraplan's LLaMA (models/transformer.py); its q/k (and MLA) norms: 1e-6
LOAD_BALANCE_COEFF = 1e-3  # torchtitan's expert-bias update rate (MoEArgs default)
_INTERLEAVED_ROPE = ("RoPE rotates interleaved pairs of each head's channels (paraplan: its two halves): the same "
                     "model up to a fixed permutation of the wq/wk output rows (matters only to convert weights)")


@dataclass
class TitanModel:
    """The torchtitan model for a plan: ``[model]`` name and flavor, and the module registering the flavor."""

    name: str  # [model] name: a torchtitan model, or paraplan_<base> (registered by the module)
    flavor: str
    hf_assets_path: str
    base: str = ""  # the torchtitan model whose train spec the module reuses; "" = a flavor torchtitan has
    args_class: str = ""  # the ModelArgs class, imported from torchtitan.models.<base> (or from ``runtime``)
    runtime: str = ""  # paraplan's module defining the model for torchtitan (its gpt_train_spec), "" = torchtitan's
    args: list[tuple[str, str, str]] = field(default_factory=list)  # (field, Python source, comment)
    imports: list[str] = field(default_factory=list)  # extra import lines the args need
    optimizers: str = ""  # a build_optimizers_fn replacing the base's ("" = keep it)
    differences: list[str] = field(default_factory=list)  # numerics torchtitan computes otherwise (docstring)
    notes: list[str] = field(default_factory=list)  # what runs differently from the plan (stderr, the files)
    num_parameters: int = 0  # what the flavor builds: paraplan's count of the plan's model

    @property
    def needs_module(self) -> bool:
        """Whether torchtitan needs the flavor module (it has no flavor of this shape)."""
        return bool(self.base)


@dataclass(frozen=True)
class Numerics:
    """RoPE base, RMSNorm eps and RoPE scaling of the plan's model: its HF config.json's where the plan came from
    one that is still there (the model the user trains), else paraplan's own LLaMA's."""

    rope_theta: float = ROPE_THETA
    norm_eps: float = NORM_EPS
    rope_scaling: dict | None = None
    source: str = ""  # the config.json read ("" = paraplan's values)
    missing: str = ""  # the plan's config.json, where it could not be read

    def comment(self) -> str:
        return f"from {self.source}" if self.source else "paraplan's LLaMA"


def numerics(plan: Plan) -> Numerics:
    """The numerics the plan kept from its HF config (Plan.model_numerics), else that config's read now (any .json
    the planner read as one: it has a model_type; plans written before they were kept), or a preset's
    published ones (models/presets.PUBLISHED_NUMERICS), else paraplan's own."""
    kept = plan.model_numerics
    if kept is not None:  # read from the config where the plan was made (planner/plan.py config_numerics)
        return _numerics_of(kept)
    if not plan.model.endswith(".json"):
        published = PUBLISHED_NUMERICS.get(plan.model)
        if published is None:
            return Numerics()
        return Numerics(published["rope_theta"], published["rms_norm_eps"], published["rope_scaling"],
                        f"{published['source']}'s config.json (preset {plan.model})")
    try:
        with open(plan.model) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return Numerics(missing=plan.model)
    read = hf_numerics(cfg, plan.model)
    if read is not None:
        return _numerics_of(read)
    # a paraplan spec written as JSON: its defaults; an HF config whose values cannot be read: say so
    return Numerics(missing=plan.model) if isinstance(cfg, dict) and "model_type" in cfg else Numerics()


def _numerics_of(values: dict) -> Numerics:
    """Numerics from a plan's model_numerics (planner/plan.py hf_numerics)."""
    return Numerics(float(values["rope_theta"]), float(values["rms_norm_eps"]), values["rope_scaling"],
                    values["source"])


def titan_model(plan: Plan, spec: TransformerSpec) -> TitanModel:
    """The torchtitan model expressing ``spec`` under the plan's layout, or ExportRefused naming the difference."""
    if spec.family == "gpt":
        return _gpt(plan, spec)
    if spec.family != "llama":
        raise ExportRefused(TARGET, f"a {spec.family} model ({spec.name}: a bidirectional encoder with a masked-LM "
                            "head)", f"{TORCHTITAN_SOURCE} trains causal decoders only; export --to deepspeed "
                            "(Megatron-LM's pretrain_gpt.py trains decoders too)")
    if spec.expert_bias:
        raise ExportRefused(TARGET, f"biases on the experts and the router ({spec.name}: expert_bias)",
                            f"{TORCHTITAN_SOURCE}'s llama4 and deepseek_v3 experts have no bias; train it with "
                            "paraplan execute")
    groups, _ = spec.routing_groups
    if groups > 1 and spec.num_experts // groups < 2:  # torchtitan's router raises at start-up
        raise ExportRefused(TARGET, f"groups of one expert ({spec.name}: moe_router_num_groups {groups} of "
                            f"{spec.num_experts} experts)", f"{TORCHTITAN_SOURCE}'s node-limited routing needs two "
                            "experts per group at least; export --to megatron (Megatron-Core takes one)")
    if spec.qkv_bias:
        raise ExportRefused(TARGET, f"biases on the q, k and v projections ({spec.name}: Qwen2's layer)",
                            f"{TORCHTITAN_SOURCE}'s llama3, qwen3 and llama4 attention projections have no bias; "
                            "export --to megatron (--add-qkv-bias)")
    registered = _registered_flavor(spec)
    num = numerics(plan)
    if registered and (num.rope_theta, num.norm_eps, _llama3_scaling(num)) != (500000.0, 1e-5, LLAMA31_SCALING):
        registered = None  # torchtitan's llama3 flavors are Llama 3.1's: another RoPE takes a flavor module
    if registered:
        return TitanModel("llama3", registered, FLAVORS[registered][1])
    if spec.mla:
        return _deepseek_v3(plan, spec)
    plain = not spec.tied and not spec.qk_norm and spec.head_dim == spec.hidden_size // spec.num_attention_heads
    if spec.is_moe and spec.dense_layers:
        raise ExportRefused(TARGET, f"dense first layers in a mixture of experts (dense_layers {spec.dense_layers}) "
                            "without latent attention", f"{TORCHTITAN_SOURCE}'s qwen3 and llama4 put experts in "
                            "every layer, and its deepseek_v3 pairs dense first layers with latent attention only")
    if plain:
        return _llama4(plan, spec) if spec.is_moe else _llama3(plan, spec)
    if plan.layout.pp > 1:
        needs = [what for what, on in (("tied embeddings", spec.tied), ("q/k RMSNorm", spec.qk_norm),
                                       (f"head size {spec.head_dim} (not hidden/heads)",
                                        spec.head_dim != spec.hidden_size // spec.num_attention_heads)) if on]
        raise ExportRefused(TARGET, f"{' and '.join(needs)} with pipeline parallelism (pp {plan.layout.pp})",
                            f"of {TORCHTITAN_SOURCE}'s models only qwen3 has "
                            f"{'them' if len(needs) > 1 else 'it'}, and its qwen3 has no pipeline parallelism; "
                            "re-plan with --pp 1")
    return _qwen3(plan, spec)


def _llama3_scaling(num: Numerics) -> dict | None:
    """A Llama 3.1-style RoPE scaling as its five numbers (the type under either key name), or None."""
    scaling = num.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    return {k: (v if k == "rope_type" else float(v)) for k, v in {**LLAMA31_SCALING, **scaling}.items()
            if k in LLAMA31_SCALING}


def _registered_flavor(spec: TransformerSpec) -> str | None:
    shape = (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.ffn_size,
             spec.vocab_size)
    if spec.tied or spec.is_moe or spec.mla or spec.qk_norm or spec.head_dim != spec.hidden_size // \
            spec.num_attention_heads:
        return None
    return next((name for name, (flavor_shape, _) in FLAVORS.items() if shape == flavor_shape), None)


def _custom(plan: Plan, spec: TransformerSpec, base: str, args_class: str) -> TitanModel:
    return TitanModel(f"paraplan_{base}", spec.name, _assets_path(plan, spec), base=base, args_class=args_class,
                      num_parameters=count_parameters(spec))


def _assets_path(plan: Plan, spec: TransformerSpec) -> str:
    """The folder of the plan's HF config.json where it still exists (its tokenizer is usually there)."""
    folder = os.path.dirname(plan.model)
    if os.path.basename(plan.model) == "config.json" and os.path.isdir(folder or "."):
        return os.path.abspath(folder or ".")
    return f"./assets/hf/{spec.name}"


def _shape_args(spec: TransformerSpec) -> list[tuple[str, str, str]]:
    return [("dim", repr(spec.hidden_size), ""), ("n_layers", repr(spec.num_layers), ""),
            ("n_heads", repr(spec.num_attention_heads), "")]


def _llama3(plan: Plan, spec: TransformerSpec) -> TitanModel:
    m = _custom(plan, spec, "llama3", "TransformerModelArgs")
    mult, multiple_of = ffn_settings(spec.hidden_size, spec.ffn_size)
    m.args = _shape_args(spec) + [
        ("n_kv_heads", repr(spec.kv_heads), ""), ("vocab_size", repr(spec.vocab_size), ""),
        ("multiple_of", repr(multiple_of), ""),
        ("ffn_dim_multiplier", repr(mult), _ffn_comment(spec.hidden_size, mult, multiple_of, "SwiGLU width")),
        *_norm_rope(m, numerics(plan), "RoPEScalingArgs(scaling_factor=1.0)", "plain RoPE: Llama 3.1's scaling off"),
        ("max_seq_len", repr(_seq(plan, spec)), "")]
    m.imports = ["from torchtitan.models.llama3.model.args import RoPEScalingArgs"]
    m.differences.append(_INTERLEAVED_ROPE)
    return m


def _llama4(plan: Plan, spec: TransformerSpec) -> TitanModel:
    m = _custom(plan, spec, "llama4", "TransformerModelArgs")
    step = spec.moe_layer_step
    # experts in every layer: their width is the one FFN setting; else the dense layers' is, and the experts' follows
    mult, multiple_of = ffn_settings(spec.hidden_size, spec.moe_ffn_size if step == 1 else spec.ffn_size)
    if step == 1:
        width = [("ffn_dim_multiplier", repr(mult), _ffn_comment(spec.hidden_size, mult, multiple_of, "expert width")),
                 ("auto_scale_hidden_dim", "False", "the expert width as given")]
    else:
        share = spec.top_k + spec.num_shared_experts
        experts = ffn_width(spec.hidden_size, mult, 1) // share
        experts += -experts % multiple_of
        if experts != spec.moe_ffn_size:
            raise ExportRefused(TARGET, f"experts {spec.moe_ffn_size} wide beside dense layers {spec.ffn_size} wide "
                                f"(moe_layer_step {step})", f"{TORCHTITAN_SOURCE}'s llama4 derives the experts' width "
                                f"from the dense one (/ top-k + shared experts = {experts} here)")
        width = [("ffn_dim_multiplier", repr(mult), _ffn_comment(spec.hidden_size, mult, multiple_of, "dense width")),
                 ("auto_scale_hidden_dim", "True", f"expert width {experts}: the dense one / (top-k + shared experts), "
                                                   f"rounded up to a multiple of {multiple_of}")]
    m.args = _shape_args(spec) + [
        ("n_kv_heads", repr(spec.kv_heads), ""), ("vocab_size", repr(spec.vocab_size), ""),
        ("multiple_of", repr(multiple_of), ""), width[0],
        *_norm_rope(m, numerics(plan), "None", "plain RoPE"), ("max_seq_len", repr(_seq(plan, spec)), ""),
        ("moe_args", _moe_args(spec), ""), width[1],
        ("interleave_moe_layer_step", repr(step), "experts in every layer" if step == 1 else
         f"experts in layers i with (i + 1) % {step} == 0, a dense MLP in the others")]
    m.imports = ["from torchtitan.models.llama4.model.args import RoPEScalingArgs",
                 "from torchtitan.models.moe import MoEArgs"]
    m.differences.append(_INTERLEAVED_ROPE)
    _moe_notes(m, spec)
    return m


def _qwen3(plan: Plan, spec: TransformerSpec) -> TitanModel:
    m = _custom(plan, spec, "qwen3", "Qwen3ModelArgs")
    m.args = _shape_args(spec) + [
        ("n_kv_heads", repr(spec.kv_heads), ""), ("head_dim", repr(spec.head_dim), ""),
        ("vocab_size", repr(spec.vocab_size), ""), ("hidden_dim", repr(spec.ffn_size), "dense SwiGLU width"),
        ("qk_norm", repr(spec.qk_norm), ""), *_norm_rope(m, numerics(plan)),
        ("max_seq_len", repr(_seq(plan, spec)), ""),
        ("enable_weight_tying", repr(spec.tied), "")]
    if spec.is_moe:
        m.args += [("moe_enabled", "True", "experts in every layer"),
                   ("moe_inter_dim", repr(spec.moe_ffn_size), ""), ("moe_args", _moe_args(spec), "")]
        m.imports = ["from torchtitan.models.moe import MoEArgs"]
        if spec.moe_aux_loss_coeff > 0:  # torchtitan's qwen3 builds no expert-bias updates
            m.optimizers = "build_optimizers_with_moe_load_balancing"
        _moe_notes(m, spec)
    if spec.qk_norm and numerics(plan).norm_eps != 1e-6:
        m.differences += [f"one RMSNorm eps ({numerics(plan).norm_eps:g}) for every norm: paraplan's q/k norms use "
                         "1e-6"]
    return m


def _deepseek_v3(plan: Plan, spec: TransformerSpec) -> TitanModel:
    if spec.tied:
        raise ExportRefused(TARGET, "tied embeddings with latent attention",
                            f"{TORCHTITAN_SOURCE}'s deepseek_v3 (its only model with latent attention) unties them")
    if spec.qk_norm:
        raise ExportRefused(TARGET, "q/k RMSNorm with latent attention",
                            f"{TORCHTITAN_SOURCE}'s deepseek_v3 (its only model with latent attention) has none")
    m = _custom(plan, spec, "deepseek_v3", "DeepSeekV3ModelArgs")
    seq = _seq(plan, spec)
    m.args = [("vocab_size", repr(spec.vocab_size), ""), ("dim", repr(spec.hidden_size), ""),
              ("inter_dim", repr(spec.ffn_size), "dense SwiGLU width"),
              ("moe_inter_dim", repr(spec.moe_ffn_size), "expert width"), ("n_layers", repr(spec.num_layers), ""),
              ("n_dense_layers", repr(spec.dense_layers if spec.is_moe else spec.num_layers),
               "the first layers have a dense MLP" if spec.is_moe else "no experts: every layer dense"),
              ("n_heads", repr(spec.num_attention_heads), "")]
    rope_norm = _norm_rope(m, numerics(plan))
    if spec.is_moe:
        m.args.append(("moe_args", _moe_args(spec), ""))
        m.imports = ["from torchtitan.models.moe import MoEArgs"]
    m.args += [("q_lora_rank", repr(spec.q_lora_rank or 0), "" if spec.q_lora_rank else "queries projected directly"),
               ("kv_lora_rank", repr(spec.kv_lora_rank), ""), ("qk_nope_head_dim", repr(spec.qk_nope_head_dim), ""),
               ("qk_rope_head_dim", repr(spec.qk_rope_head_dim), ""), ("v_head_dim", repr(spec.v_head_dim), ""),
               ("max_seq_len", repr(seq), ""), ("original_seq_len", repr(seq), "= max_seq_len: YaRN scaling off"),
               *rope_norm, ("rope_factor", "1.0", "")]
    m.differences += [_INTERLEAVED_ROPE, f"the latent q/kv RMSNorms use eps {rope_norm[0][1]} (paraplan: 1e-6) and "
                     "the final norm torch's default eps, the dtype's machine epsilon (paraplan: 1e-5)"]
    if spec.is_moe:
        _moe_notes(m, spec)
    if spec.mtp_layers:
        m.notes.append(f"the model's {spec.mtp_layers} multi-token-prediction module(s) (mtp_layers) are in neither "
                       "the plan nor torchtitan's deepseek_v3: both train without them")
    return m


def _gpt(plan: Plan, spec: TransformerSpec) -> TitanModel:
    """paraplan's gpt model for torchtitan (executor/torchtitan_gpt.py): what it cannot run is refused by name."""
    lay = plan.layout
    refusals = [(spec.is_moe, "experts in a gpt model", "executor/torchtitan_gpt.py builds dense gpt layers only"),
                (spec.qk_norm, "q/k norms in a gpt model", "executor/torchtitan_gpt.py's gpt has none"),
                (lay.dtype == "fp8", "fp8 for a gpt model", "executor/torchtitan_gpt.py has no float8 tensor-parallel "
                 "styles (torchtitan's llama3 has): export a bf16 plan"),
                (spec.head_dim != spec.hidden_size // spec.num_attention_heads,
                 f"head size {spec.head_dim} (not hidden/heads) in a gpt model",
                 "executor/torchtitan_gpt.py's gpt takes hidden / heads"),
                (lay.cp > 1, f"context parallelism (cp {lay.cp}) with learned position embeddings",
                 "torchtitan's load-balanced sequence split does not give the model each token's position; re-plan "
                 "with --cp 1"),
                (spec.tied and lay.pp > 1,
                 f"a head tied to the token embedding with pipeline parallelism (pp {lay.pp})",
                 "the two ends sit on different stages; re-plan with --pp 1 or give the spec tied_embeddings: false")]
    for refused, what, why in refusals:
        if refused:
            raise ExportRefused(TARGET, what, why)
    spec = spec.replace(seq_length=_seq(plan, spec))  # the positions table the plan trains (training.seq_len)
    m = TitanModel("paraplan_gpt", spec.name, _assets_path(plan, spec), base="gpt", args_class="GPTArgs",
                   runtime="paraplan.executor.torchtitan_gpt", num_parameters=count_parameters(spec))
    m.notes.append("torchtitan has no gpt model: the flavor module registers paraplan's (paraplan.executor."
                   "torchtitan_gpt), so paraplan must be installed where torchtitan runs")
    m.args = _shape_args(spec) + [("n_kv_heads", repr(spec.kv_heads), ""), ("ffn_dim", repr(spec.ffn_size), ""),
                                  ("vocab_size", repr(spec.vocab_size), ""),
                                  ("max_seq_len", repr(spec.seq_length), "learned positions: the table's rows"),
                                  ("tied", repr(spec.tied), "the head's weight is the token embedding's")]
    return m


def _norm_rope(m: TitanModel, num: Numerics, plain: str = "", plain_comment: str = "") -> list[tuple[str, str, str]]:
    """norm_eps, rope_theta and (``plain``: the base has RoPE scaling args) rope_scaling_args: Llama 3.1-style
    scaling where the config.json has it and the base takes it, else plain RoPE (and a note if it had another)."""
    args = [("norm_eps", repr(num.norm_eps), num.comment()), ("rope_theta", repr(num.rope_theta), num.comment())]
    scaling = num.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if num.source and (num.rope_theta, num.norm_eps, kind) != (ROPE_THETA, NORM_EPS, None):
        m.differences.append(f"RoPE base {num.rope_theta:g}, RMSNorm eps {num.norm_eps:g}"
                             + (f", RoPE scaling {kind}" if kind else "") + f" as {num.source} says (paraplan's "
                             f"executor: base {ROPE_THETA:g} without scaling, eps {NORM_EPS:g}; no planned figure "
                             "depends on them)")
    if num.missing:
        m.notes.append(f"the plan's model came from {num.missing}, which cannot be read here: the flavor uses "
                       f"paraplan's RoPE base {ROPE_THETA:g} and RMSNorm eps {NORM_EPS:g} (export where that file is, "
                       "or edit the module)")
    if plain and kind == "llama3":
        fields = (("scaling_factor", "factor"), ("low_freq_factor", "low_freq_factor"),
                  ("high_freq_factor", "high_freq_factor"),
                  ("original_max_position_embeddings", "original_max_position_embeddings"))
        given = "".join(f"        {ours}={scaling[theirs]!r},\n" for ours, theirs in fields if theirs in scaling)
        return args + [("rope_scaling_args", f"RoPEScalingArgs(\n{given}    )", num.comment())]
    if kind:
        m.notes.append(f"{num.source} scales RoPE ({kind}); torchtitan's {m.base} flavor uses plain RoPE, as "
                       "paraplan's executor does")
    return args + ([("rope_scaling_args", plain, plain_comment)] if plain else [])


def _moe_args(spec: TransformerSpec) -> str:
    balance = repr(LOAD_BALANCE_COEFF) if spec.moe_aux_loss_coeff > 0 else "None"
    groups, group_topk = spec.routing_groups
    limited = (f"        num_expert_groups={groups},  # node-limited routing\n"
               f"        num_limited_groups={group_topk},\n") if groups > 1 else ""
    return ("MoEArgs(\n"
            f"        num_experts={spec.num_experts},\n"
            f"        num_shared_experts={spec.num_shared_experts},\n"
            f"        top_k={spec.top_k},\n"
            f"        score_func={json.dumps(spec.moe_score_function)},\n"
            f"        route_norm={spec.moe_norm_topk!r},  # renormalise the top-k scores\n"
            f"        route_scale={spec.moe_routed_scaling_factor!r},\n"
            f"{limited}"
            "        score_before_experts=False,  # scores weight the experts' outputs\n"
            f"        load_balance_coeff={balance},  # expert-bias balancing (torchtitan has no auxiliary loss)\n"
            "    )")


def _moe_notes(m: TitanModel, spec: TransformerSpec) -> None:
    groups, group_topk = spec.routing_groups
    if groups > 1 and spec.moe_router_group_score == "max":
        m.notes.append(f"{TORCHTITAN_SOURCE} scores a group of experts by its top 2 scores; the plan (DeepSeek-V2's "
                       "group_limited_greedy) by its best score: the groups chosen may differ")
    elif groups > 1 and spec.top_k // group_topk != 2:
        m.notes.append(f"{TORCHTITAN_SOURCE} scores a group of experts by its top 2 scores; the plan (as "
                       f"Megatron-Core) by its top k / group_topk = {spec.top_k // group_topk}: the groups chosen may "
                       "differ")
    if spec.moe_aux_loss_coeff > 0:
        m.notes.append(f"{TORCHTITAN_SOURCE} has no auxiliary load-balancing loss: instead of the plan's "
                       f"sequence-wise one (moe_aux_loss_coeff {spec.moe_aux_loss_coeff:g}) experts are balanced by "
                       f"the auxiliary-loss-free expert bias (load_balance_coeff {LOAD_BALANCE_COEFF:g}, "
                       "arXiv 2408.15664)")


def _seq(plan: Plan, spec: TransformerSpec) -> int:
    return plan.seq_length or spec.seq_length


def ffn_width(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """The SwiGLU width torchtitan's llama3 (and llama4's experts) build: 2/3 of 4·dim, times the multiplier,
    rounded up to a multiple of ``multiple_of`` (llama3 model.py FeedForward)."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_settings(dim: int, width: int) -> tuple[float | None, int]:
    """(ffn_dim_multiplier, multiple_of) that build exactly ``width``: the plainest pair (no multiplier, or one
    with the fewest digits; the largest power-of-two multiple), else the width itself as the multiple."""
    base = int(2 * (4 * dim) / 3)
    for multiple_of in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if width % multiple_of:
            continue
        if ffn_width(dim, None, multiple_of) == width:
            return None, multiple_of
        for digits in range(1, 7):
            multiplier = round(width / base, digits)
            if multiplier > 0 and ffn_width(dim, multiplier, multiple_of) == width:
                return multiplier, multiple_of
    multiplier = width / base
    assert ffn_width(dim, multiplier, width) == width, (dim, width)
    return multiplier, width


def _ffn_comment(dim: int, multiplier: float | None, multiple_of: int, what: str) -> str:
    scaled = "int(8 * dim / 3)" if multiplier is None else f"int({multiplier!r} * int(8 * dim / 3))"
    return f"{what} {ffn_width(dim, multiplier, multiple_of)}: {scaled} rounded up to a multiple of {multiple_of}"


def module_name(filename: str) -> str:
    """The flavor module's import name for a job file: ``<stem>_model`` (``job.toml`` -> ``job_model``)."""
    stem = re.sub(r"\W", "_", os.path.basename(filename).split(".")[0]) or "torchtitan"
    return ("m_" + stem if stem[0].isdigit() else stem) + "_model"


def module_text(model: TitanModel, plan: Plan, plan_path: str, job_file: str, name: str) -> str:
    """The Python module that registers ``model``'s flavor (torchtitan imports it: ``custom_import``)."""
    def para(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(text, 110, initial_indent=indent, subsequent_indent=" " * len(indent),
                             break_on_hyphens=False)

    lines = ['"""' + f"{TORCHTITAN_SOURCE} model for {job_file}, exported by paraplan from {plan_path}.", ""]
    spec_text = (f"paraplan's {model.base} model in torchtitan's llama3 train spec ({model.runtime}, which needs "
                 "paraplan installed here)" if model.runtime else f"torchtitan's {model.base} train spec")
    lines += para(f"torchtitan imports this module before it builds the model (custom_import = \"{name}\" in "
                  f"{job_file}). It registers the train spec \"{model.name}\" ([model] name): {spec_text} "
                  f"holding one flavor, \"{model.flavor}\" ([model] flavor), the plan's "
                  f"model {plan.model} ({model.num_parameters:,} parameters). Keep it beside {job_file}, with that "
                  "folder on PYTHONPATH (the launch command does so).")
    if model.differences:
        lines += ["", f"Where torchtitan's {model.base} computes otherwise than paraplan's model (same shapes):"]
        lines += [x for d in model.differences for x in para(d, "- ")]
    if model.notes:
        lines += ["", "Notes (paraplan export prints them too):"] + [x for n in model.notes for x in para(n, "- ")]
    lines += ['"""', ""]
    if model.runtime:  # paraplan's model: its own train spec builder
        lines += [f"from {model.runtime} import {model.args_class}, {model.base}_train_spec",
                  "from torchtitan.protocols.train_spec import register_train_spec", ""]
        lines += _flavor_lines(model)
        lines += ["", f"register_train_spec(NAME, {model.base}_train_spec({{FLAVOR: MODEL_ARGS}}))", ""]
        return "\n".join(lines)
    lines += ["import dataclasses", ""]
    if model.optimizers:
        lines.append(f"from torchtitan.components.optimizer import {model.optimizers}")
    lines.append(f"from torchtitan.models.{model.base} import {model.args_class}")
    lines += model.imports
    lines += ["from torchtitan.protocols.train_spec import get_train_spec, register_train_spec", ""]
    lines += _flavor_lines(model)
    lines += ["", "register_train_spec(", "    NAME,", "    dataclasses.replace(",
              f"        get_train_spec({json.dumps(model.base)}),", "        model_args={FLAVOR: MODEL_ARGS},"]
    if model.optimizers:
        lines.append(f"        build_optimizers_fn={model.optimizers},  # expert-bias load balancing")
    lines += ["    ),", ")", ""]
    return "\n".join(lines)


def _flavor_lines(model: TitanModel) -> list[str]:
    """NAME, FLAVOR, NUM_PARAMETERS and MODEL_ARGS, as the flavor module states them."""
    lines = [f"NAME = {json.dumps(model.name)}  # [model] name",
             f"FLAVOR = {json.dumps(model.flavor)}  # [model] flavor",
             f"NUM_PARAMETERS = {model.num_parameters}  # what paraplan counts for this model", "",
             f"MODEL_ARGS = {model.args_class}("]
    for key, source, comment in model.args:
        lines.append(f"    {key}={source}," + (f"  # {comment}" if comment else ""))
    return lines + [")"]

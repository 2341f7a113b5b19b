"""Read a Hugging Face ``config.json`` into a spec mapping, with each model type's own field names.

Dense: GPT-2, LLaMA, Mistral, BERT, Qwen2 / Qwen2.5 (biased q, k and v projections), Phi-3 (LLaMA's layer with
fused q/k/v and gate/up weights: the same parameters), Qwen3. Mixtures of experts: Mixtral (``num_local_experts``,
experts ``intermediate_size`` wide), Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, per-head q/k norms,
``decoder_sparse_step`` / ``mlp_only_layers``), DeepSeek-V2/V3 (multi-head latent attention,
``n_routed_experts`` + ``n_shared_experts``, ``first_k_dense_replace``, sigmoid scores,
``num_nextn_predict_layers``), Llama 4 (its ``text_config``: ``num_local_experts`` experts and one shared
expert ``intermediate_size`` wide, dense layers ``intermediate_size_mlp`` wide between the MoE ones every
``interleave_moe_layer_step`` layers, or as ``moe_layers`` lists them; top-1 sigmoid routing). Only the
fields that determine the architecture are read (other keys are HF's and are ignored); the transformers
package is not needed. Dense layers among MoE ones map to ``dense_layers`` (the first k) and
``moe_layer_step`` (every n-th has experts); any other pattern is refused naming its fields.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ModelSpecError

_LLAMA_LIKE = {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
               "num_attention_heads": ("num_attention_heads",), "num_kv_heads": ("num_key_value_heads",),
               "ffn_hidden_size": ("intermediate_size",), "vocab_size": ("vocab_size",),
               "seq_length": ("max_position_embeddings",), "tied_embeddings": ("tie_word_embeddings",)}
_QWEN3 = {**_LLAMA_LIKE, "head_dim": ("head_dim",)}
_DEEPSEEK = {k: v for k, v in _LLAMA_LIKE.items() if k != "num_kv_heads"}  # MLA: every head reads the latent

# HF field -> our field, per model_type. A tuple lists alternatives, the first present (and not null) wins.
_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"num_layers": ("n_layer",), "hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
             "vocab_size": ("vocab_size",), "seq_length": ("n_positions", "n_ctx"),
             "ffn_hidden_size": ("n_inner",), "tied_embeddings": ("tie_word_embeddings",)},
    "llama": {**_LLAMA_LIKE, "head_dim": ("head_dim",)},
    # Mistral: LLaMA's layer (the sliding attention window of its first release is not priced: planner/workload.py
    # plans only sequences it covers)
    "mistral": {**_LLAMA_LIKE, "head_dim": ("head_dim",)},
    "bert": {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
             "num_attention_heads": ("num_attention_heads",), "ffn_hidden_size": ("intermediate_size",),
             "vocab_size": ("vocab_size",), "seq_length": ("max_position_embeddings",),
             "tied_embeddings": ("tie_word_embeddings",)},
    "qwen3": _QWEN3,
    "qwen2": _LLAMA_LIKE,  # Qwen2Config has no head_dim: hidden / heads
    "phi3": {**_LLAMA_LIKE, "head_dim": ("head_dim",)},
    # Mixtral's experts are intermediate_size wide (Megatron: moe_ffn_hidden_size defaults to ffn_hidden_size).
    "mixtral": {**_LLAMA_LIKE, "head_dim": ("head_dim",), "num_experts": ("num_local_experts",),
                "experts_per_token": ("num_experts_per_tok",), "moe_aux_loss_coeff": ("router_aux_loss_coef",)},
    "qwen3_moe": {**_QWEN3, "num_experts": ("num_experts",), "experts_per_token": ("num_experts_per_tok",),
                  "moe_ffn_hidden_size": ("moe_intermediate_size",), "moe_norm_topk": ("norm_topk_prob",),
                  "moe_aux_loss_coeff": ("router_aux_loss_coef",)},
    "deepseek_v3": {**_DEEPSEEK, "q_lora_rank": ("q_lora_rank",), "kv_lora_rank": ("kv_lora_rank",),
                    "qk_nope_head_dim": ("qk_nope_head_dim",), "qk_rope_head_dim": ("qk_rope_head_dim",),
                    "v_head_dim": ("v_head_dim",), "num_experts": ("n_routed_experts",),
                    "experts_per_token": ("num_experts_per_tok",), "num_shared_experts": ("n_shared_experts",),
                    "moe_ffn_hidden_size": ("moe_intermediate_size",), "dense_layers": ("first_k_dense_replace",),
                    "mtp_layers": ("num_nextn_predict_layers",), "moe_score_function": ("scoring_func",),
                    "moe_norm_topk": ("norm_topk_prob",), "moe_routed_scaling_factor": ("routed_scaling_factor",),
                    "moe_aux_loss_coeff": ("aux_loss_alpha",), "moe_router_num_groups": ("n_group",),
                    "moe_router_group_topk": ("topk_group",)},
    # Llama 4's text model (HF Llama4TextConfig): MoE blocks of routed experts plus one shared expert, both
    # intermediate_size wide; its dense layers' MLP is intermediate_size_mlp wide. Llama4 L2-normalises q and k
    # without weights (use_qk_norm): no parameters, so not our (RMSNorm) qk_norm.
    "llama4_text": {**_QWEN3, "ffn_hidden_size": ("intermediate_size_mlp", "intermediate_size"),
                    "moe_ffn_hidden_size": ("intermediate_size",), "num_experts": ("num_local_experts",),
                    "experts_per_token": ("num_experts_per_tok",), "moe_aux_loss_coeff": ("router_aux_loss_coef",)},
}
_FIELDS["deepseek_v2"] = _FIELDS["deepseek_v3"]
# What transformers' config class takes for a missing intermediate_size (LlamaConfig, MistralConfig, Qwen3Config,
# MixtralConfig defaults): a config.json without it loads with this width
_FFN_DEFAULTS = {"llama": 11008, "mistral": 14336, "qwen3": 22016, "mixtral": 14336, "qwen2": 22016, "phi3": 8192}
# Switches of a llama-style layer that add parameters this family does not model (it has no biases)
_UNMODELLED = ("attention_bias", "mlp_bias")
_FAMILY = {"gpt2": "gpt", "bert": "bert"}  # every other type is a llama-style decoder
_REQUIRED = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"}
_QK_NORM = {"qwen3", "qwen3_moe"}  # Qwen3 always normalises each head's query and key (no config switch)


def is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and "model_type" in data


def spec_mapping_from_hf(data: dict[str, Any], source: str) -> dict[str, Any]:
    if data.get("model_type") == "llama4":  # the multimodal wrapper: its language model is what trains here
        if not isinstance(data.get("text_config"), dict):
            raise ModelSpecError(f"{source}: a llama4 config needs its text_config (the language model's fields)")
        data = {"model_type": "llama4_text", **data["text_config"]}
    model_type = data.get("model_type")
    if model_type not in _FIELDS:
        raise ModelSpecError(f"{source}: HF model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(_FIELDS))})")
    out: dict[str, Any] = {"family": _FAMILY.get(model_type, "llama")}
    for ours, theirs in _FIELDS[model_type].items():
        found = [k for k in theirs if data.get(k) is not None]
        if found:
            out[ours] = data[found[0]]
        elif ours in _REQUIRED:
            raise ModelSpecError(f"{source}: HF config lacks '{theirs[0]}' (needed for {ours})")
    if "ffn_hidden_size" not in out and model_type in _FFN_DEFAULTS:
        out["ffn_hidden_size"] = _FFN_DEFAULTS[model_type]
    for key in _UNMODELLED:
        if _FAMILY.get(model_type, "llama") == "llama" and data.get(key):
            raise ModelSpecError(f"{source}: {key} true is not supported (this model family has no biases; "
                                 "its parameter count and traffic would be wrong)")
    window = data.get("sliding_window")
    # only sequences a window covers are planned (workload): Mistral's and Phi-3's apply when given, Qwen2's only
    # with use_sliding_window (its config carries a window it does not use)
    if window is not None and (model_type in ("mistral", "phi3") or (model_type == "qwen2" and
                                                                     data.get("use_sliding_window"))):
        out["sliding_window"] = window
    if model_type == "qwen2":
        out["qkv_bias"] = True  # Qwen2Attention: q_proj, k_proj, v_proj with bias, o_proj without
    if model_type == "gpt2" and "tied_embeddings" not in out:
        out["tied_embeddings"] = True  # GPT-2 ties its LM head to the token embedding
    if model_type == "bert" and data.get("type_vocab_size", 2) != 2:
        raise ModelSpecError(f"{source}: only type_vocab_size 2 is supported for bert, "
                             f"got {data.get('type_vocab_size')}")
    if model_type in _QK_NORM:
        out["qk_norm"] = True
    if model_type == "qwen3_moe" and out.get("num_experts"):
        layers = out.get("num_layers", 0)
        step = _whole(_given(data, "decoder_sparse_step", 1), "decoder_sparse_step", source)
        dense_ids = _layer_ids(data.get("mlp_only_layers"), "mlp_only_layers", layers, source)
        out.update(_moe_layer_pattern([i not in dense_ids and (i + 1) % step == 0 for i in range(layers)],
                                      "mlp_only_layers / decoder_sparse_step", source))
    if model_type == "llama4_text" and out.get("num_experts"):
        layers = out.get("num_layers", 0)
        step = _whole(_given(data, "interleave_moe_layer_step", 1), "interleave_moe_layer_step", source)
        listed = data.get("moe_layers")
        moe_ids = _layer_ids(listed, "moe_layers", layers, source) if listed is not None else \
            set(range(step - 1, layers, step))
        out.update(_moe_layer_pattern([i in moe_ids for i in range(layers)],
                                      "moe_layers" if listed is not None else "interleave_moe_layer_step", source))
        out.update(num_shared_experts=1, moe_score_function="sigmoid", moe_norm_topk=False)
    if model_type.startswith("deepseek"):
        if data.get("moe_layer_freq", 1) != 1:
            raise ModelSpecError(f"{source}: moe_layer_freq {data.get('moe_layer_freq')} is not supported "
                                 "(only the first first_k_dense_replace layers may be dense)")
        if model_type == "deepseek_v3" and "moe_aux_loss_coeff" not in out:
            out["moe_aux_loss_coeff"] = 0.0001  # the V3 report's balance factor (arXiv 2412.19437, Sec. 4.2)
        if model_type == "deepseek_v3" and out.get("num_experts"):  # DeepseekV3Config's defaults: n_group 8, topk 4
            out.setdefault("moe_router_num_groups", 8)
            out.setdefault("moe_router_group_topk", 4)
            # its default top-k method, noaux_tc: scores plus e_score_correction_bias (aux-loss-free balancing)
            if data.get("topk_method", "noaux_tc") == "noaux_tc" and out.get("moe_score_function") == "sigmoid":
                out["moe_router_expert_bias"] = True
        if model_type == "deepseek_v2" and data.get("topk_method", "greedy") != "group_limited_greedy":
            out.pop("moe_router_num_groups", None)  # V2's greedy top-k ignores its n_group / topk_group
            out.pop("moe_router_group_topk", None)
        elif model_type == "deepseek_v2" and out.get("moe_router_num_groups") not in (None, 1):
            out["moe_router_group_score"] = "max"  # group_limited_greedy scores a group by its best expert
        if out.get("num_experts") is None:  # a dense DeepSeek (n_routed_experts null): no MoE-only fields
            for k in ("experts_per_token", "num_shared_experts", "moe_ffn_hidden_size", "dense_layers",
                      "moe_router_num_groups", "moe_router_group_topk"):
                out.pop(k, None)
    return out


def in_config_terms(message: str, data: dict[str, Any], source: str) -> str:
    """A spec error about a config.json (spec_from_mapping names paraplan's fields) in the file's own keys: field
    'moe_router_num_groups' of a DeepSeek config is its 'n_group', num_layers its 'num_hidden_layers'; a Llama 4
    wrapper's keys under 'text_config.'. Fields read under the same name, or not read from one key, stay as they are."""
    prefix = ""
    if data.get("model_type") == "llama4" and isinstance(data.get("text_config"), dict):
        data, prefix = {"model_type": "llama4_text", **data["text_config"]}, "text_config."
    fields = _FIELDS.get(data.get("model_type"), {})
    keys = {ours: prefix + next((k for k in theirs if data.get(k) is not None), theirs[0])
            for ours, theirs in fields.items()}
    keys = {ours: key for ours, key in keys.items() if key != ours}
    head, sep, body = message.partition(f"{source}: ")  # the path itself is left alone
    if not keys or not sep or head:
        return message
    words = re.compile(r"\b(" + "|".join(sorted(map(re.escape, keys), key=len, reverse=True)) + r")\b")
    return f"{source}: " + words.sub(lambda m: keys[m.group(1)], body)


def _given(data: dict[str, Any], key: str, default: Any) -> Any:
    """``data[key]``, or ``default`` where it is missing or null (a 0 stays 0, to be refused)."""
    value = data.get(key)
    return default if value is None else value


def _layer_ids(value: Any, field: str, layers: int, source: str) -> set[int]:
    """A list of layer indices (``mlp_only_layers``, ``moe_layers``), each a whole number below ``layers``; null: none.
    Anything else is refused: read as a set of layers, a number or a layer that does not exist would pass unseen."""
    if value is None:
        return set()
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ModelSpecError(f"{source}: {field} must be a list of layer indices, got {value!r}")
    wrong = [i for i in value if not 0 <= i < layers]
    if wrong:
        raise ModelSpecError(f"{source}: {field} lists layer {wrong[0]}, outside 0..{layers - 1} "
                             f"(the model has {layers} layers)")
    return set(value)


def _whole(value: Any, field: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelSpecError(f"{source}: {field} must be a positive whole number, got {value!r}")
    return value


def _moe_layer_pattern(has_experts: list[bool], origin: str, source: str) -> dict[str, int]:
    """The spec's dense_layers and moe_layer_step for a config's per-layer choice of experts (layer i has them
    when i >= dense_layers and (i + 1) % moe_layer_step == 0): "the first k are dense", "every n-th layer", or
    both. Any other pattern is refused, naming the fields it came from."""
    moe = [i for i, e in enumerate(has_experts) if e]
    if not moe:
        raise ModelSpecError(f"{source}: {origin} leave no layer with experts")
    steps = ([moe[1] - moe[0]] if len(moe) > 1 else []) + [1]
    for step in steps:
        first = moe[0] - step + 1  # the least dense_layers that keeps layer moe[0] - step dense
        for dense in sorted({max(0, first), moe[0]}):
            if [i >= dense and (i + 1) % step == 0 for i in range(len(has_experts))] == has_experts:
                return {"dense_layers": dense, "moe_layer_step": step}
    dense_ids = [i for i, e in enumerate(has_experts) if not e]
    raise ModelSpecError(f"{source}: dense layers {dense_ids[:8]}{'...' if len(dense_ids) > 8 else ''} (from {origin}) "
                         "are neither the first k layers nor all but every n-th one (the layouts supported)")

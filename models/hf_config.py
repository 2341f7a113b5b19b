"""Read a Hugging Face ``config.json`` into a spec mapping, with each model type's own field names.

Dense: GPT-2, LLaMA, BERT, Qwen3. Mixtures of experts: Mixtral (``num_local_experts``, experts
``intermediate_size`` wide), Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, per-head q/k norms,
``decoder_sparse_step`` / ``mlp_only_layers``), DeepSeek-V2/V3 (multi-head latent attention,
``n_routed_experts`` + ``n_shared_experts``, ``first_k_dense_replace``, sigmoid scores,
``num_nextn_predict_layers``). Only the fields that determine the architecture are read (other keys
are HF's and are ignored); the transformers package is not needed.
"""

from __future__ import annotations

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
    "llama": _LLAMA_LIKE,
    "bert": {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
             "num_attention_heads": ("num_attention_heads",), "ffn_hidden_size": ("intermediate_size",),
             "vocab_size": ("vocab_size",), "seq_length": ("max_position_embeddings",),
             "tied_embeddings": ("tie_word_embeddings",)},
    "qwen3": _QWEN3,
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
                    "moe_aux_loss_coeff": ("aux_loss_alpha",)},
}
_FIELDS["deepseek_v2"] = _FIELDS["deepseek_v3"]
_FAMILY = {"gpt2": "gpt", "bert": "bert"}  # every other type is a llama-style decoder
_REQUIRED = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"}
_QK_NORM = {"qwen3", "qwen3_moe"}  # Qwen3 always normalises each head's query and key (no config switch)


def is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and "model_type" in data


def spec_mapping_from_hf(data: dict[str, Any], source: str) -> dict[str, Any]:
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
    if model_type == "gpt2" and "tied_embeddings" not in out:
        out["tied_embeddings"] = True  # GPT-2 ties its LM head to the token embedding
    if model_type == "bert" and data.get("type_vocab_size", 2) != 2:
        raise ModelSpecError(f"{source}: only type_vocab_size 2 is supported for bert, "
                             f"got {data.get('type_vocab_size')}")
    if model_type in _QK_NORM:
        out["qk_norm"] = True
    if model_type == "qwen3_moe":
        out["dense_layers"] = _qwen3_dense_layers(data, out, source)
    if model_type.startswith("deepseek"):
        if data.get("moe_layer_freq", 1) != 1:
            raise ModelSpecError(f"{source}: moe_layer_freq {data.get('moe_layer_freq')} is not supported "
                                 "(only the first first_k_dense_replace layers may be dense)")
        if model_type == "deepseek_v3" and "moe_aux_loss_coeff" not in out:
            out["moe_aux_loss_coeff"] = 0.0001  # the V3 report's balance factor (arXiv 2412.19437, Sec. 4.2)
        if not out.get("num_experts"):  # a dense DeepSeek: no MoE-only fields
            for k in ("experts_per_token", "num_shared_experts", "moe_ffn_hidden_size", "dense_layers"):
                out.pop(k, None)
    return out


def _qwen3_dense_layers(data: dict[str, Any], out: dict[str, Any], source: str) -> int:
    """Qwen3-MoE's sparse layers (HF Qwen3MoeDecoderLayer): layer i has experts when i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0. Only "the first k are dense" maps to a spec."""
    layers = out.get("num_layers", 0)
    dense_ids = set(data.get("mlp_only_layers") or [])
    step = data.get("decoder_sparse_step", 1) or 1
    if not isinstance(step, int) or step < 1:
        raise ModelSpecError(f"{source}: decoder_sparse_step must be a positive whole number, got {step!r}")
    dense = sorted(i for i in range(layers) if i in dense_ids or (i + 1) % step)
    if dense != list(range(len(dense))):
        raise ModelSpecError(f"{source}: dense layers {dense[:8]}{'...' if len(dense) > 8 else ''} (from "
                             "mlp_only_layers / decoder_sparse_step) are not the first k layers, the only "
                             "dense-layer layout supported")
    return len(dense)

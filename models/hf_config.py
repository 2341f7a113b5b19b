"""Read a Hugging Face ``config.json`` (GPT-2, LLaMA, BERT field names) into a spec mapping.

Only the fields that determine the architecture are read; the transformers package is not needed.
"""

from __future__ import annotations

from typing import Any

from .errors import ModelSpecError

# HF field -> our field, per model_type. A tuple lists alternatives, the first present wins.
_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"num_layers": ("n_layer",), "hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
             "vocab_size": ("vocab_size",), "seq_length": ("n_positions", "n_ctx"),
             "ffn_hidden_size": ("n_inner",), "tied_embeddings": ("tie_word_embeddings",)},
    "llama": {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
              "num_attention_heads": ("num_attention_heads",), "num_kv_heads": ("num_key_value_heads",),
              "ffn_hidden_size": ("intermediate_size",), "vocab_size": ("vocab_size",),
              "seq_length": ("max_position_embeddings",), "tied_embeddings": ("tie_word_embeddings",)},
    "bert": {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
             "num_attention_heads": ("num_attention_heads",), "ffn_hidden_size": ("intermediate_size",),
             "vocab_size": ("vocab_size",), "seq_length": ("max_position_embeddings",),
             "tied_embeddings": ("tie_word_embeddings",)},
}
_FAMILY = {"gpt2": "gpt", "llama": "llama", "bert": "bert"}
_OPTIONAL = {"ffn_hidden_size", "num_kv_heads", "tied_embeddings"}


def is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and "model_type" in data


def spec_mapping_from_hf(data: dict[str, Any], source: str) -> dict[str, Any]:
    model_type = data.get("model_type")
    if model_type not in _FIELDS:
        raise ModelSpecError(f"{source}: HF model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(_FIELDS))})")
    out: dict[str, Any] = {"family": _FAMILY[model_type]}
    for ours, theirs in _FIELDS[model_type].items():
        found = [k for k in theirs if data.get(k) is not None]
        if found:
            out[ours] = data[found[0]]
        elif ours not in _OPTIONAL:
            raise ModelSpecError(f"{source}: HF config lacks '{theirs[0]}' (needed for {ours})")
    if model_type == "gpt2" and "tied_embeddings" not in out:
        out["tied_embeddings"] = True  # GPT-2 ties its LM head to the token embedding
    if model_type == "bert" and data.get("type_vocab_size", 2) != 2:
        raise ModelSpecError(f"{source}: only type_vocab_size 2 is supported for bert, "
                             f"got {data.get('type_vocab_size')}")
    return out

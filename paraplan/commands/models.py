"""``paraplan models``: the presets in a table (or one JSON object)."""

from __future__ import annotations

from paraplan.models import PRESETS, count_parameters, load_model_spec

from .output import human, print_json, stdout, table


def _describe(spec) -> str:
    if spec.is_transformer:
        kv = f", kv {spec.kv_heads}" if spec.kv_heads != spec.num_attention_heads else ""
        moe = (f" experts={spec.num_experts}x{spec.moe_ffn_size} top-{spec.top_k}"
               + (f" +{spec.num_shared_experts} shared" if spec.num_shared_experts else "")
               + (f" in {spec.num_moe_layers} layers" if spec.num_moe_layers < spec.num_layers else "")) \
        if spec.is_moe else ""
        return (f"L={spec.num_layers} h={spec.hidden_size} a={spec.num_attention_heads}{kv} "
                f"ffn={spec.ffn_size}{moe} V={spec.vocab_size} s={spec.seq_length}")
    if spec.family == "mlp":
        return f"in={spec.input_size} hidden={list(spec.hidden_sizes)} classes={spec.num_classes}"
    return f"depth={spec.depth} classes={spec.num_classes} image={spec.image_size}"


def run(args) -> int:
    specs = [load_model_spec(name) for name in PRESETS]
    if args.json:
        print_json({"models": [{"name": s.name, "family": s.family, "num_parameters": count_parameters(s),
                                "spec": s.to_dict()} for s in specs]})
        return 0
    rows = [[s.name, s.family, human(count_parameters(s)), _describe(s)] for s in specs]
    stdout.print(table("Model presets", ["name", "family", "parameters", "shape"], rows, justify_right_from=2))
    return 0

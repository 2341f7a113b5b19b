"""Mixture-of-experts models: published parameter counts, HF config.json mapping, the MoE block (routing,
dispatch, shared experts, the aux-loss autoscaler), balanced-routing FLOPs and the profile."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import ROOT, run_cli_json
from paraplan.models import (
    PRESETS,
    ModelSpecError,
    balanced_routing,
    build_model,
    collect_aux_losses,
    count_active_parameters,
    count_parameters,
    initialize,
    load_model_spec,
    loss_function,
    mtp_params,
    routes_balanced,
    sample_batch,
    set_aux_loss_scale,
    spec_from_mapping,
    tp_plan,
    tp_style,
)
from paraplan.models.moe import AuxLossAutoScaler, balanced_assignment, local_dispatch, sequence_aux_loss
from paraplan.models.param_count import (
    transformer_embedding_params,
    transformer_head_params,
    transformer_layer_active_params,
    transformer_layer_params,
)
from paraplan.profiler import profile_model

HF = ROOT / "tests" / "data" / "hf"  # the models' own config.json files (tests/data/hf/SOURCES.md)
B = 1e9


def hf_spec(name: str):
    return load_model_spec(str(HF / name / "config.json"))


# ---- parameter counts vs the published figures ----
# Published figures are rounded to their last digit; each is held to within one unit of that digit.
# (name, total, active, unit) -- sources: tests/data/hf/SOURCES.md
PUBLISHED = [
    ("Mixtral-8x7B-v0.1", 46.7 * B, 12.9 * B, 0.1 * B),  # mistral.ai "Mixtral of experts"; model card
    ("Mixtral-8x22B-v0.1", 141 * B, 39 * B, 1 * B),  # mistral.ai "Cheaper, Better, Faster, Stronger"
    ("Qwen3-30B-A3B", 30.5 * B, 3.3 * B, 0.1 * B),  # Qwen/Qwen3-30B-A3B model card
    ("Qwen3-235B-A22B", 235 * B, 22 * B, 1 * B),  # Qwen/Qwen3-235B-A22B model card
    ("DeepSeek-V3", 671 * B, 37 * B, 1 * B),  # arXiv 2412.19437 abstract: 671B total, 37B activated per token
    # Meta's Llama 4 model card: 17B active, 400B total (its vision encoder included; the language model is 400.7B)
    ("Llama-4-Maverick-17B-128E", 400 * B, 17 * B, 1 * B),
]


@pytest.mark.parametrize("name,total,active,unit", PUBLISHED)
def test_parameter_counts_match_published(name, total, active, unit):
    spec = hf_spec(name)
    assert abs(count_parameters(spec) - total) < unit
    assert abs(count_active_parameters(spec) - active) < unit


@pytest.mark.parametrize("preset,hf_name", [
    ("mixtral-8x7b", "Mixtral-8x7B-v0.1"), ("mixtral-8x22b", "Mixtral-8x22B-v0.1"), ("qwen3-30b-a3b", "Qwen3-30B-A3B"),
    ("qwen3-235b-a22b", "Qwen3-235B-A22B"), ("deepseek-v3", "DeepSeek-V3"),
    ("llama4-maverick", "Llama-4-Maverick-17B-128E")])
def test_presets_are_the_hf_configs_at_pretraining_length(preset, hf_name):
    """The presets are the config.json files, except the sequence length (pre-training's, not the window)."""
    mine = load_model_spec(preset)
    theirs = hf_spec(hf_name).replace(seq_length=mine.seq_length)

    def effective(spec):
        return {**spec.to_dict(), "name": None, "tied_embeddings": spec.tied}

    assert effective(mine) == effective(theirs)


def test_mixtral_8x7b_count_by_hand():
    """Mixtral 8x7B (Jiang et al. 2024, Table 1: dim 4096, 32 layers, head_dim 128, 32 heads, 8 kv heads,
    hidden_dim 14336, vocab 32000, 8 experts, top 2), counted from the architecture: per layer Q and O
    (h x h), K and V (h x 8·128), 8 SwiGLU experts (3·h·f each), the router (h x 8), two RMSNorms; untied
    embedding and LM head; a final RMSNorm."""
    h, f, v, n_layers = 4096, 14336, 32000, 32
    attn = 2 * h * h + 2 * h * 8 * 128
    layer = attn + 8 * 3 * h * f + h * 8 + 2 * h
    total = n_layers * layer + 2 * v * h + h
    active = n_layers * (layer - 6 * 3 * h * f) + 2 * v * h + h
    spec = load_model_spec("mixtral-8x7b")
    assert count_parameters(spec) == total == 46_702_792_704
    assert count_active_parameters(spec) == active == 12_879_925_248


def test_qwen3_non_embedding_counts_match_model_cards():
    """The Qwen3 cards also give non-embedding counts: 29.9B (30B-A3B) and 234B (235B-A22B)."""
    for name, published, unit in (("Qwen3-30B-A3B", 29.9 * B, 0.1 * B), ("Qwen3-235B-A22B", 234 * B, 1 * B)):
        spec = hf_spec(name)
        non_embedding = count_parameters(spec) - transformer_embedding_params(spec) - spec.vocab_size * spec.hidden_size
        assert abs(non_embedding - published) < unit


def test_deepseek_v3_breakdown_matches_readme_weights():
    """deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: main model 671B, 36.6B activated *including the 0.9B output
    head* (so without the input embedding); the MTP module 11.5B unique parameters (its transformer layer,
    excluding the shared 0.9B embedding and 0.9B head) and 1.5B activated including the head. The model card's
    685B counts the checkpoint's tensors: main model + MTP with its own copies of the embedding and head."""
    spec = hf_spec("DeepSeek-V3")
    embedding = transformer_embedding_params(spec)
    head = transformer_head_params(spec)
    assert abs(embedding - 0.9 * B) < 0.1 * B and abs(head - 0.9 * B) < 0.1 * B
    assert abs(count_active_parameters(spec) - embedding - 36.6 * B) < 0.1 * B
    mtp_layer = mtp_params(spec) - 2 * spec.hidden_size * spec.hidden_size - 3 * spec.hidden_size  # less eh_proj, norms
    assert mtp_layer == transformer_layer_params(spec, spec.num_layers - 1)  # like the last (MoE) layer
    assert abs(mtp_layer - 11.5 * B) < 0.1 * B
    assert abs(transformer_layer_active_params(spec, spec.num_layers - 1) + head - 1.5 * B) < 0.1 * B
    checkpoint = count_parameters(spec) + mtp_params(spec) + embedding + head
    assert abs(checkpoint - 685 * B) < 1 * B


DEEPSEEK_V2 = {  # deepseek-ai/DeepSeek-V2 config.json (architecture fields)
    "model_type": "deepseek_v2", "first_k_dense_replace": 1, "hidden_size": 5120, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1536, "moe_layer_freq": 1,
    "n_routed_experts": 160, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 128,
    "num_experts_per_tok": 6, "num_hidden_layers": 60, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 16.0, "scoring_func": "softmax",
    "aux_loss_alpha": 0.001, "tie_word_embeddings": False, "v_head_dim": 128, "vocab_size": 102400}
DEEPSEEK_V2_LITE = {**DEEPSEEK_V2, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "n_routed_experts": 64, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "num_hidden_layers": 27, "q_lora_rank": None}  # deepseek-ai/DeepSeek-V2-Lite: no query rank


@pytest.mark.parametrize("config,total,active,unit", [(DEEPSEEK_V2, 236 * B, 21 * B, 1 * B),
                                                      (DEEPSEEK_V2_LITE, 15.7 * B, 2.4 * B, 0.1 * B)])
def test_deepseek_v2_counts_match_paper(write, config, total, active, unit):
    """arXiv 2405.04434: DeepSeek-V2 236B total / 21B activated per token; V2-Lite 15.7B / 2.4B. DeepSeek's
    activated counts leave the input embedding out (as README_WEIGHTS.md's 36.6B for V3 does)."""
    spec = _hf(write, config)
    assert spec.mla and spec.moe_score_function == "softmax" and not spec.moe_norm_topk
    assert abs(count_parameters(spec) - total) < unit
    assert abs(count_active_parameters(spec) - transformer_embedding_params(spec) - active) < unit


def test_dense_models_have_all_parameters_active():
    for name in ("gpt2", "llama2-7b", "bert-large", "resnet50"):
        spec = load_model_spec(name)
        assert count_active_parameters(spec) == count_parameters(spec)


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "qwen3-30b-a3b", "deepseek-v3"])
def test_active_count_agrees_with_module(name):
    """Active = all parameters less (E - k) of every MoE layer's E experts (built on meta: any size)."""
    spec = load_model_spec(name)
    model = build_model(spec, "meta")
    total = sum(p.numel() for p in model.parameters())
    inactive = sum(m.inactive_parameters() for m in model.modules() if hasattr(m, "inactive_parameters"))
    assert total == count_parameters(spec)
    assert total - inactive == count_active_parameters(spec)


# ---- Hugging Face config.json field mapping ----

def test_hf_mixtral_fields():
    spec = hf_spec("Mixtral-8x7B-v0.1")
    assert (spec.num_experts, spec.experts_per_token, spec.num_shared_experts, spec.dense_layers) == (8, 2, 0, 0)
    assert spec.ffn_size == spec.moe_ffn_size == 14336  # num_local_experts experts of intermediate_size
    assert (spec.kv_heads, spec.head_dim, spec.moe_score_function, spec.moe_aux_loss_coeff) == (8, 128, "softmax", 0.02)
    assert spec.seq_length == 32768 and not spec.tied and not spec.qk_norm and not spec.mla


def test_hf_qwen3_moe_fields():
    spec = hf_spec("Qwen3-30B-A3B")
    assert (spec.num_experts, spec.experts_per_token, spec.moe_ffn_size, spec.ffn_size) == (128, 8, 768, 6144)
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_attention_heads  # head_dim given, not h/a
    assert spec.qk_norm and spec.moe_norm_topk and spec.dense_layers == 0 and spec.kv_heads == 4


def test_hf_deepseek_v3_fields():
    spec = hf_spec("DeepSeek-V3")
    assert spec.mla and (spec.q_lora_rank, spec.kv_lora_rank) == (1536, 512)
    assert (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.head_dim) == (128, 64, 128, 192)
    assert (spec.num_experts, spec.num_shared_experts, spec.experts_per_token, spec.dense_layers) == (256, 1, 8, 3)
    assert (spec.moe_ffn_size, spec.ffn_size, spec.mtp_layers) == (2048, 18432, 1)
    assert (spec.moe_score_function, spec.moe_routed_scaling_factor, spec.moe_aux_loss_coeff) == ("sigmoid", 2.5, 1e-4)
    assert [spec.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    # node-limited routing (n_group 8, topk_group 4: at most 4 of 8 blocks of 32 experts per token, Sec. 2.1.2)
    assert spec.routing_groups == (8, 4) == load_model_spec("deepseek-v3").routing_groups


def test_group_limited_routing_fields(write):
    """DeepSeek-V2's n_group / topk_group apply only under its group_limited_greedy top-k method (its greedy
    default ignores them); bad groupings are refused naming the field."""
    assert _hf(write, DEEPSEEK_V2).routing_groups == (1, 1)
    limited = _hf(write, {**DEEPSEEK_V2, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})
    assert limited.routing_groups == (8, 3)
    # group_limited_greedy scores a group by its best expert (HF modeling_deepseek MoEGate: .max(dim=-1)); V3's
    # noaux_tc by the sum of its top two, Megatron-Core's rule at V3's k / topk_group = 2
    assert limited.routing_limit == (8, 3, "max")
    assert load_model_spec("deepseek-v3").routing_limit == (8, 4, "top-sum")
    base = dict(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32,
                num_experts=8, experts_per_token=2)
    for fields, message in (({"moe_router_num_groups": 3}, "must divide num_experts"),
                            ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "exceeds"),
                            ({"moe_router_num_groups": 4, "moe_router_group_topk": 3}, "between")):
        with pytest.raises(ModelSpecError, match=message):
            spec_from_mapping({**base, **fields}, "spec.yaml")
    with pytest.raises(ModelSpecError, match="needs num_experts"):
        spec_from_mapping({**base, "num_experts": 0, "experts_per_token": None, "moe_router_num_groups": 2},
                          "spec.yaml")
    with pytest.raises(ModelSpecError, match="'moe_router_group_score' must be one of top-sum, max, got 'mean'"):
        spec_from_mapping({**base, "moe_router_num_groups": 4, "moe_router_group_score": "mean"}, "spec.yaml")
    with pytest.raises(ModelSpecError, match="'moe_router_group_score' needs moe_router_num_groups > 1"):
        spec_from_mapping({**base, "moe_router_group_score": "max"}, "spec.yaml")


def test_aux_loss_free_expert_bias_is_read_from_deepseek_v3_s_top_k_method(write):
    """DeepSeek-V3 balances its experts with a bias on the routing scores (HF topk_method noaux_tc, its config's
    default; arXiv 2412.19437 Sec. 2.1.2): the preset and the config.json set moe_router_expert_bias, Megatron-LM's
    export turns on --moe-router-enable-expert-bias; other methods and models do not. It needs sigmoid scores."""
    assert hf_spec("DeepSeek-V3").moe_router_expert_bias and load_model_spec("deepseek-v3").moe_router_expert_bias
    v3 = json.loads((HF / "DeepSeek-V3" / "config.json").read_text())
    assert not _hf(write, {**v3, "topk_method": "greedy"}).moe_router_expert_bias
    assert not load_model_spec("mixtral-8x7b").moe_router_expert_bias
    assert not load_model_spec("llama4-maverick").moe_router_expert_bias  # sigmoid, but no bias
    from paraplan.planner.exports.megatron import _moe_args

    assert ("--moe-router-enable-expert-bias", None) in _moe_args(load_model_spec("deepseek-v3"))
    assert all(flag != "--moe-router-enable-expert-bias" for flag, _ in _moe_args(load_model_spec("mixtral-8x7b")))
    base = dict(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32,
                num_experts=8, experts_per_token=2, moe_router_expert_bias=True)
    with pytest.raises(ModelSpecError, match="'moe_router_expert_bias' needs moe_score_function sigmoid"):
        spec_from_mapping(base, "spec.yaml")
    with pytest.raises(ModelSpecError, match="'moe_router_expert_bias' needs num_experts"):
        spec_from_mapping({**base, "num_experts": 0, "experts_per_token": None}, "spec.yaml")
    assert spec_from_mapping({**base, "moe_score_function": "sigmoid"}, "spec.yaml").moe_router_expert_bias


def test_group_limited_router_picks_within_the_best_groups():
    """models.moe.group_limited_topk as Megatron-Core's moe_utils.group_limited_topk: groups scored by the sum of
    their top k / group_topk scores, the k experts taken within the group_topk best groups only."""
    from paraplan.models.moe import group_limited_topk

    # 8 experts in 4 groups of 2; k = 2 from 1 group: group sums 0.9+0.1, 0.8+0.7 (best), 0.95+0.0, 0.3+0.2
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.95, 0.0, 0.3, 0.2]])
    assert sorted(group_limited_topk(scores, 2, 4, 1)[0].tolist()) == [2, 3]  # not the plain top 2 (4, 0)
    # DeepSeek-V2's group_limited_greedy: groups scored by their best, 0.9, 0.8, 0.95 (best), 0.3
    assert sorted(group_limited_topk(scores, 2, 4, 1, "max")[0].tolist()) == [4, 5]
    torch.manual_seed(0)
    many = torch.rand(500, 64)
    idx = group_limited_topk(many, 8, 8, 2)  # (T, 8): 8 of 64 experts within 2 of 8 groups of 8
    assert all(len({e // 8 for e in row}) <= 2 for row in idx.tolist())
    assert torch.equal(group_limited_topk(many, 8, 1, 1).sort(-1).values, many.topk(8, -1).indices.sort(-1).values)


def _hf(write, config: dict):
    return load_model_spec(write("config.json", json.dumps(config)))


QWEN_SMALL = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 100, "max_position_embeddings": 32}


def test_hf_qwen3_dense_layer_layouts(write):
    """HF Qwen3MoeDecoderLayer: layer i is sparse iff i not in mlp_only_layers and (i+1) % decoder_sparse_step
    == 0. Dense first layers map to dense_layers, every n-th sparse layer to moe_layer_step; any other layout
    is refused in one line."""
    spec = _hf(write, {**QWEN_SMALL, "mlp_only_layers": [0, 1], "decoder_sparse_step": 1})
    assert (spec.dense_layers, spec.moe_layer_step) == (2, 1)
    spec = _hf(write, {**QWEN_SMALL, "decoder_sparse_step": 2})
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    spec = _hf(write, {**QWEN_SMALL, "num_hidden_layers": 6, "mlp_only_layers": [1], "decoder_sparse_step": 2})
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    for bad in ({"mlp_only_layers": [2]}, {"mlp_only_layers": [0, 1, 2, 3]}):
        with pytest.raises(ModelSpecError, match="mlp_only_layers") as e:
            _hf(write, {**QWEN_SMALL, **bad})
        assert "\n" not in str(e.value)
    # not a list of layers that exist: refused, never read as some other set of layers (a number crashed; a name
    # or a layer beyond the model was dropped, leaving every layer sparse)
    for bad, why in ((3, "must be a list of layer indices"), (["a"], "must be a list of layer indices"),
                     ([True], "must be a list of layer indices"), ([99], "lists layer 99, outside 0..3")):
        with pytest.raises(ModelSpecError, match=f"mlp_only_layers {why}"):
            _hf(write, {**QWEN_SMALL, "mlp_only_layers": bad})


def test_hf_llama4_fields():
    """Llama 4 Maverick's text_config (HF Llama4TextDecoderLayer: layer i has experts when it is in moe_layers,
    by default every interleave_moe_layer_step-th from step - 1): 128 routed experts and one shared, each
    intermediate_size (8192) wide, top-1 with sigmoid scores not renormalised; the dense layers' MLP
    intermediate_size_mlp (16384) wide; no weights in its q/k norm."""
    spec = hf_spec("Llama-4-Maverick-17B-128E")
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert spec.num_moe_layers == 24 and (spec.dense_layers, spec.moe_layer_step) == (0, 2)
    assert (spec.num_experts, spec.num_shared_experts, spec.experts_per_token) == (128, 1, 1)
    assert (spec.moe_ffn_size, spec.ffn_size, spec.head_dim, spec.kv_heads) == (8192, 16384, 128, 8)
    assert (spec.moe_score_function, spec.moe_norm_topk, spec.moe_aux_loss_coeff) == ("sigmoid", False, 0.001)
    assert not spec.tied and not spec.qk_norm


def test_hf_llama4_moe_layers_list(write):
    """An explicit moe_layers list wins over the step; one that is no supported pattern is refused."""
    text = json.loads((HF / "Llama-4-Maverick-17B-128E" / "config.json").read_text())["text_config"]
    small = {**text, "num_hidden_layers": 6}
    spec = _hf(write, {"model_type": "llama4", "text_config": {**small, "moe_layers": [3, 4, 5]}})
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, False, False, True, True, True]
    with pytest.raises(ModelSpecError, match="moe_layers"):
        _hf(write, {"model_type": "llama4", "text_config": {**small, "moe_layers": [1, 2, 5]}})
    with pytest.raises(ModelSpecError, match="moe_layers must be a list of layer indices"):
        _hf(write, {"model_type": "llama4", "text_config": {**small, "moe_layers": 3}})
    with pytest.raises(ModelSpecError, match="text_config"):
        _hf(write, {"model_type": "llama4"})
    for bad in (0, 1.5, "2"):  # never read as "every layer"
        with pytest.raises(ModelSpecError, match="interleave_moe_layer_step must be a positive whole number"):
            _hf(write, {"model_type": "llama4", "text_config": {**small, "interleave_moe_layer_step": bad}})
    with pytest.raises(ModelSpecError, match="decoder_sparse_step must be a positive whole number"):
        _hf(write, {**QWEN_SMALL, "decoder_sparse_step": 0})


def test_hf_deepseek_moe_layer_freq_refused(write):
    config = json.loads((HF / "DeepSeek-V3" / "config.json").read_text())
    with pytest.raises(ModelSpecError, match="moe_layer_freq"):
        _hf(write, {**config, "moe_layer_freq": 2})


@pytest.mark.parametrize("changes,fragment", [
    ({"n_group": 3}, "field 'n_group' (3) must divide n_routed_experts (256)"),
    ({"first_k_dense_replace": 61}, "'first_k_dense_replace' (61) must be less than num_hidden_layers (61)"),
    ({"n_routed_experts": 0}, "'num_experts_per_tok' needs n_routed_experts > 0"),  # 0 is no dense model: null is
    ({"hidden_size": -5}, "field 'hidden_size' must be positive"),  # read under its own name: as it was
    ({"first_k_dense_replace": -1}, "field 'first_k_dense_replace' must be zero or more"),
])
def test_hf_config_errors_name_the_files_own_keys(write, changes, fragment):
    """A bad config.json is refused in its own key names (n_group, not paraplan's moe_router_num_groups), its path
    left as it is, on one line."""
    config = json.loads((HF / "DeepSeek-V3" / "config.json").read_text())
    with pytest.raises(ModelSpecError) as e:
        _hf(write, {**config, **changes})
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert "moe_router" not in str(e.value) and "num_layers" not in str(e.value)


def test_a_config_json_without_model_type_is_told_so(write):
    config = json.loads((HF / "DeepSeek-V3" / "config.json").read_text())
    with pytest.raises(ModelSpecError, match="no 'model_type'"):
        _hf(write, {k: v for k, v in config.items() if k != "model_type"})


def test_hf_llama4_errors_name_the_key_under_text_config(write):
    text = json.loads((HF / "Llama-4-Maverick-17B-128E" / "config.json").read_text())["text_config"]
    with pytest.raises(ModelSpecError, match=r"'text_config\.num_experts_per_tok' \(200\) exceeds "
                                             r"text_config\.num_local_experts \(128\)"):
        _hf(write, {"model_type": "llama4", "text_config": {**text, "num_experts_per_tok": 200}})


# ---- spec validation ----

MOE = dict(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16,
           ffn_hidden_size=128, num_experts=4, experts_per_token=2)


@pytest.mark.parametrize("changes,fragment", [
    ({"experts_per_token": 5}, "'experts_per_token' (5) exceeds num_experts (4)"),
    ({"experts_per_token": None}, "needs field 'experts_per_token'"),
    ({"num_experts": 0}, "field 'experts_per_token' needs num_experts > 0"),
    ({"dense_layers": 2}, "'dense_layers' (2) must be less than num_layers (2)"),
    ({"moe_layer_step": 3}, "'moe_layer_step' (3) leaves no layer with experts"),
    ({"moe_layer_step": 0}, "'moe_layer_step' must be positive"),
    ({"num_experts": -1}, "'num_experts' must be zero or more, got -1"),  # 0: a dense model
    ({"dense_layers": -1}, "'dense_layers' must be zero or more, got -1"),
    ({"moe_score_function": "relu"}, "'moe_score_function' must be one of softmax, sigmoid"),
    ({"moe_aux_loss_coeff": -0.1}, "'moe_aux_loss_coeff' must be non-negative"),
    ({"moe_aux_loss_coeff": "a lot"}, "'moe_aux_loss_coeff' must be a number"),
    ({"moe_routed_scaling_factor": 0}, "'moe_routed_scaling_factor' must be positive"),
    ({"qk_norm": "yes"}, "'qk_norm' must be true or false"),
    ({"num_experts": 0, "experts_per_token": None, "expert_bias": True}, "'expert_bias' needs num_experts > 0"),
    ({"expert_bias": 1}, "'expert_bias' must be true or false"),
    ({"num_expert": 4}, "unknown field 'num_expert'"),
    ({"kv_lora_rank": 16}, "needs field 'qk_nope_head_dim'"),
    ({"q_lora_rank": 16}, "'q_lora_rank' belongs to multi-head latent attention"),
    ({"family": "gpt", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
     "needs family llama"),
])
def test_moe_spec_errors_are_one_line_naming_the_field(changes, fragment):
    with pytest.raises(ModelSpecError) as e:
        spec_from_mapping({**MOE, **changes}, "moe.yaml")
    assert fragment in str(e.value) and "moe.yaml" in str(e.value) and "\n" not in str(e.value)


def test_dense_spec_dicts_unchanged_by_the_new_fields():
    """New fields at their defaults stay out of to_dict (cache keys, plans and saved measurements of dense
    models read as before), and round-trip through spec_from_mapping."""
    for name in PRESETS:
        spec = load_model_spec(name)
        assert spec_from_mapping(spec.to_dict(), name) == spec
    d = load_model_spec("llama2-70b").to_dict()
    assert "num_experts" not in d and "head_dim" not in d and "qk_norm" not in d


def test_bad_moe_preset_file_is_one_line_cli_error(write):
    from conftest import assert_one_line_error, run_cli

    path = write("bad-moe.yaml", "family: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                                 "vocab_size: 100\nseq_length: 16\nnum_experts: 4\nexperts_per_token: 8\n")
    assert_one_line_error(run_cli("profile", "--model", path), "experts_per_token")


# ---- the MoE block on CPU ----

@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "llama4-tiny"])
def test_tiny_moe_models_train_on_cpu(name):
    spec = _tiny(name)
    model = build_model(spec, "cpu")
    initialize(model, spec, seed=0)
    x, y = sample_batch(spec, 2, torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.shape == (2, spec.seq_length, spec.vocab_size)  # (b, s, V)
    loss = loss_function(spec)(logits, y)
    assert abs(loss.item() - math.log(spec.vocab_size)) < 0.5  # near-uniform predictions at initialisation
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    moe = [m for m in model.modules() if hasattr(m, "last_aux_loss")]
    assert len(moe) == spec.num_moe_layers == sum(hasattr(layer, "moe") for layer in model.layers.values())
    assert all(m.last_aux_loss is not None and m.last_aux_loss > 0 for m in moe)


def _tiny(name: str):
    """A preset, or llama4-tiny: mixtral-tiny with Llama 4's pattern (MoE every other layer, one shared expert,
    top-1 sigmoid routing)."""
    if name != "llama4-tiny":
        return load_model_spec(name)
    return load_model_spec("mixtral-tiny").replace(
        name="llama4-tiny", moe_layer_step=2, num_shared_experts=1, experts_per_token=1, moe_ffn_hidden_size=96,
        moe_score_function="sigmoid", moe_norm_topk=False)


def test_latent_attention_without_query_rank_and_gpt_experts_run():
    """MLA with queries projected directly (DeepSeek-V2-Lite), and a GELU-expert MoE on the gpt family."""
    for spec in (load_model_spec("deepseek-tiny").replace(q_lora_rank=None),
                 spec_from_mapping({**MOE, "family": "gpt", "num_shared_experts": 1}, "gpt-moe")):
        model = build_model(spec, "cpu")
        assert sum(p.numel() for p in model.parameters()) == count_parameters(spec)
        x, y = sample_batch(spec, 2, torch.Generator().manual_seed(0))
        loss_function(spec)(model(x), y).backward()
        assert all(p.grad is not None for p in model.parameters())


def _naive_moe(moe, x):
    """The MoE block written token by token from its definition (Mixtral, arXiv 2401.04088 Eq. 1-2;
    DeepSeek-V3, arXiv 2412.19437 Eqs. 12-16): top-k of the scores, renormalised, scaled, weighted experts,
    plus the shared experts. x: (T, h)."""
    r = moe.router
    logits = x @ r.gate.weight.T + (r.gate.bias if r.gate.bias is not None else 0)  # (T, E)
    scores = torch.sigmoid(logits) if r.sigmoid else torch.softmax(logits, -1)
    out = []
    for t in range(x.shape[0]):
        top = torch.topk(scores[t], r.top_k).indices
        g = scores[t, top] / scores[t, top].sum() if r.norm_topk else scores[t, top]
        y = torch.zeros_like(x[t])
        for w, e in zip(g * r.scaling, top.tolist(), strict=True):
            ex = moe.experts
            b1, b2, b3 = ((b[e] if b is not None else 0) for b in (ex.b1, ex.b2, ex.b3))
            hidden = x[t] @ ex.w1[e] + b1
            hidden = torch.nn.functional.silu(hidden) * (x[t] @ ex.w3[e] + b3) if ex.gated else \
                torch.nn.functional.gelu(hidden, approximate="tanh")
            y = y + w * (hidden @ ex.w2[e] + b2)  # GPT-OSS: the routing weight scales the bias too
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(x[t])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_moe_block_matches_its_definition_token_by_token(name):
    spec = load_model_spec(name)
    model = build_model(spec, "cpu").double()
    initialize(model, spec, seed=1)
    moe = model.layers[str(spec.num_layers - 1)].moe
    x = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).view(10, -1), _naive_moe(moe, x.view(10, -1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_expert_biases_are_where_gpt_oss_has_them(family):
    """expert_bias (GPT-OSS): a bias on the router's logits and on each routed expert's linears, the second scaled
    by the routing weight with the rest of the expert's output (HF GptOssExperts; Megatron-Core adds b·p), none on
    the shared experts. Random biases: the block equals its token-by-token definition; the closed-form count equals
    the module's, the extra E·(2f + h) + E per MoE layer for SwiGLU experts (E·(f + h) + E for GELU ones)."""
    spec = spec_from_mapping({**MOE, "family": family, "num_shared_experts": 1, "expert_bias": True}, "oss")
    plain = spec.replace(expert_bias=False)
    model = build_model(spec, "cpu").double()
    initialize(model, spec, seed=1)
    moe = model.layers["1"].moe
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in (moe.router.gate.bias, moe.experts.b1, moe.experts.b2, moe.experts.b3):
            if b is not None:
                assert not b.any()  # zero at start, as Megatron-Core initialises biases
                b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype))
    assert moe.shared_experts is not None and not any("bias" in n for n, _ in moe.shared_experts.named_parameters())
    x = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).view(10, -1), _naive_moe(moe, x.view(10, -1)), rtol=1e-12, atol=1e-12)
    e, f, h = spec.num_experts, spec.moe_ffn_size, spec.hidden_size
    per_layer = e * ((2 * f if family == "llama" else f) + h) + e
    assert count_parameters(spec) - count_parameters(plain) == spec.num_moe_layers * per_layer
    assert sum(p.numel() for p in model.parameters()) == count_parameters(spec)
    k = spec.top_k
    assert count_active_parameters(spec) - count_active_parameters(plain) == \
        spec.num_moe_layers * (k * ((2 * f if family == "llama" else f) + h) + e)


def test_gpt_oss_count_with_its_biases():
    """benchmarks/fidelity_moe.py's GPT-OSS-120B (expert_bias, qkv_bias): 116.83B parameters in OpenAI's model card
    (arXiv 2508.10925, Table 1), 116,829,156,672 from its config.json's shapes by hand (per layer: q, k, v, o with
    biases 26,550,080, 64 sinks, 2 norms 5,760, router 368,768, 128 experts of 24,891,840 with their biases; 36
    layers, untied 201,088 x 2,880 embedding and head, final norm), less what the spec leaves out: each layer's
    output-projection bias (2,880) and sinks (64)."""
    import importlib.util

    found = importlib.util.spec_from_file_location("fidelity_moe", ROOT / "benchmarks" / "fidelity_moe.py")
    fid = importlib.util.module_from_spec(found)
    found.loader.exec_module(fid)
    spec = fid.gpt_oss({"seq_len": 4096})
    assert count_parameters(spec) == 116_829_156_672 - 36 * (2880 + 64)


def test_shared_experts_and_first_dense_layers_are_where_the_spec_says():
    spec = load_model_spec("deepseek-tiny")
    model = build_model(spec, "meta")
    assert hasattr(model.layers["0"], "mlp") and not hasattr(model.layers["0"], "moe")
    moe = model.layers["1"].moe
    assert moe.shared_experts.w1.weight.shape == (spec.num_shared_experts * spec.moe_ffn_size, spec.hidden_size)
    assert moe.experts.w1.shape == (spec.num_experts, spec.hidden_size, spec.moe_ffn_size)  # (E, h, f)
    assert moe.experts.w2.shape == (spec.num_experts, spec.moe_ffn_size, spec.hidden_size)  # (E, f, h)


def test_dispatch_is_replaceable_per_module():
    """Expert parallelism swaps MoE.dispatch for an all-to-all version with the same signature."""
    spec = load_model_spec("mixtral-tiny")
    model = build_model(spec, "cpu")
    initialize(model, spec, seed=0)
    x, _ = sample_batch(spec, 1, torch.Generator().manual_seed(0))
    calls = []

    def spy(tokens, expert_idx, weights, counts, experts):
        calls.append((tokens.shape, expert_idx.shape, weights.shape, sum(counts)))
        return local_dispatch(tokens, expert_idx, weights, counts, experts)

    with torch.no_grad():
        before = model(x)
        for layer in model.layers.values():
            layer.moe.dispatch = spy
        after = model(x)
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    t, k = spec.seq_length, spec.experts_per_token
    assert calls == [((t, spec.hidden_size), (t, k), (t, k), t * k)] * spec.num_layers


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_aux_loss_autoscaler_gradient_equals_explicit_sum(name, scale):
    """Backward of the LM loss alone, with the autoscaler's scale s, gives the gradients of the explicit
    loss + s·sum(alpha·aux) (Megatron-Core's MoEAuxLossAutoScaler contract), in fp64 to 1e-6; the forward
    output, and so the reported loss, is the LM loss's."""
    spec = load_model_spec(name).replace(moe_aux_loss_coeff=0.5)  # a large alpha: a visible gradient share
    x, y = sample_batch(spec, 2, torch.Generator().manual_seed(3))
    loss_fn = loss_function(spec)
    models = []
    for _ in range(2):
        model = build_model(spec, "cpu").double()
        initialize(model, spec, seed=4)
        models.append(model)
    try:
        set_aux_loss_scale(scale)
        lm_only = loss_fn(models[0](x), y)
        lm_only.backward()
        set_aux_loss_scale(0.0)  # the explicit sum carries the aux term itself
        with collect_aux_losses() as aux:
            logits = models[1](x)
        lm = loss_fn(logits, y)
        (lm + scale * sum(aux)).backward()
    finally:
        set_aux_loss_scale(1.0)
    assert len(aux) == spec.num_layers - spec.dense_layers and all(a.item() > 0 for a in aux)
    assert lm_only.item() == lm.item()  # the autoscaler leaves the output (and the reported loss) alone
    moved = 0
    for (n, p0), p1 in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p0.grad, p1.grad, rtol=0, atol=1e-6, msg=n)
        moved += int("router" in n)
    assert moved  # the router's gradient includes the aux term (checked above against the explicit sum)
    # without the aux term the router gradient differs: the test above is not vacuous
    model = build_model(spec, "cpu").double()
    initialize(model, spec, seed=4)
    set_aux_loss_scale(0.0)
    try:
        loss_fn(model(x), y).backward()
    finally:
        set_aux_loss_scale(1.0)
    gate = f"layers.{spec.num_layers - 1}.moe.router.gate.weight"
    assert not torch.allclose(model.get_parameter(gate).grad, models[0].get_parameter(gate).grad, atol=1e-6)


def test_autoscaler_is_identity_forward_and_scales_backward():
    out = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    aux = w * w  # d aux / d w = 2w = 4
    try:
        set_aux_loss_scale(0.5)
        y = AuxLossAutoScaler.apply(out, aux)
        assert torch.equal(y, out)
        y.sum().backward()
    finally:
        set_aux_loss_scale(1.0)
    assert torch.equal(out.grad, torch.ones(3)) and w.grad.item() == 0.5 * 4


def test_sequence_aux_loss_formula():
    """DeepSeek-V3 Eqs. 17-20 without alpha: sum_i f_i P_i with f_i = E/(k S) · count_i, P_i = mean_t s'_it.
    Perfectly balanced routing with uniform scores gives exactly 1; all tokens on the same k experts with
    scores concentrated there gives E/k."""
    e, k, s = 4, 2, 8
    idx, counts = balanced_assignment(s, e, k, "cpu")
    uniform = torch.full((1, s, e), 1 / e)
    assert counts == [s * k // e] * e
    assert sequence_aux_loss(uniform, idx.view(1, s, k), sigmoid=False).item() == pytest.approx(1.0)
    skew = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(1, s, e)
    top = torch.tensor([0, 1]).expand(1, s, k)
    assert sequence_aux_loss(skew, top, sigmoid=False).item() == pytest.approx(e / k)
    # sigmoid scores are normalised over experts first (Eq. 19)
    assert sequence_aux_loss(2 * skew, top, sigmoid=True).item() == pytest.approx(e / k)


# ---- balanced routing ----

def test_balanced_routing_is_the_mode_on_meta_and_on_request():
    assert routes_balanced(torch.empty(2, 3, device="meta"))
    assert not routes_balanced(torch.empty(2, 3))
    with balanced_routing():
        assert routes_balanced(torch.empty(2, 3))
    idx, counts = balanced_assignment(5, 4, 2, "cpu")  # 10 slots over 4 experts: 3, 3, 2, 2
    assert counts == [3, 3, 2, 2] and sum(counts) == 10
    assert all(len(set(row.tolist())) == 2 for row in idx)  # a token never gets one expert twice
    assert torch.bincount(idx.flatten(), minlength=4).tolist() == counts


def test_balanced_routing_runs_on_cpu_like_on_meta():
    """Under balanced_routing() a real device routes like meta does: each expert gets T·k/E tokens."""
    spec = load_model_spec("mixtral-tiny")
    model = build_model(spec, "cpu")
    initialize(model, spec, seed=0)
    seen = []
    for layer in model.layers.values():
        layer.moe.dispatch = lambda *a, f=local_dispatch: (seen.append(a[3]), f(*a))[1]
    x, _ = sample_batch(spec, 2, torch.Generator().manual_seed(0))
    with torch.no_grad(), balanced_routing():
        model(x)
    per_expert = 2 * spec.seq_length * spec.experts_per_token // spec.num_experts
    assert seen == [[per_expert] * spec.num_experts] * spec.num_layers


def _attention_fwd(spec, b, s):
    """Forward FLOPs of attention: 2·tokens·(projection weights) + 4·b·s²·a·d (scores and weighted values;
    the unfused path computes the full s x s, Korthikanti et al. 2022 App. A). MLA's projections per
    arXiv 2405.04434 Sec. 2.1.2-2.1.3; scores use nope+rope, values v_head_dim."""
    h, a, t = spec.hidden_size, spec.num_attention_heads, b * s
    if spec.mla:
        qk, v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim
        proj = h * spec.q_lora_rank + spec.q_lora_rank * a * qk + h * (spec.kv_lora_rank + spec.qk_rope_head_dim)
        proj += spec.kv_lora_rank * a * (spec.qk_nope_head_dim + v) + a * v * h
        return 2 * t * proj + 2 * b * s * s * a * (qk + v)
    d = spec.head_dim
    proj = 2 * h * a * d + 2 * h * spec.kv_heads * d
    return 2 * t * proj + 4 * b * s * s * a * d


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_balanced_routing_flops_count_the_active_experts(name):
    """A traced MoE layer's forward FLOPs = attention + router (2·T·h·E) + the k routed and the shared
    experts each token goes through (2·T·(k + shared)·3·h·f) -- never all E experts; a dense first layer
    has its dense MLP (2·T·3·h·ffn). Backward is twice forward."""
    spec = load_model_spec(name)
    b = 2
    s, h, t = spec.seq_length, spec.hidden_size, b * spec.seq_length
    prof = profile_model(spec, "meta", micro_batch=b)
    expert = 3 * h * spec.moe_ffn_size
    moe = _attention_fwd(spec, b, s) + 2 * t * h * spec.num_experts \
        + 2 * t * (spec.experts_per_token + spec.num_shared_experts) * expert
    dense = _attention_fwd(spec, b, s) + 2 * t * 3 * h * spec.ffn_size
    layers = prof.layers[1:-1]
    assert len(layers) == spec.num_layers
    for i, layer in enumerate(layers):
        assert layer.fwd_flops == (moe if spec.is_moe_layer(i) else dense), layer.name
        assert layer.bwd_flops == pytest.approx(2 * layer.fwd_flops, rel=1e-3)
        assert layer.kind == "transformer_layer"


def test_profile_counts_parameters_active_and_expert():
    for name in ("deepseek-tiny", "deepseek-v3", "mixtral-8x22b"):
        spec = load_model_spec(name)
        prof = profile_model(spec, "meta")
        assert prof.num_parameters == count_parameters(spec)
        assert prof.num_active_parameters == count_active_parameters(spec)
        assert prof.to_json_dict()["num_active_parameters"] == count_active_parameters(spec)
        for i, layer in enumerate(prof.layers[1:-1]):
            routed = spec.num_experts * 3 * spec.hidden_size * spec.moe_ffn_size if spec.is_moe_layer(i) else 0
            assert layer.expert_params == routed
            assert layer.inactive_params == routed * (spec.num_experts - spec.top_k) // max(spec.num_experts, 1)
    dense = profile_model("gpt-tiny", "meta")
    assert dense.to_json_dict()["num_active_parameters"] == dense.num_parameters


@pytest.mark.parametrize("pattern", ["dense first", "every other"])
def test_short_trace_matches_the_full_trace(pattern):
    """The profiler traces one dense and two MoE layers and repeats them where the spec puts each (the first k
    layers dense: DeepSeek; experts in every other layer: Llama 4 Maverick); tracing every layer gives the same."""
    from paraplan.profiler.profile import _profile_model

    spec = load_model_spec("deepseek-tiny").replace(num_layers=5, dense_layers=2) if pattern == "dense first" \
        else _tiny("llama4-tiny").replace(num_layers=6)
    short = profile_model(spec, "meta")
    full = _profile_model(spec, "meta", 1, None, None, None, 0, 0)
    assert [x.name for x in short.layers] == [x.name for x in full.layers]
    for a, b in zip(short.layers, full.layers, strict=True):
        assert (a.params, a.fwd_flops, a.bwd_flops, a.activation_bytes, a.signature) == \
            (b.params, b.fwd_flops, b.bwd_flops, b.activation_bytes, b.signature), a.name
    assert (short.num_parameters, short.num_active_parameters) == (full.num_parameters, full.num_active_parameters)
    assert (short.num_parameters, short.num_active_parameters) == (count_parameters(spec),
                                                                   count_active_parameters(spec))
    experts = [x.expert_params > 0 for x in short.layers[1:-1]]
    assert experts == [spec.is_moe_layer(i) for i in range(spec.num_layers)]
    if pattern == "every other":
        assert experts == [False, True] * 3


def test_profile_json_has_active_parameters():
    out = run_cli_json("profile", "--model", "mixtral-tiny", "--device", "meta")
    spec = load_model_spec("mixtral-tiny")
    assert out["num_parameters"] == count_parameters(spec)
    assert out["num_active_parameters"] == count_active_parameters(spec) < out["num_parameters"]


def test_mla_latents_are_counted_apart_as_what_the_replicated_modules_make():
    """What MLA's down-projections and latent norms (left whole by the tensor-parallel plan) make and the layer saves
    is counted apart (LayerProfile.activation_bytes_whole): under sequence parallelism this executor runs them on the
    gathered sequence, so their outputs stay whole. With selective recomputation, which reruns the latent norms and
    up-projections (the prologue), what is kept of them is exactly the prologue's inputs, the compressed query and the
    compressed key-value with the shared rotary key: tokens x (q_lora_rank + kv_lora_rank + qk_rope_head_dim), fp32
    on the CPU; without it, at least those and the two normalised latents the up-projections read besides. Dense
    attention has none."""
    spec = load_model_spec("deepseek-tiny")
    prof = profile_model(spec, micro_batch=1, dtype="fp32", device="meta")
    tokens, elem = spec.seq_length, 4
    prologue_inputs = tokens * (spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_head_dim) * elem
    for layer in prof.layers:
        if layer.kind != "transformer_layer":
            assert layer.activation_bytes_whole == layer.activation_bytes_selective_whole == 0, layer.name
            continue
        kept = layer.activation_bytes_selective_whole - layer.prologue_dropped_bytes_whole
        assert kept == prologue_inputs, layer.name
        assert layer.activation_bytes_whole >= prologue_inputs + tokens * (spec.q_lora_rank + spec.kv_lora_rank) * elem
        assert layer.activation_bytes_whole <= layer.activation_bytes - layer.activation_bytes_sharded
    dense = profile_model(load_model_spec("llama-tiny"), micro_batch=1, dtype="fp32", device="meta")
    assert all(layer.activation_bytes_whole == 0 for layer in dense.layers)


# ---- tensor-parallel plan ----

def test_tp_plan_covers_dense_layers_and_leaves_moe_blocks_replicated():
    spec = load_model_spec("deepseek-tiny")
    plan = tp_plan(spec)
    model = build_model(spec, "meta")
    for fqn, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not fqn.startswith("layers."):
            continue
        style = tp_style(plan, fqn)
        if ".moe." in fqn:
            assert style is None, fqn  # replicated: MoE blocks (each rank routes its own tokens)
        elif fqn.endswith(("wq_a", "wkv_a")):
            assert style == "replicated", fqn  # MLA's low-rank down-projections: whole on every rank
        else:
            assert style in ("colwise", "rowwise"), fqn
    assert tp_style(plan, "layers.1.moe") is None and tp_style(plan, "layers.0.mlp") == "region"
    assert tp_style(plan, "layers.1.attn.kv_norm") == "replicated"  # the latents' norm, not a per-head one
    assert tp_style(plan, "layers.1.attn.wkv_b") == "colwise" and tp_style(plan, "layers.1.attn.wo") == "rowwise"
    mixtral = tp_plan(load_model_spec("mixtral-tiny"))
    assert tp_style(mixtral, "layers.0.attn.wq") == "colwise" and tp_style(mixtral, "layers.0.moe.router.gate") is None

"""Model zoo: published parameter counts, analytic counts, spec validation, HF configs, builders."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from paraplan.models import (
    PRESETS,
    ModelSpecError,
    block_names,
    build_model,
    count_parameters,
    initialize,
    load_model_spec,
    loss_function,
    sample_batch,
    spec_from_mapping,
    tp_plan,
    tp_style,
)

# Published parameter counts (sources: HF model cards / released checkpoints; torchvision docs).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,    # Meta Llama-2-7b checkpoint
    "llama2-70b": 68_976_648_192,  # Meta Llama-2-70b checkpoint
    "gpt2": 124_439_808,           # HF gpt2 (tied LM head)
    "resnet50": 25_557_032,        # torchvision.models.resnet50
    "vgg16": 138_357_544,          # torchvision.models.vgg16
    "llama3-8b": 8_030_261_248,    # Meta Llama-3-8B checkpoint
    "bert-large": 335_174_458,     # HF bert-large-uncased as BertForMaskedLM (no pooler)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_built_module_matches_published_count(name):
    model = build_model(load_model_spec(name), "meta")
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_analytic_count_agrees_with_module(name):
    spec = load_model_spec(name)
    model = build_model(spec, "meta")
    assert count_parameters(spec) == sum(p.numel() for p in model.parameters())


def test_analytic_count_on_nonstandard_shapes():
    for data in [dict(family="gpt", num_layers=3, hidden_size=96, num_attention_heads=6, vocab_size=77,
                      seq_length=33, ffn_hidden_size=200, tied_embeddings=False),
                 dict(family="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                      vocab_size=100, seq_length=16, ffn_hidden_size=100, tied_embeddings=True),
                 dict(family="resnet", depth=18, num_classes=10, image_size=64),
                 dict(family="resnet", depth=101, num_classes=7),
                 dict(family="vgg", depth=11, num_classes=5, image_size=64),
                 dict(family="mlp", input_size=7, hidden_sizes=[5, 3], num_classes=2)]:
        spec = spec_from_mapping(data, "test")
        assert count_parameters(spec) == sum(p.numel() for p in build_model(spec, "meta").parameters())


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tiny_transformers_train_on_cpu(name):
    spec = load_model_spec(name)
    model = build_model(spec, "cpu")
    initialize(model, spec, seed=0)
    x, y = sample_batch(spec, 2, torch.Generator().manual_seed(0))
    assert x.shape == (2, spec.seq_length) and y.shape == (2, spec.seq_length)
    logits = model(x)
    assert logits.shape == (2, spec.seq_length, spec.vocab_size)  # (b, s, V)
    loss = loss_function(spec)(logits, y)
    # An untrained LM with small random weights predicts nearly uniformly: loss ~ ln(V).
    assert abs(loss.item() - torch.log(torch.tensor(float(spec.vocab_size))).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_small_cnns_and_mlp_run_on_cpu():
    for data in [dict(family="resnet", depth=18, num_classes=10, image_size=32),
                 dict(family="vgg", depth=11, num_classes=10, image_size=32),
                 dict(family="mlp", input_size=16, hidden_sizes=[32], num_classes=10)]:
        spec = spec_from_mapping(data, "test")
        x, y = sample_batch(spec, 2, torch.Generator().manual_seed(0))
        out = build_model(spec, "cpu")(x)
        assert out.shape == (2, 10)
        loss_function(spec)(out, y).backward()


def test_blocks_cover_every_parameter_once_and_prune_keeps_names():
    spec = load_model_spec("gpt-tiny")
    model = build_model(spec, "meta")
    blocks = block_names(spec)
    assert blocks == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    owned = [n for n, _ in model.named_parameters() if any(n.startswith(b + ".") for b in blocks)]
    assert len(owned) == len(list(model.named_parameters()))
    model.keep_only(["layers.2", "layers.3", "head"])
    assert model.present_blocks() == ["layers.2", "layers.3", "head"]
    # The tied LM head keeps its own weight when the embedding is cut away (Megatron's layout).
    assert model.head.proj.weight.shape == (spec.vocab_size, spec.hidden_size)


def test_cut_model_runs_stage_by_stage_like_the_whole():
    spec = load_model_spec("llama-tiny")
    torch.manual_seed(0)
    whole = build_model(spec, "cpu")
    first, second = build_model(spec, "cpu"), build_model(spec, "cpu")
    first.load_state_dict(whole.state_dict())
    second.load_state_dict(whole.state_dict())
    first.keep_only(["embed", "layers.0"])
    second.keep_only(["layers.1", "layers.2", "layers.3", "head"])
    x, _ = sample_batch(spec, 2, torch.Generator().manual_seed(1))
    torch.testing.assert_close(second(first(x)), whole(x))


def test_tp_plan_shards_every_layer_linear():
    for name in ("gpt-tiny", "llama-tiny", "bert-large"):
        spec = load_model_spec(name)
        plan = tp_plan(spec)
        model = build_model(spec, "meta")
        for fqn, mod in model.named_modules():
            if fqn.startswith("layers.") and isinstance(mod, torch.nn.Linear):
                assert tp_style(plan, fqn) in ("colwise", "rowwise"), fqn
        assert tp_style(plan, "head.proj") == "vocab_head"


# ---- spec validation ----

def _err(data) -> str:
    with pytest.raises(ModelSpecError) as e:
        spec_from_mapping(data, "my.yaml")
    return str(e.value)


BASE = dict(family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)


def test_spec_errors_name_source_and_field():
    assert "heads" in _err({**BASE, "num_attention_heads": 5}) and "my.yaml" in _err({**BASE, "num_attention_heads": 5})
    assert "num_kv_heads" in _err({**BASE, "num_kv_heads": 3})
    assert "'hidden_size' must be positive" in _err({**BASE, "hidden_size": -64})
    assert "absurdly large" in _err({**BASE, "num_layers": 10**7})
    assert "whole number" in _err({**BASE, "num_layers": 2.5})
    assert "whole number" in _err({**BASE, "num_layers": True})
    assert "whole number" in _err({**BASE, "vocab_size": "100"})
    assert "missing field 'seq_length'" in _err({k: v for k, v in BASE.items() if k != "seq_length"})
    assert "unknown family" in _err({**BASE, "family": "gtp"}) and "'gpt'" in _err({**BASE, "family": "gtp"})
    msg = _err({**BASE, "hiden_size": 64})
    assert "unknown field 'hiden_size'" in msg and "hidden_size" in msg
    assert "mapping" in _err([1, 2])
    assert "depth" in _err(dict(family="resnet", depth=51))
    assert "hidden_sizes" in _err(dict(family="mlp", input_size=4, hidden_sizes=[], num_classes=3))
    assert "tied_embeddings" in _err({**BASE, "tied_embeddings": "yes"})


def test_unknown_preset_suggests_nearest():
    with pytest.raises(ModelSpecError) as e:
        load_model_spec("llama2-7")
    assert "llama2-7b" in str(e.value)


def test_yaml_spec_file(write):
    path = write("mine.yaml", "family: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                              "num_kv_heads: 2\nffn_hidden_size: 128\nvocab_size: 50\nseq_length: 8\n")
    spec = load_model_spec(path)
    assert spec.name == "mine" and spec.kv_heads == 2 and not spec.tied


@pytest.mark.parametrize("content,fragment", [
    ("", "empty"),
    (b"\x00\x01\x02binary", "binary"),
    ("family: gpt\nnum_layers: [1,\n", "malformed YAML"),
    ("!!python/object/apply:os.system ['echo pwned']\n", "refused YAML tag"),
    ("- 1\n- 2\n", "mapping"),
])
def test_bad_spec_files_are_one_line_errors(write, content, fragment):
    path = write("bad.yaml", content)
    with pytest.raises(ModelSpecError) as e:
        load_model_spec(path)
    assert fragment in str(e.value) and "bad.yaml" in str(e.value)
    assert "\n" not in str(e.value)


# ---- Hugging Face config.json ----

HF_CONFIGS = {
    # Excerpts of the published config.json files (extra keys are HF's and are ignored).
    "gpt2": ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024, "n_ctx": 1024, "activation_function": "gelu_new", "n_inner": None},
             124_439_808),
    "llama": ({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
               "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
              6_738_415_616),
    "bert": ({"model_type": "bert", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
              "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512,
              "type_vocab_size": 2}, 335_174_458),
    # Mistral-7B-v0.3 (7,248,023,552 parameters on its model card's safetensors count)
    "mistral": ({"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32768, "head_dim": 128,
                 "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False},
                7_248_023_552),
    # Qwen2.5-7B: biased q/k/v projections (Qwen2Attention); 7,615,616,512 parameters on its model card's
    # safetensors count (the q, k and v biases: 3584 + 2 x 512 a layer). Its config carries a sliding window it
    # does not use (use_sliding_window false).
    "qwen2": ({"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
               "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
               "max_position_embeddings": 131072, "sliding_window": 131072, "use_sliding_window": False,
               "tie_word_embeddings": False, "rope_theta": 1000000.0}, 7_615_616_512),
    # Phi-3-mini-4k: LLaMA's layer with fused qkv and gate/up weights, the same parameters (3,821,079,552 on its
    # model card's safetensors count)
    "phi3": ({"model_type": "phi3", "num_hidden_layers": 32, "hidden_size": 3072, "num_attention_heads": 32,
              "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
              "max_position_embeddings": 4096, "sliding_window": 2047, "tie_word_embeddings": False},
             3_821_079_552),
}


def test_hf_llama_config_reads_head_dim_and_defaults_the_ffn_as_transformers_does(write):
    """A Llama config.json's head_dim sets the attention's width (q and o: h x heads x head_dim, k and v: h x kv
    heads x head_dim); a missing intermediate_size is LlamaConfig's default, 11008; biases, which the family does
    not have, are refused rather than left out of the count; so is a Mistral sliding window shorter than the
    sequence."""
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8,
            "num_key_value_heads": 2, "intermediate_size": 2816, "vocab_size": 1000, "max_position_embeddings": 512}
    plain = count_parameters(load_model_spec(write("a.json", json.dumps(base))))
    wide = count_parameters(load_model_spec(write("b.json", json.dumps({**base, "head_dim": 256}))))
    # per layer: q and o grow from 1024 x 1024 to 1024 x 2048 each, k and v from 1024 x 256 to 1024 x 512
    assert wide - plain == 2 * (2 * 1024 * 1024 + 2 * 1024 * 256)
    no_ffn = {k: v for k, v in base.items() if k != "intermediate_size"}
    assert load_model_spec(write("c.json", json.dumps(no_ffn))).ffn_size == 11008
    for key in ("attention_bias", "mlp_bias"):
        with pytest.raises(ModelSpecError, match=f"{key} true is not supported"):
            load_model_spec(write("d.json", json.dumps({**base, key: True})))
    # Mistral 7B v0.1's window (4096 of 32768 positions) is not modelled: planned only where it covers the sequence
    from paraplan.planner.errors import PlanError
    from paraplan.planner.workload import Workload

    windowed = write("e.json", json.dumps({**HF_CONFIGS["mistral"][0], "sliding_window": 4096}))
    assert load_model_spec(windowed).sliding_window == 4096
    with pytest.raises(PlanError, match=r"sliding_window 4096 is shorter than the sequence \(32,768 tokens: the "
                                        r"spec default\).*--seq-len 4096 or less"):
        Workload.create(windowed, "dgx-h100", 64)
    assert Workload.create(windowed, "dgx-h100", 64, seq_length=4096).spec.seq_length == 4096


def test_llama_spec_without_ffn_takes_the_swiglu_rule(write):
    """A LLaMA-family spec without ffn_hidden_size gets Meta's SwiGLU width, 2/3 of 4h rounded up to a multiple of
    256 (llama model.py): LLaMA-2 7B's shape then counts its published 6.74B parameters (HF: 6,738,415,616)."""
    path = write("l.yaml", "family: llama\nnum_layers: 32\nhidden_size: 4096\nnum_attention_heads: 32\n"
                           "vocab_size: 32000\nseq_length: 4096\n")
    spec = load_model_spec(path)
    assert spec.ffn_size == 11008 and count_parameters(spec) == 6_738_415_616


@pytest.mark.parametrize("kind", sorted(HF_CONFIGS))
def test_hf_config_loading(write, kind):
    config, expected = HF_CONFIGS[kind]
    path = write("config.json", json.dumps(config))
    spec = load_model_spec(path)
    assert count_parameters(spec) == expected


def test_qwen2_biases_q_k_and_v_alone_and_phi3_keeps_its_window(write):
    """Qwen2's layer is LLaMA's with biases on the q, k and v projections (not o, not the MLP): the executor's model
    builds them, the preset counts the published 7.62 B; a spec asking for them outside a plain llama layer is
    refused. Phi-3-mini's window (2047 of 4096 positions) applies, as Mistral's: planned only where it covers the
    sequence; Qwen2's configured window does not apply unless use_sliding_window is set."""
    from paraplan.planner.errors import PlanError
    from paraplan.planner.workload import Workload

    spec = load_model_spec(write("config.json", json.dumps(HF_CONFIGS["qwen2"][0])))
    assert spec.qkv_bias and spec.sliding_window is None
    attn = build_model(dataclasses.replace(spec, num_layers=1), "meta").layers["0"].attn
    assert all(getattr(attn, w).bias is not None for w in ("wq", "wk", "wv")) and attn.wo.bias is None
    assert count_parameters(load_model_spec("qwen2.5-7b")) == HF_CONFIGS["qwen2"][1]
    windowed = {**HF_CONFIGS["qwen2"][0], "use_sliding_window": True, "sliding_window": 4096}
    assert load_model_spec(write("w.json", json.dumps(windowed))).sliding_window == 4096
    with pytest.raises(ModelSpecError, match="'qkv_bias' applies to llama layers"):
        load_model_spec(write("g.yaml", "family: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                                        "vocab_size: 128\nseq_length: 32\nqkv_bias: true\n"))
    phi3 = write("p.json", json.dumps(HF_CONFIGS["phi3"][0]))
    with pytest.raises(PlanError, match="sliding_window 2047 is shorter than the sequence"):
        Workload.create(phi3, "dgx-h100", 8)
    assert Workload.create(phi3, "dgx-h100", 8, seq_length=2047).spec.seq_length == 2047


def test_hf_config_unsupported_type(write):
    path = write("config.json", json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(ModelSpecError, match="model_type 'mamba' is not supported"):
        load_model_spec(path)


def test_initialisation_depends_on_seed_and_name_only():
    spec = load_model_spec("gpt-tiny")
    whole = build_model(spec, "cpu")
    initialize(whole, spec, seed=3)
    last = build_model(spec, "cpu")
    last.keep_only(["layers.3", "head"])
    initialize(last, spec, seed=3)
    # The cut-off head's own copy of the tied weight starts equal to the embedding it is tied to.
    torch.testing.assert_close(last.head.proj.weight, whole.embed.tok.weight)
    torch.testing.assert_close(last.layers["3"].attn.wq.weight, whole.layers["3"].attn.wq.weight)
    other = build_model(spec, "cpu")
    initialize(other, spec, seed=4)
    assert not torch.equal(other.layers["3"].attn.wq.weight, whole.layers["3"].attn.wq.weight)


def test_a_config_json_s_long_default_sequence_is_noted(write):
    """A config.json's max_position_embeddings (131,072 for Llama 3.1) becomes the planned sequence by default: the
    workload notes it is the longest the model takes and that --seq-len sets another; at --seq-len, no note."""
    from paraplan.planner.workload import Workload

    config = {**HF_CONFIGS["llama"][0], "max_position_embeddings": 131072}
    path = write("config.json", json.dumps(config))
    assert any("max_position_embeddings" in n for n in Workload.create(path, "dgx-h100", 8).notes)
    assert not Workload.create(path, "dgx-h100", 8, seq_length=8192).notes


def _saved_bytes(fn, *args) -> int:
    """Bytes autograd keeps for the backward of ``fn(*args)`` (each storage once)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(saved.values())


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_keeps_keys_and_values_unrepeated(masked):
    """Grouped-query attention (a query heads, kv K/V heads): SDPA shares each K/V head among its a/kv query heads
    itself (enable_gqa), so the fused kernel keeps K and V as projected, as Transformer Engine's and torchtitan's
    attention do. Repeated to every head first (this executor until this stop, and so its profile and dry run), they
    were kept a/kv times over: 2·(a − kv)·s·d elements a sequence more. Same output and gradients; causal and under
    context parallelism's mask (keys of the whole sequence) alike."""
    from paraplan.models.transformer import _attention_core

    torch.manual_seed(0)
    b, a, kv, s, d = 2, 8, 2, 16, 8
    keys = 2 * s if masked else s
    q = torch.randn(b, a, s, d, requires_grad=True)  # (b, a, s, d)
    k = torch.randn(b, kv, keys, d, requires_grad=True)  # (b, kv, s_k, d)
    v = torch.randn(b, kv, keys, d, requires_grad=True)
    mask = (torch.rand(s, keys) > 0.3) | (torch.arange(keys) == 0) if masked else None  # (s, s_k) bool

    def repeated(q, k, v):  # the former way: K and V repeated to every query head, then the kernel
        return _attention_core(q, k.repeat_interleave(a // kv, dim=1), v.repeat_interleave(a // kv, dim=1), True, mask)

    grouped, kept = _saved_bytes(lambda q, k, v: _attention_core(q, k, v, True, mask), q, k, v)
    old, kept_old = _saved_bytes(repeated, q, k, v)
    assert kept_old - kept == 2 * b * (a - kv) * keys * d * 4  # fp32
    torch.testing.assert_close(grouped, old)
    grads = torch.autograd.grad(grouped.square().sum(), (q, k, v))
    grads_old = torch.autograd.grad(old.square().sum(), (q, k, v))
    for g, g_old in zip(grads, grads_old, strict=True):
        torch.testing.assert_close(g, g_old)

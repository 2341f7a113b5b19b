"""Profiler: traced FLOPs vs analytic counts, saved activations vs Korthikanti et al., TP view, errors."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, assert_one_line_error, run_cli
from paraplan.models import load_model_spec
from paraplan.profiler import ProfileError, profile_model
from paraplan.profiler.measurements import find_measurement, save_measurements


def analytic_layer_fwd(spec, b, s):
    """Forward FLOPs of one transformer layer (2 FLOPs per multiply-add).

    GPT with a 4h MLP: 24·b·s·h² + 4·b·s²·h (Narayanan et al. 2021, Sec. 5.1; Korthikanti et al. 2022, App. A).
    General: 2bs·(Q,K,V,O projections) + 4bs²h (scores and weighted values) + MLP (2 or 3 matrices of h·f).
    """
    h, f, d = spec.hidden_size, spec.ffn_size, spec.head_dim
    proj = h * spec.num_attention_heads * d * 2 + h * spec.kv_heads * d * 2
    mlp = (3 if spec.family == "llama" else 2) * h * f
    return 2 * b * s * (proj + mlp) + 4 * b * s * s * h


@pytest.mark.parametrize("name", ["gpt3-175b", "gpt2", "llama2-70b", "llama3-8b", "bert-large"])
def test_traced_flops_match_analytic(name):
    spec = load_model_spec(name)
    b, s = 2, spec.seq_length
    prof = profile_model(spec, "meta", micro_batch=b)
    layers = [x for x in prof.layers if x.kind == "transformer_layer"]
    assert len(layers) == spec.num_layers
    expected = analytic_layer_fwd(spec, b, s)
    if spec.family == "gpt":  # the closed form holds exactly for a 4h MLP
        assert expected == 24 * b * s * spec.hidden_size ** 2 + 4 * b * s * s * spec.hidden_size
    for layer in layers:
        assert layer.fwd_flops == pytest.approx(expected, rel=0.01)
        assert layer.bwd_flops == pytest.approx(2 * layer.fwd_flops, rel=0.01)  # backward = 2x forward
    head = prof.layers[-1]
    logits = 2 * b * s * spec.hidden_size * spec.vocab_size
    if spec.family == "bert":
        logits += 2 * b * s * spec.hidden_size ** 2  # BERT's MLM transform (dense h x h) before the decoder
    assert head.fwd_flops == pytest.approx(logits, rel=0.01)
    assert prof.total_bwd_flops == pytest.approx(2 * prof.total_fwd_flops, rel=0.01)


def test_gpt_layer_saved_activations_vs_korthikanti():
    """Korthikanti et al. 2022, Sec. 4.1, Eq. (1): a GPT layer saves 34·s·b·h + 5·a·s²·b bytes in fp16.

    That count includes dropout, which our models leave out: the two hidden-state dropout masks
    (s·b·h each) and, in attention, the dropout mask (a·s²·b) and dropout output (2·a·s²·b). What
    remains is 32·s·b·h + 2·a·s²·b (the softmax output). Traced on meta, attention runs torch's
    math path, so the s² term is there; a fused (flash) kernel would keep none of it. On top, each
    LayerNorm keeps its mean and reciprocal std in fp32: 2 x 2 x 4·s·b bytes per layer.
    """
    spec = load_model_spec("gpt3-1.3b")
    b, s, h, a = 2, spec.seq_length, spec.hidden_size, spec.num_attention_heads
    prof = profile_model(spec, "meta", micro_batch=b, dtype="fp16")
    layer = prof.layers[1]
    korthikanti = 34 * s * b * h + 5 * a * s * s * b
    without_dropout = korthikanti - 2 * s * b * h - 3 * a * s * s * b
    ln_stats = 2 * 2 * 4 * s * b
    assert layer.activation_bytes == without_dropout + ln_stats
    assert layer.activation_bytes < korthikanti


@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama2-7b", "mixtral-tiny"])
def test_mlp_recomputation_drops_what_the_mlp_produces(name):
    """What recomputing the MLP sublayer drops, against Korthikanti et al. 2022, Sec. 4.1's per-tensor count.

    GELU MLP (fp16): the MLP saves its input (2·s·b·h, produced by the norm before it: kept as the checkpoint's
    input), the first linear's output for GeLU (8·s·b·h) and GeLU's output for the second linear (8·s·b·h):
    16·s·b·h are dropped. SwiGLU with width f: silu's input w1·x, the product's operands silu(w1·x) and w3·x,
    and the down projection's input: 4 tensors of s·b·f, 2 bytes each. An MoE block drops everything it saved
    but its input (planner/moe.py's share). The MLP's GEMMs are the ones marked: 2 (GELU) or 3 (SwiGLU) per
    dense layer, with FLOPs 2·s·b·h·f each."""
    spec = load_model_spec(name)
    b, s, h = 2, spec.seq_length, spec.hidden_size
    prof = profile_model(spec, "meta", micro_batch=b, dtype="fp16")
    layer = prof.layers[1]
    if spec.num_experts:
        inputs = b * s * h * 2  # the MoE block's input, saved by its router and kept
        assert layer.mlp_dropped_bytes == layer.activation_bytes_moe - inputs
        return
    f = spec.ffn_size
    expected = 16 * s * b * h if spec.family == "gpt" else 4 * s * b * f * 2
    assert layer.mlp_dropped_bytes == expected
    assert layer.mlp_dropped_bytes_sharded == expected  # all of it inside the tensor-parallel MLP region
    mlp_gemms = [g for g, x in zip(layer.fwd_ops.gemm_flops, layer.fwd_ops.gemm_mlp, strict=True) if x]
    assert mlp_gemms == [2 * b * s * h * f] * (3 if spec.family == "llama" else 2)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallel_view_of_a_gpt_layer(t):
    """Korthikanti et al. 2022 Eq. (2) (tensor parallel): sbh(10 + 24/t + 5as/(ht)); Eq. (4) with sequence
    parallelism: sbh(34/t + 5as/(ht)). Without dropout (see above) the replicated part is 8sbh, the
    sharded 24sbh + 2as²b; Megatron's layer issues 2 all-reduces of 2sbh bytes forward and 2 backward."""
    spec = load_model_spec("gpt3-1.3b")
    b, s, h, a = 1, spec.seq_length, spec.hidden_size, spec.num_attention_heads
    prof = profile_model(spec, "meta", micro_batch=b, dtype="fp16", tp_degrees=[t])
    layer = prof.layers[1]
    view = layer.tp_views[t]
    ln_stats = 2 * 2 * 4 * s * b
    assert view.activation_bytes == 8 * s * b * h + ln_stats + (24 * s * b * h + 2 * a * s * s * b) // t
    assert view.activation_bytes_sp == (32 * s * b * h + 2 * a * s * s * b + ln_stats) // t
    assert view.fwd_flops == pytest.approx(layer.fwd_flops / t, rel=1e-6)
    ar = [c for c in view.collectives if c.op == "all_reduce"]
    assert [c.phase for c in ar].count("fwd") == 2 and [c.phase for c in ar].count("bwd") == 2
    assert all(c.bytes == 2 * s * b * h for c in ar)
    sp_ops = sorted((c.op, c.phase) for c in view.collectives_sp)
    assert sp_ops == sorted([("all_gather", "fwd"), ("reduce_scatter", "fwd")] * 2
                            + [("all_gather", "bwd"), ("reduce_scatter", "bwd")] * 2)
    # Weights of the four projections and the MLP are split; biases of row-parallel layers and LayerNorms are not.
    sharded = (4 * h * h + 3 * h + 8 * h * h + 4 * h) * 2
    assert view.param_bytes == sharded // t + (layer.param_bytes - sharded)


def test_identical_blocks_are_traced_once_and_meta_allocates_nothing():
    prof = profile_model("llama3-405b", "meta", micro_batch=1)
    assert len(prof.layers) == 128 and prof.num_parameters == 405_853_388_800
    sigs = {x.signature for x in prof.layers if x.kind == "transformer_layer"}
    assert len(sigs) == 1
    assert all(x.fwd_ms is None for x in prof.layers)


def test_cpu_timing_and_tied_head():
    prof = profile_model("gpt-tiny", "cpu", micro_batch=2, warmup=1, repeats=3)
    assert all(x.fwd_ms > 0 and x.bwd_ms > 0 for x in prof.layers)
    assert prof.layers[-1].tied_params == 1024 * 128  # the LM head's weight is the embedding's
    assert prof.dtype == "fp32"


def test_cnn_profile():
    prof = profile_model("resnet50", "meta", micro_batch=4)
    # ResNet-50 at 224x224: 4.1 GMACs per image forward (He et al. 2016, Table 1: 3.8e9 FLOPs counted as
    # multiply-adds for the 2015 variant; torchvision's v1.5 with stride on the 3x3 is 4.09 GMACs).
    assert prof.total_fwd_flops / 4 / 2 == pytest.approx(4.09e9, rel=0.02)


def test_custom_callable_profile():
    """A user's module is profiled per micro-batch like the zoo's: its example input (batch 4 here) resized along
    its first dimension to --micro-batch (default 1), so a Linear(32, 64) forward is 2 x batch x 32 x 64 FLOPs."""
    for extra, batch in (([], 1), (["--micro-batch", "6"], 6)):
        p = run_cli("profile", "--model", "fixtures.custom_model:two_layer_mlp", "--json", *extra,
                    env={"PYTHONPATH": str(ROOT / "tests")})
        assert p.returncode == 0, p.stderr
        data = json.loads(p.stdout)
        assert [x["name"] for x in data["layers"]] == ["0", "2"] and data["micro_batch"] == batch
        assert data["layers"][0]["fwd_flops"] == 2 * batch * 32 * 64
        assert data["num_parameters"] == 32 * 64 + 64 + 64 * 10 + 10


@pytest.mark.parametrize("model,fragment", [
    ("fixtures.custom_model:raises", "raised RuntimeError: dataset not found"),
    ("fixtures.custom_model:wrong_return", "must return (module, example_input, block_names)"),
    ("fixtures.custom_model:missing_block", "block '5' is not a submodule"),
    ("fixtures.custom_model:partial_blocks", "block_names leave parameter '2.weight' (and 1 more) outside every block"),
    ("fixtures.custom_model:nope", "has no callable 'nope'"),
    ("no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod'"),
    ("gpt-tinny", "did you mean gpt-tiny"),
    ("mymodel.py", "a Python file is not a model spec; give your module's callable as package.module:callable"),
])
def test_bad_models_are_one_line_errors(model, fragment):
    p = run_cli("profile", "--model", model, env={"PYTHONPATH": str(ROOT / "tests")})
    assert_one_line_error(p, fragment)


@pytest.mark.parametrize("model, tp, fragment", [
    ("llama-tiny", "3", "--tp 3 does not divide llama-tiny's 4 attention heads"),  # was fractional byte counts
    ("llama-tiny", "4", "--tp 4 does not divide llama-tiny's 2 key/value heads"),  # as the planner refuses it
    ("vgg16", "2", "tensor-parallel views are of transformers"),
])
def test_tensor_parallel_views_the_planner_would_refuse_are_errors(model, tp, fragment):
    assert_one_line_error(run_cli("profile", "--model", model, "--tp", tp, "--json"), fragment)


def test_absurd_micro_batch():
    p = run_cli("profile", "--model", "gpt-tiny", "--micro-batch", "10000000")
    assert_one_line_error(p, "--micro-batch 10000000 is out of range")
    with pytest.raises(ProfileError, match="needs about"):
        profile_model("gpt3-175b", "cpu", micro_batch=1024)


@pytest.mark.parametrize("ext", ["csv", "json", "parquet"])
def test_out_files(tmp_path, ext):
    out = tmp_path / f"prof.{ext}"
    p = run_cli("profile", "--model", "gpt-tiny", "--out", str(out))
    assert p.returncode == 0, p.stderr
    import pandas as pd

    df = {"csv": pd.read_csv, "parquet": pd.read_parquet}.get(ext)
    if df:
        assert list(df(out)["name"]) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    else:
        assert len(json.loads(out.read_text())["layers"]) == 6


def test_tensor_parallel_view_shows_in_every_output(tmp_path):
    """``--tp T`` asks for the per-rank view: the terminal table and the table files carry it too, not only the JSON
    (they once printed the whole-block table alone, the flag silently ignored). A layer's per-rank columns are its
    view's (Korthikanti et al. 2022, checked above): the forward FLOPs divided by T, the four all-reduces of the
    layer's 2sbh-byte output (Megatron's layer: two forward, two backward)."""
    import pandas as pd

    spec = load_model_spec("gpt-tiny")
    s, h = spec.seq_length, spec.hidden_size
    out = tmp_path / "prof.csv"
    p = run_cli("profile", "--model", "gpt-tiny", "--device", "meta", "--dtype", "fp16", "--tp", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "per rank at tensor parallelism 2" in p.stdout
    row = pd.read_csv(out).set_index("name").loc["layers.0"]
    assert row["tp2_fwd_flops"] == pytest.approx(row["fwd_flops"] / 2, rel=1e-6)
    assert row["tp2_collective_bytes"] == 4 * 2 * s * h
    assert row["tp2_activation_bytes_sp"] < row["tp2_activation_bytes"] < row["activation_bytes"]
    plain = run_cli("profile", "--model", "gpt-tiny", "--device", "meta", "--dtype", "fp16")
    assert "tensor parallelism" not in plain.stdout


def test_measurements_round_trip(tmp_path):
    prof = profile_model("gpt-tiny", "cpu", micro_batch=1, warmup=0, repeats=1)
    save_measurements(prof, gpu="cpu", directory=tmp_path)
    rec = find_measurement("cpu", prof.spec, 1, prof.seq_length, "fp32", directory=tmp_path)
    assert rec is not None and [x["fwd_ms"] for x in rec["layers"]] == [x.fwd_ms for x in prof.layers]
    assert find_measurement("cpu", prof.spec, 2, prof.seq_length, "fp32", directory=tmp_path) is None
    with pytest.raises(ProfileError, match="needs measured times"):
        save_measurements(profile_model("gpt-tiny"), gpu="cpu", directory=tmp_path)


@pytest.mark.parametrize("name", ["llama2-7b", "gpt3-1.3b"])
def test_weight_carrying_outputs_of_a_layer(name):
    """The outputs of a layer's weight-carrying ops, whose gradients torch's zero-bubble input backward keeps for
    the weight backward (pipelining/_backward.py, param_group["grads"]: one per op where a weight meets the
    activations). Per token: the column-parallel Q, K, V and the MLP's first GEMM(s) (split over tensor-parallel
    ranks), the row-parallel output projections (each rank's whole partial sum), and the two norms' scaled outputs:
    fp32 where RMSNorm's decomposition (meta, CPU: what the dry run traces) scales its fp32 intermediate by the
    weight before casting back, 16-bit from LayerNorm's one kernel (whose mean and rstd get no gradient)."""
    spec = load_model_spec(name)
    b, s, h, f = 2, spec.seq_length, spec.hidden_size, spec.ffn_size
    kv = spec.kv_heads * spec.head_dim
    layer = profile_model(spec, "meta", micro_batch=b, dtype="bf16").layers[1]
    first_mlp = 2 * f if spec.family == "llama" else f  # SwiGLU's gate and up, or GPT's fc1
    norm_elem = 4 if spec.family == "llama" else 2
    assert layer.weight_output_bytes_sharded == b * s * (h + 2 * kv + first_mlp) * 2
    assert layer.weight_output_bytes_whole == b * s * (h + h) * 2
    assert layer.weight_output_bytes - layer.weight_output_bytes_sharded - layer.weight_output_bytes_whole == \
        2 * b * s * h * norm_elem


def test_a_grouped_query_layer_keeps_its_keys_and_values_once(monkeypatch):
    """Llama 3 8B (32 query heads, 8 K/V heads of 128): what a layer keeps with a fused attention kernel (the core's
    inputs, not its s x s internals: activation_bytes_selective, from which the flash pricing starts) holds K and V as
    projected. Until this stop the layer repeated them to every query head before the core, so the core's inputs,
    and what was priced as kept, held them 4 times: 2·(a − kv)·d elements a token more (bf16). The unfused kernel's
    count (activation_bytes) keeps the copies it multiplies, either way."""
    import paraplan.models.transformer as transformer
    from paraplan.profiler import cache

    monkeypatch.setattr(cache, "load", lambda key: None)  # traced here, both; the former never stored
    monkeypatch.setattr(cache, "store", lambda key, profile: None)
    spec = load_model_spec("llama3-8b")
    b, s, a, kv, d = 1, spec.seq_length, spec.num_attention_heads, spec.kv_heads, spec.head_dim
    grouped = profile_model(spec, "meta", micro_batch=b, dtype="bf16").layers[1]
    core = transformer._attention_core

    def repeated_first(q, k, v, causal, mask=None):  # the former layer: K and V repeated before the core
        group = q.shape[1] // k.shape[1]
        return core(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), causal, mask)

    monkeypatch.setattr(transformer, "_attention_core", repeated_first)
    former = profile_model(spec, "meta", micro_batch=b, dtype="bf16").layers[1]
    assert former.activation_bytes_selective - grouped.activation_bytes_selective == 2 * b * s * (a - kv) * d * 2
    assert former.activation_bytes == grouped.activation_bytes


def test_largest_parameter_tensors_by_how_tensor_parallelism_holds_them():
    """Each block's largest parameter tensor, split over tensor-parallel ranks or kept whole (what torch's AdamW
    allocates two temporaries for as it updates that tensor: memory.step_bytes). llama-tiny (h 128, FFN 352,
    vocabulary 1,024, untied): the embedding's V x h is split (vocab-parallel); a layer's largest split tensor is an
    MLP matrix, h x f, and its largest whole one a norm's weight, h; the head block's, V x h and the final norm."""
    spec = load_model_spec("llama-tiny")
    h, f, v = spec.hidden_size, spec.ffn_size, spec.vocab_size
    layers = profile_model(spec, "meta", micro_batch=1, dtype="bf16").layers
    assert (layers[0].largest_split_param, layers[0].largest_whole_param) == (v * h, 0)
    assert (layers[1].largest_split_param, layers[1].largest_whole_param) == (h * f, h)
    assert (layers[-1].largest_split_param, layers[-1].largest_whole_param) == (v * h, h)
    assert all(x.largest_expert_param == 0 for x in layers)
    moe = load_model_spec("mixtral-tiny")  # stacked experts: (E, h, f) per projection, whole
    layer = profile_model(moe, "meta", micro_batch=1, dtype="bf16").layers[1]
    assert layer.largest_expert_param == moe.num_experts * moe.hidden_size * moe.moe_ffn_size

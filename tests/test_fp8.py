"""FP8 training in the cost model (planner/fp8.py, compute.gemm_dtype): the transformer layers' linears at the FP8
rate, everything else in bf16, the quantisation traffic and the memory as Transformer Engine or torchao keep it;
the executor refuses FP8 plans in one line."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli
from paraplan.hardware_specs import load_cluster
from paraplan.planner import fp8
from paraplan.planner.compute import estimate_pass_times, gemm_dtype
from paraplan.planner.costmodel import CostModel, default_stages
from paraplan.planner.framework import framework
from paraplan.planner.layout import Layout
from paraplan.planner.memory import state_bytes
from paraplan.planner.workload import Workload

MODEL = "benchmarks/data/llama-small.yaml"  # h 1024, a 16 x 64, kv 8, SwiGLU ffn 2816


def test_which_gemms_run_in_fp8():
    assert gemm_dtype("fp8", "transformer_layer", core=False) == "fp8"
    assert gemm_dtype("fp8", "transformer_layer", core=True) == "bf16"  # softmax(QK^T)V stays bf16
    assert gemm_dtype("fp8", "lm_head", core=False) == "bf16"  # TE / torchao leave the output layer out
    assert gemm_dtype("bf16", "transformer_layer", core=False) == "bf16"
    assert gemm_dtype("fp8", "transformer_layer", core=False, bf16_expert=True) == "bf16"  # unconverted experts


def test_fp8_linears_at_twice_the_rate_when_the_curve_matches():
    """With FP8's efficiency curve equal to bf16's and twice the peak (H100: 1979 vs 989.5 TFLOP/s dense), the
    linears' GEMM time halves, the attention core's and the output layer's do not."""
    work = Workload.create(MODEL, "dgx-h100", 64)
    gpu = work.cluster.gpu
    eff = gpu.efficiency
    same = dataclasses.replace(gpu, efficiency=dataclasses.replace(eff, matmul={"default": eff.matmul["default"]}))
    layer, head = work.profile("bf16").layers[1], work.profile("bf16").layers[-1]
    bf, f8 = (estimate_pass_times(layer, 2, 1, False, same, d, "flash") for d in ("bf16", "fp8"))
    assert f8.bwd_weight == pytest.approx(bf.bwd_weight / 2)  # weight-gradient GEMMs: linears only
    assert f8.core_fwd == pytest.approx(bf.core_fwd)
    hb, hf = (estimate_pass_times(head, 2, 1, False, same, d, "flash") for d in ("bf16", "fp8"))
    assert hf.fwd == pytest.approx(hb.fwd)


def test_linear_shapes_of_a_llama_layer():
    spec = Workload.create(MODEL, "dgx-h100", 64).spec
    s = fp8.layer_linears(spec, 1, False)
    # inputs: QKV h, output projection a·d, MLP up h, MLP down ffn
    assert s.inputs == 1024 + 16 * 64 + 1024 + 2816
    # output gradients: QKV (a + 2kv)·d, projection h, gated MLP up 2·ffn, down h
    assert s.grad_outputs == (16 + 16) * 64 + 1024 + 2 * 2816 + 1024
    assert s.weights == 1024 * 32 * 64 + 1024 * 1024 + 1024 * 2 * 2816 + 2816 * 1024
    t2 = fp8.layer_linears(spec, 2, True)  # SP: column-parallel inputs are sequence shards
    assert t2.inputs == pytest.approx(s.inputs / 2)


def test_cast_traffic_by_scaling_recipe():
    spec = Workload.create(MODEL, "dgx-h100", 64).spec
    s = fp8.layer_linears(spec, 1, False)
    tokens, hbm = 4096, 1e12
    f, b = fp8.cast_seconds(spec, framework("megatron-core"), tokens, 1, False, hbm, 0.0)
    assert f == pytest.approx(4 * tokens * s.inputs / hbm)  # TE: read 2, write 1 + transposed 1
    assert b == pytest.approx(4 * tokens * s.grad_outputs / hbm)
    f, b = fp8.cast_seconds(spec, framework("torchtitan"), tokens, 1, False, hbm, 0.0)
    assert f == pytest.approx(5 * (tokens * s.inputs + s.weights) / hbm)  # amax pass + cast, weight every time
    assert b == pytest.approx(5 * (tokens * (s.grad_outputs + s.inputs) + s.weights) / hbm)
    # TE's per-tensor current scaling (Float8CurrentScalingQuantizer::quantize_impl, transformer_engine/pytorch/
    # csrc/quantizer.cpp): nvte_compute_amax reads the tensor (2 B), nvte_compute_scale_from_amax, nvte_quantize
    # reads it again and writes the FP8 copy and its transpose (2 + 1 + 1 B): 6 B and 3 kernels per element cast,
    # on delayed scaling's tensors (inputs forward, output gradients backward)
    current = framework("megatron-core", fp8_recipe="tensorwise")
    f, b = fp8.cast_seconds(spec, current, tokens, 1, False, hbm, 0.0)
    assert f == pytest.approx(6 * tokens * s.inputs / hbm)
    assert b == pytest.approx(6 * tokens * s.grad_outputs / hbm)
    kernel = 1e-5
    delayed_f = fp8.cast_seconds(spec, framework("megatron-core"), tokens, 1, False, hbm, kernel)[0]
    current_f = fp8.cast_seconds(spec, current, tokens, 1, False, hbm, kernel)[0]
    assert current_f - delayed_f == pytest.approx(2 * tokens * s.inputs / hbm + (3 - 1) * s.linears * kernel)


def test_fp8_memory_by_stack():
    spec = Workload.create(MODEL, "dgx-h100", 64).spec
    s = fp8.layer_linears(spec, 1, False)
    assert fp8.saved_bytes_saving(spec, framework("megatron-core"), 100, 1, False, "none") == 100 * s.inputs
    assert fp8.saved_bytes_saving(spec, framework("megatron-core"), 100, 1, False, "full") == 0.0
    assert fp8.saved_bytes_saving(spec, framework("torchtitan"), 100, 1, False, "none") == 0.0
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1, dtype="fp8")
    ds = state_bytes(framework("deepspeed"), lay)  # TE's FP8 weight and transpose cached beside bf16 weights
    assert ds.weights == 2 + 2
    assert state_bytes(framework("megatron-core"), lay).weights == 2  # FP8 parameters replace them


def test_fp8_is_faster_and_its_mfu_is_against_the_fp8_peak():
    work = Workload.create("llama3-8b", "dgx-h100", 64, seq_length=4096, framework="megatron-core")
    model = CostModel(work)
    bf = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    f8 = bf.replace(dtype="fp8")
    pb, pf = (model.evaluate(x, default_stages(model, x)) for x in (bf, f8))
    assert pf.iteration_time_s < pb.iteration_time_s
    assert pf.model_tflops_per_gpu * 1e12 / pf.mfu == pytest.approx(load_cluster("dgx-h100").gpu.peak_flops("fp8"))
    assert pf.memory_gib["activations"] < pb.memory_gib["activations"]  # TE's FP8 copies of linear inputs


def test_executor_refuses_fp8_in_one_line(tmp_path):
    plan = tmp_path / "fp8.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "2",
                "--tp", "1", "--pp", "1", "--micro-batch", "1", "--dtype", "fp8", "--write-plan", str(plan))
    assert p.returncode == 0, p.stderr
    for extra in ([], ["--dry-run"]):
        p = run_cli("execute", "--plan", str(plan), *extra)
        assert p.returncode != 0 and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "fp8" in p.stderr


def test_fp8_recipe_switch_from_the_cli_prices_exports_and_reads_back(tmp_path):
    """--fp8-recipe (Megatron-Core's names): tensorwise prices TE's current scaling on a TE stack (an FP8 run gets
    slower by the amax passes; a bf16 plan, which it would not move, refuses it in one line, as MoE switches on a
    dense model), is recorded in plan.json and read back as priced, and
    the Megatron export asks for it (Megatron's default recipe is delayed); a torchao stack (this executor) has
    only tensorwise scaling: tensorwise changes nothing there and delayed is refused in one line."""
    import json

    from conftest import assert_one_line_error, run_cli_json
    from paraplan.planner.api import predict_plan
    from paraplan.planner.plan import Plan

    args = ["simulate", "--model", MODEL, "--cluster", "dgx-h100", "--global-batch", "64", "--dp", "4", "--tp", "2",
            "--pp", "1", "--micro-batch", "1", "--zero", "1", "--sequence-parallel"]
    core = [*args, "--framework", "megatron-core"]
    delayed = run_cli_json(*core, "--dtype", "fp8", "--fp8-recipe", "delayed")
    default = run_cli_json(*core, "--dtype", "fp8")
    current = run_cli_json(*core, "--dtype", "fp8", "--fp8-recipe", "tensorwise")
    assert default["iteration_time_s"] == delayed["iteration_time_s"]  # megatron-core's default: delayed
    assert current["iteration_time_s"] > delayed["iteration_time_s"]
    for dtype in ("bf16", None):
        assert_one_line_error(run_cli(*core, *(("--dtype", dtype) if dtype else ()), "--fp8-recipe", "tensorwise"),
                              "--fp8-recipe tensorwise", "changes nothing in a plan that is not fp8",
                              f"({dtype or 'the default dtype'}): add --dtype fp8")
    plan = tmp_path / "cs.json"
    first = run_cli_json(*core, "--dtype", "fp8", "--fp8-recipe", "tensorwise", "--write-plan", str(plan))
    assert json.loads(plan.read_text())["framework_switches"] == {"fp8_recipe": "tensorwise"}
    assert predict_plan(Plan.read(str(plan))).iteration_time_s == pytest.approx(first["iteration_time_s"], rel=1e-9)
    p = run_cli("export", "--plan", str(plan), "--to", "megatron")
    assert p.returncode == 0, p.stderr
    assert "--fp8-recipe tensorwise" in p.stdout
    plain = run_cli_json(*args, "--dtype", "fp8")
    assert run_cli_json(*args, "--dtype", "fp8", "--fp8-recipe", "tensorwise")["iteration_time_s"] == \
        plain["iteration_time_s"]
    assert_one_line_error(run_cli(*args, "--dtype", "fp8", "--fp8-recipe", "delayed"), "--fp8-recipe delayed",
                          "torchao")


def test_linear_shapes_of_multi_head_latent_attention():
    """DeepSeek-V3's MLA (config.json: h 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128)
    as Megatron-Core's MLASelfAttention runs its five linears: q down h -> 1536 and kv down h -> 512 + 64
    (duplicated on every rank), q up 1536 -> 128·192 and kv up 512 -> 128·(128 + 128) (column-parallel), output
    projection 128·128 -> h (row-parallel). FP8 casts their inputs forward and output gradients backward."""
    spec = Workload.create("deepseek-v3", "dgx-h100", 64).spec
    inputs, grads, weights, linears = fp8.mla_linears(spec, 1, False)
    assert linears == 5
    assert inputs == 7168 + 7168 + 1536 + 512 + 128 * 128
    assert grads == 1536 + (512 + 64) + 128 * 192 + 128 * 256 + 7168
    assert weights == 7168 * 1536 + 7168 * 576 + 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    i4, g4, w4, _ = fp8.mla_linears(spec, 4, True)  # SP: the shard's inputs; column-parallel outputs sharded
    assert i4 == pytest.approx(inputs / 4)
    assert w4 == 7168 * 1536 + 7168 * 576 + (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168) / 4
    # a dense layer (the first three) adds its SwiGLU MLP's two linears; MLA's saved tensors stay 16-bit
    dense = fp8.layer_linears(spec, 1, False)
    assert dense.linears == 7 and dense.inputs == inputs + 7168 + 18432
    assert fp8.saved_bytes_saving(spec, framework("megatron-core"), 100, 1, False, "none") == 0.0

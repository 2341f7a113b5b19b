"""--recompute norm+act: Megatron-Core's recompute_modules layernorm and moe_act (output-discarding checkpoints,
megatron/core/transformer/transformer_config.py; NVIDIA's GPT-OSS-120B H100 recipe runs them), priced for the
stacks that run them and refused by the others in one line."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, run_cli, run_cli_json
from paraplan.planner import moe
from paraplan.planner.costmodel import CostModel
from paraplan.planner.layout import Layout
from paraplan.planner.placement import layout_placement
from paraplan.planner.workload import Workload

SEQ = 1024


def _moe_block(model: str, lay: Layout, mode: str, framework: str = "megatron-core", **switches):
    work = Workload.create(model, "dgx-h100", lay.global_batch, seq_length=SEQ, nodes=max(1, lay.num_gpus // 8),
                           framework=framework, **switches)
    cost_model = CostModel(work)
    layers = work.profile(lay.dtype).layers
    i = next(i for i, layer in enumerate(layers) if moe.is_moe(layer))
    return work, cost_model.block_cost(i, lay, layout_placement(work.cluster, lay), mode)


def test_norm_act_frees_the_pre_mlp_norm_output_and_the_experts_activation_outputs():
    """Per token a rank routes (its 1/tp of the sequence under SP): the pre-MLP norm's output (2h bytes, a module of
    its own in an MoE layer, read by the router and the dispatch) and each of its k routed copies' activation output
    (2f, the second expert GEMM's input). Qwen3-30B-A3B: h 2048, f 768, k 8."""
    lay = Layout(dp=8, tp=2, pp=1, ep=8, micro_batch=1, global_batch=64, zero=1, sequence_parallel=True)
    work, none = _moe_block("qwen3-30b-a3b", lay, "none")
    _, norm_act = _moe_block("qwen3-30b-a3b", lay, "norm+act")
    tokens = SEQ / 2  # this rank's share under tp 2 with SP
    assert none.act_bytes - norm_act.act_bytes == pytest.approx(tokens * (2 * 2048 + 8 * 2 * 768))
    # backward rebuilds them: they are working memory while the block's backward runs
    assert norm_act.act_working == pytest.approx(none.act_bytes - norm_act.act_bytes)


def test_norm_act_reruns_the_norm_and_the_activation_as_memory_traffic():
    """The rerun is element-wise: the RMSNorm reads and writes 2h per token, the fused SwiGLU reads 2·up (up = 2f)
    and writes 2f per routed copy, at the GPU's achievable HBM bandwidth, one kernel each; no GEMM FLOPs."""
    lay = Layout(dp=8, tp=2, pp=1, ep=8, micro_batch=1, global_batch=64, zero=1, sequence_parallel=True)
    work, cost = _moe_block("qwen3-30b-a3b", lay, "norm+act")
    gpu = work.cluster.gpu
    hbm = gpu.hbm_GBps * 1e9 * gpu.efficiency.memory_bound
    tokens = SEQ / 2
    moved = tokens * 4 * 2048 + tokens * 8 * (2 * 1536 + 2 * 768)  # forced balance: megatron-core's load is 1.0
    assert cost.recompute == pytest.approx(moved / hbm + 2 * gpu.efficiency.op_overhead_us * 1e-6)
    assert cost.recompute_flops == 0.0
    _, plain = _moe_block("qwen3-30b-a3b", lay, "none")
    assert (cost.fwd, cost.bwd_input, cost.bwd_weight) == (plain.fwd, plain.bwd_input, plain.bwd_weight)


def test_norm_act_from_the_cli_prices_exports_and_is_refused_where_it_does_not_run(tmp_path):
    """simulate --recompute norm+act on Megatron-Core: less memory, a little more time than none, far less time
    than the MoE block's recomputation (mlp); the plan exports as Megatron's --recompute-modules layernorm moe_act.
    Refused in one line: by this executor's stack (pricing and execution), for a dense model, under FP8 delayed
    scaling (Megatron-Core refuses it), and by plan --recompute-modes on a stack that does not run it."""
    args = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
            "--seq-len", str(SEQ), "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "16", "--micro-batch", "1",
            "--zero", "1"]
    core = [*args, "--framework", "megatron-core"]
    by_mode = {m: run_cli_json(*core, "--recompute", m) for m in ("none", "norm+act", "mlp")}
    assert by_mode["norm+act"]["peak_memory_gib"] < by_mode["none"]["peak_memory_gib"]
    assert by_mode["none"]["iteration_time_s"] < by_mode["norm+act"]["iteration_time_s"] < \
        by_mode["mlp"]["iteration_time_s"]
    plan = tmp_path / "na.json"
    run_cli_json(*core, "--recompute", "norm+act", "--write-plan", str(plan))
    assert json.loads(plan.read_text())["recompute"] == "norm+act"
    p = run_cli("export", "--plan", str(plan), "--to", "megatron")
    assert p.returncode == 0, p.stderr
    assert "--recompute-modules layernorm moe_act" in p.stdout
    assert_one_line_error(run_cli(*args, "--recompute", "norm+act"), "norm+act", "--framework megatron-core")
    dense = ["simulate", "--model", "llama-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "8", "--tp",
             "1", "--pp", "1", "--micro-batch", "1", "--framework", "megatron-core", "--recompute", "norm+act"]
    assert_one_line_error(run_cli(*dense), "has no experts")
    assert_one_line_error(run_cli(*core, "--recompute", "norm+act", "--dtype", "fp8"), "delayed scaling",
                          "--fp8-recipe tensorwise")
    assert run_cli_json(*core, "--recompute", "norm+act", "--dtype", "fp8", "--fp8-recipe", "tensorwise")["fits"]
    planned = ["plan", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
               "--seq-len", str(SEQ), "--recompute-modes", "none,norm+act"]
    assert_one_line_error(run_cli(*planned), "norm+act", "--framework megatron-core")


def test_this_executor_refuses_a_norm_act_plan_in_one_line(tmp_path):
    plan = tmp_path / "na.json"
    p = run_cli("simulate", "--model", "mixtral-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "2",
                "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "1", "--framework", "megatron-core",
                "--recompute", "norm+act", "--write-plan", str(plan))
    assert p.returncode == 0, p.stderr
    assert_one_line_error(run_cli("execute", "--plan", str(plan)), "norm+act", "--to megatron")


def test_this_executor_refuses_a_zero_bubble_stage_that_recomputes_weights_in_one_line(tmp_path):
    """A zb-v plan whose stage recomputes a region holding weights (an edited plan.json: simulate refuses to write
    one) is refused before any rank starts, naming the field (layout.zero_bubble_recompute_refusal)."""
    import json

    plan = tmp_path / "zbv.json"
    p = run_cli("simulate", "--model", "llama-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1",
                "--tp", "1", "--pp", "2", "--micro-batch", "1", "--schedule", "zb-v", "--virtual-stages", "2",
                "--recompute", "selective", "--write-plan", str(plan))
    assert p.returncode == 0, p.stderr
    data = json.loads(plan.read_text())
    data["stage_recompute"] = ["selective", "full", "selective", "selective"]
    plan.write_text(json.dumps(data))
    assert_one_line_error(run_cli("execute", "--plan", str(plan)), "stage_recompute", "zb-v with full recomputation")

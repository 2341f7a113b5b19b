"""Framework profiles (planner/framework.py): every profile the CLI offers, and each behaviour field where the cost
model reads it, pinned to the source of the behaviour."""

from __future__ import annotations

import json

import pytest

from paraplan.cli import FRAMEWORK_CHOICES
from paraplan.planner import comm
from paraplan.planner.compute import estimate_pass_times
from paraplan.planner.costmodel import CostModel, default_stages
from paraplan.planner.dp_sync import DDP_BUCKET_BYTES, dp_exposures
from paraplan.planner.errors import PlanError
from paraplan.planner.framework import FRAMEWORKS, framework
from paraplan.planner.layout import Layout
from paraplan.planner.memory import state_bytes, step_bytes
from paraplan.planner.placement import layout_placement
from paraplan.planner.workload import Workload

MODEL = "benchmarks/data/llama-small.yaml"


def _model(fw: str, **switches) -> CostModel:
    return CostModel(Workload.create(MODEL, "dgx-h100", 64, framework=framework(fw).replace(**switches)))


def test_every_cli_framework_is_a_documented_profile():
    assert set(FRAMEWORK_CHOICES) == set(FRAMEWORKS)
    for name, fw in FRAMEWORKS.items():
        assert fw.name == name and len(fw.source) > 40, name
        assert fw.cp_comm in ("all_gather", "ring", "all_gather_overlap")
        assert fw.fp8_scaling in ("dynamic", "delayed")


def test_explicit_switches_override_a_profile():
    fw = framework("megatron-core", attention="unfused", overlap_dp=False, overlap_tp=False)
    assert (fw.attention, fw.overlap_dp, fw.overlap_tp) == ("unfused", False, False)
    assert fw.states == "zero" and fw.grad_bytes == 2 and fw.cp_comm == "ring"  # the rest of the profile stays
    with pytest.raises(PlanError):
        framework("megatron-1999")


def test_recipe_switches_reach_the_profile_from_the_cli_and_stacks_that_cannot_run_them_refuse():
    """The MoE recipes' settings a fidelity check uses (benchmarks/fidelity_moe.py) are CLI switches: the token
    dispatcher, the all-to-all overlap, gradients reduced in 16 bits. simulate --json with them prices what
    the Workload built with them prices; this executor runs none of them and refuses in one line."""
    from conftest import assert_one_line_error, run_cli, run_cli_json

    fw = framework("megatron-core", moe_dispatcher="hybridep", moe_a2a_overlap=True, grad_reduce_in_fp32=False)
    assert (fw.moe_dispatcher, fw.moe_a2a_overlap, fw.grad_bytes) == ("hybridep", True, 2)
    assert framework("megatron-core", grad_reduce_in_fp32=True).grad_bytes == 4
    args = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch",
            "64", "--seq-len", "1024", "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "16", "--micro-batch", "1",
            "--zero", "1", "--framework", "megatron-core"]
    plain = run_cli_json(*args)
    switched = run_cli_json(*args, "--moe-dispatcher", "hybridep", "--no-grad-reduce-in-fp32")
    work = Workload.create("qwen3-30b-a3b", "dgx-h100", 64, seq_length=1024, nodes=2, framework="megatron-core",
                           moe_dispatcher="hybridep", grad_reduce_in_fp32=False)
    model = CostModel(work)
    lay = Layout(dp=16, tp=1, pp=1, ep=16, micro_batch=1, global_batch=64, zero=1)
    from paraplan.planner.costmodel import default_stages

    expected = model.evaluate(lay, default_stages(model, lay)).iteration_time_s
    assert switched["iteration_time_s"] == pytest.approx(expected, rel=1e-6)
    assert switched["iteration_time_s"] != pytest.approx(plain["iteration_time_s"], rel=1e-6)
    p = run_cli(*args[:-2], "--moe-dispatcher", "hybridep")  # --framework paraplan: this executor
    assert_one_line_error(p, "--moe-dispatcher hybridep", "megatron-core")


def test_megatron_core_distributed_optimizer_bytes():
    """Megatron-LM docs/api-guide/dist_optimizer.md: bf16 parameters with fp32 gradients keep 6 + 12/d bytes per
    parameter under the distributed optimizer (ZeRO 1), 18 without; NeMo's performance runs reduce bf16 gradients
    (2 + 2 + 12/d); DeepSpeed's ZeRO accounting (2 + 2 + 12)."""
    fp32_grads = framework("megatron-core").replace(grad_bytes=4)
    for d in (1, 8, 64):
        lay = Layout(dp=d, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1 if d > 1 else 0)
        assert state_bytes(fp32_grads, lay).per_param == pytest.approx(6 + 12 / d if d > 1 else 18)
        assert state_bytes(framework("megatron-core"), lay).per_param == pytest.approx(4 + 12 / d if d > 1 else 16)
    per = state_bytes(framework("deepspeed"), Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1))
    assert per.per_param == pytest.approx(2 + 2 + 12 / 8)


def test_optimizer_states_in_16_bits():
    """Adam's state per parameter (--optimizer-states): K = 12 in fp32 (ZeRO Sec. 3.1: master weights, momentum,
    variance); Megatron-Core's precision-aware optimizer with bf16 exp_avg and exp_avg_sq keeps the fp32 master
    (4 + 2 + 2 = 8); Apex DistributedFusedAdam with dtype bf16 (NeMo 1.0's distributed_fused_adam) a bf16 copy of
    the weights and bf16 moments (2 + 2 + 2 = 6). ZeRO 1 shards it over dp; fp32 training has no master copy.
    The optimizer step moves each state byte twice (read and write), so it gets cheaper by twice the saving."""
    from paraplan.planner.dp_sync import optimizer_step

    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    for states, k, moments in (("fp32", 12, 8), ("bf16-moments", 8, 4), ("bf16", 6, 4)):
        fw = framework("megatron-core", optimizer_states=states)
        assert state_bytes(fw, lay).per_param == pytest.approx(2 + 2 + k / 8)
        assert state_bytes(fw, lay.replace(dtype="fp32")).per_param == pytest.approx(4 + 4 + moments / 8)
    work = lambda s: Workload.create(MODEL, "dgx-h100", 64, framework="megatron-core", optimizer_states=s)  # noqa: E731
    step = {s: optimizer_step(CostModel(work(s)), lay).params for s in ("fp32", "bf16")}
    hbm = 3350e9 * CostModel(work("fp32")).work.cluster.gpu.efficiency.memory_bound  # H100 SXM HBM3
    assert step["fp32"] - step["bf16"] == pytest.approx(2 * (12 - 6) / 8 / hbm, rel=1e-3)
    with pytest.raises(PlanError, match="--optimizer-states must be one of"):
        framework("megatron-core", optimizer_states="fp8")


def test_optimizer_states_from_the_cli_and_refused_by_this_executor():
    """simulate --optimizer-states bf16 halves the optimizer memory of a megatron-core ZeRO-0 run (12 -> 6 B per
    parameter); this executor keeps torch's fp32 Adam state and refuses the switch in one line."""
    from conftest import assert_one_line_error, run_cli, run_cli_json

    args = ["simulate", "--model", MODEL, "--cluster", "dgx-h100", "--global-batch", "64", "--dp", "8", "--tp",
            "1", "--pp", "1", "--micro-batch", "1"]
    plain = run_cli_json(*args, "--framework", "megatron-core")
    halved = run_cli_json(*args, "--framework", "megatron-core", "--optimizer-states", "bf16")
    assert halved["memory_gib"]["optimizer"] == pytest.approx(plain["memory_gib"]["optimizer"] / 2, rel=1e-9)
    assert halved["memory_gib"]["params"] == pytest.approx(plain["memory_gib"]["params"], rel=1e-9)
    assert_one_line_error(run_cli(*args, "--optimizer-states", "bf16"), "--optimizer-states bf16", "megatron-core")


def _items(model: CostModel, lay: Layout):
    return dp_exposures(model, lay, layout_placement(model.work.cluster, lay), 0.0, 0.0)


def test_zero1_as_distributed_optimizer_or_all_reduce_and_broadcast():
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    rs = _items(_model("megatron-core"), lay)
    assert [e.sync.kind for e in rs] == ["reduce_scatter", "all_gather"]
    ar = _items(_model("megatron-core", zero1="allreduce+broadcast"), lay)
    assert [e.sync.kind for e in ar] == ["all_reduce", "all_gather"]


def test_zero2_reduce_every_micro_batch_or_once():
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=2)  # 8 micro-batches per replica
    every = _items(_model("deepspeed"), lay)[0]
    once = _items(_model("deepspeed", zero23_every_micro_batch=False), lay)[0]
    assert (every.count, once.count) == (8, 1)
    assert every.sync.kind == once.sync.kind == "reduce_scatter"


def test_pipelined_dp_sync_after_the_flush_is_exposed():
    lay = Layout(dp=4, tp=1, pp=2, micro_batch=1, global_batch=64, zero=1)
    overlap = _items(_model("megatron-core"), lay)[0]
    end = _items(_model("megatron-core", dp_sync_pipelined="end"), lay)[0]
    assert overlap.hidden.window == 1.0 and end.hidden.window == 0.0


def test_overlap_param_gather_hides_the_weight_all_gather_under_the_forward():
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    on = _items(_model("megatron-core"), lay)[1]
    off = _items(_model("megatron-core", overlap_param_gather=False), lay)[1]
    assert on.hidden.fwd == 1.0 and on.floor == "bucket" and on.bucket_bytes == 40_000_000 * 2  # bf16 weights
    assert off.hidden.fwd == 0.0 and off.floor == "none"


def test_megatron_buckets_grow_with_the_data_parallel_size():
    """Megatron-Core's DistributedDataParallelConfig.bucket_size defaults to max(40M, 1M x dp) parameters
    (megatron/core/distributed/distributed_data_parallel.py: larger buckets keep the collectives of large
    data-parallel groups bandwidth-bound): the last bucket of the gradient reduce-scatter, which no backward
    hides, is that size; torch DDP's stacks keep 25 MiB."""
    for dp, params in ((8, 40_000_000), (64, 64_000_000), (512, 512_000_000)):
        lay = Layout(dp=dp, tp=1, pp=1, micro_batch=1, global_batch=1024, zero=1)
        assert _items(_model("megatron-core"), lay)[0].bucket_bytes == params * 2  # bf16 gradients
    lay = Layout(dp=64, tp=1, pp=1, micro_batch=1, global_batch=1024, zero=1)
    assert _items(_model("deepspeed"), lay)[0].bucket_bytes == DDP_BUCKET_BYTES


def test_overlap_p2p_leaves_only_the_latency_of_interleaved_sends():
    model = _model("megatron-core")
    cluster = model.work.cluster
    lay = Layout(dp=1, tp=1, pp=2, micro_batch=1, global_batch=64, schedule="interleaved-1f1b", virtual_stages=2)
    place = layout_placement(cluster, lay)
    nbytes = 64 * 2**20
    assert model.p2p_seconds(lay, nbytes, False, place) == pytest.approx(cluster.intra_node.latency_s)
    plain = lay.replace(schedule="1f1b", virtual_stages=1)
    full = cluster.intra_node.latency_s + nbytes / cluster.intra_node.bandwidth_Bps
    assert model.p2p_seconds(plain, nbytes, False, place) == pytest.approx(full)
    assert _model("paraplan").p2p_seconds(lay, nbytes, False, place) == pytest.approx(full)
    assert comm.p2p(nbytes, False, cluster, place.gpus_per_node_busy) == pytest.approx(full)


def test_elementwise_traffic_scales_only_the_memory_bound_part():
    """Fused kernels move a fraction of eager PyTorch's element-wise traffic; GEMMs are unchanged: the time is
    affine in the fraction, GEMMs at 0 and eager at 1."""
    work = Workload.create(MODEL, "dgx-h100", 64)
    layer, gpu = work.profile("bf16").layers[1], work.cluster.gpu
    t = {f: estimate_pass_times(layer, 2, 1, False, gpu, "bf16", "flash", f) for f in (0.0, 0.5, 1.0)}
    assert t[0.5].fwd == pytest.approx((t[0.0].fwd + t[1.0].fwd) / 2)
    assert t[0.5].bwd_weight == t[1.0].bwd_weight  # weight-gradient GEMMs only
    assert t[0.0].fwd < t[1.0].fwd


def test_grad_bytes_is_the_reduced_message():
    """A ZeRO-1 reduce-scatter carries grad_bytes per element of the rank's gradients."""
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    for fw, elem in (("megatron-deepspeed", 4), ("megatron-core", 2)):
        item = _items(_model(fw), lay)[0]
        assert item.sync.per_param == elem


def test_megatron_stacks_cut_equal_layer_counts_per_chunk_and_this_executor_balances():
    """Megatron-LM's get_num_layers_to_build: num_layers / (pp·vp) transformer layers per model chunk, the
    embedding with the first chunk and the head with the last — what simulate prices for a Megatron stack when
    the stages are not given; this executor's own split balances the stages' time instead."""
    from paraplan.planner.costmodel import default_stages, framework_stages

    model = _model("megatron-core")
    blocks = len(model.work.profile("bf16").layers)
    layers = blocks - 2
    lay = Layout(dp=2, tp=1, pp=2, micro_batch=1, global_batch=64, schedule="interleaved-1f1b", virtual_stages=2)
    assert layers % 4 == 0
    stages = framework_stages(model, lay)
    per = layers // 4
    assert stages[0] == [0, *range(1, 1 + per)]
    assert stages[1] == list(range(1 + per, 1 + 2 * per))
    assert stages[-1] == [*range(1 + 3 * per, 1 + 4 * per), blocks - 1]
    executor = _model("paraplan")
    assert framework_stages(executor, lay) == default_stages(executor, lay)
    odd = lay.replace(pp=3, virtual_stages=1, schedule="1f1b", dp=1)
    assert layers % 3  # layers that do not divide: the balanced split
    assert framework_stages(model, odd) == default_stages(model, odd)


# The stack a prediction was priced for, named where the user reads it (planner/framework.py: describe).
STACK = ["--model", "gpt-tiny", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "16",
         "--framework", "megatron-core", "--optimizer-states", "bf16-moments"]
PRICED = "megatron-core with --optimizer-states bf16-moments"


def test_switch_flags_name_only_what_differs_from_the_profile():
    from paraplan.planner.framework import describe, switch_flags

    assert switch_flags(framework("megatron-core")) == []
    assert describe(framework("paraplan")) == "paraplan (the profile's defaults)"
    fw = framework("megatron-core", attention="unfused", overlap_dp=False, optimizer_states="bf16-moments",
                   grad_reduce_in_fp32=True, overlap_tp=True)  # overlap_tp is megatron-core's own: not named
    assert switch_flags(fw) == ["--attention unfused", "--no-overlap-dp", "--grad-reduce-in-fp32",
                                "--optimizer-states bf16-moments"]
    routed = framework("megatron-core", moe_routing="consecutive", moe_dispatcher="hybridep")
    assert switch_flags(routed) == ["--moe-dispatcher hybridep", "--moe-routing consecutive"]
    assert switch_flags(framework("nemo-automodel", moe_dispatcher="alltoall")) == ["--moe-dispatcher alltoall"]
    with pytest.raises(PlanError, match="--moe-routing must be one of uniform, consecutive"):
        framework("megatron-core", moe_routing="sorted")
    with pytest.raises(PlanError, match="the alltoall dispatcher sends one copy per routed expert"):
        framework("nemo-automodel", moe_routing="consecutive", moe_dispatcher="alltoall")  # it would change nothing


def test_a_plan_records_the_routing_it_was_priced_with(tmp_path):
    """plan.json keeps the switches that made its stack (framework_switches), --moe-routing among them, and the
    plan read back prices with them."""
    from conftest import run_cli_json
    from paraplan.planner.plan import Plan

    out = tmp_path / "p"
    run_cli_json("plan", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
                 "--seq-len", "1024", "--framework", "nemo-automodel", "--moe-routing", "consecutive", "--out",
                 str(out), "--no-charts", "--top", "1")
    plan = Plan.read(str(out / "plan.json"))
    assert plan.framework_switches == {"moe_routing": "consecutive"}
    assert plan.stack().moe_routing == "consecutive"


def test_plan_report_names_the_framework_and_its_switches(tmp_path, capsys):
    from paraplan.cli import main

    out = tmp_path / "plan"
    assert main(["plan", *STACK, "--no-charts", "--out", str(out), "--json"]) == 0
    asked = (out / "report.md").read_text().split("## What was asked")[1].split("## ")[0]
    assert f"- priced for framework {PRICED}" in asked


def test_compare_table_names_the_framework_and_its_switches(tmp_path, capsys):
    from paraplan.cli import main

    assert main(["compare", *STACK, "--strategy", "dp=8", "--no-optimum", "--out", str(tmp_path), "--json"]) == 0
    assert f"Priced for framework {PRICED}." in (tmp_path / "comparison.md").read_text()


def test_validate_says_when_it_measures_this_executor_against_another_stack(tmp_path, monkeypatch, capsys):
    """validate runs this executor's stack: predictions priced for another (--framework megatron-core) carry a note
    saying so, as execute --dry-run's does, on stdout, in the report and in the JSON's notes; none for paraplan."""
    import json
    import os

    from paraplan.cli import main
    from paraplan.commands import validate as command
    from paraplan.executor.validate import Row
    from paraplan.planner.costmodel import default_stages

    def fake_validate(work, gpus, strategies, steps, top, out, progress=None, measure_blocks=True, passes=2):
        os.makedirs(out, exist_ok=True)  # what validate's runs write, none run here
        model, lay = CostModel(work), Layout(dp=2, tp=1, pp=1, micro_batch=8, global_batch=16)
        row = Row("dp=2", "strategy", lay, prediction=model.evaluate(lay, default_stages(model, lay)))
        row.measured_s = row.predicted_s * 1.1
        return [row]

    monkeypatch.setattr(command, "validate", fake_validate)
    args = ["validate", *STACK, "--gpus", "2", "--no-calibrate", "--no-block-times"]
    assert main([*args, "--out", str(tmp_path / "a"), "--json"]) == 0
    notes = [n for n in json.loads(capsys.readouterr().out)["notes"] if "this executor's stack" in n]
    assert len(notes) == 1 and f"priced for framework {PRICED}" in notes[0] and "--framework paraplan" in notes[0]
    assert notes[0] in (tmp_path / "a" / "validation.md").read_text()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "note: the predictions were priced for framework megatron-core" in printed
    plain = [a for a in args if a not in ("--framework", "megatron-core", "--optimizer-states", "bf16-moments")]
    assert main([*plain, "--out", str(tmp_path / "c"), "--json"]) == 0
    assert not any("this executor's stack" in n for n in json.loads(capsys.readouterr().out)["notes"])


def test_bigscience_fused_softmax_check_swapped_its_arguments():
    """bigscience's Megatron-DeepSpeed (megatron/model/fused_softmax.py from 9f5f5d4c, 2021-10-21, to 1cb76a64,
    2022-03-06) sized the kernel's batches per block from the heads per rank: 128 threads per block, warps of
    min(P, 32) threads for P the power of two at or above the heads, 2 batches per warp where P <= 128. The BLOOM
    chronicles (chronicles-prequel.md line 743) say "NHEADS=108 breaks constraints for invoking optimized fused
    softmax kernel": 108 heads over tp 4 (27 per rank) fall back at micro-batches 1, 2 and 4."""
    from paraplan.planner.compute import softmax_falls_back

    rule = "bigscience-2021-10"
    assert softmax_falls_back(rule, 8, 1, 2048)  # 8 batches, 16 warps of 8 x 2 = 32 per block
    assert not softmax_falls_back(rule, 8, 4, 2048)  # 32
    assert not softmax_falls_back(rule, 16, 1, 2048)  # 8 warps of 16 x 2 = 16 per block
    assert softmax_falls_back(rule, 12, 2, 2048) and not softmax_falls_back(rule, 12, 4, 2048)  # 24, 48 vs 16
    assert not softmax_falls_back(rule, 32, 1, 2048)  # 4 warps of 32 x 2 = 8
    assert all(softmax_falls_back(rule, 27, b, 2048) for b in (1, 2, 4))
    assert softmax_falls_back(rule, 16, 1, 4096)  # the kernel's sequences: 16 < sq <= 2048
    assert softmax_falls_back(rule, 16, 1, 2046)  # and keys a multiple of 4
    assert softmax_falls_back(rule, 16, 1, 2048, "fp32")  # 16-bit inputs only
    assert not any(softmax_falls_back("always", n, b, 2048) for n in (8, 27) for b in (1, 2))


def test_softmax_fallback_moves_the_scores_as_pytorch_does():
    """PyTorch's fp32 softmax path moves the 16-bit score matrix S 18 times forward and 20 times backward where the
    fused kernel moves it 2 and 3 times (compute.SOFTMAX_TORCH_TRAFFIC: float, scale, masked_fill, softmax, half),
    and keeps its fp32 output (S more) for the backward; GEMMs are the same."""
    from paraplan.planner.memory import layer_activation_bytes

    work = Workload.create(MODEL, "dgx-a100-80gb", 64, framework="megatron-2021")
    layer, gpu = work.profile("fp16").layers[1], work.cluster.gpu
    hbm = gpu.hbm_GBps * 1e9 * gpu.efficiency.memory_bound
    b, tp = 2, 2
    scores = layer.fwd_ops.core_scores_bytes * b / tp
    fused = estimate_pass_times(layer, b, tp, False, gpu, "fp16", "unfused")
    torch = estimate_pass_times(layer, b, tp, False, gpu, "fp16", "unfused", softmax_fallback=True)
    assert torch.fwd - fused.fwd == pytest.approx((18 - 2) * scores / hbm)
    assert torch.bwd_input - fused.bwd_input == pytest.approx((20 - 3) * scores / hbm)
    assert torch.bwd_weight == fused.bwd_weight
    kept = {f: layer_activation_bytes(layer, b, tp, False, "none", "unfused", softmax_fallback=f) for f in (0, 1)}
    assert kept[1] - kept[0] == pytest.approx(scores)
    assert layer_activation_bytes(layer, b, tp, False, "full", "unfused", softmax_fallback=True) == \
        layer_activation_bytes(layer, b, tp, False, "full", "unfused")


def test_fused_softmax_switch_from_the_cli_and_refused_with_flash_attention():
    """--fused-softmax bigscience-2021-10 prices a layout whose heads per rank the fork's check turned down slower,
    one it accepted the same; a flash kernel has no softmax kernel of its own to choose (one line)."""
    from conftest import assert_one_line_error, run_cli, run_cli_json

    args = ["simulate", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--pp", "1",
            "--zero", "1", "--framework", "megatron-deepspeed", "--recompute", "full"]
    heads = Workload.create(MODEL, "dgx-h100", 64).spec.num_attention_heads
    for tp, mb in ((heads // 8, 1), (heads // 8, 4)):  # 8 heads per rank: 8 batches fall back, 32 do not
        layout = ["--dp", str(8 // tp if tp <= 8 else 1), "--tp", str(tp), "--micro-batch", str(mb)]
        plain = run_cli_json(*args, *layout)
        old = run_cli_json(*args, *layout, "--fused-softmax", "bigscience-2021-10")
        if mb == 1:
            assert old["iteration_time_s"] > plain["iteration_time_s"]
        else:
            assert old["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-9)
    p = run_cli("simulate", "--model", MODEL, "--cluster", "dgx-h100", "--global-batch", "64", "--dp", "8", "--tp",
                "1", "--pp", "1", "--micro-batch", "1", "--framework", "megatron-core", "--fused-softmax",
                "bigscience-2021-10")
    assert_one_line_error(p, "--fused-softmax", "unfused")


def test_deepspeed_pipeline_sends_a_tensor_parallel_shard():
    """DeepSpeed's pipeline engine (deepspeed/runtime/pipe/engine.py, v0.6.0: is_pipe_partitioned =
    is_grad_partitioned = is_model_parallel) sends 1/t of each boundary per tensor-parallel rank and all-gathers it
    on arrival: Megatron-DeepSpeed's sends carry what Megatron's scatter/gather sends do."""
    assert framework("megatron-deepspeed").p2p_scatter_gather
    lay = Layout(dp=1, tp=4, pp=2, micro_batch=1, global_batch=8, zero=0)
    sent = {fw: CostModel(Workload.create(MODEL, "dgx-a100-80gb", 8, framework=fw)).stage_costs(lay, [[0, 1, 2],
                                                                                                    [3, 4, 5]])
            for fw in ("megatron-deepspeed", "deepspeed")}
    assert sent["megatron-deepspeed"][0].p2p_bytes == pytest.approx(sent["deepspeed"][0].p2p_bytes / 4)


def test_a_plan_priced_with_a_switch_of_the_unfused_attention_reads_back(tmp_path):
    """A plan written with --attention unfused --fused-softmax ... on a stack whose own kernel is flash is checked
    with its attention kernel when it is read again: it loads, prices as written, and its Megatron export says
    what Megatron-LM runs instead."""
    from conftest import run_cli, run_cli_json
    from paraplan.planner.api import predict_plan
    from paraplan.planner.plan import Plan

    plan = tmp_path / "p.json"
    args = ["--model", MODEL, "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--framework", "megatron-core",
            "--attention", "unfused", "--fused-softmax", "bigscience-2021-10"]
    first = run_cli_json("simulate", *args, "--dp", "4", "--tp", "2", "--pp", "1", "--micro-batch", "1",
                         "--write-plan", str(plan))
    loaded = Plan.read(str(plan))
    assert loaded.framework_switches == {"fused_softmax": "bigscience-2021-10"}
    assert predict_plan(loaded).iteration_time_s == pytest.approx(first["iteration_time_s"], rel=1e-9)
    p = run_cli("export", "--plan", str(plan), "--to", "megatron")
    assert p.returncode == 0, p.stderr
    assert "--fused-softmax bigscience-2021-10" in p.stdout + p.stderr


def test_nemo_automodel_syncs_fsdp2_gradients_once_per_step():
    """NeMo Automodel (moe/fsdp_mixin.py; torch pipelining's backward_maybe_with_nosync) turns FSDP2's gradient sync
    off until the step's last backward: one reduce-scatter per step — under the last micro-batch's backward
    without a pipeline, exposed after the flush with one — where this executor reduce-scatters every micro-batch.
    FSDP2 then keeps fp32 unsharded sums (to_accumulated_grad_if_needed: 4 B) beside the 16-bit gradient of the
    pass (2 B), as ZB-V's pipeline does."""
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=2)  # 8 micro-batches per replica
    ours = [e for e in _items(_model("paraplan"), lay) if e.sync.kind == "reduce_scatter"]
    auto = [e for e in _items(_model("nemo-automodel"), lay) if e.sync.kind == "reduce_scatter"]
    assert [e.count for e in ours] == [8] and [e.count for e in auto] == [1]
    assert auto[0].hidden.bwd == 1.0  # FSDP2's post-backward hooks of the last backward
    piped = [e for e in _items(_model("nemo-automodel"), lay.replace(dp=4, pp=2)) if e.sync.kind == "reduce_scatter"]
    assert [e.count for e in piped] == [1] and piped[0].hidden.bwd == 0.0
    assert state_bytes(framework("paraplan"), lay).grads == pytest.approx(4 / 8)
    assert state_bytes(framework("nemo-automodel"), lay).grads == pytest.approx(4 + 2)


def test_nemo_automodel_keeps_bf16_weights_and_moments():
    """Automodel builds its MoE models in bf16 (initialize_weights ends in self.to(bfloat16)) and FSDP2 shards those
    weights; torch's Adam keeps its two moments in the weights' dtype: per parameter under ZeRO 2 over d ranks,
    2/d weight shard + 2 gathered for the step + 4/d moments (this executor: 4/d + 2 + 8/d); ZeRO 0 replicated, no
    copy to cast (2 + 4). Adam's step reads and writes weights and moments and reads the fp32 gradient:
    2 x (2 + 4) + 4 = 16 B (this executor: 2 x 12 + 4 = 28)."""
    from paraplan.planner.dp_sync import adam_bytes_per_param

    auto, ours = framework("nemo-automodel"), framework("paraplan")
    for d in (2, 8, 64):
        lay = Layout(dp=d, tp=1, pp=1, micro_batch=1, global_batch=64, zero=2)
        a, o = state_bytes(auto, lay), state_bytes(ours, lay)
        assert (a.weights, a.optimizer) == (pytest.approx(2 / d + 2), pytest.approx(4 / d))
        assert (o.weights, o.optimizer) == (pytest.approx(4 / d + 2), pytest.approx(8 / d))
    lone = state_bytes(auto, Layout(dp=1, tp=1, pp=1, micro_batch=1, global_batch=64, zero=0))
    assert (lone.weights, lone.optimizer) == (2.0, 4.0)
    assert (adam_bytes_per_param(auto), adam_bytes_per_param(ours)) == (16, 28)


def test_nemo_automodel_dispatchers_and_refusals():
    """Automodel dispatches with DeepEP (its benchmark configs: dispatcher deepep / hybridep, priced as hybridep)
    or torch's all-to-all; it has no token dropping or all-to-all overlap, and this executor has no DeepEP."""
    assert framework("nemo-automodel").moe_dispatcher == "hybridep"
    assert framework("nemo-automodel", moe_dispatcher="alltoall").moe_dispatcher == "alltoall"
    for switches in (dict(moe_a2a_overlap=True), dict(moe_capacity_factor=1.0), dict(optimizer_states="fp32")):
        with pytest.raises(PlanError, match="nemo-automodel stack does not run it"):
            framework("nemo-automodel", **switches)
    with pytest.raises(PlanError, match="--moe-dispatcher hybridep: the torchtitan stack"):
        framework("torchtitan", moe_dispatcher="hybridep")


def test_mixture_of_experts_switches_on_a_dense_model_are_refused():
    """A dense model has no token dispatch: an MoE switch would be recorded in its plan and change nothing (then
    warned about by exports as a setting the target runs its own way)."""
    from conftest import assert_one_line_error, run_cli

    p = run_cli("simulate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
                "--dp", "8", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--zero", "3", "--framework",
                "nemo-automodel", "--moe-routing", "consecutive")
    assert_one_line_error(p, "--moe-routing: llama2-7b has no experts")


def test_shared_expert_overlap_needs_shared_experts():
    """Megatron-Core's moe_shared_expert_overlap runs the shared experts beside the dispatcher and asserts that
    there are shared experts (moe_shared_expert_intermediate_size): on Mixtral, which has none, the switch would
    change nothing, so it is refused in one line; on DeepSeek-V3 (one shared expert) it is taken."""
    from conftest import assert_one_line_error, run_cli

    base = ("simulate", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64", "--dp", "8", "--tp", "1",
            "--pp", "1", "--ep", "8", "--micro-batch", "1", "--zero", "1", "--framework", "megatron-core",
            "--moe-shared-expert-overlap")
    p = run_cli(*base, "--model", "mixtral-8x7b")
    assert_one_line_error(p, "--moe-shared-expert-overlap: mixtral-8x7b has no shared experts")
    with pytest.raises(PlanError, match="qwen3-30b-a3b has no shared experts"):
        Workload.create("qwen3-30b-a3b", "dgx-h100", 64, framework="megatron-core", moe_shared_expert_overlap=True)
    ds = Workload.create("deepseek-v3", "dgx-h100", 64, framework="megatron-core", moe_shared_expert_overlap=True)
    assert ds.framework.moe_shared_expert_overlap


def test_each_stack_runs_only_its_own_schedules_and_zero_stages():
    """Megatron-LM pipelines with 1F1B and interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py) and had
    no ZeRO-2/3 in 2021-22; DeepSpeed's pipeline engine runs 1F1B (TrainSchedule); Megatron-Core requires
    sequence parallelism under expert with tensor parallelism (model_parallel_config.py). The search enumerates
    only what the stack runs; an explicit layout it does not run is refused, naming what it runs."""
    from paraplan.planner.costmodel import validate_layout
    from paraplan.planner.errors import InvalidLayout
    from paraplan.planner.search import enumerate_layouts

    expected = {"paraplan": {"gpipe", "1f1b", "interleaved-1f1b", "zb-v"}, "torchtitan": {"gpipe", "1f1b",
                "interleaved-1f1b", "zb-v"}, "megatron-2021": {"1f1b", "interleaved-1f1b"},
                "megatron-core": {"1f1b", "interleaved-1f1b"}, "megatron-deepspeed": {"1f1b"}, "deepspeed": {"1f1b"}}
    for name, schedules in expected.items():
        work = Workload.create(MODEL, "dgx-a100-80gb", 64, framework=name)
        layouts = enumerate_layouts(work, 16, "bf16")
        assert {x.schedule for x in layouts if x.pp > 1} == schedules, name
        assert {x.zero for x in layouts if x.dp > 1} == set(work.framework.zero_stages), name
    assert FRAMEWORKS["megatron-2021"].zero_stages == (0, 1)
    core = CostModel(Workload.create(MODEL, "dgx-a100-80gb", 64, framework="megatron-core"))
    lay = Layout(dp=4, tp=2, pp=2, micro_batch=1, global_batch=64, schedule="zb-v", virtual_stages=2)
    with pytest.raises(InvalidLayout, match="megatron-core stack runs the 1f1b or interleaved-1f1b pipeline "
                                            "schedules, not zb-v"):
        validate_layout(core, lay)
    old = CostModel(Workload.create(MODEL, "dgx-a100-80gb", 64, framework="megatron-2021"))
    with pytest.raises(InvalidLayout, match="runs ZeRO 0 or 1 over data parallelism, not 3"):
        validate_layout(old, lay.replace(schedule="1f1b", virtual_stages=1, zero=3))
    moe = CostModel(Workload.create("mixtral-tiny", "dgx-h100", 16, framework="megatron-core"))
    expert = Layout(dp=4, tp=2, pp=1, ep=4, micro_batch=1, global_batch=16, zero=1)
    with pytest.raises(InvalidLayout, match=r"expert parallelism \(ep 4\) beside tensor parallelism \(tp 2\) only with "
                                            "sequence parallelism"):
        validate_layout(moe, expert)
    validate_layout(moe, expert.replace(sequence_parallel=True))
    assert not any(x.ep > 1 and x.tp > 1 and not x.sequence_parallel
                   for x in enumerate_layouts(moe.work, 8, "bf16") if _valid(moe, x))


def _valid(model, lay) -> bool:
    from paraplan.planner.costmodel import validate_layout
    from paraplan.planner.errors import InvalidLayout

    try:
        validate_layout(model, lay)
    except InvalidLayout:
        return False
    return True


def test_zero3_gathers_and_reduce_scatters_share_the_backward_window(write):
    """ZeRO-3 (this executor's FSDP2, and DeepSpeed's every-micro-batch reduce-scatter): each backward gathers the
    next weights and reduce-scatters the gradients over one network, so one backward's compute cannot hide each of
    them whole. On 2 nodes of 4 GPUs joined at 1 GB/s the collectives alone, back to back, take longer than the
    compute, and the step can be no shorter than them (it was priced below: 26.1 s against 27.0 s of transfers)."""
    path = write("slow.yaml", "name: slow\ngpu: a100-80gb\nnodes: 2\ngpus_per_node: 4\n"
                              "intra_node: {bandwidth_GBps: 100, latency_us: 2}\n"
                              "inter_node: {bandwidth_GBps: 1, latency_us: 10}\n")
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=16, zero=3)  # 2 micro-batches per replica
    for fw in ("paraplan", "deepspeed"):
        model = CostModel(Workload.create("llama2-7b", path, 16, framework=fw))
        pred = model.evaluate(lay, default_stages(model, lay))
        transfers = pred.dp_sync_of()[0]["unhidden_s"]
        assert transfers > pred.time_s["compute"]
        assert pred.iteration_time_s >= transfers, fw


def test_torchtitan_prices_only_what_torchtitan_runs():
    """torchtitan shards norms over the sequence whenever tp > 1 and takes expert tensor parallelism of 1 or tp
    (its parallelize.py; the export refused the rest after the planner had priced it: QA round 8): such layouts are
    invalid under its profile, named so, and still priced for this executor."""
    from paraplan.planner.costmodel import validate_layout
    from paraplan.planner.errors import InvalidLayout

    titan = CostModel(Workload.create("mixtral-8x7b", "dgx-h100", 256, nodes=4, framework="torchtitan"))
    ours = CostModel(Workload.create("mixtral-8x7b", "dgx-h100", 256, nodes=4))
    base = Layout(dp=8, tp=4, pp=1, micro_batch=1, global_batch=256, ep=8, zero=1, sequence_parallel=True)
    validate_layout(titan, base)
    validate_layout(titan, base.replace(etp=4))
    for lay, why in ((base.replace(sequence_parallel=False), "with sequence parallelism always"),
                     (base.replace(etp=2), "expert tensor parallelism is 1 or tp (4), not 2")):
        with pytest.raises(InvalidLayout, match=__import__("re").escape(why)):
            validate_layout(titan, lay)
        validate_layout(ours, lay)
    # `simulate --framework torchtitan --tp 2` without --sequence-parallel prices (and writes) what torchtitan runs
    from conftest import run_cli_json

    out = run_cli_json("simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "64", "--dp",
                       "2", "--tp", "2", "--pp", "1", "--micro-batch", "1", "--framework", "torchtitan")
    assert out["plan"]["sequence_parallel"] is True and any("sequence parallelism always" in n for n in out["notes"])


def _block(model: CostModel, lay: Layout, mode: str):
    """Layer 1's (a transformer layer's) block cost under ``mode``."""
    return model.block_cost(1, lay.replace(recompute=mode), layout_placement(model.work.cluster, lay), mode)


@pytest.mark.parametrize("tp", [1, 2])
def test_torchtitan_selective_is_its_per_op_checkpoint(tp):
    """torchtitan's selective mode (selective_ac_option "op"; torchtitan parallelize_llama.py's _custom_policy) saves
    the outputs of aten.mm, SDPA and reduce_scatter_tensor except every second mm of a block, and reruns the rest.
    Its Llama block's mms run wq, wk, wv, wo, w1, w3, w2: it keeps the input, wq, wv, w1 and w2 outputs, SDPA's
    output and fp32 log-sum-exp (and under SP the two reduce-scatter outputs), and reruns wk, wo and w3 with all
    the element-wise work. Expected bytes and FLOPs from that policy on llama-small's shape (h 1024, 16 heads of
    64, 8 K/V heads, FFN 2816); Megatron-Core's selective (the attention core) is unchanged beside it."""
    titan, mcore = _model("torchtitan"), _model("megatron-core")
    lay = Layout(dp=64 // (8 * tp), tp=tp, pp=8, micro_batch=1, global_batch=64, sequence_parallel=tp > 1, zero=1)
    h, q, kv, f, heads, s = 1024, 1024, 512, 2816, 16, 1024
    shard = tp if tp > 1 else 1
    per_token = 2 * (h / shard + (q + kv + f) / tp + h + q / tp + (2 * h / tp if tp > 1 else 0)) + 4 * heads / tp
    sel = _block(titan, lay, "selective")
    assert sel.act_bytes == pytest.approx(per_token * s)
    assert sel.recompute_flops == pytest.approx(2 * s * (h * kv + q * h + h * f))  # wk, wo, w3, the whole group's
    none, full = _block(titan, lay, "none"), _block(titan, lay, "full")
    assert full.act_bytes < sel.act_bytes < none.act_bytes
    assert 0 < sel.recompute < full.recompute
    assert sel.act_working == pytest.approx(none.act_bytes - sel.act_bytes)  # what the rerun rebuilds, in backward
    core = _block(mcore, lay, "selective")
    assert core.recompute_flops < sel.recompute_flops and core.act_bytes != pytest.approx(sel.act_bytes)
    if tp > 1:  # the sequence all-gathers wk's and w3's inputs come from run again; the reduce-scatters' outputs stay
        from paraplan.planner.costmodel import TP_KINDS

        gather, scatter = TP_KINDS.index("all_gather"), TP_KINDS.index("reduce_scatter")
        assert sel.tp_traffic[gather] == pytest.approx(none.tp_traffic[gather] + 2 * s * h * 2)  # two s x h gathers
        assert sel.tp_traffic[scatter] == pytest.approx(none.tp_traffic[scatter])


def test_torchtitan_per_op_checkpoint_only_where_it_describes_the_block():
    """MoE blocks (grouped expert GEMMs are not aten.mm) and FP8 (torchao's _scaled_mm) keep the attention-core
    pricing of selective under torchtitan: the same block cost as the executor's profile would give there."""
    from paraplan.planner import op_sac

    titan = CostModel(Workload.create("mixtral-8x7b", "dgx-h100", 256, nodes=4, framework="torchtitan"))
    layer = titan.work.profile("bf16").layers[1]
    assert not op_sac.applies(titan.work.framework, titan.work.spec, layer, "bf16", moe_layer=True)
    dense = _model("torchtitan")
    layer = dense.work.profile("bf16").layers[1]
    assert op_sac.applies(dense.work.framework, dense.work.spec, layer, "bf16", moe_layer=False)
    assert not op_sac.applies(dense.work.framework, dense.work.spec, layer, "fp8", moe_layer=False)
    assert not op_sac.applies(_model("megatron-core").work.framework, dense.work.spec, layer, "bf16", False)


def test_per_op_checkpoint_is_what_torchtitans_own_block_keeps_and_reruns():
    """The trace, not the formula's own reading of the policy: torchtitan's llama3 TransformerBlock under its own
    _apply_op_sac and llama3 save list, traced on CPU (tests/torchtitan_op_sac_trace.py). What it keeps after its
    forward is op_sac.saved_bytes less the block's input (which existed before the trace), to the byte; its backward
    runs op_sac.rerun_gemm_flops more matmul FLOPs than without checkpointing, exactly."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from paraplan.models import spec_from_mapping
    from paraplan.planner import op_sac

    p = subprocess.run([sys.executable, str(ROOT / "tests" / "torchtitan_op_sac_trace.py")], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    spec = spec_from_mapping({"name": "titan-block", "family": "llama", "num_layers": 2, "hidden_size": 256,
                              "num_attention_heads": 8, "num_kv_heads": 4, "ffn_hidden_size": got["ffn"],
                              "vocab_size": 1000, "seq_length": 64}, "titan-block")
    tokens = got["tokens"]
    assert got["kept_op_sac"] == op_sac.saved_bytes(spec, tokens, 1, False, 4) - tokens * 256 * 4
    assert got["backward_flops_op_sac"] - got["backward_flops_none"] == sum(op_sac.rerun_gemm_flops(spec, tokens))
    assert got["kept_op_sac"] < got["kept_none"] / 2


@pytest.mark.parametrize("fw", ["paraplan", "torchtitan"])
def test_fsdp2_copies_each_gather_out_on_the_compute_stream(fw):
    """FSDP2 copies every all-gather's output into the unsharded weights on the compute stream (torch
    fsdp/_fully_shard: wait_for_unshard -> foreach_all_gather_copy_out -> split_with_sizes_copy): per gather the
    rank's 16-bit weights read and written once, 2 x 2 bytes a parameter, at the GPU's memory-bound rate, hidden by
    nothing. ZeRO-3 gathers before each micro-batch's forward and backward (2m), ZeRO-2 once a step; Megatron's
    distributed optimizer (ZeRO-1, no FSDP2) copies nothing of the kind."""
    from paraplan.planner.concerns import RankLoad

    model = _model(fw)
    gpu = model.work.cluster.gpu
    rate = gpu.hbm_GBps * 1e9 * gpu.efficiency.memory_bound
    load = RankLoad(params=1e9, fwd=1.0, bwd=2.0, window=0.5)
    for zero, gathers in ((3, 2 * 8), (2, 1)):
        lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=zero)  # 8 micro-batches per replica
        copies = [e for e in _items(model, lay) if e.sync.kind == "copy"]
        assert len(copies) == 1 and copies[0].count == gathers
        assert copies[0].seconds(load) == pytest.approx(gathers * 1e9 * 2 * 2 / rate)
        assert copies[0].traffic(load) == []  # GPU memory, not the network
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=1)
    assert not [e for e in _items(_model("megatron-core"), lay) if e.sync.kind == "copy"]


def test_adams_step_temporaries_by_stack_and_layout():
    """What Adam's step allocates beside the states (memory.StateBytes.step_largest / step_all, per element of the
    rank's largest tensor / per parameter). torch's one-tensor AdamW (this executor over DTensors: FSDP2 wraps
    every 16-bit layout) computes exp_avg_sq.sqrt() / bias_correction2_sqrt, two temporaries of the tensor in the
    moments' dtype, 2 x 4 B per element of its ZeRO shard; the foreach implementation (plain tensors: ZeRO-1's
    views, a single fp32 rank) one copy of every second moment, 4 B per parameter of the rank's share; torchtitan's
    fused AdamW none; NeMo Automodel's foreach torch Adam over bf16 moments, 2 B per parameter of its shard."""
    lay = Layout(dp=1, tp=2, pp=1, micro_batch=1, global_batch=8)
    paraplan = state_bytes(FRAMEWORKS["paraplan"], lay)
    assert (paraplan.step_largest, paraplan.step_all) == (2 * 4, 0.0)
    sharded = state_bytes(FRAMEWORKS["paraplan"], lay.replace(dp=4, tp=1, zero=3))
    assert (sharded.step_largest, sharded.step_all) == (2 * 4 / 4, 0.0)
    zero1 = state_bytes(FRAMEWORKS["paraplan"], lay.replace(dp=4, tp=1, zero=1))
    assert (zero1.step_largest, zero1.step_all) == (0.0, 4 / 4)
    alone = state_bytes(FRAMEWORKS["paraplan"], lay.replace(tp=1, pp=2, dtype="fp32"))
    assert (alone.step_largest, alone.step_all) == (0.0, 4.0)
    titan = state_bytes(FRAMEWORKS["torchtitan"], lay)
    assert (titan.step_largest, titan.step_all) == (0.0, 0.0)
    automodel = state_bytes(FRAMEWORKS["nemo-automodel"], lay.replace(dp=4, zero=2))
    assert (automodel.step_largest, automodel.step_all) == (0.0, 2 / 4)
    # the step's moment: master weights and reduced gradients (ZeRO-3's fp32 shards), the moments, the temporaries
    got = step_bytes(sharded, params=1000.0, largest_param=100.0)
    assert got == {"params": 1000 * 4 / 4, "grads": 1000 * 4 / 4, "optimizer": 1000 * 8 / 4 + 100 * 2 * 4 / 4,
                   "activations": 0.0}


def test_optimizer_implementation_is_a_switch_of_the_fsdp2_stacks(tmp_path):
    """--optimizer-implementation (torchtitan's [optimizer] implementation names) sets what Adam's step allocates
    under a stack that picks it: torchtitan's default fused AdamW nothing, its foreach a copy of every second moment
    (4 B per parameter of the rank's ZeRO shard), its for-loop two temporaries of the largest tensor. The plan
    records it, and this executor (whose AdamW is its own) and Megatron's fused optimizer refuse it in one line."""
    from conftest import assert_one_line_error, run_cli, run_cli_json

    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=64, zero=3)
    foreach = framework("torchtitan", optimizer_implementation="foreach")
    assert (state_bytes(foreach, lay).step_all, state_bytes(foreach, lay).step_largest) == (4 / 8, 0.0)
    loop = framework("torchtitan", optimizer_implementation="for-loop")
    assert (state_bytes(loop, lay).step_all, state_bytes(loop, lay).step_largest) == (0.0, 8 / 8)
    from paraplan.planner.framework import switch_flags

    assert switch_flags(foreach) == ["--optimizer-implementation foreach"]
    args = ["simulate", "--model", "llama-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "8", "--tp",
            "1", "--pp", "1", "--micro-batch", "1", "--zero", "3"]
    plan = str(tmp_path / "plan.json")
    run_cli_json(*args, "--framework", "torchtitan", "--optimizer-implementation", "foreach", "--write-plan", plan)
    assert json.loads(open(plan).read())["framework_switches"] == {"optimizer_implementation": "foreach"}
    from paraplan.models import load_model_spec
    from paraplan.planner.exports.torchtitan import job_config
    from paraplan.planner.plan import Plan

    assert job_config(Plan.read(plan), load_model_spec("llama-tiny"))[0]["optimizer"] == {"implementation": "foreach"}
    exported = run_cli_json("export", "--plan", plan, "--to", "torchtitan")  # carried: no "runs its own" note
    assert not any("optimizer_implementation" in note for note in exported["notes"])
    for framework_name, fragment in (("paraplan", "the paraplan stack runs torch's AdamW as it builds it"),
                                     ("megatron-core", "the megatron-core stack runs a fused Adam")):
        p = run_cli(*args, "--framework", framework_name, "--optimizer-implementation", "foreach")
        assert_one_line_error(p, "--optimizer-implementation foreach", fragment)

"""`paraplan simulate` as users run it: the JSON contract, plans, timelines and one-line refusals."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, run_cli, run_cli_json

SIM_KEYS = {"num_parameters", "iteration_time_s", "tokens_per_s", "samples_per_s", "model_tflops_per_gpu",
            "hardware_tflops_per_gpu", "mfu", "hfu", "fits", "peak_memory_gib", "memory_gib", "time_s", "plan"}
BASE = ["simulate", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch", "64"]


def test_json_contract_and_consistency():
    r = run_cli_json(*BASE, "--dp", "4", "--tp", "2", "--pp", "2", "--micro-batch", "2", "--zero", "1",
                     "--recompute", "selective", "--sequence-parallel")
    assert SIM_KEYS <= set(r)
    assert set(r["memory_gib"]) >= {"params", "grads", "optimizer", "activations", "other"}
    assert set(r["time_s"]) >= {"compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble"}
    assert sum(r["time_s"].values()) == pytest.approx(r["iteration_time_s"], rel=1e-6)
    assert sum(r["memory_gib"].values()) == pytest.approx(r["peak_memory_gib"], rel=1e-6)
    assert r["tokens_per_s"] == pytest.approx(64 * 2048 / r["iteration_time_s"])
    assert r["plan"]["num_micro_batches"] == 8 and len(r["plan"]["stages"]) == 2
    assert r["fits"] is True


def test_write_plan_and_gantt(tmp_path):
    plan, png = tmp_path / "plan.json", tmp_path / "timeline.png"
    p = run_cli(*BASE, "--dp", "1", "--tp", "2", "--pp", "4", "--micro-batch", "1", "--schedule", "interleaved-1f1b",
                "--virtual-stages", "2", "--write-plan", str(plan), "--gantt", str(png))
    assert p.returncode == 0, p.stderr
    data = json.loads(plan.read_text())
    assert len(data["stages"]) == 8 and data["stages"][0][0] == "embed" and data["stages"][-1][-1] == "head"
    flat = [n for s in data["stages"] for n in s]
    assert flat == ["embed", *[f"layers.{i}" for i in range(24)], "head"]
    assert data["prediction"]["iteration_time_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parameter_server_mode():
    allreduce = run_cli_json(*BASE, "--dp", "16", "--tp", "1", "--pp", "1", "--micro-batch", "1")
    ps = run_cli_json(*BASE[:-1], "64", "--nodes", "3", "--dp", "16", "--tp", "1", "--pp", "1", "--micro-batch", "1",
                      "--dp-mode", "ps", "--ps-servers", "2")
    assert ps["time_s"]["dp_comm"] > allreduce["time_s"]["dp_comm"] > 0
    assert ps["plan"]["dp_mode"] == "ps" and ps["memory_gib"]["optimizer"] == 0


@pytest.mark.parametrize("args,fragment", [
    (["--dp", "4", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--gpus", "8"], "not the --gpus 8"),
    (["--dp", "64", "--tp", "2", "--pp", "1", "--micro-batch", "1"], "more GPUs than the cluster"),
    (["--dp", "1", "--tp", "3", "--pp", "1", "--micro-batch", "1"], "does not divide the 16 attention heads"),
    (["--dp", "3", "--tp", "1", "--pp", "1", "--micro-batch", "5"], "not divisible by dp x micro-batch"),
    (["--dp", "1", "--tp", "1", "--pp", "16", "--micro-batch", "1", "--schedule", "interleaved-1f1b",
      "--virtual-stages", "2"], "exceeds the model's 26 blocks"),
    (["--dp", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--sequence-parallel"], "needs tp > 1"),
    (["--dp", "1", "--tp", "1", "--pp", "2", "--micro-batch", "1", "--schedule", "zb-v"], "exactly two stages"),
    (["--dp", "0", "--tp", "1", "--pp", "1", "--micro-batch", "1"], "must be positive"),
    # torch's zb-v weight pass reruns a checkpointed region once per weight (layout.zero_bubble_recompute_refusal)
    (["--dp", "1", "--tp", "1", "--pp", "2", "--micro-batch", "1", "--schedule", "zb-v", "--virtual-stages", "2",
      "--recompute", "full"], "zb-v with full recomputation"),
    (["--dp", "1", "--tp", "1", "--pp", "2", "--micro-batch", "1", "--schedule", "zb-v", "--virtual-stages", "2",
      "--stage-recompute", "none,mlp,none,none"], "zb-v with mlp recomputation"),
])
def test_invalid_layouts_are_one_line_errors(args, fragment):
    assert_one_line_error(run_cli(*BASE, *args), fragment)


def test_gantt_needs_a_png_name(tmp_path):
    p = run_cli(*BASE, "--dp", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--gantt", str(tmp_path / "g.txt"))
    assert_one_line_error(p, "--gantt", "give a .png file name")  # a PNG was written under the .txt name
    assert not (tmp_path / "g.txt").exists()


def test_unsupported_dtype_and_unknown_cluster():
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "dgx-h1OO", "--global-batch", "8", "--dp", "1",
                "--tp", "1", "--pp", "1", "--micro-batch", "1")
    assert_one_line_error(p, "unknown cluster spec")
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1",
                "--tp", "1", "--pp", "1", "--micro-batch", "1", "--dtype", "fp16",
                "--write-plan", "/no/such/dir/p.json")
    assert_one_line_error(p, "does not exist")


def test_what_the_executor_would_not_run_is_said(tmp_path):
    """simulate prices any layout, but a plan it writes should not surprise at execute: etp > 1 under this executor's
    stack is noted (execute refuses it), and a written plan that does not fit is warned about (as export and execute
    warn)."""
    moe = ["--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "16", "--tp", "1", "--pp", "1",
           "--micro-batch", "1"]
    p = run_cli("simulate", *moe, "--dp", "8", "--ep", "2", "--etp", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert any("does not run expert tensor parallelism yet (etp 2)" in n for n in json.loads(p.stdout)["notes"])
    p = run_cli("simulate", *moe, "--dp", "8", "--ep", "2", "--etp", "2", "--framework", "megatron-core", "--json")
    assert not any("expert tensor parallelism" in n for n in json.loads(p.stdout)["notes"])
    big = ["--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "8", "--tp", "1", "--pp",
           "1", "--micro-batch", "1"]
    p = run_cli("simulate", *big, "--write-plan", str(tmp_path / "p.json"))
    assert p.returncode == 0 and "warning: the plan does not fit" in p.stderr
    p = run_cli("simulate", *moe, "--dp", "8", "--ep", "2", "--write-plan", str(tmp_path / "q.json"))
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr


def test_simulate_prices_a_planned_split_as_plan_did(tmp_path):
    """A plan's stage split and per-stage recomputation, given to simulate as its report lists them (--stages,
    --stage-recompute), price its layout exactly as plan did: one number for one plan (the demo's top ten plans
    include a pipeline whose stages recompute differently)."""
    got = run_cli_json("plan", "--no-charts", "--top", "10", "--out", str(tmp_path / "r"))
    mixed = [c for c in got["top_k"] if len(set(c["plan"]["stage_recompute"])) > 1]
    piped = [c for c in got["top_k"] if c["plan"]["pp"] > 1]
    assert mixed and piped
    for c in (mixed[0], piped[0]):
        plan = c["plan"]
        flags = [f"--{k.replace('_', '-')}={plan[k]}" for k in ("dp", "tp", "pp", "cp", "micro_batch", "schedule",
                                                                 "virtual_stages", "zero", "dtype")]
        flags += ["--sequence-parallel"] if plan["sequence_parallel"] else []
        again = run_cli_json("simulate", "--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "512",
                             *flags, "--stages", ",".join(str(len(s)) for s in plan["stages"]),
                             "--stage-recompute", ",".join(plan["stage_recompute"]))
        assert again["iteration_time_s"] == pytest.approx(c["iteration_time_s"], rel=1e-12)
        assert again["peak_memory_gib"] == pytest.approx(c["peak_memory_gib"], rel=1e-12)
    p = run_cli("simulate", "--model", "llama2-70b", "--cluster", "dgx-h100", "--global-batch", "512", "--dp", "8",
                "--tp", "1", "--pp", "8", "--micro-batch", "1", "--stages", "10,10,10,10,10,10,10,13")
    assert_one_line_error(p, "--stages 10,10,10,10,10,10,10,13", "sum to the model's 82 blocks")

"""``paraplan execute`` as a user runs it: a plan from ``simulate --write-plan``, refusals before
anything starts, ranks that die or hang, and two torchrun "nodes" on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from executor_cases import Case, assert_losses_match, read_run

from conftest import CLI, ROOT, assert_one_line_error, run_cli

RUN_KEYS = {"plan", "world_size", "steps", "losses", "step_time_s", "peak_memory_gib", "backend", "device"}


@pytest.fixture
def plan_file(tmp_path):
    def make(case: Case, **changes) -> str:
        data = case.plan().to_dict()
        data.update(changes)
        path = tmp_path / f"{case.name}.json"
        path.write_text(json.dumps(data))
        return str(path)

    return make


def test_simulated_plan_runs_and_records(tmp_path):
    plan = tmp_path / "plan.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--seq-len", "32",
                "--dp", "1", "--tp", "1", "--pp", "2", "--micro-batch", "2", "--schedule", "1f1b", "--dtype", "fp32",
                "--write-plan", str(plan))
    assert p.returncode == 0, p.stderr
    p = run_cli("execute", "--plan", str(plan), "--steps", "2", "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    run = read_run(str(tmp_path / "run"))
    assert RUN_KEYS <= set(run)
    assert run["world_size"] == 2 and run["steps"] == 2 and len(run["losses"]) == 2
    assert len(run["peak_memory_gib"]) == 2 and all(m > 0 for m in run["peak_memory_gib"])
    assert run["plan"]["stages"] == json.loads(plan.read_text())["stages"]
    # measured beside predicted, the warm-up step left out of the mean
    assert "measured" in p.stdout and "predicted" in p.stdout and "without step 1" in p.stdout
    assert run["mean_step_time_s"] == pytest.approx(run["step_time_s"][1])


@pytest.mark.slow  # parameter servers: tests/test_executor_ps.py covers them in the default suite
def test_simulated_parameter_server_plan_runs(tmp_path):
    """``simulate --dp-mode ps`` writes a plan that ``execute`` runs with its servers as extra ranks."""
    plan = tmp_path / "ps.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--seq-len", "32",
                "--dp", "2", "--tp", "1", "--pp", "1", "--micro-batch", "2", "--dtype", "fp32", "--dp-mode", "ps",
                "--ps-servers", "1", "--ps-staleness", "1", "--write-plan", str(plan))
    assert p.returncode == 0, p.stderr
    p = run_cli("execute", "--plan", str(plan), "--steps", "3", "--json")
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)
    assert run["world_size"] == 3 and len(run["peak_memory_gib"]) == 3 and len(run["losses"]) == 3
    assert run["plan"]["dp_mode"] == "ps" and run["plan"]["ps_staleness"] == 1


def test_json_prints_only_the_run_record(plan_file):
    p = run_cli("execute", "--plan", plan_file(Case("one", "llama-tiny", micro_batch=4)), "--steps", "2", "--json")
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)  # exactly one JSON object on stdout
    assert RUN_KEYS <= set(run) and run["world_size"] == 1 and len(run["losses"]) == 2


@pytest.mark.parametrize("change,fragment", [
    ({"stages": [["embed", "layers.0"], ["layers.2", "layers.3", "head"]]}, "leaves out block 'layers.1'"),
    ({"stages": [["embed", "layers.0", "layers.1"], ["layers.1", "layers.2", "layers.3", "head"]]},
     "lists block 'layers.1' twice"),
    ({"tp": 3, "pp": 1, "stages": [["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]]},
     "tp 3 does not divide the 4 attention heads"),
    ({"dp": 8, "global_batch": 16, "micro_batch": 1, "num_micro_batches": 2, "schedule": "gpipe"},
     "needs 16 ranks, but cluster local has 8 process slots"),
    pytest.param({"cluster": "dgx-h100", "dtype": "bf16"}, "no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    ({"dp_mode": "ps"}, "parameter servers"),
    ({"dp_mode": "ps", "tp": 2, "pp": 1, "stages": [["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]]},
     "data parallelism only (tp = pp = 1)"),
    ({"dp": 2, "pp": 1, "num_micro_batches": 2, "layer_strategies": {"head": {"parallel": "tensor", "degree": 2}},
      "stages": [["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]]}, "head_parallel"),
    ({"layer_strategies": {"layers.0": {"parallel": "tensor", "degree": 2}}}, "layer_strategies"),
])
def test_invalid_plans_are_refused_in_one_line(plan_file, change, fragment):
    start = time.time()
    p = run_cli("execute", "--plan", plan_file(Case("p", "gpt-tiny", pp=2, micro_batch=2), **change))
    assert_one_line_error(p, fragment)
    assert p.returncode == 2 and time.time() - start < 60


def test_nodes_that_do_not_divide_the_world_are_refused(plan_file):
    p = run_cli("execute", "--plan", plan_file(Case("p", "gpt-tiny", pp=2, micro_batch=2)), "--nnodes", "3",
                "--node-rank", "0")
    assert_one_line_error(p, "do not split evenly over --nnodes 3")


def test_port_in_use_is_refused(plan_file):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run_cli("execute", "--plan", plan_file(Case("p", "gpt-tiny", dp=2)), "--master-port", str(port))
    assert_one_line_error(p, f"port {port} on 127.0.0.1 is in use")


@pytest.mark.parametrize("fault,fragment", [
    ("exit:1:2", "rank 1 died step 2 (exit code 3)"),
    ("raise:1:2", "rank 1 failed step 2: RuntimeError: injected fault at step 2"),
    pytest.param("hang:1:2", "rank 1 hung step 2", marks=pytest.mark.slow),  # waits out the hang timeout
])
def test_a_failing_rank_ends_the_job_and_is_named(plan_file, fault, fragment, tmp_path):
    timeout = 8
    start = time.time()
    p = run_cli("execute", "--plan", plan_file(Case("p", "gpt-tiny", pp=2, micro_batch=2)), "--steps", "3",
                "--timeout", str(timeout), env={"PARAPLAN_FAULT": fault, "TMPDIR": str(tmp_path)}, timeout=180)
    elapsed = time.time() - start
    assert_one_line_error(p, fragment)
    assert p.returncode == 1
    assert elapsed < 60 + timeout, f"the job took {elapsed:.0f} s to end"
    logs = p.stderr.rsplit("logs of this node's ranks: ", 1)[1].rstrip(")\n")
    assert os.path.exists(os.path.join(logs, "rank1.log"))  # kept for a look at what happened


@pytest.mark.slow  # waits out a watchdog timeout
def test_watchdog_ends_a_job_whose_every_rank_hangs(plan_file, tmp_path):
    """No peer is left to time out: the launcher's watchdog ends the job and names the rank."""
    start = time.time()
    p = run_cli("execute", "--plan", plan_file(Case("one", "gpt-tiny", micro_batch=4)), "--steps", "3",
                "--timeout", "4", env={"PARAPLAN_FAULT": "hang:0:2", "TMPDIR": str(tmp_path)}, timeout=180)
    assert_one_line_error(p, "rank 0 hung step 2: no progress for 4 s")
    assert p.returncode == 1 and time.time() - start < 60


@pytest.mark.slow  # two torchrun launches
def test_two_nodes_on_loopback_run_a_dp2_pp2_plan(plan_file, tmp_path):
    case = Case("llama-dp2xpp2", "llama-tiny", dp=2, pp=2, micro_batch=2)
    plan = plan_file(case)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["execute", "--plan", plan, "--steps", "3", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, "--timeout", "120"]
    node1 = subprocess.Popen([*CLI, *common, "--node-rank", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run([*CLI, *common, "--node-rank", "0", "--out", out], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
        out1, err1 = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    for r in range(2):  # each node prints the command of every node
        assert f"--node-rank {r}" in node0.stderr and f"--node-rank {r}" in err1
    run = read_run(out)
    assert run["world_size"] == 4 and run["nnodes"] == 2
    assert_losses_match(case, run)


def test_worker_runs_alone_as_a_module():
    """``python -m paraplan.executor.worker --help`` works (the entry point torchrun starts)."""
    p = subprocess.run([sys.executable, "-m", "paraplan.executor.worker", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0 and "--plan" in p.stdout


def test_a_prediction_of_another_step_is_left_out(tmp_path):
    """A plan edited after it was priced (here its sequence length) keeps a prediction of another step: the run
    would set its measured step beside it. Job.load leaves it out and says why; an unedited plan keeps it."""
    from paraplan.executor.job import Job

    path = tmp_path / "plan.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1", "--tp",
                "1", "--pp", "1", "--micro-batch", "4", "--no-calibrate", "--write-plan", str(path))
    assert p.returncode == 0, p.stderr
    assert Job.load(str(path)).plan.prediction is not None and not Job.load(str(path)).stale_prediction
    data = json.loads(path.read_text())
    data["seq_length"] = data["model_spec"]["seq_length"] // 2
    path.write_text(json.dumps(data))
    job = Job.load(str(path))
    assert job.plan.prediction is None and job.plan.memory_warning() is None
    assert f"prices {8 * 2 * data['seq_length']:,} tokens a step, the plan runs {8 * data['seq_length']:,}" in \
        job.stale_prediction


def test_a_plan_edited_past_its_sliding_window_is_refused(tmp_path):
    """A Mistral-style sliding window is not run (the executor attends over whole sequences): a plan whose sequence
    the window covers loads, one edited to a longer sequence is refused by name instead of training another model."""
    from paraplan.executor.errors import ExecutionError
    from paraplan.executor.job import Job

    spec = tmp_path / "windowed.yaml"
    spec.write_text("family: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 128\n"
                    "seq_length: 32\nsliding_window: 32\n")
    path = tmp_path / "plan.json"
    p = run_cli("simulate", "--model", str(spec), "--cluster", "local", "--global-batch", "4", "--dp", "1", "--tp",
                "1", "--pp", "1", "--micro-batch", "2", "--no-calibrate", "--write-plan", str(path))
    assert p.returncode == 0, p.stderr
    assert Job.load(str(path)).seq_length == 32
    data = json.loads(path.read_text())
    data["seq_length"] = 64
    path.write_text(json.dumps(data))
    with pytest.raises(ExecutionError, match="seq_length 64 exceeds windowed's sliding_window 32"):
        Job.load(str(path))


def test_a_dry_run_refuses_a_plan_whose_cluster_is_unknown_here(tmp_path):
    """The dry run traces the plan's devices and their memory (a bf16 GPU plan traced on this CPU would run fp32 and
    read twice its weights): a plan naming a cluster known neither here nor by itself (no cluster_spec) is refused
    in one line, as export refuses it."""
    path = tmp_path / "plan.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "8",
                "--tp", "1", "--pp", "1", "--micro-batch", "1", "--write-plan", str(path))
    assert p.returncode == 0, p.stderr
    data = json.loads(path.read_text())
    data["cluster"] = "mystery-cluster"
    path.write_text(json.dumps(data))
    assert_one_line_error(run_cli("execute", "--plan", str(path), "--dry-run"),
                          "--dry-run: the plan's cluster 'mystery-cluster' is not known here")

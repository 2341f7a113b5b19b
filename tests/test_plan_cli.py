"""`paraplan plan` and `paraplan compare` as users run them."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import ROOT, assert_one_line_error, run_cli, run_cli_json
from paraplan.planner.workload import Workload

SIM_KEYS = {"num_parameters", "iteration_time_s", "tokens_per_s", "mfu", "hfu", "fits", "peak_memory_gib",
            "memory_gib", "time_s", "plan"}


def test_plan_json_and_report_folder(tmp_path):
    out = tmp_path / "report"
    p = run_cli("plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch", "256",
                "--top", "3", "--out", str(out), "--train-tokens", "3e11", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert {"best", "top_k", "num_candidates", "num_feasible", "search_time_s"} <= set(r)
    assert SIM_KEYS <= set(r["best"]) and len(r["top_k"]) == 3
    times = [x["iteration_time_s"] for x in r["top_k"]]
    assert times == sorted(times) and r["best"]["iteration_time_s"] == times[0]
    assert r["num_candidates"] >= r["num_feasible"] > 0
    for name in ("report.md", "plan.json", "candidates.csv", "time_breakdown.png", "memory.png", "timeline.png",
                 "scaling.png", "pareto.png"):
        assert (out / name).exists(), name
    plan = json.loads((out / "plan.json").read_text())
    assert plan["dp"] * plan["tp"] * plan["pp"] == 16 and plan["stages"][0][0] == "embed"
    rows = list(csv.DictReader((out / "candidates.csv").open()))
    assert len(rows) == r["num_candidates"]
    # every parallel degree is a column: a context-parallel layout is not a copy of the same row without it
    assert {"dp", "tp", "pp", "cp", "ep", "etp"} <= set(rows[0])
    assert len({tuple(row.values()) for row in rows}) == len(rows)
    statuses = {row["status"].split(":")[0].split(" (")[0] for row in rows}
    assert "ok" in statuses and any(s.startswith("invalid") or s.startswith("out of memory") for s in statuses)
    report = (out / "report.md").read_text()
    assert "## The chosen layout" in report and "time to train" in report and "$" in report


@pytest.mark.parametrize("tokens", ["nan", "inf", "0"])
def test_train_tokens_must_be_a_positive_number(tokens):
    p = run_cli("plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--global-batch", "64",
                "--train-tokens", tokens, "--no-charts")
    assert_one_line_error(p, "--train-tokens must be a positive number")


def test_nothing_fits_is_one_line_with_advice(tmp_path):
    """Where nothing fits, the advice is a GPU count searched, not a linear guess (llama3-405b at batch 8 once said
    "about 60 GPUs" on 8, "about 61" on 60, "about 66" on 64: none fitted): following it, a plan fits."""
    p = run_cli("plan", "--model", "llama3-405b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "16",
                "--no-charts")
    assert_one_line_error(p, "nothing fits", "GiB")
    assert p.returncode == 2
    p = run_cli("plan", "--model", "llama2-70b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "512",
                "--no-charts", "--out", str(tmp_path / "one"))
    assert_one_line_error(p, "nothing fits on 8 GPUs", "the fewest GPUs found that fit: 16 (--nodes 2)")
    out = run_cli_json("plan", "--model", "llama2-70b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch",
                       "512", "--no-charts", "--out", str(tmp_path / "two"))
    assert out["best"]["peak_memory_gib"] <= 80


def test_counts_searched_where_nothing_fits_are_whole_nodes_past_one():
    from paraplan.planner.fitting_count import counts_to_try

    assert counts_to_try(8, 8, 11) == [16, 24, 32, 48, 64, 96, 128]
    assert counts_to_try(2, 8, 3) == [4, 8, 16, 24, 32]  # powers of two within a node
    assert counts_to_try(64, 8, 66) == [72, 96, 128, 192, 256, 384, 512, 768, 1024]


def test_plan_needs_the_workload_unless_no_arguments():
    assert_one_line_error(run_cli("plan", "--model", "gpt2"), "--cluster, --global-batch")


def test_compare_strategies_and_classic_comparisons(tmp_path):
    out = tmp_path / "cmp"
    p = run_cli("compare", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch",
                "256", "--strategy", "dp=16", "--strategy", "tp=8,pp=2", "--strategy", "tp=2,pp=2,dp=4,zero=1",
                "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    names = [s["name"] for s in r["strategies"]]
    assert names == ["dp=16", "tp=8,pp=2", "tp=2,pp=2,dp=4,zero=1", "optimum (3D search)"]
    optimum = r["strategies"][-1]["iteration_time_s"]
    assert all(s["iteration_time_s"] >= optimum * (1 - 1e-9) for s in r["strategies"] if s["status"] == "ok")
    ring = r["ps_vs_ring"]["sync_time_s"]["ring all-reduce"]
    ps1 = r["ps_vs_ring"]["sync_time_s"]["parameter server, 1 server"]
    assert ps1[-1] / ps1[0] > 4 > ring[-1] / ring[0]  # PS grows with the workers, ring stays nearly flat
    for name in ("time_breakdown.png", "memory.png", "ps_vs_ring.png"):
        assert (out / name).exists()
    # --no-charts (as plan's): the same table, no charts drawn
    quick = tmp_path / "quick"
    p = run_cli("compare", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch",
                "256", "--strategy", "dp=16", "--no-optimum", "--no-charts", "--out", str(quick), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["charts"] == {"table": str(quick / "comparison.md")} and not list(quick.glob("*.png"))
    assert "](" not in (quick / "comparison.md").read_text()  # no links to charts not drawn
    assert "![time breakdown](time_breakdown.png)" in (out / "comparison.md").read_text()


def test_compare_families_are_what_their_names_say():
    """The default rows are textbook families: "data x tensor" both kinds (once it was dp8 tp1, the data-parallel
    row again), "tensor parallel" tensor parallelism alone (once tp4 cp2: half context parallelism), none of them
    context parallel (the optimum's row may be)."""
    from paraplan.planner.compare import compare

    rows = {r.name: r.layout for r in compare(Workload.create("llama2-7b", "dgx-h100", 64), 8, [], "bf16")}
    assert all(lay.cp == 1 for name, lay in rows.items() if not name.startswith("optimum"))
    assert (rows["data parallel"].tp, rows["data parallel"].pp) == (1, 1)
    assert (rows["tensor parallel"].tp, rows["tensor parallel"].dp) == (8, 1)
    assert (rows["pipeline parallel"].pp, rows["pipeline parallel"].dp) == (8, 1)
    assert rows["data x tensor"].dp > 1 and rows["data x tensor"].tp > 1 and rows["data x tensor"].pp == 1


@pytest.mark.parametrize("strategy,fragment", [
    ("tp=8;pp=2", "got '8;pp=2'"),
    ("tp", "is not key=value"),
    ("tpp=8", "unknown key 'tpp'"),
    ("tp=3", "does not divide the 16 GPUs"),
    ("tp=0", "positive whole number"),
    ("dp=4,tp=2", "not the 16 GPUs compared"),
    ("schedule=fast", "schedule must be one of"),
    ("tp=\u00b2", "positive whole number"),  # "²".isdigit() is True, int() of it fails
    ("dp_mode=allreduce,ps=2", "ps is a parameter-server setting"),
    ("staleness=3", "staleness is a parameter-server setting"),
    # each strategy parses but none can be priced: nothing compared is a failure, not an empty table
    ("dp=16,zero=5", "none of the strategies compared can run: dp=16,zero=5: invalid: zero must be 0, 1, 2 or 3"),
])
def test_bad_strategies_are_one_line_errors(strategy, fragment):
    p = run_cli("compare", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch",
                "256", "--strategy", strategy, "--no-optimum")
    assert_one_line_error(p, fragment)


def test_compare_hybrid_and_data_parallel_optimisations(tmp_path):
    """mlp-bigfc (a 1M-class classifier): the class-sharded hybrid beats replicated data parallelism;
    the data-parallel table gives per-GPU sizes per layout (replicated: the whole model's gradient, kept as
    a 1/dp ZeRO shard; hybrid: the trunk plus a 1/k classifier shard); gradient accumulation divides the
    exposed sync per sample, 16-bit gradients halve its bytes."""
    p = run_cli("compare", "--model", "mlp-bigfc", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch",
                "1024", "--out", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    rows = {s["name"]: s for s in r["strategies"]}
    dp, hybrid = rows["data parallel (replicated classifier)"], rows["hybrid: class-sharded classifier"]
    assert hybrid["iteration_time_s"] < dp["iteration_time_s"] and hybrid["time_s"]["dp_comm"] < dp["time_s"]["dp_comm"]
    assert "head/" in hybrid["layout"] and hybrid["layout"] in rows["optimum (3D search)"]["layout"]
    # mlp-bigfc: 1024 -> 2048 -> 2048 -> 1,000,000 linears with biases; this executor reduces fp32 gradients
    # (4 bytes each) in bf16 training
    trunk = 1024 * 2048 + 2048 + 2048 * 2048 + 2048
    head = 2048 * 1_000_000 + 1_000_000
    per_layout = {d["strategy"]: d for d in r["data_parallel"]}
    rep, hyb = per_layout["data parallel (replicated classifier)"], per_layout["hybrid: class-sharded classifier"]
    assert rep["grad_bytes_per_gpu"] == pytest.approx(4 * (trunk + head))
    k = int(hybrid["layout"].split("head/")[1].split()[0])
    assert hyb["grad_bytes_per_gpu"] == pytest.approx(4 * (trunk + head / k))
    dp = rep["dp"]
    if "z2" in rep["layout"].split() or "z3" in rep["layout"].split():
        assert rep["kept_bytes_per_gpu"] == pytest.approx(rep["grad_bytes_per_gpu"] / dp)
    for d in r["data_parallel"]:  # the wait is what of the collectives does not hide: never more than all of them
        assert d["exposed_s"] <= d["sync_s_not_overlapped"] * (1 + 1e-9)
    assert rep["exposed_s"] == pytest.approx(dp_row_exposed := rows["data parallel (replicated classifier)"]
                                             ["time_s"]["dp_comm"]) and hyb["exposed_s"] < dp_row_exposed
    opt = {(d["setting"].split(",")[0], d["samples_per_sync"]): d for d in r["dp_optimisations"]}
    assert {s for s, _ in opt} == {"gradients reduced in fp32"}  # this executor has no 16-bit reduction
    fp32_1, fp32_4 = opt[("gradients reduced in fp32", 1024)], opt[("gradients reduced in fp32", 4096)]
    assert fp32_4["exposed_s"] == pytest.approx(fp32_1["exposed_s"])  # one sync per iteration either way
    assert fp32_4["exposed_ms_per_1k_samples"] == pytest.approx(fp32_1["exposed_ms_per_1k_samples"] / 4)
    p = run_cli("compare", "--model", "mlp-bigfc", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch",
                "1024", "--out", str(tmp_path), "--json", "--framework", "megatron-core", "--strategy", "dp=16,zero=1")
    assert p.returncode == 0, p.stderr
    opt = {(d["setting"].split(",")[0], d["samples_per_sync"]): d for d in json.loads(p.stdout)["dp_optimisations"]}
    wide, narrow = opt[("gradients reduced in fp32", 1024)], opt[("gradients reduced in 16 bits (as priced)", 1024)]
    assert narrow["grad_bytes_per_gpu"] == pytest.approx(wide["grad_bytes_per_gpu"] / 2)
    assert narrow["sync_s_not_overlapped"] < wide["sync_s_not_overlapped"]  # half the bytes, the same latency


@pytest.mark.parametrize("command", [
    ["plan", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8"],
    ["compare", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8"],
    ["validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8"],
])
def test_report_folder_that_is_a_file_is_a_one_line_error(command, tmp_path):
    taken = tmp_path / "report"
    taken.write_text("not a folder")
    assert_one_line_error(run_cli(*command, "--out", str(taken)), "--out", "is a file")
    assert taken.read_text() == "not a folder"


def test_plan_file_that_is_a_folder_is_a_one_line_error(tmp_path):
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1",
                "--tp", "1", "--pp", "1", "--micro-batch", "1", "--write-plan", str(tmp_path))
    assert_one_line_error(p, "--write-plan", "is a folder")


def test_first_plan_in_a_fresh_folder_makes_its_default_report_folder(tmp_path):
    """A user's first `paraplan plan` in a folder without reports/ writes its report there (the default folder is
    the tool's to make); a mistyped --out is still an error, no folders made for it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "64", "--no-charts"]
    p = subprocess.run([sys.executable, "-m", "paraplan", "plan", *args], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "reports" / "gpt3-1.3b-dgx-a100-80gb-8gpus" / "report.md").is_file()
    p = subprocess.run([sys.executable, "-m", "paraplan", "plan", *args, "--out", "typo/report"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=600)
    assert_one_line_error(p, "--out typo/report", "does not exist")
    assert not (tmp_path / "typo").exists()


def test_simulate_says_when_the_event_simulation_gives_way_to_the_closed_forms():
    """Above 400,000 tasks simulate times the iteration by the closed forms and says so (--event-sim forces the
    event simulation): pp 8 x 65,536 micro-batches x 3 passes = 1,572,864 tasks."""
    r = run_cli_json("simulate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--nodes", "8", "--global-batch",
                     "65536", "--dp", "1", "--tp", "8", "--pp", "8", "--micro-batch", "1")
    assert r["method"] == "closed form"
    assert any("it would walk 1,572,864 tasks" in n and "--event-sim" in n for n in r["notes"])


def test_a_cluster_file_given_relatively_is_recorded_absolutely(tmp_path):
    """A plan made with --cluster FILE.yaml from one folder must find that file from any other (execute's slot
    check, export --to slurm): plan.json keeps its absolute path."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copy(ROOT / "hardware_specs" / "clusters" / "local.yaml", tmp_path / "mine.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "paraplan", "plan", "--model", "gpt-tiny", "--cluster", "mine.yaml",
                        "--gpus", "2", "--global-batch", "8", "--no-charts", "--no-calibrate", "--out", "r"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["cluster"] == str(tmp_path / "mine.yaml")


@pytest.mark.parametrize("command, fragment", [
    (["plan", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8", "--no-charts",
      "--out", "/proc/paraplan-report"], "/proc/paraplan-report"),
    (["simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1", "--tp", "1", "--pp",
      "1", "--micro-batch", "1", "--gantt", "/proc/paraplan.png"], "--gantt /proc/paraplan.png: cannot be written"),
    (["profile", "--model", "gpt-tiny", "--out", "/proc/paraplan.csv"], "--out /proc/paraplan.csv: cannot be written"),
])
def test_outputs_the_file_system_refuses_are_one_line_errors(command, fragment):
    """A folder that refuses new files (/proc here; a read-only or full disk, permissions) is the user's to fix: one
    line naming the path, exit 2 — for a requested chart too, checked before the work."""
    assert_one_line_error(run_cli(*command, "--no-calibrate" if command[0] != "profile" else "--json"), fragment)


def test_the_default_report_folder_stays_inside_reports(tmp_path):
    """A spec's name goes into the default report folder's name as one path component: a name with slashes and
    dots cannot write outside reports/."""
    import os
    import subprocess
    import sys

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "m.yaml").write_text('name: "../../escape/me"\nfamily: gpt\nnum_layers: 2\nhidden_size: 64\n'
                                              "num_attention_heads: 4\nvocab_size: 100\nseq_length: 32\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "paraplan", "plan", "--model", "m.yaml", "--cluster", "local", "--gpus",
                        "2", "--global-batch", "8", "--no-charts", "--no-calibrate"], capture_output=True, text=True,
                       cwd=tmp_path / "work", env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    [folder] = os.listdir(tmp_path / "work" / "reports")
    assert "/" not in folder and (tmp_path / "work" / "reports" / folder / "plan.json").is_file()
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("command, fragment", [
    (["validate", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8", "--steps", "1"],
     "--steps 1: the first step warms up and is not timed"),
    (["calibrate", "--cluster", "local", "--ranks", "9"], "--ranks 9: cluster local has 8 process slots per node"),
])
def test_counts_that_would_measure_nothing_are_refused(command, fragment):
    assert_one_line_error(run_cli(*command), fragment)


def test_a_report_folder_keeps_only_this_plan_s_charts(tmp_path):
    """Planning again into a folder with --no-charts leaves no chart of the earlier plan behind (it would pass for
    this one's), and the files are written whole (planner/atomic.py: no temporary file left)."""
    args = ["plan", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8",
            "--no-calibrate", "--out", str(tmp_path)]
    assert run_cli(*args).returncode == 0
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())
    assert run_cli(*args, "--no-charts").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["candidates.csv", "plan.json", "report.md"]


def test_two_executes_into_one_folder_at_once_are_refused(tmp_path):
    """While one execute holds --out (an exclusive lock on its .paraplan-execute.lock), another is refused in one
    line before starting, instead of interleaving their metrics."""
    import fcntl

    plan = tmp_path / "plan.json"
    p = run_cli("simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "1", "--tp",
                "1", "--pp", "1", "--micro-batch", "1", "--write-plan", str(plan), "--no-calibrate")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".paraplan-execute.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert_one_line_error(run_cli("execute", "--plan", str(plan), "--steps", "2", "--out", str(out)),
                              "is being written by another paraplan execute")


def test_a_gpu_without_the_dtype_says_which_it_has():
    from paraplan.hardware_specs import HardwareSpecError
    from paraplan.hardware_specs.loader import load_gpu

    with pytest.raises(HardwareSpecError, match=r"v100-32gb has no bf16 support .*; give --dtype (fp16|fp32)"):
        load_gpu("v100-32gb").peak_flops("bf16")


def test_plans_equally_fast_rank_the_one_that_moves_less_first():
    """The demo's model and cluster priced for Megatron-Core: its two fastest plans are priced alike (dp32 tp2 and
    dp16 tp2 cp2 under ZeRO-3, their collectives hidden); the one that moves fewer bytes a step comes first, as its
    time depends less on how well that traffic overlaps. (The demo itself had such a pair, ZeRO-2 and ZeRO-3 of one
    layout, until FSDP2's copy-out of each ZeRO-3 gather was priced.)"""
    r = run_cli_json("plan", "--no-charts", "--top", "5", "--framework", "megatron-core")
    tied = [t for t in r["top_k"] if t["iteration_time_s"] == r["top_k"][0]["iteration_time_s"]]
    assert len(tied) >= 2
    moved = [sum(sum(rank.values()) for rank in t["rank_comm_bytes"]) for t in tied]
    assert moved == sorted(moved)


def test_compare_prices_a_layout_as_simulate_and_plan_do(tmp_path):
    """An interleaved pipeline's row in compare is timed by the event simulation, as plan's rows and simulate are
    (its closed form put compare 1-12% off theirs for interleaved and ZB-V layouts)."""
    r = run_cli_json("compare", "--model", "gpt3-1.3b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch",
                     "64", "--strategy", "dp=2,pp=4,v=2,mb=1,zero=1", "--no-optimum", "--no-charts", "--out",
                     str(tmp_path))
    [row] = r["strategies"]
    assert row["method"] == "event simulation"


def test_a_note_says_when_fewer_gpus_train_faster(write):
    """GPT-2, one sample a step, on two 6-GPU nodes: every layout of all 12 GPUs spreads the model over both nodes
    (tp 12 across them), while tp 6 inside one node trains faster; the search uses every GPU it is given, so the
    report (and plan's notes) say so from the scaling table's re-plans, with the flag that plans on fewer."""
    from paraplan.planner.report import fewer_gpus_faster
    from paraplan.planner.scaling import ScalingPoint
    from paraplan.planner.search import search
    from paraplan.planner.workload import Workload

    path = write("six.yaml", "name: six\ngpu: h100-sxm-80gb\nnodes: 2\ngpus_per_node: 6\n"
                             "intra_node: {bandwidth_GBps: 300, latency_us: 2}\n"
                             "inter_node: {bandwidth_GBps: 25, latency_us: 10}\n")
    work = Workload.create("gpt2", path, 1)
    full, half = search(work, 12, top_k=1), search(work, 6, top_k=1)
    assert half.best.prediction.tokens_per_s > full.best.prediction.tokens_per_s
    note = fewer_gpus_faster(full, [ScalingPoint(6, half.best), ScalingPoint(12, full.best)])
    assert note.startswith("6 GPUs train faster than 12: dp1 tp6") and "plan --gpus 6" in note
    cut = ScalingPoint(3, None, "re-plan stopped after 3 s")
    assert fewer_gpus_faster(half, [cut, ScalingPoint(6, half.best)]) == ""


def test_compare_labels_mixed_stage_modes_and_a_fixed_mode_loses_no_split(tmp_path):
    """A strategy that fixes recomputation is priced no worse than the free search's split when that split already
    uses only the fixed mode (the narrowed search's quick split need not fit in it: Mixtral 8x22B's interleaved
    layout came out 3.6% slower with recompute=none than without); a row whose stages recompute differently says
    so in its label ("full" alone would read as every stage recomputing)."""
    layout = "dp=4,tp=2,pp=4,cp=2,ep=8,mb=2,schedule=interleaved-1f1b,v=4,zero=2,sp=1"
    got = run_cli_json("compare", "--model", "mixtral-8x22b", "--cluster", "dgx-h100", "--nodes", "8",
                       "--global-batch", "512", "--framework", "megatron-core", "--strategy", layout, "--strategy",
                       layout + ",recompute=none", "--no-optimum", "--no-charts", "--out", str(tmp_path / "m"),
                       "--memory-margin", "0")  # on the whole GPU the free split recomputes nothing
    free, fixed = got["strategies"]
    assert set(free["stage_recompute"]) == {"none"}
    assert fixed["iteration_time_s"] == pytest.approx(free["iteration_time_s"], rel=1e-12)
    mixed = "dp=2,tp=2,pp=16,mb=1,schedule=interleaved-1f1b,v=2,zero=2,sp=1"
    got = run_cli_json("compare", "--no-optimum", "--no-charts", "--out", str(tmp_path / "l"), "--model", "llama2-70b",
                       "--cluster", "dgx-h100", "--global-batch", "512", "--strategy", mixed)
    [row] = got["strategies"]
    modes = sorted(set(row["stage_recompute"]))
    assert len(modes) > 1 and row["label"] == f"{row['layout']} [{'/'.join(modes)}]"


def test_compare_keeps_expert_gradients_sharded_over_their_own_group(tmp_path):
    """Under ZeRO-2/3 a GPU keeps 1/dp of its dense gradients but 1/edp of its experts' (edp = dp x tp / ep: the
    ranks holding the same experts); with ep = dp the experts' group is one GPU and nothing of them is sharded (QA
    round 8: compare divided the whole gradient by dp)."""
    from paraplan.planner.workload import Workload

    r = run_cli_json("compare", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "16",
                     "--gpus", "8", "--strategy", "dp=8,ep=8,zero=3", "--strategy", "dp=8,ep=2,zero=3",
                     "--out", str(tmp_path), "--no-charts")
    layers = Workload.create("mixtral-tiny", "dgx-h100", 16).profile("bf16").layers
    experts, total = sum(x.expert_params for x in layers), sum(x.params for x in layers)
    rows = {d["layout"].split(" ep")[1].split()[0]: d for d in r["data_parallel"]}
    for ep, d in rows.items():
        ep = int(ep)
        assert d["grad_bytes_per_gpu"] == pytest.approx(4 * (total - experts + experts / ep), rel=1e-6)
        assert d["kept_bytes_per_gpu"] == pytest.approx(4 * ((total - experts) / 8 + experts / ep / (8 // ep)),
                                                        rel=1e-6)


def test_plans_leave_the_memory_margin_free(tmp_path):
    """plan --memory-margin: the demo's top plans with the whole GPU include one above 98% of its 80 GiB; with the
    default 2% margin none is, and each says what it may fill (78.4 GiB)."""
    whole = run_cli_json("plan", "--out", str(tmp_path / "whole"), "--no-charts", "--memory-margin", "0")
    assert max(p["peak_memory_gib"] for p in whole["top_k"]) > 0.98 * 80
    kept = run_cli_json("plan", "--out", str(tmp_path / "kept"), "--no-charts")
    assert all(p["peak_memory_gib"] <= 0.98 * 80 and p["fits"] for p in kept["top_k"])
    assert kept["best"]["memory_limit_gib"] == pytest.approx(78.4) and kept["best"]["memory_capacity_gib"] == 80


@pytest.mark.parametrize("share", ["0.5", "-0.1", "nan", "two"])
def test_a_memory_margin_outside_its_range_is_a_one_line_error(share):
    p = run_cli("plan", "--no-charts", "--memory-margin", share)
    assert_one_line_error(p, "--memory-margin")

"""Calibrated or says so (issue 13): timings apply only on the machine that measured them, a machine with no
calibration is calibrated before predictions for it, and uncalibrated predictions are labelled.

The automatic calibration itself (about a minute of measuring) is replaced here by a stand-in that writes
the shipped spec stamped with this machine's identity; the real one is run by `paraplan calibrate`'s test
in test_closed_loop.py and by benchmarks/validate_local.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from conftest import run_cli
from paraplan.cli import main
from paraplan.executor import calibrate as calibrate_module
from paraplan.executor.autocalibrate import needs_calibration
from paraplan.executor.calibrate import Calibration, calibrated_spec, shipped_cluster
from paraplan.executor.framework_fit import nnls, robust_nnls
from paraplan.hardware_specs import cluster_mapping, load_cluster
from paraplan.hardware_specs.identity import machine_identity, mismatch
from paraplan.profiler.measurements import FORMAT, find_measurement

SIMULATE = ["simulate", "--model", "gpt-tiny", "--cluster", "local", "--global-batch", "8", "--dp", "2", "--tp", "1",
            "--pp", "1", "--micro-batch", "4"]


def foreign_identity() -> dict:
    """This machine's identity with another core count: a machine of another kind."""
    here = machine_identity("cpu")
    return {**here, "cores": here["cores"] + 62}


def calibrated_local(identity: dict | None, op_overhead_us: float = 123.0) -> dict:
    """The shipped local spec as a calibration would write it, with a recognisable per-kernel overhead."""
    mapping = cluster_mapping(shipped_cluster("local"))
    mapping["gpu"]["efficiency"]["op_overhead_us"] = op_overhead_us
    if identity is not None:
        mapping["machine"] = identity
    return mapping


def write_calibration(folder, identity: dict | None, op_overhead_us: float = 123.0) -> None:
    (folder / "local.yaml").write_text(yaml.safe_dump(calibrated_local(identity, op_overhead_us)))


@pytest.fixture
def measurements(tmp_path, monkeypatch):
    """An empty measurements folder of this test's own, with automatic calibration allowed."""
    monkeypatch.setenv("PARAPLAN_MEASUREMENTS", str(tmp_path))
    monkeypatch.delenv("PARAPLAN_NO_CALIBRATE", raising=False)
    return tmp_path


# ---- identity ----

def test_this_machine_matches_itself_and_not_another():
    assert mismatch(machine_identity("cpu")) is None
    why = mismatch(foreign_identity())
    assert why is not None and f"{foreign_identity()['cores']} cores" in why
    assert "older paraplan" in mismatch(None)
    assert "older paraplan" in mismatch({"cpu": "x"})  # no device: not an identity


def test_torch_version_is_part_of_the_identity():
    here = machine_identity("cpu")
    assert mismatch({**here, "torch": "0.0.1"}) is not None


# ---- calibrated cluster specs ----

def test_a_calibration_of_this_machine_is_used(measurements):
    write_calibration(measurements, machine_identity("cpu"))
    cluster = load_cluster("local")
    assert cluster.calibrated and cluster.notes == ()
    assert cluster.gpu.efficiency.op_overhead_us == 123.0


@pytest.mark.parametrize("identity", [foreign_identity(), None], ids=["another-machine", "no-identity"])
def test_a_calibration_of_another_machine_is_ignored_with_a_note(measurements, identity):
    write_calibration(measurements, identity)
    cluster = load_cluster("local")
    shipped = shipped_cluster("local")
    assert not cluster.calibrated
    assert cluster.gpu.efficiency.op_overhead_us == shipped.gpu.efficiency.op_overhead_us
    assert len(cluster.notes) == 1 and "not used" in cluster.notes[0] and str(measurements) in cluster.notes[0]


def test_a_spec_file_named_by_path_is_used_as_given(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(calibrated_local(foreign_identity())))
    cluster = load_cluster(str(path))
    assert cluster.gpu.efficiency.op_overhead_us == 123.0  # the user's choice
    assert not cluster.calibrated and "another machine" in cluster.notes[0]


def test_calibrate_records_the_machine_and_the_spec_loads_back_calibrated():
    cal = Calibration(device="cpu", threads=1, ranks=2, gemm={"fp32": [(1e6, 2e10), (1e9, 6e10)]},
                      bandwidth_GBps=15.0, op_overhead_us=7.5, machine=machine_identity("cpu"))
    mapping = calibrated_spec(load_cluster("local"), cal)
    # the machine, and the share of its cores the figures were timed with: one process alone, 1 thread
    assert mapping["machine"] == {**machine_identity("cpu"), "threads": 1, "ranks": 1}
    from paraplan.hardware_specs.loader import cluster_from_mapping

    assert cluster_from_mapping(mapping, "x").calibrated


def test_a_malformed_identity_is_refused(tmp_path):
    from paraplan.hardware_specs import HardwareSpecError

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(calibrated_local({"device": "cpu", "colour": "blue"})))
    with pytest.raises(HardwareSpecError, match="unknown key 'colour'"):
        load_cluster(str(path))


# ---- measured block times ----

def block_record(identity: dict | None) -> dict:
    rec = {"format": FORMAT, "gpu": "cpu", "spec": {"name": "m"}, "micro_batch": 1, "seq_length": 8, "dtype": "fp32",
           "layers": [{"name": "embed", "fwd_ms": 1.0, "bwd_ms": 2.0}]}
    if identity is not None:
        rec["machine"] = identity
    return rec


@pytest.mark.parametrize(("identity", "found"), [(machine_identity("cpu"), True), (foreign_identity(), False),
                                                 (None, False)], ids=["this-machine", "another-machine", "none"])
def test_block_times_apply_only_on_the_machine_that_measured_them(tmp_path, identity, found):
    (tmp_path / "t.json").write_text(json.dumps(block_record(identity)))
    notes: list[str] = []
    rec = find_measurement("cpu", {"name": "m"}, 1, 8, "fp32", directory=tmp_path, notes=notes)
    assert (rec is not None) == found
    assert (notes == []) == found
    if not found:
        assert "t.json not used" in notes[0]


# ---- automatic calibration and labels ----

class FakeCalibrate:
    """Stands in for calibrate_cluster: writes the shipped spec stamped with this machine's identity."""

    def __init__(self, fail: bool = False):
        self.calls = 0
        self.fail = fail

    def __call__(self, cluster, ranks, quick, out):
        from paraplan.executor.errors import ExecutionError
        from paraplan.hardware_specs import measurements_dir

        self.calls += 1
        if self.fail:
            raise ExecutionError("the calibration runs failed: rank 1 died")
        path = measurements_dir() / f"{cluster}.yaml"
        path.write_text(yaml.safe_dump(calibrated_local(machine_identity("cpu"), op_overhead_us=77.0)))
        return path, Calibration(device="cpu", threads=1, ranks=ranks, seconds=0.5), {}


def test_needs_calibration():
    local, dgx = load_cluster("local"), load_cluster("dgx-h100")
    assert needs_calibration("local", local, any_cluster=False)
    assert not needs_calibration("dgx-h100", dgx, any_cluster=False)  # planning for a cluster elsewhere
    assert needs_calibration("dgx-h100", dgx, any_cluster=True)  # validate runs it here


def test_simulate_on_local_calibrates_first_then_uses_the_calibration(measurements, monkeypatch, capsys):
    fake = FakeCalibrate()
    monkeypatch.setattr(calibrate_module, "calibrate_cluster", fake)
    assert main([*SIMULATE, "--json"]) == 0
    out, err = capsys.readouterr()
    assert fake.calls == 1 and "calibrating it first" in err and "--no-calibrate" in err
    r = json.loads(out)
    assert r["calibrated"] is True and not any("uncalibrated" in n for n in r["notes"])
    # the calibration timed its own model: gpt-tiny's blocks are priced from FLOPs, and the output says so (the
    # prediction changes once they are timed)
    assert any(n.startswith("gpt-tiny's blocks at micro-batch 4 (fp32) have not been timed") for n in r["notes"])
    assert main([*SIMULATE, "--json"]) == 0  # calibrated now: not again
    assert fake.calls == 1 and "calibrating" not in capsys.readouterr().err


def test_plan_says_its_best_plans_blocks_were_not_timed(measurements, monkeypatch, capsys, tmp_path):
    """plan, like simulate, says when the best plan's blocks were priced from FLOPs and bytes rather than timed on
    this machine (the prediction moves once they are): on the console and in the report."""
    monkeypatch.setattr(calibrate_module, "calibrate_cluster", FakeCalibrate())
    out_dir = tmp_path / "report"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8",
                 "--no-charts", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "note: gpt-tiny's blocks at micro-batch" in printed and "have not been timed" in printed
    assert "have not been timed" in (out_dir / "report.md").read_text()


def test_no_calibrate_labels_every_prediction(measurements, monkeypatch, capsys, tmp_path):
    fake = FakeCalibrate()
    monkeypatch.setattr(calibrate_module, "calibrate_cluster", fake)
    assert main([*SIMULATE, "--no-calibrate", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert fake.calls == 0
    assert r["calibrated"] is False and any(n.startswith("uncalibrated") for n in r["notes"])
    assert main([*SIMULATE, "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert "uncalibrated" in out.splitlines()[0] + out.splitlines()[1]  # the table's title
    assert "note: uncalibrated" in out
    path = tmp_path / "p.json"  # --write-plan's prediction carries the note as the output does
    assert main([*SIMULATE, "--no-calibrate", "--write-plan", str(path)]) == 0
    assert any(n.startswith("uncalibrated") for n in json.loads(path.read_text())["prediction"]["notes"])


def test_plan_labels_table_report_and_json(measurements, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PARAPLAN_NO_CALIBRATE", "1")
    report = tmp_path / "report"
    args = ["plan", "--model", "gpt-tiny", "--cluster", "local", "--gpus", "2", "--global-batch", "8", "--no-charts",
            "--out", str(report)]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["calibrated"] is False and r["best"]["calibrated"] is False
    assert any(n.startswith("uncalibrated") for n in r["notes"])
    assert "**uncalibrated" in (report / "report.md").read_text()
    written = json.loads((report / "plan.json").read_text())["prediction"]
    assert written["calibrated"] is False and any(n.startswith("uncalibrated") for n in written["notes"])
    assert main(args) == 0
    assert "uncalibrated" in capsys.readouterr().out


def test_planning_for_a_remote_cluster_never_calibrates(measurements, monkeypatch, capsys):
    fake = FakeCalibrate()
    monkeypatch.setattr(calibrate_module, "calibrate_cluster", fake)
    assert main(["simulate", "--model", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--dp", "8",
                 "--tp", "1", "--pp", "1", "--micro-batch", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert fake.calls == 0 and r["calibrated"] is False
    assert not any("uncalibrated" in n for n in r["notes"])  # not this machine: nothing to measure here


def test_a_failed_calibration_is_one_line_naming_the_way_out(measurements, monkeypatch, capsys):
    monkeypatch.setattr(calibrate_module, "calibrate_cluster", FakeCalibrate(fail=True))
    assert main(SIMULATE) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "calibrating this machine failed" in err[-1] and "--no-calibrate" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_the_cli_labels_uncalibrated_predictions_without_a_traceback():
    """As a user runs it (the suite sets PARAPLAN_NO_CALIBRATE): one JSON object, labelled."""
    p = run_cli(*SIMULATE, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["calibrated"] is False and any(n.startswith("uncalibrated") for n in r["notes"])


# ---- the framework fit ----

def test_robust_fit_shrugs_off_one_disturbed_run():
    """Costs x = (2, 0.5, 1) ms generate exact targets; one run slowed by another process (+60% of its
    time) drags plain least squares away, the Huber-weighted fit stays within 2% of x."""
    rng = np.random.default_rng(0)
    a = rng.uniform(0.0, 10.0, size=(10, 3))
    x = np.array([2.0, 0.5, 1.0])
    b = a @ x
    b[3] += 0.6 * b[3]
    robust, plain = robust_nnls(a, b), nnls(a, b)
    assert robust == pytest.approx(x, rel=0.02)
    assert np.abs(plain - x).max() > 5 * np.abs(robust - x).max()


def test_gemm_sizes_too_slow_to_time_are_skipped(monkeypatch):
    import torch

    monkeypatch.setattr(calibrate_module, "GEMM_CALL_LIMIT_S", 1e-12)
    points = calibrate_module.measure_gemm(torch.device("cpu"), ("fp32",), ((64, 64, 64), (32, 32, 32)), repeats=1)
    assert [f for f, _ in points["fp32"]] == [2.0 * 32 ** 3]  # the smallest only


def test_a_calibration_of_a_busy_machine_says_so():
    import os

    cores = os.cpu_count() or 1
    assert "busy" in Calibration(device="cpu", threads=1, ranks=2, load_before=2.0 * cores).busy_note
    assert Calibration(device="cpu", threads=1, ranks=2, load_before=0.1 * cores).busy_note is None


def test_validate_runs_on_a_busy_machine_say_so():
    """Our own ranks do not count as others' work: 2 ranks on an otherwise idle machine are not busy."""
    import os

    from paraplan.executor.calibrate import busy_note

    cores = os.cpu_count() or 1
    assert busy_note(2.0, 2, "during the runs") is None
    note = busy_note(2.0 + cores, 2, "during the runs")
    assert note is not None and "2 of them ours" in note and note.endswith("during the runs")


def test_a_quick_calibration_to_a_file_says_what_it_left_out_and_how_to_use_it(tmp_path):
    """``calibrate --quick`` fits no framework host costs, which the CPU cluster's step times need: it says so (a QA
    pass found a quick calibration had replaced a full one's, a gpt-tiny dp2 pp2 step then predicted 0.083 s where the
    full one said 0.189 s); and a spec written with --out is not the one `local` reads: the command names
    --cluster FILE instead of claiming 'local' uses it now."""
    out = tmp_path / "quick.yaml"
    p = run_cli("calibrate", "--quick", "--ranks", "1", "--out", str(out),
                env={"PARAPLAN_MEASUREMENTS": str(tmp_path / "measurements")})
    assert p.returncode == 0, p.stderr
    said, noted = " ".join(p.stdout.split()), " ".join(p.stderr.split())  # as the console wrapped them
    assert f"give --cluster {out}" in said and "use it now" not in said
    assert "--quick does not fit the framework's per-event host costs" in noted
    assert "framework_us" not in (yaml.safe_load(out.read_text())["gpu"].get("efficiency") or {})

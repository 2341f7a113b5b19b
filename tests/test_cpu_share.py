"""A CPU cluster's ranks share this machine's cores (planner/cpu_share.py): their kernels run on the threads the
executor gives them, or time-slice where they outnumber the cores."""

from __future__ import annotations

import dataclasses

import pytest

from paraplan.hardware_specs import load_cluster
from paraplan.hardware_specs.identity import cores_per_rank, recorded_cores_per_rank, threads_per_rank
from paraplan.planner.costmodel import CostModel, default_stages
from paraplan.planner.dp_sync import optimizer_step
from paraplan.planner.layout import Layout
from paraplan.planner.placement import layout_placement
from paraplan.planner.workload import Workload

# timings taken by one single-thread process on a 2-core machine (calibrate's record: threads 1, ranks 1)
TWO_CORES = {"device": "cpu", "cpu": "test CPU", "cores": 2, "torch": "x", "threads": 1, "ranks": 1}


@pytest.mark.parametrize("ranks, cores, threads, share", [
    (1, 2, 2, 2.0),  # alone: both cores, two threads
    (2, 2, 1, 1.0),
    (4, 2, 1, 0.5),  # four one-thread processes on two cores: half a core each
    (8, 2, 1, 0.25),
    (3, 8, 2, 2.0),  # 8 // 3 threads each, all backed by cores
])
def test_the_cores_a_rank_gets(ranks, cores, threads, share):
    assert threads_per_rank(ranks, cores) == threads
    assert cores_per_rank(ranks, cores=cores) == share


def test_older_records_are_read_as_two_processes_sharing_the_machine():
    # written before threads and ranks were recorded: calibrate's and validate's default of two processes
    assert recorded_cores_per_rank({"device": "cpu", "cores": 8}, 2) == 4.0
    assert recorded_cores_per_rank({"device": "cpu", "cores": 2, "threads": 1, "ranks": 4}, 2) == 0.5


def _model(machine: dict) -> tuple[CostModel, Workload]:
    cluster = load_cluster("local")
    # host costs as calibrate fits them: a micro-batch's handling, an FSDP unit and a step, 100, 1000 and 500 us
    eff = dataclasses.replace(cluster.gpu.efficiency, framework_us={"micro_batch": 100.0, "fsdp_unit": 1000.0,
                                                                              "step": 500.0})
    cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, efficiency=eff), machine=machine)
    work = Workload.create("gpt-tiny", cluster, global_batch=16)
    return CostModel(work), work


def _block(model: CostModel, dp: int) -> tuple[float, float]:
    """(forward seconds of a transformer layer, a stage's host overhead) on a rank of dp ranks, ZeRO-2."""
    lay = Layout(dp=dp, tp=1, pp=1, micro_batch=1, global_batch=16, schedule="1f1b", zero=2, dtype="fp32")
    cost = model.block_cost(1, lay, layout_placement(model.work.cluster, lay), "none")
    return cost.fwd, model.stage_host_overhead(lay)


def test_kernels_follow_the_cores_and_host_work_only_the_time_slices():
    model, _ = _model(TWO_CORES)
    fwd2, host2 = _block(model, 2)  # 2 ranks on 2 cores: one core each, as the figures were timed
    fwd1, host1 = _block(CostModel(model.work), 4)  # 4 ranks: half a core each
    fwd4, host4 = _block(CostModel(model.work), 8)  # 8 ranks: a quarter
    assert fwd1 == pytest.approx(2 * fwd2) and fwd4 == pytest.approx(4 * fwd2)
    assert host2 == pytest.approx(1100e-6) and host1 == pytest.approx(2 * host2) and host4 == pytest.approx(4 * host2)
    # one rank alone: its kernels on both cores' threads, its host work (one Python thread) no faster
    fwd_alone, host_alone = _block(CostModel(model.work), 1)
    assert fwd_alone == pytest.approx(fwd2 / 2) and host_alone == pytest.approx(100e-6)  # no FSDP unit on one rank
    # figures timed with both cores' threads (threads 2): a one-core rank takes twice their seconds
    faster, _ = _model({**TWO_CORES, "threads": 2})
    assert _block(faster, 2)[0] == pytest.approx(2 * fwd2)


def test_the_optimizer_step_runs_at_the_rank_s_share_too():
    model, _ = _model(TWO_CORES)

    def step(dp: int):
        return optimizer_step(model, Layout(dp=dp, tp=1, pp=1, micro_batch=1, global_batch=16, dtype="fp32"))

    two, four = step(2), step(4)  # without ZeRO every rank updates all its parameters: the same traffic
    assert two.const == pytest.approx(500e-6) and four.const == pytest.approx(2 * two.const)
    assert four.params == pytest.approx(2 * two.params)


def test_utilisation_is_against_the_cores_a_rank_has():
    """One rank alone runs both cores' threads: its MFU is against both cores' peak, never above 100% for running
    twice as fast as the one-core figures."""
    model, _ = _model(TWO_CORES)
    lays = [Layout(dp=dp, tp=1, pp=1, micro_batch=2, global_batch=16, dtype="fp32") for dp in (1, 2, 4)]
    preds = [model.evaluate(lay, default_stages(model, lay)) for lay in lays]
    peak = model.work.cluster.gpu.peak_flops("fp32")
    for pred, cores in zip(preds, (2.0, 1.0, 0.5), strict=True):
        assert pred.mfu == pytest.approx(pred.model_tflops_per_gpu * 1e12 / (peak * cores))


def test_gpus_are_not_cpu_shares():
    work = Workload.create("gpt3-1.3b", "dgx-h100", global_batch=64)
    share = CostModel(work).cpu_share
    assert not share.cpu and share.compute(8) == 1.0 and share.host(8) == 1.0


def test_a_rate_above_the_calibrated_peak_is_noted(monkeypatch):
    """Block times measured faster than the machine's calibrated peak put MFU above 100%: the prediction says so and
    what to do (a calibration taken while the machine was busy); within the peak, no such note."""
    model, _ = _model(TWO_CORES)
    lay = Layout(dp=2, tp=1, pp=1, micro_batch=2, global_batch=16, dtype="fp32")
    pred = model.evaluate(lay, default_stages(model, lay))
    assert pred.hfu <= 1 and not any("calibrated peak" in n for n in pred.notes)
    monkeypatch.setattr(model.cpu_share, "rank_peak_flops", lambda dtype, busy: pred.hardware_tflops_per_gpu * 5e11)
    noted = model.evaluate(lay, default_stages(model, lay))
    assert noted.mfu > 1 and any(n.startswith("200% of the calibrated peak") and "calibrate again" in n
                                 for n in noted.notes)

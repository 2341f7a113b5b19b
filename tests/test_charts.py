"""Charts a reader understands (issue 13): one number for the chosen plan in table, report and timeline; the
timeline zoomed into warm-up, steady state and cool-down; the simulator's activation peak as 1F1B defines it.
"""

from __future__ import annotations

import os
import re

import pytest

from paraplan.planner.api import simulate
from paraplan.planner.charts import gantt, timeline_title, timeline_windows
from paraplan.planner.layout import Layout
from paraplan.planner.refine import simulate_ranked
from paraplan.planner.report import write_report
from paraplan.planner.search import search
from paraplan.planner.simulator import simulate_pipeline
from paraplan.planner.workload import Workload

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("schedule", "first", "last"), [("1f1b", 4, 1), ("gpipe", 8, 8)])
def test_activation_peak_counts_what_each_schedule_holds(schedule, first, last):
    """p = 4 stages, m = 8 micro-batches, 10 bytes saved per micro-batch and stage: 1F1B's first stage holds
    p micro-batches, its last one (Narayanan et al. 2021, Sec. 2.2.1); GPipe holds all m everywhere. A
    backward that ends as the next forward starts frees its activations first."""
    sim = simulate_pipeline(schedule, 4, 1, 8, [1.0] * 4, [2.0] * 4, [0.0] * 4, act_bytes=[10.0] * 4)
    assert sim.peak_activation_bytes[0] == 10 * first
    assert sim.peak_activation_bytes[-1] == 10 * last


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory):
    """The README's demo (llama2-70b, 64 H100s, batch 512), searched and
    written as a report, as `paraplan plan` does."""
    work = Workload.create("llama2-70b", "dgx-h100", 512, nodes=8)
    result = search(work, 64, top_k=3)
    simulate_ranked(result)
    out = tmp_path_factory.mktemp("report")
    files = write_report(result, str(out), [], charts=True)
    return work, result, files


def test_table_report_and_timeline_show_one_number(llama_plan):
    work, result, files = llama_plan
    best = result.best
    assert best.prediction.method == "event simulation"
    # `paraplan simulate` of the same layout and stages prices it identically
    pred, _ = simulate(work, best.layout, best.stages, best.stage_recompute, keep_timeline=True)
    assert pred.iteration_time_s == best.prediction.iteration_time_s
    assert pred.bubble_fraction == best.prediction.bubble_fraction
    report = open(files["report"]).read()
    shown = re.search(r"\| iteration time \| ([0-9.]+) s \|", report).group(1)
    row = next(line for line in report.splitlines() if line.startswith(f"| 1 | {best.layout.short()} |"))
    bubble = row.split(" | ")[6]
    title = timeline_title(pred)
    assert f"{shown} s per iteration" in title and f"bubble {bubble}" in title
    assert open(files["timeline"], "rb").read(8) == PNG


def test_ranked_plans_stay_sorted_after_the_event_simulation(llama_plan):
    _, result, _ = llama_plan
    times = [c.prediction.iteration_time_s for c in result.ranked]
    assert times == sorted(times) and all(c.prediction.fits for c in result.ranked)


def test_titles_count_one_micro_batch_in_the_singular():
    one = Layout(dp=8, tp=1, pp=1, micro_batch=4, global_batch=32)
    assert one.micro_batches_text == "1 micro-batch"
    assert one.replace(micro_batch=2).micro_batches_text == "2 micro-batches"
    pred, _ = simulate(Workload.create("gpt-tiny", "local", 8), one)
    assert timeline_title(pred).endswith(", 1 micro-batch")


def test_a_long_pipeline_is_drawn_as_three_zooms(llama_plan, tmp_path):
    work, result, _ = llama_plan
    best = result.best
    pred, _ = simulate(work, best.layout, best.stages, best.stage_recompute, keep_timeline=True)
    windows = timeline_windows(pred)
    assert len(windows) == 3
    (a0, a1), (b0, b1), (c0, c1) = windows
    assert a0 == 0 and c1 == pred.iteration_time_s  # from the start; to the end, DP sync and optimizer included
    assert a1 < b0 < b1 < c0  # time left out between the zooms
    assert a1 - a0 == pytest.approx(b1 - b0)
    # each zoom spans p + 3 steady-state periods: a few micro-batches, not the 64 of the iteration
    period = max(sum(e.end - e.start for e in pred.sim.timeline if e.rank == r) for r in range(best.layout.pp))
    assert a1 - a0 == pytest.approx((best.layout.pp + 3) * period / best.layout.num_micro_batches)
    gantt(pred, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG


def test_a_short_pipeline_is_drawn_whole(tmp_path):
    work = Workload.create("gpt3-1.3b", "dgx-a100-80gb", 32)
    lay = Layout(dp=2, tp=1, pp=4, micro_batch=4, global_batch=32, schedule="1f1b")
    pred, _ = simulate(work, lay, keep_timeline=True)
    assert timeline_windows(pred) == [(0.0, pred.iteration_time_s)]
    gantt(pred, str(tmp_path / "t.png"), note="uncalibrated")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG


# ---------------- a chart that fails never takes the command down (planner/chart_guard.py) ----------------


def _small_plan():
    work = Workload.create("gpt-tiny", "dgx-a100-80gb", 16, nodes=1)
    result = search(work, 8, top_k=2)
    simulate_ranked(result)
    return result


def test_a_failing_chart_or_re_plan_leaves_a_note_and_the_rest_of_the_report(tmp_path, monkeypatch):
    """One chart raising (a full disk, a broken Pillow) and the scaling re-plans failing: the report,
    plan.json and the other charts are still written; the notes (printed by `plan`, listed in report.md) say
    which chart is missing and why."""
    from paraplan.planner import charts

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    def replans_fail():
        raise RuntimeError("re-plan child died")

    monkeypatch.setattr(charts, "time_breakdown", broken)
    result = _small_plan()
    files = write_report(result, str(tmp_path), replans_fail, charts=True)
    assert "breakdown" not in files and "scaling" not in files
    assert open(files["memory"], "rb").read(8) == PNG
    assert "time breakdown chart not drawn (OSError: No space left on device)" in result.notes
    assert "scaling chart not drawn (RuntimeError: re-plan child died)" in result.notes
    report = open(files["report"]).read()
    assert "note: time breakdown chart not drawn" in report and "time_breakdown.png" not in report
    assert open(files["plan"]).read().strip().startswith("{")


def test_compare_simulate_and_validate_charts_degrade_too(tmp_path, monkeypatch):
    """The same guard behind compare's charts, simulate --gantt and validate's scatter."""
    from paraplan.commands.compare import _draw_charts
    from paraplan.commands.simulate import _draw_gantt
    from paraplan.executor.validate import Row, write_outputs
    from paraplan.planner import charts

    def broken(*args, **kwargs):
        raise ValueError("cannot plot")

    for name in ("time_breakdown", "memory_vs_capacity", "sync_vs_workers", "gantt"):
        monkeypatch.setattr(charts, name, broken)
    work = Workload.create("gpt-tiny", "dgx-a100-80gb", 16, nodes=1)
    notes: list[str] = []
    assert _draw_charts(work, 8, [], [2, 4], {"ring": [1.0, 2.0]}, str(tmp_path), notes) == {}
    assert notes == ["parameter server vs ring chart not drawn (ValueError: cannot plot)"]
    pred, _ = simulate(work, Layout(dp=8, tp=1, pp=1, micro_batch=2, global_batch=16), keep_timeline=True)
    notes = []
    assert _draw_gantt(pred, str(tmp_path / "t.png"), "", notes) is False
    assert notes == ["timeline chart not drawn (ValueError: cannot plot)"]
    monkeypatch.setattr(charts, "predicted_vs_measured", broken)
    row = Row("dp8", "default", Layout(dp=8, tp=1, pp=1, micro_batch=2, global_batch=16))
    row.prediction, row.measured_s = pred, pred.iteration_time_s * 1.1
    stats = {"mape": 0.1, "kendall_tau": float("nan"), "layouts": 1, "measured_fastest": "dp8",
             "recommended": "dp8", "recommended_vs_fastest": 0.0}
    files = write_outputs([row], stats, str(tmp_path), "gpt-tiny")
    assert "chart" not in files
    assert "predicted vs measured chart not drawn (ValueError: cannot plot)" in open(files["report"]).read()
    assert "(one pass over the layouts)" in open(files["report"]).read()  # validate --passes 1 says so
    row.pass_medians_s = [1.1, 1.0]
    report = open(write_outputs([row], stats, str(tmp_path), "gpt-tiny")["report"]).read()
    assert "the fastest of the layout's 2 passes" in report and "one pass" not in report


def test_charts_drawn_beside_each_other_come_out_as_drawn_in_order(tmp_path):
    """chart_guard.draw_files draws the heaviest chart in a forked child: a chart failing there comes back as the
    same note, in the jobs' order; a child that dies leaves its chart to the parent, which draws it; no child is
    left behind."""
    import multiprocessing

    from paraplan.planner.chart_guard import ChartJob, draw_files

    parent = os.getpid()

    def write(path: str) -> None:
        with open(path, "w") as f:
            f.write(str(os.getpid()))

    def broken(path: str) -> None:
        raise OSError("No space left on device")

    def dies_in_a_child(path: str) -> None:
        if os.getpid() != parent:
            os._exit(3)
        write(path)

    jobs = [ChartJob("a", str(tmp_path / "a.txt"), "first", write),
            ChartJob("b", str(tmp_path / "b.txt"), "heavy", broken, weight=3.0),
            ChartJob("c", str(tmp_path / "c.txt"), "third", broken)]
    files, notes = {}, []
    draw_files(files, notes, jobs)
    assert files == {"a": str(tmp_path / "a.txt")}
    assert notes == ["heavy chart not drawn (OSError: No space left on device)",
                     "third chart not drawn (OSError: No space left on device)"]
    jobs = [ChartJob("a", str(tmp_path / "a.txt"), "first", write),
            ChartJob("t", str(tmp_path / "t.txt"), "timeline", dies_in_a_child, weight=3.0)]
    files, notes = {}, []
    draw_files(files, notes, jobs)
    assert set(files) == {"a", "t"} and notes == []
    assert (tmp_path / "t.txt").read_text() == str(parent)  # redrawn here after the child died
    assert multiprocessing.active_children() == []


def _write_pid(*args, path: str, **kwargs) -> None:
    """A stand-in chart: the pid of the process that drew it."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _dying_in_a_child(parent: int):
    """A stand-in chart that kills any process but ``parent`` drawing it (drawn there as :func:`_write_pid`)."""
    def chart(*args, path: str, **kwargs) -> None:
        if os.getpid() != parent:
            os._exit(3)
        _write_pid(path=path)
    return chart


def test_the_chart_server_draws_in_its_child_and_what_it_cannot_is_drawn_here(tmp_path, monkeypatch):
    """chart_guard.ChartServer (forked when `plan` starts, so the drawing's imports are not on the command's path):
    its charts come back with the same notes, in the requests' order; a child that dies before or while drawing
    leaves its charts to this process, which draws them; a Pillow that cannot be imported is one note, no
    chart; no child is left behind."""
    import multiprocessing

    from paraplan.planner import chart_guard, charts
    from paraplan.planner.chart_guard import ChartRequest, ChartServer

    parent = os.getpid()


    def broken(*args, path: str, **kwargs) -> None:
        raise OSError("No space left on device")


    monkeypatch.setattr(charts, "time_breakdown", _write_pid)
    monkeypatch.setattr(charts, "memory_vs_capacity", broken)
    monkeypatch.setattr(charts, "scaling", _dying_in_a_child(parent))
    requests = [ChartRequest("a", str(tmp_path / "a.txt"), "first", "time_breakdown", ([1.0], ["x"])),
                ChartRequest("b", str(tmp_path / "b.txt"), "memory", "memory_vs_capacity", weight=3.0),
                ChartRequest("c", str(tmp_path / "c.txt"), "third", "time_breakdown")]
    files, notes = {}, []
    ChartServer().draw(files, notes, requests)
    assert files == {"a": str(tmp_path / "a.txt"), "c": str(tmp_path / "c.txt")}
    assert notes == ["memory chart not drawn (OSError: No space left on device)"]
    assert (tmp_path / "a.txt").read_text() != str(parent)  # drawn by the server's child
    assert multiprocessing.active_children() == []

    requests = [ChartRequest("a", str(tmp_path / "a.txt"), "first", "time_breakdown"),
                ChartRequest("s", str(tmp_path / "s.txt"), "scaling", "scaling", weight=3.0)]
    files, notes = {}, []
    ChartServer().draw(files, notes, requests)  # the child (and its grandchild) die drawing "s"
    assert set(files) == {"a", "s"} and notes == []
    assert (tmp_path / "s.txt").read_text() == str(parent)
    assert multiprocessing.active_children() == []

    real = chart_guard.charts_module
    monkeypatch.setattr(chart_guard, "charts_module",
                        lambda lines: os._exit(3) if os.getpid() != parent else real(lines))
    files, notes = {}, []
    ChartServer().draw(files, notes, requests[:1])  # the child dies before it is ready
    assert files == {"a": str(tmp_path / "a.txt")} and notes == []
    assert (tmp_path / "a.txt").read_text() == str(parent)

    def no_pillow(lines):
        lines.append("no charts drawn (Pillow: ImportError: libfreetype.so.6)")

    monkeypatch.setattr(chart_guard, "charts_module", no_pillow)
    files, notes = {}, []
    ChartServer().draw(files, notes, requests)
    assert files == {} and notes == ["no charts drawn (Pillow: ImportError: libfreetype.so.6)"]
    assert multiprocessing.active_children() == []


def test_a_failure_beside_the_drawing_stops_every_drawing_process(tmp_path, monkeypatch):
    """ChartServer.draw runs the caller's own work (candidates.csv) while its child draws; if that work fails, the
    child is stopped with the grandchild drawing its heavier share: no chart appears after the command failed."""
    import time

    from paraplan.planner import charts
    from paraplan.planner.chart_guard import ChartRequest, ChartServer

    def slow(*args, path: str, **kwargs) -> None:
        time.sleep(2.0)
        with open(path, "w") as f:
            f.write("late")

    def quick(*args, path: str, **kwargs) -> None:
        with open(path, "w") as f:
            f.write("ok")

    monkeypatch.setattr(charts, "gantt", slow)
    monkeypatch.setattr(charts, "time_breakdown", quick)
    server = ChartServer()  # forked now: the child has the patched charts
    requests = [ChartRequest("t", str(tmp_path / "t.txt"), "timeline", "gantt", weight=3.0),
                ChartRequest("a", str(tmp_path / "a.txt"), "first", "time_breakdown")]

    def fails() -> None:
        time.sleep(0.5)  # the grandchild is drawing by now
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        server.draw({}, [], requests, meanwhile=fails)
    time.sleep(2.5)
    assert not (tmp_path / "t.txt").exists()


def test_charts_asked_for_later_are_drawn_after_the_first_batch(tmp_path, monkeypatch):
    """ChartServer.draw's ``later`` (the report's scaling chart, which waits for its re-plans): asked for after the
    caller's own work, drawn by the same child once the first batch is drawn, recorded after it; where the child dies
    on it, drawn here; no child is left behind."""
    import multiprocessing

    from paraplan.planner import charts
    from paraplan.planner.chart_guard import ChartRequest, ChartServer

    parent = os.getpid()
    order: list[str] = []



    monkeypatch.setattr(charts, "time_breakdown", _write_pid)
    monkeypatch.setattr(charts, "scaling", _dying_in_a_child(parent))
    first = [ChartRequest("a", str(tmp_path / "a.txt"), "first", "time_breakdown")]

    def later_ok() -> list[ChartRequest]:
        order.append("later")
        return [ChartRequest("b", str(tmp_path / "b.txt"), "second", "time_breakdown")]

    files, notes = {}, []
    ChartServer().draw(files, notes, first, meanwhile=lambda: order.append("meanwhile"), later=later_ok)
    assert order == ["meanwhile", "later"] and list(files) == ["a", "b"] and notes == []
    assert (tmp_path / "b.txt").read_text() not in ("", str(parent))  # drawn by the server's child
    assert multiprocessing.active_children() == []

    files = {}
    ChartServer().draw(files, notes, first, later=lambda: [
        ChartRequest("s", str(tmp_path / "s.txt"), "scaling", "scaling")])
    assert list(files) == ["a", "s"] and notes == []
    assert (tmp_path / "s.txt").read_text() == str(parent)  # the child died on it: drawn here
    assert multiprocessing.active_children() == []


# ---------------- the drawing layer (planner/raster.py): ticks, colours and where a bar lands ----------------


def test_ticks_are_round_steps_of_one_two_or_five():
    """Steps of 1, 2 or 5 times a power of ten, the first at least (range / count): 83.6 / 6 = 13.9 -> 20;
    1.4 / 6 = 0.23 -> 0.5. Log axes tick at the powers of their base, 1-2-5 within a decade when asked."""
    from paraplan.planner.raster import log_ticks, nice_ticks, tick_label

    assert nice_ticks(0.0, 83.6, 6) == [0, 20, 40, 60, 80]
    assert nice_ticks(0.3, 1.7, 6) == [0.5, 1.0, 1.5]
    assert log_ticks(6, 80, 2) == [8, 16, 32, 64]
    assert log_ticks(3, 300, 10) == [10, 100]
    assert log_ticks(0.04, 0.375, 10, (1.0, 2.0, 5.0)) == [0.05, 0.1, 0.2]
    assert [tick_label(v) for v in (60000.0, 0.5, 250.0)] == ["60,000", "0.5", "250"]


def test_a_lighter_colour_is_the_colour_at_that_opacity_over_white():
    from paraplan.planner.raster import lighter

    # each channel 255 - 0.6 * (255 - c): 0x4C=76 -> 147.6, 0x72=114 -> 170.4, 0xB0=176 -> 207.6
    assert lighter("#4C72B0", 0.6) == "#94AAD0"


def test_a_bar_lands_where_its_data_coordinates_say(tmp_path):
    """Axes box (10, 10)-(90, 90) for x in [0, 10], y in [0, 10]: the bar x 2-4, y 0-5 covers pixels x 26-42 and
    y 50-90 (y grows downwards); a log2 axis from 1 to 16 puts 4 half way."""
    from PIL import Image

    from paraplan.planner.raster import Axes, Figure

    fig = Figure(100, 100)
    ax = Axes(fig, (10, 10, 90, 90), (0.0, 10.0), (0.0, 10.0))
    ax.bar(2, 4, 0, 5, "#FF0000")
    fig.save(str(tmp_path / "bar.png"))
    image = Image.open(tmp_path / "bar.png").convert("RGB")
    assert image.size == (100, 100)
    assert image.getpixel((34, 70)) == (255, 0, 0)
    assert image.getpixel((60, 30)) == (255, 255, 255) and image.getpixel((34, 45)) == (255, 255, 255)
    assert Axes(fig, (10, 10, 90, 90), (1.0, 16.0), (0.0, 1.0), xbase=2).x(4.0) == pytest.approx(50.0)


def test_a_value_that_is_not_finite_is_a_note_not_a_hang(tmp_path):
    """A prediction holding inf (or NaN) reaches a chart: the chart raises at once (its dashed lines would otherwise
    loop over an endless segment) and chart_guard turns that into a note."""
    from paraplan.planner.chart_guard import draw
    from paraplan.planner.raster import Figure, nice_ticks

    with pytest.raises(ValueError):
        nice_ticks(0.0, float("inf"))
    with pytest.raises(ValueError):
        Figure(10, 10).line([(0.0, 0.0), (float("inf"), 5.0)], "black", dash=4)
    notes: list[str] = []
    from paraplan.planner import charts

    assert not draw(notes, "throughput vs memory", lambda: charts.pareto(
        [10.0, float("nan")], [1.0, 2.0], [True, False], 80.0, str(tmp_path / "p.png"), "t"))
    assert notes and notes[0].startswith("throughput vs memory chart not drawn (ValueError")


def test_the_dry_run_hint_of_another_stacks_plan_says_what_it_traces(tmp_path):
    """The dry run traces paraplan's own executor: a plan priced for Megatron-Core is not told that it checks it."""
    for framework, expected in (("paraplan", "traces what the executor allocates for this plan"),
                                ("megatron-core", "not megatron-core's stack, which this plan is priced for")):
        work = Workload.create("gpt-tiny", "local", 8, framework=framework)
        result = search(work, 8, top_k=1, layouts=[Layout(dp=8, tp=1, pp=1, micro_batch=1, global_batch=8)])
        report = open(write_report(result, str(tmp_path / framework), [], charts=False)["report"]).read()
        assert expected in report

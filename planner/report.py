"""The planner's report folder: report.md, plan.json, candidates.csv and the charts.

Written for a reader who wants the answer first (the layout, its throughput, memory and why it won),
then the alternatives, then what was rejected and why.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable

from . import chart_guard
from .api import plan_for
from .atomic import atomic_open
from .costmodel import CostModel, Prediction
from .exports import report_lines
from .framework import PARAPLAN
from .framework import describe as describe_framework
from .gc_pause import without_gc_pauses
from .placement import layout_placement
from .plan import calibration_notes, label_prediction
from .scaling import ScalingPoint
from .search import Candidate, SearchResult, ranked
from .units import tflops_text

GiB = 2**30


def plan_object(result: SearchResult, cand: Candidate) -> dict:
    """A ranked candidate as the simulate JSON object (prediction keys + ``plan``)."""
    plan = plan_for(result.work, cand.layout, cand.stages, cand.prediction, cand.stage_recompute)
    return {**cand.prediction.to_dict(), "plan": {k: v for k, v in plan.to_dict().items() if k != "prediction"}}


def write_plan(result: SearchResult, cand: Candidate, path: str) -> None:
    plan = plan_for(result.work, cand.layout, cand.stages, cand.prediction, cand.stage_recompute)
    label_prediction(plan, result.work)
    plan.write(path)


def calibration_lines(work) -> list[str]:
    """The report's word on the hardware figures: calibrated on this machine, or uncalibrated and why
    (only where it applies: this machine's cluster, a calibrated spec, or measurements found but not used)."""
    from paraplan.hardware_specs.identity import describe, markdown_notes

    calibrated, notes = calibration_notes(work)
    lines = markdown_notes(notes)
    if calibrated:
        lines.insert(0, f"- hardware figures: calibrated on this machine ({describe(work.cluster.machine)})")
    return lines


def _trace_line(result: SearchResult, best: Candidate) -> str:
    """What the executor's dry run said of the chosen plan (plan --verify), or how to have it."""
    rejected = [c for c in result.candidates if c.status == "traced oom"]
    before = (f" It replaced {len(rejected)} faster plan{'s' if len(rejected) > 1 else ''} whose traced peak exceeds "
              f"the GPU ({', '.join(f'{c.layout.short()}: {c.traced_peak_gib:.1f} GiB' for c in rejected)}).") \
        if rejected else ""
    if best.traced_peak_gib is None and result.work.framework.name != PARAPLAN.name:
        return (f"Memory not checked by a dry run: `paraplan execute --plan plan.json --dry-run` traces what "
                f"paraplan's own executor allocates, not {result.work.framework.name}'s stack, which this plan is "
                "priced for.")
    if best.traced_peak_gib is None:
        return ("Memory not checked by the executor's dry run: `paraplan plan --verify`, or `paraplan execute --plan "
                "plan.json --dry-run`, traces what the executor allocates for this plan.")
    p = best.prediction
    return (f"The executor's dry run (`execute --dry-run`) traced a peak of {best.traced_peak_gib:.1f} GiB vs "
            f"{p.peak_memory_gib:.1f} GiB predicted, of {p.memory_capacity_gib:g} GiB.{before}")


CANDIDATE_COLUMNS = ["rank", "dp", "tp", "pp", "cp", "ep", "etp", "micro_batch", "num_micro_batches", "schedule",
                     "virtual_stages", "zero", "sequence_parallel", "recompute", "status", "iteration_time_s",
                     "tokens_per_s", "mfu", "peak_memory_gib", "lower_bound_s"]


@without_gc_pauses
def write_candidates_csv(result: SearchResult, path: str) -> None:
    """Every candidate, fastest first (then by lower bound), with its status. DeepSeek-V3 on 1024 GPUs writes
    ~950,000 rows, most of them dominated, invalid or pruned on a bound: each line is formatted at once, the prices
    only where there are some, as csv.writer would write it (minimal quoting, CRLF ends) in about a third of its
    time (benchmarks/bench_plan.py)."""
    inf = float("inf")
    order = ranked(c for c in result.candidates if c.status == "ok")
    order = {id(c): i for i, c in enumerate(order, 1)}

    def line(c) -> str:
        lay, p = c.layout, c.prediction
        recompute = "/".join(c.stage_recompute) if c.stage_recompute else lay.recompute
        bound = f"{c.lower_bound_s:.6g}" if c.lower_bound_s != inf else ""
        prices = "," * 4 if p is None else \
            f"{p.iteration_time_s:.6g},{p.tokens_per_s:.6g},{p.mfu:.4f},{p.peak_memory_gib:.3f},"
        return (f"{order.get(id(c), '')},{lay.dp},{lay.tp},{lay.pp},{lay.cp},{lay.ep},{lay.etp},{lay.micro_batch},"
                f"{lay.num_micro_batches},{lay.schedule},{lay.virtual_stages},{lay.zero},"
                f"{lay.sequence_parallel},{_csv_field(recompute)},{_csv_field(c.status_text())},{prices}{bound}\r\n")

    rows = sorted(result.candidates, key=lambda c: (
        c.prediction.iteration_time_s if c.prediction is not None else inf, c.lower_bound_s))
    with atomic_open(path, newline="") as f:
        f.write(",".join(CANDIDATE_COLUMNS) + "\r\n")
        for at in range(0, len(rows), 20000):
            f.write("".join(map(line, rows[at:at + 20000])))


def _csv_field(text: str) -> str:
    """``text`` as a CSV field the way csv.writer's minimal quoting writes it: quoted (quotes doubled) where it
    holds a comma, a quote or a line break."""
    if "," in text or '"' in text or "\n" in text or "\r" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def _why(result: SearchResult) -> list[str]:
    """A few sentences on why the best layout wins, from its breakdown and its neighbours."""
    best = result.ranked[0]
    p, lay = best.prediction, best.layout
    t = p.time_s
    total = p.iteration_time_s
    lines = []
    big = sorted(((v, k) for k, v in t.items() if k != "compute"), reverse=True)[:2]
    lines.append(f"Compute is {100 * t['compute'] / total:.0f}% of the iteration; the largest overheads are "
                 + " and ".join(f"{k.replace('_', ' ')} ({100 * v / total:.1f}%)" for v, k in big) + ".")
    if lay.tp > 1:
        crosses = layout_placement(result.work.cluster, lay).tp.crosses_nodes
        where = "across nodes" if crosses else "inside one node (NVLink-class links)"
        lines.append(f"Tensor parallelism of {lay.tp} splits each layer's weights and activations {where}.")
    if lay.pp > 1:
        lines.append(f"Pipeline parallelism of {lay.pp} ({lay.schedule}"
                     + (f", {lay.virtual_stages} chunks per rank" if lay.virtual_stages > 1 else "")
                     + f") with {lay.micro_batches_text} keeps the bubble at "
                       f"{100 * p.bubble_fraction:.1f}%.")
    if lay.cp > 1:
        lines.append(f"Context parallelism of {lay.cp} splits each sequence over {lay.cp} ranks (activations and "
                     f"logits divided by {lay.cp}); exchanging keys and values costs "
                     f"{100 * t.get('cp_comm', 0.0) / total:.1f}%.")
    if lay.ep > 1:
        lines.append(f"Expert parallelism of {lay.ep} spreads the experts over {lay.ep} ranks; the token "
                     f"all-to-alls cost {100 * t.get('ep_comm', 0.0) / total:.1f}%.")
    if lay.dp > 1:
        lines.append(f"Data parallelism of {lay.dp} with ZeRO-{lay.zero}: the gradient sync costs "
                     f"{100 * t['dp_comm'] / total:.1f}% after overlapping the last backward.")
    modes = Counter(best.stage_recompute or [lay.recompute])
    if len(modes) > 1:
        lines.append("Recomputation differs per pipeline stage (" + ", ".join(
            f"{n} x {u}" for u, n in modes.items()) + "): only the stages that need memory pay for it.")
    elif lay.recompute != "none":
        lines.append(f"{lay.recompute.capitalize()} recomputation is needed to fit in memory.")
    if len(result.ranked) > 1:
        second = result.ranked[1]
        lines.append(f"The runner-up ({second.layout.short()}) is {100 * (second.time_s / best.time_s - 1):.1f}% "
                     "slower.")
    return lines


def _money(result: SearchResult, pred: Prediction, train_tokens: float | None) -> list[str]:
    if not train_tokens:
        return []
    seconds = train_tokens / pred.tokens_per_s
    rows = [f"- time to train on {train_tokens:.3g} tokens: **{seconds / 86400:.1f} days** "
            f"({seconds / 3600:,.0f} hours)"]
    price = result.work.cluster.cost_per_gpu_hour_usd
    if price:
        rows.append(f"- cost at ${price:g} per GPU-hour: **${seconds / 3600 * result.gpus * price:,.0f}**")
    return rows


def write_report(result: SearchResult, out: str, scaling: list[ScalingPoint] | Callable[[], list[ScalingPoint]],
                 train_tokens: float | None = None, charts: bool = True,
                 server: chart_guard.ChartServer | None = None) -> dict[str, str]:
    """Write the whole report folder; returns {what: path}. ``scaling`` may be a call that waits for the
    points (see scaling.ScalingReplans). ``server``: draws the charts in its child (started with the command,
    it has them imported by now) while the candidates are written, the scaling chart last, once its points are in
    (the re-plans may still run when the search ends); without one they are drawn here (chart_guard.draw_files)."""
    os.makedirs(out, exist_ok=True)
    files = {"report": os.path.join(out, "report.md"), "plan": os.path.join(out, "plan.json"),
             "candidates": os.path.join(out, "candidates.csv")}
    best = result.best
    assert best is not None
    write_plan(result, best, files["plan"])
    exports: list[str] = []
    points: list[ScalingPoint] = []

    def beside_the_charts() -> None:  # every candidate, and the export section (it reads plan.json)
        write_candidates_csv(result, files["candidates"])
        exports.extend(report_lines(files["plan"]))  # the export command per framework, or why it cannot take it

    def scaling_points() -> list[ScalingPoint]:  # waits for the re-plans at fewer GPUs where they still run
        if callable(scaling):  # if they fail, no scaling chart or table
            chart_guard.draw(result.notes, "scaling", lambda: points.extend(scaling()))
        else:
            points.extend(scaling)
        faster = fewer_gpus_faster(result, points)
        if faster:
            result.notes.append(faster)
        return points

    if charts and server:
        # the other charts are drawn while the candidates (~90,000 rows for a 1T model's search) are written and the
        # scaling chart's re-plans finish; it is drawn last
        try:
            server.draw(files, result.notes, _chart_requests(result, out), meanwhile=beside_the_charts,
                        later=lambda: _scaling_requests(result, out, scaling_points()))
        finally:
            server.close()
    else:
        scaling_points()
        beside_the_charts()
        if charts:
            chart_guard.draw_files(files, result.notes, [r.job() for r in _chart_requests(result, out, points)])
    for name in CHART_FILES:  # an earlier report's chart this one did not draw would pass for this plan's
        path = os.path.join(out, name)
        if path not in files.values() and os.path.isfile(path):
            os.remove(path)
    work, lay, p = result.work, best.layout, best.prediction
    cl = work.cluster
    # a pruned layout whose memory was never checked (search.time_bound) is counted apart
    status = Counter("pruned unchecked" if c.status == "pruned" and not c.memory_checked else c.status
                     for c in result.candidates)
    reasons = Counter(c.reason if c.status == "invalid" else "out of memory" for c in result.candidates
                      if c.status in ("invalid", "oom"))
    md = [f"# Plan: {work.spec.name} on {result.gpus} x {cl.gpu.name} ({cl.name})", "",
          "## What was asked", "",
          f"- model: `{work.model_ref}` ({p.num_parameters / 1e9:.3g} B parameters"
          + (f", sequence {work.seq_length}" if work.seq_length else "") + ")",
          f"- cluster: {cl.name}: {cl.nodes} nodes x {cl.gpus_per_node} {cl.gpu.name} "
          f"({cl.gpu.memory_GiB:g} GiB), {cl.intra_node.bandwidth_GBps:g} GB/s inside a node, "
          + (f"{cl.inter_node.bandwidth_GBps:g} GB/s per node across" if cl.networked else "no network (one node)"),
          f"- GPUs used: {result.gpus}; global batch {lay.global_batch} samples"
          + (f" ({lay.global_batch * work.tokens_per_sample:,} tokens)" if work.seq_length else "")
          + f"; {result.dtype}",
          f"- priced for framework {describe_framework(work.framework)}", *calibration_lines(work), "",
          "## The chosen layout", "",
          f"**{lay.short()}** — data parallel {lay.dp}, tensor parallel {lay.tp}, pipeline parallel {lay.pp}, "
          f"micro-batch {lay.micro_batch} ({lay.num_micro_batches} per replica), "
          + (f"schedule {lay.schedule}" + (f" with {lay.virtual_stages} chunks per rank" if lay.virtual_stages > 1
                                            else "") + ", " if lay.pp > 1 else "")
          + f"ZeRO-{lay.zero}, recomputation per stage: {', '.join(best.stage_recompute or [lay.recompute])}, "
          + f"sequence parallelism {'on' if lay.sequence_parallel else 'off'}.", "",
          "| predicted | |", "|---|---|",
          f"| iteration time | {p.iteration_time_s:.4g} s |",
          f"| throughput | {p.tokens_per_s:,.0f} tokens/s, {p.samples_per_s:.4g} samples/s |",
          f"| per GPU | {tflops_text(p.model_tflops_per_gpu)} model TFLOP/s (MFU {100 * p.mfu:.1f}%), "
          f"{tflops_text(p.hardware_tflops_per_gpu)} hardware TFLOP/s (HFU {100 * p.hfu:.1f}%) |",
          f"| memory per GPU | {p.peak_memory_gib:.1f} of {p.limit_text()} (params "
          f"{p.memory_gib['params']:.1f}, grads {p.memory_gib['grads']:.1f}, optimizer {p.memory_gib['optimizer']:.1f},"
          f" activations {p.memory_gib['activations']:.1f}, other {p.memory_gib['other']:.1f}) |",
          f"| stages | {', '.join(str(len(s)) for s in best.stages)} blocks |", "",
          _trace_line(result, best), "",
          *_money(result, p, train_tokens), "",
          "Why this layout:", "", *[f"- {x}" for x in _why(result)], "",
          "## Top plans", "",
          "| # | layout | iteration s | tokens/s | MFU | memory GiB | bubble | dp sync |",
          "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(result.ranked, 1):
        q = c.prediction
        md.append(f"| {i} | {c.layout.short()} | {q.iteration_time_s:.4g} | {q.tokens_per_s:,.0f} | "
                  f"{100 * q.mfu:.1f}% | {q.peak_memory_gib:.1f} | {100 * q.bubble_fraction:.1f}% | "
                  f"{q.time_s['dp_comm']:.3g} s |")
    md += ["", "## The search", "",
           f"{len(result.candidates):,} candidate layouts in {result.search_time_s:.2f} s "
           f"({result.ilp_solves} stage-split ILPs solved through PuLP):", "",
           *(f"- note: {n}" for n in result.notes), *([""] if result.notes else [])]
    labels = {"ok": "priced exactly with their ILP stage split (or, in the default mode, interleaved and V layouts "
              "of transformer layers, their quick split polished)", "priced": "priced at a balanced split only, "
              "or bounded there by its closed form (over 5% behind the top plans, or the ILP's bound showed no split "
              "beats them)",
              "pruned": "pruned by a lower bound that cannot beat the top plans",
              "pruned unchecked": "pruned by their pipeline's time alone, which cannot beat the top plans (their "
              "memory not checked: some may not fit)",
              "dominated": "dominated by an equally fast, leaner variant", "oom": "rejected: out of memory",
              "invalid": "rejected: invalid for this model or cluster"}
    for k in ("ok", "priced", "pruned", "pruned unchecked", "dominated", "oom", "invalid"):
        if status.get(k):
            md.append(f"- {status[k]:,} {labels[k]}")
    if reasons:
        md += ["", "Rejections by reason:", ""] + [f"- {n:,} x {r}" for r, n in reasons.most_common(8)]
    if points:
        md += ["", "## Scaling", "", "| GPUs | best layout | tokens/s | per GPU | MFU |", "|---|---|---|---|---|"]
        for sp in points:
            shown, stand_in = sp.shown, sp.stand_in
            if shown is not None:  # the re-plan's best, or the stand-in of one cut short (it fits)
                q = shown.prediction
                name = shown.layout.short() + ("" if shown is sp.best else f" (the chosen layout at dp "
                                                                              f"{shown.layout.dp}, not re-planned: "
                                                                              f"{sp.cut_short})")
                md.append(f"| {sp.gpus} | {name} | {q.tokens_per_s:,.0f} | {q.tokens_per_s / sp.gpus:,.0f} | "
                          f"{100 * q.mfu:.1f}% |")
            elif sp.cut_short:
                q = stand_in.prediction if stand_in is not None else None
                why = f"; the chosen layout at dp {stand_in.layout.dp} needs {q.peak_memory_gib:.1f} of " \
                      f"{q.limit_text()}" if q is not None else ""
                md.append(f"| {sp.gpus} | not known ({sp.cut_short}){why} | | | |")
            else:
                md.append(f"| {sp.gpus} | nothing fits | | | |")
    if charts:
        md += ["", "## Charts", ""]
        for key, title in (("breakdown", "Where the time goes (top plans)"), ("memory", "Memory per GPU"),
                           ("timeline", "Pipeline timeline of the chosen plan"), ("scaling", "Throughput vs GPUs"),
                           ("pareto", "Throughput vs memory")):
            if key in files:
                md += [f"### {title}", "", f"![{title}]({os.path.basename(files[key])})", ""]
    md += ["", "Files: `plan.json` (run it with `paraplan execute --plan plan.json`), `candidates.csv` (every "
           "candidate with its status).", ""]
    md += exports
    with atomic_open(files["report"]) as f:
        f.write("\n".join(md))
    return files


CHART_FILES = ("time_breakdown.png", "memory.png", "timeline.png", "scaling.png", "pareto.png")


def fewer_gpus_faster(result: SearchResult, scaling: list[ScalingPoint]) -> str:
    """A note where a re-plan on fewer GPUs (the scaling table's) trains faster than the best plan on all of them:
    the search uses every GPU it is given, and a small job spread over more of them (across nodes) can be slower."""
    best = result.best
    if best is None:
        return ""
    quicker = [sp for sp in scaling if sp.best is not None and sp.gpus < result.gpus and
               sp.best.prediction.tokens_per_s > best.prediction.tokens_per_s]
    if not quicker:
        return ""
    top = max(quicker, key=lambda sp: sp.best.prediction.tokens_per_s)
    return (f"{top.gpus} GPUs train faster than {result.gpus}: {top.best.layout.short()} at "
            f"{top.best.prediction.tokens_per_s:,.0f} tokens/s against {best.prediction.tokens_per_s:,.0f} (the "
            f"search uses every GPU it is given; plan --gpus {top.gpus} plans on fewer)")


def _chart_requests(result: SearchResult, out: str,
                    scaling: list[ScalingPoint] | None = None) -> list[chart_guard.ChartRequest]:
    """The report's charts as chart_guard draws them (data only: they go to the drawing child through a pipe), the
    scaling chart where ``scaling`` has points (:func:`_scaling_requests`)."""
    request = functools.partial(_request, out)
    preds = [c.prediction for c in result.ranked]
    labels = [c.layout.short() for c in result.ranked]
    title = f"{result.work.spec.name} on {result.gpus} x {result.work.cluster.gpu.name}"
    requests = [request("breakdown", "time_breakdown.png", "time breakdown", "time_breakdown", preds, labels,
                        title=f"Where the time goes — {title}"),
                request("memory", "memory.png", "memory", "memory_vs_capacity", preds, labels,
                        title=f"Memory per GPU — {title}")]
    best = result.ranked[0]
    if best.prediction.method == "event simulation":  # what the report prints (planner/refine.py), drawn
        model = result.model or CostModel(result.work)
        sims = []
        if chart_guard.draw(result.notes, "timeline", lambda: sims.append(model.evaluate(
                best.layout, best.stages, best.stage_recompute, simulate=True, keep_timeline=True))):
            # a long pipeline's is the dearest chart, though zoomed to its warm-up, a window of its steady state and
            # its cool-down: the demo's (4,096 bars) 0.030 s against 0.015-0.023 s for each of the others
            bars = len(sims[0].sim.timeline)
            requests.append(request("timeline", "timeline.png", "timeline", "gantt", sims[0],
                                    weight=1.5 if bars > 500 else 0.5))
    requests += _scaling_requests(result, out, scaling)
    priced = [c.prediction for c in result.candidates if c.prediction is not None]
    if priced:  # the points alone (thousands of predictions would be slow to send)
        top = {id(c.prediction) for c in result.ranked}
        requests.append(request("pareto", "pareto.png", "throughput vs memory", "pareto",
                                [p.peak_memory_gib for p in priced], [p.tokens_per_s for p in priced],
                                [id(p) in top for p in priced], priced[0].memory_capacity_gib,
                                title=f"Throughput vs memory — {title}"))
    return requests


def _request(out: str, key: str, name: str, what: str, chart: str, *args, weight: float = 1.0,
             **kwargs) -> chart_guard.ChartRequest:
    """One chart of the report folder ``out``: file ``name``, drawn by charts.``chart``(*args, **kwargs)."""
    return chart_guard.ChartRequest(key, os.path.join(out, name), what, chart, args, kwargs, weight)


def _scaling_requests(result: SearchResult, out: str,
                      scaling: list[ScalingPoint] | None) -> list[chart_guard.ChartRequest]:
    """The scaling chart's request, where there are points (none: no chart)."""
    if not scaling:
        return []
    return [_request(out, "scaling", "scaling.png", "scaling", "scaling", [s.gpus for s in scaling],
                     [s.shown.prediction if s.shown else None for s in scaling],
                     title=f"Throughput vs GPU count — {result.work.spec.name}",
                     labels=[s.shown.layout.short() if s.shown else "" for s in scaling],
                     stand_ins=[s.best is None and s.shown is not None for s in scaling])]

"""Charts of predictions, drawn as PNG files by planner/raster.py (Pillow; no display, no matplotlib)."""

from __future__ import annotations

import math

from .costmodel import Prediction
from .raster import NORMAL, SMALL, SMOOTH, TITLE, Axes, Figure, lighter, log_ticks, nice_ticks, tick_label
from .schedules import rank_stages

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "dp": "#8172B2", "opt": "#937860"}
TIME_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "ep_comm", "cp_comm",
             "host")
TIME_COLORS = ["#4C72B0", "#8DA0CB", "#DD8452", "#C44E52", "#8172B2", "#CCCCCC", "#937860", "#DA8BC3", "#64B5CD",
               "#8C8C8C"]

TIMELINE_WIDTH_PX = 1440
LABEL_PX = 10  # the micro-batch numbers' font size; a bar carries its number where it is wide enough to hold it
PAD = 12  # pixels between a chart's edge and what it holds


def timeline_windows(pred: Prediction) -> list[tuple[float, float]]:
    """The spans of one iteration the timeline draws: all of it when it is short, else three zooms of the
    same width, warm-up (from 0), steady state (around the middle) and cool-down (to the end of the
    iteration, DP sync and optimizer included). The width is p + 3 steady-state periods, a period being
    the busiest rank's work per micro-batch: the pipeline's fill and a few steady periods on either side."""
    tl = pred.sim.timeline
    p, m = pred.layout.pp, pred.layout.num_micro_batches
    end = pred.iteration_time_s
    busy = max(sum(e.end - e.start for e in tl if e.rank == r) for r in range(p))
    width = (p + 3) * busy / m
    makespan = max(e.end for e in tl)
    if makespan <= 3.6 * width:
        return [(0.0, end)]
    mid = makespan / 2
    return [(0.0, width), (mid - width / 2, mid + width / 2), (makespan - width, end)]


def timeline_title(pred: Prediction) -> str:
    """The timeline's headline: the prediction's iteration time and bubble, formatted as the report prints them."""
    return (f"{pred.layout.short()}: {pred.iteration_time_s:.4g} s per iteration, bubble "
            f"{100 * pred.bubble_fraction:.1f}%, {pred.layout.micro_batches_text}")


def gantt(pred: Prediction, path: str, title: str = "", note: str = "") -> None:
    """Per-rank pipeline timeline of one iteration: forward, backward, weight-gradient, DP sync and optimizer;
    gaps are bubbles. A long iteration is drawn as three zooms (:func:`timeline_windows`) with a break
    between them, so warm-up, steady state and cool-down stay readable; the title's time and bubble are
    the prediction's own (the figures the report and `simulate` print)."""
    if pred.sim is None or not pred.sim.timeline:
        raise AssertionError("gantt needs a prediction made with keep_timeline=True")
    p, m, v = pred.layout.pp, pred.layout.num_micro_batches, pred.layout.virtual_stages
    timeline = pred.sim.timeline
    windows = timeline_windows(pred)
    spans_s = [b - a for a, b in windows]
    above = 126 if len(windows) > 1 else 96  # pixels above the ranks: title, legend (and the zooms' names)
    below, row = 52, 54
    fig = Figure(TIMELINE_WIDTH_PX, above + below + row * p)
    left, right, gap = 115, TIMELINE_WIDTH_PX - 14, 18
    room = right - left - gap * (len(windows) - 1)
    schedule = pred.layout.schedule if p > 1 else "1f1b"
    # a rank's later model chunks (interleaved, zb-v) are drawn lighter than its first
    chunk_of = {s: rs.index(s) for r in range(p) for rs in [rank_stages(schedule, r, p, v)] for s in rs}
    tail = pred.iteration_time_s - pred.time_s["optimizer"]
    x0, panels = left, []
    for i, (lo, hi) in enumerate(windows):
        width = room * spans_s[i] / sum(spans_s)
        ax = Axes(fig, (x0, above, x0 + width, above + row * p), (lo, hi), (-0.5, p - 0.5), yflip=True)
        panels.append(ax)
        x0 += width + gap
        shown = [e for e in timeline if e.start < hi and e.end > lo]
        edges = len(shown) <= 4000  # a white edge between neighbouring bars, where they are few enough to see
        for e in shown:
            color = COLORS[e.kind] if not chunk_of.get(e.stage, 0) else lighter(COLORS[e.kind], 0.6)
            px = ax.x(min(e.end, hi)) - ax.x(max(e.start, lo))
            ax.bar(max(e.start, lo), min(e.end, hi), e.rank - 0.4, e.rank + 0.4, color,
                   outline="white" if edges and px >= 3 else None)
            number = str(e.micro_batch + 1)
            if px >= 4 + 6 * len(number):  # the micro-batch's number where the bar holds it (6 px a digit)
                fig.text((ax.x(max(e.start, lo)) + ax.x(min(e.end, hi))) / 2, ax.y(e.rank), number, LABEL_PX,
                         color="white")
        for r in range(p):
            end, sync = pred.rank_finish_s[r], pred.rank_dp_exposed_s[r]
            if sync > 0 and end < hi:
                ax.bar(max(end, lo), min(end + sync, hi), r - 0.4, r + 0.4, COLORS["dp"])
            if tail < hi:
                ax.bar(max(tail, lo), min(pred.iteration_time_s, hi), r - 0.4, r + 0.4, COLORS["opt"])
        ax.frame(left=i == 0, right=i == len(windows) - 1)
        ax.xticks(nice_ticks(lo, hi, max(2, int(width / 110))))
    names = ["warm-up", "steady state", "cool-down"] if len(windows) == 3 else []
    for ax, name, (lo, hi) in zip(panels, names, windows, strict=False):
        mbs = sorted({e.micro_batch + 1 for e in timeline if e.start < hi and e.end > lo})
        fig.text((ax.box[0] + ax.box[2]) / 2, above - 8, f"{name}: micro-batches {mbs[0]}-{mbs[-1]} of {m}"
                 if mbs else name, NORMAL, anchor="mb")
    for a, b in zip(panels, panels[1:], strict=False):  # a broken axis: // marks where time is left out
        for x in (a.box[2], b.box[0]):
            for y in (a.box[1], a.box[3]):
                fig.line([(x - 5, y + 6), (x + 5, y - 6)], "black", 1)
    panels[0].yticks(list(range(p)), [f"pp rank {r}" for r in range(p)], NORMAL)
    fig.text(TIMELINE_WIDTH_PX / 2, above + row * p + 26, "seconds into the iteration" + (
        "  (three zooms of one iteration; // marks time left out: the steady state repeats)"
        if len(windows) > 1 else ""), NORMAL, anchor="mt")
    kinds = {e.kind for e in timeline} | ({"dp"} if max(pred.rank_dp_exposed_s) > 0 else set()) | {"opt"}
    entries = [(label, COLORS[k], "patch") for k, label in (
        ("F", "forward"), ("B", "backward"), ("W", "weight gradient (zero bubble)"), ("dp", "DP sync (exposed)"),
        ("opt", "optimizer")) if k in kinds]
    if v > 1:
        entries.append(("lighter: the rank's later model chunk", lighter(COLORS["F"], 0.6), "patch"))
    fig.text(TIMELINE_WIDTH_PX / 2, 10, (title or timeline_title(pred)) + (f" — {note}" if note else ""), TITLE,
             anchor="mt")
    fig.legend(entries, TIMELINE_WIDTH_PX / 2, 44, columns=len(entries), anchor="mt")
    fig.save(path)


def _plot_area(fig: Figure, title: str, ylabel: str, ylabels: list[str], bottom: float, right: float) -> tuple:
    """The axes' pixel box on ``fig``: room left for the y label and ``ylabels``, above for ``title``, ``bottom``
    pixels below and ``right`` pixels on the right; the title and y label drawn."""
    tick_w = max((fig.text_size(t, SMALL)[0] for t in ylabels), default=0.0)
    left = PAD + NORMAL + 8 + tick_w + 10
    top = PAD + TITLE + 14
    box = (left, top, fig.width - PAD - right, fig.height - bottom)
    fig.text(fig.width / 2, PAD, title, TITLE, anchor="mt")
    fig.text(PAD + NORMAL / 2, (box[1] + box[3]) / 2, ylabel, NORMAL, rotate=90)
    return box


def _stacked(preds: list[Prediction], labels: list[str], parts: list[tuple[str, str, object]], ylabel: str,
             title: str, path: str, capacity_gib: float | None = None) -> None:
    """Stacked bars, one per plan: ``parts`` are (legend, colour, value of a prediction); the legend on the right,
    the plans' names slanted under their bars; ``capacity_gib``: a dashed line at the GPU's memory."""
    values = [[value(p) for _, _, value in parts] for p in preds]
    top = max([sum(v) for v in values] + [capacity_gib or 0.0, 1e-12])
    ticks = nice_ticks(0.0, top * 1.05, 6)
    entries = [(label, color, "patch") for label, color, _ in parts]
    if capacity_gib is not None:
        entries.append((f"GPU memory {capacity_gib:g} GiB", "black", "dashed"))
    probe = Figure(1, 1)
    legend_w = 26 + max(probe.text_size(label, SMALL)[0] for label, _, _ in entries)
    sizes = [probe.text_size(label, SMALL) for label in labels]
    slant = max((w * math.sin(math.radians(30)) + h * math.cos(math.radians(30)) for w, h in sizes), default=0.0)
    bottom = 16 + slant
    fig = Figure(round(max(720, 132 * len(preds) + 240) + legend_w), 540 + round(max(0.0, bottom - 110)))
    box = _plot_area(fig, title, ylabel, [tick_label(t) for t in ticks], bottom, legend_w + 16)
    ax = Axes(fig, box, (-0.6, len(preds) - 0.4), (0.0, max(ticks[-1], top * 1.05)))
    for i, vals in enumerate(values):
        base = 0.0
        for (_, color, _), v in zip(parts, vals, strict=True):
            if v > 0:
                ax.bar(i - 0.4, i + 0.4, base, base + v, color)
            base += v
    if capacity_gib is not None:
        ax.hline(capacity_gib)
    ax.frame()
    ax.yticks(ticks)
    ax.xticks(list(range(len(preds))), labels, rotate=30)
    fig.legend(entries, box[2] + 16, box[1], anchor="lt")
    fig.save(path)


def time_breakdown(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked bars: where each plan's iteration time goes."""
    parts = [(k.replace("_", " "), c, lambda p, k=k: p.time_s.get(k, 0.0)) for k, c in zip(TIME_KEYS, TIME_COLORS,
                                                                                            strict=True)]
    _stacked(preds, labels, parts, "seconds per iteration", title, path)


def memory_vs_capacity(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked memory per GPU (most loaded rank) against the GPU's capacity."""
    keys = ("params", "grads", "optimizer", "activations", "other")
    colors = ["#4C72B0", "#55A868", "#DD8452", "#C44E52", "#CCCCCC"]
    parts = [(k, c, lambda p, k=k: p.memory_gib[k]) for k, c in zip(keys, colors, strict=True)]
    _stacked(preds, labels, parts, "GiB per GPU (most loaded rank)", title, path,
             capacity_gib=preds[0].memory_capacity_gib if preds else 0.0)


def _line_chart(title: str, xlabel: str, ylabel: str, xs_all: list[float], ys_all: list[float],
                entries: list[tuple[str, str, str]], xbase: float = 0.0, ybase: float = 0.0,
                xlim: tuple[float, float] | None = None, xticks: list[float] | None = None):
    """A 840 x 540 chart with its axes drawn and the legend under the x label: (figure, axes) to plot on."""
    fig = Figure(840, 540, SMOOTH)
    if ybase:
        ylo, yhi = min(ys_all) / 1.3, max(ys_all) * 1.3
        yt = log_ticks(ylo, yhi, ybase)
        yt = yt if len(yt) >= 4 else log_ticks(ylo, yhi, ybase, (1.0, 2.0, 5.0))
    else:
        ylo, yhi = 0.0, max(ys_all + [1e-12]) * 1.08
        yt = nice_ticks(ylo, yhi, 6)
        yhi = max(yhi, yt[-1])
    rows = math.ceil(len(entries) / 2)
    box = _plot_area(fig, title, ylabel, [tick_label(t) for t in yt], 50 + 19 * rows, 0.0)
    if xlim is None:
        xlim = (min(xs_all) / 1.3, max(xs_all) * 1.3) if xbase else (0.0, max(xs_all + [1e-12]) * 1.05)
    ax = Axes(fig, box, xlim, (ylo, yhi), xbase=xbase, ybase=ybase)
    ax.frame()
    ax.yticks(yt)
    ax.xticks(xticks if xticks is not None else nice_ticks(*xlim, 7))
    fig.text((box[0] + box[2]) / 2, box[3] + 22, xlabel, NORMAL, anchor="mt")
    fig.legend(entries, (box[0] + box[2]) / 2, box[3] + 42, columns=2, anchor="mt")
    return fig, ax


def scaling(gpus: list[int], preds: list[Prediction | None], path: str, title: str,
            labels: list[str] | None = None, stand_ins: list[bool] | None = None) -> None:
    """Throughput of the best plan at each GPU count, against perfect linear scaling from the smallest.
    ``labels``: each point's layout (default: its prediction's layout). ``stand_ins``: the points that are not
    re-plans but the chosen layout at that count by its data parallelism (scaling.same_shape: the re-plan ran out
    of time), in their own colour and legend entry."""
    labels = labels or [p.layout.short() if p is not None else "" for p in preds]
    stand_ins = stand_ins or [False] * len(gpus)
    pts = [(g, p.tokens_per_s, lbl, s) for g, p, lbl, s in zip(gpus, preds, labels, stand_ins, strict=True)
           if p is not None]
    known = [p for p in preds if p is not None]
    unit = "tokens/s" if known and known[0].tokens_per_s != known[0].samples_per_s else "samples/s"
    xs = [g for g, _, _, _ in pts]
    linear = [pts[0][1] * x / pts[0][0] for x in xs] if pts else []
    entries = [("best plan (replanned at each count)", "#4C72B0", "line"),
               ("linear from the smallest", "#999999", "dashed")]
    if any(s for *_, s in pts):
        entries.append(("chosen layout, dp scaled (re-plan cut short)", "#DD8452", "dot"))
    fig, ax = _line_chart(title, "GPUs", unit, [float(g) for g in gpus], [y for _, y, _, _ in pts] + linear, entries,
                          xbase=2, xticks=[float(g) for g in gpus])
    if pts:
        ax.plot(xs, linear, "#999999", dash=5)
        ax.plot(xs, [y for _, y, _, _ in pts], "#4C72B0")
        widest = max(gpus)
        for x, y, name, stand_in in pts:  # each point's layout under it; above it, on its left, at the right edge
            fig.dot(ax.x(x), ax.y(y), 4, "#DD8452" if stand_in else "#4C72B0")
            last = x == widest
            fig.text(ax.x(x) + (-6 if last else 6), ax.y(y) + (-6 if last else 6), name.replace(" mb", "\nmb", 1), 10,
                     anchor="rb" if last else "lt")
    fig.save(path)


def pareto(memory_gib: list[float], tokens_per_s: list[float], highlight: list[bool], capacity_gib: float, path: str,
           title: str) -> None:
    """Every priced candidate's throughput against its memory per GPU (most loaded rank), with the Pareto front;
    the ``highlight`` ones (the top plans) marked, the GPU's memory as a line."""
    xs, ys = memory_gib, tokens_per_s
    entries = [("candidates", "#AAAAAA", "dot"), ("Pareto front (faster or leaner)", "#C44E52", "line"),
               ("top plans", "#4C72B0", "dot"), ("GPU memory", "black", "dashed")]
    fig, ax = _line_chart(title, "GiB per GPU (most loaded rank)", "tokens/s", list(xs) + [capacity_gib], list(ys),
                          entries)
    for x, y in zip(xs, ys, strict=True):
        fig.dot(ax.x(x), ax.y(y), 1.6, "#AAAAAA")
    front, best_y = [], -1.0
    for x, y in sorted(zip(xs, ys, strict=True)):
        if y > best_y:
            front.append((x, y))
            best_y = y
    if front:  # a step after each point: the best throughput for at most that much memory
        steps = [pt for (x, y), nxt in zip(front, front[1:] + [None], strict=True)
                 for pt in ([(x, y), (nxt[0], y)] if nxt else [(x, y)])]
        ax.plot([x for x, _ in steps], [y for _, y in steps], "#C44E52")
    for x, y, h in zip(xs, ys, highlight, strict=True):
        if h:
            fig.dot(ax.x(x), ax.y(y), 4, "#4C72B0")
    if xs:
        ax.vline(capacity_gib)
    fig.save(path)


def sync_vs_workers(workers: list[int], series: dict[str, list[float]], path: str, title: str) -> None:
    """Gradient sync time against the number of data-parallel workers, one line per architecture."""
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860"]
    names = list(series)
    ys_all = [y for ys in series.values() for y in ys if y > 0]
    fig, ax = _line_chart(title, "data-parallel workers", "gradient sync per iteration (s)",
                          [float(w) for w in workers], ys_all or [1.0],
                          [(n, palette[i % len(palette)], "line") for i, n in enumerate(names)], xbase=2, ybase=10,
                          xticks=[float(w) for w in workers])
    for i, name in enumerate(names):
        ax.plot(workers, [max(y, 1e-300) for y in series[name]], palette[i % len(palette)], dots=3.5)
    fig.save(path)


def predicted_vs_measured(measured_s: list[float], predicted_s: list[float], numbers: list[int], pick: int | None,
                          path: str, title: str, subtitle: str) -> None:
    """Predicted against measured step time, log-log in milliseconds: each point numbered as in the validation
    table (names would overlap in a cluster), the ``pick`` (an index) starred, y = x dashed and +-15% shaded."""
    lo, hi = min(measured_s + predicted_s) * 0.8, max(measured_s + predicted_s) * 1.25
    ticks = log_ticks(lo, hi, 10, (1.0, 2.0, 5.0))
    labels = [f"{1e3 * t:.6g}" for t in ticks]
    fig = Figure(720, 720, SMOOTH)
    left = PAD + NORMAL + 8 + max(fig.text_size(t, SMALL)[0] for t in labels) + 10
    top = PAD + 2 * TITLE + 20
    box = (left, top, fig.width - PAD - 8, fig.height - 100)
    ax = Axes(fig, box, (lo, hi), (lo, hi), xbase=10, ybase=10)
    fig.polygon([(ax.x(lo), ax.y(lo * 0.85)), (ax.x(hi), ax.y(hi * 0.85)), (ax.x(hi), ax.y(hi * 1.15)),
                 (ax.x(lo), ax.y(lo * 1.15))], "#EEEEEE")
    ax.plot([lo, hi], [lo, hi], "black", 1.0, dash=5)
    fig.rect(0, 0, box[0], fig.height, fill="white")  # the shaded band cut at the axes
    fig.rect(0, box[3], fig.width, fig.height, fill="white")
    fig.rect(0, 0, fig.width, box[1], fill="white")
    fig.rect(box[2], 0, fig.width, fig.height, fill="white")
    for i, (x, y) in enumerate(zip(measured_s, predicted_s, strict=True)):
        fig.dot(ax.x(x), ax.y(y), 4, "#4C72B0")
        fig.text(ax.x(x) + 5, ax.y(y) - 5, str(numbers[i]), SMALL, anchor="lb")
    if pick is not None:
        fig.star(ax.x(measured_s[pick]), ax.y(predicted_s[pick]), 9, "#C44E52")
    ax.frame()
    ax.xticks(ticks, labels)
    ax.yticks(ticks, labels)
    fig.text(fig.width / 2, PAD, title, TITLE, anchor="mt")
    fig.text(fig.width / 2, PAD + TITLE + 6, subtitle, NORMAL, anchor="mt")
    fig.text(PAD + NORMAL / 2, (box[1] + box[3]) / 2, "predicted step time (ms)", NORMAL, rotate=90)
    fig.text((box[0] + box[2]) / 2, box[3] + 24, "measured step time (ms)", NORMAL, anchor="mt")
    entries = [("y = x", "black", "dashed"), ("+-15%", "#DDDDDD", "patch")]
    if pick is not None:
        entries.insert(0, ("planner's pick", "#C44E52", "star"))
    fig.legend(entries, (box[0] + box[2]) / 2, box[3] + 48, columns=len(entries), anchor="mt")
    fig.save(path)

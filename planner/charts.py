"""Charts of predictions (matplotlib, Agg backend: files only, no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .costmodel import Prediction  # noqa: E402
from .schedules import rank_stages  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "dp": "#8172B2", "opt": "#937860"}
TIME_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "ep_comm")
TIME_COLORS = ["#4C72B0", "#8DA0CB", "#DD8452", "#C44E52", "#8172B2", "#CCCCCC", "#937860", "#DA8BC3"]


FIGURE_WIDTH_IN, DPI = 12.0, 120
LABEL_MIN_PX = 9  # a bar narrower than this carries no micro-batch number


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
            f"{100 * pred.bubble_fraction:.1f}%, {pred.layout.num_micro_batches} micro-batches")


def gantt(pred: Prediction, path: str, title: str = "", note: str = "") -> None:
    """Per-rank pipeline timeline of one iteration: forward, backward, weight-gradient, DP sync and optimizer;
    gaps are bubbles. A long iteration is drawn as three zooms (:func:`timeline_windows`) with a break
    between them, so warm-up, steady state and cool-down stay readable; the title's time and bubble are
    the prediction's own (the figures the report and `simulate` print)."""
    if pred.sim is None or not pred.sim.timeline:
        raise AssertionError("gantt needs a prediction made with keep_timeline=True")
    p, m, v = pred.layout.pp, pred.layout.num_micro_batches, pred.layout.virtual_stages
    windows = timeline_windows(pred)
    spans_s = [b - a for a, b in windows]
    above = 1.05 if len(windows) > 1 else 0.8  # inches above the ranks: title, legend (and the zooms' names)
    height = above + 0.65 + 0.45 * p
    fig, axes = plt.subplots(1, len(windows), sharey=True, figsize=(FIGURE_WIDTH_IN, height),
                             gridspec_kw={"width_ratios": spans_s}, squeeze=False)
    fig.subplots_adjust(left=0.08, right=0.99, top=1 - above / height, bottom=0.65 / height, wspace=0.05)
    axes = list(axes[0])
    # one collection per (rank, kind, chunk): a 1T-parameter plan has ~25,000 actions, which one bar each cannot
    # draw; a rank's later model chunks (interleaved, zb-v) are drawn lighter than its first
    schedule = pred.layout.schedule if p > 1 else "1f1b"
    chunk_of = {s: rs.index(s) for r in range(p) for rs in [rank_stages(schedule, r, p, v)] for s in rs}
    spans: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for e in pred.sim.timeline:
        spans.setdefault((e.rank, e.kind, min(chunk_of.get(e.stage, 0), 1)), []).append((e.start, e.end - e.start))
    tail = pred.iteration_time_s - pred.time_s["optimizer"]
    plot_px = FIGURE_WIDTH_IN * DPI * 0.88  # the axes' share of the figure's width
    for ax, (lo, hi) in zip(axes, windows, strict=True):
        shown = [(key, [(a, w) for a, w in xs if a < hi and a + w > lo]) for key, xs in spans.items()]
        drawn = sum(len(xs) for _, xs in shown)
        edges = {"edgecolor": "white", "linewidth": 0.4} if drawn <= 4000 else {}
        for (rank, kind, chunk), xs in shown:
            if xs:
                ax.broken_barh(xs, (rank - 0.4, 0.8), facecolor=COLORS[kind], alpha=0.6 if chunk else 1.0, **edges)
        px_per_s = plot_px / sum(spans_s)  # the panels' widths are in proportion to their spans
        for e in pred.sim.timeline:  # micro-batch numbers where a bar is wide enough to hold one
            if e.start < hi and e.end > lo and (min(e.end, hi) - max(e.start, lo)) * px_per_s >= LABEL_MIN_PX:
                ax.text((max(e.start, lo) + min(e.end, hi)) / 2, e.rank, str(e.micro_batch + 1), ha="center",
                        va="center", fontsize=6, color="white", clip_on=True)
        for r in range(p):
            end, sync = pred.rank_finish_s[r], pred.rank_dp_exposed_s[r]
            if sync > 0 and end < hi:
                ax.barh(r, sync, left=end, height=0.8, color=COLORS["dp"])
            if tail < hi:
                ax.barh(r, pred.time_s["optimizer"], left=tail, height=0.8, color=COLORS["opt"])
        ax.set_xlim(lo, hi)
        ax.tick_params(axis="x", labelsize=7)
    names = ["warm-up", "steady state", "cool-down"] if len(windows) == 3 else []
    for ax, name, (lo, hi) in zip(axes, names, windows, strict=False):
        mbs = sorted({e.micro_batch + 1 for e in pred.sim.timeline if e.start < hi and e.end > lo})
        ax.set_title(f"{name}: micro-batches {mbs[0]}-{mbs[-1]} of {m}" if mbs else name, fontsize=8)
    for left, right in zip(axes, axes[1:], strict=False):  # a broken axis: // marks where time is left out
        left.spines["right"].set_visible(False)
        right.spines["left"].set_visible(False)
        right.tick_params(axis="y", left=False)
        for ax, x in ((left, 1.0), (right, 0.0)):
            kw = {"transform": ax.transAxes, "color": "black", "clip_on": False, "linewidth": 1}
            for y in (0.0, 1.0):
                ax.plot([x - 0.012, x + 0.012], [y - 0.03, y + 0.03], **kw)
    axes[0].set_yticks(range(p))
    axes[0].set_yticklabels([f"pp rank {r}" for r in range(p)])
    axes[0].set_ylim(p - 0.5, -0.5)  # rank 0 on top
    fig.supxlabel("seconds into the iteration" + ("  (three zooms of one iteration; // marks time left out: the "
                                                  "steady state repeats)" if len(windows) > 1 else ""), fontsize=8,
                  y=0.05 / height, va="bottom")
    headline = title or timeline_title(pred)
    kinds = {e.kind for e in pred.sim.timeline} | ({"dp"} if max(pred.rank_dp_exposed_s) > 0 else set()) | {"opt"}
    handles = [Patch(color=COLORS[k], label=lbl) for k, lbl in (("F", "forward"), ("B", "backward"),
                                                                ("W", "weight gradient (zero bubble)"),
                                                                ("dp", "DP sync (exposed)"), ("opt", "optimizer"))
               if k in kinds]
    if v > 1:
        handles.append(Patch(color=COLORS["F"], alpha=0.6, label="lighter: the rank's later model chunk"))
    fig.suptitle(headline + (f" — {note}" if note else ""), fontsize=10, y=1 - 0.08 / height, va="top")
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.38 / height), fontsize=7,
               ncol=len(handles), frameon=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _stacked(preds: list[Prediction], labels: list[str], parts: list[tuple[str, str, object]], ylabel: str,
             title: str):
    """Stacked bars, one per plan: ``parts`` are (legend, colour, value of a prediction)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(preds) + 2), 4.5))
    bottoms = [0.0] * len(preds)
    for label, color, value in parts:
        vals = [value(p) for p in preds]
        ax.bar(range(len(preds)), vals, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(range(len(preds)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _save(fig, path: str) -> None:
    """Lay out, write the PNG and free the figure (every chart ends so)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_breakdown(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked bars: where each plan's iteration time goes."""
    parts = [(k.replace("_", " "), c, lambda p, k=k: p.time_s.get(k, 0.0)) for k, c in zip(TIME_KEYS, TIME_COLORS,
                                                                                            strict=True)]
    fig, ax = _stacked(preds, labels, parts, "seconds per iteration", title)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def memory_vs_capacity(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked memory per GPU (most loaded rank) against the GPU's capacity."""
    keys = ("params", "grads", "optimizer", "activations", "other")
    colors = ["#4C72B0", "#55A868", "#DD8452", "#C44E52", "#CCCCCC"]
    parts = [(k, c, lambda p, k=k: p.memory_gib[k]) for k, c in zip(keys, colors, strict=True)]
    fig, ax = _stacked(preds, labels, parts, "GiB per GPU (most loaded rank)", title)
    cap = preds[0].memory_capacity_gib if preds else 0
    ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"GPU memory {cap:g} GiB")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def scaling(gpus: list[int], preds: list[Prediction | None], path: str, title: str,
            labels: list[str] | None = None) -> None:
    """Throughput of the best plan at each GPU count, against perfect linear scaling from the smallest.
    ``labels``: each point's layout (default: its prediction's layout)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = labels or [p.layout.short() if p is not None else "" for p in preds]
    pts = [(g, p.tokens_per_s, lbl) for g, p, lbl in zip(gpus, preds, labels, strict=True) if p is not None]
    if pts:
        xs, ys, names = zip(*pts, strict=True)
        ax.plot(xs, ys, "o-", color="#4C72B0", label="best plan (replanned at each count)")
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", color="#999999", label="linear from the smallest")
        for x, y, name in zip(xs, ys, names, strict=True):
            ax.annotate(name.replace(" mb", "\nmb"), (x, y), fontsize=6, textcoords="offset points", xytext=(4, -14))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    known = [p for p in preds if p is not None]
    ax.set_ylabel("tokens/s" if known and known[0].tokens_per_s != known[0].samples_per_s else "samples/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)


def pareto(memory_gib: list[float], tokens_per_s: list[float], highlight: list[bool], capacity_gib: float, path: str,
           title: str) -> None:
    """Every priced candidate's throughput against its memory per GPU (most loaded rank), with the Pareto front;
    the ``highlight`` ones (the top plans) marked, the GPU's memory as a line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = memory_gib, tokens_per_s
    ax.scatter(xs, ys, s=8, color="#AAAAAA", label="candidates")
    front, best_y = [], -1.0
    for x, y in sorted(zip(xs, ys, strict=True)):
        if y > best_y:
            front.append((x, y))
            best_y = y
    if front:
        fx, fy = zip(*front, strict=True)
        ax.step(fx, fy, where="post", color="#C44E52", label="Pareto front (faster or leaner)")
    hx = [x for x, h in zip(xs, highlight, strict=True) if h]
    hy = [y for y, h in zip(ys, highlight, strict=True) if h]
    ax.scatter(hx, hy, s=30, color="#4C72B0", label="top plans", zorder=3)
    if xs:
        ax.axvline(capacity_gib, color="black", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xlabel("GiB per GPU (most loaded rank)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)


def sync_vs_workers(workers: list[int], series: dict[str, list[float]], path: str, title: str) -> None:
    """Gradient sync time against the number of data-parallel workers, one line per architecture."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        ax.plot(workers, ys, "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel workers")
    ax.set_ylabel("gradient sync per iteration (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)

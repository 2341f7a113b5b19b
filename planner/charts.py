"""Charts of predictions (matplotlib, Agg backend: files only, no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .costmodel import Prediction  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "dp": "#8172B2", "opt": "#937860"}
TIME_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer")
TIME_COLORS = ["#4C72B0", "#8DA0CB", "#DD8452", "#C44E52", "#8172B2", "#CCCCCC", "#937860"]


def gantt(pred: Prediction, path: str, title: str = "") -> None:
    """Per-rank pipeline timeline of one iteration: forward, backward, weight-gradient, DP sync; gaps are bubbles."""
    if pred.sim is None or not pred.sim.timeline:
        raise AssertionError("gantt needs a prediction made with keep_timeline=True")
    p = pred.layout.pp
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.45 * p))
    # one collection per (rank, kind): a 1T-parameter plan has ~25,000 actions, which one bar each cannot draw
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in pred.sim.timeline:
        spans.setdefault((e.rank, e.kind), []).append((e.start, e.end - e.start))
    edges = {"edgecolor": "white", "linewidth": 0.3} if len(pred.sim.timeline) <= 2000 else {}
    for (rank, kind), xs in spans.items():
        ax.broken_barh(xs, (rank - 0.4, 0.8), facecolor=COLORS[kind], **edges)
    if p * pred.layout.num_micro_batches <= 64:
        for e in pred.sim.timeline:
            ax.text((e.start + e.end) / 2, e.rank, str(e.micro_batch), ha="center", va="center", fontsize=6,
                    color="white")
    tail = pred.iteration_time_s - pred.time_s["optimizer"]
    for r in range(p):
        end, sync = pred.rank_finish_s[r], pred.rank_dp_exposed_s[r]
        if sync > 0:
            ax.barh(r, sync, left=end, height=0.8, color=COLORS["dp"])
        ax.barh(r, pred.time_s["optimizer"], left=tail, height=0.8, color=COLORS["opt"])
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"pp rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -1.4)  # rank 0 on top, with a free band above it for the legend
    ax.set_xlabel("seconds")
    ax.set_title(title or f"{pred.layout.short()}: {pred.iteration_time_s:.3g} s per iteration, "
                 f"bubble {100 * pred.bubble_fraction:.1f}%")
    handles = [Patch(color=COLORS[k], label=lbl) for k, lbl in (("F", "forward"), ("B", "backward"),
                                                                ("W", "weight grad (zb)"), ("dp", "DP sync"),
                                                                ("opt", "optimizer"))]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    _save(fig, path)


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


def pareto(preds: list[Prediction], highlight: list[bool], path: str, title: str) -> None:
    """Every priced candidate's throughput against its memory per GPU, with the Pareto front."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.peak_memory_gib for p in preds]
    ys = [p.tokens_per_s for p in preds]
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
    if preds:
        ax.axvline(preds[0].memory_capacity_gib, color="black", linestyle="--", linewidth=1, label="GPU memory")
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

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
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * p))
    for e in pred.sim.timeline:
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=COLORS[e.kind], edgecolor="white",
                linewidth=0.3)
        if p * pred.layout.num_micro_batches <= 64:
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
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"{pred.layout.short()}: {pred.iteration_time_s:.3g} s per iteration, "
                 f"bubble {100 * pred.bubble_fraction:.1f}%")
    handles = [Patch(color=COLORS[k], label=lbl) for k, lbl in (("F", "forward"), ("B", "backward"),
                                                                ("W", "weight grad (zb)"), ("dp", "DP sync"),
                                                                ("opt", "optimizer"))]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_breakdown(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked bars: where each plan's iteration time goes."""
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(preds) + 2), 4.5))
    bottoms = [0.0] * len(preds)
    for key, color in zip(TIME_KEYS, TIME_COLORS, strict=True):
        vals = [p.time_s.get(key, 0.0) for p in preds]
        ax.bar(range(len(preds)), vals, bottom=bottoms, color=color, label=key.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(range(len(preds)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_vs_capacity(preds: list[Prediction], labels: list[str], path: str, title: str) -> None:
    """Stacked memory per GPU (most loaded rank) against the GPU's capacity."""
    keys = ("params", "grads", "optimizer", "activations", "other")
    colors = ["#4C72B0", "#55A868", "#DD8452", "#C44E52", "#CCCCCC"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(preds) + 2), 4.5))
    bottoms = [0.0] * len(preds)
    for key, color in zip(keys, colors, strict=True):
        vals = [p.memory_gib[key] for p in preds]
        ax.bar(range(len(preds)), vals, bottom=bottoms, color=color, label=key)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    cap = preds[0].memory_capacity_gib if preds else 0
    ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"GPU memory {cap:g} GiB")
    ax.set_xticks(range(len(preds)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""The dry run for a person: per traced rank, memory and traffic traced beside what the plan predicts."""

from __future__ import annotations

from .output import human, stdout, table

COMM = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _delta(traced: float, predicted: float | None) -> str:
    if predicted is None or traced == 0:
        return "-"
    return f"{100 * (predicted / traced - 1):+.1f}%"


def _gib(x: float) -> str:
    """GiB with the digits a small plan needs (a tiny model's gradients are a thousandth of one)."""
    return f"{x:.2f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def print_dry_run(result: dict, job) -> None:
    lay = job.layout
    title = (f"Dry run of {job.source}: {job.spec.name}, {lay.short()}, world size {result['world_size']} "
             f"({result['device']} code path, fake tensors)")
    rows = []
    for r in result["ranks"]:
        mem, pred = r["memory_gib"], r["predicted_memory_breakdown_gib"] or {}
        rows.append([f"{r['rank']} (stage {r['pp_rank']})", _gib(r['peak_memory_gib']),
                     "-" if r["predicted_memory_gib"] is None else _gib(r['predicted_memory_gib']),
                     _delta(r["peak_memory_gib"], r["predicted_memory_gib"]),
                     *(f"{_gib(mem[k])} / {_gib(pred[k])}" if k in pred else _gib(mem[k])
                       for k in ("params", "grads", "optimizer", "activations", "other"))])
    stdout.print(table(title + " — memory per GPU, GiB (traced / predicted)",
                       ["rank", "traced peak", "predicted", "pred. vs traced", "weights", "gradients", "optimizer",
                        "activations", "other"], rows))
    rows = []
    for r in result["ranks"]:
        pred = r["predicted_comm_bytes"] or {}
        for kind in COMM:
            got, want = r["comm_bytes"][kind], pred.get(kind)
            if got or want:
                rows.append([f"{r['rank']} (stage {r['pp_rank']})", kind, human(got, "B"),
                             "-" if want is None else human(want, "B"), _delta(got, want)])
        want = r.get("predicted_flops")
        rows.append([f"{r['rank']} (stage {r['pp_rank']})", "FLOPs", human(r["flops"]),
                     "-" if want is None else human(want), _delta(r["flops"], want)])
    stdout.print(table("Traffic and FLOPs per rank and iteration (traced / predicted)",
                       ["rank", "kind", "traced", "predicted", "pred. vs traced"], rows))
    peak, gpu = result["peak_memory_gib"], result["gpu_memory_gib"]
    verdict = ("" if gpu is None else
               (f"fits: {peak:.1f} of {gpu:g} GiB" if result["fits"] else f"DOES NOT FIT: {peak:.1f} of {gpu:g} GiB"))
    predicted = result["predicted_peak_memory_gib"]
    stdout.print(f"traced peak {peak:.2f} GiB vs predicted "
                 f"{'-' if predicted is None else f'{predicted:.2f}'} GiB; {verdict}")
    for note in result["notes"]:
        stdout.print(f"note: {note}")

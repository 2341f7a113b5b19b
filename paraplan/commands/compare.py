"""``paraplan compare``: strategies side by side with the optimum, as a table and charts."""

from __future__ import annotations

import os

from paraplan.hardware_specs.identity import markdown_notes
from paraplan.planner import chart_guard
from paraplan.planner.compare import compare, dp_optimisations, dp_per_layout, ps_vs_ring
from paraplan.planner.errors import PlanError
from paraplan.planner.framework import describe as describe_framework
from paraplan.planner.framework import switches_of

from .common import calibration_labels, ensure_calibrated, workload_from_args
from .output import print_json, report_folder, stderr, stdout, table


def _row_json(row) -> dict:
    out = {"name": row.name, "status": row.status, "layout": row.layout.short() if row.layout else None,
           "label": row.label}
    if row.prediction is not None:
        out.update(row.prediction.to_dict())
        out["stage_recompute"] = row.stage_recompute
    return out


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f} MiB"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3g}"


def _figure(x: float) -> str:
    """Three significant figures, as a whole number from 1,000 on (not 3.35e+03)."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def dp_layout_cells(d) -> list[str]:
    """A row of the per-layout data-parallel table (terminal and markdown alike)."""
    share = f"{100 * d.exposed_s / d.iteration_s:.1f}%" if d.iteration_s else "-"
    return [d.name, d.layout.short(), d.group, d.kind, _mib(d.grad_bytes), _mib(d.kept_bytes), _mib(d.sent_bytes),
            _s(d.traffic_s), f"{d.exposed_s:.3g} ({share})"]


DP_LAYOUT_COLUMNS = ["strategy", "layout", "data-parallel group", "sync", "gradients a GPU reduces", "kept after sync",
                     "collective bytes per iteration", "sync s if not overlapped", "exposed s (of the iteration)"]
DP_OPT_COLUMNS = ["setting", "samples per optimizer step", "gradients a GPU reduces", "sync s if not overlapped",
                  "exposed s per iteration", "exposed ms per 1k samples"]


def dp_opt_cells(d) -> list[str]:
    return [d.what, str(d.samples_per_sync), _mib(d.grad_bytes), _s(d.sync_s), f"{d.exposed_s:.3g}",
            _figure(d.exposed_ms_per_1k_samples)]


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |"
                                                                              for r in rows]


def _all_to_all(time_s: dict) -> str:
    """The MoE token all-to-alls, context parallelism's exchange and the framework's host seconds of a layout's
    time breakdown, where it has any."""
    parts = (("ep_comm", "all-to-all"), ("cp_comm", "cp"), ("host", "host"))
    return "".join(f" / {label} {time_s[k]:.3g}" for k, label in parts if time_s.get(k))


def _write_markdown(path: str, work, gpus: int, rows, workers, series, dp_layouts, dp_rows, dp_base,
                    notes: list[str], charts: dict[str, str]) -> None:
    """comparison.md: the tables, and the ``charts`` drawn ({key: path}; none with --no-charts or where one failed)."""
    lines = [f"# {work.spec.name} on {gpus} x {work.cluster.gpu.name} ({work.cluster.name}), global batch "
             f"{work.global_batch}", "",
             f"Priced for framework {describe_framework(work.framework)}.", "",
             *markdown_notes(notes), *([""] if notes else []),
             "| strategy | layout | iteration s | tokens/s | MFU | GiB/GPU | tp / pp / dp "
             "comm, bubble (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.prediction
        if p is None:
            lines.append(f"| {r.name} | {r.label} | {r.status} | | | | |")
            continue
        t = p.time_s
        lines.append(f"| {r.name} | {r.label} | {p.iteration_time_s:.4g} | {p.tokens_per_s:,.0f} | "
                     f"{100 * p.mfu:.1f}% | {p.peak_memory_gib:.1f}{'' if p.fits else ' (OOM)'} | "
                     f"{t['tp_comm']:.3g} / {t['pp_comm']:.3g} / {t['dp_comm']:.3g}, {t['bubble']:.3g}"
                     f"{_all_to_all(t)} |")
    lines += ["", "Gradient sync per iteration (s), parameter servers vs ring all-reduce:", "",
              "| workers | " + " | ".join(series) + " |", "|---" * (len(series) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{series[k][i]:.3g}" for k in series) + " |" for i, n in enumerate(workers)]
    if dp_layouts:
        lines += ["", "Data-parallel communication per layout, per GPU (the pipeline rank that waits longest for it): "
                  "the gradients it reduces (its tensor- and pipeline-parallel share of the model), what it keeps "
                  "after the sync (ZeRO-2/3: a 1/dp shard), the bytes of its data-parallel collectives per "
                  "iteration, those collectives' time back to back, and what the iteration waits for once they "
                  "overlap the backward pass:", ""]
        lines += _md_table(DP_LAYOUT_COLUMNS, [dp_layout_cells(d) for d in dp_layouts])
    if dp_rows:
        lines += ["", "Gradient accumulation (more samples per optimizer step), and 16-bit gradient reduction "
                  f"(half the bytes) where the stack has it, on {dp_base}:", ""]
        lines += _md_table(DP_OPT_COLUMNS, [dp_opt_cells(d) for d in dp_rows])
    for key, what in (("breakdown", "time breakdown"), ("memory", "memory"),
                      ("ps_vs_ring", "parameter server vs ring")):
        if key in charts:
            lines += ["", f"![{what}]({os.path.basename(charts[key])})"]
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _draw_charts(work, gpus: int, rows: list, workers: list[int], series: dict, out: str,
                 notes: list[str]) -> dict[str, str]:
    """The comparison's charts, {what: path}; one that cannot be drawn is left out with a line in ``notes``
    (planner/chart_guard.py)."""
    files: dict[str, str] = {}
    charts = chart_guard.charts_module(notes)
    if charts is None:
        return files
    each = lambda key, name, what, chart: chart_guard.draw_file(files, notes, key, os.path.join(out, name),  # noqa: E731
                                                                what, chart)
    priced = [r for r in rows if r.prediction is not None]
    title = f"{work.spec.name} on {gpus} x {work.cluster.gpu.name}"
    if priced:
        labels = [f"{r.name}\n{r.layout.short()}" if r.name != r.layout.short() else r.name for r in priced]
        preds = [r.prediction for r in priced]
        each("breakdown", "time_breakdown.png", "time breakdown",
             lambda path: charts.time_breakdown(preds, labels, path, f"{title}: where the time goes"))
        each("memory", "memory.png", "memory",
             lambda path: charts.memory_vs_capacity(preds, labels, path, f"{title}: memory per GPU"))
    each("ps_vs_ring", "ps_vs_ring.png", "parameter server vs ring", lambda path: charts.sync_vs_workers(
        workers, series, path, f"Gradient sync of {work.spec.name} ({work.cluster.name}): parameter server vs ring"))
    return files


def run(args) -> int:
    work = workload_from_args(args)
    dtype = args.dtype or work.default_dtype()
    gpus = args.gpus or work.cluster.num_gpus
    if gpus > work.cluster.num_gpus:
        raise PlanError(f"--gpus {gpus} is more than {work.cluster.name}'s {work.cluster.num_gpus} GPUs; use --nodes")
    out = report_folder(args.out, f"compare-{work.spec.name}-{work.cluster.name}-{gpus}gpus")
    work = ensure_calibrated(args, work)
    work.memory_margin = args.memory_margin  # as plan: the optimum, and every strategy's fit, leave this share free
    rows = compare(work, gpus, args.strategy, dtype, optimum=not args.no_optimum)
    if rows and all(r.prediction is None for r in rows):  # nothing to compare: a script must see it failed
        raise PlanError("none of the strategies compared can run: " + "; ".join(f"{r.name}: {r.status}" for r in rows))
    workers, series = ps_vs_ring(work, dtype, max(gpus, 2))
    dp_layouts = dp_per_layout(work, rows)
    # accumulation (and 16-bit gradient reduction) on the fastest compared layout that syncs over data parallelism
    synced = sorted((r for r in rows if r.prediction is not None and r.layout.dp > 1 and r.layout.dp_mode != "ps"),
                    key=lambda r: r.prediction.iteration_time_s)
    dp_base = ""
    if synced:
        short = synced[0].layout.short()
        dp_base = short if synced[0].name == short else f"{short} ({synced[0].name})"
    dp_rows = dp_optimisations(work, synced[0]) if synced else []
    os.makedirs(out, exist_ok=True)
    calibrated, notes, suffix = calibration_labels(work)
    # a chart that fails leaves a note
    files = {} if args.no_charts else _draw_charts(work, gpus, rows, workers, series, out, notes)
    files["table"] = os.path.join(out, "comparison.md")
    _write_markdown(files["table"], work, gpus, rows, workers, series, dp_layouts, dp_rows, dp_base, notes, files)
    if args.json:
        print_json({"calibrated": calibrated, "notes": notes, "framework": work.framework.name,
                    "framework_switches": switches_of(work.framework), "strategies": [_row_json(r) for r in rows],
                    "ps_vs_ring": {"workers": workers, "sync_time_s": series},
                    "data_parallel": [{"strategy": d.name, "layout": d.layout.short(), "dp": d.layout.dp,
                                       "group": d.group, "sync": d.kind, "grad_bytes_per_gpu": d.grad_bytes,
                                       "kept_bytes_per_gpu": d.kept_bytes, "collective_bytes_per_gpu": d.sent_bytes,
                                       "sync_s_not_overlapped": d.traffic_s, "exposed_s": d.exposed_s,
                                       "iteration_time_s": d.iteration_s} for d in dp_layouts],
                    "dp_optimisations": [{"setting": d.what, "layout": d.layout.short(),
                                          "global_batch": d.layout.global_batch,
                                          "samples_per_sync": d.samples_per_sync, "grad_bytes_per_gpu": d.grad_bytes,
                                          "sync_s_not_overlapped": d.sync_s, "exposed_s": d.exposed_s,
                                          "iteration_time_s": d.iteration_s,
                                          "exposed_ms_per_1k_samples": d.exposed_ms_per_1k_samples}
                                         for d in dp_rows],
                    "charts": files})
        return 0
    table_rows = []
    for r in rows:
        p = r.prediction
        if p is None:
            table_rows.append([r.name, r.label, r.status, "", "", "", ""])
            continue
        table_rows.append([r.name, r.label, f"{p.iteration_time_s:.4g}", f"{p.tokens_per_s:,.0f}",
                           f"{100 * p.mfu:.1f}%", f"{p.peak_memory_gib:.1f}{'' if p.fits else ' (OOM)'}",
                           f"tp {p.time_s['tp_comm']:.3g} / pp {p.time_s['pp_comm']:.3g} / dp {p.time_s['dp_comm']:.3g}"
                           f" / bubble {p.time_s['bubble']:.3g}{_all_to_all(p.time_s)}"])
    title = (f"{work.spec.name} on {gpus} x {work.cluster.gpu.name} ({work.cluster.name}), global batch "
             f"{work.global_batch}, priced for {describe_framework(work.framework)}{suffix}")
    stdout.print(table(title, ["strategy", "layout", "iteration s", "tokens/s", "MFU", "GiB/GPU",
                               "communication and bubble (s)"], table_rows))
    ps_rows = [[str(n)] + [f"{series[k][i]:.3g}" for k in series] for i, n in enumerate(workers)]
    stdout.print(table("Gradient sync per iteration (s): parameter servers vs ring all-reduce", ["workers", *series],
                       ps_rows))
    if dp_layouts:
        stdout.print(table("Data-parallel communication per layout, per GPU (the pipeline rank that waits longest "
                           "for it)", DP_LAYOUT_COLUMNS, [dp_layout_cells(d) for d in dp_layouts]))
    if dp_rows:
        stdout.print(table(f"Gradient accumulation (and 16-bit gradient reduction where the stack has it) on "
                           f"{dp_base}", DP_OPT_COLUMNS, [dp_opt_cells(d) for d in dp_rows]))
    for note in notes:
        stdout.print(f"note: {note}", markup=False)
    stderr.print(f"table in {files['table']}" if args.no_charts else f"charts in {out}/")
    return 0

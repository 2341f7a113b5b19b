"""``paraplan plan``: search the fastest layout that fits, print the top plans, write the report folder."""

from __future__ import annotations

import os
import re
import sys

from paraplan.planner.chart_guard import ChartServer
from paraplan.planner.costmodel import CostModel
from paraplan.planner.errors import PlanError
from paraplan.planner.fitting_count import smallest_fitting_count
from paraplan.planner.refine import simulate_ranked
from paraplan.planner.report import plan_object, write_report
from paraplan.planner.scaling import ScalingReplans
from paraplan.planner.search import SearchResult, search
from paraplan.planner.workload import Workload

from .common import calibration_labels, ensure_calibrated, workload_from_args
from .output import print_json, report_folder, stderr, stdout, table

DEFAULT = {"model": "llama2-70b", "cluster": "dgx-h100", "global_batch": 512}
SCALING_WAIT_S = 3.0  # the scaling re-plans' least time: as long as the main search, at least this


def _progress(enabled: bool):
    """A rich progress bar on stderr (only on a terminal), as a callback for the search."""
    if not enabled:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("searching layouts"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=stderr, transient=True)
    task = bar.add_task("search", total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)


def nothing_fits_message(result: SearchResult, allowed_modes: tuple[str, ...] | None = None) -> str:
    """The least memory any layout needs against the GPU's, and what would make one fit: the fewest GPUs (whole
    nodes) found at which a layout does (planner/fitting_count.py)."""
    gpu = result.work.cluster.gpu
    oom = [c for c in result.candidates if c.status == "oom"]
    needs = []
    for c in oom:
        m = re.search(r"needs ([0-9.]+) GiB", c.reason) or re.search(r"\(([0-9.]+) of", c.reason)
        if m:
            needs.append((float(m.group(1)), c))
    if not needs:
        return (f"no valid layout for {result.work.spec.name} on {result.gpus} GPUs "
                f"({len(result.candidates)} candidates, all invalid); try another GPU count or global batch")
    least, cand = min(needs, key=lambda x: x[0])
    share = result.work.memory_margin
    margin = f" ({result.work.memory_limit_GiB:.1f} planned: --memory-margin {share:g})" if share else ""
    more = max(2, int(result.gpus * least / result.work.memory_limit_GiB + 0.999))
    count, fits, searched = smallest_fitting_count(result.work, result.gpus, more, result.dtype, allowed_modes)
    per_node = result.work.cluster.gpus_per_node
    if fits is not None:
        where = f"--nodes {count // per_node}" if count % per_node == 0 and count >= per_node else f"--gpus {count}"
        hint = (f"the fewest GPUs found that fit: {count} ({where}; {', '.join(map(str, searched[:-1]))} searched "
                "too, nothing fitted)" if len(searched) > 1 else f"the fewest GPUs found that fit: {count} ({where})")
        hint += (f", e.g. {fits.layout.short()} at {fits.prediction.peak_memory_gib:.1f} GiB per GPU; or a smaller "
                 "global batch, or a GPU with more memory")
    elif searched:
        hint = (f"nothing fits on {', '.join(map(str, searched))} GPUs either (searched); try a smaller global batch "
                "or a GPU with more memory")
    else:
        hint = f"try about {more} GPUs (--gpus/--nodes), a smaller global batch or a GPU with more memory"
    return (f"nothing fits on {result.gpus} GPUs: every layout needs at least {least:.1f} GiB per GPU (the least: "
            f"{cand.layout.short()}, with ZeRO-3 and full recomputation considered), each {gpu.name} has "
            f"{gpu.memory_GiB:g} GiB{margin}; {hint}")


def run(args) -> int:
    given = [args.model, args.cluster, args.global_batch]
    if all(v is None for v in given):
        args.model, args.cluster, args.global_batch = DEFAULT["model"], DEFAULT["cluster"], DEFAULT["global_batch"]
    missing = [f for f, v in (("--model", args.model), ("--cluster", args.cluster),
                              ("--global-batch", args.global_batch)) if v is None]
    if missing:
        raise PlanError(f"give {', '.join(missing)} too (or no arguments at all for the built-in example)")
    if args.solver:
        from paraplan.planner import ilp

        ilp.SOLVER_ORDER = ilp.BLOCK_SOLVER_ORDER = (args.solver, *(x for x in ilp.SOLVER_ORDER if x != args.solver))
    work = workload_from_args(args)
    gpus = args.gpus or work.cluster.num_gpus
    if args.train_tokens is not None and not 0 < args.train_tokens < float("inf"):  # nan and inf too
        raise PlanError(f"--train-tokens must be a positive number, got {args.train_tokens:g}")
    out = report_folder(args.out, f"{work.spec.name}-{work.cluster.name}-{gpus}gpus")
    work = ensure_calibrated(args, work)
    work.memory_margin = args.memory_margin  # plans leave this share of each GPU free (Workload.memory_margin)
    model = CostModel(work)
    # the scaling chart's re-plans run in the background, beside the search and the drawing
    replans = None if args.no_charts else ScalingReplans(work, gpus, args.dtype or work.default_dtype(), model)
    # and the charts' child imports the drawing code meanwhile (planner/chart_guard.py)
    drawing = None if args.no_charts else ChartServer()
    try:
        result, files = _search_and_report(args, work, gpus, model, out, replans, drawing)
    except BaseException:
        if replans:
            replans.cancel()
        raise
    finally:
        if drawing:
            drawing.close()  # drawn by now, or not needed: the command failed
    calibrated, notes, suffix = calibration_labels(work)
    notes = notes + result.notes
    if args.json:
        print_json({"best": {**plan_object(result, result.best), "calibrated": calibrated},
                    "top_k": [{**plan_object(result, c), "calibrated": calibrated} for c in result.ranked],
                    "num_candidates": len(result.candidates), "num_feasible": result.num_feasible,
                    "search_time_s": result.search_time_s, "ilp_solves": result.ilp_solves, "report": files,
                    "calibrated": calibrated, "notes": notes})
        return 0
    best = result.best
    p = best.prediction
    rows = [[str(i), c.layout.short(), f"{c.prediction.iteration_time_s:.4g}", f"{c.prediction.tokens_per_s:,.0f}",
             f"{100 * c.prediction.mfu:.1f}%", f"{c.prediction.peak_memory_gib:.1f}",
             "/".join(sorted(set(c.stage_recompute or [c.layout.recompute])))]
            for i, c in enumerate(result.ranked, 1)]
    stdout.print(table(f"Top plans: {work.spec.name} on {gpus} x {work.cluster.gpu.name} ({work.cluster.name}), "
                       f"global batch {args.global_batch}{suffix}",
                       ["#", "layout", "iteration s", "tokens/s", "MFU", "GiB/GPU", "recompute"], rows))
    stdout.print(f"best: [bold]{best.layout.short()}[/bold] — {p.iteration_time_s:.4g} s/iteration, "
                 f"{p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}%, {p.peak_memory_gib:.1f} of "
                 f"{p.memory_capacity_gib:g} GiB per GPU")
    if args.train_tokens:
        days = args.train_tokens / p.tokens_per_s / 86400
        price = work.cluster.cost_per_gpu_hour_usd
        cost = f", ${days * 24 * gpus * price:,.0f} at ${price:g}/GPU-hour" if price else ""
        stdout.print(f"time to train on {args.train_tokens:.3g} tokens: {days:.1f} days{cost}")
    for note in notes:
        stdout.print(f"note: {note}", markup=False)
    stdout.print(f"searched {len(result.candidates):,} layouts ({result.num_feasible:,} not rejected) in "
                 f"{result.search_time_s:.2f} s, {result.ilp_solves} ILPs; report: {files['report']}")
    return 0


def _search_and_report(args, work: Workload, gpus: int, model: CostModel, out: str, replans: ScalingReplans | None,
                       drawing: ChartServer | None) -> tuple[SearchResult, dict[str, str]]:
    """The search (with its progress bar), the dry-run check (--verify) and the report folder."""
    bar, cb = _progress(not args.json and sys.stderr.isatty())
    if bar:
        bar.start()
    try:
        result = search(work, gpus, top_k=args.top, dtype=args.dtype, progress=cb, model=model,
                        refine_slack=None if args.exhaustive else 0.05, allowed_modes=args.recompute_modes)
        simulate_ranked(result, model)  # the plans shown are priced as their schedule runs (planner/refine.py)
        if result.best is None:
            raise PlanError(nothing_fits_message(result, args.recompute_modes))
        # what the best plan's own prediction says of itself (blocks not yet timed on this machine, ...): on the
        # console and in the report, as simulate prints it
        result.notes.extend(n for n in result.best.prediction.notes if n not in result.notes)
    finally:
        if bar:
            bar.stop()
    if args.verify:
        rejected = verify_by_dry_run(result, work, args.json)
        if result.best is None:
            raise PlanError("no plan fits by the executor's dry run: " + "; ".join(
                f"{c.layout.short()}: {c.status_text()}" for c in rejected))
    # the scaling chart's re-plans (started with the search, on the cores it leaves) get as long as it took,
    # at least SCALING_WAIT_S; then every chart is drawn at once, by the child forked when the command started
    wait = max(SCALING_WAIT_S, result.search_time_s)
    scaling = (lambda: replans.points(result.best, wait)) if replans else []
    files = write_report(result, out, scaling, train_tokens=args.train_tokens, charts=not args.no_charts,
                         server=drawing)
    return result, files


def verify_by_dry_run(result: SearchResult, work: Workload, quiet: bool) -> list:
    """Dry-run the ranked plans in order (executor/dry_run.py) until one fits by its trace; each that does
    not leaves the ranking. The winner records its traced peak for the report. Returns those left out, in the
    order tried."""
    import tempfile

    from paraplan.executor.dry_run import dry_run
    from paraplan.executor.job import Job
    from paraplan.executor.machine import plan_device_type
    from paraplan.planner.report import write_plan

    say = (lambda line: None) if quiet else (lambda line: stderr.print(line, markup=False, highlight=False))
    rejected = []
    for cand in list(result.ranked):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "plan.json")
            write_plan(result, cand, path)
            job = Job.load(path)
            say(f"verifying {cand.layout.short()} with the executor's dry run")
            traced = dry_run(job, plan_device_type(job.plan), progress=say).to_dict()
        cand.traced_peak_gib = traced["peak_memory_gib"]
        if traced["fits"] is not False:
            say(f"traced peak {traced['peak_memory_gib']:.1f} GiB vs {cand.prediction.peak_memory_gib:.1f} GiB "
                f"predicted: fits")
            return rejected
        say(f"traced peak {traced['peak_memory_gib']:.1f} GiB exceeds the GPU's {work.cluster.gpu.memory_GiB:g} "
            "GiB: trying the next plan")
        result.reject_traced(cand, traced["peak_memory_gib"])
        rejected.append(cand)
    return rejected

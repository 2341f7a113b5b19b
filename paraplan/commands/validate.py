"""``paraplan validate``: run layouts through the executor and compare measured with predicted."""

from __future__ import annotations

import math
import sys

from paraplan.executor.validate import summary, to_json, update_spec, validate, write_outputs
from paraplan.planner.errors import PlanError
from paraplan.planner.framework import other_stack_note

from .common import calibration_labels, ensure_calibrated, workload_from_args
from .output import print_json, report_folder, stderr, stdout, table


def run(args) -> int:
    if args.steps < 2:
        raise PlanError(f"--steps {args.steps}: the first step warms up and is not timed; give 2 or more")
    work = workload_from_args(args)
    if args.gpus > work.cluster.num_gpus:
        raise PlanError(f"--gpus {args.gpus} is more than {work.cluster.name}'s {work.cluster.num_gpus}")
    out = report_folder(args.out, f"validate-{work.spec.name}-{work.cluster.name}-{args.gpus}gpus")
    work = ensure_calibrated(args, work, validating=True)
    show = not args.json and sys.stderr.isatty()
    progress = (lambda i, n, name: stderr.print(f"[{i + 1}/{n}] {name}") if i < n else None) if show else None
    rows = validate(work, args.gpus, args.strategy, args.steps, args.top, out, progress=progress,
                    measure_blocks=not args.no_block_times, passes=args.passes)
    stats = summary(rows)
    calibrated, notes, suffix = calibration_labels(work, validating=True)
    if note := other_stack_note(work.framework, "the predictions were", "the measurements are",
                                "validate with --framework paraplan to check the predictions themselves"):
        notes.append(note)
    files = write_outputs(rows, stats, out, f"{work.spec.name} on {args.gpus} x {work.cluster.gpu.name} "
                                            f"({work.cluster.name}), global batch {work.global_batch}", calibrated,
                          notes)
    spec_note = None
    if args.update_spec:
        path, a, c = update_spec(work, rows)
        spec_note = f"spec rescaled (compute x{a:.3f}, communication x{c:.3f}) and written to {path}"
    if args.json:
        print_json({**to_json(rows, stats), "report": files, "updated_spec": spec_note, "calibrated": calibrated,
                    "notes": notes})
        return 0
    trows = [[r.layout.short(), r.source, f"{r.predicted_s:.4g}" if r.predicted_s else "-",
              f"{r.measured_s:.4g}" if r.measured_s else "-",
              f"{100 * r.error:+.1f}%" if r.error is not None else r.status] for r in rows]
    stdout.print(table(f"Validation: {work.spec.name} on {args.gpus} x {work.cluster.gpu.name} ({work.cluster.name})"
                       f"{suffix}",
                       ["layout", "source", "predicted s", "measured s", "error"], trows))
    tau = stats["kendall_tau"]
    stdout.print(f"MAPE {100 * stats['mape']:.1f}%, Kendall tau {'n/a' if math.isnan(tau) else f'{tau:.2f}'} over "
                 f"{stats['layouts']} layouts; measured fastest {stats['measured_fastest']}; planner's pick "
                 f"{stats['recommended']} ({100 * stats['recommended_vs_fastest']:+.1f}%); report {files['report']}")
    for note in notes:
        stdout.print(f"note: {note}", markup=False)
    if spec_note:
        stdout.print(spec_note)
    return 0

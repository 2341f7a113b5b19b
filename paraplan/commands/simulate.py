"""``paraplan simulate``: one layout's predicted iteration time, throughput, memory and breakdown."""

from __future__ import annotations

from paraplan.planner import chart_guard
from paraplan.planner.api import simulate
from paraplan.planner.errors import PlanError
from paraplan.planner.framework import sequence_parallel_as_run
from paraplan.planner.layout import RECOMPUTE
from paraplan.planner.plan import label_prediction
from paraplan.planner.search import summary_mode
from paraplan.planner.units import tflops_text

from .common import calibration_labels, ensure_calibrated, layout_from_args, workload_from_args
from .output import output_path_problem, print_json, stderr, stdout, table


def _check_out(path: str, flag: str) -> None:
    if problem := output_path_problem(path, flag, folder=False):
        raise PlanError(problem)


def prediction_rows(d: dict) -> list[list[str]]:
    t, mem = d["time_s"], d["memory_gib"]
    rows = [["iteration time", f"{d['iteration_time_s']:.4g} s"],
            ["throughput", f"{d['tokens_per_s']:,.0f} tokens/s  ({d['samples_per_s']:.4g} samples/s)"],
            ["TFLOP/s per GPU", f"model {tflops_text(d['model_tflops_per_gpu'])}, "
                                f"hardware {tflops_text(d['hardware_tflops_per_gpu'])}"],
            ["MFU / HFU", f"{100 * d['mfu']:.1f}% / {100 * d['hfu']:.1f}%"],
            ["memory per GPU", f"{d['peak_memory_gib']:.2f} GiB of {d['memory_capacity_gib']:g} "
                               f"({'fits' if d['fits'] else 'DOES NOT FIT'})"],
            ["  params / grads / optimizer", f"{mem['params']:.2f} / {mem['grads']:.2f} / {mem['optimizer']:.2f} GiB"],
            ["  activations / other", f"{mem['activations']:.2f} / {mem['other']:.2f} GiB"]]
    # context parallelism's K/V exchange, the MoE token all-to-alls (planner/moe.py) and the framework's host-side
    # seconds (calibrated on CPUs) where there are any
    for k in ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer") + \
            tuple(k for k in ("cp_comm", "ep_comm", "host") if t.get(k)):
        share = 100 * t[k] / d["iteration_time_s"] if d["iteration_time_s"] else 0
        # (a part below a billionth of the step is rounding, as a pp1 layout's bubble: printed as 0)
        seconds = t[k] if abs(t[k]) > 1e-9 * d["iteration_time_s"] else 0.0
        label = "host overhead" if k == "host" else k.replace("_", " ")
        rows.append([f"  time: {label}", f"{seconds:.4g} s ({share:.1f}%)"])
    return rows


def _draw_gantt(pred, path: str, note: str, notes: list[str]) -> bool:
    """The timeline to ``path``; if it cannot be drawn, a line in ``notes`` says why and the prediction stands
    (planner/chart_guard.py). The drawing code is imported only when drawing."""
    charts = chart_guard.charts_module(notes)
    return charts is not None and chart_guard.draw(notes, "timeline", lambda: charts.gantt(pred, path, note=note))


def stages_from_counts_arg(text: str | None, n_blocks: int, lay) -> list[list[int]] | None:
    """``--stages 6,6,5``: that many blocks in each stage, in model order (None: not given)."""
    if text is None:
        return None
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(f"--stages {text}: give whole numbers of blocks per stage, e.g. 6,6,5") from None
    if len(counts) != lay.num_stages:
        raise PlanError(f"--stages {text}: {len(counts)} stages, but pp x virtual-stages = {lay.num_stages}")
    if any(c <= 0 for c in counts) or sum(counts) != n_blocks:
        raise PlanError(f"--stages {text}: every stage needs a block or more, and the counts must sum to the model's "
                        f"{n_blocks} blocks (embedding and head included), not {sum(counts)}")
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(counts))]


def stage_modes_arg(text: str | None, lay) -> list[str] | None:
    """``--stage-recompute full,none,...``: one recomputation mode per stage, or one for every stage (None: not
    given); spaces after the commas are allowed, as a report lists them."""
    if text is None:
        return None
    modes = [m.strip() for m in text.split(",") if m.strip()]  # a trailing comma is no stage
    if len(modes) == 1:
        modes = modes * lay.num_stages
    if len(modes) != lay.num_stages:
        raise PlanError(f"--stage-recompute {text}: {len(modes)} modes, but pp x virtual-stages = {lay.num_stages}")
    unknown = [m for m in modes if m not in RECOMPUTE]
    if unknown:
        raise PlanError(f"--stage-recompute: unknown mode {unknown[0]!r} (one of {', '.join(RECOMPUTE)})")
    return modes


def run(args) -> int:
    work = workload_from_args(args)
    lay = layout_from_args(args, work)
    sp_note = ""
    if (run := sequence_parallel_as_run(work.framework, lay)) is not lay:  # what that stack runs
        lay = run
        sp_note = (f"the {work.framework.name} stack runs tensor parallelism with sequence parallelism always: "
                   "priced (and written) with --sequence-parallel")
    if args.gpus is not None and lay.num_gpus != args.gpus:
        raise PlanError(f"dp x tp x pp = {lay.dp} x {lay.tp} x {lay.pp} = {lay.num_gpus}, not the --gpus {args.gpus}")
    if args.write_plan:
        _check_out(args.write_plan, "--write-plan")
    if args.gantt:
        _check_out(args.gantt, "--gantt")
        if not args.gantt.lower().endswith(".png"):  # the timeline is drawn as a PNG, whatever the name says
            raise PlanError(f"--gantt {args.gantt}: the timeline is a PNG image; give a .png file name")
    # the layout's own checks first (one line, as simulate's): calibrating a machine (a minute) for a layout it
    # cannot run helps nobody
    n_blocks = len(work.profile(lay.dtype).layers)
    lay.validate(work.spec, n_blocks, work.cluster.num_gpus)
    stages = stages_from_counts_arg(args.stages, n_blocks, lay)
    modes = stage_modes_arg(args.stage_recompute, lay)
    if modes is not None:
        if args.recompute not in ("none", summary_mode(modes)):
            raise PlanError(f"--recompute {args.recompute} disagrees with --stage-recompute, whose heaviest mode is "
                            f"{summary_mode(modes)} (the layout's label): give one of them")
        lay = lay.replace(recompute=summary_mode(modes))
        lay.validate_stage_recompute(work.spec, modes)
    work = ensure_calibrated(args, work)
    pred, plan = simulate(work, lay, stages, modes, keep_timeline=bool(args.gantt),
                          event_sim=True if args.event_sim else None)
    if sp_note:
        pred.notes.append(sp_note)
        if sp_note not in plan.prediction.setdefault("notes", []):
            plan.prediction["notes"].append(sp_note)
    calibrated, cal_notes, suffix = calibration_labels(work)
    label_prediction(plan, work)  # the plan file says so too, with the notes that say why
    if args.write_plan:
        plan.write(args.write_plan)
    chart_notes: list[str] = []
    drawn = bool(args.gantt) and _draw_gantt(pred, args.gantt, suffix.strip(" —"), chart_notes)
    out = {**plan.prediction, "notes": [*pred.notes, *cal_notes, *chart_notes],
           "plan": {k: v for k, v in plan.to_dict().items() if k != "prediction"}}
    if args.json:
        print_json(out)
        return 0
    title = (f"{work.spec.name} on {work.cluster.name} ({lay.num_gpus} GPUs, {work.cluster.gpu.name}): "
             f"{lay.short()}, global batch {lay.global_batch}, {lay.micro_batches_text} per "
             f"replica{suffix}")
    stdout.print(table(title, ["", "predicted"], prediction_rows(out)))
    for note in out["notes"]:
        stdout.print(f"note: {note}", markup=False)
    if args.write_plan:
        stderr.print(f"plan written to {args.write_plan}")
        if warning := plan.memory_warning():  # as export and execute will say
            stderr.print(f"warning: {warning}", markup=False, highlight=False)
    if drawn:
        stderr.print(f"timeline drawn to {args.gantt}")
    return 0

"""``paraplan export``: a plan as Megatron-LM arguments, a torchtitan TOML, a DeepSpeed JSON or a Slurm script.

A file that needs another beside it (torchtitan's flavor module, for a model torchtitan has no flavor of) is
written with it under ``--out``; printed to stdout, only the main file is, and a note says so.

What the target cannot express is refused in one line naming the feature (exit 2); what it runs
differently from the plan is a note on stderr. For Slurm the plan is first checked the way ``execute``
checks it, since the script runs ``paraplan execute`` on every node.
"""

from __future__ import annotations

import os
import stat
import sys

from paraplan.planner.errors import PlanError
from paraplan.planner.exports import export_plan
from paraplan.planner.plan import Plan

from .output import output_path_problem, print_json


def execute_flags() -> frozenset[str]:
    """The option strings ``paraplan execute`` accepts here (checkpoint and resume flags come and go with it)."""
    from paraplan.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return frozenset(o for a in sub.choices["execute"]._actions for o in a.option_strings)


def run(args) -> int:
    if args.out and (problem := output_path_problem(args.out, "--out", folder=False)):
        raise PlanError(problem)
    plan = Plan.read(args.plan)
    options = {}
    if args.to == "slurm":
        from paraplan.executor.job import Job

        from .execute import checkpoint_refusal

        job = Job.load(args.plan)  # what execute would refuse on every node, refused here
        options["execute_flags"] = execute_flags()
        options["no_checkpoints"] = checkpoint_refusal(job.layout)  # and the flags it would refuse, left out
    if args.to.startswith("torchtitan") and args.out:
        options["filename"] = args.out  # names the flavor module written beside it
    result = export_plan(plan, args.to, args.plan, **options)
    if warning := plan.memory_warning():
        sys.stderr.write(f"paraplan export: warning: {warning}\n")
    for note in result.notes:
        sys.stderr.write(f"paraplan export: note: {note}\n")
    # files the main one needs go beside it (torchtitan's flavor module); without --out they are not written
    files = {os.path.join(os.path.dirname(args.out), name) if args.out else name: text
             for name, text in result.files.items()}
    if files and not args.out:
        sys.stderr.write(f"paraplan export: note: the {args.to} file needs {', '.join(files)} beside it (it registers "
                         "the model); --out FILE writes both\n")
    launch = result.launch.replace(result.filename, args.out) if args.out else result.launch
    if args.out:
        _write(args.out, result.text, executable=result.filename.endswith((".sh", ".sbatch")))
        for path, text in files.items():
            _write(path, text, executable=False)
    if args.json:
        print_json({"target": result.target, "plan": args.plan, "out": args.out, "launch": launch,
                    "where": result.where, "notes": result.notes, "values": result.values, "text": result.text,
                    "files": files})
    elif args.out:
        sys.stdout.write(f"wrote {' and '.join([args.out, *files])} ({args.to}); launch"
                         + (f" {result.where}" if result.where else "") + f": {launch}\n")
    else:
        sys.stdout.write(result.text)
    return 0


def _write(path: str, text: str, executable: bool) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
        if executable:
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as e:
        raise PlanError(f"--out {path}: {e.strerror}") from None

"""``paraplan export``: a plan as Megatron-LM arguments, a torchtitan TOML, a DeepSpeed JSON or a Slurm script.

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

        Job.load(args.plan)  # what execute would refuse on every node, refused here
        options["execute_flags"] = execute_flags()
    result = export_plan(plan, args.to, args.plan, **options)
    for note in result.notes:
        sys.stderr.write(f"paraplan export: note: {note}\n")
    launch = result.launch.replace(result.filename, args.out) if args.out else result.launch
    if args.out:
        _write(args.out, result.text, executable=result.filename.endswith((".sh", ".sbatch")))
    if args.json:
        print_json({"target": result.target, "plan": args.plan, "out": args.out, "launch": launch,
                    "where": result.where, "notes": result.notes, "values": result.values, "text": result.text})
    elif args.out:
        sys.stdout.write(f"wrote {args.out} ({args.to}); launch" + (f" {result.where}" if result.where else "")
                         + f": {launch}\n")
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

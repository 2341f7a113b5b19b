"""Slurm: an sbatch script that runs ``paraplan execute`` on every node of the plan, with a c10d rendezvous.

One task per node (srun); each runs ``paraplan execute --nnodes N --node-rank $SLURM_NODEID
--rdzv-endpoint <first node>:<port>``, which starts that node's ranks with torchrun. The nodes and
processes per node come from the plan's cluster (fewest nodes that hold its ranks, the same count on
each). Checkpoint, resume, restart and data flags are passed when ``execute`` has them (the command
layer hands over the option strings ``execute`` accepts, and leaves the checkpoint flags out for a plan whose
checkpoints ``execute`` refuses, e.g. expert-parallel ones); a run resumes from CKPT_DIR when it holds a
complete checkpoint (``step-N/``). ``bash -n`` and shellcheck check the script (tests/test_export.py).
"""

from __future__ import annotations

import os
import shlex

from paraplan.models import ModelSpec

from ..plan import Plan
from .common import Export, header_lines, placement

TARGET = "slurm"


def export(plan: Plan, plan_path: str, spec: ModelSpec, execute_flags: frozenset[str] = frozenset(),
           no_checkpoints: str | None = None) -> Export:
    """``no_checkpoints``: why ``paraplan execute`` would refuse this plan's checkpoint flags (then left out, with
    a note in the script and the export's notes)."""
    place = placement(plan, TARGET)
    model = plan.model if not os.path.isfile(plan.model) else os.path.splitext(os.path.basename(plan.model))[0]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in f"paraplan-{model}")[:64]
    lines = ["#!/bin/bash"]
    lines += [f"# {x}" for x in header_lines(plan, plan_path, "Slurm batch script running paraplan execute")]
    lines += ["# Submit with: sbatch paraplan.sbatch (add --time, --partition, --account as your site needs).",
              "KNOBS",
              f"#SBATCH --job-name={name}",
              f"#SBATCH --nodes={place.nodes}",
              "#SBATCH --ntasks-per-node=1"]
    if place.gpus:
        lines.append(f"#SBATCH --gpus-per-node={place.per_node}")
    lines += ["#SBATCH --exclusive", "#SBATCH --output=%x-%j.out", "", "set -euo pipefail", "",
              f"PLAN=${{PLAN:-{shlex.quote(os.path.abspath(plan_path))}}}  # the same path on every node",
              "STEPS=${STEPS:-100}",
              "OUT=${OUT:-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}",
              "PARAPLAN=${PARAPLAN:-paraplan}  # or the paraplan of your virtual environment",
              "RDZV_PORT=${RDZV_PORT:-29500}"]
    node_cmd = ['"$PARAPLAN" execute --plan "$PLAN" --steps "$STEPS" --out "$OUT"',
                f'--nnodes {place.nodes} --node-rank "$SLURM_NODEID" --rdzv-endpoint "$RDZV_ENDPOINT"']
    exports = ["PLAN", "STEPS", "OUT", "PARAPLAN", "RDZV_ENDPOINT"]
    notes = []
    if no_checkpoints and "--checkpoint-dir" in execute_flags:
        notes.append(f"no checkpoint or resume flags: {no_checkpoints}")
        lines.append(f"# No checkpoints: {no_checkpoints}.")
    elif "--checkpoint-dir" in execute_flags:
        lines += ["CKPT_DIR=${CKPT_DIR:-checkpoints/$SLURM_JOB_NAME}",
                  "CKPT_EVERY=${CKPT_EVERY:-50}"]
        node_cmd.append('--checkpoint-dir "$CKPT_DIR" --checkpoint-every "$CKPT_EVERY"')
        exports += ["CKPT_DIR", "CKPT_EVERY"]
        if "--resume" in execute_flags:
            lines += ["RESUME_DIR=", "# a complete checkpoint is a step-N folder; resume from the latest",
                      'if compgen -G "$CKPT_DIR/step-*" > /dev/null; then RESUME_DIR=$CKPT_DIR; fi']
            node_cmd.append('${RESUME_DIR:+--resume "$RESUME_DIR"}')
            exports.append("RESUME_DIR")
    for flag, var in (("--max-restarts", "MAX_RESTARTS"), ("--data", "DATA")):
        if flag in execute_flags:
            node_cmd.append(f'${{{var}:+{flag} "${var}"}}')
            exports.append(var)
            lines.append(f"{var}=${{{var}:-}}")
    lines[lines.index("KNOBS")] = "# Settable in the environment: " + ", ".join(
        [e for e in exports if e not in ("RDZV_ENDPOINT", "RESUME_DIR")] + ["RDZV_PORT"]) + "."
    lines += ["", "# the first node hosts the rendezvous (read without '| head', whose SIGPIPE ends a pipefail job)",
              'mapfile -t job_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              'RDZV_ENDPOINT="${job_nodes[0]}:$RDZV_PORT"',
              f"export {' '.join(exports)}", "",
              "# One task per node; $SLURM_NODEID is expanded on each node (hence the single quotes).",
              "# shellcheck disable=SC2016",
              f"srun --nodes={place.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '",
              "exec " + " \\\n    ".join(node_cmd) + "'", ""]
    return Export(target=TARGET, text="\n".join(lines), filename="paraplan.sbatch", launch="sbatch paraplan.sbatch",
                  values={"nodes": place.nodes, "per_node": place.per_node, "world_size": place.world_size},
                  notes=notes)


"""torchtitan, command-line form: the same job config as the TOML, as ``--section.key value`` overrides
in a bash fragment (source it and pass "${TORCHTITAN_ARGS[@]}", or run it to start this node's ranks).

torchtitan 0.2's ConfigManager reads these overrides with tyro (lists comma-separated, a list of lists
as one comma-separated value per inner list); tests/test_export.py checks that it builds the same config
as from the TOML. A model torchtitan has no flavor for gets the same flavor module as with the TOML,
beside the script, which puts that folder on PYTHONPATH. (torchtitan 0.3 dropped TOML for
``--module``/``--config`` registry functions plus overrides; its section names differ in places, so this
form is for 0.2.)
"""

from __future__ import annotations

import shlex

from paraplan.models import ModelSpec

from ..plan import Plan
from .common import Export, header_lines, placement, refuse_ps_and_sharded_heads
from .torchtitan import TORCHTITAN_SOURCE, job_config, model_files, model_lines
from .torchtitan_model import module_name

TARGET = "torchtitan-cli"


def export(plan: Plan, plan_path: str, spec: ModelSpec, filename: str = "torchtitan.sh") -> Export:
    """``filename``: where the script goes (its folder takes the flavor module, its stem names it)."""
    refuse_ps_and_sharded_heads(plan, TARGET)
    module = module_name(filename)
    config, notes, model = job_config(plan, spec, module)
    pairs = cli_pairs(config)
    place = placement(plan, TARGET)
    nodes = place.nodes
    lines = ["#!/usr/bin/env bash"]
    what = f"torchtitan command-line overrides ({TORCHTITAN_SOURCE})"
    lines += [f"# {x}" for x in header_lines(plan, plan_path, what)]
    lines += [f"# {x}" for x in model_lines(model, module)]
    lines += [f"# Note: {n}" for n in notes]
    lines += ["# Source this file and pass \"${TORCHTITAN_ARGS[@]}\" to torchtitan.train, or run it: it starts this",
              "# node's ranks with torchrun (on several nodes, on each with NNODES and RDZV_ENDPOINT=host:port).", "",
              "TORCHTITAN_ARGS=("]
    lines += [f"    {flag} " + " ".join(_quote(v) for v in values) for flag, values in pairs]
    lines += [")", ""]
    if model.needs_module:
        lines += [f"# torchtitan imports {module} (beside this file) to register the model: this folder goes on "
                  "PYTHONPATH", 'PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"',
                  "export PYTHONPATH", ""]
    lines += ['if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then',
              f"    exec torchrun --nnodes \"${{NNODES:-{nodes}}}\" "
              f"--nproc-per-node {place.per_node} \\",
              "        --rdzv-backend c10d --rdzv-endpoint \"${RDZV_ENDPOINT:-localhost:29500}\" "
              "--rdzv-id \"${RDZV_ID:-paraplan}\" \\",
              "        -m torchtitan.train \"${TORCHTITAN_ARGS[@]}\"", "fi", ""]
    return Export(target=TARGET, text="\n".join(lines), filename=filename,
                  launch=("RDZV_ENDPOINT=<first-node>:29500 " if nodes > 1 else "") + f"bash {filename}",
                  notes=notes, where=f"on each of the {nodes} nodes" if nodes > 1 else "",
                  values={"model": model.name, "flavor": model.flavor,
                          "args": [x for flag, values in pairs for x in (flag, *values)]},
                  files=model_files(model, plan, plan_path, filename, module))


def cli_pairs(config: dict, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Nested config sections -> (``--a.b``, values) in tyro's form: a list comma-joined, a list of lists one
    value per inner list."""
    out: list[tuple[str, list[str]]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += cli_pairs(value, f"{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], list):
            out.append((f"--{name}", [",".join(part) for part in value]))
        elif isinstance(value, list):
            out.append((f"--{name}", [",".join(value)]))
        else:
            out.append((f"--{name}", [str(value)]))
    return out


def _quote(value: str) -> str:
    """Shell-quoted; comma lists quoted too, so they read as one word (and shellcheck does not take the commas
    for mistaken array separators)."""
    quoted = shlex.quote(value)
    return f"'{value}'" if quoted == value and "," in value else quoted

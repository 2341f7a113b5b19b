"""Shared terminal output: one JSON object on stdout, rich tables, one-line messages on stderr."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

# Off a terminal rich would wrap tables at 80 columns; reports and logs read better wider. Off a terminal there are
# no colours either, so the highlighter (numbers, paths, ...: 0.5 ms a line) has nothing to show: off.
stdout = Console(width=None if sys.stdout.isatty() else 160, highlight=sys.stdout.isatty())
stderr = Console(stderr=True, width=None if sys.stderr.isatty() else 160, highlight=sys.stderr.isatty())


def output_path_problem(path: str, flag: str, folder: bool) -> str | None:
    """Why ``path`` cannot be written (its folder missing; a file where a report folder goes, or a
    folder where a file goes), as the user's one-line error; None when it can."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: folder {parent} does not exist"
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path}: is a file; give a folder for the report"
    if not folder and os.path.isdir(path):
        return f"{flag} {path}: is a folder; give a file name"
    if not folder:  # try it now, not after the work: a folder that refuses writes (permissions, read-only)
        existed = os.path.exists(path)
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            return f"{flag} {path}: cannot be written ({e.strerror})"
        if not existed:
            os.remove(path)
    return None


def report_folder(given: str | None, name: str) -> str:
    """The report folder a command writes: ``given`` (its --out, whose parent must exist: a mistyped path is an
    error, not a new tree), else ``reports/<name>`` under the working directory, ``reports/`` made when missing (a
    user's first command in a fresh folder must not fail for want of it). Raises PlanError with the user's line."""
    from paraplan.planner.errors import PlanError

    if given is None:
        try:
            os.makedirs("reports", exist_ok=True)
        except OSError as e:
            raise PlanError(f"--out: cannot make the default report folder {os.path.abspath('reports')} "
                             f"({e.strerror}); give --out") from None
    # the default folder's name from the model's and cluster's names: one path component, whatever they hold
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip(".") or "report"
    out = given or os.path.join("reports", safe)
    if problem := output_path_problem(out, "--out", folder=True):
        raise PlanError(problem)
    return out


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: map them to null; tuples to lists; numpy scalars to Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        try:
            value = value.item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(_clean(obj), indent=indent, sort_keys=False)


def print_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(to_json(obj) + "\n")


def table(title: str, columns: list[str], rows: list[list[Any]], justify_right_from: int = 1) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= justify_right_from else "left")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M'."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()

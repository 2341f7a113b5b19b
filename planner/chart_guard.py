"""Charts are a side view: one that cannot be drawn never takes the command down with it.

matplotlib can be missing or broken on a user's machine, a file can be unwritable, a prediction can hold
something a chart cannot plot; the table, the plan and the JSON still stand. :func:`draw` runs one chart
and, when it fails, records one line saying which chart and why (the command prints it as a note and the
report lists it) and lets the command go on.
"""

from __future__ import annotations

from collections.abc import Callable


def draw(notes: list[str], what: str, chart: Callable[[], object]) -> bool:
    """Run ``chart`` (which draws ``what``); False, with a line in ``notes``, when it raises."""
    try:
        chart()
        return True
    except Exception as e:  # noqa: BLE001 - any failure of a chart degrades to a note, by design
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        notes.append(f"{what} chart not drawn ({type(e).__name__}{': ' + text if text else ''})")
        return False


def draw_file(files: dict[str, str], notes: list[str], key: str, path: str, what: str,
              chart: Callable[[str], object]) -> None:
    """Draw ``chart(path)`` through :func:`draw`; where it worked, ``files[key]`` is the path."""
    if draw(notes, what, lambda: chart(path)):
        files[key] = path


def charts_module(notes: list[str]):
    """planner/charts.py, or None with a note when matplotlib cannot be imported (missing or broken)."""
    try:
        from . import charts
    except Exception as e:  # noqa: BLE001 - no charts; the tables, plan and JSON still stand
        notes.append(f"no charts drawn (matplotlib: {type(e).__name__}: {e})")
        return None
    return charts

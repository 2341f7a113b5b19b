"""Charts are a side view: one that cannot be drawn never takes the command down with it.

matplotlib can be missing or broken on a user's machine, a file can be unwritable, a prediction can hold
something a chart cannot plot; the table, the plan and the JSON still stand. :func:`draw` runs one chart
and, when it fails, records one line saying which chart and why (the command prints it as a note and the
report lists it) and lets the command go on.

:func:`draw_files` draws several charts, the dearest in a forked child beside the others (matplotlib draws on one
core, and a report's timeline alone takes as long as the rest together): the same files and notes as drawing
them one after another, in about half the time on two cores. A child that dies or hangs leaves its charts to the
parent, which draws them itself; it never outlives the call.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass

CHILD_WAIT_S = 300.0  # a chart child still drawing after this is stopped and its charts drawn in line


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


@dataclass
class ChartJob:
    key: str  # the files dict's key
    path: str
    what: str  # the chart's name in a note
    chart: Callable[[str], object]  # draws the file at its argument
    weight: float = 1.0  # its drawing time relative to a plain bar chart


def draw_files(files: dict[str, str], notes: list[str], jobs: list[ChartJob]) -> None:
    """:func:`draw_file` for every job, the heaviest in a forked child while this process draws the rest (where
    fork exists and there are two cores); ``files`` and ``notes`` come out as if drawn in order."""
    heaviest = max(jobs, key=lambda j: j.weight, default=None)
    child = None
    if len(jobs) > 1 and (os.cpu_count() or 1) >= 2 and "fork" in multiprocessing.get_all_start_methods():
        child = _fork([heaviest])
    results: dict[str, tuple[bool, list[str]]] = {}
    for job in jobs:
        if child is None or job is not heaviest:
            results[job.key] = _draw_one(job)
    if child:
        results.update(_collect(child, [heaviest]))
    for job in jobs:
        ok, lines = results[job.key]
        notes.extend(lines)
        if ok:
            files[job.key] = job.path


def _draw_one(job: ChartJob) -> tuple[bool, list[str]]:
    lines: list[str] = []
    return draw(lines, job.what, lambda: job.chart(job.path)), lines


def _child(conn, jobs: list[ChartJob]) -> None:
    """Forked: draw ``jobs`` and send back (key, drawn, notes) for each; on any failure send nothing (the parent
    draws them itself)."""
    try:
        conn.send_bytes(pickle.dumps([(j.key, *_draw_one(j)) for j in jobs]))
    except BaseException:  # noqa: BLE001 - the parent sees the closed pipe
        pass
    finally:
        conn.close()


def _fork(jobs: list[ChartJob]):
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush()  # a child flushes its copy of the buffers when it ends: nothing may be in them twice
    sys.stderr.flush()
    receive, send = ctx.Pipe(duplex=False)
    try:
        proc = ctx.Process(target=_child, args=(send, jobs), daemon=True)
        proc.start()
    except OSError:  # no process to spare: draw in line
        receive.close()
        return None
    finally:
        send.close()
    return receive, proc


def _collect(child, jobs: list[ChartJob]) -> dict[str, tuple[bool, list[str]]]:
    receive, proc = child
    got: dict[str, tuple[bool, list[str]]] = {}
    try:
        if receive.poll(CHILD_WAIT_S):
            # our own child's pickle of plain results, over a private pipe (nothing a user handed us)
            got = {key: (ok, lines) for key, ok, lines in pickle.loads(receive.recv_bytes())}
    except (EOFError, OSError):  # the child died: draw here
        pass
    finally:
        receive.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    for job in jobs:
        if job.key not in got:
            got[job.key] = _draw_one(job)
    return got


def charts_module(notes: list[str]):
    """planner/charts.py, or None with a note when matplotlib cannot be imported (missing or broken)."""
    try:
        from . import charts
    except Exception as e:  # noqa: BLE001 - no charts; the tables, plan and JSON still stand
        notes.append(f"no charts drawn (matplotlib: {type(e).__name__}: {e})")
        return None
    return charts

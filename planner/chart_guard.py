"""Charts are a side view: one that cannot be drawn never takes the command down with it.

Pillow can be missing or broken on a user's machine, a file can be unwritable, a prediction can hold
something a chart cannot plot; the table, the plan and the JSON still stand. :func:`draw` runs one chart
and, when it fails, records one line saying which chart and why (the command prints it as a note and the
report lists it) and lets the command go on.

:func:`draw_files` draws several charts, the dearest in a forked child beside the others (a chart draws on one
core, and a long pipeline's timeline takes as long as the rest together): the same files and notes as drawing
them one after another, in about half the time on two cores. A child that dies or hangs leaves its charts to the
parent, which draws them itself; it never outlives the call.

:class:`ChartServer` goes one step further for `plan`'s report: the drawing, its imports included, moves to a child
forked when the command starts; the imports happen beside the search, the charts' data are sent to it when known,
and it draws while `plan` writes its candidates table (0.22-0.29 s for the demo's report with it, 0.27-0.34 s
drawing in line).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

CHILD_NICENESS = 5  # the chart server's priority below the command's (its drawing waits for the search anyway)
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
    _record(files, notes, jobs, _draw_jobs(jobs))


def _draw_jobs(jobs: list[ChartJob], then: Callable[[], dict[str, tuple[bool, list[str]]]] | None = None
               ) -> dict[str, tuple[bool, list[str]]]:
    """{key: (drawn, notes)} for every job; where there are fork and two cores, the jobs are dealt into two
    shares of about equal weight (heaviest first, each to the lighter share; the heaviest away) and one is drawn in
    a forked child. ``then``: more work for this process once its share is drawn, while the child may still draw
    (the chart server's second batch); its results are merged in."""
    away: list[ChartJob] = []
    if len(jobs) > 1 and (os.cpu_count() or 1) >= 2 and "fork" in multiprocessing.get_all_start_methods():
        here_weight = away_weight = 0.0
        for job in sorted(jobs, key=lambda j: -j.weight):
            if away_weight <= here_weight:
                away.append(job)
                away_weight += job.weight
            else:
                here_weight += job.weight
    child = _fork(away) if away else None
    results: dict[str, tuple[bool, list[str]]] = {}
    for job in jobs:
        if child is None or job not in away:
            results[job.key] = _draw_one(job)
    if then is not None:
        results.update(then())
    if child:
        results.update(_collect(child, away))
    return results


def _record(files: dict[str, str], notes: list[str], jobs: list[ChartJob],
            results: dict[str, tuple[bool, list[str]]]) -> None:
    """Each job's notes in the jobs' order; the path of each drawn one in ``files``."""
    for job in jobs:
        if job.key in results:
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
    receive, proc = _start_child(_child, duplex=False, daemon=True, args=(jobs,))
    return (receive, proc) if proc is not None else None


def _start_child(target: Callable, duplex: bool, daemon: bool, args: tuple = ()):
    """Fork ``target(its end of a new pipe, *args)``: (our end, the process), or (None, None) when no process can be
    started (the caller draws in line)."""
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush()  # a child flushes its copy of the buffers when it ends: nothing may be in them twice
    sys.stderr.flush()
    mine, theirs = ctx.Pipe(duplex=duplex)
    try:
        proc = ctx.Process(target=target, args=(theirs, *args), daemon=daemon)
        proc.start()
    except OSError:  # no process to spare
        mine.close()
        return None, None
    finally:
        theirs.close()
    return mine, proc


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


@dataclass
class ChartRequest:
    """A chart :class:`ChartServer` draws: ``chart`` names a function of planner/charts.py, called as
    ``chart(*args, path=path, **kwargs)``; everything in it goes through a pipe (pickled), so no closures."""

    key: str
    path: str
    what: str
    chart: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    weight: float = 1.0

    def job(self) -> ChartJob:
        return ChartJob(self.key, self.path, self.what, functools.partial(_call_chart, self.chart, self.args,
                                                                          self.kwargs), self.weight)


def _call_chart(name: str, args: tuple, kwargs: dict, path: str) -> None:
    from . import charts

    getattr(charts, name)(*args, path=path, **kwargs)


# what a pipe to a child may raise: it died (EOF, OS errors), or a request would not pickle
_PIPE_ERRORS = (EOFError, OSError, pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError, ValueError,
                RecursionError)


class ChartServer:
    """A child forked when a command starts: it imports planner/charts.py while the command works (`plan`
    searches), then draws the requests :meth:`draw` sends it, the heaviest in a grandchild (:func:`draw_files`).
    Without fork or a second core, or when the child dies or hangs, :meth:`draw` draws here what it did not: the
    same files and notes either way, in the requests' order.
    One batch per server; :meth:`close` (or draw) reaps the child."""

    def __init__(self) -> None:
        self._child = None
        if (os.cpu_count() or 1) >= 2 and "fork" in multiprocessing.get_all_start_methods():
            self._child = _fork_server()
            # a command that ends without draw or close still reaps it: before multiprocessing's own exit hook,
            # which would wait for this (non-daemon) child while our end of its pipe kept it waiting too
            atexit.register(self.close)

    def draw(self, files: dict[str, str], notes: list[str], requests: list[ChartRequest],
             meanwhile: Callable[[], None] | None = None,
             later: Callable[[], list[ChartRequest]] | None = None) -> None:
        """Draw ``requests``; record what was drawn in ``files`` and each chart's (and the import's) notes.
        ``meanwhile``: the caller's own work, done while the child draws (its errors are the caller's).
        ``later``: after that, the charts whose data the caller had to wait for (the report's scaling chart, its
        re-plans), sent to the child as a second batch: it draws them once it has drawn its own share of the first
        (its grandchild may still draw the other), so the first need not wait for them. Recorded after ``requests``,
        in their order."""
        jobs = [r.job() for r in requests]
        try:
            module_lines, sent = self._send(requests) if self._child is not None else (None, False)
            if meanwhile is not None:
                meanwhile()
            more = later() if later is not None else []
            jobs += [r.job() for r in more]
            # the child waits for the second batch (empty or not) once it has drawn its share of the first
            ready = sent and module_lines == [] and self._send_more(more)
            results = self._receive() if ready else {}
        finally:
            self.close()
        if module_lines is None:  # no child, or it failed before it was ready: the module's import here
            module_lines = []
            importable = charts_module(module_lines) is not None
        else:
            importable = not module_lines  # the child's import failed: so would this process's
        if importable:  # all of them, or what the child did not send back
            results.update(_draw_jobs([job for job in jobs if job.key not in results]))
        notes.extend(module_lines)
        _record(files, notes, jobs, results)

    def _send_more(self, requests: list[ChartRequest]) -> bool:
        """The second batch to the child (after :meth:`_send`'s): whether it went through."""
        conn, _ = self._child
        try:
            conn.send_bytes(pickle.dumps(requests))
            return True
        except _PIPE_ERRORS:
            return False

    def _send(self, requests: list[ChartRequest]) -> tuple[list[str] | None, bool]:
        """(the import's notes, or None where the child never got ready; whether the requests went to it)."""
        conn, _ = self._child
        module_lines = None
        try:
            if conn.poll(CHILD_WAIT_S):
                # our own child's pickles of plain results, over a private pipe (nothing a user handed us)
                module_lines = pickle.loads(conn.recv_bytes())
                conn.send_bytes(pickle.dumps(requests))  # it is ready, waiting for them: no deadlock
                return module_lines, True
        except _PIPE_ERRORS:
            pass  # the child died, or a request would not go through the pipe: what is missing is drawn here
        return module_lines, False

    def _receive(self) -> dict[str, tuple[bool, list[str]]]:
        """{key: (drawn, notes)} the child sent ({} where it died or hung: drawn here)."""
        conn, _ = self._child
        try:
            if conn.poll(CHILD_WAIT_S):
                return pickle.loads(conn.recv_bytes())
        except _PIPE_ERRORS:
            pass
        return {}

    def close(self) -> None:
        """Stop the child if it still runs (a command that failed half way needs no charts)."""
        if self._child is not None:
            conn, proc = self._child
            self._child = None
            atexit.unregister(self.close)
            conn.close()
            if proc.is_alive():
                try:  # its process group: the child and the grandchild drawing for it (a killed child reaps none)
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:  # not a group of its own (setpgid refused): the child alone
                    proc.kill()
            proc.join()


def _own_group(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of a process group of its own, so that killing the group stops it
    and every process it forked; both parent and child ask, whichever runs first (as shells do)."""
    try:
        os.setpgid(pid, pid or os.getpid())
    except OSError:  # e.g. the child is already gone, or the platform refuses: close() kills the child alone
        pass


def _server(conn) -> None:
    """Forked by ChartServer: import the charts and send the import's notes (none: ready); receive the requests and
    draw them, then the second batch (ChartServer.draw's ``later``) while the grandchild still draws its share; send
    {key: (drawn, notes)} for both. On any failure it stops sending: the parent draws what is missing."""
    try:
        _own_group(0)
        os.nice(CHILD_NICENESS)  # its imports run beside the search: the search, and its solvers, go first
        module_lines: list[str] = []
        ready = charts_module(module_lines) is not None
        conn.send_bytes(pickle.dumps(module_lines))
        if ready:  # while the parent searches: the first chart's set-up, paid here once (raster.warm_up)
            _warm_up()
        requests = pickle.loads(conn.recv_bytes())  # our parent's own pickle, over a private pipe
        if ready:
            def second_batch() -> dict[str, tuple[bool, list[str]]]:  # what the parent had to wait for (``later``),
                return {job.key: _draw_one(job) for job in  # drawn here while the grandchild draws its share
                        (r.job() for r in pickle.loads(conn.recv_bytes()))}

            conn.send_bytes(pickle.dumps(_draw_jobs([r.job() for r in requests], then=second_batch)))
    except BaseException:  # noqa: BLE001 - the parent sees the closed pipe and draws in line
        pass
    finally:
        conn.close()


def _warm_up() -> None:
    """raster.warm_up, whose failure changes nothing: a chart that cannot be drawn says so when it is drawn."""
    from . import raster

    try:
        raster.warm_up()
    except Exception:  # noqa: BLE001, S110 - only a head start; the drawing reports its own errors
        pass


def _fork_server():
    # not a daemon: it forks the heaviest chart's grandchild (draw_files); draw/close always reap it
    mine, proc = _start_child(_server, duplex=True, daemon=False)
    if proc is None:
        return None
    _own_group(proc.pid)
    return mine, proc


def charts_module(notes: list[str]):
    """planner/charts.py, or None with a note when Pillow cannot be imported (missing or broken)."""
    try:
        from . import charts
    except Exception as e:  # noqa: BLE001 - no charts; the tables, plan and JSON still stand
        notes.append(f"no charts drawn (Pillow: {type(e).__name__}: {e})")
        return None
    return charts

"""Start the ranks of a plan with torchrun, watch them, and say in one line why a failed job failed.

``paraplan execute`` on one machine runs ``python -m torch.distributed.run ... -m
paraplan.executor.worker ...`` with one process per GPU (or the plan's world size of CPU processes);
across nodes each node runs its own ``paraplan execute --node-rank R ...`` (static rendezvous at
``--master-addr:--master-port``, or a c10d rendezvous endpoint), and the commands for every node are
printed first.

A failing job must end, and end loudly: torchrun stops every rank once one fails; each process group
carries ``--timeout`` so a collective that waits on a dead or hung rank fails; and the launcher's own
watchdog ends the job when no rank on this node has made progress for longer than that (a hang
outside any collective, or a node that never joins). Ranks report their state in status files
(status.py), from which :func:`diagnose` names the rank that caused the failure.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .errors import JobFailed
from .status import STATUS_DIR_ENV, RankStatus, read_statuses

WATCHDOG_MARGIN = 0.5  # x --timeout (at most 15 s) on top of it, so process-group timeouts (more precise) fire first
STARTUP_ALLOWANCE_S = 60.0  # at least this long for the first rank to start (torchrun waits for every node first)
STOP_GRACE_S = 40.0  # torchrun gives its workers 30 s between SIGTERM and SIGKILL


@dataclass(frozen=True)
class TrainingOptions:
    """What the ranks train on and how they save and resume (execute's --data and checkpoint flags)."""

    data: str | None = None  # --data PATH (token_data.py); None: the bundled corpus
    data_dtype: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # save after every step this divides (0: never)
    resume: str | None = None  # a step-N folder to start from
    max_restarts: int = 0  # torchrun restarts the job this often after a failure
    init_from: str | None = None  # a Hugging Face LLaMA folder to take the initial weights from
    run_id: str | None = None  # this launch's id, recorded in its checkpoints (restarts resume from their own)

    def worker_args(self) -> list[str]:
        args = []
        for flag, value in (("--data", self.data), ("--data-dtype", self.data_dtype),
                            ("--checkpoint-dir", self.checkpoint_dir), ("--resume", self.resume),
                            ("--init-from", self.init_from), ("--run-id", self.run_id)):
            if value:
                args += [flag, value if flag in ("--data-dtype", "--run-id") else os.path.abspath(value)]
        if self.checkpoint_every:
            args += ["--checkpoint-every", str(self.checkpoint_every)]
        return args


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_endpoint: str | None = None
    run_id: str = "paraplan"
    timeout_s: float = 300.0
    steps: int = 5
    debug: bool = False
    quiet: bool = False  # ranks print nothing on stdout (the caller prints the record as JSON)
    threads_per_rank: int | None = None  # OMP threads of a CPU rank (None: leave the environment's)
    training: TrainingOptions = TrainingOptions()


def torchrun_command(plans: list[str], outs: list[str | None], opts: LaunchOptions) -> list[str]:
    """The exact torchrun command line for this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(opts.nnodes),
           "--nproc-per-node", str(opts.nproc_per_node), "--max-restarts", str(opts.training.max_restarts),
           "--monitor-interval", "0.2"]
    if opts.rdzv_endpoint:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint, "--rdzv-id", opts.run_id]
    else:
        cmd += ["--node-rank", str(opts.node_rank), "--master-addr", opts.master_addr,
                "--master-port", str(opts.master_port)]
    cmd += ["-m", "paraplan.executor.worker", "--steps", str(opts.steps), "--timeout", str(opts.timeout_s),
            "--nnodes", str(opts.nnodes)]
    for plan, out in zip(plans, outs, strict=True):
        cmd += ["--plan", os.path.abspath(plan), "--out", os.path.abspath(out) if out else "-"]
    cmd += opts.training.worker_args()
    if opts.quiet:
        cmd.append("--quiet")
    if opts.debug:
        cmd.append("--debug")
    return cmd


def quote(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


@dataclass
class Outcome:
    """How torchrun ended on this node, and what the local ranks said."""

    returncode: int
    statuses: dict[int, RankStatus]
    torchrun_stderr: str
    world_size: int
    watchdog: str | None = None  # why the watchdog ended the job, if it did
    status_dir: str | None = None  # the ranks' status files and logs


def run_torchrun(plans: list[str], outs: list[str | None], opts: LaunchOptions) -> Outcome:
    """Run this node's part; returns when every local rank has ended (raises nothing)."""
    status_dir = tempfile.mkdtemp(prefix="paraplan-run-")
    env = {**os.environ, STATUS_DIR_ENV: status_dir, "PYTHONUNBUFFERED": "1"}
    if opts.threads_per_rank is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(opts.threads_per_rank)
    cmd = torchrun_command(plans, outs, opts)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=None if opts.debug else subprocess.PIPE,
                            env=env, text=True)
    err_lines: list[str] = []
    reader = None
    if proc.stderr is not None:
        reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
        reader.start()
    why = None
    restarts = [0]

    def on_restart(before: dict[int, RankStatus]) -> None:
        restarts[0] += 1
        t = opts.training
        where = ("the latest complete checkpoint" if t.checkpoint_dir else
                 "the checkpoint it resumed from" if t.resume else "step 1")
        sys.stderr.write(f"paraplan execute: {restart_cause(before)}; torchrun restarts the job from {where} "
                         f"(restart {restarts[0]} of {t.max_restarts})\n")
        sys.stderr.flush()

    try:
        why = _watch(proc, status_dir, opts.timeout_s, on_restart if opts.training.max_restarts else None)
    except KeyboardInterrupt:  # the user stopped it: its ranks and their logs go (a QA pass found 14 folders left)
        _stop(proc, status_dir)
        shutil.rmtree(status_dir, ignore_errors=True)
        raise
    if reader is not None:
        reader.join(timeout=5)
    return Outcome(returncode=proc.returncode, statuses=read_statuses(status_dir),
                   torchrun_stderr="".join(err_lines), world_size=opts.nproc_per_node * opts.nnodes, watchdog=why,
                   status_dir=status_dir)


def _watch(proc: subprocess.Popen, status_dir: str, timeout_s: float, on_restart=None) -> str | None:
    """Wait for torchrun; end it when no local rank has made progress for --timeout (+ a margin). When
    torchrun restarts the workers (--max-restarts), call ``on_restart`` with the statuses just before."""
    started = time.time()
    limit = timeout_s + min(15.0, WATCHDOG_MARGIN * timeout_s) if timeout_s > 0 else None
    seen: dict[int, int] = {}  # rank -> the pid it last reported
    attempt: set[int] = set()  # pids of the current attempt's ranks
    before: dict[int, RankStatus] = {}
    while proc.poll() is None:
        time.sleep(0.2)
        statuses = read_statuses(status_dir)
        for r, st in statuses.items():
            old = seen.get(r)
            if old is not None and st.pid != old and old in attempt:  # a new process for a rank: a restart
                if on_restart is not None:
                    on_restart(before)
                attempt = set()
            if old is None or st.pid != old:
                attempt.add(st.pid)
            seen[r] = st.pid
        before = statuses
        if limit is None:
            continue
        live = [s for s in statuses.values() if s.state == "running"]
        last = max((s.time for s in live), default=None)
        startup = max(limit, STARTUP_ALLOWANCE_S)
        if not statuses and time.time() - started > startup:
            _stop(proc, status_dir)
            return f"no rank started within {startup:g} s (is every node running its command?)"
        if last is not None and time.time() - last > limit:
            stalled = sorted(live, key=lambda s: s.time)[0]  # the rank that reported progress longest ago
            _stop(proc, status_dir)
            return f"rank {stalled.rank} hung {_where(stalled)}: no progress for {timeout_s:g} s"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def restart_cause(before: dict[int, RankStatus]) -> str:
    """Why the attempt that just ended failed, from its last statuses on this node (one phrase)."""
    errors = sorted((s for s in before.values() if s.state == "error"), key=lambda s: s.time)
    if errors:
        return f"rank {errors[0].rank} failed {_where(errors[0])}: {errors[0].message}"
    dead = sorted((s for s in before.values() if s.state == "running" and s.pid and not _alive(s.pid)),
                  key=lambda s: s.rank)
    if dead:
        return f"rank {dead[0].rank} died {_where(dead[0])}"
    peers = [s for s in before.values() if s.state == "peer"]
    stuck = sorted((s for s in before.values() if s.state in ("running", "terminated")), key=lambda s: s.rank)
    if peers and stuck:
        return f"rank {stuck[0].rank} hung {_where(stuck[0])}"
    if peers:
        return f"a rank on another node failed (rank {peers[0].rank} here saw: {peers[0].message})"
    return "a rank failed"


def _stop(proc: subprocess.Popen, status_dir: str) -> None:
    """End torchrun and its workers: SIGTERM (torchrun forwards it), then SIGKILL what is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for st in read_statuses(status_dir).values():  # workers run in sessions of their own
        if st.state == "running" and st.pid:
            try:
                os.kill(st.pid, signal.SIGKILL)
            except OSError:
                pass


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_failures(stderr: str) -> dict[int, int]:
    """Rank -> exit code of the failures torchrun reported (its ChildFailedError summary)."""
    return {int(r): int(c) for r, c in _FAILURE.findall(stderr)}


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


PHASES = {"starting": "while starting", "rendezvous": "while joining the process group",
          "mesh": "while building the device mesh", "model": "while building its model chunks",
          "optimizer": "while building the optimizer", "pipeline": "while building the pipeline schedule",
          "resume": "while loading its checkpoint",
          "finish": "after its last step (draining parameter-server replies)",
          "record": "while recording the run", "done": "after finishing"}


def _where(st: RankStatus) -> str:
    if st.phase == "checkpoint":
        return f"while saving the checkpoint of step {st.step + 1}"
    return f"step {st.step + 1}" if st.phase == "train" else PHASES.get(st.phase, f"while {st.phase}")


def diagnose(o: Outcome) -> str:
    """One line naming the rank that made the job fail, and how."""
    sts = o.statuses
    errors = sorted((s for s in sts.values() if s.state == "error"), key=lambda s: s.time)
    if errors:
        first = errors[0]
        more = f" (ranks {', '.join(str(s.rank) for s in errors[1:])} too)" if len(errors) > 1 else ""
        return f"rank {first.rank} failed {_where(first)}: {first.message}{more}"
    failures = torchrun_failures(o.torchrun_stderr)
    dead = sorted(r for r, code in failures.items()
                  if r not in sts or sts[r].state == "running")  # ended without saying why: it died
    if dead:
        r = dead[0]
        where = f" {_where(sts[r])}" if r in sts else " before it started"
        return f"rank {r} died{where} ({_exit_text(failures[r])})"
    if o.watchdog:
        return o.watchdog
    peers = [s for s in sts.values() if s.state == "peer"]
    timed_out = [s for s in peers if "timed out" in s.message.lower() or "timeout" in s.message.lower()]
    hung = sorted(s.rank for s in sts.values() if s.state in ("running", "terminated"))
    if timed_out and hung:
        st = sts[hung[0]]
        return (f"rank {st.rank} hung {_where(st)}: the other ranks timed out after waiting for it "
                f"(--timeout)")
    if peers:
        st = sorted(peers, key=lambda s: s.time)[0]
        missing = [r for r in range(o.world_size) if r not in sts]
        culprit = f"a rank on another node (one of ranks {_ranges(missing)})" if missing else "another rank"
        return f"{culprit} failed; rank {st.rank} here saw: {st.message}"
    tail = [ln for ln in o.torchrun_stderr.strip().splitlines() if ln.strip()]
    return f"torchrun failed ({_exit_text(o.returncode)})" + (f": {tail[-1].strip()}" if tail else "")


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if ranks else "?"


def launch(plans: list[str], outs: list[str | None], opts: LaunchOptions) -> None:
    """Run this node's part of the job; raise JobFailed with the diagnosis if it fails."""
    outcome = run_torchrun(plans, outs, opts)
    if outcome.returncode == 0 and outcome.watchdog is None:
        shutil.rmtree(outcome.status_dir, ignore_errors=True)
        return
    if outcome.torchrun_stderr:
        with open(os.path.join(outcome.status_dir, "torchrun.log"), "w") as f:
            f.write(outcome.torchrun_stderr)
    raise JobFailed(f"{diagnose(outcome)} (logs of this node's ranks: {outcome.status_dir})")

"""The program each rank runs under torchrun: ``python -m paraplan.executor.worker --plan PLAN.json ...``.

It joins the process group (gloo on CPU, nccl on CUDA) with the run's timeout, builds its share of
the plan (parallelize.py), trains, and rank 0 reports and writes the run record. Several plans of
the same world size may be given; they run one after the other in the same processes (the tests
use this to pay for the start-up once).

Every rank keeps a status file for its launcher (status.py) and classifies how it stopped: an
exception of its own (``error``), a collective that failed because of another rank (``peer``), or
a SIGTERM from torchrun/the launcher (``terminated``). Output of ranks other than 0 (and rank 0's
stderr) goes to per-rank log files beside the status files, so the console shows one clean run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

FAULT_ENV = "PARAPLAN_FAULT"  # fault injection for tests: "exit:RANK:STEP", "hang:RANK:STEP" or "raise:RANK:STEP"
# (STEP counts from 1, as the messages do)
PEER_ERROR_MARKERS = ("connection closed by peer", "connection reset", "timed out", "timeout", "broken pipe",
                      "socket", "nccl", "gloo", "recv", "send", "peer", "abort")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="paraplan.executor.worker")
    p.add_argument("--plan", action="append", required=True, help="plan file (repeatable: run one after another)")
    p.add_argument("--out", action="append", default=[], help="record folder per plan ('-' for none)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


class Terminated(BaseException):
    """SIGTERM arrived (torchrun or the launcher is ending the job)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _redirect_output(rank: int, folder: str | None) -> None:
    """Send this rank's stderr (and stdout, unless rank 0) to ``folder/rank<R>.log`` (file descriptors
    too, so C++ warnings follow)."""
    if not folder:
        return
    log = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(log, 2)
    if rank != 0:
        sys.stdout.flush()
        os.dup2(log, 1)
    os.close(log)


def _fault(rank: int, step: int) -> None:
    """Injected faults (tests): make rank RANK exit, hang or raise at the start of step STEP (1-based)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, r, s = spec.split(":")
    if int(r) != rank or int(s) != step + 1:
        return
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step + 1}")


def is_peer_failure(exc: BaseException) -> bool:
    """Did a collective or point-to-point op fail (because of another rank) rather than our own code?"""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in PEER_ERROR_MARKERS)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (pipelining wraps a stage's error in its own)."""
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def one_line(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def device_for(job) -> tuple:
    """(torch.device, backend) for this rank: the local GPU with nccl, or the CPU with gloo."""
    import torch

    if job_device_type(job) == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def job_device_type(job) -> str:
    from .machine import plan_device_type

    return plan_device_type(job.plan)


def run_plan(job, steps: int, out: str | None, timeout: timedelta | None, status, nnodes: int) -> None:
    import torch
    import torch.distributed as dist

    from .console import TrainingDisplay
    from .parallelize import build_rank_model
    from .record import RunSummary, peak_memory_gib
    from .trainer import Trainer

    rank = dist.get_rank()
    device, backend = device_for(job)
    rm = build_rank_model(job, rank, device, timeout, on_phase=lambda ph: status.update(phase=ph))
    trainer = Trainer.create(rm)
    notes = []
    if device.type == "cpu" and job.layout.dtype != "fp32":
        notes.append(f"the plan trains in {job.layout.dtype}; on CPU the executor trains in fp32")
    with TrainingDisplay(job, steps, enabled=rank == 0, notes=notes) as display:
        for k in range(steps):
            status.update(phase="train", step=k)
            _fault(rank, k)
            r = trainer.step(k)
            display.step(k, r.loss, r.time_s)
    status.update(phase="record")
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_gib(device))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        summary = RunSummary(job=job, losses=[r.loss for r in trainer.results],
                             step_time_s=[r.time_s for r in trainer.results], peak_memory_gib=peaks,
                             backend=backend, device=name, nnodes=nnodes)
        display.summary(summary)
        if out:
            path = summary.write(out)
            display.console.print(f"run record written to {path}")
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    from .status import STATUS_DIR_ENV, StatusWriter

    status = StatusWriter.from_env(rank)
    if not args.debug:
        _redirect_output(rank, os.environ.get(STATUS_DIR_ENV))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        import torch.distributed as dist

        from .job import Job

        jobs = [Job.load(p) for p in args.plan]
        outs = [None if o == "-" else o for o in args.out] + [None] * (len(jobs) - len(args.out))
        timeout = timedelta(seconds=args.timeout) if args.timeout > 0 else None
        _, backend = device_for(jobs[0])
        status.update(phase="rendezvous")
        dist.init_process_group(backend=backend, timeout=timeout)
        for job in jobs:
            job.dims.check_world(dist.get_world_size())
        for job, out in zip(jobs, outs, strict=True):
            run_plan(job, args.steps, out, timeout, status, args.nnodes)
        status.update(state="done", phase="done")
        dist.destroy_process_group()
        return 0
    except Terminated:
        status.update(state="terminated", message=f"ended by SIGTERM during {status.status.phase}")
        return 143
    except BaseException as e:  # noqa: BLE001 - every failure is classified for the launcher
        root = root_cause(e)
        status.update(state="peer" if is_peer_failure(root) else "error", message=one_line(root))
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())

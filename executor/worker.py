"""The program each rank runs under torchrun: ``python -m paraplan.executor.worker --plan PLAN.json ...``.

It joins the process group (gloo on CPU, nccl on CUDA) with the run's timeout, builds its share of
the plan (parallelize.py), trains, and rank 0 reports and writes the run record. Several plans of
the same world size may be given; they run one after the other in the same processes (the tests
use this to pay for the start-up once).

Every rank keeps a status file for its launcher (status.py) and classifies how it stopped: an
exception of its own (``error``), a collective that failed because of another rank (``peer``), or
a SIGTERM from torchrun/the launcher (``terminated``). Output of ranks other than 0 (and rank 0's
stderr) goes to per-rank log files beside the status files, so the console shows one clean run.
Heavy imports (torch) come after the first status write, so the launcher sees a starting rank at once.

With one plan, the run may read the user's tokens, save checkpoints, resume from one, and, when
torchrun restarts the job after a failure, resume by itself from the latest complete one
(training.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import traceback
from datetime import timedelta

from .failures import is_peer_failure, one_line, root_cause
from .status import STATUS_DIR_ENV, StatusWriter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="paraplan.executor.worker")
    p.add_argument("--plan", action="append", required=True, help="plan file (repeatable: run one after another)")
    p.add_argument("--out", action="append", default=[], help="record folder per plan ('-' for none)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--quiet", action="store_true", help="no progress or summary on stdout (execute --json)")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--data", help="token file (execute --data)")
    p.add_argument("--data-dtype")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", help="checkpoint folder to start from")
    p.add_argument("--init-from", help="Hugging Face LLaMA folder with the initial weights")
    p.add_argument("--run-id", help="the launch's id, recorded in its checkpoints")
    return p.parse_args(argv)


def training_options(args: argparse.Namespace):
    from .launch import TrainingOptions

    return TrainingOptions(data=args.data, data_dtype=args.data_dtype, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, resume=args.resume, init_from=args.init_from,
                           run_id=args.run_id)


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


def run_plan(job, steps: int, out: str | None, timeout: timedelta | None, status, nnodes: int,
             quiet: bool = False, training=None) -> None:
    import torch
    import torch.distributed as dist

    from .failures import inject_fault
    from .machine import rank_device
    from .optim import optimizer_state_bytes
    from .record import RunSummary, peak_memory_gib

    rank = dist.get_rank()
    device, backend = rank_device(job.plan)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # several plans may run in one process
    if job.is_server(rank):
        from .param_server import ParameterServer
        from .ps_protocol import PSRoles
        from .ps_worker import worker_group

        status.update(phase="mesh")
        worker_group(PSRoles.of(job.layout), timeout)  # every rank takes part in creating the workers' group
        status.update(phase="model")
        server = ParameterServer(job, rank, device)

        def on_step(k: int) -> None:
            status.update(phase="train", step=k)
            inject_fault(rank, k)

        server.serve(steps, on_step)
        results, optimizer, resumed = [], server.optimizer, None
    else:
        results, optimizer, resumed = _train(job, rank, device, steps, timeout, status, quiet, training, out)
    status.update(phase="record")
    per_rank: list = [None] * dist.get_world_size()  # (peak memory GiB, optimizer state GiB) of every rank
    dist.all_gather_object(per_rank, (peak_memory_gib(device), optimizer_state_bytes(optimizer) / 2**30))
    if rank == 0:
        from .console import TrainingDisplay

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        summary = RunSummary(job=job, losses=[r.loss for r in results],
                             step_time_s=[r.time_s for r in results], peak_memory_gib=[m for m, _ in per_rank],
                             optimizer_state_gib=[o for _, o in per_rank],
                             backend=backend, device=name, nnodes=nnodes, restarts=_restarts(),
                             resumed_from_step=resumed, data=_data_record(training, job))
        display = TrainingDisplay(job, steps, enabled=not quiet)
        display.summary(summary)
        if out:
            path = summary.write(out)
            if not quiet:
                display.console.print(f"run record written to {path}")
    dist.barrier()


def _train(job, rank: int, device, steps: int, timeout: timedelta | None, status, quiet: bool, training,
           out: str | None):
    """Build this rank's model and train it; returns (every step's result, optimizer, the step the run
    resumed from or None)."""
    from .console import TrainingDisplay
    from .failures import inject_fault
    from .launch import TrainingOptions
    from .parallelize import build_rank_model
    from .training import TrainingRun

    rm = build_rank_model(job, rank, device, timeout, on_phase=lambda ph: status.update(phase=ph))
    status.update(phase="resume")
    run = TrainingRun.start(rm, training or TrainingOptions(), steps, out)
    notes = []
    if device.type == "cpu" and job.layout.dtype != "fp32":
        notes.append(f"the plan trains in {job.layout.dtype}; on CPU the executor trains in fp32")
    notes += _layout_notes(job) + run.notes
    try:
        with TrainingDisplay(job, steps, enabled=rank == 0 and not quiet, notes=notes,
                             start=run.start_step) as display:
            for k in range(run.start_step, steps):
                status.update(phase="train", step=k)
                inject_fault(rank, k)
                r = run.step(k)
                display.step(k, r.loss, r.time_s)
                if run.checkpoint_due(k):
                    status.update(phase="checkpoint", step=k)
                    path = run.save(k)
                    display.note(f"checkpoint {path}")
        status.update(phase="finish")
        run.trainer.finish()
    finally:
        run.close()
    return run.results(), rm.optimizer, run.resumed_from_step


def _restarts() -> int:
    from .training import restart_count

    return restart_count()


def _data_record(training, job) -> dict | None:
    """What run.json says about the data: the token file, or None for the bundled corpus."""
    if training is None or not training.data:
        return None
    from .token_data import open_tokens

    return open_tokens(training.data, training.data_dtype, job.spec.vocab_size).describe()


def _init_process_group(backend: str, timeout: timedelta | None) -> None:
    """Join the job's process group. Under torchrun the workers share the agent's store, which a static
    rendezvous keeps for the whole job: a restarted attempt would read the dead attempt's addresses
    (gloo then waits on ports nobody listens on). Each attempt gets a namespace of its own in it."""
    import torch.distributed as dist

    from .training import restart_count

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout or timedelta(minutes=30))
    store = dist.PrefixStore(f"/paraplan/attempt_{restart_count()}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi == lo + 1 else f"ranks {lo}-{hi - 1}"


def _layout_notes(job) -> list[str]:
    lay = job.layout
    notes = []
    if lay.dp_mode == "ps":
        mode = "sync" if lay.ps_staleness == 0 else f"async, staleness bound {lay.ps_staleness}"
        notes.append(f"{lay.num_gpus} workers ({_ranks(0, lay.num_gpus)}) and {lay.ps_servers} parameter "
                     f"server{'s' if lay.ps_servers > 1 else ''} ({_ranks(lay.num_gpus, lay.world_size)}), {mode}")
        if lay.ps_staleness:
            notes.append("step losses shown are worker 0's; the record holds the mean over every worker")
    if lay.head_parallel > 1:
        notes.append(f"classifier sharded by class over groups of {lay.head_parallel} consecutive ranks")
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    status = StatusWriter.from_env(rank)
    if not args.debug:
        _redirect_output(rank, os.environ.get(STATUS_DIR_ENV))
    # a native crash (a segfault in a collective library) writes every thread's Python stack to the rank's log, so
    # the launcher's "died with SIGSEGV" points somewhere
    faulthandler.enable()
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        import torch.distributed as dist

        from .errors import ExecutionError
        from .job import Job
        from .machine import rank_device

        jobs = [Job.load(p) for p in args.plan]
        outs = [None if o == "-" else o for o in args.out] + [None] * (len(jobs) - len(args.out))
        training = training_options(args)
        if len(jobs) > 1 and training != type(training)():
            raise ExecutionError("--data, checkpoints and --resume apply to one plan per launch")
        timeout = timedelta(seconds=args.timeout) if args.timeout > 0 else None
        _, backend = rank_device(jobs[0].plan)
        status.update(phase="rendezvous")
        _init_process_group(backend, timeout)
        for job in jobs:
            job.check_world(dist.get_world_size())
        for job, out in zip(jobs, outs, strict=True):
            run_plan(job, args.steps, out, timeout, status, args.nnodes, quiet=args.quiet, training=training)
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


def exit_now(code: int) -> None:
    """Leave with ``code`` once the rank's work is done, skipping the interpreter's finalization: there gloo's
    threads and the objects holding process groups are torn down in no fixed order, and a rank that had finished
    was seen to die of SIGABRT or SIGSEGV (tests/spawned_rank.py), which would fail a finished job."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

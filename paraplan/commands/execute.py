"""``paraplan execute``: train a plan with torch.distributed, on this machine or across nodes.

Everything that can be refused is refused before a process starts (the plan, the slots or GPUs, the
node options, the port, the data file, the checkpoint to resume and whether it holds the plan's
model); then torchrun runs this node's ranks and a failure comes back as one line naming the rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import uuid
import zlib

from paraplan.executor.errors import ExecutionError, JobFailed
from paraplan.executor.job import Job
from paraplan.executor.launch import LaunchOptions, TrainingOptions, launch, quote
from paraplan.executor.machine import check_port_free, check_slots, free_port, plan_cluster, plan_device_type
from paraplan.hardware_specs.identity import threads_per_rank
from paraplan.planner.framework import other_stack_note

from .output import print_json

DEFAULT_MULTI_NODE_PORT = 29500


def node_command(args, node_rank: int, port: int) -> list[str]:
    """The ``paraplan execute`` command node ``node_rank`` runs."""
    cmd = ["paraplan", "execute", "--plan", args.plan, "--steps", str(args.steps), "--nnodes", str(args.nnodes),
           "--node-rank", str(node_rank), "--timeout", f"{args.timeout:g}"]
    if args.rdzv_endpoint:
        cmd += ["--rdzv-endpoint", args.rdzv_endpoint]
    else:
        cmd += ["--master-addr", args.master_addr, "--master-port", str(port)]
    if args.out:
        cmd += ["--out", args.out]
    for flag in ("data", "data_dtype", "checkpoint_dir", "checkpoint_every", "resume", "max_restarts", "init_from"):
        value = getattr(args, flag, None)
        if value:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    return cmd


def checkpoint_refusal(lay) -> str | None:
    """Why this executor cannot write or resume checkpoints of a plan of layout ``lay`` (None: it can). The Slurm
    export leaves its checkpoint flags out for such a plan."""
    if lay.dp_mode == "ps" or lay.head_parallel > 1:
        what = "parameter servers" if lay.dp_mode == "ps" else "a class-sharded classifier (head_parallel)"
        return (f"checkpoints are written and resumed for all-reduce data, tensor and pipeline parallelism; the plan "
                f"uses {what}")
    if lay.ep > 1:  # experts differ per expert-parallel rank: they need global offsets to reshard
        return f"checkpoints of expert-parallel plans (ep {lay.ep}) are not written or resumed yet"
    return None


def training_options(args, job: Job) -> TrainingOptions:
    """Check --data, the checkpoint flags and --resume before any rank starts (one line, exit 2)."""
    lay, spec = job.layout, job.spec
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ExecutionError("--checkpoint-every needs --checkpoint-dir DIR (where to write the checkpoints)")
    if (args.checkpoint_dir or args.resume) and (why := checkpoint_refusal(lay)):
        raise ExecutionError(why)
    if args.checkpoint_dir:
        _check_folder("--checkpoint-dir", args.checkpoint_dir)
        from paraplan.executor import checkpoint_io

        found = checkpoint_io.complete_steps(args.checkpoint_dir)
        if found and not args.resume:
            raise ExecutionError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (up to step-"
                                 f"{found[-1]}): continue that run with --resume {args.checkpoint_dir}, or give "
                                 "an empty folder")
    resume = None
    if args.resume:
        from paraplan.executor import checkpoint_io

        resume = checkpoint_io.resolve(args.resume)
        state = checkpoint_io.read_state(resume)
        checkpoint_io.check_model(state, job, resume)  # before anything else of the checkpoint is read
        if state.step >= args.steps:
            raise ExecutionError(f"--resume {args.resume}: the checkpoint is at step {state.step} and --steps is "
                                 f"{args.steps}; --steps is the run's total, so give more than {state.step}")
        later = [n for n in checkpoint_io.complete_steps(args.checkpoint_dir) if n > state.step] \
            if args.checkpoint_dir else []
        if later:  # the resumed run writes its own step-N over the first run's
            sys.stderr.write(f"paraplan execute: warning: resuming from step {state.step} while "
                             f"{args.checkpoint_dir} holds later checkpoints (step-{', step-'.join(map(str, later))}): "
                             "this run replaces those it reaches\n")
    if args.data:
        from paraplan.executor.token_data import check_tokens, open_tokens

        if not hasattr(spec, "vocab_size"):
            raise ExecutionError(f"--data feeds language models (gpt, llama, bert); {spec.name} is a {spec.family} "
                                 "model, trained on synthetic samples")
        tokens = open_tokens(args.data, args.data_dtype, spec.vocab_size)
        check_tokens(tokens, spec.vocab_size, job.seq_length + 1, f"--data {args.data}")
    elif args.data_dtype:
        raise ExecutionError("--data-dtype applies to --data")
    if args.init_from:
        from paraplan.executor.hf_weights import check

        if lay.dp_mode == "ps" or lay.head_parallel > 1:
            raise ExecutionError("--init-from runs with all-reduce data, tensor and pipeline parallelism")
        check(args.init_from, job)
    return TrainingOptions(data=args.data, data_dtype=args.data_dtype, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every or 0, resume=resume,
                           max_restarts=args.max_restarts, init_from=args.init_from,
                           run_id=uuid.uuid4().hex if args.checkpoint_dir else None)


def _check_folder(flag: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ExecutionError(f"{flag} {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ExecutionError(f"{flag} {path}: not writable")


def _check_out(path: str) -> None:
    _check_folder("--out", path)


@contextlib.contextmanager
def _out_lock(out: str | None):
    """Hold ``out`` for this run: a second execute writing the same folder at once would interleave its records
    (metrics.jsonl, run.json) with this one's, so it is refused in one line while this run holds the lock."""
    if not out:
        yield
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".paraplan-execute.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExecutionError(f"--out {out} is being written by another paraplan execute; wait for it or give "
                                 "another --out") from None
        yield


def _rendezvous_port(args) -> int:
    """Check the rendezvous address; returns the port torchrun will use."""
    if args.rdzv_endpoint:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()):
            raise ExecutionError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected host:port")
        if args.master_port is not None:
            raise ExecutionError("give either --rdzv-endpoint or --master-addr/--master-port, not both")
        return int(port)
    if args.master_port is not None:
        port = args.master_port
    elif args.nnodes == 1:
        port = free_port(args.master_addr)
    else:
        port = DEFAULT_MULTI_NODE_PORT
    if args.node_rank == 0:  # node 0 hosts the rendezvous store on this port
        check_port_free(args.master_addr, port)
    return port


def run(args) -> int:
    if args.dry_run:
        return dry_run(args)
    if not 0 <= args.node_rank < args.nnodes:
        raise ExecutionError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    job = Job.load(args.plan)
    nproc = check_slots(job.plan, job.world_size, args.nnodes)
    unknown = None if plan_cluster(job.plan) is not None else (
        f"the plan's cluster {job.plan.cluster!r} is not known here (no such spec name or file): the device is what "
        "this machine has, its process slots are not checked and MFU is not computed")
    other_stack = other_stack_note(job.plan.stack(), "its prediction was", "this run is",
                                   "price it with --framework paraplan to compare the run with its own stack")
    for warning in (job.stale_prediction, job.plan.memory_warning(), unknown, other_stack):
        if warning:
            sys.stderr.write(f"paraplan execute: warning: {warning}\n")
    training = training_options(args, job)
    out = args.out
    if args.json and not out and args.node_rank == 0:  # the record is printed, so it is written somewhere first
        out = tempfile.mkdtemp(prefix="paraplan-record-")
    if out and args.node_rank == 0:
        _check_out(out)
    port = _rendezvous_port(args)
    threads = threads_per_rank(nproc) if plan_device_type(job.plan) == "cpu" else None
    with open(args.plan, "rb") as f:
        run_id = f"paraplan-{zlib.crc32(f.read()):08x}"
    opts = LaunchOptions(nproc_per_node=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                         master_addr=args.master_addr, master_port=port, rdzv_endpoint=args.rdzv_endpoint,
                         run_id=run_id, timeout_s=args.timeout, steps=args.steps, debug=args.debug,
                         quiet=args.json, threads_per_rank=threads, training=training)
    if args.nnodes > 1:
        sys.stderr.write(f"{args.nnodes} nodes x {nproc} ranks; run on each node:\n")
        for r in range(args.nnodes):
            sys.stderr.write(f"  node {r}: {quote(node_command(args, r, port))}\n")
        sys.stderr.write(f"this is node {args.node_rank}; starting its ranks\n")
    if args.debug:
        from paraplan.executor.launch import torchrun_command

        sys.stderr.write(f"torchrun: {quote(torchrun_command([args.plan], [out], opts))}\n")
    sys.stderr.flush()
    try:
        with _out_lock(out if args.node_rank == 0 else None):
            launch([args.plan], [out], opts)
    except JobFailed as e:  # it ran and failed: one line too, but exit 1 (2 means refused before starting)
        if args.debug:
            raise
        sys.stderr.write(f"paraplan execute: error: {e}\n")
        return 1
    if args.json:
        if args.node_rank == 0:
            with open(os.path.join(out, "run.json")) as f:
                print_json(json.load(f))
        else:
            print_json({"node_rank": args.node_rank, "nnodes": args.nnodes, "finished": True})
    return 0


def dry_run(args) -> int:
    """``execute --dry-run``: trace the plan's ranks (executor/dry_run.py) and show traced beside predicted."""
    from paraplan.executor.dry_run import dry_run as trace_plan

    from .dry_run_table import print_dry_run
    from .output import stderr

    job = Job.load(args.plan)
    if plan_cluster(job.plan) is None:  # its GPUs (or CPUs) decide the device, dtype and capacity traced
        raise ExecutionError(f"--dry-run: the plan's cluster {job.plan.cluster!r} is not known here (no such spec name "
                             "or file, and the plan carries no cluster_spec): the dry run traces the plan's devices "
                             "and their memory from it; dry-run where that spec is known")
    progress = (lambda line: None) if args.json else (lambda line: stderr.print(line, markup=False, highlight=False))
    result = trace_plan(job, plan_device_type(job.plan), progress=progress)
    if args.json:
        print_json(result.to_dict())
    else:
        print_dry_run(result.to_dict(), job)
    return 0

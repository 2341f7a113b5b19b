"""The ``paraplan`` command line: one entry point, one sub-command per job (DESIGN.md, CLI).

Sub-command handlers live in :mod:`paraplan.commands` and are imported only when used, so
``paraplan hardware`` does not pay for importing torch. Every user error is one line on stderr and
exit code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import os
import sys

from paraplan import __version__

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")
RECOMPUTE = ("none", "norm+act", "selective", "mlp", "selective+mlp", "full")
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp8")
# plan's default memory margin (Workload.memory_margin): the demo's picks trace 0.8% (1F1B) to 1.2% (interleaved,
# RMSNorm fused) above their predicted peaks in the executor's dry run; a plan at the GPU's last GiB would not survive
PLAN_MEMORY_MARGIN = 0.02
FRAMEWORK_CHOICES = ("paraplan", "megatron-core", "megatron-2021", "megatron-deepspeed", "deepspeed", "torchtitan",
                     "nemo-automodel")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (not usage + error) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _recompute_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in RECOMPUTE]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected modes of {', '.join(RECOMPUTE)} separated by commas, got {text!r}")
    return modes


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.02, got {text!r}") from None
    if not 0.0 <= value < 0.5:  # nan fails this too
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 0.5 (a share of the GPU's memory), got {text}")
    return value


def _add_memory_margin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-margin", type=_margin, default=PLAN_MEMORY_MARGIN, metavar="SHARE",
                   help="share of each GPU's memory plans leave free for the prediction's own error against what the "
                        f"executor allocates (default {PLAN_MEMORY_MARGIN:g}; 0 plans to the whole GPU)")


def _add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    if json_flag:
        p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def _add_workload(p: argparse.ArgumentParser, model_required: bool = True, batch_required: bool = True) -> None:
    p.add_argument("--model", required=model_required,
                   help="preset name, YAML spec or HF config.json (your own nn.Module: profile only)")
    p.add_argument("--cluster", required=model_required, help="cluster name (paraplan hardware) or YAML file")
    p.add_argument("--nodes", type=_positive_int, help="override the cluster's node count")
    p.add_argument("--global-batch", type=_positive_int, required=batch_required, help="samples per iteration")
    p.add_argument("--seq-len", type=_positive_int, help="sequence length (default: the model's)")
    p.add_argument("--framework", default="paraplan", choices=FRAMEWORK_CHOICES,
                   help="the software stack to price: paraplan (this executor), megatron-core, megatron-2021, "
                        "megatron-deepspeed, deepspeed, torchtitan, nemo-automodel")
    p.add_argument("--attention", choices=("flash", "unfused"), help="attention kernel (overrides the framework)")
    p.add_argument("--overlap-dp", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the data-parallel gradient sync with the backward (overrides the framework)")
    p.add_argument("--overlap-tp", action=argparse.BooleanOptionalAction, default=None,
                   help="hide tensor-parallel input-gradient all-reduces behind weight-gradient GEMMs (overrides "
                        "the framework)")
    p.add_argument("--moe-dispatcher", choices=("alltoall", "hybridep"),
                   help="MoE token dispatcher: one all-to-all per routed copy, or DeepEP/HybridEP (one copy per "
                        "remote node, forwarded over NVLink) (overrides the framework)")
    p.add_argument("--moe-routing", choices=("uniform", "consecutive"),
                   help="how tokens pick experts, which sets what a deduplicating dispatcher (hybridep) sends: "
                        "uniform (a trained router, or Megatron-Core's forced balancing: random logits), or "
                        "consecutive (NeMo Automodel's fake_balanced_gate: token t takes experts t*k..t*k+k-1 mod E) "
                        "(overrides the framework)")
    p.add_argument("--moe-a2a-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="hide each MoE all-to-all behind another micro-batch's compute (overrides the framework)")
    p.add_argument("--moe-shared-expert-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="run the MoE shared experts' GEMMs beside the dispatch and combine all-to-alls, on a stream "
                        "of their own (overrides the framework)")
    p.add_argument("--moe-capacity-factor", type=float,
                   help="MoE token dropping: each expert takes at most this many times its mean share of a rank's "
                        "routed tokens, the rest are dropped (default: dropless) (overrides the framework)")
    p.add_argument("--moe-pad-to-capacity", action=argparse.BooleanOptionalAction, default=None,
                   help="pad every expert's tokens to its capacity (fixed shapes; needs --moe-capacity-factor) "
                        "(overrides the framework)")
    p.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="keep and reduce gradients in fp32 (--no-...: in the 16-bit training dtype) (overrides "
                        "the framework)")
    p.add_argument("--optimizer-states", choices=("fp32", "bf16-moments", "bf16"),
                   help="Adam's state in 16-bit training: fp32 master weights and moments (12 B per parameter), "
                        "fp32 master with bf16 moments (8 B; Megatron's precision-aware optimizer), or 16-bit master "
                        "and bf16 moments (6 B; NeMo's distributed_fused_adam with dtype bf16) (overrides the "
                        "framework)")
    p.add_argument("--optimizer-implementation", choices=("for-loop", "foreach", "fused"),
                   help="torch's Adam implementation under an FSDP2 stack that picks one (torchtitan's "
                        "[optimizer] implementation; nemo-automodel): the temporaries its step allocates, two of the "
                        "tensor it updates (for-loop), a copy of every second moment (foreach) or none (fused) "
                        "(overrides the framework)")
    p.add_argument("--fused-softmax", choices=("always", "bigscience-2021-10"),
                   help="the unfused attention's fused scale-mask-softmax kernel: always taken, or only where "
                        "bigscience's Megatron-DeepSpeed of 2021-10-21..2022-03-06 (BLOOM's layout sweep) found it "
                        "available, PyTorch's fp32 softmax elsewhere (overrides the framework)")
    p.add_argument("--fp8-recipe", choices=("delayed", "tensorwise"),
                   help="FP8 scaling (with --dtype fp8), Megatron-Core's names: delayed = scales from an amax history "
                        "(Transformer Engine's DelayedScaling), tensorwise = per-tensor current scaling (an amax "
                        "pass before each cast; what Megatron-Bridge's H100 FP8 recipes run; the only one torchao "
                        "stacks have) (overrides the framework)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not calibrate this machine first when no calibration of it exists (local cluster, "
                        "validate); predictions are then labelled uncalibrated (env: PARAPLAN_NO_CALIBRATE=1)")


def _add_layout(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--dp", type=_positive_int, required=required, help="data-parallel degree")
    p.add_argument("--tp", type=_positive_int, required=required, help="tensor-parallel degree")
    p.add_argument("--pp", type=_positive_int, required=required, help="pipeline-parallel degree")
    p.add_argument("--micro-batch", type=_positive_int, required=required, help="samples per micro-batch")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--virtual-stages", type=_positive_int, default=1, help="model chunks per pipeline rank")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recomputation: selective = the attention core (Korthikanti et al. 2022); "
                   "mlp = the MLP or MoE sublayer (Megatron-Core's recompute_modules mlp, moe); selective+mlp = "
                   "both; norm+act = the separate norms and the routed experts' activation (Megatron-Core's "
                   "layernorm, moe_act; MoE models on a Transformer Engine stack); full = the whole layer")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs tp>1)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="training dtype (default bf16; fp32 on CPU)")
    p.add_argument("--dp-mode", choices=("allreduce", "ps"), default="allreduce",
                   help="gradient sync: ring all-reduce or parameter servers")
    p.add_argument("--ps-servers", type=_positive_int, default=1, help="parameter servers (with --dp-mode ps)")
    p.add_argument("--ps-staleness", type=_non_negative_int, default=0,
                   help="asynchronous parameter server: staleness bound in steps (0 = synchronous)")
    p.add_argument("--cp", type=_positive_int, default=1, help="context-parallel degree (sequence split)")
    p.add_argument("--ep", type=_positive_int, default=1,
                   help="expert-parallel degree (MoE; experts spread over a stage's dp x cp x tp ranks)")
    p.add_argument("--etp", type=_positive_int, default=1, help="expert tensor-parallel degree (MoE)")
    p.add_argument("--head-parallel", type=_positive_int, default=1,
                   help="hybrid parallelism (resnet/vgg/mlp): shard the classifier by class over this many "
                        "data-parallel ranks")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="paraplan", description="Plan, predict and run distributed training.")
    parser.add_argument("--version", action="version", version=f"paraplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    p = sub.add_parser("models", help="list the model presets")
    _add_common(p)

    p = sub.add_parser("hardware", help="list the GPU, link and cluster specs")
    _add_common(p)

    p = sub.add_parser("profile", help="per-layer FLOPs, memory and time of a model")
    p.add_argument("--model", required=True,
                   help="preset name, YAML spec, HF config.json, or your own nn.Module as package.module:callable "
                        "returning (module, example input, block names): see models/custom.py")
    p.add_argument("--device", choices=("meta", "cpu", "cuda"), default="meta")
    p.add_argument("--micro-batch", type=_positive_int, default=1)
    p.add_argument("--seq-len", type=_positive_int)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None)
    p.add_argument("--tp", type=_positive_int, action="append", help="add the tensor-parallel view for degree T")
    p.add_argument("--out", help="write the table as .csv, .json or .parquet")
    p.add_argument("--save-measurements", metavar="GPU",
                   help="save the measured times as GPU spec GPU's (e.g. cpu, h200-141gb) under "
                        "hardware_specs/measurements/, where the cost model finds them")
    _add_common(p)

    p = sub.add_parser("simulate", help="predict one layout's iteration time, throughput and memory")
    _add_workload(p)
    _add_layout(p, required=True)
    p.add_argument("--gpus", type=_positive_int, help="GPUs the layout must use (checks dp x tp x pp)")
    p.add_argument("--stages", metavar="N,N,...",
                   help="blocks per pipeline stage, in model order (pp x virtual-stages counts summing to the model's "
                        "blocks, embedding and head included: the report's 'stages' row); default: the framework's "
                        "split")
    p.add_argument("--stage-recompute", metavar="MODE,MODE,...",
                   help="recomputation per stage (one --recompute mode each), as a plan's report lists them")
    p.add_argument("--write-plan", metavar="PLAN.json", help="write the runnable plan")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the per-rank pipeline timeline")
    p.add_argument("--event-sim", action="store_true",
                   help="time the iteration with the event simulator however many tasks it has (by default it does "
                        "up to 400,000, the closed forms beyond)")
    _add_common(p)

    p = sub.add_parser("plan", help="search for the fastest layout that fits, and report it")
    _add_workload(p, model_required=False, batch_required=False)
    p.add_argument("--gpus", type=_positive_int, help="GPUs to use (default: the whole cluster)")
    p.add_argument("--out", help="report folder (default: reports/<model>-<cluster>-<gpus>)")
    p.add_argument("--top", type=_positive_int, default=5, help="plans to list")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None)
    p.add_argument("--train-tokens", type=float, help="tokens to train on: adds time-to-train and cost")
    p.add_argument("--no-charts", action="store_true", help="skip the charts (faster)")
    p.add_argument("--exhaustive", action="store_true",
                   help="proof mode: solve every layout's ILP that its lower bound does not rule out (slower; the "
                        "default skips layouts whose balanced split is over 5%% behind the top plans)")
    p.add_argument("--solver", choices=("cbc", "highs"), default=None,
                   help="the ILP solver tried first (the other takes over when it fails; default: HiGHS: "
                        "planner/ilp.py's SOLVER_ORDER)")
    p.add_argument("--recompute-modes", metavar="M,M", type=_recompute_modes, default=None,
                   help="recomputation modes the search may give stages, of none, norm+act, selective, mlp, "
                        "selective+mlp, full (default: none,selective,full, and mlp and selective+mlp too for "
                        "mixture-of-experts models)")
    p.add_argument("--verify", action="store_true",
                   help="dry-run the top plan with the executor's own code (execute --dry-run): a plan whose traced "
                        "peak exceeds the GPU is dropped for the next (minutes for a large model)")
    _add_memory_margin(p)
    _add_common(p)

    p = sub.add_parser("compare", help="several strategies and the optimum side by side")
    _add_workload(p)
    p.add_argument("--gpus", type=_positive_int, help="GPUs every strategy uses (default: the whole cluster)")
    p.add_argument("--strategy", action="append", default=[], metavar="S",
                   help='e.g. "tp=8,pp=4,dp=2,zero=1" (repeatable)')
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="training dtype (default: bf16 on GPUs, fp32 on CPUs)")
    p.add_argument("--out", help="folder for the table and charts")
    p.add_argument("--no-optimum", action="store_true", help="skip the search for the optimum")
    p.add_argument("--no-charts", action="store_true", help="skip the charts (faster; the table is still written)")
    _add_memory_margin(p)
    _add_common(p)

    p = sub.add_parser("execute", help="train a plan with torch.distributed")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a plan written by plan or simulate")
    p.add_argument("--steps", type=_positive_int, default=5, help="training steps to run (default 5)")
    p.add_argument("--out", help="folder for run.json")
    p.add_argument("--nnodes", type=_positive_int, default=1, help="machines in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index among them")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--rdzv-endpoint", help="host:port of a c10d rendezvous (instead of master addr/port)")
    p.add_argument("--timeout", type=_non_negative_float, default=300.0,
                   help="seconds a rank may hang before the job is ended")
    # training on your data, checkpoints, resume, restarts (executor/training.py)
    p.add_argument("--data", metavar="PATH", help="token file: flat uint16/uint32 ids (nanoGPT's train.bin) or "
                   "Megatron's indexed dataset PATH.bin + PATH.idx")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"),
                   help="id width of a flat token file (default: uint16 when the vocabulary fits, else uint32)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints to DIR/step-N/")
    p.add_argument("--checkpoint-every", type=_positive_int, metavar="K", help="save after every K-th step")
    p.add_argument("--resume", metavar="DIR[/step-N]", help="start from a checkpoint (DIR: its latest complete one)")
    p.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="R",
                   help="restart the job from the latest checkpoint up to R times when a rank dies or hangs")
    p.add_argument("--dry-run", action="store_true",
                   help="run the executor's own code for the plan at full world size on this machine's CPU (fake "
                        "process group, fake tensors; one process per pipeline stage traced, two at a time): trace "
                        "each stage's memory, traffic and FLOPs against the prediction; allocates nothing")
    p.add_argument("--init-from", metavar="DIR", help="start a LLaMA plan from Hugging Face safetensors weights "
                   "(a model folder; plan the model from its config.json)")
    _add_common(p)

    p = sub.add_parser("export", help="write a plan as Megatron-LM arguments, a torchtitan TOML, a DeepSpeed "
                                      "config or a Slurm script")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a plan written by plan or simulate")
    p.add_argument("--to", required=True, choices=("megatron", "torchtitan", "torchtitan-cli", "deepspeed", "slurm"),
                   help="torchtitan: a TOML job file; torchtitan-cli: the same as command-line overrides")
    p.add_argument("--out", metavar="FILE", help="file to write (default: print it)")
    _add_common(p)

    p = sub.add_parser("calibrate", help="measure this machine (or, under torchrun, the cluster)")
    p.add_argument("--cluster", default="local", help="the spec to start from (default: local)")
    p.add_argument("--out", help="spec file to write (default: hardware_specs/measurements/<cluster>.yaml, "
                                 "or $PARAPLAN_MEASUREMENTS/<cluster>.yaml)")
    p.add_argument("--ranks", type=_positive_int, default=2, help="processes for the collective measurements")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and repeats, and no fit of the framework's per-event host costs (a CPU "
                        "cluster's predictions then leave them out)")
    _add_common(p)

    p = sub.add_parser("validate", help="run layouts and compare measured with predicted")
    _add_workload(p)
    p.add_argument("--gpus", type=_positive_int, required=True, help="processes (GPUs) each layout runs on")
    p.add_argument("--strategy", action="append", default=[], metavar="S",
                   help='a layout to run, as in compare (e.g. "pp=2,schedule=1f1b,mb=2"); repeatable; '
                        "default: a spread of dp, tp and pp layouts")
    p.add_argument("--steps", type=_positive_int, default=8,
                   help="training steps per layout (the first warms up and is not timed; the median of the rest "
                        "is the measured step time)")
    p.add_argument("--top", type=_non_negative_int, default=3, help="planner's top-k added to the layouts (0: none)")
    p.add_argument("--passes", type=_positive_int, default=2,
                   help="times every layout is run, all in turn; the fastest pass's median is measured (as "
                        "calibrate measures), so a busy minute or the machine's warm-up lands on no one layout")
    p.add_argument("--out", help="folder for the report")
    p.add_argument("--update-spec", action="store_true", help="feed the measurements back into the cluster spec")
    p.add_argument("--no-block-times", action="store_true",
                   help="price blocks from FLOPs and bytes only (by default, on the local cluster, the model's "
                        "blocks are timed first)")
    _add_common(p)
    return parser


def user_error_types() -> tuple[type[Exception], ...]:
    """The exception types that mean "the input is wrong" (shown as one line, exit 2)."""
    from paraplan.hardware_specs import HardwareSpecError
    from paraplan.models import ModelSpecError

    types: list[type[Exception]] = [ModelSpecError, HardwareSpecError]
    for module, name in (("paraplan.profiler.errors", "ProfileError"), ("paraplan.planner.errors", "PlanError"),
                         ("paraplan.executor.errors", "ExecutionError")):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    debug = getattr(args, "debug", False)
    try:
        handler = importlib.import_module(f"paraplan.commands.{args.command}")
        return int(handler.run(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("paraplan: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        if debug:
            raise
        if isinstance(e, user_error_types()):
            sys.stderr.write(f"paraplan {args.command}: error: {e}\n")
            return 2
        if isinstance(e, MemoryError):
            sys.stderr.write(f"paraplan {args.command}: error: out of host memory\n")
            return 2
        if isinstance(e, OSError) and e.filename and e.errno in FILE_ERRNOS:  # a path the user gave, or the disk
            sys.stderr.write(f"paraplan {args.command}: error: {e.filename}: {e.strerror}\n")
            return 2
        sys.stderr.write(f"paraplan {args.command}: internal error: {type(e).__name__}: {e} "
                         "(run again with --debug for the traceback, and report it)\n")
        return 1


# File-system refusals of a path (permissions, a read-only or full disk, a file in the way): the user's to fix, one line
FILE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ENOTDIR,
               errno.ENOENT, errno.EISDIR, errno.EEXIST)


# Commands that only compute, write their files and exit (no torch.distributed, no processes left behind).
PLANNING_COMMANDS = ("plan", "simulate", "compare")


def console() -> None:
    """The ``paraplan`` console script: :func:`main`, with two shortcuts for the planning commands.
    Their objects (thousands of candidates, cached per-block costs) hold no reference cycles worth
    collecting, so the cyclic garbage collector is off (and numpy's BLAS runs one thread), and the
    interpreter's teardown, which would free them one by one, is skipped once the output is flushed
    (``paraplan plan`` on llama2-70b/64 GPUs: about 0.4 s of 2.4 s; benchmarks/bench_plan.py)."""
    argv = sys.argv[1:]
    planning = bool(argv) and argv[0] in PLANNING_COMMANDS
    if planning:
        gc.disable()
        # numpy's OpenBLAS starts a thread per core at import, which spin on the second core while `plan`'s scaling
        # re-plans and chart child need it (about 0.06 s of CPU); the planner's arrays are too small for threads
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    code = main(argv)
    if planning:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:
            pass
        os._exit(code)
    raise SystemExit(code)

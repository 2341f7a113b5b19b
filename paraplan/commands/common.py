"""Helpers shared by the planning commands: build the workload and layouts from the CLI's flags."""

from __future__ import annotations

from paraplan.planner.errors import PlanError
from paraplan.planner.layout import Layout
from paraplan.planner.workload import Workload


def workload_from_args(args, global_batch: int | None = None) -> Workload:
    return Workload.create(args.model, args.cluster, global_batch or args.global_batch, seq_length=args.seq_len,
                           nodes=args.nodes)


def layout_from_args(args, work: Workload) -> Layout:
    if args.dp_mode != "ps" and (args.ps_servers != 1 or args.ps_staleness):
        raise PlanError("--ps-servers and --ps-staleness need --dp-mode ps")
    return Layout(dp=args.dp, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch, global_batch=args.global_batch,
                  schedule=args.schedule, virtual_stages=args.virtual_stages, zero=args.zero,
                  recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                  dtype=args.dtype or work.default_dtype(), dp_mode=args.dp_mode, ps_servers=args.ps_servers,
                  ps_staleness=args.ps_staleness, head_parallel=args.head_parallel)

"""Helpers shared by the planning commands: build the workload and layouts from the CLI's flags."""

from __future__ import annotations

import dataclasses

from paraplan.planner.errors import PlanError
from paraplan.planner.layout import Layout
from paraplan.planner.plan import calibration_notes
from paraplan.planner.workload import Workload


def workload_from_args(args, global_batch: int | None = None) -> Workload:
    if args.fp8_recipe is not None and getattr(args, "dtype", None) != "fp8":  # as the MoE switches on a dense model
        dtype = getattr(args, "dtype", None)
        advice = ": add --dtype fp8" if hasattr(args, "dtype") else f" ({args.command} runs none)"
        raise PlanError(f"--fp8-recipe {args.fp8_recipe} sets how FP8 training scales its casts; it changes nothing "
                        f"in a plan that is not fp8 ({dtype or 'the default dtype'}){advice}")
    return Workload.create(args.model, args.cluster, global_batch or args.global_batch, seq_length=args.seq_len,
                           nodes=args.nodes, framework=args.framework, attention=args.attention,
                           overlap_dp=args.overlap_dp, overlap_tp=args.overlap_tp,
                           moe_dispatcher=args.moe_dispatcher, moe_a2a_overlap=args.moe_a2a_overlap,
                           grad_reduce_in_fp32=args.grad_reduce_in_fp32, optimizer_states=args.optimizer_states,
                           fused_softmax=args.fused_softmax, moe_capacity_factor=args.moe_capacity_factor,
                           moe_pad_to_capacity=args.moe_pad_to_capacity, fp8_recipe=args.fp8_recipe,
                           moe_shared_expert_overlap=args.moe_shared_expert_overlap, moe_routing=args.moe_routing,
                           optimizer_implementation=args.optimizer_implementation)


def ensure_calibrated(args, work: Workload, validating: bool = False) -> Workload:
    """``work`` on a calibrated cluster: this machine is calibrated first where it needs it
    (executor/autocalibrate.py; ``--no-calibrate`` opts out)."""
    from paraplan.executor.autocalibrate import calibrate_first

    from .output import stderr

    cluster = calibrate_first(work.cluster_ref, work.cluster, args.nodes, args.no_calibrate, validating,
                              lambda line: stderr.print(line, markup=False, highlight=False))
    return work if cluster is work.cluster else dataclasses.replace(work, cluster=cluster)


def calibration_labels(work: Workload, validating: bool = False) -> tuple[bool, list[str], str]:
    """(calibrated, notes, title suffix) for the predictions on ``work``'s cluster: the JSON key, the notes
    (measurements found but not used, the uncalibrated label) and what a table title adds."""
    calibrated, notes = calibration_notes(work, validating)
    uncalibrated = any(n.startswith("uncalibrated") for n in notes)
    return calibrated, notes, " — uncalibrated" if uncalibrated else ""


def layout_from_args(args, work: Workload) -> Layout:
    if args.dp_mode != "ps" and (args.ps_servers != 1 or args.ps_staleness):
        raise PlanError("--ps-servers and --ps-staleness need --dp-mode ps")
    return Layout(dp=args.dp, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch, global_batch=args.global_batch,
                  schedule=args.schedule, virtual_stages=args.virtual_stages, zero=args.zero,
                  recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                  dtype=args.dtype or work.default_dtype(), dp_mode=args.dp_mode, ps_servers=args.ps_servers,
                  ps_staleness=args.ps_staleness, head_parallel=args.head_parallel, cp=args.cp, ep=args.ep,
                  etp=args.etp)

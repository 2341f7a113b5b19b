"""``paraplan execute --plan P --dry-run``: the executor's own code path for a plan, at the plan's full
world size, in this one CPU process, with no memory really allocated.

For one rank per pipeline stage (data- and tensor-parallel ranks of a stage are symmetric) it joins
torch's fake process group (``init_process_group("fake")``: every collective returns at once) as
that rank of the plan's world, builds exactly what :func:`paraplan.executor.parallelize.build_rank_model`
builds — the same mesh, stage split, tensor-parallel plan, FSDP/ZeRO wrapping, recomputation and
pipeline schedule — with every tensor a fake tensor (``FakeTensorMode``: shapes, no storage), and runs
training steps through the same Trainer, under :class:`paraplan.executor.trace.RankTrace`.

Steps: a warm-up step (FSDP's lazy set-up and the optimizer's states appear) and a traced step.
Memory peaks once as many micro-batches are in flight as the plan ever has (planner/schedules.py's
in-flight counts), so the steps run the fewest micro-batches that reach the plan's in-flight peak
(all of them for GPipe); communication and FLOPs are linear in the number of micro-batches (each
micro-batch sends and computes the same), so the two steps, run with different counts, give both the
per-step and the per-micro-batch part, and the plan's total follows exactly. A plan the executor
cannot build or run fails here with the executor's own error.

Traced peaks are of tensors; the figure compared with the plan adds what the cost model adds for
what no tensor shows (the CUDA context and workspaces, the allocator's fragmentation), so that both
sides count the same things.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from paraplan.planner.framework import other_stack_note
from paraplan.planner.layout import Layout
from paraplan.planner.schedules import in_flight

from .errors import ExecutionError
from .job import Job
from .trace import COMM_KINDS, MEMORY_KINDS, RankTrace, classify_rank

GiB = 2**30


@dataclass
class TracedRank:
    rank: int
    pp_rank: int
    tensor_peak_bytes: int
    memory_bytes: dict[str, int]  # at the peak: params, grads, optimizer, activations
    comm_bytes: dict[str, float]  # per training step of the plan
    flops: float  # per training step of the plan
    micro_batches_traced: tuple[int, int]
    seconds: float


@dataclass
class DryRun:
    job: Job
    device_type: str
    ranks: list[TracedRank] = field(default_factory=list)
    prediction: object | None = None  # the cost model's Prediction for the plan (None: its cluster is unknown here)
    notes: list[str] = field(default_factory=list)

    def traced_memory_gib(self, traced: TracedRank) -> dict[str, float]:
        """The traced breakdown plus what no tensor shows, added exactly as the cost model adds it (the
        framework allowance and the allocator's fragmentation), so both sides count the same things."""
        from paraplan.planner.memory import untracked_bytes

        gpu = self._gpu()
        other = untracked_bytes(gpu, traced.tensor_peak_bytes) if gpu is not None else 0.0
        return {k: v / GiB for k, v in traced.memory_bytes.items()} | {"other": other / GiB}

    def _gpu(self):
        from .machine import plan_cluster

        cluster = plan_cluster(self.job.plan)
        return None if cluster is None else cluster.gpu

    def to_dict(self) -> dict:
        pred = self.prediction
        ranks = []
        for t in self.ranks:
            mem = self.traced_memory_gib(t)
            peak = (t.tensor_peak_bytes / GiB) + mem["other"]
            entry = {"rank": t.rank, "pp_rank": t.pp_rank, "peak_memory_gib": peak,
                     "predicted_memory_gib": pred.rank_memory_gib[t.pp_rank] if pred else None,
                     "memory_gib": mem, "tensor_peak_gib": t.tensor_peak_bytes / GiB,
                     "predicted_memory_breakdown_gib": pred.rank_memory_breakdown_gib[t.pp_rank] if pred else None,
                     "comm_bytes": {k: float(v) for k, v in t.comm_bytes.items()},
                     "predicted_comm_bytes": pred.rank_comm_bytes[t.pp_rank] if pred else None,
                     "flops": t.flops, "predicted_flops": pred.rank_flops[t.pp_rank] if pred else None,
                     "micro_batches_traced": list(t.micro_batches_traced),
                     "trace_seconds": t.seconds}
            ranks.append(entry)
        gpu = self._gpu()
        return {"dry_run": True, "world_size": self.job.world_size, "device": self.device_type,
                "peak_memory_gib": max(r["peak_memory_gib"] for r in ranks),
                "predicted_peak_memory_gib": pred.peak_memory_gib if pred else None,
                "gpu_memory_gib": gpu.memory_GiB if gpu is not None else None,
                "fits": (max(r["peak_memory_gib"] for r in ranks) <= gpu.memory_GiB) if gpu is not None else None,
                "ranks": ranks, "notes": self.notes}


def _valid_micro_batch_counts(lay: Layout, spec, n_blocks: int) -> list[int]:
    """Micro-batch counts (up to the plan's) for which the layout is still valid."""
    from paraplan.planner.errors import InvalidLayout

    out = []
    for m in range(1, lay.num_micro_batches + 1):
        trial = lay.replace(global_batch=lay.dp * lay.micro_batch * m)
        try:
            trial.validate(spec, n_blocks)
        except InvalidLayout:
            continue
        out.append(m)
    return out


def traced_micro_batches(job: Job, n_blocks: int) -> tuple[int, int]:
    """(warm-up count, traced count): the fewest micro-batches past those whose in-flight peak is the plan's
    on every pipeline rank (so the peak also meets gradients of an earlier micro-batch, as the plan's does),
    and a different valid count for the other step (or the plan's own twice)."""
    lay = job.layout
    m = lay.num_micro_batches
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    want = [max(d.values(), default=0) for d in in_flight(schedule, lay.pp, lay.virtual_stages, m)]
    valid = _valid_micro_batch_counts(lay, job.spec, n_blocks)
    saturated = [k for k in valid if k >= min(2, m) and
                 [max(d.values(), default=0) for d in in_flight(schedule, lay.pp, lay.virtual_stages, k)] == want]
    # one micro-batch more than saturates: the peak then also holds the gradients of an earlier backward
    traced = next((k for k in saturated if k > saturated[0]), m) if saturated else m
    if traced == m:
        return m, m
    warm = next((k for k in valid if k != traced), traced)
    return warm, traced


def _job_with(job: Job, micro_batches: int) -> Job:
    lay = job.layout
    plan = job.plan.replace(layout=lay.replace(global_batch=lay.dp * lay.micro_batch * micro_batches))
    return Job(plan=plan, spec=job.spec, source=job.source)


def _static_pipeline(schedule) -> None:
    """Skip torch's pipeline warm-up vote (a real P2P exchange: fake peers would answer nothing): every
    stage was given its shapes (pipeline.stage_io), which is what the vote would find."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warm_up(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warm_up


def trace_rank(job: Job, rank: int, device_type: str, counts: tuple[int, int]) -> TracedRank:
    """Build and train ``rank`` of ``job`` on the fake process group; what it allocated and sent."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .parallelize import build_rank_model
    from .pipeline import build_schedule
    from .trainer import Trainer

    start = time.perf_counter()
    warm_m, traced_m = counts
    warm_job, traced_job = _job_with(job, warm_m), _job_with(job, traced_m)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=job.world_size)
    try:
        mesh = warm_job.dims.build_mesh("cpu")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        holder: dict = {}
        trace = RankTrace(classify=lambda: classify_rank(holder.get("modules", []), holder.get("optimizer")))

        @contextlib.contextmanager
        def allocate():
            with fake, trace:
                yield

        device = torch.device("cpu")
        rm = build_rank_model(warm_job, rank, device, None, mesh=mesh, device_type=device_type, allocate=allocate)
        holder.update(modules=rm.trained, optimizer=rm.optimizer)
        comm, flops = [], []
        for k, step_job in enumerate((warm_job, traced_job)):
            if rm.schedule is not None:
                if step_job is not rm.job:
                    with allocate():
                        rm.schedule = build_schedule([(c.stage, m) for c, m in zip(rm.chunks, rm.trained, strict=True)],
                                                     step_job, rm.mesh["pp"], device, rm.loss_fn,
                                                     compute_dtype=_compute_dtype(job, device_type))
                _static_pipeline(rm.schedule)
            rm.job = step_job
            before_comm, before_flops = dict(trace.comm), trace.flops
            if k == 1:
                trace.peak, trace._snapshot_total = trace.total, 0  # the traced step's own peak
            with allocate():
                Trainer.create(rm).train_step(k)
            comm.append({x: trace.comm[x] - before_comm[x] for x in COMM_KINDS})
            flops.append(trace.flops - before_flops)
    finally:
        dist.destroy_process_group()
    m = job.layout.num_micro_batches
    per_mb = (lambda a, b: (b - a) / (traced_m - warm_m)) if traced_m != warm_m else (lambda a, b: 0.0)
    comm_total = {x: comm[1][x] + per_mb(comm[0][x], comm[1][x]) * (m - traced_m) for x in COMM_KINDS}
    flops_total = flops[1] + per_mb(flops[0], flops[1]) * (m - traced_m)
    pp_rank, _, _ = job.dims.coords(rank)
    return TracedRank(rank=rank, pp_rank=pp_rank, tensor_peak_bytes=trace.peak,
                      memory_bytes={k: trace.peak_breakdown.get(k, 0) for k in MEMORY_KINDS},
                      comm_bytes=comm_total, flops=flops_total, micro_batches_traced=(warm_m, traced_m),
                      seconds=time.perf_counter() - start)


def _compute_dtype(job: Job, device_type: str) -> torch.dtype:
    from .rank_model import mixed_precision_dtype

    return mixed_precision_dtype(job, device_type) or torch.float32


def dry_run(job: Job, device_type: str, progress=lambda text: None, processes: int | None = None) -> DryRun:
    """Trace one rank per pipeline stage of ``job`` (data- and tensor-parallel rank 0 of each), each in a
    process of its own (a fake process group is per process, as a rank is), several at once."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from paraplan.models import block_names

    lay = job.layout
    if lay.dp_mode == "ps" or lay.head_parallel > 1:
        raise ExecutionError(f"{job.source}: the dry run traces data, tensor and pipeline parallelism; parameter "
                             "servers and class-sharded classifiers are not traced yet")
    counts = traced_micro_batches(job, len(block_names(job.spec)))
    ranks = [job.dims.rank(pp_rank, 0, 0) for pp_rank in range(lay.pp)]
    workers = max(1, min(len(ranks), processes or os.cpu_count() or 1))
    progress(f"tracing {len(ranks)} rank{'s' if len(ranks) > 1 else ''} (one per pipeline stage) with "
             f"{counts[0]} then {counts[1]} micro-batches, {workers} at a time")
    out = DryRun(job=job, device_type=device_type)
    out.prediction, note = _predict(job)
    if note:
        out.notes.append(note)
    if out.prediction is not None:
        note = other_stack_note(job.plan.stack(), "the plan was", "the trace is",
                                "price it with --framework paraplan to check the prediction itself")
        if note:
            out.notes.append(note)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: torch's state is per process
    # one rank per process: torch keeps process groups (and their names) per process, so a process that
    # traced one rank cannot cleanly join the fake group again as another
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_quiet_worker,
                             max_tasks_per_child=1) as pool:
        futures = [pool.submit(trace_rank, job, rank, device_type, counts) for rank in ranks]
        for fut in futures:
            out.ranks.append(fut.result())
            progress(f"rank {out.ranks[-1].rank} traced in {out.ranks[-1].seconds:.1f} s")
    return out


def _quiet_worker() -> None:
    """One thread per tracing process (they run side by side), torch's distributed warnings off, and
    FSDP2's replicate where the executor would use DDP (data_parallel.DDP_ALLOWED)."""
    import logging

    from . import data_parallel

    data_parallel.DDP_ALLOWED = False
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def _predict(job: Job):
    """The cost model's prediction of the plan as written, or (None, why not)."""
    from paraplan.hardware_specs import HardwareSpecError
    from paraplan.planner.api import predict_plan
    from paraplan.planner.errors import PlanError

    try:
        return predict_plan(job.plan, job.spec), ""
    except (HardwareSpecError, PlanError) as e:
        return None, f"no prediction to compare with: {e}"

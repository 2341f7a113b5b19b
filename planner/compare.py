"""Several strategies and the optimum side by side, plus the classic comparisons.

- user strategies (``--strategy``), each priced as ``plan`` prices that layout: the search's split and
  recomputation per stage (quick split, ILP or polish), then the event simulation (refine.simulate_ranked), so a
  row and plan's row of the same layout agree;
- when none are given, the families a textbook sets side by side: pure data parallelism, pure tensor
  parallelism, pure pipeline parallelism, data x tensor, and full 3D (the optimum), each at its best
  micro-batch, schedule and ZeRO stage;
- parameter server vs ring all-reduce: gradient sync time of this model as the workers grow;
- the data-parallel side of every compared layout, per GPU: the gradients it computes (its tensor- and
  pipeline-parallel share), what it keeps after the sync, what it sends, and what the iteration waits for;
  then, for the best of them, what gradient accumulation and (where the stack can) 16-bit gradients change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paraplan.hardware_specs import HardwareSpecError

from . import comm, moe
from .costmodel import CostModel, Prediction, validate_layout
from .errors import InvalidLayout
from .framework import sequence_parallel_as_run
from .layout import Layout
from .placement import layout_placement, placement
from .schedules import rank_stages
from .search import Candidate, enumerate_layouts, search
from .strategies import parse_strategy, strategy_layout
from .workload import Workload


@dataclass
class Row:
    name: str
    layout: Layout | None
    prediction: Prediction | None
    status: str  # ok | oom: ... | invalid: ...
    stages: list[list[int]] | None = None
    stage_recompute: list[str] | None = None

    @property
    def label(self) -> str:
        """The layout as plan's table reads it, with its stages' recomputation where they differ (a label names
        the heaviest mode: "full" alone would read as every stage recomputing)."""
        if self.layout is None:
            return "-"
        modes = sorted(set(self.stage_recompute or []))
        return self.layout.short() + (f" [{'/'.join(modes)}]" if len(modes) > 1 else "")


def price_layout(model: CostModel, lay: Layout, name: str, fixed_recompute: bool) -> Row:
    """``lay`` priced by the search alone (as ``plan`` prices it among the others), then by the event simulation."""
    from .refine import simulate_ranked

    try:
        validate_layout(model, lay)
    except InvalidLayout as e:
        return Row(name, lay, None, f"invalid: {e}")

    def priced(modes: tuple[str, ...] | None):
        result = search(model.work, lay.num_gpus, top_k=1, dtype=lay.dtype, layouts=[lay], model=model,
                        allowed_modes=modes)
        simulate_ranked(result, model)
        return result

    result = priced((lay.recompute,) if fixed_recompute else None)
    if fixed_recompute:  # the search over every mode may find a split in this mode alone that the narrowed one
        # misses (its quick split need not fit in that mode): the faster of the two, both in the mode asked for
        wide = priced(None)
        best = wide.best
        if best is not None and set(best.stage_recompute or [best.layout.recompute]) == {lay.recompute} and \
                (result.best is None or best.time_s < result.best.time_s):
            result = wide
    if result.best is None:
        return Row(name, lay, None, result.candidates[0].status_text())
    return from_candidate(name, result.best)


def from_candidate(name: str, cand: Candidate | None, valid: bool = True) -> Row:
    if cand is None:
        return Row(name, None, None, "nothing fits" if valid else "no valid layout")
    return Row(name, cand.layout, cand.prediction, "ok", cand.stages, cand.stage_recompute)


# Each family is what its name says and nothing more: no context parallelism in any (it is a dimension of its own,
# in the optimum's row), and a product of two kinds only where both are used (a "data x tensor" row of tp1 is the
# data-parallel row again; a "tensor parallel" row of tp4 cp2 is half context parallelism)
FAMILIES = {
    "data parallel": lambda x: x.tp == 1 and x.pp == 1 and x.cp == 1 and x.head_parallel == 1,
    "tensor parallel": lambda x: x.dp == 1 and x.pp == 1 and x.cp == 1,
    "pipeline parallel": lambda x: x.dp == 1 and x.tp == 1 and x.cp == 1,
    "data x tensor": lambda x: x.dp > 1 and x.tp > 1 and x.pp == 1 and x.cp == 1 and x.head_parallel == 1,
}
# mixtures of experts: the same families without expert parallelism, then with it (planner/moe.py)
FAMILIES_MOE = {
    "data parallel": lambda x: x.tp == 1 and x.pp == 1 and x.cp == 1 and x.ep == 1,
    "tensor parallel": lambda x: x.dp == 1 and x.pp == 1 and x.cp == 1 and x.ep == 1,
    "pipeline parallel": lambda x: x.dp == 1 and x.tp == 1 and x.cp == 1 and x.ep == 1,
    "data x tensor": lambda x: x.dp > 1 and x.tp > 1 and x.pp == 1 and x.cp == 1 and x.ep == 1,
    "data x expert": lambda x: x.tp == 1 and x.pp == 1 and x.cp == 1 and x.ep > 1,
    "data x tensor x expert": lambda x: x.tp > 1 and x.pp == 1 and x.cp == 1 and x.ep > 1,
}
# resnet / vgg / mlp: the trunk runs data-parallel; the question is the classifier (Krizhevsky 2014)
FAMILIES_CLASSIFIER = {
    "data parallel (replicated classifier)": lambda x: x.pp == 1 and x.head_parallel == 1,
    "hybrid: class-sharded classifier": lambda x: x.pp == 1 and x.head_parallel > 1,
    "pipeline parallel": lambda x: x.dp == 1,
}


def compare(work: Workload, gpus: int, strategies: list[str], dtype: str, optimum: bool = True) -> list[Row]:
    """Each row priced as ``simulate`` and ``plan`` price it: its split by the ILP, its time by the event simulation
    where the pipeline's tasks allow (refine.simulate_ranked for the searches' picks)."""
    from .refine import simulate_ranked

    model = CostModel(work)
    rows = []
    for text in strategies:
        fields = parse_strategy(text)
        lay = strategy_layout(fields, gpus, work.global_batch, dtype, text)
        if "sp" not in fields:  # what the stack runs (as simulate)
            lay = sequence_parallel_as_run(work.framework, lay)
        rows.append(price_layout(model, lay, text, "recompute" in fields))

    def best_of(layouts: list[Layout] | None = None):
        result = search(work, gpus, top_k=1, dtype=dtype, layouts=layouts, model=model)
        simulate_ranked(result, model)
        return result

    if not strategies:
        every = enumerate_layouts(work, gpus, dtype)
        families = (FAMILIES_MOE if work.spec.is_moe else FAMILIES) if work.spec.is_transformer else \
            FAMILIES_CLASSIFIER
        for name, keep in families.items():
            result = best_of([x for x in every if keep(x)])
            rows.append(from_candidate(name, result.best, any(c.status != "invalid" for c in result.candidates)))
    if optimum:
        rows.append(from_candidate("optimum (3D search)", best_of().best))
    return rows


def ps_vs_ring(work: Workload, dtype: str, max_workers: int, servers: tuple[int, ...] = (1, 2, 4)
               ) -> tuple[list[int], dict[str, list[float]]]:
    """Gradient sync time of the whole model (pure data parallelism) for 2..max_workers workers, the gradients at
    the width the stack reduces them (dp_sync.grad_bytes: fp32 for this executor), as the per-layout table prices
    them; the servers are GPUs beside the workers (in their node while both fit in one, else across nodes)."""
    from .dp_sync import grad_bytes

    params = work.profile(dtype).num_parameters
    grads = params * grad_bytes(work, Layout(dp=2, tp=1, pp=1, micro_batch=1, global_batch=2, dtype=dtype))
    cl = work.cluster
    workers = []
    n = 2
    while n <= max_workers:
        workers.append(n)
        n *= 2
    series: dict[str, list[float]] = {"ring all-reduce": []}
    for k in servers:
        series[f"parameter server, {k} server{'s' if k > 1 else ''}"] = []
    for n in workers:
        place = placement(cl, n, 1, 1)
        series["ring all-reduce"].append(comm.all_reduce(grads, place.dp, cl, place.gpus_per_node_busy))
        for k in servers:
            series[f"parameter server, {k} server{'s' if k > 1 else ''}"].append(
                comm.parameter_server_sync(grads, n, k, cl, all_in_one_node=n + k <= cl.gpus_per_node,
                                           worker_busy=place.gpus_per_node_busy))
    return workers, series


@dataclass
class DPLayoutRow:
    """One compared layout's data-parallel communication, per GPU (its pipeline rank that waits longest for it),
    as the cost model prices it (concerns.sync_summary of the rank's data-parallel items)."""

    name: str
    layout: Layout
    group: str  # the data-parallel group's size and placement
    kind: str  # the collectives that sync it, with how many times each runs
    grad_bytes: float  # gradients a GPU reduces: its tensor- and pipeline-parallel share, at the stack's width
    kept_bytes: float  # gradients a GPU keeps after the sync (ZeRO-2/3: its 1/dp shard; experts' 1/edp)
    sent_bytes: float | None  # the collectives' message bytes per iteration (simulate's rank_comm_bytes)
    traffic_s: float | None  # those collectives back to back, as if nothing overlapped them
    exposed_s: float  # what that rank waits for (never more than traffic_s)
    iteration_s: float


KIND_NAMES = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
              "send_recv": "push/pull", "copy": "gathered-weight copy"}


def _sync_view(work: Workload, pred: Prediction) -> tuple[dict, float, float]:
    """(the sync summary of the pipeline rank that waits longest for its data-parallel sync, that rank's gradient
    bytes at the width the stack reduces them (dp_sync.grad_bytes), of which its expert-parallel experts')."""
    from .dp_sync import grad_bytes

    lay = pred.layout
    syncs = pred.rank_dp_sync
    rank = max(range(len(syncs)), key=lambda r: syncs[r]["exposed_s"]) if syncs else 0
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    held = rank_stages(schedule, rank, lay.pp, lay.virtual_stages)
    params = sum(pred.stages[s].params for s in held)
    experts = sum(pred.stages[s].experts for s in held)
    nothing = dict(kinds=[], bytes=0.0, unhidden_s=0.0, exposed_s=0.0)
    # without data parallelism what the rank syncs is no data-parallel sync (sequence parallelism's weight sums, a
    # tied embedding's ends): the table says none
    summary = syncs[rank] if syncs and lay.data_ranks > 1 else nothing
    return summary, params * grad_bytes(work, lay), experts * grad_bytes(work, lay)


def _kinds(summary: dict, lay: Layout) -> str:
    if lay.data_ranks == 1:
        return "none (dp = 1)"
    parts = []
    for kind, count in summary["kinds"]:
        name = KIND_NAMES.get(kind, kind)
        parts.append(name if count == 1 else f"{name} x{count:g}")
    return " + ".join(parts) or "none"


def dp_per_layout(work: Workload, rows: list[Row]) -> list[DPLayoutRow]:
    """The data-parallel side of every priced row: what a GPU reduces, keeps, sends and waits for."""
    out = []
    for row in rows:
        if row.prediction is None:
            continue
        lay, pred = row.layout, row.prediction
        span = layout_placement(work.cluster, lay).dp  # gradients reduce over dp x cp ranks (cp: each its tokens)
        n = lay.dp * lay.cp
        where = "" if n == 1 else (f" over {span.nodes} nodes" if span.crosses_nodes else " in one node")
        cp = f" (dp {lay.dp} x cp {lay.cp})" if lay.cp > 1 else ""
        summary, grads, expert_grads = _sync_view(work, pred)
        # ZeRO-2/3 shard the gradients over the data-parallel ranks, the experts' over their own group (edp: moe.py)
        kept = (grads - expert_grads) / lay.data_ranks + expert_grads / moe.edp(lay) \
            if lay.zero >= 2 and lay.dp_mode != "ps" else grads
        experts = f", experts over {moe.edp(lay)}" if expert_grads else ""
        out.append(DPLayoutRow(row.name, lay, f"{n} GPU{'s' if n > 1 else ''}{cp}{where}{experts}",
                               _kinds(summary, lay),
                               grads, kept, summary["bytes"], summary["unhidden_s"], summary["exposed_s"],
                               pred.iteration_time_s))
    return out


@dataclass
class DPRow:
    what: str
    layout: Layout
    samples_per_sync: int
    grad_bytes: float  # per GPU per sync
    sync_s: float  # the data-parallel collectives back to back, as if nothing overlapped them
    exposed_s: float  # what the iteration waits for after overlap
    iteration_s: float

    @property
    def exposed_ms_per_1k_samples(self) -> float:
        return 1e3 * self.exposed_s / self.samples_per_sync * 1000

    @property
    def sync_ms_per_1k_samples(self) -> float:
        return 1e3 * self.sync_s / self.samples_per_sync * 1000


def dp_optimisations(work: Workload, base: Row) -> list[DPRow]:
    """``base``'s layout (its degrees, stages, ZeRO stage and training dtype) with more samples per gradient sync
    (gradient accumulation: 1, 2 and 4 times its micro-batches per replica), and, where the stack can reduce
    gradients in either width (Megatron's grad_reduce_in_fp32; this executor and torchtitan reduce fp32 only), in
    fp32 and in 16 bits: what a GPU reduces per sync, and what is exposed per iteration and per sample."""
    from .dp_sync import grad_bytes

    lay0 = base.layout
    stacks = [work]
    if work.framework.states != "executor" and lay0.dtype in ("bf16", "fp16", "fp8"):
        other = 2 if grad_bytes(work, lay0) == 4 else 4
        stacks.append(replace(work, framework=work.framework.replace(grad_bytes=other)))
    rows = []
    for stack in stacks:
        model = CostModel(stack)
        width = grad_bytes(stack, lay0)
        label = "gradients reduced in fp32" if width == 4 else "gradients reduced in 16 bits"
        if stack is work and len(stacks) > 1:
            label += " (as priced)"
        for k in (1, 2, 4):
            lay = replace(lay0, global_batch=lay0.global_batch * k)
            try:
                validate_layout(model, lay)
                pred = model.evaluate(lay, base.stages, base.stage_recompute)
            except (InvalidLayout, HardwareSpecError):
                continue
            summary, grads, _ = _sync_view(stack, pred)
            what = f"{label}, {lay.num_micro_batches} micro-batch{'es' if lay.num_micro_batches > 1 else ''} per step"
            rows.append(DPRow(what, lay, lay.global_batch, grads, summary["unhidden_s"], summary["exposed_s"],
                              pred.iteration_time_s))
    return rows

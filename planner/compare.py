"""Several strategies and the optimum side by side, plus the classic comparisons.

- user strategies (``--strategy``), each priced with its ILP stage split;
- when none are given, the families a textbook sets side by side: pure data parallelism, pure tensor
  parallelism, pure pipeline parallelism, data x tensor, and full 3D (the optimum), each at its best
  micro-batch, schedule and ZeRO stage;
- parameter server vs ring all-reduce: gradient sync time of this model as the workers grow.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import comm
from .costmodel import CostModel, Prediction, validate_layout
from .errors import InvalidLayout
from .ilp import best_partition
from .layout import Layout
from .placement import placement
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


def price_layout(model: CostModel, lay: Layout, name: str, fixed_recompute: bool) -> Row:
    try:
        validate_layout(model, lay)
        allowed = (lay.recompute,) if fixed_recompute else None
        part = best_partition(model, lay, allowed)
    except InvalidLayout as e:
        status = str(e) if str(e).startswith("out of memory") or "fits in memory" in str(e) else f"invalid: {e}"
        return Row(name, lay, None, status)
    return Row(name, lay, part.prediction, "ok", part.stages, part.recompute)


def from_candidate(name: str, cand: Candidate | None, valid: bool = True) -> Row:
    if cand is None:
        return Row(name, None, None, "nothing fits" if valid else "no valid layout")
    return Row(name, cand.layout, cand.prediction, "ok", cand.stages, cand.stage_recompute)


FAMILIES = {
    "data parallel": lambda x: x.tp == 1 and x.pp == 1 and x.head_parallel == 1,
    "tensor parallel": lambda x: x.dp == 1 and x.pp == 1,
    "pipeline parallel": lambda x: x.dp == 1 and x.tp == 1,
    "data x tensor": lambda x: x.pp == 1 and x.head_parallel == 1,
}
# resnet / vgg / mlp: the trunk runs data-parallel; the question is the classifier (Krizhevsky 2014)
FAMILIES_CLASSIFIER = {
    "data parallel (replicated classifier)": lambda x: x.pp == 1 and x.head_parallel == 1,
    "hybrid: class-sharded classifier": lambda x: x.pp == 1 and x.head_parallel > 1,
    "pipeline parallel": lambda x: x.dp == 1,
}


def compare(work: Workload, gpus: int, strategies: list[str], dtype: str, optimum: bool = True) -> list[Row]:
    model = CostModel(work)
    rows = []
    for text in strategies:
        fields = parse_strategy(text)
        lay = strategy_layout(fields, gpus, work.global_batch, dtype, text)
        rows.append(price_layout(model, lay, text, "recompute" in fields))
    if not strategies:
        every = enumerate_layouts(work, gpus, dtype)
        families = FAMILIES if work.spec.is_transformer else FAMILIES_CLASSIFIER
        for name, keep in families.items():
            result = search(work, gpus, top_k=1, dtype=dtype, layouts=[x for x in every if keep(x)])
            rows.append(from_candidate(name, result.best, any(c.status != "invalid" for c in result.candidates)))
    if optimum:
        rows.append(from_candidate("optimum (3D search)", search(work, gpus, top_k=1, dtype=dtype).best))
    return rows


def ps_vs_ring(work: Workload, dtype: str, max_workers: int, servers: tuple[int, ...] = (1, 2, 4)
               ) -> tuple[list[int], dict[str, list[float]]]:
    """Gradient sync time of the whole model (pure data parallelism) for 2..max_workers workers."""
    params = work.profile(dtype).num_parameters
    grads = params * (4 if dtype == "fp32" else 2)
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
class DPRow:
    what: str
    layout: Layout
    samples_per_sync: int
    grad_bytes: float  # per GPU per sync
    sync_s: float  # the gradient collective itself
    exposed_s: float  # what the iteration waits for after overlap
    iteration_s: float

    @property
    def sync_ms_per_1k_samples(self) -> float:
        return 1e3 * self.sync_s / self.samples_per_sync * 1000


def dp_optimisations(work: Workload, gpus: int, micro_batch: int) -> list[DPRow]:
    """Pure data parallelism on ``gpus`` GPUs: the effect of gradient accumulation (one sync for several
    micro-batches: fewer syncs per sample) and of 16-bit gradients (half the bytes) on communication."""
    rows = []
    base = Workload.create(work.spec, work.cluster, gpus * micro_batch, attention=work.attention)
    for dtype, label in (("fp32", "fp32 gradients"), ("bf16", "bf16 gradients (mixed precision)")):
        for m in (1, 2, 4, 8):
            w = base if m == 1 else Workload.create(work.spec, work.cluster, gpus * micro_batch * m,
                                                    attention=work.attention)
            lay = Layout(dp=gpus, tp=1, pp=1, micro_batch=micro_batch, global_batch=gpus * micro_batch * m, dtype=dtype)
            model = CostModel(w)
            try:
                validate_layout(model, lay)
            except InvalidLayout:
                continue
            pred = model.evaluate(lay, [list(range(len(w.profile(dtype).layers)))])
            grads = pred.stages[0].params * (4 if dtype == "fp32" else 2)
            place = placement(work.cluster, gpus, 1, 1)
            sync = comm.all_reduce(grads, place.dp, work.cluster, place.gpus_per_node_busy)
            what = f"{label}, {m} micro-batch{'es' if m > 1 else ''} per sync"
            rows.append(DPRow(what, lay, gpus * micro_batch * m, grads, sync, pred.time_s["dp_comm"],
                              pred.iteration_time_s))
    return rows

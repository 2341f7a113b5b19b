"""Several strategies and the optimum side by side, plus the classic comparisons.

- user strategies (``--strategy``), each priced with its ILP stage split;
- when none are given, the families a textbook sets side by side: pure data parallelism, pure tensor
  parallelism, pure pipeline parallelism, data x tensor, and full 3D (the optimum), each at its best
  micro-batch, schedule and ZeRO stage;
- parameter server vs ring all-reduce: gradient sync time of this model as the workers grow;
- the data-parallel side of every compared layout, per GPU: the gradients it computes (its tensor- and
  pipeline-parallel share), what it keeps after the sync, what it sends, and what the iteration waits for;
  then, for the best of them, what gradient accumulation and 16-bit gradients change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paraplan.hardware_specs import HardwareSpecError

from . import comm
from .costmodel import CostModel, Prediction, validate_layout
from .errors import InvalidLayout
from .ilp import best_partition
from .layout import Layout
from .placement import consecutive_group, placement
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
# mixtures of experts: the same families without expert parallelism, then with it (planner/moe.py)
FAMILIES_MOE = {
    "data parallel": lambda x: x.tp == 1 and x.pp == 1 and x.ep == 1,
    "tensor parallel": lambda x: x.dp == 1 and x.pp == 1 and x.ep == 1,
    "pipeline parallel": lambda x: x.dp == 1 and x.tp == 1,
    "data x tensor": lambda x: x.pp == 1 and x.ep == 1,
    "data x expert": lambda x: x.tp == 1 and x.pp == 1 and x.ep > 1,
    "data x tensor x expert": lambda x: x.pp == 1 and x.ep > 1,
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
        families = (FAMILIES_MOE if work.spec.is_moe else FAMILIES) if work.spec.is_transformer else \
            FAMILIES_CLASSIFIER
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
class DPLayoutRow:
    """One compared layout's data-parallel communication, per GPU (the most loaded pipeline rank)."""

    name: str
    layout: Layout
    group: str  # the data-parallel group's size and placement
    kind: str  # the collectives that sync it
    grad_bytes: float  # gradients a GPU computes: its tensor- and pipeline-parallel share of the model
    kept_bytes: float  # gradients a GPU keeps after the sync (ZeRO-2/3: its 1/dp shard)
    sent_bytes: float | None  # bytes a GPU sends over the data-parallel group per iteration (ring algorithms)
    traffic_s: float | None  # those collectives back to back, as if nothing overlapped them
    exposed_s: float  # what the iteration waits for (the prediction's data-parallel time)
    iteration_s: float


def _rank_grad_bytes(pred: Prediction) -> float:
    """Gradient bytes of the most loaded pipeline rank's GPU (the cost model's width: 4 B in fp32, else 2 B)."""
    lay = pred.layout
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    width = 4 if lay.dtype == "fp32" else 2
    return max(sum(pred.stages[s].params for s in rank_stages(schedule, r, lay.pp, lay.virtual_stages)) * width
               for r in range(lay.pp))


def dp_traffic(lay: Layout, grads: float, work: Workload) -> tuple[str, float, float | None, float | None]:
    """(collectives, kept bytes, sent bytes, seconds back to back) of one iteration's data-parallel sync of
    ``grads`` bytes per GPU, as the cost model prices it: ZeRO 0 all-reduces; ZeRO 1/2 reduce-scatter the
    gradients and all-gather the updated weights; ZeRO 3 also all-gathers the weights for every micro-batch's
    forward and backward. A ring all-reduce sends 2(n-1)/n of the tensor, a reduce-scatter or all-gather
    (n-1)/n (Patarasuk and Yuan 2009)."""
    n = lay.dp
    if lay.dp_mode == "ps":
        return f"parameter servers ({lay.ps_servers})", grads, 2 * grads, None  # push every gradient, pull back
    if n == 1:
        return "none (dp = 1)", grads, 0.0, 0.0
    place = placement(work.cluster, lay.dp, lay.tp, lay.pp)
    busy = place.gpus_per_node_busy
    one = (n - 1) / n * grads
    if lay.head_parallel > 1:  # the trunk over every dp rank, each classifier shard over the dp/k ranks holding it
        head = work.profile(lay.dtype).layers[-1].params / lay.head_parallel * (4 if lay.dtype == "fp32" else 2)
        holders = lay.dp // lay.head_parallel
        group = consecutive_group(work.cluster, holders, lay.head_parallel)
        sent = 2 * (n - 1) / n * (grads - head) + 2 * (holders - 1) / holders * head
        return (f"all-reduce (trunk; classifier shards over {holders} GPU{'s' if holders > 1 else ''})", grads, sent,
                comm.all_reduce(grads - head, place.dp, work.cluster, busy) + comm.all_reduce(head, group, work.cluster,
                                                                                             busy))
    if lay.zero == 0:
        return "all-reduce", grads, 2 * one, comm.all_reduce(grads, place.dp, work.cluster, busy)
    gathers = 1 if lay.zero < 3 else 1 + 2 * lay.num_micro_batches
    kind = "reduce-scatter + all-gather" + (" (and 2 per micro-batch)" if lay.zero == 3 else "")
    kept = grads / n if lay.zero >= 2 else grads
    return kind, kept, one * (1 + gathers), (1 + gathers) * comm.gather(grads, place.dp, work.cluster, busy)


def dp_per_layout(work: Workload, rows: list[Row]) -> list[DPLayoutRow]:
    """The data-parallel side of every priced row: what a GPU holds, sends and waits for."""
    out = []
    for row in rows:
        if row.prediction is None:
            continue
        lay, pred = row.layout, row.prediction
        span = placement(work.cluster, lay.dp, lay.tp, lay.pp).dp
        where = "" if lay.dp == 1 else (f" over {span.nodes} nodes" if span.crosses_nodes else " in one node")
        grads = _rank_grad_bytes(pred)
        kind, kept, sent, traffic = dp_traffic(lay, grads, work)
        out.append(DPLayoutRow(row.name, lay, f"{lay.dp} GPU{'s' if lay.dp > 1 else ''}{where}", kind, grads, kept,
                               sent, traffic, pred.time_s["dp_comm"], pred.iteration_time_s))
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
    """``base``'s layout (its degrees, stages and ZeRO stage) with more samples per gradient sync (gradient
    accumulation: 1, 2 and 4 times its micro-batches per replica) and with 32- or 16-bit training (the
    gradient's width): what a GPU sends per sync, and what is exposed per iteration and per sample."""
    lay0 = base.layout
    model = CostModel(work)
    rows = []
    for dtype, label in (("fp32", "fp32 gradients"), ("bf16", "16-bit gradients (bf16 training)")):
        for k in (1, 2, 4):
            lay = replace(lay0, global_batch=lay0.global_batch * k, dtype=dtype)
            try:
                validate_layout(model, lay)
                pred = model.evaluate(lay, base.stages, base.stage_recompute)
            except (InvalidLayout, HardwareSpecError):
                continue
            grads = _rank_grad_bytes(pred)
            _, _, _, traffic = dp_traffic(lay, grads, work)
            what = f"{label}, {lay.num_micro_batches} micro-batch{'es' if lay.num_micro_batches > 1 else ''} per sync"
            rows.append(DPRow(what, lay, lay.global_batch, grads, traffic or 0.0, pred.time_s["dp_comm"],
                              pred.iteration_time_s))
    return rows

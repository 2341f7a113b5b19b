"""One definition per cost concern, used exactly by the evaluator and in linear form by the ILP.

Each concern of a pipeline rank — the data-parallel gradient sync and ZeRO's gathers, the tied
embedding's all-reduce, the parameter servers' round, the optimizer step, the model states in memory —
is written here once, as data over the rank's *load*: its parameters, its forward and backward compute
per micro-batch, its last backward (the overlap window) and the pipeline's makespan. The cost model
(costmodel.evaluate) evaluates them exactly on numbers; the stage ILP (ilp.py) evaluates the same
objects on its LP expressions, where each collective's time becomes its secant (exact for α-β links)
and each ``max`` an auxiliary variable; the search's lower bound (search.py) takes the same per-parameter
coefficients. (calculon's "one small class per concern" is the model.)

Vocabulary:
- :class:`Affine`: c + a·params + f·fwd + b·bwd + w·window + k·makespan + r·replicated + e·experts
  + s·moe_shared over a rank's load;
- :class:`Sync`: one collective whose message is affine in the rank's load (bytes), with its exact
  time function and the kind of traffic it is (all_reduce, all_gather, reduce_scatter, send_recv);
- :class:`Exposure`: ``count`` times what of a Sync the rank waits for: max(floor, time - hidden), with
  ``hidden`` the compute it overlaps and ``floor`` 0 (it may hide entirely), nothing (it may not), or the
  time of its last bucket, min(message, bucket) (bucketed overlap: DDP, FSDP units). Collectives that run in
  the same window over the same network (ZeRO-3's backward: the next layer's weights gathered while this
  layer's gradients are reduce-scattered) are one Exposure (``also``): their times add up before the window
  is taken off, so one window never hides each of them whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

LOAD_FIELDS = ("params", "fwd", "bwd", "window", "makespan", "replicated", "experts", "moe_shared")


@dataclass
class RankLoad:
    """What one pipeline rank holds and computes (numbers, or the ILP's LP expressions)."""

    params: object = 0.0  # parameters held (tensor-parallel shard; a tied weight once), routed experts aside
    fwd: object = 0.0  # forward compute per micro-batch, seconds (no communication)
    bwd: object = 0.0  # backward compute per micro-batch, seconds
    window: object = 0.0  # the last micro-batch's backward on this rank (what a bucketed sync overlaps)
    makespan: object = 0.0  # the pipeline's makespan (asynchronous parameter servers overlap it)
    replicated: object = 0.0  # of params, those tensor parallelism leaves whole (norms, row-parallel biases)
    # Mixture of experts (planner/moe.py): the routed-expert parameters held (its ep x etp shard; synced over the
    # expert-data-parallel group, not dp), and of params the MoE weights replicated over tensor-parallel ranks
    # that each route their own tokens (router, shared experts; routed experts when ep = 1): summed over tp.
    experts: object = 0.0
    moe_shared: object = 0.0


@dataclass(frozen=True)
class Affine:
    const: float = 0.0
    params: float = 0.0
    fwd: float = 0.0
    bwd: float = 0.0
    window: float = 0.0
    makespan: float = 0.0
    replicated: float = 0.0
    experts: float = 0.0
    moe_shared: float = 0.0

    def at(self, load: RankLoad):
        out = self.const
        for name, coef in self._terms:
            out = out + coef * getattr(load, name)
        return out

    @cached_property
    def _terms(self) -> tuple[tuple[str, float], ...]:
        """The load's fields with a coefficient, in LOAD_FIELDS order (what :meth:`at` adds, in that order): the
        cost model evaluates thousands of these a search. Kept in the instance (not a field: no part of its
        equality, hash or repr)."""
        return tuple((name, getattr(self, name)) for name in LOAD_FIELDS if getattr(self, name))


@dataclass(frozen=True)
class Sync:
    """A message of ``const_bytes + per_param·params + per_replicated·replicated + per_expert·experts +
    per_moe_shared·moe_shared`` bytes (affine in the rank's load) through ``time`` (seconds for n bytes), plus
    ``extra`` seconds (e.g. a server's update)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv; copy: GPU memory, no network
    time: Callable[[float], float]
    per_param: float = 0.0
    const_bytes: float = 0.0
    per_replicated: float = 0.0
    per_expert: float = 0.0
    per_moe_shared: float = 0.0
    extra: Affine = field(default_factory=Affine)

    def nbytes(self, load: RankLoad):
        return self._bytes.at(load)

    @cached_property
    def _bytes(self) -> Affine:
        """:meth:`bytes_affine`, built once (every evaluation of the sync asks for it)."""
        return self.bytes_affine()

    def bytes_affine(self) -> Affine:
        return Affine(const=self.const_bytes, params=self.per_param, replicated=self.per_replicated,
                      experts=self.per_expert, moe_shared=self.per_moe_shared)

    def seconds(self, load: RankLoad) -> float:
        return self.time(self.nbytes(load)) + self.extra.at(load)

    def secant(self, guess_bytes: float) -> Affine:
        """Time as affine in the rank's load: the transfer's secant through ``guess_bytes`` and twice that
        (exact when the time is α + bytes/β), plus the extra seconds."""
        x0 = max(guess_bytes, 1.0)
        y0, y1 = self.time(x0), self.time(2 * x0)
        slope = (y1 - y0) / x0
        b = self.bytes_affine()
        e = self.extra
        return Affine(const=y0 - slope * x0 + slope * b.const + e.const, params=slope * b.params + e.params,
                      fwd=e.fwd, bwd=e.bwd, window=e.window, makespan=e.makespan,
                      replicated=slope * b.replicated + e.replicated, experts=slope * b.experts + e.experts,
                      moe_shared=slope * b.moe_shared + e.moe_shared)


@dataclass(frozen=True)
class Exposure:
    """``count`` x max(floor, sync time - hidden): the part of a collective the rank waits for."""

    sync: Sync
    count: float = 1.0
    hidden: Affine = field(default_factory=Affine)
    floor: str = "none"  # "zero": may hide entirely; "none": never below its time - hidden; "bucket": see below
    bucket_bytes: float = 0.0  # floor "bucket": at least the time of min(message, bucket_bytes)
    bucket_time: Callable[[float], float] | None = None  # that last bucket's collective (default: the sync's)
    also: tuple[Sync, ...] = ()  # collectives sharing its window and network, each ``count`` times (times add up)

    def __post_init__(self) -> None:
        assert not (self.also and self.floor == "bucket"), "a bucketed floor is one collective's"

    @property
    def syncs(self) -> tuple[Sync, ...]:
        return (self.sync, *self.also)

    @property
    def last_bucket_time(self) -> Callable[[float], float]:
        return self.bucket_time or self.sync.time

    def seconds(self, load: RankLoad) -> float:
        t = sum(s.seconds(load) for s in self.syncs) - self.hidden.at(load)
        if self.floor == "zero":
            t = max(0.0, t)
        elif self.floor == "bucket":  # the last bucket's collective, min(message, bucket), cannot hide (a part of
            # the sync: never longer than the whole of it)
            nbytes = self.sync.nbytes(load)
            t = max(t, min(self.last_bucket_time(min(nbytes, self.bucket_bytes)), self.sync.time(nbytes)))
        return self.count * t

    def least_seconds(self, load: RankLoad) -> float:
        """A lower bound on :meth:`seconds`, convex in the load (the search's lower bound evaluates it at the
        pipeline ranks' mean load, which by Jensen's inequality bounds their mean wait): the transfer at its
        least cost per byte — every collective time here is concave in the message (the faster of ring and
        tree, hierarchical sums of those, latencies >= 0), so time(n) >= n x its slope for large n — the
        floor relaxed to zero, and nothing for what overlaps the makespan, which a bound does not know."""
        if self.hidden.makespan or any(s.extra.makespan for s in self.syncs):
            return 0.0
        t = sum(least_slope(s.time) * s.nbytes(load) + s.extra.at(load) for s in self.syncs) - self.hidden.at(load)
        return self.count * (t if self.floor == "none" else max(0.0, t))

    def traffic(self, load: RankLoad) -> list[tuple[str, float]]:
        """Network bytes by kind (a ``copy`` moves none)."""
        return [(s.kind, self.count * s.nbytes(load)) for s in self.syncs if s.kind != "copy"]


def least_slope(time: Callable[[float], float]) -> float:
    """Seconds per byte of a concave, piecewise-affine transfer time at large messages: its least slope."""
    big = float(2**50)
    return max(0.0, (time(2 * big) - time(big)) / big)


def exposed_seconds(items: list[Exposure], load: RankLoad) -> float:
    return sum(e.seconds(load) for e in items)


def sync_summary(items: list[Exposure], load: RankLoad) -> dict:
    """A rank's sync ``items`` as a reader sees them: the collectives in order with how many times each runs
    (``kinds``: [(kind, count)]), their message bytes per iteration (``bytes``, as :func:`traffic` counts them),
    their seconds back to back as if nothing overlapped them (``unhidden_s``) and what the rank waits for
    (``exposed_s``, never more: :meth:`Exposure.seconds` takes only what hides)."""
    counts: dict[str, float] = {}  # by kind, in the order first seen
    for e in items:
        for s in e.syncs:
            counts[s.kind] = counts.get(s.kind, 0.0) + e.count
    return dict(kinds=list(counts.items()), bytes=sum(traffic(items, load).values()),
                unhidden_s=sum(e.count * s.seconds(load) for e in items for s in e.syncs),
                exposed_s=exposed_seconds(items, load))


def traffic(items: list[Exposure], load: RankLoad) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in items:
        for kind, nbytes in e.traffic(load):
            out[kind] = out.get(kind, 0.0) + nbytes
    return out

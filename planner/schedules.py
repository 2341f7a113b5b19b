"""Pipeline schedules: each rank's order of work, stage placement, in-flight micro-batches, closed forms.

Orders follow torch.distributed.pipelining (what the executor runs), which follow the papers:
- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021 Sec. 2.2): p - r - 1 warm-up forwards on rank r,
  then one forward / one backward, then the remaining backwards.
- ``interleaved-1f1b`` (Narayanan et al. 2021 Sec. 2.2.2): v model chunks per rank, chunk c of rank r
  is stage c*p + r; torch's "flexible" variant groups micro-batches in rounds of max(1, m // p).
- ``zb-v`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 6): two chunks per rank in a V
  (rank r holds stages r and 2p-1-r), backward split into input (B) and weight (W) gradients.
An op is (kind, stage, micro-batch) with kind F, B (full backward, or input backward in zb-v) or W.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import Any

Op = tuple[str, int, int]


def stage_rank(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank that runs (virtual) stage ``stage``."""
    if schedule == "zb-v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@lru_cache(maxsize=65536)
def rank_stages(schedule: str, rank: int, pp: int, v: int) -> tuple[int, ...]:
    return tuple(s for s in range(pp * v) if stage_rank(schedule, s, pp) == rank)


def _gpipe(r: int, m: int) -> list[Op]:
    return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Op]:
    warmup = min(p - r - 1, m)
    ops: list[Op] = [("F", r, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", r, warmup + i), ("B", r, i)]
    ops += [("B", r, i) for i in range(m - warmup, m)]
    return ops


def _interleaved(r: int, p: int, v: int, m: int) -> list[Op]:
    kind, stage, micro = _interleaved_arrays(r, p, v, m)
    names = ("F", "B")
    return list(zip([names[k] for k in kind.tolist()], stage.tolist(), micro.tolist(), strict=True))


def _interleaved_arrays(r: int, p: int, v: int, m: int):
    """Rank r's interleaved order as arrays (kind: 0 F, 1 B; stage; micro-batch), each (2·v·m,). Torch's flexible
    order, in closed form: micro-batches go in rounds of g = m // max(1, m // p); forward step j runs chunk
    (j // g) mod v on micro-batch (j // (g·v))·g + j mod g, backward step j chunk v - 1 - (j // g) mod v on the
    same micro-batch. After the warm-up's forwards each step runs a forward and then the backward of step j -
    warm-up, and the cool-down runs the backwards left (equal to the step-by-step walk: tests)."""
    import numpy as np

    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - r), v * m)
    total = v * m
    steady = total - warmup  # steps that run a forward and a backward
    j = np.arange(total)
    mb = (j // (per_round * v)) * per_round + j % per_round  # (total,): step j's micro-batch, forward or backward
    turn = (j // per_round) % v
    fwd, bwd = turn * p + r, (v - 1 - turn) * p + r  # (total,): step j's forward and backward stage
    kind = np.ones(2 * total, dtype=np.int64)
    stage, micro = np.empty_like(kind), np.empty_like(kind)
    mid = slice(warmup, warmup + 2 * steady)
    for out, f_val, b_val in ((stage, fwd, bwd), (micro, mb, mb)):
        out[:warmup] = f_val[:warmup]
        out[mid][0::2] = f_val[warmup:]
        out[mid][1::2] = b_val[:steady]
        out[warmup + 2 * steady:] = b_val[steady:]
    kind[:warmup] = 0
    kind[mid][0::2] = 0
    return kind, stage, micro


KIND_CODES = {"F": 0, "B": 1, "W": 2}


def rank_order_arrays(schedule: str, pp: int, v: int, m: int) -> list[tuple[Any, Any, Any]]:
    """:func:`rank_orders` as arrays per rank: (kind: 0 F, 1 B, 2 W; stage; micro-batch), for the event simulation's
    walk (interleaved orders of thousands of ops built without a tuple per op)."""
    import numpy as np

    if schedule == "interleaved-1f1b":
        return [_interleaved_arrays(r, pp, v, m) for r in range(pp)]
    out = []
    for order in rank_orders(schedule, pp, v, m):
        kinds, stages, micros = zip(*order, strict=True) if order else ((), (), ())
        out.append((np.array([KIND_CODES[k] for k in kinds], dtype=np.int64), np.array(stages, dtype=np.int64),
                    np.array(micros, dtype=np.int64)))
    return out


def _zbv(r: int, p: int, m: int) -> list[Op]:
    n = max(2 * p - 1, m)  # torch pads to at least 2p-1 micro-batches, then drops the padding
    c0, c1 = r, 2 * p - 1 - r
    cnt = defaultdict(int)
    ops: list[Op] = []

    def add(kind: str, stage: int) -> None:
        key = (kind, stage)
        ops.append((kind, stage, cnt[key]))
        cnt[key] += 1

    for _ in range(2 * (p - r) - 1):
        add("F", c0)
    for _ in range(r):
        add("F", c1)
        add("F", c0)
    for _ in range(p - r):
        add("F", c1)
        add("B", c1)
        add("W", c1)
    while cnt[("F", c1)] < cnt[("F", c0)] or cnt[("F", c0)] < n:
        if cnt[("F", c0)] < n:
            add("F", c0)
        add("B", c0)
        add("W", c0)
        add("F", c1)
        add("B", c1)
        add("W", c1)
    for _ in range(r):
        add("B", c0)
        add("B", c1)
    for _ in range(p - r):
        add("B", c0)
        add("W", c0)
    while cnt[("W", c1)] < cnt[("B", c1)]:
        add("W", c1)
    while cnt[("W", c0)] < cnt[("B", c0)]:
        add("W", c0)
    return [op for op in ops if op[2] < m]


@lru_cache(maxsize=512)
def rank_orders(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[Op, ...], ...]:
    """Each pipeline rank's ops in the order it runs them."""
    if schedule == "gpipe":
        return tuple(tuple(_gpipe(r, m)) for r in range(pp))
    if schedule == "1f1b":
        return tuple(tuple(_one_f_one_b(r, pp, m)) for r in range(pp))
    if schedule == "interleaved-1f1b":
        return tuple(tuple(_interleaved(r, pp, v, m)) for r in range(pp))
    if schedule == "zb-v":
        return tuple(tuple(_zbv(r, pp, m)) for r in range(pp))
    raise AssertionError(f"unknown schedule {schedule}")


# chunks torch's multi-stage pipeline runtime keeps unsharded at once (_add_unshard_reshard's max_active_stages)
RUNTIME_ACTIVE_CHUNKS = 3


@lru_cache(maxsize=512)
def runtime_unshards(schedule: str, pp: int, v: int, m: int) -> float:
    """All-gathers of each chunk's weights a step, on average over the ranks and their chunks, under FSDP2 ZeRO-2/3
    in torch's multi-stage pipeline runtime (torch/distributed/pipelining/schedules.py, _add_unshard_reshard): before
    each op it unshards the next RUNTIME_ACTIVE_CHUNKS distinct chunks the rank will run and reshards the others, so
    a rank of more chunks than that gathers them again as its order cycles through them (interleaved 1F1B with
    pp 2, v 4, 16 micro-batches: 5.75 and 5.25 per chunk on its two ranks); 1 with at most that many chunks.

    Once m // pp exceeds m % pp every round of the order holds pp micro-batches (_interleaved) and, past the
    warm-up, the order repeats one round per chunk, so the count grows by a fixed amount per pp more micro-batches:
    it is walked for two counts of m's residue, a round after that point, and extended linearly (equal to the full
    walk: tests), instead of walking thousands of ops for every micro-batch count the search tries."""
    if pp == 1 or schedule != "interleaved-1f1b" or v <= RUNTIME_ACTIVE_CHUNKS:
        return 1.0
    start = pp * (max(2, m % pp + 1) + 1) + m % pp
    if m <= start + pp:
        return _unshards_walked(schedule, pp, v, m) / (pp * v)
    first, second = _unshards_walked(schedule, pp, v, start), _unshards_walked(schedule, pp, v, start + pp)
    return (first + (m - start) // pp * (second - first)) / (pp * v)


def gathers_whole_chunks(schedule: str, pp: int, v: int) -> bool:
    """Does torch's multi-stage runtime keep evicting and gathering again whole chunks of a rank under FSDP2 ZeRO-3
    (interleaved 1F1B of more than RUNTIME_ACTIVE_CHUNKS chunks a rank)? With fewer a rank gathers all its chunks
    at the step's first op and never evicts one (memory.StateBytes.start_weights)."""
    return schedule == "interleaved-1f1b" and pp > 1 and v > RUNTIME_ACTIVE_CHUNKS


@lru_cache(maxsize=512)
def runtime_gathers(pp: int, v: int, m: int) -> tuple[Any, ...]:
    """Per rank of an interleaved 1F1B schedule, a (ops, v) 0/1 array: before each op, which of the rank's chunks
    (rank_stages order) have whole-chunk gathers pending under FSDP2 ZeRO-3 in torch's multi-stage runtime
    (_PipelineScheduleRuntime, torch/distributed/pipelining/schedules.py _add_unshard_reshard). Before each op the
    runtime unshards (async all-gathers of every unit) the chunks among the next RUNTIME_ACTIVE_CHUNKS distinct ones
    the rank runs (its window, this op's first) that the last window lacked, and reshards the others. An
    all-gather's output stays until that chunk's next op waits on it — FSDP2's reshard leaves a pending
    all-gather result alone (_fsdp_param_group.py) — and is then copied out into the chunk's unsharded weights,
    which its units' hooks free one at a time; so before an op its own chunk counts where it is pending.
    Row 0 is the step's first op (memory.start_bytes' moment). Each window comes from the next op's, walked
    backwards (as _unshards_walked)."""
    import numpy as np

    return tuple((np.array(masks)[:, None] >> np.arange(v)) & 1  # (ops, v)
                 for masks in _pending_masks(pp, v, m))


@lru_cache(maxsize=512)
def _pending_masks(pp: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """runtime_gathers' flags per rank as one bit mask per op (bit c: chunk c pending)."""
    out = []
    for r, (_, stage, _) in enumerate(rank_order_arrays("interleaved-1f1b", pp, v, m)):
        chunks = ((stage - r) // pp).tolist()  # (ops,): each op's chunk on the rank
        windows = [0] * len(chunks)  # each op's window as a mask
        window: list[int] = []
        for i in range(len(chunks) - 1, -1, -1):
            c = chunks[i]
            window = [c] + [x for x in window if x != c][:RUNTIME_ACTIVE_CHUNKS - 1]
            windows[i] = sum(1 << x for x in window)
        masks = []
        active = pending = 0
        for c, window in zip(chunks, windows, strict=True):
            pending |= window & ~active
            active = window
            masks.append(pending)
            pending &= ~(1 << c)
        out.append(tuple(masks))
    return tuple(out)


@lru_cache(maxsize=512)
def _unshards_walked(schedule: str, pp: int, v: int, m: int) -> int:
    """runtime_unshards' gathers summed over the ranks and their chunks, by walking each rank's order: before each op
    the runtime holds the next RUNTIME_ACTIVE_CHUNKS distinct chunks from it on (its window), so each op gathers the
    chunks of its window that the op before's lacked. Walked backwards, each window comes from the next one."""
    import numpy as np

    total = 0
    for _, stage, _ in rank_order_arrays(schedule, pp, v, m):
        if not len(stage):
            continue
        # an op followed by one of its own chunk has that op's window: only the last of each run can gather
        runs = stage[np.append(stage[:-1] != stage[1:], True)].tolist()
        window: list[int] = []  # the next op's, its chunk first
        for chunk in reversed(runs):
            if chunk in window:  # moved to the front: nothing leaves the window, the next op gathers nothing
                window.remove(chunk)
            elif len(window) == RUNTIME_ACTIVE_CHUNKS:  # the window's last leaves it: the next op gathers it back
                window.pop()
                total += 1
            window.insert(0, chunk)
        total += len(window)  # the first op gathers its whole window
    return total


def in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, int], ...]:
    """Per rank, the micro-batches of each of its stages holding activations at the rank's peak.

    Walking the rank's order: a forward stores a micro-batch's activations, its backward (in zb-v: its
    weight-gradient pass, which still needs the saved inputs) frees them. The peak is the most
    micro-batch-stages held at once. The peak is reached during warm-up, so past a point more
    micro-batches change nothing (1f1b: m >= p; interleaved with m a multiple of p: m >= 2p; zb-v:
    m >= 2p; checked against the full walk in the tests) and the walk stops there.
    """
    if schedule == "1f1b" and m >= pp:
        m = pp
    elif schedule == "zb-v" and m >= 2 * pp:
        m = 2 * pp
    elif schedule == "interleaved-1f1b" and m % pp == 0 and m >= 2 * pp:
        m = 2 * pp
    if schedule == "zb-v":
        return _in_flight(schedule, pp, v, m)
    return _in_flight_at_warm_up(schedule, pp, v, m)


def peak_holdings(schedule: str, pp: int, v: int, m: int, gathers: bool = False
                  ) -> tuple[tuple[dict[int, int], ...], ...]:
    """Per rank, the micro-batches of each stage holding activations at every moment that could be its
    activation peak: the holdings that no other moment of the rank's order matches or exceeds stage by stage.
    Where a rank's stages keep different bytes per micro-batch (uneven chunks, or a chunk recomputed and another
    not) the peak in bytes may come after the most micro-batches are held (:func:`in_flight`'s moment): in an
    interleaved steady state each step trades one chunk's micro-batch for another's. The rank's peak is the
    largest of these, whatever each stage keeps — what the event simulation finds (tests). One stage per rank:
    in_flight's. As in_flight, the walk stops where more micro-batches change nothing (interleaved with m a
    multiple of p: 3p; zb-v: 2p + 1; checked against the full walk in the tests).

    In zb-v a stage's input backward (B) also leaves, until its weight backward (W), the gradients torch keeps for
    it (StageCost.dw_pending): a moment's dict counts those micro-batches under the key ``pending_key(stage)``
    beside the stage's own; and under ``unfolded_key(stage)`` 1 where the stage's last backward task was a W, whose
    16-bit weight gradients FSDP2 keeps until the stage's next B folds them into its fp32 sums
    (memory.StateBytes.unfolded).

    ``gathers`` (FSDP2 ZeRO-3 where :func:`gathers_whole_chunks`): the moments are each op's start after the step's
    first (:func:`runtime_gathers`, ``gathered_key(stage)`` 1 where the stage's chunk is pending; an op's end holds
    no more than the next op's start), ``buffer_key(stage)`` 1 where the stage's chunk keeps its last reduce buffer
    (FSDP2's per-chunk reduce-scatter state: from its first backward to its last, which frees it), and
    ``late_key(pp, v)`` 1 where the rank's first backward has run (gradients exist from then on): a chunk's gathered
    weights outweigh many micro-batches' activations, so the peak may hold fewer micro-batches than the most
    (llama2-70b dp16 tp2 pp2 v = 4, traced: rank 0's peak holds 6 chunk micro-batches of its most 9, in the
    cool-down, with three chunks gathered and three reduce buffers: its last chunk past its last backward)."""
    m = moments_micro_batches(schedule, pp, v, m, gathers)
    if gathers and gathers_whole_chunks(schedule, pp, v):
        return _gather_holdings(pp, v, m)
    if schedule != "zb-v" and v == 1:
        return tuple((d,) for d in in_flight(schedule, pp, v, m))
    return _peak_holdings(schedule, pp, v, m)


def moments_micro_batches(schedule: str, pp: int, v: int, m: int, gathers: bool = False) -> int:
    """The micro-batch count whose walk gives :func:`peak_holdings`' moments for ``m`` (the same moments from there
    on, checked against the full walk in the tests): interleaved with m a multiple of p, 3p (with whole-chunk gathers
    too); zb-v, 2p + 1 (the unfolded gradients' too); 1F1B, p (in_flight's); otherwise ``m``."""
    if schedule == "interleaved-1f1b":  # whole-chunk gathers or not
        return 3 * pp if m % pp == 0 and m >= 3 * pp else m
    if schedule == "zb-v":
        return 2 * pp + 1 if m > 2 * pp else m
    if schedule == "1f1b" and v == 1:
        return min(m, pp)
    return m


def gathered_key(stage: int, pp: int, v: int) -> int:
    """peak_holdings' key for whether ``stage``'s chunk has whole-chunk gathers pending (ZeRO-3 interleaved): 1 or
    absent."""
    return 3 * pp * v + stage


def late_key(pp: int, v: int) -> int:
    """peak_holdings' key (with ``gathers``) for whether the moment comes after the rank's first backward: 1 or
    absent."""
    return 4 * pp * v


@lru_cache(maxsize=256)
def _gather_holdings(pp: int, v: int, m: int) -> tuple[tuple[dict[int, int], ...], ...]:
    """peak_holdings with ``gathers``: per rank, walking its order beside runtime_gathers' flags (as running sums over
    the order's arrays: the walk of thousands of ops, once per rank, in numpy)."""
    import numpy as np

    out = []
    for r, ((kind, stage, _), masks) in enumerate(zip(rank_order_arrays("interleaved-1f1b", pp, v, m),
                                                      _pending_masks(pp, v, m), strict=True)):
        stages = list(rank_stages("interleaved-1f1b", r, pp, v))
        chunk = np.eye(v, dtype=np.int64)[(stage - r) // pp]  # (ops, v): each op's chunk, one-hot
        # after each op: micro-batches held per chunk (a forward adds one, a backward frees one), backwards run per
        # chunk, and whether the rank's first backward has run
        held = np.cumsum(chunk * np.where(kind == 0, 1, -1)[:, None], axis=0)  # (ops, v)
        backwards = np.cumsum(chunk * kind[:, None], axis=0)  # (ops, v)
        late = np.maximum.accumulate(kind)  # (ops,)
        # the moments: before each op but the step's first (memory.start_bytes'), i.e. after the op before, with
        # that op's pending chunks; an op's end is matched by the next op's start, which holds as much, its pending
        # chunks and more (the window's new ones); a chunk keeps its last reduce buffer from its first backward to
        # its last. Then the last op's end: every chunk past its last backward, nothing pending.
        pending = (np.array(masks[1:], dtype=np.int64)[:, None] >> np.arange(v)) & 1  # (ops - 1, v)
        buffers = (backwards[:-1] > 0) & (backwards[:-1] < m)  # (ops - 1, v)
        rows = np.vstack([np.hstack([held[:-1], pending, buffers, late[:-1, None]]),
                          np.hstack([held[-1], np.zeros(2 * v, dtype=np.int64), late[-1:]])])  # (ops, 3v + 1)
        out.append(_not_dominated_rows([*stages, *_gather_keys(stages, pp, v)], rows))
    return tuple(out)


def _gather_keys(stages, pp: int, v: int) -> list[int]:
    """The keys a gather moment holds after its stages' micro-batches, in peak_matrices' column order: each stage's
    :func:`gathered_key`, then its :func:`buffer_key`, then :func:`late_key`."""
    return [*(gathered_key(s, pp, v) for s in stages), *(buffer_key(s, pp, v) for s in stages), late_key(pp, v)]


def buffer_key(stage: int, pp: int, v: int) -> int:
    """peak_holdings' key (with ``gathers``) for whether ``stage``'s chunk keeps a reduce buffer at the moment (it has
    run a backward and not yet its last, which frees it): 1 or absent."""
    return 5 * pp * v + stage


def pending_key(stage: int, pp: int, v: int) -> int:
    """peak_holdings' key for the micro-batches of ``stage`` between its input and its weight backward (zb-v)."""
    return pp * v + stage


def unfolded_key(stage: int, pp: int, v: int) -> int:
    """peak_holdings' key for whether ``stage`` holds 16-bit weight gradients not yet folded (zb-v): 1 or absent."""
    return 2 * pp * v + stage


@lru_cache(maxsize=1024)
def peak_matrices(schedule: str, pp: int, v: int, m: int, gathers: bool = False
                  ) -> tuple[tuple[tuple[int, ...], Any], ...]:
    """:func:`peak_holdings` as arrays: per rank its stages and a (moments, stages) matrix of the micro-batches each
    holds, so that a rank's activation peak is one matrix-vector product (the cost model asks thousands of times).
    In zb-v the matrix is (moments, 3 x stages): after the stages' columns, the micro-batches each has between its
    input and its weight backward (:func:`pending_key`), then whether it holds unfolded gradients
    (:func:`unfolded_key`). With ``gathers`` (ZeRO-3, :func:`gathers_whole_chunks`) (moments, 3 x stages + 1): then
    whether each stage's chunk has gathers pending (:func:`gathered_key`), keeps a reduce buffer
    (:func:`buffer_key`), and last whether the moment comes after the rank's first backward (:func:`late_key`),
    those moments first."""
    import numpy as np

    from . import schedule_cache

    gathers = gathers and gathers_whole_chunks(schedule, pp, v)
    m = moments_micro_batches(schedule, pp, v, m, gathers)  # every count from there on shares its entry
    key = (schedule, pp, v, m, gathers)
    matrices = schedule_cache.load(key, pp)  # kept on disk by an earlier process (schedule_cache.py), or computed:
    if matrices is None:
        matrices = []
        for r, held in enumerate(peak_holdings(schedule, pp, v, m, gathers)):
            stages = rank_stages(schedule, r, pp, v)
            keys = list(stages) + ([pending_key(s, pp, v) for s in stages] + [unfolded_key(s, pp, v) for s in stages]
                                   if schedule == "zb-v" else _gather_keys(stages, pp, v) if gathers else [])
            rows = [[h.get(k, 0) for k in keys] for h in held]
            if gathers:
                rows.sort(key=lambda row: -row[-1])  # the moments after the first backward first (stable)
            matrices.append(np.array(rows, dtype=float).reshape(len(rows), len(keys)))
        schedule_cache.store(key, matrices)
    return tuple((rank_stages(schedule, r, pp, v), held) for r, held in enumerate(matrices))


@lru_cache(maxsize=1024)
def _peak_holdings(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[dict[int, int], ...], ...]:
    if schedule == "zb-v":
        return _zero_bubble_holdings(pp, m)
    out = []
    for r, order in enumerate(rank_orders(schedule, pp, v, m)):
        stages = sorted(rank_stages(schedule, r, pp, v))
        col = {s: i for i, s in enumerate(stages)}
        held = [0] * len(stages)  # micro-batches held per stage of the rank, in stage order
        tops: set[tuple[int, ...]] = set()
        rising = False  # a forward since the last free: a moment that may be a peak ends at the next free
        for kind, stage, _ in order:
            if kind == "F":
                held[col[stage]] += 1
                rising = True
            elif kind == "B":
                if rising:
                    tops.add(tuple(held))
                rising = False
                held[col[stage]] -= 1
        if rising:
            tops.add(tuple(held))
        out.append(_not_dominated(stages, tops))
    return tuple(out)


def _zero_bubble_holdings(pp: int, m: int) -> tuple[tuple[dict[int, int], ...], ...]:
    """_peak_holdings for zb-v: per stage of a rank the micro-batches holding activations (F to W), those between B
    and W (pending_key), and whether its last backward task was a W (unfolded_key). A moment may be a peak where
    anything rose since the last (F, B's pending, a W's first unfolded gradients) and a task comes that may lower it
    (B folds the unfolded gradients, W frees a micro-batch)."""
    out = []
    for r, order in enumerate(rank_orders("zb-v", pp, 2, m)):
        stages = sorted(rank_stages("zb-v", r, pp, 2))
        keys = stages + [pending_key(s, pp, 2) for s in stages] + [unfolded_key(s, pp, 2) for s in stages]
        col = {s: i for i, s in enumerate(stages)}
        k = len(stages)
        held = [0] * len(keys)
        tops: set[tuple[int, ...]] = set()
        rising = False
        for kind, stage, _ in order:
            c = col[stage]
            if kind == "F":
                held[c] += 1
                rising = True
                continue
            if rising:
                tops.add(tuple(held))
            if kind == "B":
                held[k + c] += 1
                held[2 * k + c] = 0
                rising = True
            else:  # W
                held[c] -= 1
                held[k + c] -= 1
                rising = not held[2 * k + c]
                held[2 * k + c] = 1
        if rising:
            tops.add(tuple(held))
        out.append(_not_dominated(keys, tops))
    return tuple(out)


def _not_dominated(stages: list[int], tops: set[tuple[int, ...]]) -> tuple[dict[int, int], ...]:
    """Of the holdings ``tops`` (micro-batches per stage of ``stages``, in that order), those that no other holds
    at least as much of, stage by stage, as {stage: micro-batches} without zero counts; most micro-batches first."""
    import numpy as np

    return _not_dominated_rows(stages, np.array(sorted(tops), dtype=np.int64).reshape(len(tops), len(stages)))


def _not_dominated_rows(stages: list[int], rows) -> tuple[dict[int, int], ...]:
    """:func:`_not_dominated` of the holdings ``rows`` ((moments, stages) integer array; repeats allowed)."""
    import numpy as np

    held = np.unique(rows, axis=0)  # (N, K): each distinct moment's
    small = held.astype(np.int32)  # (counts of micro-batches and 0/1 flags: narrower compares quicker)
    covers = (small[:, None, :] >= small[None, :, :]).all(axis=2)  # (N, N): [b, a] = b holds at least a's
    np.fill_diagonal(covers, False)  # distinct holdings: covering another means holding more somewhere
    keep = np.flatnonzero(~covers.any(axis=0))
    peaks = [{s: k for s, k in zip(stages, held[i].tolist(), strict=True) if k} for i in keep]
    peaks.sort(key=lambda d: (-sum(d.values()), sorted(d.items())))
    return tuple(peaks)


@lru_cache(maxsize=4096)
def _in_flight_at_warm_up(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, int], ...]:
    """:func:`_in_flight` without walking the orders, for the schedules whose peak is the end of the warm-up: a
    rank runs its warm-up forwards, then each steady step a forward before a backward (one more held, then one
    fewer), then only backwards — so it holds the most right after the first steady forward (or after every
    forward, when the warm-up is all of them). GPipe holds all m; 1F1B's rank r min(p - r, m); interleaved
    rank r counts the first k forwards by chunk, chunk c taking steps c·g..c·g+g-1 of every round of v·g
    (g micro-batches per round, as _interleaved orders them). The tests compare it with the walk."""
    if schedule == "gpipe":
        return tuple({r: m} for r in range(pp))
    if schedule == "1f1b":
        return tuple({r: min(pp - r, m)} for r in range(pp))
    assert schedule == "interleaved-1f1b", schedule
    per_round = m // max(1, m // pp)
    out = []
    for r in range(pp):
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), v * m)
        k = min(warmup + 1, v * m)  # forwards run before the first backward
        cycles, rest = divmod(k, per_round * v)
        held = {c * pp + r: cycles * per_round + min(max(rest - c * per_round, 0), per_round) for c in range(v)}
        out.append({s: n for s, n in held.items() if n})
    return tuple(out)


@lru_cache(maxsize=1024)
def _in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, int], ...]:
    frees = "W" if schedule == "zb-v" else "B"
    out = []
    for order in rank_orders(schedule, pp, v, m):
        held: dict[int, int] = defaultdict(int)
        best: dict[int, int] = {}
        total = best_total = 0
        for kind, stage, _ in order:
            if kind == "F":
                held[stage] += 1
                total += 1
                if total > best_total:
                    best_total, best = total, dict(held)
            elif kind == frees:
                held[stage] -= 1
                total -= 1
        out.append(best)
    return tuple(out)


def closed_form_makespan(schedule: str, pp: int, v: int, m: int, rank_time: list[float],
                         rank_fwd: list[float], rank_bwd_weight: list[float]) -> float:
    """Iteration time of the pipeline part, from each rank's time per micro-batch (all its stages).

    - gpipe, 1f1b: (m - 1) x slowest rank + sum over ranks (fill and drain); for equal ranks
      (m + p - 1) x t, i.e. the bubble fraction (p - 1)/(m + p - 1) (Huang et al. 2019, Sec. 2.3;
      Narayanan et al. 2021, Sec. 2.2.1).
    - interleaved-1f1b (m >= p): m x slowest rank + (p - 1)/v x mean rank time, i.e. the bubble
      fraction (p - 1)/(v m) of the 1F1B one divided by v (Narayanan et al. 2021, Sec. 2.2.2).
    - zb-v, and interleaved with fewer micro-batches than ranks: m x slowest rank plus the bubble of
      the schedule's warm-up and cool-down, which does not grow with m once m >= 2p; it is found by
      running the schedule's own order on uniform stages for min(m, 2p) micro-batches (cached).
    From the ranks' sums alone: where the chunks of an interleaved schedule's rounds differ, the schedule waits more
    (:func:`rounds_excess`, which the cost model adds).
    """
    slow = max(rank_time)
    linear = linear_makespan(schedule, pp, v, m)
    if linear is not None:
        per_slowest, per_total = linear
        return per_slowest * slow + per_total * sum(rank_time)
    r = max(range(pp), key=lambda i: rank_time[i])
    t_f, t_w = rank_fwd[r] / v, rank_bwd_weight[r] / v  # per stage (chunk)
    t_b = rank_time[r] / v - t_f - t_w
    m0 = min(m, 2 * pp)
    # Stage-time ratios rounded to 0.1% share one cached simulation (the bubble moves by less than 0.5%
    # of the iteration even when m = p).
    unit = _uniform_makespan(schedule, pp, v, m0, round(t_f / slow, 3), round(t_b / slow, 3), round(t_w / slow, 3))
    return m * slow + (unit - m0) * slow


def linear_makespan(schedule: str, pp: int, v: int, m: int) -> tuple[float, float] | None:
    """(a, b) with makespan = a x slowest rank time + b x the ranks' summed time, where the closed form
    is that linear (gpipe, 1f1b; interleaved with m >= p); None where it needs the simulated bubble.
    The stage ILP builds its objective from the same coefficients."""
    if schedule in ("gpipe", "1f1b"):
        return m - 1, 1.0
    if schedule == "interleaved-1f1b" and m >= pp:
        return m, (pp - 1) / v / pp
    return None


@lru_cache(maxsize=4096)
def _uniform_makespan(schedule: str, pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    from .simulator import simulate_pipeline  # the simulator imports this module

    n = pp * v
    return simulate_pipeline(schedule, pp, v, m, [t_f] * n, [t_b] * n, [t_w] * n).makespan


# The rounds (rounds_excess) are simulated only up to this many tasks (2p and 4p micro-batches over the p·v stages,
# a forward and a backward each): 32 ranks of 4 chunks are 49,152 (~10 ms); beyond, the ranks' sums stand.
ROUNDS_SIM_MAX_TASKS = 50_000


def rounds_priced(schedule: str, pp: int, v: int, m: int) -> bool:
    """Does :func:`rounds_excess` price this pipeline's rounds: interleaved 1F1B of v > 1 chunks a rank, m >= pp
    micro-batches, its simulations within ROUNDS_SIM_MAX_TASKS?"""
    return schedule == "interleaved-1f1b" and v > 1 and pp > 1 and m >= pp and 12 * pp * pp * v <= ROUNDS_SIM_MAX_TASKS


def rounds_excess(pp: int, v: int, m: int, t_f: list[float], t_b: list[float], t_w: list[float],
                  slowest: float, closed: float) -> float:
    """What interleaved 1F1B (m >= pp, v > 1) takes beyond ``closed``, its closed form (closed_form_makespan) on
    these stage times, ``slowest`` the slowest rank's time per micro-batch; 0.0 where nothing.

    The closed form paces the steady state by the slowest rank's time, the sum of its chunks. The schedule runs
    its chunks in lock-step rounds (micro-batches go round the ranks chunk after chunk), so where the chunks of a
    round differ (80 layers over 32 chunks leave chunks of 2 and 3 layers; recomputation on some chunks of a round),
    a rank waits for the slower chunks of the ranks before it and the steady state runs slower than any rank's sum.
    So the schedule itself is run: the event simulation of min(m, 4p) micro-batches, and beyond 4p its steady state
    extended by the time per micro-batch of its last 2p (over two rounds of micro-batches: some patterns alternate).
    Against the event simulation of all m micro-batches, on 150 random patterns of 2- and 3-layer chunks (p 4-16,
    v 2-6, m 4p-16p): from 1.6% under to 3.4% over, median 0.0%, 17 over by more than 0.5% (the ranks' sums alone:
    15% under to the same 3.4% over, 16 over by more than 0.5%; on the demo's priced plans up to 26% under). Never
    below ``closed``: the search's bounds are bounds on it. Where no round's slowest chunk is slower than the rank's
    (every round's chunks alike), or the simulations would exceed ROUNDS_SIM_MAX_TASKS, 0.0."""
    if not rounds_priced("interleaved-1f1b", pp, v, m) or slowest <= 0:
        return 0.0
    totals = [f + b + w for f, b, w in zip(t_f, t_b, t_w, strict=True)]
    # Each round is at most as slow as its slowest chunk on every rank: the period is at most the sum of the rounds'
    # slowest chunks (the schedule's times only grow with its tasks'); where that is the slowest rank's, so is it.
    if sum(max(totals[j * pp:(j + 1) * pp]) for j in range(v)) <= slowest * (1 + 1e-9):
        return 0.0
    times = (tuple(t_f), tuple(t_b), tuple(t_w))
    if m <= 4 * pp:
        run = _interleaved_makespan(pp, v, m, *times)
    else:
        four = _interleaved_makespan(pp, v, 4 * pp, *times)
        run = four + (m - 4 * pp) * (four - _interleaved_makespan(pp, v, 2 * pp, *times)) / (2 * pp)
    return max(0.0, run - closed)


@lru_cache(maxsize=8192)
def _interleaved_makespan(pp: int, v: int, m: int, t_f: tuple[float, ...], t_b: tuple[float, ...],
                          t_w: tuple[float, ...]) -> float:
    """The event simulation's interleaved 1F1B makespan of m micro-batches on these stage times (rounds_excess)."""
    from .simulator import simulate_pipeline  # the simulator imports this module

    return simulate_pipeline("interleaved-1f1b", pp, v, m, list(t_f), list(t_b), list(t_w)).makespan

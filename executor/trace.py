"""What one rank allocates and sends, traced op by op (the dry run's instrument; dry_run.py).

:class:`RankTrace` is a TorchDispatchMode that sees every op the rank runs (under the dry run's fake
tensor mode no memory is really allocated, but every tensor still has its size):

- **memory**: each storage from its first appearance (an op's output) until it is freed (garbage
  collected, or shrunk with ``resize_``, as FSDP2 frees gathered weights); the running total and
  its peak, and at the peak a breakdown: weights (sharded fp32 masters and gathered bf16 copies),
  gradients (sharded, unsharded and accumulated), optimizer states, and everything else — saved
  activations and the temporaries of forward and backward (``activations``). Views share their
  storage and are counted once. torch's own ``MemTracker`` does the same but refuses a module called
  more than once per step, which gradient accumulation and pipelining always do.
- **FLOPs** of the local matmuls, convolutions and attention kernels (torch's flop-counter formulas).
- **communication**: the bytes of every collective and point-to-point op, by kind: all-reduce;
  all-gather (the gathered output; broadcasts count here, as ZeRO-1's owners broadcast their updated
  shards); reduce-scatter (the full input); all-to-all (the input); send/recv (sent plus received).
DTensor ops are left to DTensor, so the trace sees the local ops and collectives they lower to (and not
the global-shape ops of DTensor's sharding propagation, which it runs on fake tensors of the current fake
mode or of its own: both are skipped).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import wraps

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
MEMORY_KINDS = ("params", "grads", "optimizer", "activations")


def _nbytes(x) -> int:
    tensors, _ = tree_flatten(x)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _comm_table() -> dict:
    """Collective op -> (kind, bytes(args, result)): the logical size of the whole collective."""
    c10d, fn, fna = torch.ops.c10d, torch.ops._c10d_functional, torch.ops._c10d_functional_autograd
    table = {
        c10d.allreduce_.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
        c10d.broadcast_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
        c10d.allgather_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
        c10d._allgather_base_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
        c10d.reduce_scatter_.default: ("reduce_scatter", lambda a, r: _nbytes(a[1])),
        c10d._reduce_scatter_base_.default: ("reduce_scatter", lambda a, r: _nbytes(a[1])),
        c10d.alltoall_base_.default: ("all_to_all", lambda a, r: _nbytes(a[1])),
        c10d.alltoall_.default: ("all_to_all", lambda a, r: _nbytes(a[1])),
        c10d.send.default: ("send_recv", lambda a, r: _nbytes(a[0])),
        c10d.recv_.default: ("send_recv", lambda a, r: _nbytes(a[0])),
        fn.all_reduce.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
        fn.all_reduce_.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
        fn.all_gather_into_tensor.default: ("all_gather", lambda a, r: _nbytes(r)),
        fna.all_gather_into_tensor.default: ("all_gather", lambda a, r: _nbytes(r)),
        fn.reduce_scatter_tensor.default: ("reduce_scatter", lambda a, r: _nbytes(a[0])),
        fna.reduce_scatter_tensor.default: ("reduce_scatter", lambda a, r: _nbytes(a[0])),
        fn.all_to_all_single.default: ("all_to_all", lambda a, r: _nbytes(a[0])),
        fna.all_to_all_single.default: ("all_to_all", lambda a, r: _nbytes(a[0])),
        fn.broadcast.default: ("all_gather", lambda a, r: _nbytes(a[0])),
    }
    return table


class RankTrace(TorchDispatchMode):
    """Memory and communication of one rank. ``classify()`` returns, for the storages that are weights,
    gradients or optimizer states right now, their kind (keyed by ``storage_key``); it is asked at
    each new peak, so the breakdown is that of the peak moment."""

    def __init__(self, classify: Callable[[], dict[int, str]] | None = None):
        super().__init__()
        self.classify = classify or dict
        self.live: dict[int, int] = {}  # storage key -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self.total = 0
        self.peak = 0
        self.peak_breakdown: dict[str, int] = {}
        self._snapshot_total = 0
        self.comm: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self.flops = 0
        self._table = _comm_table()
        self._flop_formulas = _flop_formulas()
        self._orig_resize = None
        self._orig_propagate = None
        self._propagating = 0

    # ---- memory ----
    def _track(self, tensors: Iterable) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = storage_key(st)
            size = st.nbytes()
            old = self.live.get(key)
            if old is None:
                self._refs[key] = weakref.ref(st, lambda _, key=key: self._freed(key))
                self.live[key] = size
                self.total += size
            elif old != size:
                self.live[key] = size
                self.total += size - old
        self._update_peak()

    def _freed(self, key: int) -> None:
        size = self.live.pop(key, 0)
        self._refs.pop(key, None)
        self.total -= size

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = storage_key(st)
        if key in self.live:
            size = st.nbytes()
            self.total += size - self.live[key]
            self.live[key] = size
            self._update_peak()

    def _update_peak(self) -> None:
        if self.total <= self.peak:
            return
        self.peak = self.total
        if self.total > self._snapshot_total * 1.002:  # the breakdown: within 0.2% of the peak moment
            self._snapshot_total = self.total
            kinds = self.classify()
            breakdown = dict.fromkeys(MEMORY_KINDS, 0)
            for key, size in self.live.items():
                breakdown[kinds.get(key, "activations")] += size
            self.peak_breakdown = breakdown

    # ---- communication ----
    def _count(self, func, args, kwargs, result) -> None:
        entry = self._table.get(func)
        if entry is not None:
            kind, size = entry
            if _group_size(func, args) > 1:  # a group of one (a single data-parallel replica) moves nothing
                self.comm[kind] += size(args, result)
            return
        formula = self._flop_formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=result)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._propagating or active_fake_mode() is not self._fake_mode_on_entry:
            return result  # DTensor's sharding propagation on global shapes: not the rank's memory
        self._count(func, args, kwargs, result)
        self._track(tree_flatten(result)[0])
        return result

    def __enter__(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        trace = self
        propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        self._orig_propagate = propagate

        @wraps(propagate)
        def propagate_untraced(*args, **kwargs):
            trace._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                trace._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_untraced

        @wraps(orig)
        def resize_(st, size):
            out = orig(st, size)
            trace._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._fake_mode_on_entry = active_fake_mode()
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        torch.UntypedStorage.resize_ = self._orig_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        return super().__exit__(*exc)


def _group_size(func, args) -> int:
    """Ranks in the process group of a collective op (its group argument sits where torch's own fake
    collectives look for it)."""
    from torch.distributed._tools.fake_collectives import CollectiveOp

    try:
        return CollectiveOp.get_process_group(func, args).size()
    except (TypeError, IndexError, ValueError):
        return 2  # unknown: count it


def _flop_formulas() -> dict:
    """torch's FLOP formulas (matmuls, convolutions, attention), keyed by op packet, taking shapes; and for the
    attention kernel a trace on the CPU runs, ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (torch's
    counter has no formula for them: the trace missed every attention core, gpt-tiny's 4·s²·h per layer forward),
    the flash kernel's, whose arguments start alike (grad_out, then query, key, value)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    formulas = dict(FlopCounterMode(display=False).flop_registry)
    for cpu, flash in ((aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
                       (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                        aten._scaled_dot_product_flash_attention_backward)):
        if cpu not in formulas and flash in formulas:
            formulas[cpu] = formulas[flash]
    return formulas


def storage_key(st: torch.UntypedStorage) -> int:
    """A storage's identity (its StorageImpl), the same for every view and every Python wrapper of it."""
    return st._cdata


def tensor_storage_key(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return storage_key(t.untyped_storage())


def classify_rank(modules: list, optimizer) -> dict[int, str]:
    """Storage key -> "params" | "grads" | "optimizer" for what ``modules`` and ``optimizer`` hold now:
    their parameters and gradients, FSDP2's gathered (unsharded) weights and their gradients, and the
    optimizer's states (of a ZeRO-1 sharded optimizer too)."""
    kinds: dict[int, str] = {}

    def add(t, kind: str) -> None:
        if isinstance(t, torch.Tensor):
            kinds.setdefault(tensor_storage_key(t), kind)

    for module in modules:
        for p in module.parameters():
            add(p, "params")
            add(p.grad, "grads")
        for sub in module.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            state = get_state() if get_state is not None else None
            for group in getattr(state, "_fsdp_param_groups", []) if state is not None else []:
                for fp in group.fsdp_params:  # modules show the gathered weights while they run
                    add(fp.sharded_param, "params")
                    add(getattr(fp, "_sharded_param_data", None), "params")
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        add(unsharded, "params")
                        add(unsharded.grad, "grads")
                    add(fp.unsharded_accumulated_grad, "grads")
                    add(fp.sharded_param.grad, "grads")
                # buffers FSDP2 holds between a unit's collectives and its compute: an all-gather's output before its
                # copy-out (a prefetched unit; the last one kept for the stream's reuse) is weights, a reduce-scatter's
                # input (the unit's gradients, fp32) gradients: otherwise they would pass for activations
                pending = getattr(group, "_all_gather_result", None)
                add(getattr(pending, "all_gather_output", None), "params")
                ctx = getattr(group, "comm_ctx", None)
                add(getattr(getattr(getattr(ctx, "all_gather_state", None), "all_gather_result", None),
                            "all_gather_output", None), "params")
                for rs in getattr(ctx, "reduce_scatter_states", None) or []:
                    add(getattr(rs, "reduce_scatter_input", None), "grads")
    inner = getattr(optimizer, "inner", optimizer)
    for state in getattr(inner, "state", {}).values():
        for t in state.values():
            add(t, "optimizer")
    return kinds

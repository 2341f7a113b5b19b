"""Measured forward and backward time of one block on a real device (cpu or cuda).

Warm-up runs first, then the median of several runs; CUDA times come from CUDA events.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _outputs_for_backward(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop_ms(self, started) -> float:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            return started.elapsed_time(ev)
        return (time.perf_counter() - started) * 1e3


def time_block(run: Callable[[], Any], device: torch.device, warmup: int = 2,
               repeats: int = 5) -> tuple[float, float, int | None]:
    """Median forward ms, median backward ms and (cuda) peak bytes of ``run`` (returns outputs)."""
    clock = _Clock(device)
    fwd, bwd = [], []
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for i in range(warmup + repeats):
        t0 = clock.start()
        out = run()
        f = clock.stop_ms(t0)
        outs, grads = _outputs_for_backward(out)
        t1 = clock.start()
        if outs:
            torch.autograd.backward(outs, grads)
        b = clock.stop_ms(t1)
        del out, outs, grads
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    return statistics.median(fwd), statistics.median(bwd), peak

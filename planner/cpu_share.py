"""How fast one rank of a CPU cluster (the ``local`` cluster: ranks are processes on this machine) runs, by the
share of the machine's cores it gets.

A CPU "GPU" is not a device of its own: ``paraplan execute`` gives each of the n ranks on the machine
``cores // n`` threads (at least one), so one rank on two cores runs two threads and four ranks on two cores
time-slice, half a core each (identity.cores_per_rank). The cluster's figures (calibrate's GEMM rates, bandwidth
and per-kernel overhead; measured block times) were taken with some share of their own, recorded with them
(identity.recorded_cores_per_rank). So a rank's compute takes ``ref / now`` times its figures' seconds (threads
divide a kernel's work; time slices stretch everything), and its host-side framework seconds (one Python thread
each) ``min(1, ref) / min(1, now)``: only time slicing stretches them. Measured on this 2-core machine, llama-tiny,
global batch 16, mb2, before this rule: 1, 2 and 4 ranks predicted 0.396, 0.205 and 0.112 s per step, measured
0.238, 0.173 and 0.252 s (the planner's 4-rank pick the slowest of the three).
"""

from __future__ import annotations

import os

from paraplan.hardware_specs import ClusterSpec
from paraplan.hardware_specs.identity import cores_per_rank, recorded_cores_per_rank

# what a calibration or block-timing file written before the share was recorded measured with: calibrate's and
# validate's default of two processes
DEFAULT_RANKS = 2


class CpuShare:
    """Time multipliers for the ranks of a CPU cluster (all 1 on GPUs)."""

    def __init__(self, cluster: ClusterSpec):
        self.gpu = cluster.gpu
        self.cpu = cluster.gpu.is_cpu
        machine = cluster.machine if cluster.machine and cluster.machine.get("device") == "cpu" else None
        self.cores = int((machine or {}).get("cores") or os.cpu_count() or 1)
        # a shipped spec's figures: one rank on one core of its own
        self.ref = recorded_cores_per_rank(machine, DEFAULT_RANKS) if machine else 1.0

    def measured_ref(self, record: dict | None) -> float:
        """The share a measured block-time file's timings had (its ``machine`` identity), else the cluster's."""
        machine = (record or {}).get("machine")
        return recorded_cores_per_rank(machine, DEFAULT_RANKS) if isinstance(machine, dict) else self.ref

    def now(self, ranks_on_node: int) -> float:
        return cores_per_rank(ranks_on_node, cores=self.cores)

    def compute(self, ranks_on_node: int, ref: float | None = None) -> float:
        """Seconds of a rank's kernels per second of its figures' (``ref``: the figures' share; the cluster's)."""
        if not self.cpu:
            return 1.0
        return (ref if ref is not None else self.ref) / self.now(ranks_on_node)

    def rank_peak_flops(self, dtype: str, ranks_on_node: int) -> float:
        """A rank's dense peak FLOP/s: the GPU's, or on a CPU its share of the cores' (what MFU counts against)."""
        return self.gpu.peak_flops(dtype) / self.compute(ranks_on_node)

    def host(self, ranks_on_node: int) -> float:
        """Seconds of a rank's host-side framework work per second of the calibrated figure."""
        if not self.cpu:
            return 1.0
        return min(1.0, self.ref) / min(1.0, self.now(ranks_on_node))

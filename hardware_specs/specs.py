"""Hardware spec dataclasses: GPU, link and cluster (units in the field names, DESIGN.md).

The dataclasses are plain data plus the few derived facts the cost model asks for (peak FLOP/s of
a dtype, achievable fraction of it for a GEMM of a given size).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
FRAMEWORK_EVENTS = ("step", "micro_batch", "tp_module", "fsdp_unit", "pp_action")


class HardwareSpecError(ValueError):
    """A hardware spec that is missing, malformed or asks for something the hardware lacks."""


@dataclass(frozen=True)
class Efficiency:
    """How much of the datasheet a kernel really gets; defaults until `paraplan calibrate` measures.

    ``matmul`` maps a dtype (or ``default``) to points (GEMM FLOPs, fraction of dense peak), sorted
    by FLOPs and interpolated in log(FLOPs); ``memory_bound`` is the fraction of HBM bandwidth that
    elementwise and normalisation kernels reach; ``op_overhead_us`` is the fixed cost per kernel.
    """

    matmul: dict[str, tuple[tuple[float, float], ...]]
    memory_bound: float
    op_overhead_us: float
    source: str = "defaults"
    # Framework costs per event, in µs, that a host-bound run pays beyond its kernels (measured by
    # `paraplan calibrate` from executor runs): step (one training step's fixed work), micro_batch
    # (one micro-batch of the gradient-accumulation loop without a pipeline), tp_module (one call of a
    # tensor-parallel module, forward and backward), fsdp_unit (one FSDP unit's hooks and gathers per
    # micro-batch), pp_action (one forward or backward action of a pipeline schedule).
    framework_us: dict[str, float] = field(default_factory=dict)

    def framework(self, event: str) -> float:
        """Seconds per ``event`` (0 where nothing was measured: on GPUs the host runs ahead of the kernels)."""
        return self.framework_us.get(event, 0.0) * 1e-6

    def matmul_fraction(self, flops: float, dtype: str) -> float:
        points = self.matmul.get(dtype) or self.matmul["default"]
        if flops <= points[0][0]:
            return points[0][1]
        if flops >= points[-1][0]:
            return points[-1][1]
        xs = [p[0] for p in points]
        i = bisect.bisect_right(xs, flops)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        t = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_GiB: float
    hbm_GBps: float
    peak_tflops: dict[str, float | None]
    efficiency: Efficiency
    # streaming multiprocessors (NVIDIA; 0: not given): what a communication kernel running beside compute takes
    # its share of (planner/moe.py, the overlapped all-to-all)
    sm_count: int = 0

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; fp32 training uses TF32 tensor cores where they exist."""
        value = self.peak_tflops.get(dtype)
        if value is None:
            others = [d for d, v in self.peak_tflops.items() if v is not None and d != "default"]
            raise HardwareSpecError(f"{self.name} has no {dtype} support (peak_tflops.{dtype} is null)"
                                    + (f"; give --dtype {' or '.join(others)}" if others else ""))
        return value * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_GiB * 2**30

    @property
    def memory_bound_Bps(self) -> float:
        """Bytes per second a memory-bound kernel moves: HBM bandwidth at its memory-bound efficiency."""
        return self.hbm_GBps * 1e9 * self.efficiency.memory_bound

    @property
    def is_cpu(self) -> bool:
        """A host CPU standing in for GPUs (the ``local`` cluster): processes, gloo, fp32."""
        return self.name == "cpu"


@dataclass(frozen=True)
class LinkSpec:
    """One link's unidirectional bandwidth and latency (α–β model: t = latency + bytes / bandwidth)."""

    name: str
    kind: str
    bandwidth_GBps: float
    latency_us: float
    efficiency: float = 1.0  # fraction of bandwidth_GBps that collectives reach (NCCL bus bandwidth / link rate)

    @property
    def bandwidth_Bps(self) -> float:
        """Achieved bytes per second (the link rate times its collective efficiency)."""
        return self.bandwidth_GBps * 1e9 * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes of identical GPUs. ``intra_node`` is one GPU's bandwidth to its node peers;
    ``inter_node`` is one node's network bandwidth, all its NICs together (DESIGN.md). A one-node spec may leave
    the network out (``networked`` False: a workstation); it then refuses more nodes."""

    name: str
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    nics_per_node: int = 1
    cost_per_gpu_hour_usd: float | None = None
    source: str = field(default="", compare=False)
    # Calibration (identity.py): the identity of the machine a calibrated spec was measured on (None for a
    # shipped spec), whether it is this machine's, and notes on calibrations that were found but not used.
    machine: dict | None = field(default=None, compare=False)
    calibrated: bool = field(default=False, compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)
    networked: bool = True  # False: a one-node spec without inter_node (never priced: no rank leaves the node)

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> ClusterSpec:
        if nodes <= 0:
            raise HardwareSpecError(f"--nodes must be positive, got {nodes}")
        if nodes > 1 and not self.networked:
            raise HardwareSpecError(f"cluster {self.name} is one node without an inter_node link: give its network "
                                    f"(inter_node) to plan on {nodes} nodes")
        return replace(self, nodes=nodes)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def topology(self):
        """The cluster as a networkx graph; see :mod:`topology`."""
        from .topology import build_topology

        return build_topology(self)

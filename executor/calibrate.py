"""Measure the machine (or, under torchrun, the cluster) and write a hardware spec the planner uses.

What is measured, per rank with the threads a rank of ``paraplan execute`` gets:
- GEMM throughput over shapes and dtypes (torch.matmul): the peak is the best rate seen, the efficiency
  curve is each size's rate over that peak, by the GEMM's FLOPs (what the cost model interpolates); a
  size whose single call would take longer than ``GEMM_CALL_LIMIT_S`` is not measured (bf16 on CPUs
  without bf16 units runs ~40x slower than fp32: the curve's last point then stands for larger sizes);
- memory bandwidth of bandwidth-bound ops (large elementwise adds and copies);
- the fixed cost per kernel, from a tiny transformer layer whose forward and backward do next to no
  arithmetic: its time over the number of kernels the profiler counts for it (this folds in the
  framework's dispatch and Python overhead, which dominate small models on a CPU);
- collectives between ``ranks`` processes (gloo on CPU, nccl on GPU): all-reduce, all-gather,
  reduce-scatter and send/recv over message sizes, fitted jointly to the α-β model the cost model uses
  (ring all-reduce 2(n-1)/n·M/B + 2(n-1)·α, all-gather and reduce-scatter (n-1)/n·M/B + (n-1)·α,
  send/recv M/B + α) by least squares.
The result is a cluster spec (YAML, the shipped cluster's fields with the GPU and the intra-node link
inlined and measured, and the identity of the machine measured: hardware_specs/identity.py) written to
hardware_specs/measurements/<cluster>.yaml by default, which ``load_cluster`` then prefers over the
shipped file on this machine (and on machines of the same identity) only.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from paraplan.hardware_specs import SPEC_DIR, ClusterSpec, load_cluster, measurements_dir
from paraplan.hardware_specs.identity import describe, machine_identity, threads_per_rank
from paraplan.hardware_specs.loader import cluster_from_mapping

from .errors import ExecutionError

GEMM_SIZES_QUICK = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 512, 512),
                    (2048, 1024, 1024))
GEMM_SIZES = ((32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 128, 128), (256, 256, 256), (512, 256, 256),
              (512, 512, 512), (1024, 512, 512), (1024, 1024, 1024), (2048, 1024, 1024), (2048, 2048, 1024))
MESSAGE_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
GEMM_CALL_LIMIT_S = 0.1  # larger GEMMs of a dtype are skipped once one call would take longer than this


@dataclass
class Calibration:
    device: str
    threads: int
    ranks: int
    gemm: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # dtype -> (flops, flop/s)
    bandwidth_GBps: float = 0.0
    op_overhead_us: float = 0.0
    collectives: list[tuple[str, int, int, float]] = field(default_factory=list)  # (op, ranks, bytes, seconds)
    link_bandwidth_GBps: float | None = None
    link_latency_us: float | None = None
    framework_us: dict[str, float] = field(default_factory=dict)
    framework_runs: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    machine: dict = field(default_factory=dict)  # identity of the machine measured (hardware_specs/identity.py)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # what each part of the calibration cost
    load_before: float | None = None  # the 1-minute load average when it began (others' work skews timings)

    @property
    def busy_note(self) -> str | None:
        """A warning when the machine was busy with other work as the calibration began, else None."""
        return busy_note(self.load_before, 0, "as the calibration began: its timings may be off; run `paraplan "
                                              "calibrate` again on an idle machine")


def busy_note(load: float | None, own: int, consequence: str) -> str | None:
    """A warning when the 1-minute load average ``load``, less ``own`` processes of ours, exceeds 3/4 of the
    cores (others' work on a shared machine slows every timing), else None."""
    cores = os.cpu_count() or 1
    if load is None or load - own <= 0.75 * cores:
        return None
    mine = f", {own} of them ours" if own else ""
    return f"the machine was busy (load {load:.1f} on {cores} cores{mine}) {consequence}"


def _timeit(fn, sync, repeats: int, min_time: float = 0.02) -> float:
    """Median seconds of ``fn``, with enough inner repetitions that each sample lasts ``min_time``."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    return _timeit_fixed(fn, sync, repeats, max(1, int(min_time / once)))


def _timeit_fixed(fn, sync, repeats: int, inner: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` samples of ``inner`` calls (collectives: every rank
    makes the same calls, so the count cannot depend on a rank's own timing)."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _sync(device):
    import torch

    return (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)


def measure_gemm(device, dtypes: tuple[str, ...], sizes, repeats: int) -> dict[str, list[tuple[float, float]]]:
    import torch

    from paraplan.profiler import TORCH_DTYPES

    out: dict[str, list[tuple[float, float]]] = {}
    for name in dtypes:
        dt = TORCH_DTYPES[name]
        points: list[tuple[float, float]] = []
        for m, n, k in sorted(sizes, key=lambda mnk: mnk[0] * mnk[1] * mnk[2]):
            flops = 2.0 * m * n * k
            if points and flops / max(rate for _, rate in points) > GEMM_CALL_LIMIT_S:
                break  # too slow to time here; sizes are sorted, so every larger one would be too
            a = torch.randn(m, k, device=device).to(dt)  # (m, k)
            b = torch.randn(k, n, device=device).to(dt)  # (k, n)
            secs = _timeit(lambda a=a, b=b: torch.matmul(a, b), _sync(device), repeats)
            points.append((flops, flops / secs))
        out[name] = points
    return out


def measure_bandwidth(device, repeats: int, numel: int = 1 << 23) -> float:
    """GB/s of a large elementwise add (reads two tensors, writes one)."""
    import torch

    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
    z = torch.empty_like(x)
    secs = _timeit(lambda: torch.add(x, y, out=z), _sync(device), repeats)
    return 3 * numel * 4 / secs / 1e9


def measure_op_overhead(device, repeats: int) -> float:
    """Microseconds per kernel of a tiny transformer layer (forward + backward), framework included."""
    import torch

    from paraplan.models import build_model, load_model_spec
    from paraplan.profiler import profile_model

    spec = load_model_spec("gpt-tiny").replace(hidden_size=16, num_attention_heads=2, seq_length=4, vocab_size=16,
                                                num_layers=1)
    layer = profile_model(spec, "meta", micro_batch=1, dtype="fp32").layers[1]
    kernels = layer.fwd_ops.kernels + layer.bwd_ops.kernels
    block = build_model(spec, device).layers["0"]
    x = torch.randn(1, 4, 16, device=device, requires_grad=True)  # (b, s, h)

    def step():
        block(x).sum().backward()

    return _timeit(step, _sync(device), repeats, min_time=0.05) / kernels * 1e6


# ---- collectives, in separate processes ----

def _collective_worker(rank: int, world: int, port: int, sizes, repeats: int, backend: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        results = collectives_in_group(rank, world, sizes, repeats, device)
        if rank == 0:
            with open(out_path, "w") as f:
                yaml.safe_dump([list(r) for r in results], f)
    finally:
        dist.destroy_process_group()


def collectives_in_group(rank: int, world: int, sizes, repeats: int, device) -> list[tuple[str, int, int, float]]:
    """Time the collectives on the default process group (every rank calls this)."""
    import torch
    import torch.distributed as dist

    results = []
    for nbytes in sizes:
        # every rank must run the same number of calls: the repetitions follow from the size alone (a small
        # message costs its latency, ~0.1-2 ms on loopback: 20 calls per sample are plenty)
        inner = max(2, min(20, (1 << 22) // max(nbytes, 1)))
        n = max(world, nbytes // 4 // world * world)
        t = torch.ones(n, device=device)
        chunks = torch.empty(n // world, device=device)
        gathered = torch.empty(n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.1x
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        ops = {
            "all_reduce": lambda t=t: dist.all_reduce(t),
            "all_gather": lambda c=chunks, g=gathered, f=gather: f(g, c),
            "reduce_scatter": lambda c=chunks, t=t, f=scatter: f(c, t),
        }
        for op, fn in ops.items():
            try:
                dist.barrier()
                secs = _timeit_fixed(fn, _sync(device), repeats, inner)
            except RuntimeError:  # a backend without this collective
                continue
            results.append((op, world, n * 4, secs))
        # send/recv between ranks 0 and 1 (a ping-pong: half its round trip)
        dist.barrier()
        if rank < 2:
            peer = 1 - rank

            def pingpong(t=t, peer=peer):
                if rank == 0:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)

            secs = _timeit_fixed(pingpong, _sync(device), repeats, inner) / 2
            results.append(("send_recv", 2, n * 4, secs))
        dist.barrier()
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_collectives(ranks: int, sizes, repeats: int, backend: str) -> list[tuple[str, int, int, float]]:
    import torch.multiprocessing as mp

    out = tempfile.mktemp(suffix=".yaml", prefix="paraplan-calibrate-")
    mp.start_processes(_collective_worker, args=(ranks, _free_port(), sizes, repeats, backend, out), nprocs=ranks,
                       start_method="spawn")
    with open(out) as f:
        rows = yaml.safe_load(f) or []
    os.unlink(out)
    return [tuple(r) for r in rows]


def fit_link(points: list[tuple[str, int, int, float]]) -> tuple[float, float]:
    """Least-squares (bandwidth GB/s, latency µs) of the α-β model over every measured collective."""
    import numpy as np

    rows, ys = [], []
    for op, n, nbytes, secs in points:
        if op == "all_reduce":
            coeff_b, coeff_a = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
        elif op in ("all_gather", "reduce_scatter"):
            coeff_b, coeff_a = (n - 1) / n * nbytes, n - 1
        else:
            coeff_b, coeff_a = nbytes, 1
        # relative error: weight each point by 1/time so small messages (latency) count as much as large ones
        rows.append([coeff_b / secs, coeff_a / secs])
        ys.append(1.0)
    (inv_bw, alpha), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    if inv_bw <= 0:
        raise ExecutionError("collective timings do not fit latency + bytes / bandwidth (noisy machine?); "
                             "run calibrate again")
    return float(1.0 / inv_bw / 1e9), float(max(alpha, 0.0) * 1e6)


def calibrate(ranks: int = 2, quick: bool = False, device_type: str | None = None) -> Calibration:
    import torch

    t0 = time.perf_counter()
    if ranks < 1:
        raise ExecutionError("--ranks must be at least 1")
    cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    threads = threads_per_rank(ranks) if not cuda else torch.get_num_threads()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    repeats = 3 if quick else 5
    try:
        dtypes = ("fp32", "bf16") + (("fp16",) if cuda else ())
        cal = Calibration(device=device.type, threads=threads, ranks=ranks, machine=machine_identity(device.type))
        cal.gemm = measure_gemm(device, dtypes, GEMM_SIZES_QUICK if quick else GEMM_SIZES, repeats)
        cal.phase_seconds["gemm"] = time.perf_counter() - t0
        cal.bandwidth_GBps = measure_bandwidth(device, repeats)
        cal.op_overhead_us = measure_op_overhead(device, repeats)
        cal.phase_seconds["bandwidth_and_overhead"] = time.perf_counter() - t0 - cal.phase_seconds["gemm"]
    finally:
        torch.set_num_threads(old)
    if ranks > 1:
        t1 = time.perf_counter()
        sizes = MESSAGE_SIZES[::2] if quick else MESSAGE_SIZES
        cal.collectives = measure_collectives(ranks, sizes, repeats, "nccl" if cuda else "gloo")
        if cal.collectives:
            cal.link_bandwidth_GBps, cal.link_latency_us = fit_link(cal.collectives)
        cal.phase_seconds["collectives"] = time.perf_counter() - t1
    cal.seconds = time.perf_counter() - t0
    return cal


def calibrated_spec(base: ClusterSpec, cal: Calibration) -> dict:
    """The cluster spec mapping with the GPU and the intra-node link replaced by the measurements."""
    gpu = base.gpu
    peaks = dict(gpu.peak_tflops)
    curves = {}
    for dtype, points in cal.gemm.items():
        peak = max(rate for _, rate in points)
        peaks[dtype] = round(peak / 1e12, 6)
        curves[dtype] = [[float(f"{flops:.4g}"), round(rate / peak, 4)] for flops, rate in sorted(points)]
    if "fp32" in curves:
        curves["default"] = curves["fp32"]
    for d in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        peaks.setdefault(d, None)
    gpu_map = {"name": gpu.name, "memory_GiB": gpu.memory_GiB,
               "hbm_GBps": round(cal.bandwidth_GBps, 3),
               "peak_tflops": peaks, **({"sm_count": gpu.sm_count} if gpu.sm_count else {}),
               "efficiency": {"source": f"paraplan calibrate: {cal.device}, {cal.threads} thread(s) per rank, "
                                        f"{time.strftime('%Y-%m-%d')}",
                              "matmul": curves, "memory_bound": 1.0, "op_overhead_us": round(cal.op_overhead_us, 3)}}
    intra = dataclasses.asdict(base.intra_node)
    if cal.link_bandwidth_GBps is not None:
        intra.update(bandwidth_GBps=round(cal.link_bandwidth_GBps, 4), latency_us=round(cal.link_latency_us, 3),
                     efficiency=1.0, name=f"{base.intra_node.name} (calibrated)")
    out = {"name": base.name, "gpu": gpu_map, "nodes": base.nodes, "gpus_per_node": base.gpus_per_node,
           "intra_node": intra, "nics_per_node": base.nics_per_node,
           "machine": {**(cal.machine or machine_identity(cal.device)),
                       # the GEMMs, bandwidth and kernel overhead were timed in one process alone (cpu_share.py)
                       **({"threads": cal.threads, "ranks": 1} if cal.device == "cpu" else {})}}
    if base.networked:  # a one-node spec without a network keeps none (ClusterSpec.networked)
        out["inter_node"] = dataclasses.asdict(base.inter_node)
    if base.cost_per_gpu_hour_usd is not None:
        out["cost_per_gpu_hour_usd"] = base.cost_per_gpu_hour_usd
    cluster_from_mapping(out, "calibrated spec")  # it must load back
    return out


def write_spec(mapping: dict, path: str | None, cal: Calibration) -> Path:
    target = Path(path) if path else measurements_dir() / f"{mapping['name']}.yaml"
    if not path:
        target.parent.mkdir(parents=True, exist_ok=True)  # the default folder: created on first use
    header = (f"# Written by `paraplan calibrate` on {time.strftime('%Y-%m-%d %H:%M')}: {cal.device}, "
              f"{cal.threads} thread(s) per rank, {cal.ranks} ranks for the collectives.\n"
              f"# Measured: GEMM rates (peak = best rate seen), memory bandwidth, per-kernel overhead,\n"
              f"# and the intra-node link fitted to {len(cal.collectives)} collective timings.\n"
              f"# Machine: {describe(mapping['machine'])}; used automatically only on machines of this identity.\n"
              + (f"# Note: {cal.busy_note}.\n" if cal.busy_note else ""))
    write_mapping(mapping, target, header)
    return target


def write_mapping(mapping: dict, target: Path, header: str) -> None:
    """Write a cluster spec mapping as YAML (after checking it loads back)."""
    if not target.parent.is_dir():
        raise ExecutionError(f"--out {target}: folder {target.parent} does not exist")
    cluster_from_mapping(mapping, str(target))
    target.write_text(header + yaml.dump(mapping, Dumper=_PlainDumper, sort_keys=False))


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases: a spec file people read and edit."""

    def ignore_aliases(self, data) -> bool:
        return True


def shipped_cluster(cluster: str) -> ClusterSpec:
    """The cluster as shipped (not an earlier calibration of it), the base a new calibration replaces."""
    shipped = SPEC_DIR / "clusters" / f"{cluster}.yaml"
    return load_cluster(str(shipped) if shipped.exists() else cluster)


def calibrate_cluster(cluster: str, ranks: int, quick: bool, out: str | None) -> tuple[Path | None, Calibration, dict]:
    """Measure, build the spec and (on rank 0) write it. Under torchrun every rank measures the
    collectives over the whole job (the cluster's links); alone, ``ranks`` local processes are spawned."""
    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    base = shipped_cluster(cluster)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cal = calibrate_under_torchrun(quick)
        if int(os.environ.get("RANK", "0")) != 0:
            return None, cal, {}
    else:
        check_ranks(base, ranks)
        cal = calibrate(ranks=ranks, quick=quick, device_type=_device_of(base))
    mapping = calibrated_spec(base, cal)
    if not quick and ranks > 1 and cal.device == "cpu":
        # the framework's per-event host costs, from executor runs of a calibration model
        from .framework_fit import fit_framework

        t1 = time.perf_counter()
        cal.framework_us, cal.framework_runs = fit_framework(mapping, ranks, seconds=cal.phase_seconds)
        mapping["gpu"]["efficiency"]["framework_us"] = cal.framework_us
        cal.phase_seconds["framework"] = time.perf_counter() - t1
        cal.seconds = time.perf_counter() - started
    cal.load_before = load
    return write_spec(mapping, out, cal), cal, mapping


def check_ranks(cluster: ClusterSpec | str, ranks: int) -> None:
    """Refuse more local processes than the cluster's node has slots (a CPU stand-in) or this machine GPUs: they
    would measure nothing the cluster runs, and hundreds of processes swamp the machine."""
    base = shipped_cluster(cluster) if isinstance(cluster, str) else cluster
    device = _device_of(base)
    if device == "cpu":
        slots, what = base.gpus_per_node, "process slots"
    else:
        import torch

        slots, what = (torch.cuda.device_count() if torch.cuda.is_available() else 0), "GPUs on this machine"
    if ranks > slots:
        raise ExecutionError(f"--ranks {ranks}: cluster {base.name} has {slots} {what} per node; give --ranks "
                             f"{slots} or fewer")


def _device_of(cluster: ClusterSpec) -> str:
    """What measures the cluster's "GPUs" here: the CPU for the CPU stand-in (also on a machine with GPUs),
    CUDA for a GPU cluster (refused where there is none: CPU timings are no GPU's)."""
    if cluster.gpu.is_cpu:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ExecutionError(f"cluster {cluster.name} has {cluster.gpu.name} GPUs and this machine has no CUDA GPU: "
                             "calibrate it on the cluster (under torchrun), or calibrate `local`")
    return "cuda"


def calibrate_under_torchrun(quick: bool) -> Calibration:
    """Under torchrun: compute figures on this rank, collectives across the job (nccl on GPUs, gloo else)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        cal = calibrate(ranks=1, quick=quick, device_type="cuda" if cuda else "cpu")
        cal.ranks = world
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        sizes = MESSAGE_SIZES[::2] if quick else MESSAGE_SIZES
        cal.collectives = collectives_in_group(rank, world, sizes, 3 if quick else 5, device)
        cal.link_bandwidth_GBps, cal.link_latency_us = fit_link(cal.collectives)
    finally:
        dist.destroy_process_group()
    return cal

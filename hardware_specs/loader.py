"""Strict loading of GPU, link and cluster specs from the YAML files beside this module.

A spec is named (``a100-80gb``), given as a path to a YAML file, or (inside a cluster) inlined as a
mapping. Unknown keys, missing keys, wrong types and non-positive numbers are refused with the file
and the key named (calculon's systems/*.json and llm-analysis's gpu_configs are the model here).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from .datafile import read_data_file
from .identity import check_identity
from .identity import mismatch as identity_mismatch
from .specs import DTYPES, FRAMEWORK_EVENTS, ClusterSpec, Efficiency, GPUSpec, HardwareSpecError, LinkSpec

SPEC_DIR = Path(__file__).resolve().parent
KINDS = {"gpu": "gpus", "link": "links", "cluster": "clusters"}
MEASUREMENTS_DIR = SPEC_DIR / "measurements"


def measurements_dir() -> Path:
    """Where calibrations and measured block times live: ``PARAPLAN_MEASUREMENTS`` if set (tests keep
    theirs apart), else hardware_specs/measurements/ beside the shipped specs."""
    return Path(os.environ.get("PARAPLAN_MEASUREMENTS") or MEASUREMENTS_DIR)

DEFAULT_EFFICIENCY = Efficiency(
    matmul={"default": ((1e6, 0.02), (1e8, 0.15), (1e9, 0.40), (1e10, 0.62), (1e11, 0.72), (1e12, 0.75))},
    memory_bound=0.8, op_overhead_us=5.0, source="generic defaults (no efficiency data in the spec)")


def names(kind: str) -> list[str]:
    """The spec names of one kind (``gpu``, ``link``, ``cluster``) shipped with paraplan."""
    return sorted(p.stem for p in (SPEC_DIR / KINDS[kind]).glob("*.yaml"))


def _number(where: str, key: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HardwareSpecError(f"{where}: '{key}' must be a number, got {value!r}")
    if not math.isfinite(value):  # YAML's .nan and .inf
        raise HardwareSpecError(f"{where}: '{key}' must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise HardwareSpecError(f"{where}: '{key}' must be {'zero or more' if allow_zero else 'positive'}, got {value}")
    return float(value)


def _integer(where: str, key: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HardwareSpecError(f"{where}: '{key}' must be a positive whole number, got {value!r}")
    if value > limit:
        raise HardwareSpecError(f"{where}: '{key}' = {value} is absurdly large (limit {limit})")
    return value


def _check_keys(where: str, data: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(data, dict):
        raise HardwareSpecError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    allowed = required | optional
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise HardwareSpecError(f"{where}: unknown key '{key}'{hint}")
    for key in sorted(required):
        if key not in data:
            raise HardwareSpecError(f"{where}: missing key '{key}'")
    return data


def _resolve(kind: str, ref: str) -> tuple[Path, Any]:
    """A name or a path -> (file, parsed data)."""
    if os.path.exists(ref):
        path = Path(ref)
    else:
        path = SPEC_DIR / KINDS[kind] / f"{ref}.yaml"
        if not path.exists():
            close = difflib.get_close_matches(ref, names(kind), n=3, cutoff=0.4)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names(kind))}"
            raise HardwareSpecError(f"unknown {kind} spec {ref!r}{hint}")
    return path, read_data_file(str(path), f"{kind} spec", HardwareSpecError)


def parse_efficiency(where: str, data: Any) -> Efficiency:
    data = _check_keys(where, data, {"matmul", "memory_bound", "op_overhead_us"}, {"source", "framework_us"})
    curves = data["matmul"]
    if not isinstance(curves, dict) or "default" not in curves:
        raise HardwareSpecError(f"{where}: 'matmul' must map dtypes to curves and include 'default'")
    parsed: dict[str, tuple[tuple[float, float], ...]] = {}
    for dtype, points in curves.items():
        if dtype != "default" and dtype not in DTYPES:
            raise HardwareSpecError(f"{where}: matmul curve for unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
        if not isinstance(points, list) or not points:
            raise HardwareSpecError(f"{where}: matmul.{dtype} must be a list of [flops, fraction] points")
        pts = []
        for p in points:
            if not (isinstance(p, list | tuple) and len(p) == 2):
                raise HardwareSpecError(f"{where}: matmul.{dtype} point {p!r} is not [flops, fraction]")
            flops = _number(where, f"matmul.{dtype} flops", p[0])
            frac = _number(where, f"matmul.{dtype} fraction", p[1])
            if frac > 1:
                raise HardwareSpecError(f"{where}: matmul.{dtype} fraction {frac} exceeds 1 (the peak)")
            pts.append((flops, frac))
        pts.sort()
        parsed[dtype] = tuple(pts)
    mb = _number(where, "memory_bound", data["memory_bound"])
    if mb > 1:
        raise HardwareSpecError(f"{where}: 'memory_bound' {mb} exceeds 1 (the peak bandwidth)")
    framework = _check_keys(f"{where}: framework_us", data.get("framework_us", {}), set(), set(FRAMEWORK_EVENTS))
    return Efficiency(matmul=parsed, memory_bound=mb,
                      op_overhead_us=_number(where, "op_overhead_us", data["op_overhead_us"], allow_zero=True),
                      source=str(data.get("source", "unspecified")),
                      framework_us={k: _number(where, f"framework_us.{k}", v, allow_zero=True)
                                    for k, v in framework.items()})


def gpu_from_mapping(data: Any, where: str) -> GPUSpec:
    data = _check_keys(where, data, {"name", "memory_GiB", "hbm_GBps", "peak_tflops"}, {"efficiency", "sm_count"})
    peaks = _check_keys(f"{where}: peak_tflops", data["peak_tflops"], set(DTYPES))
    peak = {d: None if peaks[d] is None else _number(where, f"peak_tflops.{d}", peaks[d]) for d in DTYPES}
    if all(v is None for v in peak.values()):
        raise HardwareSpecError(f"{where}: peak_tflops gives no dtype a number")
    eff = parse_efficiency(f"{where}: efficiency", data["efficiency"]) if "efficiency" in data else DEFAULT_EFFICIENCY
    sms = data.get("sm_count", 0)
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 0:
        raise HardwareSpecError(f"{where}: 'sm_count' must be a whole number >= 0, got {sms!r}")
    return GPUSpec(name=str(data["name"]), memory_GiB=_number(where, "memory_GiB", data["memory_GiB"]),
                   hbm_GBps=_number(where, "hbm_GBps", data["hbm_GBps"]), peak_tflops=peak, efficiency=eff,
                   sm_count=sms)


def link_from_mapping(data: Any, where: str, default_name: str) -> LinkSpec:
    data = _check_keys(where, data, {"bandwidth_GBps", "latency_us"}, {"name", "kind", "efficiency"})
    eff = _number(where, "efficiency", data.get("efficiency", 1.0))
    if eff > 1:
        raise HardwareSpecError(f"{where}: 'efficiency' {eff} exceeds 1")
    return LinkSpec(name=str(data.get("name", default_name)), kind=str(data.get("kind", "custom")),
                    bandwidth_GBps=_number(where, "bandwidth_GBps", data["bandwidth_GBps"]),
                    latency_us=_number(where, "latency_us", data["latency_us"], allow_zero=True), efficiency=eff)


@lru_cache(maxsize=64)
def load_gpu(ref: str) -> GPUSpec:
    path, data = _resolve("gpu", ref)
    return gpu_from_mapping(data, str(path))


@lru_cache(maxsize=64)
def load_link(ref: str) -> LinkSpec:
    path, data = _resolve("link", ref)
    return link_from_mapping(data, str(path), default_name=path.stem)


def _gpu_field(where: str, value: Any) -> GPUSpec:
    if isinstance(value, str):
        return load_gpu(value)
    return gpu_from_mapping(value, f"{where}: gpu")


def _link_field(where: str, key: str, value: Any) -> LinkSpec:
    if isinstance(value, str):
        return load_link(value)
    return link_from_mapping(value, f"{where}: {key}", default_name=key)


def cluster_from_mapping(data: Any, where: str) -> ClusterSpec:
    data = _check_keys(where, data, {"name", "gpu", "nodes", "gpus_per_node", "intra_node"},
                       {"nics_per_node", "cost_per_gpu_hour_usd", "machine", "inter_node"})
    nics = _integer(where, "nics_per_node", data.get("nics_per_node", 1), 64)
    networked = "inter_node" in data
    if not networked and _integer(where, "nodes", data["nodes"], 1 << 20) != 1:
        raise HardwareSpecError(f"{where}: missing key 'inter_node' (the network between its {data['nodes']} nodes; "
                                "only a one-node cluster may leave it out)")
    # one node without a network: no rank ever sends across nodes, so the link is never priced (a stand-in)
    inter = _link_field(where, "inter_node", data["inter_node"]) if networked else \
        LinkSpec(name="none", kind="none", bandwidth_GBps=1.0, latency_us=0.0)
    if networked and isinstance(data["inter_node"], str):  # a named link: one port, nics_per_node a node
        inter = LinkSpec(name=f"{nics}x {inter.name}", kind=inter.kind, bandwidth_GBps=inter.bandwidth_GBps * nics,
                         latency_us=inter.latency_us, efficiency=inter.efficiency)
    cost = data.get("cost_per_gpu_hour_usd")
    machine = check_identity(where, data["machine"]) if "machine" in data else None
    why = identity_mismatch(machine) if machine is not None else None
    notes = (f"{where} was calibrated on another machine ({why}); its figures are used as given",) if why else ()
    return ClusterSpec(
        name=str(data["name"]), gpu=_gpu_field(where, data["gpu"]),
        nodes=_integer(where, "nodes", data["nodes"], 1 << 20),
        gpus_per_node=_integer(where, "gpus_per_node", data["gpus_per_node"], 1024),
        intra_node=_link_field(where, "intra_node", data["intra_node"]), inter_node=inter, nics_per_node=nics,
        cost_per_gpu_hour_usd=None if cost is None else _number(where, "cost_per_gpu_hour_usd", cost),
        source=where, machine=machine, calibrated=machine is not None and why is None, notes=notes, networked=networked)


def load_cluster(ref: str, nodes: int | None = None) -> ClusterSpec:
    """A cluster by name or path; a calibrated copy in measurements/ takes precedence over the shipped one
    when it was measured on this machine (identity.py), and is otherwise ignored with a note.

    ``nodes`` overrides the node count (the CLI's ``--nodes``).
    """
    notes: list[str] = []
    calibrated = calibration_file(ref)
    if calibrated is not None:
        data = read_data_file(str(calibrated), "cluster spec", HardwareSpecError)
        why = identity_mismatch(data.get("machine") if isinstance(data, dict) else None)
        if why is None:
            ref = str(calibrated)
        else:
            notes.append(f"calibration {calibrated} not used: {why}")
    path, data = _resolve("cluster", ref)
    cluster = cluster_from_mapping(data, str(path))
    if notes:
        cluster = dataclasses.replace(cluster, notes=(*notes, *cluster.notes))
    return cluster.with_nodes(nodes) if nodes is not None else cluster


def calibration_file(ref: str) -> Path | None:
    """The calibrated spec ``paraplan calibrate`` wrote for cluster name ``ref`` (whoever's machine it
    measured), or None; a path given as ``ref`` is used as given and never replaced."""
    path = measurements_dir() / f"{ref}.yaml"
    return path if not os.path.exists(ref) and os.sep not in ref and path.exists() else None


def cluster_mapping(cluster: ClusterSpec) -> dict:
    """A loaded cluster as the mapping the loader reads (GPU and links inlined): for writing specs back."""
    gpu = cluster.gpu
    eff = gpu.efficiency
    out = {
        "name": cluster.name,
        "gpu": {"name": gpu.name, "memory_GiB": gpu.memory_GiB, "hbm_GBps": gpu.hbm_GBps,
                "peak_tflops": dict(gpu.peak_tflops), **({"sm_count": gpu.sm_count} if gpu.sm_count else {}),
                "efficiency": {"source": eff.source,
                               "matmul": {d: [list(p) for p in pts] for d, pts in eff.matmul.items()},
                               "memory_bound": eff.memory_bound, "op_overhead_us": eff.op_overhead_us,
                               **({"framework_us": dict(eff.framework_us)} if eff.framework_us else {})}},
        "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "intra_node": dataclasses.asdict(cluster.intra_node), "nics_per_node": cluster.nics_per_node,
    }
    if cluster.networked:
        out["inter_node"] = dataclasses.asdict(cluster.inter_node)
    if cluster.cost_per_gpu_hour_usd is not None:
        out["cost_per_gpu_hour_usd"] = cluster.cost_per_gpu_hour_usd
    if cluster.machine is not None:
        out["machine"] = dict(cluster.machine)
    return out

"""Which machine measured something: the identity a calibration or a block-timing file records.

Timings belong to the machine that took them. `paraplan calibrate` (a cluster spec with measured
figures) and measured block times (profiler/measurements.py) record the identity of the machine that
measured them, and are used automatically only where this machine has the same identity; anything
else is ignored with a note saying why (a file named by path on the command line is the user's
choice and is used as given).

What is compared depends on the device that was measured:
- ``cpu``: the CPU model, the number of cores and the torch version (a CPU's timings depend on all
  three; the host name does not matter, so identical machines share a calibration);
- ``cuda``: the GPU model, the number of GPUs and the torch version (a planning host without GPUs,
  such as a login node, cannot match: name the calibrated spec file instead).

Nothing here imports torch: the torch version comes from the installed package's metadata, the GPU
model from ``nvidia-smi`` (or from torch when it is already imported).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

KEYS = {"cpu": ("cpu", "cores", "torch"), "cuda": ("gpu", "gpus", "torch")}
# threads, ranks: how a CPU measured (each process's threads, processes sharing the cores): not compared, but a
# rank's speed depends on them (cores_per_rank)
FIELDS = ("device", "cpu", "cores", "gpu", "gpus", "torch", "threads", "ranks")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what the platform module reports)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                    return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def torch_version() -> str:
    import importlib.metadata  # imported here: 25 ms that planning from a shipped spec need not pay

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def gpus() -> tuple[str, ...]:
    """Model names of this machine's CUDA GPUs (empty when there are none or none can be seen)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
            if p.returncode == 0:
                return tuple(line.strip() for line in p.stdout.splitlines() if line.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return ()


def machine_identity(device: str = "cpu") -> dict[str, Any]:
    """This machine's identity for timings measured on ``device`` (``cpu`` or ``cuda``)."""
    out: dict[str, Any] = {"device": device, "cpu": cpu_model(), "cores": os.cpu_count() or 1,
                           "torch": torch_version()}
    if device == "cuda":
        names = gpus()
        out.update(gpu=names[0] if names else None, gpus=len(names))
    return out


def threads_per_rank(ranks: int, cores: int | None = None) -> int:
    """The CPU threads paraplan gives each of ``ranks`` processes sharing this machine (execute, calibrate, block
    timing): the cores dealt out, at least one each."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, ranks))


def cores_per_rank(ranks: int, threads: int | None = None, cores: int | None = None) -> float:
    """The cores one of ``ranks`` processes running ``threads`` threads each (default: threads_per_rank) keeps
    busy on a machine of ``cores`` cores: its threads, or its time slice where the processes' threads outnumber
    the cores (four one-thread ranks on two cores: half a core each)."""
    cores = cores or os.cpu_count() or 1
    threads = threads if threads is not None else threads_per_rank(ranks, cores)
    return min(float(threads), cores / max(1, ranks))


def recorded_cores_per_rank(identity: dict[str, Any], default_ranks: int) -> float:
    """The cores per process a CPU's recorded timings had (:func:`cores_per_rank` of the identity's threads and
    ranks); files written before those were recorded: ``default_ranks`` processes with threads_per_rank each."""
    cores = identity.get("cores") or os.cpu_count() or 1
    ranks = identity.get("ranks") or default_ranks
    return cores_per_rank(ranks, identity.get("threads") or threads_per_rank(default_ranks, cores), cores)


def describe(identity: dict[str, Any]) -> str:
    """A short human description: ``AMD EPYC, 2 cores, torch 2.13.0`` or ``NVIDIA H100 80GB HBM3 x8, torch ...``."""
    if identity.get("device") == "cuda":
        return f"{identity.get('gpu')} x{identity.get('gpus')}, torch {identity.get('torch')}"
    return f"{identity.get('cpu')}, {identity.get('cores')} cores, torch {identity.get('torch')}"


def mismatch(recorded: Any) -> str | None:
    """None when timings recorded with identity ``recorded`` apply to this machine, else why not."""
    if not isinstance(recorded, dict) or recorded.get("device") not in KEYS:
        return "it records no machine identity (written by an older paraplan)"
    here = machine_identity(recorded["device"])
    differ = [k for k in KEYS[recorded["device"]] if recorded.get(k) != here[k]]
    if not differ:
        return None
    return f"measured on {describe(recorded)}, this machine is {describe(here)}"


def check_identity(where: str, value: Any) -> dict[str, Any]:
    """A recorded identity as read from a file: a mapping of the known fields to plain values."""
    from .specs import HardwareSpecError

    if not isinstance(value, dict):
        raise HardwareSpecError(f"{where}: 'machine' must be a mapping ({', '.join(FIELDS)})")
    for key, v in value.items():
        if key not in FIELDS:
            raise HardwareSpecError(f"{where}: machine: unknown key '{key}' (known: {', '.join(FIELDS)})")
        if v is not None and not isinstance(v, str | int) or isinstance(v, bool):
            raise HardwareSpecError(f"{where}: machine.{key} must be text or a whole number, got {v!r}")
    if value.get("device") not in KEYS:
        raise HardwareSpecError(f"{where}: machine.device must be one of {', '.join(KEYS)}")
    return dict(value)


def is_this_machine(cluster) -> bool:
    """The cluster's GPUs are this host's CPU processes (the ``local`` cluster): its figures can be measured here."""
    return cluster.gpu.is_cpu


def calibration_status(cluster, validating: bool = False) -> tuple[bool, list[str]]:
    """(calibrated, notes) for predictions on ``cluster`` (a ClusterSpec): notes on calibrations found but not
    used, and the uncalibrated label where it matters (this machine's cluster, or whatever `validate` runs)."""
    notes = list(cluster.notes)
    if not cluster.calibrated and (validating or is_this_machine(cluster)):
        notes.append(f"uncalibrated: no calibration of this machine for cluster '{cluster.name}'; predictions use the "
                     "spec's figures, not measurements (`paraplan calibrate` measures this machine)")
    return cluster.calibrated, notes


def markdown_notes(notes: list[str]) -> list[str]:
    """Report lines for :func:`calibration_status`'s notes: the uncalibrated label in bold, the rest as notes."""
    return [f"- **{n}**" if n.startswith("uncalibrated") else f"- note: {n}" for n in notes]

"""Measured block times saved under hardware_specs/measurements/, for the cost model to use.

A measurement file records, for one model at one micro-batch, sequence length and dtype on one
device, each block's measured forward and backward milliseconds, and the identity of the machine
that measured them (hardware_specs/identity.py). The cost model looks a file up by (GPU spec name,
model, micro-batch, sequence length, dtype) and uses its times instead of the peak-based estimate
only when the file was measured on this machine; files from other machines (or from before
identities were recorded) are skipped with a note. See :func:`find_measurement`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from paraplan.hardware_specs import measurements_dir
from paraplan.hardware_specs.identity import machine_identity, mismatch

from .errors import ProfileError
from .records import ModelProfile

FORMAT = "paraplan-block-times/1"


def measurement_record(profile: ModelProfile, gpu: str, ranks: int = 1) -> dict[str, Any]:
    """The file's contents; ``ranks``: how many processes were timing blocks at once on this machine (on a CPU,
    with the threads each had, what a rank's share of the cores was: planner/cpu_share.py)."""
    if profile.device == "meta":
        raise ProfileError("--save-measurements needs measured times: profile with --device cpu or cuda")
    machine = machine_identity("cuda" if profile.device == "cuda" else "cpu")
    if profile.device != "cuda":
        import torch  # imported already: the profile was measured with it

        machine.update(threads=torch.get_num_threads(), ranks=ranks)
    return {
        "format": FORMAT, "gpu": gpu, "device_name": profile.device_name, "model": profile.model,
        "spec": profile.spec, "micro_batch": profile.micro_batch, "seq_length": profile.seq_length,
        "dtype": profile.dtype, "machine": machine,
        "layers": [{"name": x.name, "kind": x.kind, "signature": x.signature, "fwd_ms": x.fwd_ms, "bwd_ms": x.bwd_ms,
                    "fwd_flops": x.fwd_flops} for x in profile.layers],
    }


def save_measurements(profile: ModelProfile, gpu: str, name: str | None = None,
                      directory: Path | None = None, ranks: int = 1) -> Path:
    """Write the profile's measured times as ``<directory>/<name>.json`` (default name from the key); ``ranks``:
    as measurement_record's."""
    directory = directory or measurements_dir()
    record = measurement_record(profile, gpu, ranks)
    name = name or f"{gpu}--{profile.model}--mb{profile.micro_batch}--s{profile.seq_length}--{profile.dtype}"
    if os.sep in name or name.startswith("."):
        raise ProfileError(f"--save-measurements: {name!r} must be a plain file name")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (name if name.endswith(".json") else f"{name}.json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def find_measurement(gpu: str, spec: dict[str, Any], micro_batch: int, seq_length: int | None, dtype: str,
                     directory: Path | None = None, notes: list[str] | None = None) -> dict[str, Any] | None:
    """The saved measurement for exactly this workload on this GPU spec, taken on this machine, or None.
    A matching file measured elsewhere is skipped, and why is appended to ``notes``."""
    directory = directory or measurements_dir()
    if not directory.exists():
        return None
    for path in sorted(directory.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (isinstance(rec, dict) and rec.get("format") == FORMAT and rec.get("gpu") == gpu
                and rec.get("spec") == spec and rec.get("micro_batch") == micro_batch
                and rec.get("seq_length") == seq_length and rec.get("dtype") == dtype):
            why = mismatch(rec.get("machine"))
            if why is None:
                return rec
            if notes is not None:
                notes.append(f"measured block times {path} not used: {why}")
    return None

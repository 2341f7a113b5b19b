"""On-disk cache of meta-device profiles (they are deterministic and cost ~1 s of torch start-up each).

Key: the spec, micro-batch, sequence length, dtype, TP degrees, torch and paraplan versions and the
profiler's own source; value: the ModelProfile as JSON. ``PARAPLAN_CACHE`` sets the folder
(default ``~/.cache/paraplan``); ``PARAPLAN_CACHE=off`` disables it. A broken or unwritable cache is
ignored, never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .records import Collective, LayerProfile, ModelProfile, OpMix, TPView

_FORMAT = 14  # 5: block signatures hashed with sha1 (stable across processes); 6: MLA's up-projection; 7: the
# experts' weights unbound once (their backward's traffic linear in the experts, not quadratic); 8: MLA's
# down-projections and latent norms replicated under tensor parallelism (models.transformer_tp_plan); 9: the
# activations those replicated modules produce (LayerProfile.activation_bytes_whole); 10: the weight-carrying ops'
# outputs (LayerProfile.weight_output_bytes); 11: RMSNorm keeps what the GPU's fused kernel keeps (models/norms.py);
# 12: grouped-query attention keeps K and V unrepeated (SDPA's enable_gqa); 13: no core output recorded (the flash
# kernel's is the output projection's input, priced with it: memory.layer_activation_bytes); 14: each block's
# largest parameter tensors (LayerProfile.largest_split_param and the two beside it)


def cache_folder() -> Path | None:
    """The folder of the on-disk caches (PARAPLAN_CACHE), or None where they are off."""
    where = os.environ.get("PARAPLAN_CACHE", "")
    if where.lower() in ("off", "0", "false", "no"):
        return None
    return Path(where) if where else Path.home() / ".cache" / "paraplan" / "profiles"


@functools.cache
def _torch_version() -> str:
    """torch's version from its package's version.py, read as text: importing torch to read it would cost a second,
    importlib.metadata 20 ms of `plan`'s start (its fallback, then torch itself, where the file is not there)."""
    try:
        spec = importlib.util.find_spec("torch")
        text = Path(spec.origin).with_name("version.py").read_text() if spec and spec.origin else ""
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    except (OSError, ValueError, ImportError):
        pass
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return torch.__version__


@functools.cache
def _source_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    models = Path(__file__).resolve().parent.parent / "models"
    for f in sorted(models.glob("*.py")) if models.is_dir() else []:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(spec: dict[str, Any], micro_batch: int, seq_length: int | None, dtype: str,
              tp_degrees: list[int]) -> str:
    from paraplan import __version__

    payload = json.dumps([_FORMAT, spec, micro_batch, seq_length, dtype, tp_degrees, _torch_version(), __version__,
                          _source_digest()], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def load(key: str) -> ModelProfile | None:
    folder = cache_folder()
    if folder is None:
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text())
        return _profile_from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, profile: ModelProfile) -> None:
    folder = cache_folder()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(profile), f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass


def _profile_from_dict(d: dict[str, Any]) -> ModelProfile:
    layers = []
    for x in d["layers"]:
        x = dict(x)
        x["fwd_ops"], x["bwd_ops"] = OpMix(**x["fwd_ops"]), OpMix(**x["bwd_ops"])
        x["region_io"] = [tuple(r) for r in x["region_io"]]
        x["tp_views"] = {int(t): TPView(**{**v, "collectives": [Collective(**c) for c in v["collectives"]],
                                           "collectives_sp": [Collective(**c) for c in v["collectives_sp"]]})
                         for t, v in x["tp_views"].items()}
        layers.append(LayerProfile(**x))
    return ModelProfile(**{**d, "layers": layers})

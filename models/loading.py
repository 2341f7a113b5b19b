"""Turn what a user passes as ``--model`` into a validated spec.

Accepted: a preset name (``llama2-70b``), a YAML spec file, an HF ``config.json``, or
``package.module:callable`` (a user's own module; see :mod:`custom`). YAML is read with
``yaml.safe_load``: a tag that would construct Python objects is refused, never run.
"""

from __future__ import annotations

import difflib
import os
import re

from paraplan.hardware_specs.datafile import read_data_file

from .custom import CallableSpec
from .errors import ModelSpecError
from .hf_config import in_config_terms, is_hf_config, spec_mapping_from_hf
from .presets import PRESETS
from .specs import ModelSpec, spec_from_mapping

_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_model_spec(ref: str) -> ModelSpec:
    """Resolve ``ref`` (preset name, YAML/JSON path or ``module:callable``) to a validated spec."""
    if not isinstance(ref, str) or not ref.strip():
        raise ModelSpecError("--model: give a preset name, a YAML/JSON spec file or package.module:callable")
    if ref in PRESETS:
        return spec_from_mapping({"name": ref, **PRESETS[ref]}, source=f"preset {ref}")
    if ref.endswith(".py"):
        raise ModelSpecError(f"--model {ref}: a Python file is not a model spec; give your module's callable as "
                             "package.module:callable (importable from here; paraplan profile takes it)")
    if os.path.exists(ref):
        return _load_file(ref)
    if _CALLABLE.match(ref):
        return CallableSpec(name=ref, family="custom", target=ref)
    if ref.endswith((".yaml", ".yml", ".json")):
        raise ModelSpecError(f"{ref}: no such file")
    close = difflib.get_close_matches(ref, list(PRESETS), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(PRESETS)}"
    raise ModelSpecError(f"unknown model preset {ref!r}{hint}")


def parse_data_file(path: str, what: str):
    """Read a small YAML or JSON file safely; every failure is one ModelSpecError line."""
    return read_data_file(path, what, ModelSpecError)


# keys of an HF config.json that no paraplan spec has: a file with them but no model_type is a config missing it
_HF_ONLY_KEYS = ("architectures", "num_hidden_layers", "n_layer", "n_embd", "torch_dtype", "transformers_version")


def _load_file(path: str) -> ModelSpec:
    data = parse_data_file(path, "model spec")
    stem = os.path.splitext(os.path.basename(path))[0]
    if is_hf_config(data):
        mapping = spec_mapping_from_hf(data, source=path)
        name = stem if stem != "config" else os.path.basename(os.path.dirname(os.path.abspath(path)))
        try:
            return spec_from_mapping({"name": name, **mapping}, source=path)
        except ModelSpecError as e:  # in the file's own key names, not paraplan's
            raise ModelSpecError(in_config_terms(str(e), data, path)) from None
    if isinstance(data, dict) and "family" not in data and any(k in data for k in _HF_ONLY_KEYS):
        raise ModelSpecError(f"{path}: no 'model_type' (the key an HF config.json names its model type with) and no "
                             "'family' (a paraplan spec's)")
    if isinstance(data, dict) and "name" not in data:
        data = {"name": stem, **data}
    return spec_from_mapping(data, source=path)

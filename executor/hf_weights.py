"""Start a LLaMA plan from Hugging Face weights (``execute --init-from DIR``): continue training a real model.

``DIR`` is a Hugging Face model folder: ``model.safetensors``, or shards listed by
``model.safetensors.index.json``, and (optionally) ``config.json``. The plan's model should come from
the same ``config.json`` (``paraplan simulate --model DIR/config.json ...``), so every parameter has
its counterpart; the launcher checks names, shapes and the RoPE/norm settings from the files'
headers before any rank starts, then every rank reads the tensors it holds (a tensor-parallel or
FSDP shard is cut from the full tensor, as chunks.materialize does with the reference init).

Names (HF ``LlamaForCausalLM`` -> the zoo's whole-model FQNs)::

    model.embed_tokens.weight                    embed.tok.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj    layers.{i}.attn.{wq,wk,wv,wo}
    model.layers.{i}.mlp.{gate,up,down}_proj     layers.{i}.mlp.{w1,w3,w2}
    model.layers.{i}.input_layernorm             layers.{i}.attn_norm
    model.layers.{i}.post_attention_layernorm    layers.{i}.mlp_norm
    model.norm.weight                            head.norm.weight
    lm_head.weight                               head.proj.weight (embed_tokens when the model ties them)

HF stores q/k projections for the "rotate half" form of RoPE, which is the zoo's (models/transformer.py),
so no permutation is needed. The zoo's LLaMA uses RoPE base 10000 without scaling and RMSNorm eps 1e-5:
a config.json that says otherwise (Llama 3's base 500000, say) is refused rather than trained wrongly.

The safetensors format is read here directly (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw data), so no extra package is needed.
"""

from __future__ import annotations

import json
import os
import re
import struct
from functools import lru_cache

import numpy as np
import torch

from .errors import ExecutionError

ROPE_THETA, RMS_EPS = 10000.0, 1e-5
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_IN_LAYER = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
             "mlp.w2": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_OUTSIDE = {"embed.tok": "model.embed_tokens", "head.norm": "model.norm", "head.proj": "lm_head"}


def hf_name(fqn: str) -> str | None:
    """The HF name of the zoo's parameter ``fqn`` (None: no counterpart)."""
    module, _, leaf = fqn.rpartition(".")
    m = _LAYER.match(module)
    if m and m.group(2) in _IN_LAYER:
        return f"model.layers.{m.group(1)}.{_IN_LAYER[m.group(2)]}.{leaf}"
    return f"{_OUTSIDE[module]}.{leaf}" if module in _OUTSIDE else None


class SafetensorsFile:
    """One ``.safetensors`` file: its header, and tensors read on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise ExecutionError(f"--init-from: {path} is not a safetensors file ({e})") from None
        self.start = 8 + n
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, e in self.entries.items():
            begin, end = e.get("data_offsets", (0, -1))
            if not 0 <= begin <= end <= size - self.start:
                raise ExecutionError(f"--init-from: {path}: tensor {name} lies outside the file (truncated?)")

    def tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        if e["dtype"] not in _DTYPES:
            raise ExecutionError(f"--init-from: {self.path}: {name} is {e['dtype']}; weights are F32, F16 or BF16")
        begin, end = e["data_offsets"]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start + begin, shape=(end - begin,))
        t = torch.frombuffer(bytearray(raw), dtype=_DTYPES[e["dtype"]])
        if t.numel() != int(np.prod(e["shape"])):
            raise ExecutionError(f"--init-from: {self.path}: {name} holds {t.numel()} values, not its shape "
                                 f"{tuple(e['shape'])}")
        return t.reshape(e["shape"])


@lru_cache(maxsize=2)
def open_folder(folder: str) -> dict[str, SafetensorsFile]:
    """HF name -> the file holding it, for a model folder (one file, or the shards its index lists)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ExecutionError(f"--init-from: {index} is not a safetensors index ({e})") from None
        files = {name: SafetensorsFile(os.path.join(folder, name)) for name in sorted(set(weight_map.values()))}
        return {k: files[v] for k, v in weight_map.items()}
    if not os.path.isdir(folder):
        raise ExecutionError(f"--init-from {folder}: no such folder")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise ExecutionError(f"--init-from {folder}: no .safetensors file in it")
    out = {}
    for n in names:
        st = SafetensorsFile(os.path.join(folder, n))
        out.update({k: st for k in st.entries})
    return out


def source_of(fqn: str, tensors: dict[str, SafetensorsFile], tied: bool) -> str | None:
    name = hf_name(fqn)
    if name == "lm_head.weight" and name not in tensors and tied:
        return "model.embed_tokens.weight"
    return name if name in tensors else None


def check(folder: str, job) -> None:
    """Refuse (one line) a folder whose weights do not fit the plan's model; reads headers only."""
    from paraplan.models import build_model

    spec = job.spec
    if spec.family != "llama" or getattr(spec, "num_experts", None) or getattr(spec, "qk_norm", False):
        raise ExecutionError(f"--init-from loads dense LLaMA models; the plan's model {spec.name} is not one")
    _check_config(folder)
    tensors = open_folder(folder)
    model = build_model(spec, "meta")
    used = set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        name = source_of(fqn, tensors, spec.tied)
        if name is None:
            raise ExecutionError(f"--init-from {folder}: no weight for {fqn} (HF {hf_name(fqn)})")
        shape = tuple(tensors[name].entries[name]["shape"])
        if shape != tuple(p.shape):
            raise ExecutionError(f"--init-from {folder}: {name} is {shape}, the plan's model needs {tuple(p.shape)} "
                                 f"for {fqn} (plan the model from {folder}/config.json)")
        used.add(name)
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ExecutionError(f"--init-from {folder}: {unused[0]} has no place in the plan's model {spec.name} "
                             f"(plan the model from {folder}/config.json)")


def _check_config(folder: str) -> None:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return  # shapes are checked; the RoPE settings cannot be
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ExecutionError(f"--init-from: {path}: {e}") from None
    where = f"--init-from: {path}"
    if cfg.get("model_type", "llama") != "llama":
        raise ExecutionError(f"{where}: model_type {cfg.get('model_type')!r}; LLaMA weights are loaded")
    if float(cfg.get("rope_theta", ROPE_THETA)) != ROPE_THETA or cfg.get("rope_scaling"):
        raise ExecutionError(f"{where}: RoPE base {cfg.get('rope_theta')} / scaling {cfg.get('rope_scaling')}; the "
                             f"zoo's LLaMA uses base {ROPE_THETA:g} without scaling")
    if float(cfg.get("rms_norm_eps", RMS_EPS)) != RMS_EPS:
        raise ExecutionError(f"{where}: rms_norm_eps {cfg['rms_norm_eps']}; the zoo's LLaMA uses {RMS_EPS:g}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ExecutionError(f"{where}: biased projections; the zoo's LLaMA has none")


@torch.no_grad()
def load_into(rm, folder: str) -> int:
    """Overwrite this rank's parameters with the HF weights (each its own shard); returns how many."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    tensors = open_folder(folder)
    tied = rm.job.spec.tied
    done = 0
    for chunk in rm.chunks:
        for fqn, p in chunk.module.named_parameters():
            name = source_of(fqn, tensors, tied)
            full = tensors[name].tensor(name).to(device=rm.device, dtype=p.dtype)  # the whole tensor
            if isinstance(p, DTensor):  # keep this rank's shard, no communication
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(full)
            done += 1
    return done

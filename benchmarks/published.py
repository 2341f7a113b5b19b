"""Published training runs as paraplan workloads and layouts, predicted through the CLI's own code path.

Reads the H100/H200 rows of benchmarks/data/published_h100.yaml (NVIDIA's dgxc-benchmarking recipes with
measured step times, NeMo and Megatron-Bridge performance tables, Megatron-LM's README, the Llama 3 paper)
and turns each into what a user would give ``paraplan simulate``: the model (a preset, or the row's shape),
the cluster (DGX H100 nodes), the global batch and sequence length, the layout, the dtype and the framework
(``megatron-core`` for NeMo / Megatron runs, ``torchtitan`` for torchtitan's tables). Each prediction goes
through ``Workload.create(..., framework=...)`` and ``CostModel.evaluate`` on the stage split the framework
makes (Megatron: equal layers per chunk; costmodel.framework_stages), as ``paraplan simulate`` does.

What a row leaves unstated is filled by a rule, never per row:
- recomputation: the least (none, then selective, then full) that the cost model predicts to fit — what the
  recipe's author does to fit a layout in memory;
- sequence parallelism: on whenever tp > 1 (NeMo's and Megatron-Bridge's performance recipes);
- ZeRO: the distributed optimizer (ZeRO 1) whenever dp x cp > 1 (every NeMo / Megatron recipe uses it);
- virtual pipeline stages: what another release of the same recipe lists (VIRTUAL_STAGES), else none.
A row is measured by its step time (dgxc: ``train_step_timing``), or by its tokens per second per GPU
(step = global batch x sequence / (tokens/s/GPU x GPUs)), or by its published model TFLOP/s per GPU.
Rows this cost model cannot express (hybrid Mamba models, B200, MoE: issue 16) are left out with the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from paraplan.models import load_model_spec, spec_from_mapping
from paraplan.planner.costmodel import CostModel, framework_stages, validate_layout
from paraplan.planner.errors import InvalidLayout
from paraplan.planner.layout import Layout
from paraplan.planner.workload import Workload

DATA = Path(__file__).with_name("data")

# Model shapes of rows that name a model without giving its shape (sources beside each).
SHAPES = {
    # NeMo's GPT-3 configs (NeMo launcher conf/training/gpt3/5b.yaml and 20b.yaml)
    "gpt3-5b": dict(family="gpt", num_layers=24, hidden_size=4096, num_attention_heads=32, vocab_size=51200),
    "gpt3-20b": dict(family="gpt", num_layers=44, hidden_size=6144, num_attention_heads=48, vocab_size=51200),
    # Nemotron-4 15B (Parmar et al. 2024, Table 1) and 340B (NVIDIA 2024, Table 1): squared-ReLU MLP of 4h
    # (not gated), GQA with 8 K/V heads, RoPE, untied embeddings, 256K vocabulary
    "nemotron4-15b": dict(family="gpt", num_layers=32, hidden_size=6144, num_attention_heads=48, num_kv_heads=8,
                          ffn_hidden_size=24576, vocab_size=256000, tied_embeddings=False),
    "nemotron4-340b": dict(family="gpt", num_layers=96, hidden_size=18432, num_attention_heads=96, num_kv_heads=8,
                           ffn_hidden_size=73728, vocab_size=256000, tied_embeddings=False),
}
PRESETS = {"llama3.1-8b": "llama3-8b", "llama3-8b": "llama3-8b", "llama3.1-70b": "llama3-70b",
           "llama3-70b": "llama3-70b", "llama3.1-405b": "llama3-405b", "llama2-7b": "llama2-7b",
           "llama2-13b": "llama2-13b", "llama2-70b": "llama2-70b", "gpt3-175b": "gpt3-175b"}
# Virtual pipeline stages a recipe uses where one release's table leaves them out (dgxc-benchmarking's
# nemotron4-340b: VP 12 at v24.11.1 and v25.05, printed NA at v25.04.01).
VIRTUAL_STAGES = {"nemotron4-340b": 12}
# Recipe settings the tables leave out, read from the config the benchmark runs, given as the CLI's switches:
# dgxc-benchmarking's Nemotron-4 340B under the NeMo 1.0 launcher runs nemotron/nemotron4-340b-synth.yaml
# (configure.sh: --config-name=${MODEL}-${MODEL_SIZE}-synth), whose optim is distributed_fused_adam with
# dtype: bf16 — Apex's DistributedFusedAdam then keeps a bf16 copy of the weights and bf16 moments
# (store_params defaults to True): --optimizer-states bf16. Its other NeMo 1.0 configs (GPT-3 175B, Nemotron-4
# 15B) keep fp32 optimizer states, the profile's default.
RECIPE_SWITCHES = {("nemotron4-340b", "NeMo-Megatron launcher"): {"optimizer_states": "bf16"}}
# Megatron-Bridge's H100 FP8 runs from its 25.11 release (v0.2.0) on use per-tensor current scaling: every H100 FP8
# performance config is an FP8_CS one (v0.2.0 scripts/performance/configs: *_H100_FP8_CS_BASE_CONFIG for Llama 3,
# Qwen3, GPT-OSS, DeepSeek-V3 (which also has an FP8_SC, subchannel, config); v0.3.0 to v0.5.0:
# *_PRETRAIN_CONFIG_H100_FP8_CS_V*), which scripts/performance/utils/precision.py turns into
# bf16_with_fp8_current_scaling_mixed (fp8_recipe "tensorwise", fp8_param_gather) with no bf16 first/last layers;
# the 25.11 table labels them FP8-CS. At 25.09 (commit a28844195, "Cherry pick perf 2509") the run script's
# --fp8_recipe defaulted to ds (delayed) and the table does not say, but the MoE models' H100 performance matrices
# list only fp8_cs beside bf16 (scripts/performance/configs/qwen3/*_llm_pretrain.yaml; deepseek_v3_llm_pretrain.yaml
# also fp8_ss, the subchannel recipe the table's parenthesised figures name), and the Qwen3-30B-A3B row's MBS 2 is
# the fp8_cs entry's (bf16: 1): those are current scaling too. The dense 25.09 matrices list fp8_ds and fp8_cs
# both: those rows keep the profile's (delayed).
MEGATRON_BRIDGE_CS_FROM = (25, 11)
MEGATRON_BRIDGE_CS_MOE_FROM = ((25, 9), ("qwen3", "deepseek"))


def megatron_bridge_fp8_switches(rid: str, dtype: str) -> dict:
    """The FP8 recipe of a Megatron-Bridge row (id "mbridge-<release>-<system>-..."), as the CLI's switch."""
    parts = rid.split("-")
    if dtype != "fp8" or parts[0] != "mbridge" or len(parts) < 3:
        return {}
    release = tuple(int(x) for x in parts[1].split(".")[:2])
    moe_from, moe_models = MEGATRON_BRIDGE_CS_MOE_FROM
    current = release >= MEGATRON_BRIDGE_CS_FROM or (release >= moe_from and any(m in rid for m in moe_models))
    return {"fp8_recipe": "tensorwise"} if current else {}


@dataclass
class Run:
    id: str
    source: str
    model: str  # the row's model name
    spec: object
    gpus: int
    framework: str
    layout: dict  # Layout fields
    seq_len: int
    measured: str  # "step_time_s" or "model_tflops_per_gpu"
    value: float  # the measurement
    recompute_stated: bool
    group: str = ""  # model / dtype / framework: what the fit selects by
    notes: list[str] = field(default_factory=list)
    switches: dict = field(default_factory=dict)  # the recipe's framework switches (RECIPE_SWITCHES)


def _int(x) -> int | None:
    if isinstance(x, int):
        return x
    if isinstance(x, str) and re.fullmatch(r"\d+", x.strip()):
        return int(x)
    return None


def _spec(row: dict):
    name = str(row["model"]).split(" ")[0]
    shape = dict(row.get("model_shape") or {})
    layers = row.get("num_layers")
    if name in PRESETS:
        spec = load_model_spec(PRESETS[name])
        if isinstance(layers, int) and layers != spec.num_layers:  # dgxc's 405B proxies: fewer layers
            spec = spec.replace(num_layers=layers, name=f"{spec.name}-{layers}l")
        return spec
    if name in SHAPES:
        return spec_from_mapping({"name": name, **SHAPES[name], "seq_length": row.get("seq_len") or 4096}, name)
    if shape.get("family") == "gpt" and all(isinstance(shape.get(k), int) for k in
                                            ("num_layers", "hidden_size", "num_attention_heads")):
        keep = {k: shape[k] for k in ("family", "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                      "seq_length") if k in shape}
        keep.setdefault("vocab_size", 51200)
        keep.setdefault("seq_length", row.get("seq_len") or 4096)
        return spec_from_mapping({"name": name, **keep}, name)
    return None


def _dtype(row: dict) -> str | None:
    text = str(row.get("dtype") or row.get("dtype_published") or "")
    if text.startswith("bf16"):
        return "bf16"
    if text.lower().startswith("fp8"):
        return "fp8"
    if "fp8" in str(row.get("id", "")):
        return "fp8"
    return None


def _recompute(row: dict) -> str | None:
    text = str(row.get("recompute") or "").lower()
    for mode in ("none", "selective", "full"):
        if text.startswith(mode):
            return mode
    return None


def h100_runs() -> tuple[list[Run], list[tuple[str, str]]]:
    """(runs, [(id, why left out)]) of the H100/H200 rows."""
    rows = yaml.safe_load((DATA / "published_h100.yaml").read_text())["rows"]
    runs, skipped = [], []
    for row in rows:
        rid = row["id"]
        gpu = str(row.get("gpu", ""))
        if "B200" in gpu:
            skipped.append((rid, "B200 (no spec here)"))
            continue
        if "H100" not in gpu and "H200" not in gpu:
            skipped.append((rid, f"GPU {gpu}"))
            continue
        if "H200" in gpu or "96GB" in gpu or "94/95" in gpu or "500W" in gpu:
            skipped.append((rid, "not a DGX H100 80 GB at 700 W"))
            continue
        spec = _spec(row)
        if spec is None:
            skipped.append((rid, f"model {row['model']} not expressible (shape unknown or hybrid)"))
            continue
        gpus, tp, pp = _int(row.get("gpus")), _int(row.get("tp")), _int(row.get("pp"))
        cp = _int(row.get("cp")) or 1
        seq = _int(row.get("seq_len"))
        dtype = _dtype(row)
        if not (gpus and tp and pp and seq and dtype):
            skipped.append((rid, "layout, sequence or dtype not published"))
            continue
        dp = gpus // (tp * pp * cp)
        mb = _int(row.get("micro_batch"))
        gb = _int(row.get("global_batch"))
        if gb is None and _int(row.get("grad_accum")) and mb:
            gb = _int(row["grad_accum"]) * dp * mb
        if gb is None and _int(row.get("batch_size_per_dp")):
            gb = _int(row["batch_size_per_dp"]) * dp
        if mb is None or gb is None:
            skipped.append((rid, "micro-batch or global batch not published"))
            continue
        vp = _int(row.get("vp")) or VIRTUAL_STAGES.get(str(row["model"]).split(" ")[0], 1) if pp > 1 else 1
        if pp * vp > spec.num_layers + 2:  # more chunks than blocks: not a layout
            vp = 1
        measured, value = "step_time_s", None
        if isinstance(row.get("step_time_s"), (int, float)):
            value = float(row["step_time_s"])
        elif isinstance(row.get("tokens_per_s_per_gpu"), (int, float)):
            value = gb * seq / (row["tokens_per_s_per_gpu"] * gpus)
        elif isinstance(row.get("tflops_per_gpu"), (int, float)):
            measured, value = "model_tflops_per_gpu", float(row["tflops_per_gpu"])
        if value is None:
            skipped.append((rid, "no measurement"))
            continue
        framework = "torchtitan" if "torchtitan" in str(row.get("framework", "")).lower() else "megatron-core"
        sp = row.get("sequence_parallel")
        layout = dict(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=mb, global_batch=gb, dtype=dtype,
                      schedule="interleaved-1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                      sequence_parallel=bool(sp) if isinstance(sp, bool) else tp > 1,
                      zero=1 if dp * cp > 1 else 0, recompute=_recompute(row) or "none")
        model = str(row["model"]).split(" ")[0]
        switches = next((sw for (name, stack), sw in RECIPE_SWITCHES.items()
                         if name == model and str(row.get("framework", "")).startswith(stack)), {})
        switches = {**switches, **megatron_bridge_fp8_switches(rid, dtype)}
        runs.append(Run(id=rid, source=str(row.get("source", "")), model=model, spec=spec.replace(seq_length=seq),
                        gpus=gpus, framework=framework, layout=layout, seq_len=seq, measured=measured, value=value,
                        recompute_stated=_recompute(row) is not None, group=f"{model}/{dtype}", switches=switches))
    return runs, skipped


@cache
def _workload(spec_key, framework: str, nodes: int, global_batch: int, cluster: str,
              switches: tuple = ()) -> Workload:
    return Workload.create(spec_key[0].spec, cluster, global_batch, nodes=nodes, framework=framework, **dict(switches))


@dataclass
class Predicted:
    run: Run
    prediction: object | None
    layout: Layout | None
    error: float | None  # predicted / measured - 1 (step time), or of the model TFLOP/s
    why: str = ""


def predict(run: Run, cluster: str = "dgx-h100", efficiency=None) -> Predicted:
    """The run through the CLI's code path (``efficiency``: a GPU efficiency to price with instead of the
    cluster's, for the fit)."""
    import dataclasses

    nodes = max(1, math.ceil(run.gpus / 8))
    work = _workload((_Hashable(run.spec),), run.framework, nodes, run.layout["global_batch"], cluster,
                     tuple(sorted(run.switches.items())))
    if efficiency is not None:
        gpu = dataclasses.replace(work.cluster.gpu, efficiency=efficiency)
        work = dataclasses.replace(work, cluster=dataclasses.replace(work.cluster, gpu=gpu), _profiles=work._profiles)
    model = CostModel(work)
    modes = [run.layout["recompute"]] if run.recompute_stated else ["none", "selective", "full"]
    best, why = None, ""
    for mode in modes:
        lay = Layout(**{**run.layout, "recompute": mode})
        try:
            validate_layout(model, lay)
        except InvalidLayout as e:
            return Predicted(run, None, None, None, f"invalid: {e}")
        pred = model.evaluate(lay, framework_stages(model, lay))
        best = (pred, lay)
        if pred.fits:
            break
    pred, lay = best
    if run.measured == "step_time_s":
        err = pred.iteration_time_s / run.value - 1
    else:
        err = pred.model_tflops_per_gpu / run.value - 1
    return Predicted(run, pred, lay, err, why)


class _Hashable:
    """A model spec as a cache key (specs are dataclasses with dict fields)."""

    def __init__(self, spec):
        self.spec = spec
        self.key = repr(spec.to_dict())

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return self.key == other.key


# torchtitan's own tables on 64 A100 80GB (docs/performance.md, August 2024): FSDP2 alone, so every parameter, gradient
# and optimizer state sharded over the 64 ranks and the parameters gathered per block for forward and again for
# backward (reshard_after_forward: ZeRO 3 here); its AC modes as --recompute: "no" none, "full" full, "selective op"
# its per-op SAC, which --framework torchtitan prices under selective (planner/framework.py). "selective layer"
# (every other block checkpointed whole, selective_ac_option "2") is one mode per block, not per stage: left out.
TORCHTITAN_AC = {"no": "none", "none": "none", "full": "full", "selective op": "selective"}


def torchtitan_a100_runs() -> tuple[list[Run], list[tuple[str, str]]]:
    """(runs, [(id, why left out)]) of the torchtitan rows of published_a100_extra.yaml, as a user would give them
    to ``paraplan simulate --framework torchtitan --cluster dgx-a100-80gb``."""
    rows = yaml.safe_load((DATA / "published_a100_extra.yaml").read_text())["rows"]
    runs, skipped = [], []
    for row in rows:
        if "torchtitan" not in str(row.get("framework", "")).lower():
            continue
        rid, mode = row["id"], TORCHTITAN_AC.get(str(row.get("recompute", "")).lower())
        if mode is None:
            skipped.append((rid, f"activation checkpointing '{row.get('recompute')}' is per block, not per stage"))
            continue
        gpus, seq, gb = row["gpus"], row["seq_len"], row["global_batch"]
        dp = row["fsdp"]
        spec = load_model_spec(PRESETS[row["model"]]).replace(seq_length=seq)
        layout = dict(dp=dp, tp=row["tp"], pp=row["pp"], cp=1, micro_batch=row["local_batch_per_dp_rank"],
                      global_batch=gb, dtype="bf16", schedule="1f1b", virtual_stages=1, sequence_parallel=False,
                      zero=3, recompute=mode)
        runs.append(Run(id=rid, source=str(row.get("source", "")), model=row["model"], spec=spec, gpus=gpus,
                        framework="torchtitan", layout=layout, seq_len=seq, measured="step_time_s",
                        value=gb * seq / (row["tokens_per_s_per_gpu"] * gpus), recompute_stated=True,
                        group=f"{row['model']}/bf16"))
    return runs, skipped

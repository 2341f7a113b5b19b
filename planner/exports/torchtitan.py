"""torchtitan: the plan as a TOML job file for torchtitan 0.2's ConfigManager (``--job.config_file``).

torchtitan builds its models from registered flavors, so the plan's model must have the shape of one
(FLAVORS, from torchtitan 0.2.2 torchtitan/models/llama3/__init__.py); its own config manager parsing
the file is the test (tests/test_export.py).

Mapping (plan -> torchtitan):
- tp, pp, cp, ep, etp -> [parallelism] tensor_parallel_degree, pipeline_parallel_degree,
  context_parallel_degree, expert_parallel_degree, expert_tensor_parallel_degree (etp must be 1 or tp).
- dp with ZeRO 3 -> data_parallel_shard_degree (FSDP2); ZeRO 0/1/2 -> FSDP2 with
  fsdp_reshard_after_forward = "never" (torchtitan has no ZeRO-1/2, and its DDP runs only without other
  parallelism), except pure data parallelism with ZeRO 0, which is data_parallel_replicate_degree (DDP).
- stages -> module_fqns_per_model_part (embed -> tok_embeddings, layers.N, head -> norm + output), schedule ->
  pipeline_parallel_schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble), micro-batch ->
  pipeline_parallel_microbatch_size.
- batch: local_batch_size = global / dp (with pp > 1 the pipeline splits it into micro-batches), else the
  micro-batch, and global_batch_size: torchtitan accumulates gradients over the rest.
- recompute -> [activation_checkpoint] mode (selective as per-op SAC); dtype bf16/fp32 ->
  mixed_precision_param; fp8 -> the quantize.linear.float8 converter.
Refused: models without a torchtitan flavor, fp16, parameter servers, class-sharded heads.
"""

from __future__ import annotations

import json

from paraplan.models import ModelSpec

from ..plan import Plan
from .common import (
    Export,
    ExportRefused,
    header_lines,
    placement,
    refuse_ps_and_sharded_heads,
    require_transformer,
    uniform_recompute,
)

TARGET = "torchtitan"
TORCHTITAN_SOURCE = "torchtitan 0.2.2"
# flavor -> (layers, hidden, heads, kv heads, SwiGLU ffn size as built, vocabulary), with its HF assets folder
FLAVORS = {
    "debugmodel": ((6, 256, 16, 16, 768, 2048), "./tests/assets/tokenizer"),
    "8B": ((32, 4096, 32, 8, 14336, 128256), "./assets/hf/Llama-3.1-8B"),
    "70B": ((80, 8192, 64, 8, 28672, 128256), "./assets/hf/Llama-3.1-70B"),
    "405B": ((126, 16384, 128, 8, 53248, 128256), "./assets/hf/Llama-3.1-405B"),
}
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zb-v": "ZBVZeroBubble"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}


def export(plan: Plan, plan_path: str, spec: ModelSpec) -> Export:
    refuse_ps_and_sharded_heads(plan, TARGET)
    config, notes = job_config(plan, spec)
    lines = [f"# {x}" for x in header_lines(plan, plan_path, f"torchtitan job config ({TORCHTITAN_SOURCE})")]
    lines += ["# Run: torchrun ... -m torchtitan.train --job.config_file <this file>", ""]
    text = "\n".join(lines) + "\n" + to_toml(config)
    place = placement(plan)
    nodes = place.nodes or 1
    launch = (f"torchrun --nnodes {nodes} --nproc-per-node {place.per_node or place.world_size} "
              + ("--rdzv-backend c10d --rdzv-endpoint <first-node>:29500 " if nodes > 1 else "")
              + "-m torchtitan.train --job.config_file torchtitan.toml")
    par, tr = config["parallelism"], config["training"]
    return Export(target=TARGET, text=text, filename="torchtitan.toml", launch=launch, notes=notes,
                  where=f"on each of the {nodes} nodes" if nodes > 1 else "",
                  values={"tp": par["tensor_parallel_degree"], "pp": par["pipeline_parallel_degree"],
                          "dp": par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"],
                          "local_batch_size": tr["local_batch_size"], "global_batch_size": tr["global_batch_size"]})


def flavor_of(spec) -> str:
    shape = (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.ffn_size,
             spec.vocab_size)
    if spec.family == "llama" and not spec.tied and not getattr(spec, "num_experts", 0):
        for name, (flavor_shape, _) in FLAVORS.items():
            if shape == flavor_shape:
                return name
    raise ExportRefused(TARGET, f"model {spec.name} ({spec.family}, layers {shape[0]}, hidden {shape[1]}, heads "
                        f"{shape[2]}/{shape[3]}, ffn {shape[4]}, vocab {shape[5]})",
                        f"{TORCHTITAN_SOURCE} builds registered flavors only, and no llama3 flavor "
                        f"({', '.join(FLAVORS)}) has this shape")


def job_config(plan: Plan, spec: ModelSpec) -> tuple[dict, list[str]]:
    """The TOML's sections as nested dicts, and the notes on what torchtitan runs differently."""
    spec = require_transformer(spec, TARGET, "torchtitan")
    lay = plan.layout
    if lay.dtype not in PRECISION:
        raise ExportRefused(TARGET, f"dtype {lay.dtype}", "torchtitan trains in bfloat16 or float32 "
                            "(training.mixed_precision_param), with float8 as a converter")
    flavor = flavor_of(spec)
    notes: list[str] = []
    model = {"name": "llama3", "flavor": flavor, "hf_assets_path": FLAVORS[flavor][1]}
    if lay.dtype == "fp8":
        model["converters"] = ["quantize.linear.float8"]
    seq = plan.seq_length or spec.seq_length
    training = {"local_batch_size": lay.global_batch // lay.dp if lay.pp > 1 else lay.micro_batch,
                "global_batch_size": lay.global_batch, "seq_len": seq,
                "mixed_precision_param": PRECISION[lay.dtype]}
    config = {"job": {"description": f"paraplan: {plan.model} {lay.short()}"}, "model": model,
              "training": training, "parallelism": parallelism(plan, notes),
              "activation_checkpoint": activation_checkpoint(plan, notes)}
    if lay.dtype == "fp8":
        config["quantize"] = {"linear": {"float8": {"filter_fqns": ["output"]}}}
    return config, notes


def parallelism(plan: Plan, notes: list[str]) -> dict:
    lay = plan.layout
    others = lay.tp > 1 or lay.pp > 1 or lay.cp > 1
    if lay.zero == 0 and not others:
        replicate, shard, reshard = lay.dp, 1, None
    else:
        replicate, shard = 1, lay.dp
        reshard = "default" if lay.zero == 3 else "never"
        if lay.zero < 3 and lay.dp > 1:
            notes.append(f"ZeRO-{lay.zero} runs as FSDP2 without resharding after forward (torchtitan has no "
                         "ZeRO-1/2 and its DDP runs only without other parallelism): parameters are sharded too")
    par: dict = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    if reshard:
        par["fsdp_reshard_after_forward"] = reshard
    par["tensor_parallel_degree"] = lay.tp
    if lay.tp > 1 and not lay.sequence_parallel:
        notes.append("torchtitan shards norms and dropout over the sequence whenever tp > 1 (sequence "
                     "parallelism on, as if planned with --sequence-parallel)")
    par["pipeline_parallel_degree"] = lay.pp
    if lay.pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULES[lay.schedule]
        par["pipeline_parallel_microbatch_size"] = lay.micro_batch
        par["module_fqns_per_model_part"] = [_fqns(names) for names in plan.stages]
    par["context_parallel_degree"] = lay.cp
    if lay.ep > 1 or lay.etp > 1:
        if lay.etp not in (1, lay.tp):
            raise ExportRefused(TARGET, f"etp {lay.etp}",
                                f"torchtitan's expert tensor parallelism is 1 or tp ({lay.tp})")
        par["expert_parallel_degree"] = lay.ep
        par["expert_tensor_parallel_degree"] = lay.etp
    return par


def _fqns(names: list[str]) -> list[str]:
    """paraplan block names -> torchtitan llama3 module FQNs."""
    out: list[str] = []
    for n in names:
        out += {"embed": ["tok_embeddings"], "head": ["norm", "output"]}.get(n, [n])
    return out


def activation_checkpoint(plan: Plan, notes: list[str]) -> dict:
    mode, note = uniform_recompute(plan, TARGET)
    if note:
        notes.append(note)
    if mode == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}
    return {"mode": mode}


def to_toml(config: dict) -> str:
    """A nested dict of tables (values: str, int, float, bool, lists of those or of lists) as TOML."""
    out: list[str] = []

    def table(prefix: str, body: dict) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        if scalars:
            out.append(f"[{prefix}]")
            out.extend(f"{k} = {_value(v)}" for k, v in scalars.items())
            out.append("")
        for k, v in body.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}", v)

    for name, body in config.items():
        table(name, body)
    return "\n".join(out)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for the characters used here
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")

"""torchtitan: the plan as a TOML job file for torchtitan 0.2's ConfigManager (``--job.config_file``).

torchtitan builds its models from registered flavors. A model with the shape of one of its llama3 flavors
uses it; any other model it can express gets a flavor module beside the TOML, which torchtitan imports
(``[experimental] custom_import``) to register that flavor with the plan's exact shape
(torchtitan_model.py says which torchtitan model takes which model, and what it refuses). Its own config
manager parsing the file, and the module registering a model of the plan's parameter count, are the tests
(tests/test_export.py).

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
A gpt model trains as paraplan's own GPT for torchtitan (executor/torchtitan_gpt.py, registered the same way).
Refused: models no torchtitan model expresses (bert, ...), fp16, a sequence length torchtitan cannot split
over tp x 2cp, parameter servers, class-sharded heads.
"""

from __future__ import annotations

import json
import os
import shlex

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
from .torchtitan_model import FLAVORS, TORCHTITAN_SOURCE, TitanModel, module_name, module_text, titan_model

TARGET = "torchtitan"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zb-v": "ZBVZeroBubble"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}

__all__ = ["FLAVORS", "TORCHTITAN_SOURCE", "export", "job_config", "model_files", "to_toml"]


def export(plan: Plan, plan_path: str, spec: ModelSpec, filename: str = "torchtitan.toml") -> Export:
    """``filename``: where the TOML goes (its folder takes the flavor module, its stem names it)."""
    refuse_ps_and_sharded_heads(plan, TARGET)
    module = module_name(filename)
    config, notes, model = job_config(plan, spec, module)
    lines = [f"# {x}" for x in header_lines(plan, plan_path, f"torchtitan job config ({TORCHTITAN_SOURCE})")]
    lines += [f"# {x}" for x in model_lines(model, module)]
    lines += [f"# Note: {n}" for n in notes]
    lines += ["# Run: torchrun ... -m torchtitan.train --job.config_file <this file>", ""]
    text = "\n".join(lines) + "\n" + to_toml(config)
    place = placement(plan, TARGET)
    nodes = place.nodes
    launch = (python_path(filename, model)
              + f"torchrun --nnodes {nodes} --nproc-per-node {place.per_node} "
              + ("--rdzv-backend c10d --rdzv-endpoint <first-node>:29500 " if nodes > 1 else "")
              + f"-m torchtitan.train --job.config_file {filename}")
    par, tr = config["parallelism"], config["training"]
    return Export(target=TARGET, text=text, filename=filename, launch=launch, notes=notes,
                  where=f"on each of the {nodes} nodes" if nodes > 1 else "",
                  values={"model": model.name, "flavor": model.flavor,
                          "tp": par["tensor_parallel_degree"], "pp": par["pipeline_parallel_degree"],
                          "dp": par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"],
                          "local_batch_size": tr["local_batch_size"], "global_batch_size": tr["global_batch_size"]},
                  files=model_files(model, plan, plan_path, filename, module))


def model_lines(model: TitanModel, module: str) -> list[str]:
    """Comment lines saying which torchtitan model the file trains."""
    if not model.needs_module:
        return [f"Model: torchtitan's registered {model.name} flavor {model.flavor}, the plan's shape (its RoPE: "
                "base 500000 with Llama 3.1 scaling; paraplan's executor uses base 10000, on which no planned figure "
                "depends)"]
    if model.runtime:
        return [f"Model: the plan's {model.flavor} as paraplan's {model.base} model for torchtitan ({model.runtime}), "
                f"registered by {module}.py (keep it beside this file, that folder on PYTHONPATH: custom_import)"]
    return [f"Model: the plan's {model.flavor} as a flavor of torchtitan's {model.base}, registered by {module}.py "
            f"(keep it beside this file, that folder on PYTHONPATH: custom_import)"]


def model_files(model: TitanModel, plan: Plan, plan_path: str, filename: str, module: str) -> dict[str, str]:
    """The flavor module, named relative to the job file's folder ({} when torchtitan has the flavor)."""
    if not model.needs_module:
        return {}
    return {f"{module}.py": module_text(model, plan, plan_path, os.path.basename(filename), module)}


def python_path(filename: str, model: TitanModel) -> str:
    """The launch command's PYTHONPATH prefix that lets torchtitan import the flavor module ("" if none)."""
    if not model.needs_module:
        return ""
    return f"PYTHONPATH={shlex.quote(os.path.dirname(filename) or '.')}${{PYTHONPATH:+:$PYTHONPATH}} "


def job_config(plan: Plan, spec: ModelSpec, module: str = "torchtitan_model") -> tuple[dict, list[str], TitanModel]:
    """The TOML's sections as nested dicts, the notes on what torchtitan runs differently, and the model
    (``module``: the flavor module's import name, where the model needs one)."""
    spec = require_transformer(spec, TARGET, "torchtitan")
    lay = plan.layout
    if lay.dtype not in PRECISION:
        raise ExportRefused(TARGET, f"dtype {lay.dtype}", "torchtitan trains in bfloat16 or float32 "
                            "(training.mixed_precision_param), with float8 as a converter")
    seq = plan.seq_length or spec.seq_length
    divisor = lay.tp * 2 * lay.cp
    if seq % divisor:
        raise ExportRefused(TARGET, f"sequence length {seq} with tp {lay.tp} and cp {lay.cp}",
                            f"torchtitan splits each sequence over tp x 2cp = {divisor} (sequence and context "
                            "parallelism), which must divide it")
    model = titan_model(plan, spec)
    notes = list(model.notes)
    if model.needs_module:
        notes.append(f"torchtitan reads its tokenizer from [model] hf_assets_path ({model.hf_assets_path}): put a "
                     f"Hugging Face tokenizer there whose ids fit the model's vocabulary ({spec.vocab_size})")
    section = {"name": model.name, "flavor": model.flavor, "hf_assets_path": model.hf_assets_path}
    if lay.dtype == "fp8":
        section["converters"] = ["quantize.linear.float8"]
    training = {"local_batch_size": lay.global_batch // lay.dp if lay.pp > 1 else lay.micro_batch,
                "global_batch_size": lay.global_batch, "seq_len": seq,
                "mixed_precision_param": PRECISION[lay.dtype]}
    config = {"job": {"description": f"paraplan: {plan.model} {lay.short()}"}, "model": section,
              "training": training, "parallelism": parallelism(plan, spec, notes),
              "activation_checkpoint": activation_checkpoint(plan, notes)}
    if lay.dtype == "fp8":
        config["quantize"] = {"linear": {"float8": {"filter_fqns": ["output"]}}}
    implementation = plan.framework_switches.get("optimizer_implementation")
    if implementation:  # as priced (--optimizer-implementation); torchtitan's own default is fused
        config["optimizer"] = {"implementation": implementation}
    if model.needs_module:
        config["experimental"] = {"custom_import": module}
    return config, notes, model


def parallelism(plan: Plan, spec: ModelSpec, notes: list[str]) -> dict:
    lay = plan.layout
    others = lay.tp > 1 or lay.pp > 1 or lay.cp > 1
    if lay.zero == 0 and not others:
        replicate, shard, reshard = lay.dp, 1, None
    else:
        replicate, shard = 1, lay.dp
        reshard = "default" if lay.zero == 3 else "never"
        if lay.zero < 3 and lay.dp > 1:
            why, sharded = ("torchtitan has no ZeRO-1/2 and its DDP runs only without other parallelism",
                            "parameters are sharded too")
            if lay.zero == 0:
                why, sharded = ("torchtitan's DDP runs only without other parallelism",
                                "parameters, gradients and optimizer states are sharded")
            notes.append(f"ZeRO-{lay.zero} runs as FSDP2 without resharding after forward ({why}): {sharded}")
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
        learned = spec.family == "gpt"  # executor/torchtitan_gpt.py: learned positions
        par["module_fqns_per_model_part"] = [_fqns(names, learned) for names in plan.stages]
    par["context_parallel_degree"] = lay.cp
    if lay.ep > 1 or lay.etp > 1:
        if lay.etp not in (1, lay.tp):
            raise ExportRefused(TARGET, f"etp {lay.etp}",
                                f"torchtitan's expert tensor parallelism is 1 or tp ({lay.tp})")
        par["expert_parallel_degree"] = lay.ep
        par["expert_tensor_parallel_degree"] = lay.etp
    return par


def _fqns(names: list[str], learned_positions: bool = False) -> list[str]:
    """paraplan block names -> the module FQNs of torchtitan's llama3, llama4 and deepseek_v3 (and of
    executor/torchtitan_gpt.py's GPT: ``learned_positions``, its embedding stage holds pos_embeddings too)."""
    embed = ["tok_embeddings", "pos_embeddings"] if learned_positions else ["tok_embeddings"]
    out: list[str] = []
    for n in names:
        out += {"embed": embed, "head": ["norm", "output"]}.get(n, [n])
    return out


def activation_checkpoint(plan: Plan, notes: list[str]) -> dict:
    mode, note = uniform_recompute(plan, TARGET)
    if note:
        notes.append(note)
    if mode == "selective":
        # torchtitan's op-level policy (models/*/infra/parallelize.py _op_sac_save_list, distributed/
        # activation_checkpoint.py): saves the attention kernel's output and every other matmul's, reruns the rest
        # a plan priced for torchtitan priced this policy already (planner/op_sac.py), on the blocks it describes
        if plan.framework != "torchtitan":
            notes.append("torchtitan's selective checkpoint ('op') is not the plan's selective recomputation (the "
                         "attention core rerun): it saves the attention kernel's output and every other matmul's "
                         "output and reruns the other matmuls and the element-wise ops, so its memory and time differ "
                         "from the plan's (more recomputation, fewer activations kept); plan with --framework "
                         "torchtitan to price it")
        return {"mode": "selective", "selective_ac_option": "op"}
    if mode in ("norm+act", "mlp", "selective+mlp"):  # torchtitan checkpoints whole blocks or ops, not one sublayer
        notes.append(f"torchtitan has no recomputation of one sublayer or module ({mode}): full recomputation is "
                     "used (fits, but slower than predicted)")
        return {"mode": "full"}
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

"""DeepSpeed: the plan as a DeepSpeed JSON config, as ``DeepSpeedConfig`` reads it.

The JSON configures DeepSpeed's engine; the model code supplies what the JSON cannot (a
``PipelineModule`` for pipeline stages, the data-parallel group through an ``mpu``). DeepSpeed's own
``DeepSpeedConfig`` reading the file back is the test (tests/test_export.py).

Mapping (plan -> DeepSpeed):
- global batch, micro-batch, micro-batches per replica -> train_batch_size, train_micro_batch_size_per_gpu,
  gradient_accumulation_steps (the pipeline engine runs the latter as its micro-batches).
- zero -> zero_optimization.stage; dtype bf16/fp16 -> bf16/fp16 enabled (fp32: neither).
- tp -> tensor_parallel.autotp_size (AutoTP training); pp -> pipeline.stages (PipelineModule(num_stages=pp));
  ep / etp -> expert_parallel (AutoEP) autoep_size / expert_tensor_parallel_size.
- recompute -> activation_checkpointing (which model code using deepspeed.checkpointing follows).
Refused: schedules other than 1F1B with pp > 1 (the pipeline engine's own), ZeRO 2/3 with pp > 1, context
parallelism, fp8, parameter servers, class-sharded heads.
"""

from __future__ import annotations

import json

from paraplan.models import ModelSpec

from ..plan import Plan
from .common import Export, ExportRefused, header_lines, placement, refuse_ps_and_sharded_heads, uniform_recompute

TARGET = "deepspeed"


def export(plan: Plan, plan_path: str, spec: ModelSpec) -> Export:
    refuse_ps_and_sharded_heads(plan, TARGET)
    config, notes = ds_config(plan)
    place = placement(plan, TARGET)
    nodes = place.nodes
    launch = (f"deepspeed --num_nodes {nodes} --num_gpus {place.per_node} "
              + ("--hostfile hostfile " if nodes > 1 else "") + "your_train.py --deepspeed_config ds_config.json")
    about = (" / ".join(header_lines(plan, plan_path, "DeepSpeed config")) + f"; the data-parallel size "
             f"({plan.layout.dp}) comes from the launch (world size / (tp x pp)) or the model code's mpu")
    return Export(target=TARGET, text=json.dumps(config, indent=2) + "\n", filename="ds_config.json", launch=launch,
                  notes=notes, where="on the first node (the launcher reaches the others through the hostfile)"
                  if nodes > 1 else "", values={"dp": plan.layout.dp, "tp": plan.layout.tp, "pp": plan.layout.pp,
                                       "zero": plan.layout.zero, "about": about})


def ds_config(plan: Plan) -> tuple[dict, list[str]]:
    """The config dict and the notes on what DeepSpeed leaves to the model code."""
    lay = plan.layout
    notes: list[str] = []
    if lay.pp > 1 and lay.schedule != "1f1b":
        raise ExportRefused(TARGET, f"the {lay.schedule} schedule" + (f" with {lay.virtual_stages} stages per rank"
                                                                       if lay.virtual_stages > 1 else ""),
                            "DeepSpeed's pipeline engine runs one stage per rank with its 1F1B schedule; "
                            "simulate the layout with --schedule 1f1b --virtual-stages 1")
    if lay.pp > 1 and lay.zero >= 2:
        raise ExportRefused(TARGET, f"ZeRO-{lay.zero} with pipeline parallelism",
                            "DeepSpeed's pipeline engine allows ZeRO 0 or 1")
    if lay.cp > 1:
        raise ExportRefused(TARGET, f"context parallelism (cp {lay.cp})", "DeepSpeed's sequence parallelism "
                            "(Ulysses, sequence_parallel_size) shards attention heads with all-to-alls, not the "
                            "sequence chunks the plan priced")
    if lay.dtype not in ("bf16", "fp16", "fp32"):
        raise ExportRefused(TARGET, f"dtype {lay.dtype}", "DeepSpeed's config enables bf16 or fp16 mixed precision")
    config: dict = {"train_batch_size": lay.global_batch, "train_micro_batch_size_per_gpu": lay.micro_batch,
                    "gradient_accumulation_steps": lay.num_micro_batches,
                    "zero_optimization": {"stage": lay.zero}, "gradient_clipping": 1.0, "steps_per_print": 10}
    if lay.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif lay.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    if lay.tp > 1:
        config["tensor_parallel"] = {"autotp_size": lay.tp}
        if lay.sequence_parallel:
            notes.append("DeepSpeed's AutoTP has no sequence parallelism: norms and dropout hold whole sequences "
                         "(more activation memory than planned)")
    if lay.pp > 1:
        config["pipeline"] = {"stages": lay.pp, "activation_checkpoint_interval": 0}
        notes.append(f"build the model as PipelineModule(num_stages={lay.pp}, partition_method='type:...' or "
                     "'parameters'): DeepSpeed takes stage boundaries from the model code, not the JSON")
    if lay.ep > 1 or lay.etp > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": lay.ep, "expert_tensor_parallel_size": lay.etp}
    mode, note = uniform_recompute(plan, TARGET)
    if note:
        notes.append(note)
    if mode != "none":
        # partition_activations shards each checkpointed layer input over the tensor-parallel ranks (gathered again
        # in backward): what the plan's sequence parallelism keeps of it, so only where the plan has it
        config["activation_checkpointing"] = {"partition_activations": lay.tp > 1 and lay.sequence_parallel,
                                              "contiguous_memory_optimization": False, "cpu_checkpointing": False}
        if mode in ("norm+act", "selective", "mlp", "selective+mlp"):
            notes.append(f"{mode} recomputation is the model code's choice (e.g. Megatron-DeepSpeed "
                         "--recompute-granularity selective); the JSON configures deepspeed.checkpointing only")
        else:
            notes.append("full recomputation runs where the model code checkpoints each layer with "
                         "deepspeed.checkpointing.checkpoint (Megatron-DeepSpeed: --checkpoint-activations "
                         "--deepspeed-activation-checkpointing); the JSON configures it, it does not turn it on")
        if lay.pp > 1:
            config["pipeline"]["activation_checkpoint_interval"] = 1 if mode == "full" else 0
    return config, notes

"""Predicted vs published step times of mixture-of-experts training runs on H100s (issue 16 item 4).

References: benchmarks/data/published_moe.yaml (each row with its source). Each H100 row whose layout is
published and whose model paraplan can build is priced through the simulate command's code path
(paraplan.planner.api.simulate: Workload.create with ``--framework megatron-core``, a Layout from the row,
balanced stages): the step time is compared with the published one (dgxc-benchmarking: measured seconds per
step) or with the one the published throughput implies (Megatron-Bridge: tokens/s/GPU -> seq x global batch /
(tokens/s/GPU x GPUs)).

One number is fitted to these rows (round 4, below); nothing else. The MoE settings of the megatron-core profile
come from the recipes' code:
``moe_imbalance`` = 1.0 (Megatron-Bridge sets moe_router_force_load_balancing, and its tables' footnote says
the benchmarks force-balance tokens), ``moe_grouped_gemm`` (one kernel per projection); per recipe, the
dispatcher and all-to-all overlap (RECIPES). FIT names the two rows looked at while those choices were made
(and while the model of the all-to-all was written), and the one row round 4's number is fitted on; they are
reported apart. Everything else (H100
efficiency curves, the rest of the megatron-core profile) comes from elsewhere, so the held-out error is
what a user would see. A second summary leaves out the rows the data file itself marks SUSPICIOUS.
Caveat on "held out": the accounting of Megatron-Core's fused MoE kernels (planner/fused_moe.py: saved bytes
and memory traffic, counted from the kernels, no free parameter) was written after every row here had been
seen (it took the held-out MAPE from 15.6% to 13.0%); the rows judged the choice to model it, not a number in it.
Likewise MLP recomputation (--recompute mlp) and Megatron-Core's MLA activation accounting
(planner/fused_activations.py) were added after DeepSeek-V3's rows were predicted not to fit; both count what
the modules save, with no free parameter. The tables do not say what a run recomputed: each row is priced with
the lightest --recompute that fits (RECOMPUTE_ORDER), as a user holding only the table would. The DeepSeek-V3
25.09 row's switches (RECIPES) were read from that release's performance script after the row was seen +58%
off (its all-to-all overlap); they are the recipe's settings, not numbers chosen for the row. That script also
recomputes MLA's up-projections (recompute_modules mla_up_proj): selective recomputation of MLA models does so
since (planner/fused_activations.mla_bytes), added after Megatron-Core was found to refuse the all-to-all overlap
beside the MoE recomputation this row had been priced with; it counts what the modules free, no free parameter.

Three more were written after every row had been seen (the held-out mean was 12.1%): Grok-1's dgxc rows, which
publish no expert tensor parallelism, run Megatron-Core's default ETP = TP (default_etp; 9.0%), an all-to-all
overlapped with compute takes moe.COMM_SMS of the GPU's SMs from it (DeepSeek-V3's report; 8.4%), and FP8
experts behind the all-to-all dispatcher pay TE's padding copies (planner/fused_moe.py; 8.2%): each from the
software's or the report's figures, no free parameter.
A row whose table cells contradict the recipe its release ran carries that recipe's layout (``recipe_layout``,
with its source): Qwen3-30B-A3B at 26.02.01, whose table kept the 26.02 row's PP2/VP12/EP8 while the release's
recipe ran PP1/EP16 with HybridEP (read from Megatron-Bridge's history after the row was seen at +0.0% as
printed; priced as run it is -10.0%, beside the same recipe's 26.04 rows). Likewise, read after the rows
had been priced, the two PP2 rows whose VP 24 (and at 25.11 MBS 2) cells contradict their release's scripts:
Qwen3-30B-A3B 25.11 (v0.2.0: MBS 1, VP 12; -46.9% as printed, -30.3% as run) and 25.09's token-drop row (VP 12;
+14.8% as printed, +14.9% as run). Those dropless PP2 rows (25.11, 26.02) are the ones Megatron-Bridge issue
#1998 reports 2X slower than token drop: a regression NVIDIA fixed by a recipe change, its time host-bound
(a host sync per dropless dispatch beside the all-to-all overlap), which this model does not price.

Llama 4 Maverick's two dgxc rows (MoE every other layer) are priced since the specs have moe_layer_step: they were
first seen then, never fitted to (held out). So were six Megatron-Core rows found in round 2 (the MoE model zoo's
Qwen3-235B-A22B table with its dispatcher, overlap, FSDP and recomputation per row; dgxc v25.08's DeepSeek-V3):
LATE lists them and they are summarised apart as well. One choice was made after pricing them: keeping the
experts' linear weight-gradient traffic as it stands (planner/moe.py rank_view says what and why), which they
priced at 18.3% mean error scaled as physics says and 14.7% as kept.

Round 3, both after every row had been seen, each from the software's source with no free parameter: the FP8
recipe of Megatron-Bridge's rows (published.megatron_bridge_fp8_switches: per-tensor current scaling, --fp8-recipe
tensorwise, from 25.11 on and for 25.09's MoE runs; held out 9.8% -> 9.5%), and the all-to-all overlap paired
exchange by exchange with the compute stretch Megatron-Core's schedule runs beside it (moe.overlapped_layer_exchanges:
9.5% -> 9.7%); and 25.09's Qwen3 rows run without the all-to-all overlap (RECIPES_25_09, read from that release's
scripts after the rows had been priced with the later recipes' overlap: 9.7% -> 9.3%); FP8 casts of multi-head
latent attention's five linears (planner/fp8.mla_linears; they ran at the FP8 rate with no cast cost before:
DeepSeek-V3 25.09 -11.8% -> -8.1%, 9.3% -> 9.2%); GPT-OSS-120B's rows with its recipe's recomputation (--recompute
norm+act, written this round: RECIPE_RECOMPUTE) and 25.11's with its release's MBS 1 (recipe_layout; its table's
MBS 4 and GA 2 do not multiply out): 9.2% -> 9.3%, GPT-OSS now 14-17% fast in every release.

Round 4, the one fitted number: every row with Megatron-Core's paired all-to-all overlap on came out fast (the
Qwen3-235B-A22B rows 12-17%, the model zoo's overlapped row 16% beside its twin without the overlap at +1%,
DeepSeek-V3 25.09 5%) while the rows without it did not: the compute beside an exchange was priced as keeping all
the SMs the exchange leaves it. moe.PAIRED_OVERLAP_EFFICIENCY, the share of those it keeps, was fitted on one row,
Megatron-Bridge 26.04's Qwen3-235B-A22B (0.712; FIT, reported apart), and left there: held out 72 rows 9.0% ->
71 rows 8.1% (the 66 not marked suspicious 8.0% -> 7.1%); the other overlapped Qwen3-235B rows -4.5% to +1.5%,
the model zoo's -7.7%, DeepSeek-V3 25.09's +6.3%. The Qwen3-30B-A3B PP2 rows barely moved (-34.5% -> -32.6%):
their gap is not the overlap's.
Also in round 4, from the source with no free parameter: GPT-OSS's expert biases (spec field expert_bias;
Megatron-Core's TEGroupedMLP._apply_bias adds the second linear's expert by expert: planner/fused_moe.py), found in
round 3 and priced now: its Megatron-Bridge rows -14% to -17% -> -5.1% to -8.0%, held out 8.1% -> 7.5% (the 66 not
suspicious 6.5%). Then 26.02's DeepEP for Qwen3-30B-A3B's PP2 row (RECIPES_26_02): 7.6% (6.5%). Most of the
overlap fit's gain is on the fitted row's siblings (its layout in four other releases); without the siblings of any
fitted row, 54 held-out rows, 8.7% (printed). NeMo
Automodel's GPT-OSS-20B is not charged the loop (its experts are not TEGroupedMLP).
Round 5, from the source with no free parameter, after every row had been seen: DeepSeek-V3's node-limited
routing (spec fields moe_router_num_groups 8 / moe_router_group_topk 4, as Megatron-Bridge's DeepSeekV3ModelProvider
and NeMo set them): a deduplicating dispatcher (DeepEP, HybridEP) sends a token to fewer nodes (moe.
limited_destinations). dgxc v25.08's DeepSeek-V3 +22.7% -> +9.0%, Megatron-Bridge 25.09's +6.1% -> +0.6%;
Automodel's rows route with its fake balanced gate and do not move. With the recipe layouts above: held out 71 rows
7.6% -> 7.1%, the 67 not marked suspicious 6.6%, without the fitted rows' siblings 8.0%.

Megatron-Bridge's 25.09 token-drop rows are priced with its apply_moe_token_drop defaults (capacity factor 1.0,
padded to capacity: --moe-capacity-factor 1.0 --moe-pad-to-capacity), first in round 2 (LATE).

Round 3, NeMo Automodel's H100 table (its PyTorch FSDP2 + DeepEP stack): the ``nemo-automodel`` profile was
written from Automodel's source and benchmark configs (planner/framework.py NEMO_AUTOMODEL), then its five
expressible rows priced once and left as they came out (held out): the layout as the table prints it, ZeRO-3
without a pipeline and ZeRO-2 with one (FSDP2's reshard_after_forward = not pp_enabled at the rows' commit,
89e3a9fdd), full recomputation (activation_checkpointing), DeepSeek-V3 without its MTP layer (Automodel's model
had none then), GPT-OSS-20B's EP from its config of that commit (recipe_layout). First priced at 16.7% mean error
(DeepSeek-V3 on 256 GPUs +35%); two things read from the sources after that went into the model for every stack,
no free parameter: DeepEP sends a token once per GPU holding any of its experts (moe.deduplicated_dispatch), and
Automodel's benchmarks route with fake_balanced_gate, token t to experts t·k ... t·k + k - 1 (--moe-routing
consecutive, the switch these rows take: recipe()): 13.2%.

Rows left out, and why (printed too): B200 rows (no B200 spec), hybrid Mamba models (Nemotron 3: not a
transformer family here), rows without a layout (DeepSeek-V3 report, MoE Parallel Folding abstract, Megatron-Core
README), Automodel's GPT-OSS-120B (EP not published; its config of the day ran another layout).

Run: .venv/bin/python benchmarks/fidelity_moe.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published import megatron_bridge_fp8_switches  # noqa: E402

from paraplan.models import PRESETS as MODEL_PRESETS
from paraplan.models import load_model_spec, spec_from_mapping
from paraplan.planner.api import simulate
from paraplan.planner.errors import PlanError
from paraplan.planner.layout import Layout
from paraplan.planner.workload import Workload

DATA = Path(__file__).with_name("data") / "published_moe.yaml"
FRAMEWORK = "megatron-core"
AUTOMODEL = "nemo-automodel"  # NeMo Automodel's rows (its performance-summary table)
# the CLI's --recompute modes, least memory saved first
RECOMPUTE_ORDER = ("none", "selective", "mlp", "selective+mlp", "full")
# Rows the MoE choices were checked on before the others were looked at (see the module docstring).
# The third, Megatron-Bridge 26.04's Qwen3-235B-A22B, is what moe.PAIRED_OVERLAP_EFFICIENCY is fitted on.
FIT = ("dgxc-v24.11.1-grok1-314b-bf16-32gpu", "mbridge-26.04-h100-qwen3_30b_a3b-fp8-16gpu",
       "mbridge-26.04-h100-qwen3_235b_a22b-fp8-256gpu")
# Rows first priced in round 2, after the model above was written (Llama 4 Maverick once the specs had
# moe_layer_step; the model zoo's and dgxc v25.08's rows once found; the 25.09 token-drop rows once
# --moe-capacity-factor priced token dropping): summarised apart too.
LATE = ("dgxc-v25.05-llama4-maverick", "dgxc-v25.08-", "mcore-moe-modelzoo-",
        "mbridge-25.09-h100-qwen3_30b_a3b-tokendrop", "mbridge-25.09-h100-qwen3_235b_a22b-tokendrop")
# MoE settings of Megatron-Bridge's H100 performance recipes (scripts/performance/configs/qwen/
# qwen3_workload_base_configs.py and qwen3_llm_pretrain.py, deepseek/deepseek_workload_base_configs.py, at the
# commits the code search stores), applied to the rows whose layout is the recipe's: the token dispatcher
# (moe_token_dispatcher_type "flex" with moe_flex_dispatcher_backend "hybridep", or "alltoall"),
# moe_a2a_overlap, Qwen3's grad_reduce_in_fp32 = False (16-bit gradient buffers) and the optimizer's state
# precision, given as the CLI's switches (--moe-dispatcher, --moe-a2a-overlap, --grad-reduce-in-fp32,
# --optimizer-states). Rows of other layouts (earlier recipe versions) keep the profile's defaults (alltoall, no
# overlap, fp32 optimizer states).
RECIPES = {
    ("qwen3-30b-a3b", 1, 1, 16): dict(moe_dispatcher="hybridep", grad_reduce_in_fp32=False),
    # the 16-GPU pp2 layout of the 25.11 and 26.02 releases (Megatron-Bridge v0.2.0
    # scripts/performance/configs/qwen3/workload_base_configs.py QWEN3_30B_A3B_H100_*_BASE_CONFIG and v0.3.0
    # configs/qwen/qwen3_workload_base_configs.py QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_*_V1: moe_a2a_overlap=True;
    # v0.3.0 adds the DeepEP flex backend: RECIPES_26_02)
    ("qwen3-30b-a3b", 1, 2, 8): dict(moe_a2a_overlap=True),
    ("qwen3-235b-a22b", 2, 8, 32): dict(moe_a2a_overlap=True, grad_reduce_in_fp32=False),
    # DeepSeek-V3 on H100 at the 25.09 release (Megatron-Bridge scripts/performance/run_script.py at "Cherry pick
    # perf 2509", a28844195, 2025-10-15): DeepEP (flex dispatcher), A2A_1F1B = overlap_moe_expert_parallel_comm
    # with delay_wgrad_compute, recompute_modules mla_up_proj + mlp; its recipe (recipes/deepseek/deepseek_v3.py)
    # turns on the precision-aware optimizer with bf16 exp_avg / exp_avg_sq and fp32 main params, which Megatron
    # keeps itself under FP8 parameters (the default FP8 recipe "ds" sets fp8_param_gather): 4 + 2 + 2 bytes
    ("deepseek-v3 (dropless)", 2, 8, 64): dict(moe_dispatcher="hybridep", moe_a2a_overlap=True,
                                               optimizer_states="bf16-moments"),
    # Llama 4 Maverick in dgxc-benchmarking v25.05 (NeMo's scripts/performance/llm/pretrain_llama4_e128.py): NeMo's
    # Llama4Config (nemo/collections/llm/gpt/model/llama.py) sets moe_shared_expert_overlap True with the alltoall
    # dispatcher, which the performance script keeps
    ("llama4-maverick-400b-a17b", 4, 1, 128): dict(moe_shared_expert_overlap=True),
}
# Megatron-Bridge's 25.09 release (commit a28844195, "Cherry pick perf 2509") ran Qwen3 without the all-to-all
# overlap the later recipes above turn on: its run_script.py builds both Qwen3 recipes with
# CommOverlapConfig(tp_comm_overlap=True) alone, training/comm_overlap.py leaves overlap_moe_expert_parallel_comm off
# ("Optimizations disabled by default"), and its perf-matrix YAMLs (configs/qwen3/*_llm_pretrain.yaml) set only
# mixed_precision.grad_reduce_in_fp32: false besides the layout.
RECIPES_25_09 = {
    ("qwen3-30b-a3b", 1, 2, 8): dict(grad_reduce_in_fp32=False),
    ("qwen3-235b-a22b", 2, 8, 32): dict(grad_reduce_in_fp32=False),
}
# Megatron-Bridge's 26.02 release (v0.3.0: configs/qwen/qwen3_workload_base_configs.py
# QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1) runs the PP2 layout with DeepEP as well, moe_flex_dispatcher_backend
# "deepep" (training/flex_dispatcher_backend.py sets moe_token_dispatcher_type "flex" on Hopper): priced as
# --moe-dispatcher hybridep (read in round 4 after the row had been priced -33% with the alltoall dispatcher; -38%
# so). 25.11's v0.2.0 sets no flex backend.
RECIPES_26_02 = {
    ("qwen3-30b-a3b", 1, 2, 8): dict(moe_a2a_overlap=True, moe_dispatcher="hybridep"),
}
# A release's own recipes, where they differ from RECIPES for a layout (by row id prefix).
RELEASE_RECIPES = {"mbridge-25.09-": RECIPES_25_09, "mbridge-26.02-": RECIPES_26_02}
# The recomputation a recipe runs, where it names it (--recompute): GPT-OSS-120B's H100 recipe recomputes the
# separate norms and the experts' activation (recompute_modules ["layernorm", "moe_act"]: Megatron-Bridge v0.2.0
# scripts/performance/configs/gpt_oss/workload_base_configs.py GPT_OSS_120B_H100_BF16_BASE_CONFIG, v0.3.0 and v0.4.0
# configs/gpt_oss/gpt_oss_workload_base_configs.py GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1, all PP4, EP8).
RECIPE_RECOMPUTE = {("gpt-oss-120b", 1, 4, 8): "norm+act"}
# The Megatron-Bridge model names of the rows, as our presets (or specs built below).
PRESETS = {"qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-235b-a22b": "qwen3-235b-a22b", "deepseek-v3": "deepseek-v3",
           "deepseek-v3 (dropless)": "deepseek-v3"}


def grok(row: dict):
    """Grok-1 from the row's model_shape (NeMo's grok1_314b.yaml), truncated to the proxy's layer count: SwiGLU
    experts, Llama 3's tokenizer (128,256 ids)."""
    shape = row["model_shape"]
    return spec_from_mapping(dict(
        name=f"grok1-{row['num_layers']}l", family="llama", num_layers=row["num_layers"],
        hidden_size=shape["hidden_size"], ffn_hidden_size=shape["ffn_hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_kv_heads=shape["num_kv_heads"],
        num_experts=shape["num_experts"], experts_per_token=shape["experts_per_token"], vocab_size=128256,
        seq_length=row["seq_len"]), "published_moe.yaml")


def gpt_oss(row: dict, layers: int = 36, experts: int = 128):
    """GPT-OSS-120B (its config.json): 36 layers, h 2880, 64 query heads of 64, 8 K/V heads, 128 SwiGLU experts
    of 2880, top-4, 201,088 ids; GPT-OSS-20B the same with 24 layers and 32 experts (20.9B parameters); biases on
    the experts and the router (expert_bias: Megatron-Core adds the second linear's expert by expert) and on q, k
    and v. Not modelled: the sliding 128-token window of every other layer's attention (priced as full causal
    attention: its attention FLOPs overstated), attention sinks, the output projection's bias."""
    return spec_from_mapping(dict(
        name=f"gpt-oss-{'120b' if layers == 36 else '20b'}", family="llama", num_layers=layers, hidden_size=2880,
        num_attention_heads=64, head_dim=64, num_kv_heads=8, ffn_hidden_size=2880, num_experts=experts,
        experts_per_token=4, expert_bias=True, qkv_bias=True, vocab_size=201088, seq_length=row["seq_len"]),
        "published_moe.yaml")


def kimi_k2(row: dict):
    """Kimi K2 (moonshotai/Kimi-K2-Base config.json): DeepSeek-V3's architecture with 64 heads, 384 routed experts
    (top-8, one shared), one dense layer first, 163,840 ids, no multi-token prediction layer: 1.026T parameters,
    32.9B active (published: 1T, 32B)."""
    return spec_from_mapping(dict(
        name="kimi-k2", family="llama", num_layers=61, hidden_size=7168, num_attention_heads=64, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden_size=18432,
        moe_ffn_hidden_size=2048, num_experts=384, experts_per_token=8, num_shared_experts=1, dense_layers=1,
        moe_score_function="sigmoid", moe_routed_scaling_factor=2.827, vocab_size=163840,
        seq_length=row["seq_len"]), "published_moe.yaml")


def is_automodel(row: dict) -> bool:
    return "Automodel" in str(row.get("framework", ""))


def model_of(row: dict):
    """(spec, why not) for a row."""
    name = str(row.get("model", ""))
    if "B200" in str(row.get("gpu", "")) or "H100" not in str(row.get("gpu", "")):
        return None, "not an H100 run"
    if "nemotron" in name:
        return None, "hybrid Mamba-Transformer: no such family here"
    if is_automodel(row):
        if as_run(row).get("ep") in (None, "-"):
            return None, "expert parallelism not published (and the config at the table's commit ran another layout)"
        if name == "kimi-k2":
            return kimi_k2(row), ""
        if name == "gpt-oss-20b":
            return gpt_oss(row, layers=24, experts=32), ""
        if name == "deepseek-v3":  # Automodel's DeepSeek-V3 had no multi-token prediction module at the rows' commit
            return load_model_spec("deepseek-v3").replace(seq_length=row["seq_len"], mtp_layers=0), ""
    if "llama4-maverick" in name:  # the 48-layer model (the README's FLOPs per sample are the 48-layer model's)
        return load_model_spec("llama4-maverick").replace(seq_length=row["seq_len"]), ""
    if name.startswith("grok"):
        return grok(row), ""
    if name == "gpt-oss-120b":
        return gpt_oss(row), ""
    name = base_model(row)  # a token-drop row is priced with its recipe's token dropping (recipe())
    if "seq_len" not in row:
        return None, "no layout published (sequence length, parallel degrees)"
    if name in PRESETS or name in MODEL_PRESETS:
        return load_model_spec(PRESETS.get(name, name)).replace(seq_length=row["seq_len"]), ""
    return None, f"model {name} not available"


def as_run(row: dict) -> dict:
    """The row with the layout its release's recipe ran, where the table's cells contradict it (``recipe_layout``,
    with its ``recipe_source``; the published figures are kept)."""
    return {**row, **(row.get("recipe_layout") or {})}


def default_etp(row: dict) -> int:
    """The expert tensor parallelism of a row that publishes none: Megatron-Bridge's performance recipes set
    expert_tensor_parallel_size=1 (scripts/performance/configs: BASE_QWEN3_*, BASE_DEEPSEEK_V3_CONFIG); NVIDIA's
    dgxc-benchmarking Grok-1 recipes of v24.11.1 and v25.02 set none, so Megatron-Core's default applies, the
    tensor-parallel size (megatron/core/parallel_state.py, core_r0.10.0: "if expert_tensor_parallel_size is None:
    expert_tensor_parallel_size = tensor_model_parallel_size"); their README lists no ETP (v25.05's lists 1)."""
    return row["tp"] if str(row.get("id", "")).startswith("dgxc-") else 1


def row_dtype(row: dict) -> str:
    dtype = str(row.get("dtype") or row.get("dtype_published")).lower()
    return "fp8" if "fp8" in dtype else dtype  # FP8, FP8-CS, "not stated in table (FP8, see notes)"


def layout_of(row: dict) -> Layout:
    row = as_run(row)
    gpus, tp, pp, cp = row["gpus"], row["tp"], row["pp"], row.get("cp") or 1
    vp = row.get("vp")
    vp = vp if isinstance(vp, int) and vp > 1 and pp > 1 else 1
    dtype = row_dtype(row)
    fsdp = str(row.get("fsdp", "")).lower() in ("on", "1", "true")  # Megatron FSDP: parameters sharded too
    zero = 3 if fsdp else 1
    if is_automodel(row):  # FSDP2 with reshard_after_forward = not pp_enabled (moe/parallelizer.py at 89e3a9fdd)
        zero = 2 if pp > 1 else 3
    return Layout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=row["ep"], etp=row.get("etp") or default_etp(row),
                  micro_batch=row["micro_batch"], global_batch=row["global_batch"],
                  schedule="interleaved-1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                  sequence_parallel=tp > 1, zero=zero, dtype=dtype)


def published_step(row: dict) -> float | None:
    if isinstance(row.get("step_time_s"), int | float):
        return float(row["step_time_s"])
    per_gpu = row.get("tokens_per_s_per_gpu")
    if isinstance(per_gpu, int | float):
        return row["seq_len"] * row["global_batch"] / (per_gpu * row["gpus"])
    return None


def base_model(row: dict) -> str:
    """The row's model without its " (token-drop)" qualifier (Megatron-Bridge's 25.09 token-drop rows)."""
    return str(row.get("model", "")).replace(" (token-drop)", "")


def recipe(row: dict) -> dict:
    """The framework switches of the row's recipe: those the row itself publishes (``token_dispatcher``: DeepEP's
    flex dispatcher priced as --moe-dispatcher hybridep, else alltoall; ``ep_a2a_overlap``), else RECIPES' where
    its layout is the recipe's."""
    row = as_run(row)
    if is_automodel(row):  # the nemo-automodel profile is its DeepEP configs' stack; they route with fake_balanced_gate
        return dict(moe_routing="consecutive")
    if "token_dispatcher" in row:
        flex = any(x in str(row["token_dispatcher"]) for x in ("DeepEP", "flex", "HybridEP"))
        return dict(moe_dispatcher="hybridep" if flex else "alltoall", moe_a2a_overlap=bool(row.get("ep_a2a_overlap")))
    key = (base_model(row), row.get("tp"), row.get("pp"), row.get("ep"))
    release = next((r for prefix, r in RELEASE_RECIPES.items() if str(row.get("id", "")).startswith(prefix)), {})
    recipes = release if key in release else RECIPES
    switches = dict(recipes.get(key, {}))
    switches.update(megatron_bridge_fp8_switches(row["id"], row_dtype(row)))  # the release's FP8 recipe
    if base_model(row) != row.get("model"):  # Megatron-Bridge's apply_moe_token_drop defaults: c = 1.0, padded
        switches.update(moe_capacity_factor=1.0, moe_pad_to_capacity=True)
    return switches


def predict(row: dict, framework: str = FRAMEWORK):
    spec, why = model_of(row)
    if spec is None:
        return None, why
    if published_step(row) is None or not isinstance(row.get("tp"), int):
        return None, "no step time or layout"
    lay = layout_of(row)
    # the recipe's switches as the CLI takes them (--moe-dispatcher, --moe-a2a-overlap, --no-grad-reduce-in-fp32,
    # --optimizer-states)
    framework = AUTOMODEL if is_automodel(row) else framework
    work = Workload.create(spec, "dgx-h100", lay.global_batch, nodes=max(1, lay.num_gpus // 8), framework=framework,
                           **recipe(row))
    # The tables do not say what each run recomputed: the recipe's where it names it (RECIPE_RECOMPUTE), else the
    # lightest recomputation the layout fits with, as a user holding only the table would pick it (--recompute none,
    # selective, mlp, full in turn; the last if none fits)
    published = str(row.get("recompute_published", ""))
    run = as_run(row)
    by_recipe = RECIPE_RECOMPUTE.get((base_model(row), run.get("tp"), run.get("pp"), run.get("ep")))
    full = published.startswith("full") or is_automodel(row)  # Automodel's configs: activation_checkpointing true
    modes = ("full",) if full else (by_recipe,) if by_recipe else RECOMPUTE_ORDER
    for mode in modes:
        try:
            pred, _ = simulate(work, lay.replace(recompute=mode), event_sim=False)
        except PlanError as e:
            return None, f"cannot be priced: {e}"
        if pred.fits:
            break
    return (lay.replace(recompute=mode), pred), ""


def rows() -> list[dict]:
    return yaml.safe_load(DATA.read_text())["rows"]


def layout_key(row: dict) -> tuple:
    """A row's model and layout as run (its other releases share it: the same recipe, re-measured)."""
    run = as_run(row)
    return base_model(row), run.get("tp"), run.get("pp"), run.get("ep")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out, fitted, held, skipped = [], [], [], []
    for row in rows():
        got, why = predict(row)
        if got is None:
            skipped.append((row["id"], why))
            continue
        lay, pred = got
        ref = published_step(row)
        err = pred.iteration_time_s / ref - 1
        (fitted if row["id"] in FIT else held).append(abs(err))
        out.append(dict(id=row["id"], layout=lay.short(), predicted_s=pred.iteration_time_s, published_s=ref,
                        error=err, fit=row["id"] in FIT, fits_in_memory=pred.fits, mfu=pred.mfu,
                        ep_comm_s=pred.time_s.get("ep_comm", 0.0),
                        suspicious="SUSPICIOUS" in str(row.get("notes", "")), late=row["id"].startswith(LATE)))
    clean = [abs(r["error"]) for r in out if not r["fit"] and not r["suspicious"]]
    # the fitted rows' siblings (the same model and layout in other releases) say little about the fit's reach
    fitted_layouts = {layout_key(row) for row in rows() if row["id"] in FIT}
    sibling_ids = {row["id"] for row in rows() if layout_key(row) in fitted_layouts and row["id"] not in FIT}
    apart = [abs(r["error"]) for r in out if not r["fit"] and r["id"] not in sibling_ids]
    summary = dict(fitted=len(fitted), fitted_mean_abs_error=statistics.mean(fitted) if fitted else None,
                   held_out=len(held), held_out_mean_abs_error=statistics.mean(held) if held else None,
                   held_out_max_abs_error=max(held) if held else None,
                   held_out_within_25=sum(1 for e in held if e <= 0.25),
                   not_suspicious=len(clean), not_suspicious_mean_abs_error=statistics.mean(clean) if clean else None,
                   not_suspicious_within_25=sum(1 for e in clean if e <= 0.25),
                   not_fit_siblings=len(apart),
                   not_fit_siblings_mean_abs_error=statistics.mean(apart) if apart else None)
    late = [abs(r["error"]) for r in out if r["late"]]
    summary.update(late=len(late), late_mean_abs_error=statistics.mean(late) if late else None)
    if args.json:
        print(json.dumps(dict(rows=out, summary=summary, skipped=skipped), indent=1))
        return 0
    width = max(len(r["id"]) for r in out)
    print(f"{'run':{width}s} {'layout':52s} {'pred s':>8s} {'pub s':>8s} {'error':>7s}")
    for r in out:
        print(f"{r['id']:{width}s} {r['layout']:52s} {r['predicted_s']:8.3f} {r['published_s']:8.3f} "
              f"{100 * r['error']:+6.1f}%{' (fit)' if r['fit'] else ''}{' (suspicious)' if r['suspicious'] else ''}"
              f"{'' if r['fits_in_memory'] else ' (predicted OOM)'}")
    print(f"fitted: {summary['fitted']} runs, mean |error| {100 * (summary['fitted_mean_abs_error'] or 0):.1f}%")
    print(f"held out: {summary['held_out']} runs, mean |error| {100 * summary['held_out_mean_abs_error']:.1f}%, "
          f"max {100 * summary['held_out_max_abs_error']:.1f}%, {summary['held_out_within_25']} within 25%")
    print(f"held out, without the rows the data marks SUSPICIOUS: {summary['not_suspicious']} runs, mean |error| "
          f"{100 * summary['not_suspicious_mean_abs_error']:.1f}%, {summary['not_suspicious_within_25']} within 25%")
    print(f"held out, without the fitted rows' siblings (their model and layout in other releases): "
          f"{summary['not_fit_siblings']} runs, mean |error| {100 * summary['not_fit_siblings_mean_abs_error']:.1f}%")
    if late:
        print(f"of which first priced in round 2 (LATE): {summary['late']} runs, mean |error| "
              f"{100 * summary['late_mean_abs_error']:.1f}%")
    print("left out:")
    for rid, why in skipped:
        print(f"  {rid}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`paraplan export`: each target's file, checked by that framework's own parser where one installs on CPU.

- megatron: every flag is in Megatron-LM's parser (tests/data/megatron_args.txt, derived from its source at
  the commit named there); the sourced fragment's argv carries the plan's degrees, batches and stages.
- torchtitan: torchtitan 0.2's ConfigManager parses the TOML (and the command-line form, to the same config)
  with warnings as errors, and its ParallelDims accepts the degrees for the plan's world size.
- deepspeed: DeepSpeedConfig reads the JSON, with the data-parallel size given through an mpu.
- slurm: bash -n, shellcheck, and a dry run with stand-ins for srun/scontrol/paraplan.
Expected values come from the plans themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest
from torchtitan_ranks import bare_package, install_stand_ins

from conftest import ROOT, assert_one_line_error, run_cli
from paraplan.cli import main
from paraplan.models import ModelSpec, TransformerSpec, block_names, count_parameters, load_model_spec
from paraplan.planner.errors import PlanError
from paraplan.planner.exports import ExportRefused, export_plan, report_lines
from paraplan.planner.exports.common import StageShape
from paraplan.planner.exports.megatron import layout_string, stage_args
from paraplan.planner.plan import Plan

# Every flag the Megatron exporter can write (model shape, MoE/MLA, parallelism, stages, batch, precision,
# ZeRO, recomputation, run and data flags). Each must exist in Megatron-LM's parser.
MEGATRON_FLAGS = {
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
    "--max-position-embeddings", "--group-query-attention", "--num-query-groups", "--normalization", "--swiglu",
    "--position-embedding-type", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--kv-lora-rank", "--q-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--kv-channels", "--qk-layernorm", "--add-qkv-bias", "--mtp-num-layers", "--num-experts",
    "--moe-router-topk", "--moe-router-pre-softmax",
    "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
    "--moe-router-score-function", "--moe-router-topk-scaling-factor", "--moe-aux-loss-coeff",
    "--moe-router-load-balancing-type", "--moe-router-num-groups", "--moe-router-group-topk",
    "--moe-router-enable-expert-bias",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--sequence-parallel",
    "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--micro-batch-size",
    "--global-batch-size", "--bf16", "--fp16", "--fp8-format", "--use-distributed-optimizer", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--ckpt-format", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--recompute-modules", "--train-iters", "--lr", "--save", "--load", "--save-interval",
    "--mock-data", "--tokenizer-type", "--vocab-size", "--make-vocab-size-divisible-by", "--attention-dropout",
    "--hidden-dropout", "--grad-reduce-in-bf16", "--use-precision-aware-optimizer",
    "--exp-avg-dtype", "--exp-avg-sq-dtype", "--overlap-grad-reduce", "--overlap-param-gather",
    "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-grouped-gemm",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--fp8-param-gather",
    "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity", "--rotary-base", "--norm-epsilon",
    "--use-rope-scaling", "--rope-scaling-factor", "--no-gradient-accumulation-fusion", "--init-model-with-meta-device",
}


def cli(*args: str) -> subprocess.CompletedProcess:
    """``paraplan ARGS`` in this process (the planner and torch are imported once); run_cli runs a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def megatron_parser_flags() -> set[str]:
    lines = (ROOT / "tests" / "data" / "megatron_args.txt").read_text().splitlines()
    return {x for x in lines if x and not x.startswith("#")}


def _simulate(path: Path, *layout: str) -> Plan:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch",
                     "64", *layout, "--write-plan", str(path), "--json"])
    assert code == 0
    return Plan.read(str(path))


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, tuple[Plan, Path]]:
    """The two plans of the issue, written by the planner: a 3D one and a ZeRO-3 one."""
    d = tmp_path_factory.mktemp("plans")
    p3d = _simulate(d / "3d.json", "--dp", "2", "--tp", "2", "--pp", "4", "--micro-batch", "1", "--schedule",
                    "interleaved-1f1b", "--virtual-stages", "2", "--zero", "1", "--recompute", "selective",
                    "--sequence-parallel")
    pz3 = _simulate(d / "z3.json", "--dp", "16", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--zero", "3",
                    "--recompute", "full")
    return {"3d": (p3d, d / "3d.json"), "z3": (pz3, d / "z3.json")}


def variant(plan: Plan, path: Path, **layout) -> tuple[Plan, Path]:
    """The plan with some layout fields changed (stages kept: same pp x virtual stages), written next to it."""
    new = plan.replace(layout=plan.layout.replace(**layout))
    out = path.with_name(f"{path.stem}-{'-'.join(f'{k}{v}' for k, v in layout.items())}.json")
    new.write(str(out))
    return new, out


def even_stages(spec: ModelSpec, num_stages: int) -> list[list[str]]:
    """``spec``'s blocks as ``execute`` names them, in ``num_stages`` contiguous stages as even as can be: the stages
    of a plan that covers the model (a plan whose model or pp x virtual stages a test changes needs new ones)."""
    blocks = block_names(spec)
    per, extra = divmod(len(blocks), num_stages)
    ends = [sum(per + (i < extra) for i in range(k + 1)) for k in range(num_stages)]
    return [blocks[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def flag_values(argv: list[str]) -> dict[str, str | None]:
    """--flag value / --switch pairs of an argv."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def megatron_argv(script: Path, **env: str) -> list[str]:
    p = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "${MEGATRON_ARGS[@]}"', "_", str(script)],
                       capture_output=True, text=True, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def megatron_export(plan: Plan, tmp_path: Path, spec=None) -> tuple[dict[str, str | None], list[str]]:
    result = export_plan(plan, "megatron", "plan.json", spec)
    script = tmp_path / "megatron.sh"
    script.write_text(result.text)
    argv = megatron_argv(script)
    flags = flag_values(argv)
    assert not set(flags) - MEGATRON_FLAGS, sorted(set(flags) - MEGATRON_FLAGS)  # every flag written is listed
    return flags, result.notes


def unrolled_layout(text: str) -> list[str]:
    """Megatron's reading of --pipeline-model-parallel-layout: commas dropped, x*n unrolled, '|' splits."""
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text.replace(",", ""))
    return text.split("|")


def plan_layout(plan: Plan) -> list[str]:
    return [("E" if "embed" in s else "") + "t" * sum(n.startswith("layers.") for n in s) + ("L" if "head" in s else "")
            for s in plan.stages]


# ---------------------------------------------------------------- megatron


def test_megatron_3d_plan_as_pretrain_gpt_arguments(plans, tmp_path):
    plan, path = plans["3d"]
    lay = plan.layout
    out = tmp_path / "megatron.sh"
    p = cli("export", "--plan", str(path), "--to", "megatron", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert os.access(out, os.X_OK) and "bash" in p.stdout and str(out) in p.stdout
    argv = megatron_argv(out)
    f = flag_values(argv)
    assert not set(f) - MEGATRON_FLAGS, sorted(set(f) - MEGATRON_FLAGS)
    assert f["--tensor-model-parallel-size"] == str(lay.tp) and f["--pipeline-model-parallel-size"] == str(lay.pp)
    assert f["--micro-batch-size"] == str(lay.micro_batch) and f["--global-batch-size"] == str(lay.global_batch)
    assert "--sequence-parallel" in f and "--use-distributed-optimizer" in f and "--bf16" in f
    assert f["--recompute-granularity"] == "selective"
    layout = unrolled_layout(f["--pipeline-model-parallel-layout"])
    assert len(layout) == lay.pp * lay.virtual_stages and layout == plan_layout(plan)
    spec = load_model_spec("llama3-8b")
    assert f["--num-layers"] == str(spec.num_layers) and f["--num-query-groups"] == str(spec.kv_heads)
    # Megatron's NullTokenizer adds an end-of-document id, and pads to --make-vocab-size-divisible-by x tp: the
    # plan's vocabulary exactly; no dropout (Megatron's default 0.1), as the model priced
    assert int(f["--vocab-size"]) + 1 == spec.vocab_size and f["--seq-length"] == str(plan.seq_length)
    assert spec.vocab_size % (int(f["--make-vocab-size-divisible-by"]) * lay.tp) == 0
    assert f["--attention-dropout"] == f["--hidden-dropout"] == "0"
    # the data-parallel size Megatron derives: world size / (tp x pp x cp) = the plan's dp
    model_parallel = int(f["--tensor-model-parallel-size"]) * int(f["--pipeline-model-parallel-size"])
    assert lay.world_size // model_parallel == lay.dp
    text = out.read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in text and "--nproc-per-node 8" in text and "NNODES:-2" in text
    check_shell(out)


def test_megatron_flags_exist_in_megatron_lm():
    known = megatron_parser_flags()
    assert len(known) > 500  # the whole parser, not a hand-picked list
    assert not MEGATRON_FLAGS - known, sorted(MEGATRON_FLAGS - known)


@pytest.mark.parametrize("split,expected", [
    ([(True, 8, False), (False, 8, False), (False, 8, False), (False, 8, True)], []),
    ([(True, 4, False)] + [(False, 4, False)] * 6 + [(False, 4, True)],
     [("--num-virtual-stages-per-pipeline-rank", 2)]),
    ([(True, 6, False), (False, 10, False), (False, 10, False), (False, 6, True)],
     [("--decoder-first-pipeline-num-layers", 6), ("--decoder-last-pipeline-num-layers", 6)]),
    ([(True, 0, False), (False, 12, False), (False, 12, False), (False, 8, True)],
     [("--pipeline-model-parallel-layout", "E|t*12|t*12|t*8,L")]),
])
def test_megatron_stage_flags_state_the_boundaries_exactly(split, expected):
    shapes = [StageShape(*s) for s in split]
    pp = 4
    args = stage_args(shapes, 32, pp, len(shapes) // pp)
    assert args == expected
    assert unrolled_layout(layout_string(shapes)) == [("E" if e else "") + "t" * n + ("L" if h else "")
                                                      for e, n, h in split]


def test_megatron_zero3_full_recompute_and_uneven_pipeline(plans, tmp_path):
    plan, _ = plans["z3"]
    f, _ = megatron_export(plan, tmp_path)
    assert "--use-megatron-fsdp" in f and f["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert f["--ckpt-format"] == "fsdp_dtensor" and f["--pipeline-model-parallel-size"] == "1"
    assert (f["--recompute-granularity"], f["--recompute-method"], f["--recompute-num-layers"]) == ("full", "uniform",
                                                                                                    "1")
    zero2, _ = variant(plan, Path(tmp_path / "z3.json"), zero=2)
    f, notes = megatron_export(zero2, tmp_path)
    assert f["--data-parallel-sharding-strategy"] == "optim_grads" and any("ZeRO-2" in n for n in notes)
    # as NVIDIA's Megatron-FSDP scripts run it (examples/megatron_fsdp), whatever stack the plan was priced for
    fsdp = {"--use-distributed-optimizer", "--no-gradient-accumulation-fusion", "--init-model-with-meta-device"}
    assert fsdp <= set(f)
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & set(f)  # priced for this executor: no overlap
    f, _ = megatron_export(zero2.replace(framework="megatron-core"), tmp_path)
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--use-megatron-fsdp"} <= set(f)
    # per-stage recomputation: one mode for all (the strongest), said in a note
    p3d, _ = plans["3d"]
    mixed = p3d.replace(stage_recompute=["full"] + ["none"] * (len(p3d.stages) - 1))
    f, notes = megatron_export(mixed, tmp_path)
    assert f["--recompute-granularity"] == "full" and any("per stage" in n for n in notes)
    # MLP recomputation: Megatron-Core's per-module recomputation of dense MLPs and MoE blocks, two words
    mlp = p3d.replace(layout=p3d.layout.replace(recompute="mlp"), stage_recompute=None)
    script = tmp_path / "mlp.sh"
    script.write_text(export_plan(mlp, "megatron", "plan.json").text)
    argv = megatron_argv(script)
    at = argv.index("--recompute-modules")
    assert argv[at + 1:at + 3] == ["mlp", "moe"] and argv[argv.index("--recompute-granularity") + 1] == "selective"
    # fp8, context parallelism, 1F1B with the planner's uneven split
    one = p3d.replace(layout=p3d.layout.replace(schedule="1f1b", virtual_stages=1, dtype="fp8", cp=2, dp=1),
                      stages=[p3d.stages[0] + p3d.stages[1], p3d.stages[2] + p3d.stages[3],
                              p3d.stages[4] + p3d.stages[5], p3d.stages[6] + p3d.stages[7]])
    f, _ = megatron_export(one, tmp_path)
    assert f["--fp8-format"] == "hybrid" and "--bf16" in f and f["--context-parallel-size"] == "2"
    counts = [sum(n.startswith("layers.") for n in s) for s in one.stages]
    assert (f["--decoder-first-pipeline-num-layers"], f["--decoder-last-pipeline-num-layers"]) == (str(counts[0]),
                                                                                                   str(counts[-1]))


def test_megatron_carries_a_config_json_s_rope_and_norm(plans, tmp_path):
    """A plan of a Llama 3.1 config.json (RoPE base 500,000, llama3 scaling by 8, RMSNorm eps 1e-5) exports them as
    --rotary-base, --use-rope-scaling --rope-scaling-factor and --norm-epsilon (Megatron's defaults would train
    another model: base 10,000, no scaling); a preset named after a released model carries its published ones
    (llama3-8b: Llama 3.1 8B's config.json, as torchtitan's 8B flavor has them); another keeps Megatron's
    defaults, which are paraplan's own."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 1024,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_model_spec(str(path))
    plan, _ = plans["z3"]
    ours = plan.replace(model=str(path), model_spec=spec.to_dict(), stages=even_stages(spec, plan.layout.pp))
    flags, _ = megatron_export(ours, tmp_path, spec)
    assert (flags["--rotary-base"], flags["--norm-epsilon"], flags["--rope-scaling-factor"]) == ("500000", "1e-06",
                                                                                                  "8.0")
    assert "--use-rope-scaling" in flags
    # the same HF config under another name (the planner reads any .json with a model_type as one)
    renamed = tmp_path / "llama31-small.json"
    renamed.write_text(json.dumps(config))
    flags, _ = megatron_export(ours.replace(model=str(renamed)), tmp_path, spec)
    assert (flags["--rotary-base"], flags["--norm-epsilon"]) == ("500000", "1e-06")
    flags, _ = megatron_export(plan, tmp_path)
    assert plan.model == "llama3-8b" and "--use-rope-scaling" in flags
    assert (flags["--rotary-base"], flags["--norm-epsilon"], flags["--rope-scaling-factor"]) == ("500000", "1e-05",
                                                                                                  "8.0")
    tiny_spec = load_model_spec("llama-tiny")
    tiny = plan.replace(model="llama-tiny", model_spec=tiny_spec.to_dict(),
                        stages=even_stages(tiny_spec, plan.layout.pp))
    flags, _ = megatron_export(tiny, tmp_path, tiny_spec)
    assert "--rotary-base" not in flags and "--norm-epsilon" not in flags


def test_megatron_moe_model_flags(plans, tmp_path):
    @dataclasses.dataclass(frozen=True)
    class MoESpec(TransformerSpec):  # the MoE fields of DESIGN.md's model spec
        num_experts: int = 0
        experts_per_token: int | None = None
        moe_ffn_hidden_size: int | None = None
        num_shared_experts: int = 0
        dense_layers: int = 0
        moe_score_function: str = "softmax"
        moe_routed_scaling_factor: float = 1.0
        moe_aux_loss_coeff: float = 0.01

    spec = MoESpec(name="moe", family="llama", num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=1000,
                   seq_length=1024, num_kv_heads=4, ffn_hidden_size=1024, num_experts=16, experts_per_token=2,
                   moe_ffn_hidden_size=256, num_shared_experts=1, dense_layers=1, moe_score_function="sigmoid")
    plan, _ = plans["z3"]
    moe = plan.replace(model="moe", model_spec=None, layout=plan.layout.replace(ep=4, etp=1, zero=1),
                       stages=even_stages(spec, 1))
    f, _ = megatron_export(moe, tmp_path, spec)
    assert (f["--num-experts"], f["--moe-router-topk"], f["--moe-ffn-hidden-size"]) == ("16", "2", "256")
    assert f["--expert-model-parallel-size"] == "4" and f["--expert-tensor-parallel-size"] == "1"
    assert f["--moe-layer-freq"] == "([0]*1+[1]*7)" and f["--moe-shared-expert-intermediate-size"] == "256"
    assert f["--moe-router-score-function"] == "sigmoid"
    # the plan's auxiliary loss is per sequence (models/moe.py); Megatron-Core's default, aux_loss, per micro-batch
    assert (f["--moe-aux-loss-coeff"], f["--moe-router-load-balancing-type"]) == ("0.01", "seq_aux_loss")
    # priced for this executor: Megatron's own defaults, but the dispatcher is stated (Megatron's is allgather)
    assert f["--moe-token-dispatcher-type"] == "alltoall" and "--overlap-moe-expert-parallel-comm" not in f
    core = moe.replace(framework="megatron-core", framework_switches={"moe_dispatcher": "hybridep",
                                                                       "moe_a2a_overlap": True},
                       layout=moe.layout.replace(recompute="none"), stage_recompute=None)  # the overlap needs it
    f, _ = megatron_export(core, tmp_path, spec)
    assert (f["--moe-token-dispatcher-type"], f["--moe-flex-dispatcher-backend"]) == ("flex", "hybridep")
    assert {"--moe-grouped-gemm", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"} <= set(f)
    assert "--moe-expert-capacity-factor" not in f  # dropless
    dropping = core.replace(framework_switches={"moe_capacity_factor": 1.25, "moe_pad_to_capacity": True})
    f, _ = megatron_export(dropping, tmp_path, spec)
    assert f["--moe-expert-capacity-factor"] == "1.25" and "--moe-pad-expert-input-to-capacity" in f


def test_megatron_runs_the_stack_the_plan_was_priced_for(plans, tmp_path):
    """A plan priced for Megatron-Core (16-bit gradients, overlapped distributed optimizer) exports the flags that
    make Megatron-LM run that (it would otherwise accumulate bf16 runs' gradients in fp32 and overlap nothing);
    --optimizer-states bf16-moments adds the precision-aware optimizer. A plan priced for this executor gets none."""
    plan, _ = plans["3d"]  # bf16, dp 2, ZeRO-1
    f, _ = megatron_export(plan, tmp_path)
    assert not {"--grad-reduce-in-bf16", "--overlap-grad-reduce", "--use-precision-aware-optimizer"} & set(f)
    core = plan.replace(framework="megatron-core")
    f, notes = megatron_export(core, tmp_path)
    assert {"--grad-reduce-in-bf16", "--overlap-grad-reduce", "--overlap-param-gather"} <= set(f)
    assert "--use-precision-aware-optimizer" not in f
    f, notes = megatron_export(core.replace(framework_switches={"optimizer_states": "bf16-moments",
                                                                "grad_reduce_in_fp32": True}), tmp_path)
    assert (f["--exp-avg-dtype"], f["--exp-avg-sq-dtype"]) == ("bf16", "bf16")
    assert "--use-precision-aware-optimizer" in f and "--grad-reduce-in-bf16" not in f
    assert any("remainders" in n for n in notes)
    f, notes = megatron_export(core.replace(layout=plan.layout.replace(dtype="fp8"),
                                            framework_switches={"optimizer_states": "bf16"}), tmp_path)
    assert {"--fp8-format", "--fp8-param-gather", "--use-precision-aware-optimizer"} <= set(f)
    assert any("fp32 one" in n for n in notes)  # FP8 parameters: Megatron keeps the master whole


def test_plan_records_the_framework_switches_it_was_priced_with(tmp_path):
    """simulate --write-plan keeps --optimizer-states and the MoE switches in plan.json (framework_switches), so the
    plan priced again (what execute --dry-run and validate compare with) is the plan priced; a plan with a switch
    its stack cannot run, or an unknown one, is refused in one line naming the file."""
    from paraplan.planner.api import predict_plan

    path = tmp_path / "plan.json"
    args = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
            "--seq-len", "1024", "--dp", "16", "--tp", "1", "--pp", "1", "--ep", "16", "--micro-batch", "1",
            "--zero", "1", "--framework", "megatron-core", "--moe-a2a-overlap", "--optimizer-states", "bf16-moments",
            "--write-plan", str(path), "--json"]
    p = cli(*args)
    assert p.returncode == 0, p.stderr
    simulated = json.loads(p.stdout)
    plan = Plan.read(str(path))
    assert plan.framework_switches == {"moe_a2a_overlap": True, "optimizer_states": "bf16-moments"}
    again = predict_plan(plan)
    assert again.iteration_time_s == pytest.approx(simulated["iteration_time_s"], rel=1e-9)
    assert again.peak_memory_gib == pytest.approx(simulated["peak_memory_gib"], rel=1e-9)
    plain = cli(*args[:args.index("--moe-a2a-overlap")], "--json")
    assert json.loads(plain.stdout)["peak_memory_gib"] > simulated["peak_memory_gib"]
    data = json.loads(path.read_text())
    for switches, words in (({"optimizer_states": "fp4"}, "--optimizer-states must be one of"),
                            ({"overlap_everything": True}, "unknown framework switch 'overlap_everything'"),
                            ({"moe_a2a_overlap": "yes"}, "wrong type"),
                            ({"moe_capacity_factor": True}, "wrong type"),
                            ({"moe_capacity_factor": 0}, "--moe-capacity-factor must be a positive number"),
                            ({"moe_pad_to_capacity": True}, "give --moe-capacity-factor too")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**data, "framework_switches": switches}))
        assert_one_line_error(cli("export", "--plan", str(bad), "--to", "megatron"), str(bad), words)
    bad.write_text(json.dumps({**data, "framework": "paraplan", "framework_switches": {"moe_a2a_overlap": True}}))
    assert_one_line_error(cli("export", "--plan", str(bad), "--to", "megatron"), "--moe-a2a-overlap", "paraplan")


def test_megatron_refuses_what_it_cannot_express(plans, tmp_path):
    plan, path = plans["3d"]
    _, zbv = variant(plan, path, schedule="zb-v")
    p = cli("export", "--plan", str(zbv), "--to", "megatron")
    assert_one_line_error(p, "megatron cannot express the zb-v schedule")
    assert p.returncode == 2 and not p.stdout
    bert_spec = load_model_spec("bert-large")
    bert = plan.replace(model="bert-large", model_spec=bert_spec.to_dict(),
                        stages=even_stages(bert_spec, plan.layout.num_stages))
    with pytest.raises(ExportRefused, match="bert"):
        export_plan(bert, "megatron")
    ps = plan.replace(layout=plan.layout.replace(dp_mode="ps", ps_servers=2, zero=0, dp=1))  # 8 + 2 of 16 GPUs
    with pytest.raises(ExportRefused, match="parameter servers"):
        export_plan(ps, "megatron")


# ---------------------------------------------------------------- torchtitan


@pytest.fixture(scope="module")
def torchtitan_config():
    """torchtitan 0.2's ConfigManager, imported without the package __init__ (which needs its training deps)."""
    found = importlib.util.find_spec("torchtitan")
    if found is None:
        pytest.fail("torchtitan is not installed: make setup installs it (pip install --no-deps torchtitan==0.2.2 "
                    "tyro docstring-parser typeguard)")
    bare_package()
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools.logging import logger

    return ConfigManager, ParallelDims, logger


def parse_torchtitan(tools, toml_text: str | None, tmp_path: Path, world_size: int, args: list[str] = ()):
    """ConfigManager.parse_args on the TOML (or on command-line ``args``), warnings (Python's and torchtitan's
    log) as errors, then ParallelDims for the world size, as torchtitan's trainer builds it."""
    config_manager, parallel_dims, logger = tools
    if toml_text is not None:
        path = tmp_path / "torchtitan.toml"
        path.write_text(toml_text)
        args = ["--job.config_file", str(path)]
        assets = tomllib.loads(toml_text)["model"]["hf_assets_path"]
    else:
        assets = args[list(args).index("--model.hf_assets_path") + 1]
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # the flavor's HF assets folder is relative; torchtitan warns when it is missing
        (tmp_path / assets).mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = config_manager().parse_args(list(args))
    finally:
        os.chdir(cwd)
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]
    p = cfg.parallelism
    dims = parallel_dims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                         cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                         ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size)
    return cfg, dims


@pytest.fixture(scope="module")
def torchtitan_models(torchtitan_config):
    """torchtitan's model registry (get_train_spec, register_train_spec's table), with stand-ins for the
    training-only modules that do not import here (tests/torchtitan_ranks.install_stand_ins)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script_method, used by torch modules it loads
        install_stand_ins()
        from torchtitan.protocols import train_spec

        for model in ("llama3", "llama4", "qwen3", "deepseek_v3"):
            importlib.import_module(f"torchtitan.models.{model}")
    return train_spec


def check_flavor_module(registry, module_path: Path, cfg, spec: TransformerSpec, forward: bool = False):
    """Import the exported flavor module as torchtitan's trainer does (custom_import, then get_train_spec and the
    flavor's args updated from the job config), build the model on the meta device and check it has the plan's
    parameter count (``forward``: then run it); returns the train spec and the model."""
    import torch

    assert cfg.experimental.custom_import == module_path.stem
    found = importlib.util.spec_from_file_location(module_path.stem, module_path)
    module = importlib.util.module_from_spec(found)
    try:
        found.loader.exec_module(module)
        train_spec = registry.get_train_spec(cfg.model.name)
    finally:
        registry._extra_train_specs.pop(cfg.model.name, None)  # each test registers its own
    assert (module.NAME, module.FLAVOR) == (cfg.model.name, cfg.model.flavor) == (module.NAME, spec.name)
    args = train_spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = train_spec.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(spec) == module.NUM_PARAMETERS
    assert cfg.parallelism.pipeline_parallel_degree == 1 or train_spec.pipelining_fn is not None
    if forward:  # a real step's forward pass on the CPU (torchtitan's MoE routing needs a GPU: dense models only)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
            logits = model(torch.randint(0, spec.vocab_size, (2, cfg.training.seq_len)))  # (b, s, V)
        assert logits.shape == (2, cfg.training.seq_len, spec.vocab_size) and torch.isfinite(logits).all()
    return train_spec, model


def _tiny_plan(path: Path, model: str, *layout: str, batch: str = "16") -> Plan:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["simulate", "--model", model, "--cluster", "dgx-h100", "--global-batch", batch, "--micro-batch",
                     "2", *layout, "--write-plan", str(path), "--json"])
    assert code == 0
    return Plan.read(str(path))


def export_torchtitan(tmp_path: Path, plan: Plan, name: str, tools) -> tuple[subprocess.CompletedProcess, object]:
    """``paraplan export --to torchtitan --out <tmp>/<name>.toml`` of ``plan``, and torchtitan's reading of it."""
    plan_path = tmp_path / f"{name}.json"
    plan.write(str(plan_path))
    p = cli("export", "--plan", str(plan_path), "--to", "torchtitan", "--out", str(tmp_path / f"{name}.toml"))
    assert p.returncode == 0, p.stderr
    cfg, _ = parse_torchtitan(tools, (tmp_path / f"{name}.toml").read_text(), tmp_path, plan.layout.world_size)
    return p, cfg


def test_torchtitan_reads_the_3d_and_zero3_plans(plans, tmp_path, torchtitan_config):
    plan, path = plans["3d"]
    lay = plan.layout
    out = tmp_path / "3d.toml"
    p = cli("export", "--plan", str(path), "--to", "torchtitan", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "note: ZeRO-1 runs as FSDP2" in p.stderr  # torchtitan has no ZeRO-1: said, not hidden
    cfg, dims = parse_torchtitan(torchtitan_config, out.read_text(), tmp_path, lay.world_size)
    par, tr = cfg.parallelism, cfg.training
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp) == (lay.dp, lay.tp, lay.pp, lay.cp)
    assert par.pipeline_parallel_schedule == "Interleaved1F1B"
    assert par.pipeline_parallel_microbatch_size == lay.micro_batch
    assert tr.global_batch_size == lay.global_batch
    assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == lay.num_micro_batches
    assert tr.seq_len == plan.seq_length and cfg.model.flavor == "8B"
    parts = par.module_fqns_per_model_part
    assert len(parts) == lay.pp * lay.virtual_stages
    assert [sum(n.startswith("layers.") for n in part) for part in parts] == \
        [sum(n.startswith("layers.") for n in s) for s in plan.stages]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert cfg.activation_checkpoint.mode == "selective"
    # torchtitan's op-level policy is not the plan's selective recomputation: said, not hidden; a plan priced for
    # torchtitan priced that policy (planner/op_sac.py): nothing to say
    assert "is not the plan's selective recomputation" in " ".join(p.stderr.split())
    from paraplan.planner.exports.torchtitan import activation_checkpoint

    notes: list[str] = []
    titan = __import__("dataclasses").replace(plan, framework="torchtitan")
    assert activation_checkpoint(titan, notes) == {"mode": "selective", "selective_ac_option": "op"} and not notes

    z3, _ = plans["z3"]
    cfg, dims = parse_torchtitan(torchtitan_config, export_plan(z3, "torchtitan").text, tmp_path,
                                 z3.layout.world_size)
    assert (dims.dp_shard, dims.dp_replicate, dims.tp, dims.pp) == (z3.layout.dp, 1, 1, 1)
    assert cfg.parallelism.fsdp_reshard_after_forward == "default"  # ZeRO-3: reshard after forward
    assert cfg.training.local_batch_size == z3.layout.micro_batch and cfg.training.global_batch_size == 64
    assert cfg.activation_checkpoint.mode == "full"


def test_torchtitan_zbv_fp8_and_pure_data_parallel(plans, tmp_path, torchtitan_config):
    plan, path = plans["3d"]
    zbv = plan.replace(layout=plan.layout.replace(schedule="zb-v", dtype="fp8"))
    cfg, _ = parse_torchtitan(torchtitan_config, export_plan(zbv, "torchtitan").text, tmp_path, plan.layout.world_size)
    assert cfg.parallelism.pipeline_parallel_schedule == "ZBVZeroBubble"
    assert cfg.model.converters == ["quantize.linear.float8"]
    z3, _ = plans["z3"]
    ddp = z3.replace(layout=z3.layout.replace(zero=0, recompute="none"))
    result = export_plan(ddp, "torchtitan")
    cfg, dims = parse_torchtitan(torchtitan_config, result.text, tmp_path, z3.layout.world_size)
    assert (dims.dp_replicate, dims.dp_shard) == (z3.layout.dp, 1) and not result.notes  # plain DDP, as planned
    assert cfg.activation_checkpoint.mode == "none"


def test_torchtitan_command_line_form_is_the_same_config(plans, tmp_path, torchtitan_config):
    plan, path = plans["3d"]
    out = tmp_path / "torchtitan.sh"
    p = cli("export", "--plan", str(path), "--to", "torchtitan-cli", "--out", str(out))
    assert p.returncode == 0, p.stderr
    check_shell(out)
    got = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "${TORCHTITAN_ARGS[@]}"', "_", str(out)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    from_cli, _ = parse_torchtitan(torchtitan_config, None, tmp_path, plan.layout.world_size, got)
    from_toml, _ = parse_torchtitan(torchtitan_config, export_plan(plan, "torchtitan").text, tmp_path,
                                    plan.layout.world_size)
    from_toml.job.config_file = None
    assert from_cli.to_dict() == from_toml.to_dict()
    assert from_cli.parallelism.tensor_parallel_degree == plan.layout.tp


def test_torchtitan_trains_any_dense_llama_through_a_flavor_module(plans, tmp_path, torchtitan_config,
                                                                  torchtitan_models):
    """A model without a registered flavor: the TOML names a flavor module written beside it, which registers
    torchtitan's llama3 with the plan's exact shape (layers, widths, heads, SwiGLU width, vocabulary)."""
    plan = _tiny_plan(tmp_path / "p.json", "llama-tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--schedule",
                      "1f1b", "--sequence-parallel")
    p, cfg = export_torchtitan(tmp_path, plan, "job", torchtitan_config)
    assert str(tmp_path / "job_model.py") in p.stdout and "PYTHONPATH=" + str(tmp_path) in p.stdout
    assert "hf_assets_path (./assets/hf/llama-tiny)" in p.stderr  # the tokenizer it needs: said
    assert (cfg.model.name, cfg.model.flavor, cfg.experimental.custom_import) == ("paraplan_llama3", "llama-tiny",
                                                                                  "job_model")
    spec = load_model_spec("llama-tiny")
    train_spec, model = check_flavor_module(torchtitan_models, tmp_path / "job_model.py", cfg, spec, forward=True)
    assert model.layers["0"].feed_forward.w1.weight.shape == (spec.ffn_size, spec.hidden_size)
    assert model.layers["0"].attention.wk.weight.shape == (spec.kv_heads * spec.head_dim, spec.hidden_size)
    assert model.freqs_cis.shape == (plan.seq_length or spec.seq_length, spec.head_dim // 2)
    assert [sum(n.startswith("layers.") for n in part) for part in cfg.parallelism.module_fqns_per_model_part] == \
        [sum(n.startswith("layers.") for n in s) for s in plan.stages]
    # plain RoPE, base 10000, as paraplan's LLaMA: the scaling is off
    args = train_spec.model_args["llama-tiny"]
    assert (args.rope_theta, args.rope_scaling_args.scaling_factor, args.norm_eps) == (10000.0, 1.0, 1e-5)

    # a full-size model: LLaMA 2 7B's SwiGLU width 11008 is no llama3 flavor's; built exactly
    z3, _ = plans["z3"]
    llama2 = z3.replace(model="llama2-7b", model_spec=load_model_spec("llama2-7b").to_dict())
    _, cfg = export_torchtitan(tmp_path, llama2, "llama2", torchtitan_config)
    _, model = check_flavor_module(torchtitan_models, tmp_path / "llama2_model.py", cfg, load_model_spec("llama2-7b"))
    assert model.layers["0"].feed_forward.w1.weight.shape == (11008, 4096)


def test_torchtitan_trains_a_gpt_plan_as_paraplans_gpt(tmp_path, torchtitan_config, torchtitan_models):
    """torchtitan has no gpt model: the flavor module registers paraplan's (executor/torchtitan_gpt.py) in
    llama3's train spec. Built from the job config it has the plan's parameter count and, given paraplan's
    executor model's weights, computes the same logits; an untied gpt pipelines, its learned positions on the
    first stage."""
    import torch

    from paraplan.models import build_model

    plan = _tiny_plan(tmp_path / "p.json", "gpt-tiny", "--dp", "2", "--tp", "1", "--pp", "1")
    p, cfg = export_torchtitan(tmp_path, plan, "job", torchtitan_config)
    assert "paraplan must be installed where torchtitan runs" in p.stderr
    assert (cfg.model.name, cfg.model.flavor, cfg.experimental.custom_import) == ("paraplan_gpt", "gpt-tiny",
                                                                                  "job_model")
    spec = load_model_spec("gpt-tiny")
    train_spec, model = check_flavor_module(torchtitan_models, tmp_path / "job_model.py", cfg, spec, forward=True)
    assert model.output.weight is model.tok_embeddings.weight  # tied, as paraplan's gpt-tiny
    assert train_spec.parallelize_fn.__name__ == "parallelize_gpt"

    ours = build_model(spec).float()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, 0.05)
    theirs = {"tok_embeddings.weight": "embed.tok.weight", "pos_embeddings.weight": "embed.pos.weight",
              "norm.weight": "head.norm.weight", "norm.bias": "head.norm.bias"}
    for i in range(spec.num_layers):
        for a, b in [("attention_norm", "attn_norm"), ("ffn_norm", "mlp_norm"), ("attention.wq", "attn.wq"),
                     ("attention.wk", "attn.wk"), ("attention.wv", "attn.wv"), ("attention.wo", "attn.wo"),
                     ("feed_forward.w1", "mlp.fc1"), ("feed_forward.w2", "mlp.fc2")]:
            for kind in ("weight", "bias"):
                theirs[f"layers.{i}.{a}.{kind}"] = f"layers.{i}.{b}.{kind}"
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(mine[theirs[name]])
        tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length))  # (b, s)
        expected = ours.head(ours.layers["3"](ours.layers["2"](ours.layers["1"](ours.layers["0"](
            ours.embed(tokens))))))  # (b, s, V)
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)

    untied = tmp_path / "untied.yaml"
    untied.write_text("name: gpt-untied\nfamily: gpt\nnum_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\n"
                      "vocab_size: 512\nseq_length: 64\ntied_embeddings: false\n")
    piped = _tiny_plan(tmp_path / "u.json", str(untied), "--dp", "1", "--tp", "2", "--pp", "2", "--schedule",
                       "1f1b", "--sequence-parallel")
    _, cfg = export_torchtitan(tmp_path, piped, "piped", torchtitan_config)
    parts = cfg.parallelism.module_fqns_per_model_part
    assert parts[0][:2] == ["tok_embeddings", "pos_embeddings"] and parts[-1][-2:] == ["norm", "output"]
    _, model = check_flavor_module(torchtitan_models, tmp_path / "piped_model.py", cfg, load_model_spec(str(untied)))
    assert model.output.weight is not model.tok_embeddings.weight


@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_torchtitan_gpt_parallelizes_like_one_process(mode, torchtitan_config):
    """paraplan's gpt for torchtitan under parallelize_gpt on two CPU ranks (gloo): tp 2 (sequence parallel,
    vocabulary-split tied head) and FSDP2 over 2 give the single process's logits and mean-loss gradients."""
    import torch.multiprocessing as mp
    from torchtitan_ranks import gpt_rank

    from paraplan.executor.machine import free_port

    mp.spawn(gpt_rank, args=(free_port("127.0.0.1"), mode), nprocs=2, join=True)


def test_torchtitan_uses_its_llama3_flavor_only_with_its_numerics(plans):
    """torchtitan's 8B flavor is Llama 3.1 8B (RoPE base 500,000, llama3 scaling): the llama3-8b preset, which
    carries those published numerics, takes it (and the Megatron export passes the same); a spec of that shape
    with paraplan's own numerics (base 10,000) gets a flavor module with them, so both exports train one model."""
    plan, _ = plans["z3"]
    assert export_plan(plan, "torchtitan").values["flavor"] == "8B"
    spec = load_model_spec("llama3-8b").to_dict()
    mine = plan.replace(model="my-llama", model_spec={**spec, "name": "my-llama"})
    result = export_plan(mine, "torchtitan")
    assert result.values["model"] == "paraplan_llama3" and "rope_theta=10000.0" in "".join(result.files.values())


def test_torchtitan_flavor_widths_are_exact():
    from paraplan.planner.exports.torchtitan_model import ffn_settings, ffn_width

    assert ffn_settings(4096, 14336) == (1.3, 1024)  # Llama 3 8B, as torchtitan's own flavor states it
    for dim, width in [(128, 352), (4096, 11008), (5120, 13824), (256, 768), (96, 1), (100, 999), (7168, 18432)]:
        assert ffn_width(dim, *ffn_settings(dim, width)) == width, (dim, width)


def test_torchtitan_mixtures_of_experts_qwen3_and_latent_attention(tmp_path, torchtitan_config, torchtitan_models):
    """Experts in every layer -> llama4 (with pipelines); tied embeddings, q/k norms or an own head size ->
    qwen3 (no pipelines in torchtitan 0.2.2); latent attention -> deepseek_v3. Each builds the plan's count."""
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing

    mixtral = _tiny_plan(tmp_path / "m.json", "mixtral-tiny", "--dp", "2", "--tp", "1", "--pp", "2", "--ep", "2")
    p, cfg = export_torchtitan(tmp_path, mixtral, "mixtral", torchtitan_config)
    assert cfg.model.name == "paraplan_llama4" and cfg.parallelism.expert_parallel_degree == 2
    assert "no auxiliary load-balancing loss" in p.stderr
    _, model = check_flavor_module(torchtitan_models, tmp_path / "mixtral_model.py", cfg,
                                   load_model_spec("mixtral-tiny"))
    assert all(layer.moe_enabled for layer in model.layers.values())

    deepseek = _tiny_plan(tmp_path / "d.json", "deepseek-tiny", "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "2")
    p, cfg = export_torchtitan(tmp_path, deepseek, "deepseek", torchtitan_config)
    assert cfg.model.name == "paraplan_deepseek_v3" and "multi-token-prediction" in p.stderr
    # Megatron-LM leaves the module out too, saying so (it would build parameters the plan never priced)
    m = cli("export", "--plan", str(tmp_path / "d.json"), "--to", "megatron")
    assert m.returncode == 0 and "--mtp-num-layers" not in m.stdout and "multi-token-prediction" in m.stderr
    spec = load_model_spec("deepseek-tiny")
    _, model = check_flavor_module(torchtitan_models, tmp_path / "deepseek_model.py", cfg, spec)
    assert [layer.moe_enabled for layer in model.layers.values()] == [i >= spec.dense_layers
                                                                      for i in range(spec.num_layers)]
    moe = model.layers["1"].moe
    assert (moe.router.score_func, moe.router.route_scale, moe.router.top_k) == ("sigmoid", 2.5, 2)
    assert moe.router.num_expert_groups is None  # deepseek-tiny routes over all its experts
    # node-limited routing (DeepSeek-V3's n_group / topk_group): torchtitan's num_expert_groups / num_limited_groups,
    # Megatron-LM's --moe-router-num-groups / --moe-router-group-topk; torchtitan scores a group by its top 2
    (tmp_path / "grouped.yaml").write_text(json.dumps({**spec.to_dict(), "name": "grouped",
                                                       "moe_router_num_groups": 4, "moe_router_group_topk": 2}))
    grouped = _tiny_plan(tmp_path / "g.json", str(tmp_path / "grouped.yaml"), "--dp", "4", "--tp", "1", "--pp", "1",
                         "--ep", "2")
    p, cfg = export_torchtitan(tmp_path, grouped, "grouped", torchtitan_config)
    assert "scores a group of experts by its top 2 scores" in p.stderr  # k / group_topk = 1 here
    _, model = check_flavor_module(torchtitan_models, tmp_path / "grouped_model.py", cfg,
                                   load_model_spec(str(tmp_path / "grouped.yaml")))
    assert (model.layers["1"].moe.router.num_expert_groups, model.layers["1"].moe.router.num_limited_groups) == (4, 2)
    (tmp_path / "single.yaml").write_text(json.dumps({**spec.to_dict(), "name": "single",
                                                      "moe_router_num_groups": 8, "moe_router_group_topk": 2}))
    single = _tiny_plan(tmp_path / "s.json", str(tmp_path / "single.yaml"), "--dp", "4", "--tp", "1", "--pp", "1",
                        "--ep", "2")
    assert single.layout.ep == 2  # torchtitan's router refuses groups of one expert at start-up: refused here
    assert_one_line_error(cli("export", "--plan", str(tmp_path / "s.json"), "--to", "torchtitan"),
                          "groups of one expert")
    f, _ = megatron_export(grouped, tmp_path, load_model_spec(str(tmp_path / "grouped.yaml")))
    assert (f["--moe-router-num-groups"], f["--moe-router-group-topk"]) == ("4", "2")
    # DeepSeek-V2's group_limited_greedy scores a group by its best expert: neither stack has that rule, and says so
    (tmp_path / "greedy.yaml").write_text(json.dumps({**spec.to_dict(), "name": "greedy", "moe_router_num_groups": 4,
                                                      "moe_router_group_topk": 2, "moe_router_group_score": "max"}))
    _tiny_plan(tmp_path / "gr.json", str(tmp_path / "greedy.yaml"), "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "2")
    for target in ("megatron", "torchtitan"):
        done = cli("export", "--plan", str(tmp_path / "gr.json"), "--to", target, "--out", str(tmp_path / target))
        assert done.returncode == 0 and "by its best score: the groups chosen may differ" in done.stderr
    # latent attention without experts, under a pipeline: deepseek_v3 with every layer dense
    keep = ("family", "num_layers", "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "ffn_hidden_size", "vocab_size", "seq_length")
    mla = {k: v for k, v in spec.to_dict().items() if k in keep}
    (tmp_path / "mla.yaml").write_text(json.dumps(mla))
    plan = _tiny_plan(tmp_path / "mla.json", str(tmp_path / "mla.yaml"), "--dp", "2", "--tp", "1", "--pp", "3",
                      "--schedule", "1f1b", batch="12")
    _, cfg = export_torchtitan(tmp_path, plan, "mla", torchtitan_config)
    _, model = check_flavor_module(torchtitan_models, tmp_path / "mla_model.py", cfg,
                                   load_model_spec(str(tmp_path / "mla.yaml")), forward=True)
    assert cfg.model.name == "paraplan_deepseek_v3" and not any(layer.moe_enabled for layer in model.layers.values())

    qwen_moe = {"family": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_kv_heads": 2,
                "head_dim": 48, "qk_norm": True, "ffn_hidden_size": 384, "moe_ffn_hidden_size": 64, "num_experts": 4,
                "experts_per_token": 2, "vocab_size": 1024, "seq_length": 128}
    for name, fields, layout in [("qwen-moe", qwen_moe, ("--ep", "2")),
                                 ("qwen-tied", {**qwen_moe, "num_experts": 0, "experts_per_token": None,
                                                "moe_ffn_hidden_size": None, "tied_embeddings": True}, ())]:
        fields = {k: v for k, v in fields.items() if v is not None and not (k == "num_experts" and v == 0)}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(fields))
        plan = _tiny_plan(tmp_path / f"{name}.json", str(tmp_path / f"{name}.yaml"), "--dp", "2", "--tp", "2",
                          "--pp", "1", "--sequence-parallel", *layout)
        _, cfg = export_torchtitan(tmp_path, plan, name, torchtitan_config)
        assert cfg.model.name == "paraplan_qwen3"
        spec = load_model_spec(str(tmp_path / f"{name}.yaml"))
        train_spec, model = check_flavor_module(torchtitan_models, tmp_path / f"{name.replace('-', '_')}_model.py",
                                                cfg, spec, forward=not spec.is_moe)
        assert model.layers["0"].attention.q_norm is not None and model.layers["0"].attention.head_dim == 48
        if spec.is_moe:  # torchtitan's qwen3 updates no expert bias: the module asks for it
            assert train_spec.build_optimizers_fn is build_optimizers_with_moe_load_balancing
        else:
            assert model.output.weight is model.tok_embeddings.weight  # tied
            piped = plan.replace(layout=plan.layout.replace(pp=2, tp=1, dp=2, sequence_parallel=False),
                                 stages=even_stages(spec, 2))
            with pytest.raises(ExportRefused, match=r"tied embeddings and q/k RMSNorm and head size 48 .* with "
                                                    r"pipeline parallelism \(pp 2\).*only qwen3"):
                export_plan(piped, "torchtitan", spec=spec)


def test_moe_every_other_layer_exports_to_torchtitan_llama4_and_megatron(plans, tmp_path, torchtitan_config,
                                                                        torchtitan_models):
    """Llama 4 Maverick's pattern (experts in every other layer, dense layers twice the experts' width, one shared
    expert): torchtitan's llama4 with interleave_moe_layer_step 2 and the expert width derived from the dense one
    builds the plan's count with experts where the spec has them; Megatron gets a 0/1 per layer; an expert width
    torchtitan cannot derive is refused."""
    fields = {"family": "llama", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 352, "moe_ffn_hidden_size": 192, "num_experts": 4, "experts_per_token": 1,
              "num_shared_experts": 1, "moe_layer_step": 2, "moe_score_function": "sigmoid", "moe_norm_topk": False,
              "vocab_size": 1024, "seq_length": 128}
    (tmp_path / "l4.yaml").write_text(json.dumps(fields))
    spec = load_model_spec(str(tmp_path / "l4.yaml"))
    plan = _tiny_plan(tmp_path / "l4.json", str(tmp_path / "l4.yaml"), "--dp", "2", "--tp", "1", "--pp", "2",
                      "--ep", "2")
    _, cfg = export_torchtitan(tmp_path, plan, "l4", torchtitan_config)
    assert cfg.model.name == "paraplan_llama4"
    _, model = check_flavor_module(torchtitan_models, tmp_path / "l4_model.py", cfg, spec)
    assert [layer.moe_enabled for layer in model.layers.values()] == [False, True, False, True]
    f, _ = megatron_export(plan, tmp_path, spec)
    assert f["--moe-layer-freq"] == "[0,1,0,1]"
    odd = load_model_spec(str(tmp_path / "l4.yaml")).replace(moe_ffn_hidden_size=96)
    with pytest.raises(ExportRefused, match=r"experts 96 wide beside dense layers 352 wide.*= 192 here"):
        export_plan(plan, "torchtitan", spec=odd)


def test_torchtitan_refuses_what_no_torchtitan_model_is(plans, tmp_path):
    """bert: no torchtitan model trains one (training a LLaMA instead would void the plan); what paraplan's gpt
    for torchtitan cannot run (context parallelism with learned positions, a tied head across pipeline stages);
    dense first layers without latent attention; fp16; a sequence torchtitan cannot split."""
    gpt = _tiny_plan(tmp_path / "gpt.json", "gpt-tiny", "--dp", "2", "--tp", "1", "--pp", "1")
    _tiny_plan(tmp_path / "gpt-pp.json", "gpt-tiny", "--dp", "1", "--tp", "1", "--pp", "2")
    p = cli("export", "--plan", str(tmp_path / "gpt-pp.json"), "--to", "torchtitan", "--out", str(tmp_path / "g.toml"))
    assert_one_line_error(p, "torchtitan cannot express a head tied to the token embedding with pipeline "
                          "parallelism (pp 2)", "tied_embeddings: false")
    assert p.returncode == 2 and not p.stdout and not list(tmp_path.glob("g*.toml")) + list(tmp_path.glob("g*.py"))
    assert_one_line_error(cli("export", "--plan", str(tmp_path / "gpt-pp.json"), "--to", "torchtitan-cli"),
                          "head tied")
    with pytest.raises(ExportRefused, match=r"context parallelism \(cp 2\) with learned position embeddings"):
        export_plan(gpt.replace(layout=gpt.layout.replace(cp=2, dp=1)), "torchtitan")
    plan, _ = plans["z3"]
    bert_spec = load_model_spec("bert-large")
    bert = plan.replace(model="bert-large", model_spec=bert_spec.to_dict(), stages=even_stages(bert_spec, 1))
    with pytest.raises(ExportRefused, match="bert model .* causal decoders only; export --to deepspeed ") as e:
        export_plan(bert, "torchtitan")
    assert "--to megatron" not in str(e.value)  # which refuses a bert model too
    with pytest.raises(ExportRefused, match="bert model"):
        export_plan(bert, "megatron")
    assert export_plan(bert, "deepspeed").text  # the target it advises takes it
    dense_first = {"name": "dense-first", **{k: v for k, v in load_model_spec("mixtral-tiny").to_dict().items()
                                             if k != "name"}, "dense_layers": 1}
    with pytest.raises(ExportRefused, match=r"dense first layers .* without latent attention"):
        export_plan(gpt.replace(model="dense-first", model_spec=dense_first,
                                stages=even_stages(load_model_spec("mixtral-tiny"), 1)), "torchtitan")
    with pytest.raises(ExportRefused, match="dtype fp16"):
        export_plan(plan.replace(layout=plan.layout.replace(dtype="fp16")), "torchtitan")
    # the model's 8192 positions split into 2·cp chunks (the plan is valid), but the plan trains 8190-token sequences
    with pytest.raises(ExportRefused, match=r"sequence length 8190 with tp 1 and cp 2"):
        export_plan(plan.replace(seq_length=8190, layout=plan.layout.replace(cp=2, dp=1)), "torchtitan")


def test_qwen2_qkv_biases_export_to_megatron_and_are_refused_by_torchtitan(plans):
    """Qwen2's biased q/k/v projections: Megatron-LM's --add-qkv-bias beside --disable-bias-linear (its other
    linears stay bias-free); torchtitan's attention projections have none, so that export refuses rather than train
    another model."""
    plan, _ = plans["z3"]
    spec = load_model_spec("qwen2.5-7b")
    qwen = plan.replace(model="qwen2.5-7b", model_spec=spec.to_dict(), stages=even_stages(spec, 1))
    text = export_plan(qwen, "megatron").text
    assert "--add-qkv-bias" in text and "--disable-bias-linear" in text
    assert "--add-qkv-bias" not in export_plan(plan, "megatron").text
    with pytest.raises(ExportRefused, match="biases on the q, k and v projections .* export --to megatron"):
        export_plan(qwen, "torchtitan")


def test_torchtitan_command_line_form_takes_the_same_flavor_module(tmp_path, torchtitan_config, torchtitan_models):
    plan = _tiny_plan(tmp_path / "p.json", "llama-tiny", "--dp", "4", "--tp", "1", "--pp", "1")
    out = tmp_path / "run" / "tt.sh"
    out.parent.mkdir()
    p = cli("export", "--plan", str(tmp_path / "p.json"), "--to", "torchtitan-cli", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run" / "tt_model.py").exists()
    check_shell(out)
    got = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "$PYTHONPATH" "${TORCHTITAN_ARGS[@]}"', "_",
                          str(out)], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": "/elsewhere"}).stdout.splitlines()
    assert got[0] == f"{out.parent}:/elsewhere"  # torchtitan imports the module from the script's folder
    cfg, _ = parse_torchtitan(torchtitan_config, None, tmp_path, plan.layout.world_size, got[1:])
    check_flavor_module(torchtitan_models, tmp_path / "run" / "tt_model.py", cfg, load_model_spec("llama-tiny"))
    from_toml, _ = parse_torchtitan(torchtitan_config, export_plan(plan, "torchtitan", filename="tt.toml").text,
                                    tmp_path, plan.layout.world_size)
    from_toml.job.config_file = None
    assert cfg.to_dict() == from_toml.to_dict()
    # printed, not written: the TOML alone, and a note that its module needs --out
    p = cli("export", "--plan", str(tmp_path / "p.json"), "--to", "torchtitan")
    assert p.returncode == 0 and 'custom_import = "torchtitan_model"' in p.stdout
    assert "needs torchtitan_model.py beside it" in p.stderr and not (ROOT / "torchtitan_model.py").exists()
    r = json.loads(cli("export", "--plan", str(tmp_path / "p.json"), "--to", "torchtitan", "--json").stdout)
    assert r["values"]["model"] == "paraplan_llama3" and "register_train_spec(" in r["files"]["torchtitan_model.py"]


# ---------------------------------------------------------------- deepspeed


@pytest.fixture(scope="module")
def deepspeed_config():
    from deepspeed.runtime import config

    return config


class DataParallelMpu:
    """What DeepSpeedConfig asks an mpu: the data-parallel world size."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def read_deepspeed(config_module, path: Path, dp: int, monkeypatch):
    monkeypatch.setattr(config_module.dist, "get_rank", lambda *a, **k: 0)  # no process group in a unit test
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", ResourceWarning)  # DeepSpeed leaves the config file open
        return config_module.DeepSpeedConfig(str(path), mpu=DataParallelMpu(dp))


def test_deepspeed_reads_the_zero3_and_3d_plans(plans, tmp_path, deepspeed_config, monkeypatch):
    plan, path = plans["z3"]
    lay = plan.layout
    out = tmp_path / "ds.json"
    p = cli("export", "--plan", str(path), "--to", "deepspeed", "--out", str(out))
    assert p.returncode == 0, p.stderr
    ds = read_deepspeed(deepspeed_config, out, lay.dp, monkeypatch)
    assert ds.world_size == lay.dp and ds.zero_optimization_stage == lay.zero == 3
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == \
        (lay.global_batch, lay.micro_batch, lay.num_micro_batches)
    assert ds.bfloat16_config.enabled and ds.activation_checkpointing_config is not None
    assert "deepspeed.checkpointing.checkpoint" in p.stderr  # the JSON configures full recomputation, not runs it
    # checkpoints sharded over tp (partition_activations) only where the plan keeps 1/tp of them: with SP
    for sp in (False, True):
        tp2 = plan.replace(layout=lay.replace(dp=8, tp=2, sequence_parallel=sp))
        assert json.loads(export_plan(tp2, "deepspeed").text)["activation_checkpointing"]["partition_activations"] \
            is sp

    p3d, path3d = plans["3d"]
    one, path1 = variant(p3d, path3d, schedule="1f1b", virtual_stages=1)
    one = one.replace(stages=[a + b for a, b in zip(p3d.stages[::2], p3d.stages[1::2], strict=True)])
    one.write(str(path1))
    p = cli("export", "--plan", str(path1), "--to", "deepspeed", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["target"] == "deepspeed" and r["out"] == str(out) and "PipelineModule" in " ".join(r["notes"])
    ds = read_deepspeed(deepspeed_config, out, one.layout.dp, monkeypatch)
    assert ds.world_size == one.layout.dp and ds.zero_optimization_stage == 1
    assert ds.tensor_parallel_config.autotp_size == one.layout.tp and ds.pipeline["stages"] == one.layout.pp
    assert ds.gradient_accumulation_steps == one.layout.num_micro_batches  # the pipeline engine's micro-batches
    assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * ds.world_size


def test_deepspeed_refuses_interleaving_context_parallelism_and_zero3_pipelines(plans, tmp_path):
    plan, path = plans["3d"]
    p = cli("export", "--plan", str(path), "--to", "deepspeed")
    assert_one_line_error(p, "deepspeed cannot express the interleaved-1f1b schedule", "--schedule 1f1b")
    one = plan.replace(layout=plan.layout.replace(schedule="1f1b", virtual_stages=1),
                       stages=[plan.stages[i] + plan.stages[i + 1] for i in range(0, len(plan.stages), 2)])
    with pytest.raises(ExportRefused, match="ZeRO-3 with pipeline"):
        export_plan(one.replace(layout=one.layout.replace(zero=3)), "deepspeed")
    with pytest.raises(ExportRefused, match="context parallelism"):
        export_plan(one.replace(layout=one.layout.replace(cp=2, dp=1)), "deepspeed")


# ---------------------------------------------------------------- slurm


def check_shell(path: Path) -> None:
    """bash -n, then shellcheck (the Debian package; .ci/run installs it)."""
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found (apt-get install shellcheck); bash -n passed")
    p = subprocess.run([shellcheck, str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_slurm_script_for_the_3d_plan(plans, tmp_path):
    plan, path = plans["3d"]
    out = tmp_path / "job.sbatch"
    p = cli("export", "--plan", str(path), "--to", "slurm", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "sbatch " + str(out) in p.stdout
    text = out.read_text()
    nodes = plan.layout.world_size // 8  # dgx-h100: 8 GPUs per node
    assert f"#SBATCH --nodes={nodes}\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert "--rdzv-endpoint" in text and f"--nnodes {nodes}" in text
    assert f"#SBATCH --job-name=paraplan-{plan.model}\n" in text
    check_shell(out)
    # a plan of a model file: the job is named after the file's stem, not its path
    spec_file = tmp_path / "my.model.yaml"
    spec_file.write_text("name: mine\nfamily: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                         "vocab_size: 100\nseq_length: 32\n")
    filed = tmp_path / "filed.json"
    filed.write_text(json.dumps({**json.loads(path.read_text()), "model": str(spec_file)}))
    p = cli("export", "--plan", str(filed), "--to", "slurm", "--out", str(tmp_path / "f.sbatch"))
    assert p.returncode == 0, p.stderr
    assert "#SBATCH --job-name=paraplan-my.model\n" in (tmp_path / "f.sbatch").read_text()


@pytest.mark.parametrize("flags", [frozenset(), frozenset({"--checkpoint-dir", "--resume", "--max-restarts"})])
def test_slurm_script_runs_execute_on_every_node(plans, tmp_path, flags):
    """A dry run with stand-ins for scontrol, srun (each node in turn) and paraplan (records its argv)."""
    plan, path = plans["3d"]
    script = tmp_path / "job.sbatch"
    script.write_text(export_plan(plan, "slurm", str(path), execute_flags=flags).text)
    check_shell(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"scontrol": "printf 'gpu-a\\ngpu-b\\n'",
             "srun": 'while [[ $1 == --* ]]; do shift; done\nfor n in 0 1; do SLURM_NODEID=$n "$@"; done',
             "fake-paraplan": 'printf "%s\\n" "$@" > "$RECORD.$SLURM_NODEID"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "ckpt" / "step-20").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PARAPLAN": str(bin_dir / "fake-paraplan"),
           "RECORD": str(tmp_path / "argv"), "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_NAME": "t",
           "SLURM_JOB_ID": "7", "CKPT_DIR": str(tmp_path / "ckpt"), "MAX_RESTARTS": "2"}
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for node in (0, 1):
        f = flag_values((tmp_path / f"argv.{node}").read_text().splitlines())
        assert f["--plan"] == str(path.resolve()) and f["--nnodes"] == "2" and f["--node-rank"] == str(node)
        assert f["--rdzv-endpoint"] == "gpu-a:29500"
        assert (f.get("--resume") == str(tmp_path / "ckpt")) == ("--resume" in flags)
        assert (f.get("--max-restarts") == "2") == ("--max-restarts" in flags)


def test_slurm_refuses_what_execute_refuses(plans, tmp_path):
    plan, path = plans["3d"]
    _, fp16 = variant(plan, path, dtype="fp16")
    assert_one_line_error(cli("export", "--plan", str(fp16), "--to", "slurm"), "fp16")


# ---------------------------------------------------------------- every target: the plan against its model and cluster

TARGETS = ("megatron", "deepspeed", "torchtitan", "torchtitan-cli", "slurm")


@pytest.fixture(scope="module")
def piped(plans, tmp_path_factory) -> tuple[dict, Path]:
    """The 3D plan with one stage per pipeline rank (1F1B, the planner's stages joined in pairs): a plan every
    target exports as it is. Its JSON, to corrupt, and its file."""
    plan, _ = plans["3d"]
    one = plan.replace(layout=plan.layout.replace(schedule="1f1b", virtual_stages=1),
                       stages=[plan.stages[i] + plan.stages[i + 1] for i in range(0, len(plan.stages), 2)])
    path = tmp_path_factory.mktemp("piped") / "piped.json"
    one.write(str(path))
    for target in TARGETS:
        p = cli("export", "--plan", str(path), "--to", target)
        assert p.returncode == 0, (target, p.stderr)
    return json.loads(path.read_text()), path


def corrupted(data: dict, path: Path, name: str, **changes) -> Path:
    """The plan's JSON with some fields replaced, written beside it as NAME.json."""
    out = path.with_name(f"{name}.json")
    out.write_text(json.dumps({**data, **changes}))
    return out


def _stage_cases(data: dict) -> list[tuple[str, list[list[str]], tuple[str, ...]]]:
    """(name, corrupted stages, fragments of the refusal) for a plan of pp 4 x 1 virtual stage."""
    s = data["stages"]
    last_of_1, first_of_2 = s[1][-1], s[2][0]
    return [
        ("missing", [s[0], s[1][:-1], s[2], s[3]], (f"leaves out block {last_of_1!r}",)),
        ("overlap", [s[0], s[1], [last_of_1, *s[2]], s[3]], (f"lists block {last_of_1!r} twice",)),
        ("order", [s[0], s[2], s[1], s[3]], ("model order", f"{first_of_2!r} stands where {s[1][0]!r} belongs")),
        ("count", [s[0], s[1], s[2] + s[3]], ("lists 3 stages but pp x virtual_stages = 4 x 1 = 4",)),
        ("unknown", [s[0], s[1], s[2], [*s[3][:-1], "layers.99", s[3][-1]]], ("'layers.99'", "not a block of")),
    ]


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_refuses_stages_that_do_not_cover_the_model(piped, target):
    """A plan.json whose stages leave out a layer, list one twice, run out of model order, number other than
    pp x virtual_stages or name no block of the model: refused in one line naming the file and 'stages', by every
    target (the check ``execute`` makes, Plan.validate_stages), and nothing written on stdout."""
    data, path = piped
    for name, stages, fragments in _stage_cases(data):
        bad = corrupted(data, path, f"{target}-{name}", stages=stages)
        p = cli("export", "--plan", str(bad), "--to", target)
        assert_one_line_error(p, str(bad), "'stages'", *fragments)
        assert p.returncode == 2 and not p.stdout, (name, p.stdout)


def test_a_plan_whose_cluster_file_cannot_be_read_is_refused(piped, tmp_path):
    """The plan names a cluster YAML that is here but broken: one line naming 'cluster' and what is wrong (its GPUs
    cannot be checked), not an export that skips the check; a cluster file that is not here (planned elsewhere) and
    that the plan does not carry (cluster_spec) is refused too: its nodes and GPUs per node shape every launch line
    (a guess of one node of every GPU launched another shape)."""
    data, path = piped
    broken = tmp_path / "cluster.yaml"
    broken.write_text("name: mine\ngpu: [unclosed\n")
    bad = corrupted(data, path, "broken-cluster", cluster=str(broken))
    p = cli("export", "--plan", str(bad), "--to", "megatron")
    assert_one_line_error(p, str(bad), "'cluster'", str(broken))
    assert p.returncode == 2 and not p.stdout
    elsewhere = corrupted(data, path, "cluster-elsewhere", cluster=str(tmp_path / "absent.yaml"))
    assert_one_line_error(cli("export", "--plan", str(elsewhere), "--to", "megatron"), "megatron: cannot read the "
                          f"plan's cluster '{tmp_path / 'absent.yaml'}'", "no cluster_spec")


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_refuses_a_world_beyond_the_plans_nodes(piped, target):
    """The GPUs the plan needs (dp x cp x tp x pp) against its cluster's for its 'nodes' (gpus_per_node x nodes):
    fewer nodes than the plan was made for, or a degree raised by hand, is refused in one line."""
    data, path = piped
    world = data["dp"] * data["cp"] * data["tp"] * data["pp"]
    assert data["nodes"] == 2 and world == 16  # dgx-h100: 8 GPUs per node
    bad = corrupted(data, path, f"{target}-nodes", nodes=1)
    p = cli("export", "--plan", str(bad), "--to", target)
    assert_one_line_error(p, str(bad), "'nodes'", f"dp x cp x tp x pp = {world} needs more GPUs than the cluster's 8",
                          "1 node x 8 GPUs per node of dgx-h100")
    assert p.returncode == 2 and not p.stdout
    dp = data["dp"] * 2  # the same global batch: half the micro-batches per replica
    bad = corrupted(data, path, f"{target}-dp", dp=dp,
                    num_micro_batches=data["global_batch"] // (dp * data["micro_batch"]))
    p = cli("export", "--plan", str(bad), "--to", target)
    assert_one_line_error(p, str(bad), "'nodes'", f"= {2 * world} needs more GPUs than the cluster's 16",
                          "2 nodes x 8 GPUs per node")


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_refuses_expert_parallelism_that_does_not_divide(tmp_path, target):
    """ep must divide a stage's dp x cp x tp ranks (and the experts), as the planner and ``execute`` require."""
    _tiny_plan(tmp_path / "m.json", "mixtral-tiny", "--dp", "2", "--tp", "1", "--pp", "2", "--ep", "2")
    data = json.loads((tmp_path / "m.json").read_text())
    bad = corrupted(data, tmp_path / "m.json", "ep4", ep=4)
    assert_one_line_error(cli("export", "--plan", str(bad), "--to", target), str(bad),
                          "ep x etp = 4 must divide a stage's dp x cp x tp = 2 ranks")


# ---------------------------------------------------------------- command and report


def test_export_command_output_and_errors(plans, tmp_path):
    plan, path = plans["z3"]
    p = run_cli("export", "--plan", str(path), "--to", "torchtitan")  # as users run it: the console command
    assert p.returncode == 0 and p.stdout.startswith("# torchtitan job config") and "[parallelism]" in p.stdout
    p = cli("export", "--plan", str(path), "--to", "megatron", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["values"]["dp"] == plan.layout.dp and r["text"].startswith("#!/usr/bin/env bash")
    assert_one_line_error(cli("export", "--plan", str(tmp_path / "none.json"), "--to", "megatron"), "none.json")
    assert_one_line_error(cli("export", "--plan", str(path), "--to", "horovod"), "invalid choice")
    assert_one_line_error(cli("export", "--plan", str(path), "--to", "megatron", "--out", str(tmp_path)),
                          "is a folder")


def test_report_lists_the_export_commands(plans):
    _, path = plans["3d"]
    lines = "\n".join(report_lines(str(path)))
    assert "paraplan export --plan plan.json --to megatron --out megatron.sh" in lines
    assert "paraplan export --plan plan.json --to torchtitan --out torchtitan.toml" in lines
    assert "paraplan export --plan plan.json --to torchtitan-cli --out torchtitan.sh" in lines
    assert "sbatch paraplan.sbatch" in lines
    assert "deepspeed: not exported — deepspeed cannot express the interleaved-1f1b schedule" in lines


def test_plan_json_fields_out_of_range_are_one_line_errors(tmp_path):
    """A hand-edited plan.json with a field out of range is refused in one line naming the file and the field
    (found by a fuzzing pass: before, export crashed on these or hung on an absurd degree)."""
    plan = _simulate(tmp_path / "base.json", "--dp", "2", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--zero", "1")
    data = json.loads((tmp_path / "base.json").read_text())
    cases = [({"dp": 0}, "dp must be positive"), ({"tp": -1}, "tp must be positive"),
             ({"recompute": "bogus"}, "unknown recompute"), ({"schedule": None}, "unknown schedule"),
             ({"zero": 7}, "zero must be 0, 1, 2 or 3"), ({"stage_recompute": ["none", "bogus"]}, "stage_recompute"),
             ({"seq_length": "2"}, "'seq_length' must be a positive whole number"),
             ({"prediction": 1}, "'prediction' must be an object"),
             ({"prediction": {"iteration_time_s": "x"}}, "prediction 'iteration_time_s' must be a number"),
             ({"sequence_parallel": "false"}, "'sequence_parallel' must be true or false"),
             ({"attention": "bogus"}, "'attention' must be one of"), ({"framework_switches": []}, "must be an object"),
             ({"cluster": 3}, "'cluster' must be a name"),
             ({"model": "llama2-7b"}, "'model' 'llama2-7b' disagrees with 'model_spec'")]
    bad = tmp_path / "bad.json"
    for change, words in cases:
        bad.write_text(json.dumps({**data, **change}))
        assert_one_line_error(cli("export", "--plan", str(bad), "--to", "megatron"), str(bad), words)
    huge = {**data, "dp": 1000000007, "pp": 1, "global_batch": 1000000007, "num_micro_batches": 1,
            "stages": [[n for s in data["stages"] for n in s]]}
    bad.write_text(json.dumps(huge))
    # a prime world size far beyond the plan's 2 nodes: refused at once, naming the field that bounds the GPUs
    p = cli("export", "--plan", str(bad), "--to", "deepspeed")
    assert_one_line_error(p, str(bad), "'nodes'", f"= {huge['dp'] * huge['tp']} needs more GPUs than the cluster's 16")
    assert plan.layout.world_size == 8


def test_a_null_prediction_figure_reads_as_a_missing_one(tmp_path):
    """A plan whose prediction holds null figures loads without them (execute trained every step, then failed to
    print a null peak memory and lost its run record)."""
    from paraplan.planner.plan import Plan

    _simulate(tmp_path / "base.json", "--dp", "2", "--tp", "1", "--pp", "1", "--micro-batch", "1")
    data = json.loads((tmp_path / "base.json").read_text())
    data["prediction"].update(peak_memory_gib=None, iteration_time_s=None)
    (tmp_path / "null.json").write_text(json.dumps(data))
    pred = Plan.read(str(tmp_path / "null.json")).prediction
    assert "peak_memory_gib" not in pred and "iteration_time_s" not in pred and pred["mfu"] == data["prediction"]["mfu"]


def test_moe_all_to_all_overlap_only_where_megatron_runs_it(tmp_path):
    """Megatron-Core overlaps a micro-batch's all-to-alls with another's compute only with ep > 1, two micro-batches
    or more, no full recomputation nor of the MoE blocks (TransformerConfig refuses "moe" in recompute_modules,
    which the mlp mode exports) and virtual stages under a pipeline: elsewhere --moe-a2a-overlap hides nothing and
    the export leaves the flag out with a note."""
    base = ["simulate", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "1", "--seq-len", "1024",
            "--dp", "8", "--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1", "--zero", "1",
            "--framework", "megatron-core", "--json"]
    one = ["--global-batch", "8"]  # one micro-batch per replica: nothing to overlap with
    plain = json.loads(cli(*base, *one).stdout)
    over = json.loads(cli(*base, *one, "--moe-a2a-overlap", "--write-plan", str(tmp_path / "p.json")).stdout)
    assert over["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-12)
    result = export_plan(Plan.read(str(tmp_path / "p.json")), "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in result.text
    assert any("all-to-all overlap is left out" in n for n in result.notes)
    two = ["--global-batch", "16"]
    assert json.loads(cli(*base, *two, "--moe-a2a-overlap").stdout)["time_s"]["ep_comm"] < \
        json.loads(cli(*base, *two).stdout)["time_s"]["ep_comm"]
    per_stage = Plan.read(str(tmp_path / "p.json"))  # one micro-batch: no stage of it was priced with the overlap
    assert any("priced without it too" in n for n in export_plan(per_stage, "megatron").notes)
    mlp = ["--global-batch", "16", "--recompute", "mlp"]  # two micro-batches, but the MoE blocks recomputed
    plain = json.loads(cli(*base, *mlp).stdout)
    over = json.loads(cli(*base, *mlp, "--moe-a2a-overlap", "--write-plan", str(tmp_path / "m.json")).stdout)
    assert over["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-12)
    result = export_plan(Plan.read(str(tmp_path / "m.json")), "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in result.text and "moe" in result.text.split(
        "--recompute-modules")[1].split("--")[0]
    # stages of mixed modes, one recomputing its MoE blocks: exported with mlp throughout, so without the overlap
    # the other stage was priced with
    mixed = Plan.read(str(tmp_path / "m.json"))
    mixed = mixed.replace(layout=mixed.layout.replace(pp=2, dp=4, schedule="interleaved-1f1b", virtual_stages=2),
                          stage_recompute=["mlp", "none", "none", "none"])
    from paraplan.planner.exports.megatron import stack_args

    notes: list[str] = []
    stack_args(mixed, load_model_spec("qwen3-30b-a3b"), notes)
    assert any("priced with it on the stages recomputing less: slower than predicted" in n for n in notes)


def test_shared_expert_overlap_reaches_the_plan_and_megatron(tmp_path):
    """--moe-shared-expert-overlap (Megatron-Core's moe_shared_expert_overlap, on in NeMo's Llama 4 recipes) is
    recorded among the plan's framework switches, prices the exchanges faster where the model has shared experts,
    and exports as Megatron-LM's --moe-shared-expert-overlap."""
    base = ["simulate", "--model", "llama4-maverick", "--cluster", "dgx-h100", "--nodes", "1", "--seq-len", "1024",
            "--global-batch", "16", "--dp", "8", "--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1",
            "--zero", "1", "--recompute", "full", "--framework", "megatron-core", "--json"]
    plain = json.loads(cli(*base).stdout)
    over = json.loads(cli(*base, "--moe-shared-expert-overlap", "--write-plan", str(tmp_path / "p.json")).stdout)
    assert over["time_s"]["ep_comm"] < plain["time_s"]["ep_comm"]
    plan = Plan.read(str(tmp_path / "p.json"))
    assert plan.framework_switches == {"moe_shared_expert_overlap": True}
    assert "--moe-shared-expert-overlap" in export_plan(plan, "megatron").text


def test_mla_selective_recomputation_exports_the_up_projections_and_keeps_the_overlap(tmp_path):
    """Selective recomputation of a multi-head latent attention model repeats its up-projections too (priced so:
    planner/fused_activations.mla_bytes, executor/checkpointing.py): Megatron gets recompute_modules core_attn and
    mla_up_proj, which its all-to-all overlap allows (unlike moe), so the overlap flag stays."""
    plan = tmp_path / "p.json"
    cli("simulate", "--model", "deepseek-tiny", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "16",
        "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "4", "--micro-batch", "1", "--zero", "1", "--recompute",
        "selective", "--framework", "megatron-core", "--moe-a2a-overlap", "--write-plan", str(plan), "--json")
    script = tmp_path / "mla.sh"
    script.write_text(export_plan(Plan.read(str(plan)), "megatron").text)
    argv = megatron_argv(script)
    at = argv.index("--recompute-modules")
    assert argv[at + 1:at + 3] == ["core_attn", "mla_up_proj"] and "--overlap-moe-expert-parallel-comm" in argv
    assert not set(flag_values(argv)) - MEGATRON_FLAGS


def test_selective_and_mlp_recomputation_together_export_every_module_and_no_overlap(tmp_path):
    """--recompute selective+mlp as NVIDIA's DeepSeek-V3 recipes run it: Megatron gets recompute_modules core_attn,
    mla_up_proj, mlp and moe; recomputing the MoE blocks rules out the all-to-all overlap (as mlp does), which the
    price already left out, and the export says so."""
    plan = tmp_path / "p.json"
    base = ["simulate", "--model", "deepseek-tiny", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "16",
            "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "4", "--micro-batch", "1", "--zero", "1",
            "--framework", "megatron-core", "--moe-a2a-overlap", "--json"]
    both = json.loads(cli(*base, "--recompute", "selective+mlp", "--write-plan", str(plan)).stdout)
    mlp = json.loads(cli(*base, "--recompute", "mlp").stdout)
    assert both["plan"]["recompute"] == "selective+mlp"
    assert both["memory_gib"]["activations"] < mlp["memory_gib"]["activations"]
    assert both["time_s"]["ep_comm"] == pytest.approx(mlp["time_s"]["ep_comm"], rel=1e-12)  # no overlap either
    script = tmp_path / "both.sh"
    result = export_plan(Plan.read(str(plan)), "megatron")
    script.write_text(result.text)
    argv = megatron_argv(script)
    at = argv.index("--recompute-modules")
    assert argv[at + 1:at + 5] == ["core_attn", "mla_up_proj", "mlp", "moe"]
    assert "--overlap-moe-expert-parallel-comm" not in argv
    assert not set(flag_values(argv)) - MEGATRON_FLAGS


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_refuses_a_plan_of_a_python_callable_model(piped, target):
    """A plan whose model is the user's own callable: its blocks come only from running that code, which export
    does not do (execute refuses it too); one line naming the file, whatever the callable would do."""
    data, path = piped
    for name in ("two_layer_mlp", "raises"):
        bad = corrupted(data, path, f"{target}-custom-{name}", model=f"fixtures.custom_model:{name}", model_spec=None)
        p = cli("export", "--plan", str(bad), "--to", target)
        assert_one_line_error(p, str(bad), "python callable")
        assert p.returncode == 2 and not p.stdout


def test_a_plan_that_does_not_fit_is_exported_with_a_warning(tmp_path, plans):
    """simulate --write-plan writes a layout that does not fit when asked; exporting it still works (the user may
    know better) but says, on stderr, that its own prediction runs out of memory — and a plan that fits says
    nothing of the kind."""
    path = tmp_path / "big.json"
    # llama3-8b without ZeRO, recomputation or tensor parallelism at micro-batch 8: far over 80 GiB
    plan = _simulate(path, "--dp", "16", "--tp", "1", "--pp", "1", "--micro-batch", "4", "--zero", "0")
    pred = plan.prediction
    assert pred["fits"] is False and pred["peak_memory_gib"] > pred["memory_capacity_gib"] == 80
    p = cli("export", "--plan", str(path), "--to", "megatron", "--out", str(tmp_path / "args.sh"))
    assert p.returncode == 0 and (tmp_path / "args.sh").exists()
    warning = [line for line in p.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "does not fit" in warning[0] and f"{pred['peak_memory_gib']:.1f} GiB" in warning[0]
    _, fitting = plans["3d"]
    p = cli("export", "--plan", str(fitting), "--to", "megatron", "--out", str(tmp_path / "ok.sh"))
    assert p.returncode == 0 and "does not fit" not in p.stderr


def test_slurm_script_of_an_expert_parallel_plan_leaves_checkpoints_out(tmp_path):
    """execute refuses checkpoint flags for expert-parallel plans: the script would fail on every node as it started.
    It runs without them, and says why (in the script and on stderr)."""
    path = tmp_path / "plan.json"
    p = cli("simulate", "--model", "mixtral-tiny", "--cluster", "dgx-h100", "--global-batch", "16", "--dp", "4",
            "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "1", "--write-plan", str(path))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "job.sbatch"
    p = cli("export", "--plan", str(path), "--to", "slurm", "--out", str(out))
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert "--checkpoint-dir" not in text and "--resume" not in text and "CKPT_DIR" not in text
    assert "# No checkpoints: checkpoints of expert-parallel plans (ep 2)" in text
    assert "note: no checkpoint or resume flags: checkpoints of expert-parallel plans" in p.stderr
    check_shell(out)


def test_exports_say_when_the_plan_was_priced_for_another_stack(plans):
    """A target runs its own stack: an export of a plan priced for another framework says so (its memory and time
    were priced for that one), and Megatron says a benchmark routing (--moe-routing consecutive) is not its
    router's; a plan of the target's own stack gets no such note."""
    plan, _ = plans["3d"]
    theirs = plan.replace(framework="nemo-automodel", framework_switches={"moe_routing": "consecutive"})
    for target in ("megatron", "slurm", "torchtitan"):
        notes = export_plan(theirs, target).notes
        assert any("the plan was priced for framework nemo-automodel" in n for n in notes), target
    assert any("--moe-routing consecutive" in n for n in export_plan(theirs, "megatron").notes)
    assert not any("the plan was priced for framework" in n for n in export_plan(plan, "slurm").notes)


def test_megatron_refuses_experts_with_tensor_parallelism_without_sequence_parallelism(tmp_path):
    """Megatron-Core requires sequence parallelism where expert and tensor parallelism meet
    (model_parallel_config.py: "sequence parallelism must be used"); a paraplan-stack plan without it is refused
    naming the fix, not exported to a run that fails (or runs another plan)."""
    plan = _tiny_plan(tmp_path / "moe.json", "mixtral-tiny", "--dp", "2", "--tp", "2", "--pp", "1", "--ep", "2")
    assert plan.layout.ep == 2 and plan.layout.tp == 2 and not plan.layout.sequence_parallel
    with pytest.raises(ExportRefused, match=r"expert parallelism \(ep 2\) with tensor parallelism \(tp 2\) without "
                                            r"sequence parallelism.*--sequence-parallel"):
        export_plan(plan, "megatron")
    sp = plan.replace(layout=plan.layout.replace(sequence_parallel=True))
    assert "--sequence-parallel" in export_plan(sp, "megatron").text


def test_a_plan_carries_its_cluster_file_and_refuses_an_unknown_one(tmp_path):
    """A plan priced on a cluster file carries the spec (cluster_spec): moved to a machine without the file it
    exports the same launch shape (2 nodes x 6 GPUs, not one node of 12) and predicts the same; a plan whose cluster
    is known neither by it nor here is refused by every target in one line instead of guessing one node."""
    from paraplan.planner.api import predict_plan

    yaml = tmp_path / "six.yaml"
    yaml.write_text("name: six\ngpu: h100-sxm-80gb\nnodes: 2\ngpus_per_node: 6\n"
                    "intra_node: {bandwidth_GBps: 450, latency_us: 2}\n"
                    "inter_node: {bandwidth_GBps: 50, latency_us: 5}\n")
    path = tmp_path / "plan.json"
    p = cli("simulate", "--model", "llama2-7b", "--cluster", str(yaml), "--global-batch", "24", "--dp", "6", "--tp",
            "2", "--pp", "1", "--micro-batch", "1", "--zero", "1", "--write-plan", str(path), "--json")
    assert p.returncode == 0, p.stderr
    priced = json.loads(p.stdout)["iteration_time_s"]
    yaml.unlink()
    plan = Plan.read(str(path))
    assert plan.cluster_spec["gpus_per_node"] == 6 and plan.load_cluster().nodes == 2
    assert predict_plan(plan).iteration_time_s == pytest.approx(priced, rel=1e-9)
    text = export_plan(plan, "megatron").text
    assert '--nnodes "${NNODES:-2}" --nproc-per-node 6' in text
    data = json.loads(path.read_text())
    del data["cluster_spec"]
    path.write_text(json.dumps(data))
    for target in ("megatron", "deepspeed", "torchtitan", "slurm"):
        assert_one_line_error(cli("export", "--plan", str(path), "--to", target), "cannot read the plan's cluster",
                              "no cluster_spec")


def test_expert_biases_are_refused_by_megatron_and_torchtitan(plans):
    """A spec with biases on its experts alone (expert_bias, GPT-OSS's experts and router): Megatron-LM biases
    every linear or none (--add-bias-linear), torchtitan's experts have none: both refuse in one line, naming the
    field, rather than train another model."""
    plan, _ = plans["z3"]
    spec = load_model_spec("mixtral-8x7b").replace(expert_bias=True, qkv_bias=True)  # GPT-OSS's biases, bar o's
    oss = plan.replace(model="mixtral-bias", model_spec=spec.to_dict(), stages=even_stages(spec, 1))
    for target in ("megatron", "torchtitan"):
        with pytest.raises(ExportRefused, match=r"expert_bias.*paraplan execute") as e:
            export_plan(oss, target)
        assert "\n" not in str(e.value)


def test_megatron_routes_unrenormalised_softmax_scores_with_pre_softmax(tmp_path):
    """DeepSeek-V2 (norm_topk_prob false) weights its experts by the softmax over every expert, not renormalised:
    Megatron-Core's --moe-router-pre-softmax (its default, a softmax over the top k's logits, renormalises them;
    moe_utils.topk_routing_with_score_function). Renormalising models (Mixtral) get the default."""
    spec = load_model_spec("mixtral-tiny")
    for norm, flag in ((True, False), (False, True)):
        (tmp_path / "m.yaml").write_text(json.dumps({**spec.to_dict(), "name": "m", "moe_norm_topk": norm}))
        plan = _tiny_plan(tmp_path / "m.json", str(tmp_path / "m.yaml"), "--dp", "2", "--tp", "1", "--pp", "1",
                          "--ep", "2")
        f, _ = megatron_export(plan, tmp_path, load_model_spec(str(tmp_path / "m.yaml")))
        assert ("--moe-router-pre-softmax" in f) == flag


def test_a_plan_keeps_its_config_json_s_rope_and_norm_where_the_file_is_not(tmp_path, monkeypatch):
    """plan.json keeps the HF config's RoPE base, norm eps and RoPE scaling (model_numerics): exported from another
    folder, or after the config moved, the plan still trains the model it priced (QA round 8: Qwen3's base 1,000,000
    became Megatron's 10,000). A bad model_numerics is refused in one line naming it."""
    config = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": 1024, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "q3.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    plan = _tiny_plan(tmp_path / "q3plan.json", "cfg/q3.json", "--dp", "2", "--tp", "1", "--pp", "1")
    assert plan.model == "cfg/q3.json" and plan.model_numerics["rope_theta"] == 1e6
    (tmp_path / "cfg" / "q3.json").unlink()  # the config gone: the plan alone
    kept = Plan.read(str(tmp_path / "q3plan.json"))
    flags, notes = megatron_export(kept, tmp_path)
    assert (flags["--rotary-base"], flags["--norm-epsilon"]) == ("1000000", "1e-06")
    assert not any("could not be read" in n for n in notes)
    from paraplan.planner.plan import config_numerics

    (tmp_path / "odd.json").write_text(json.dumps({**config, "rope_theta": -1.0}))
    assert config_numerics(str(tmp_path / "odd.json")) is None  # never written where a plan could not be read back
    data = json.loads((tmp_path / "q3plan.json").read_text())
    for bad in ({**data["model_numerics"], "rope_theta": -1}, {"rope_theta": 1e6}):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "model_numerics": bad}))
        with pytest.raises(PlanError, match="model_numerics"):
            Plan.read(str(tmp_path / "bad.json"))

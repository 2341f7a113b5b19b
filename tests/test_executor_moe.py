"""Mixture-of-experts layouts: expert parallelism (all-to-all dispatch, experts folded onto the data- and
tensor-parallel ranks of a stage) and MoE blocks under tensor, pipeline and ZeRO data parallelism.

Each layout trains 3 steps under torchrun and its losses must equal the single process's (1e-4 relative),
and its first step's gradients must too (tests/executor_grads.py: AdamW's per-tensor normalisation would
hide an expert gradient off by a constant factor from the losses). Models: ``mixtral-tiny`` (softmax top-2
of 4 experts), ``deepseek-tiny`` (MLA, sigmoid top-2 of 8, a shared expert, a dense first layer) and
``qwen3-moe-tiny`` (per-head q/k norms), ``llama4-tiny`` (Llama 4 Maverick's pattern: experts in every other
layer, a shared expert, top-1 sigmoid routing).
"""

from __future__ import annotations

import pytest
from executor_cases import STEPS, Case, assert_losses_match, launched_run
from executor_grads import assert_grads_match, gradient_runs

from paraplan.executor.errors import ExecutionError
from paraplan.executor.parallel_dims import ParallelDims

LOSS_CASES = {
    2: [
        Case("mixtral-dp2-ep2", "mixtral-tiny", dp=2, ep=2, micro_batch=2),
        Case("mixtral-tp2-ep2", "mixtral-tiny", tp=2, ep=2, micro_batch=4),  # ep over the tensor-parallel ranks
        Case("mixtral-dp2-ep2-zero1", "mixtral-tiny", dp=2, ep=2, zero=1, micro_batch=2),
        Case("mixtral-dp2-ep2-zero3", "mixtral-tiny", dp=2, ep=2, zero=3, micro_batch=2),
        Case("deepseek-tp2-sp-ep2", "deepseek-tiny", tp=2, ep=2, sequence_parallel=True, micro_batch=4),
        Case("mixtral-dp2-ep2-mlp", "mixtral-tiny", dp=2, ep=2, recompute="mlp", micro_batch=2),  # a2a rerun
        # selective recomputation repeats MLA's latent norms and up-projection (models.in_attention_prologue)
        Case("deepseek-tp2-ep2-selective", "deepseek-tiny", tp=2, ep=2, recompute="selective", micro_batch=4),
        Case("llama4-dp2-ep2", "llama4-tiny", dp=2, ep=2, micro_batch=2),  # experts in every other layer
        # both checkpoints at once (NVIDIA's DeepSeek-V3 recipes): MLA's core and prologue, the MoE block and its a2a
        Case("deepseek-dp2-ep2-sel-mlp", "deepseek-tiny", dp=2, ep=2, recompute="selective+mlp", micro_batch=2),
    ],
    4: [
        Case("mixtral-dp2-pp2-ep2", "mixtral-tiny", dp=2, pp=2, ep=2, micro_batch=2),
        Case("deepseek-tp2-pp2-ep2-gpipe", "deepseek-tiny", tp=2, pp=2, ep=2, schedule="gpipe", micro_batch=4),
        Case("mixtral-dp2xtp2-ep4", "mixtral-tiny", dp=2, tp=2, ep=4, micro_batch=4),  # one expert per rank
        Case("mixtral-dp2xtp2-ep2-zero3-sp", "mixtral-tiny", dp=2, tp=2, ep=2, zero=3, sequence_parallel=True,
             micro_batch=4),  # experts sharded over edp = 2
        Case("moe-bias-dp2xtp2-ep2-zero3-sp", "moe-bias-tiny", dp=2, tp=2, ep=2, zero=3, sequence_parallel=True,
             micro_batch=4),  # the expert biases (E/ep, f) and (E/ep, h) sharded by FSDP2 over edp = 2 too
    ],
}

GRAD_CASES = {
    2: LOSS_CASES[2] + [
        Case("mixtral-dp2-accumulate", "mixtral-tiny", dp=2, micro_batch=1),  # aux losses under accumulation
        Case("mixtral-tp2", "mixtral-tiny", tp=2, micro_batch=4),  # each tp rank routes its share of the tokens
        Case("mixtral-tp2-sp-full", "mixtral-tiny", tp=2, sequence_parallel=True, recompute="full", micro_batch=4),
        Case("deepseek-tp2", "deepseek-tiny", tp=2, micro_batch=4),  # MLA's shared rotary key
        Case("qwen3-moe-tp2-ep2", "qwen3-moe-tiny", tp=2, ep=2, micro_batch=4),  # per-head q/k norms
        Case("qwen3-moe-tp2-sp", "qwen3-moe-tiny", tp=2, sequence_parallel=True, micro_batch=4),
        Case("qwen3-moe-tp2-selective", "qwen3-moe-tiny", tp=2, recompute="selective", micro_batch=4),  # q/k norms
        Case("moe-bias-dp2-ep2", "moe-bias-tiny", dp=2, ep=2, micro_batch=2),  # expert biases sharded with experts
        Case("moe-bias-tp2-ep2", "moe-bias-tiny", tp=2, ep=2, micro_batch=4),  # ep over the tensor-parallel ranks
        Case("moe-bias-dp2-zero3", "moe-bias-tiny", dp=2, zero=3, micro_batch=2),  # biases sharded by FSDP2 (ep 1)
        Case("deepseek-groups-dp2-ep2", "deepseek-groups-tiny", dp=2, ep=2, micro_batch=2),  # group-limited routing
    ],
    4: LOSS_CASES[4],
}


def _check_run(case: Case, tmp_path_factory) -> None:
    run = launched_run(f"moe{case.world_size}", LOSS_CASES[case.world_size], case, STEPS, tmp_path_factory)
    assert run["world_size"] == case.world_size and run["plan"]["ep"] == case.ep
    assert_losses_match(case, run)


@pytest.mark.parametrize("case", LOSS_CASES[2] + [pytest.param(c, marks=pytest.mark.slow) for c in LOSS_CASES[4]],
                         ids=lambda c: c.name)  # 4 ranks: slow
def test_moe_layout_matches_single_process(case, tmp_path_factory):
    _check_run(case, tmp_path_factory)


@pytest.mark.parametrize("case", GRAD_CASES[2], ids=lambda c: c.name)
def test_moe_gradients_match_single_process(case, tmp_path_factory):
    folders = gradient_runs("moe2", GRAD_CASES[2], tmp_path_factory)
    assert_grads_match(case, folders[case.name])


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES[4], ids=lambda c: c.name)
def test_four_rank_moe_gradients_match_single_process(case, tmp_path_factory):
    folders = gradient_runs("moe4", GRAD_CASES[4], tmp_path_factory)
    assert_grads_match(case, folders[case.name])


@pytest.mark.parametrize("dp,cp,tp,ep", [(2, 1, 2, 2), (2, 1, 2, 4), (4, 1, 1, 2), (1, 2, 2, 2), (2, 2, 2, 4)])
def test_expert_folding_follows_megatron(dp, cp, tp, ep):
    """i = tp_rank + tp·(cp_rank + cp·dp_rank) splits as ep_rank = i % ep, edp_rank = i // ep (etp = 1); each
    (edp, ep) pair once per stage; an ep group is consecutive ranks."""
    dims = ParallelDims(dp=dp, tp=tp, pp=2, cp=cp, ep=ep)
    assert dims.edp == dp * cp * tp // ep
    for rank in range(dims.world_size):
        p, d, t = dims.coords(rank)
        c = dims.cp_rank(rank)
        assert dims.rank(p, d, t, c) == rank
        i = t + tp * (c + cp * d)
        assert dims.expert_coords(rank) == (i // ep, i % ep, 0)
    stage = [dims.expert_coords(r)[:2] for r in range(dims.stage_size)]
    assert sorted(stage) == [(e, k) for e in range(dims.edp) for k in range(ep)]


def test_expert_mesh_matches_the_folding():
    """The DeviceMesh cut (edp, ep, etp) from (pp, dp, cp, tp) holds the ranks the folding rule names."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(dp=2, tp=2, pp=2, ep=2)
    rank = 5  # pp 1, dp 0, tp 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")
        experts = dims.expert_mesh(mesh)
        assert experts["ep"].mesh.tolist() == [4, 5]
        assert experts["edp"].mesh.tolist() == [5, 7]
        assert dims.data_mesh(mesh).mesh.tolist() == [5, 7]
    finally:
        dist.destroy_process_group()


def test_expert_tensor_parallelism_is_refused_in_one_line(tmp_path):
    from paraplan.executor.job import Job

    path = Case("mixtral-etp2", "mixtral-tiny", dp=2, ep=1, etp=2, micro_batch=2).write(str(tmp_path))
    with pytest.raises(ExecutionError, match=r"expert tensor parallelism \(etp 2\) is not executed yet") as e:
        Job.load(path)
    assert "\n" not in str(e.value)


def test_sequence_parallel_leaves_moe_and_attention_internals_alone():
    """Under sequence parallelism only replicated weights on the sequence shard outside attention and MoE
    blocks become SequenceParallel: MLA's down-projections and norms see the gathered sequence, the MoE
    block routes its own shard (expert_parallel.py), Qwen3's q/k norms are summed over tp instead."""
    from paraplan.executor.tensor_parallel import tp_module_plan, tp_partial_params
    from paraplan.models import build_model, load_model_spec

    for model in ("deepseek-tiny", "mixtral-tiny"):
        spec = load_model_spec(model)
        plan = tp_module_plan(build_model(spec, "meta"), spec, sequence_parallel=True)
        assert not [n for n in plan if ".moe." in n or n.endswith(".moe") or ".attn." in n and
                    type(plan[n]).__name__ == "SequenceParallel"], sorted(plan)
    import executor_cases

    spec = executor_cases.spec_from_mapping(executor_cases.model_mapping("qwen3-moe-tiny"), source="qwen3-moe-tiny")
    assert tp_partial_params(build_model(spec, "meta")) == [f"layers.{i}.attn.{n}.weight" for i in range(2)
                                                            for n in ("q_norm", "k_norm")]


@pytest.mark.slow  # the dry-run spread (tests/test_dry_run.py) covers MoE in the default suite
def test_dry_run_counts_the_token_all_to_alls(tmp_path):
    """The dry run traces an expert-parallel plan (balanced routing on fake tensors) and counts its
    all-to-alls: per MoE layer and micro-batch, dispatch and combine forward and again backward, each the
    (tokens·k, h) rows of the rank, plus the forward's exchange of E int64 counts."""
    from paraplan.executor.dry_run import dry_run
    from paraplan.executor.job import Job

    case = Case("mixtral-dp2-ep2-dry", "mixtral-tiny", dp=2, ep=2, micro_batch=2)
    job = Job.load(case.write(str(tmp_path)))
    (traced,) = dry_run(job, "cpu", processes=1).ranks
    spec, lay = job.spec, job.layout
    rows = lay.micro_batch * job.seq_length * spec.experts_per_token
    per_layer = 4 * rows * spec.hidden_size * 4 + spec.num_experts * 8  # fp32 rows, int64 counts
    assert traced.comm_bytes["all_to_all"] == per_layer * spec.num_layers * lay.num_micro_batches

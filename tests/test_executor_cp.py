"""Context parallelism: each sequence split over cp ranks (causal models: chunks c and 2·cp-1-c of 2·cp on
rank c; BERT: plain chunks), keys and values all-gathered for attention (executor/context_parallel.py).

Each layout trains 3 steps under torchrun and its losses must equal the single process's (1e-4 relative);
its first step's gradients must too (tests/executor_grads.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from executor_cases import STEPS, Case, assert_losses_match, launched_run
from executor_grads import assert_grads_match, gradient_runs

from paraplan.executor.context_parallel import chunk_positions
from paraplan.executor.errors import ExecutionError

LOSS_CASES = {
    2: [
        Case("gpt-cp2", "gpt-tiny", cp=2, micro_batch=2),
        Case("llama-cp2", "llama-tiny", cp=2, micro_batch=2),
        Case("bert-cp2", "bert-small", cp=2, micro_batch=2),  # non-causal: plain chunks, no mask
    ],
    4: [
        Case("gpt-cp2xtp2", "gpt-tiny", cp=2, tp=2, micro_batch=4),
        Case("llama-cp2xtp2-sp", "llama-tiny", cp=2, tp=2, sequence_parallel=True, micro_batch=4),
        Case("gpt-cp2xpp2", "gpt-tiny", cp=2, pp=2, micro_batch=2),  # tied embedding split over the stages
        Case("llama-cp2xpp2", "llama-tiny", cp=2, pp=2, micro_batch=2),
        Case("llama-dp2xcp2-zero3", "llama-tiny", dp=2, cp=2, zero=3, micro_batch=2),
    ],
}

GRAD_CASES = {
    2: LOSS_CASES[2] + [
        Case("gpt-cp2-zero3", "gpt-tiny", cp=2, zero=3, micro_batch=2),
        Case("mixtral-cp2-ep2", "mixtral-tiny", cp=2, ep=2, micro_batch=2),  # aux loss over split sequences
        Case("deepseek-cp2", "deepseek-tiny", cp=2, micro_batch=4),  # MLA
    ],
    4: LOSS_CASES[4] + [
        Case("gpt-dp2xcp2-zero1-selective", "gpt-tiny", dp=2, cp=2, zero=1, recompute="selective", micro_batch=2),
        Case("gpt-cp2xpp2-interleaved", "gpt-tiny", cp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
             micro_batch=2),
        Case("mixtral-cp2xtp2-ep4", "mixtral-tiny", cp=2, tp=2, ep=4, micro_batch=4),
        Case("deepseek-cp2xtp2-sp-ep2-full", "deepseek-tiny", cp=2, tp=2, ep=2, sequence_parallel=True,
             recompute="full", micro_batch=4),
    ],
}


@pytest.mark.parametrize("case", LOSS_CASES[2] + [pytest.param(c, marks=pytest.mark.slow) for c in LOSS_CASES[4]],
                         ids=lambda c: c.name)  # 4 ranks: slow
def test_cp_layout_matches_single_process(case, tmp_path_factory):
    run = launched_run(f"cp{case.world_size}", LOSS_CASES[case.world_size], case, STEPS, tmp_path_factory)
    assert run["world_size"] == case.world_size and run["plan"]["cp"] == case.cp
    assert_losses_match(case, run)


@pytest.mark.parametrize("case", GRAD_CASES[2], ids=lambda c: c.name)
def test_cp_gradients_match_single_process(case, tmp_path_factory):
    folders = gradient_runs("cp2", GRAD_CASES[2], tmp_path_factory)
    assert_grads_match(case, folders[case.name])


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES[4], ids=lambda c: c.name)
def test_four_rank_cp_gradients_match_single_process(case, tmp_path_factory):
    folders = gradient_runs("cp4", GRAD_CASES[4], tmp_path_factory)
    assert_grads_match(case, folders[case.name])


def test_causal_chunks_balance_the_attention_work():
    """Rank c holds chunks c and 2·cp-1-c: all positions once, and every rank the same number of
    (query, key) pairs under the causal mask (Llama 3, Sec. 3.3.2)."""
    s, cp = 64, 4
    held = [chunk_positions(s, cp, r, causal=True) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    assert held[0].tolist() == [*range(8), *range(56, 64)]
    work = {int((p + 1).sum()) for p in held}  # query at position p attends p + 1 keys
    assert len(work) == 1
    assert chunk_positions(s, cp, 1, causal=False).tolist() == list(range(16, 32))


def test_a_sequence_that_does_not_split_is_refused_in_one_line(tmp_path):
    from paraplan.executor.job import Job

    path = Case("llama-cp4-short", "llama-tiny", cp=4, micro_batch=2).write(str(tmp_path))
    with open(path) as f:
        plan = json.load(f)
    with open(path, "w") as f:
        json.dump({**plan, "seq_length": 36}, f)
    with pytest.raises(ExecutionError, match="cuts the sequence into 8 equal chunks") as e:
        Job.load(path)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # the dry-run spread (tests/test_dry_run.py) covers cp in the default suite
def test_dry_run_counts_the_key_value_all_gathers(tmp_path):
    """The dry run traces a cp plan: per layer and micro-batch, K and V (b, heads, s, d) all-gathered in
    forward and their gradients reduce-scattered in backward (the stages' other gradients are all-reduced)."""
    from paraplan.executor.dry_run import dry_run
    from paraplan.executor.job import Job

    job = Job.load(Case("gpt-cp2xpp2-dry", "gpt-tiny", cp=2, pp=2, micro_batch=2).write(str(tmp_path)))
    ranks = dry_run(job, "cpu", processes=1).ranks
    spec, lay = job.spec, job.layout
    kv = 2 * lay.micro_batch * job.seq_length * spec.hidden_size * 4  # K and V of the whole sequence, fp32
    assert sum(r.comm_bytes["all_gather"] for r in ranks) == kv * spec.num_layers * lay.num_micro_batches
    assert all(r.comm_bytes["reduce_scatter"] == r.comm_bytes["all_gather"] for r in ranks)

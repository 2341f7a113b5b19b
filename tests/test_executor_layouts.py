"""Same model, seed and global batch => the same losses whatever the layout (DESIGN.md, run record).

Every case trains 3 steps with the executor under torchrun (CPU, gloo) and compares the losses with
an independent single-process run (tests/executor_cases.py) to 1e-4 relative. To pay for process
start-up once, the cases of one world size run one after another in the same torchrun launch; each
case is still its own test.
"""

from __future__ import annotations

import pytest
from executor_cases import STEPS, Case, assert_losses_match, launch_once, launched_run, read_run

CASES = {
    1: [Case("gpt-single", "gpt-tiny", micro_batch=2), Case("llama-single", "llama-tiny", micro_batch=2)],
    2: [
        Case("gpt-dp2", "gpt-tiny", dp=2),
        Case("llama-dp2", "llama-tiny", dp=2, micro_batch=2),
        Case("gpt-tp2", "gpt-tiny", tp=2, micro_batch=4),
        Case("gpt-tp2-odd-vocab", "gpt-odd-vocab", tp=2, micro_batch=4),
        Case("llama-tp2", "llama-tiny", tp=2, micro_batch=4),
        Case("gpt-pp2-gpipe", "gpt-tiny", pp=2, schedule="gpipe", micro_batch=2),
        Case("llama-pp2-gpipe", "llama-tiny", pp=2, schedule="gpipe", micro_batch=2),
        Case("llama-3layer-pp2-1f1b-uneven", "llama-3layer", pp=2, schedule="1f1b", micro_batch=2),
        Case("gpt-3layer-pp2-1f1b-uneven", "gpt-3layer", pp=2, schedule="1f1b", micro_batch=2),
        Case("gpt-pp2-interleaved-v2", "gpt-tiny", pp=2, schedule="interleaved-1f1b", virtual_stages=2),
        Case("llama-pp2-zbv", "llama-tiny", pp=2, schedule="zb-v", virtual_stages=2, micro_batch=2),
        Case("llama-dp2-zero1", "llama-tiny", dp=2, zero=1, micro_batch=2),
        Case("gpt-dp2-zero2", "gpt-tiny", dp=2, zero=2, micro_batch=2),
        Case("gpt-dp2-zero3", "gpt-tiny", dp=2, zero=3, micro_batch=2),
        Case("gpt-dp2-selective", "gpt-tiny", dp=2, recompute="selective", micro_batch=2),
        Case("llama-tp2-full", "llama-tiny", tp=2, recompute="full", micro_batch=4),
        Case("gpt-tp2-sp", "gpt-tiny", tp=2, sequence_parallel=True, micro_batch=4),
        Case("llama-tp2-sp-selective", "llama-tiny", tp=2, sequence_parallel=True, recompute="selective",
             micro_batch=4),
        Case("llama-tp2-sp-mlp", "llama-tiny", tp=2, sequence_parallel=True, recompute="mlp", micro_batch=4),
        Case("bert-tp2-sp", "bert-small", tp=2, sequence_parallel=True, micro_batch=4),  # post-norm, MLM head
        Case("mlp-dp2-zero3", "mlp-small", dp=2, zero=3),  # synthetic features and labels
        Case("mlp-pp2-gpipe", "mlp-small", pp=2, schedule="gpipe", micro_batch=2),
    ],
    4: [
        Case("gpt-dp2xtp2", "gpt-tiny", dp=2, tp=2, micro_batch=4),
        Case("llama-dp2xtp2-zero1", "llama-tiny", dp=2, tp=2, zero=1, micro_batch=4),
        Case("llama-tp2xpp2", "llama-tiny", tp=2, pp=2, micro_batch=4),
        Case("gpt-tp2xpp2-stage-recompute", "gpt-tiny", tp=2, pp=2, micro_batch=4,
             extra={"stage_recompute": ["full", "selective"]}),
        Case("gpt-dp2xpp2", "gpt-tiny", dp=2, pp=2, micro_batch=2),
        Case("llama-dp2xpp2-zero3-interleaved", "llama-tiny", dp=2, pp=2, zero=3, schedule="interleaved-1f1b",
             virtual_stages=2),
        Case("gpt-dp2xtp2-zero3-sp-full", "gpt-tiny", dp=2, tp=2, zero=3, sequence_parallel=True, recompute="full",
             micro_batch=4),
    ],
    8: [
        Case("gpt-dp2xtp2xpp2", "gpt-tiny", dp=2, tp=2, pp=2, micro_batch=2),
        Case("llama-dp2xtp2xpp2-zero3-sp", "llama-tiny", dp=2, tp=2, pp=2, zero=3, sequence_parallel=True,
             micro_batch=2),
    ],
}


def runs_of(world: int, tmp_path_factory) -> dict[str, str]:
    """Output folders of every case of world size ``world``, all run in one torchrun launch."""
    return launch_once(f"layouts{world}", CASES[world], STEPS, tmp_path_factory)[0]


def check_case(case: Case, tmp_path_factory) -> None:
    run = launched_run(f"layouts{case.world_size}", CASES[case.world_size], case, STEPS, tmp_path_factory)
    assert run["world_size"] == case.world_size
    assert run["steps"] == STEPS and len(run["step_time_s"]) == STEPS
    assert len(run["peak_memory_gib"]) == case.world_size
    assert run["backend"] == "gloo" and run["device"] == "cpu"
    assert_losses_match(case, run)


@pytest.mark.parametrize("case", CASES[1] + CASES[2] + [pytest.param(c, marks=pytest.mark.slow) for c in CASES[4]],
                         ids=lambda c: c.name)  # 4 ranks: slow
def test_layout_matches_single_process(case, tmp_path_factory):
    check_case(case, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[8], ids=lambda c: c.name)
def test_eight_rank_layout_matches_single_process(case, tmp_path_factory):
    check_case(case, tmp_path_factory)


def test_losses_fall_and_differ_between_models(tmp_path_factory):
    """The comparison is not vacuous: training makes progress and the models give different losses."""
    gpt = read_run(runs_of(1, tmp_path_factory)["gpt-single"])["losses"]
    llama = read_run(runs_of(1, tmp_path_factory)["llama-single"])["losses"]
    assert gpt[-1] < gpt[0] - 0.3 and llama[-1] < llama[0] - 0.3
    assert abs(gpt[1] - llama[1]) > 1e-2


@pytest.mark.parametrize("replicated,sharded", [("gpt-dp2", "gpt-dp2-zero3"), ("llama-dp2", "llama-dp2-zero1"),
                                                ("gpt-dp2", "gpt-dp2-zero2")])
def test_zero_shards_the_optimizer_state(replicated, sharded, tmp_path_factory):
    outs = runs_of(2, tmp_path_factory)
    full = read_run(outs[replicated])["optimizer_state_gib"]
    part = read_run(outs[sharded])["optimizer_state_gib"]
    assert len(set(full)) == 1 and full[0] > 0  # every replica holds all of it
    assert max(part) < 0.6 * full[0] and sum(part) == pytest.approx(full[0], rel=0.02)

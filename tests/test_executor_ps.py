"""Parameter servers (dp_mode ps) under torchrun on CPU/gloo: sync mode gives data parallelism's losses,
async mode follows the bounded-staleness protocol of executor/ps_protocol.py exactly (a one-process
replay of its rules gives the same losses) and its loss falls.

Every case runs 4 ranks (workers + servers) for 8 steps in one torchrun launch.
"""

from __future__ import annotations

import pytest
import torch
from executor_cases import RTOL, SEQ, Case, assert_losses_match, launched_run, reference_model

from paraplan.executor.batches import BatchSource
from paraplan.executor.optim import ADAMW
from paraplan.executor.ps_protocol import flat_grads, flat_params, load_flat, shard_bounds
from paraplan.models import loss_function

PS_STEPS = 8
SYNC = [
    Case("gpt-dp2-ps2-sync", "gpt-tiny", dp=2, micro_batch=2, dp_mode="ps", ps_servers=2),
    Case("mlp-dp3-ps1-sync", "mlp-small", dp=3, micro_batch=2, global_batch=12, dp_mode="ps", ps_servers=1),
]
ASYNC = [
    Case("gpt-dp2-ps2-async-s1", "gpt-tiny", dp=2, micro_batch=2, dp_mode="ps", ps_servers=2, ps_staleness=1),
    Case("llama-dp3-ps1-async-s2", "llama-tiny", dp=3, micro_batch=4, global_batch=12, dp_mode="ps",
         ps_servers=1, ps_staleness=2),
]


def run_of(case: Case, tmp_path_factory) -> dict:
    run = launched_run("ps", SYNC + ASYNC, case, PS_STEPS, tmp_path_factory)
    assert run["world_size"] == 4 and run["steps"] == PS_STEPS and len(run["step_time_s"]) == PS_STEPS
    assert len(run["peak_memory_gib"]) == 4
    return run


@pytest.mark.parametrize("case", SYNC, ids=lambda c: c.name)
def test_sync_parameter_servers_match_data_parallelism(case, tmp_path_factory):
    run = run_of(case, tmp_path_factory)
    assert_losses_match(case, run)  # = the single-process run = data parallelism with dp = N
    state = run["optimizer_state_gib"]
    workers, servers = state[:case.dp], state[case.dp:]
    assert all(s == 0 for s in workers) and all(s > 0 for s in servers)  # the servers hold AdamW's state
    assert sum(servers) == pytest.approx(max(servers) * case.ps_servers, rel=1e-3)  # in equal shards


@pytest.mark.parametrize("case", ASYNC, ids=lambda c: c.name)
def test_async_parameter_servers_follow_the_documented_protocol(case, tmp_path_factory):
    run = run_of(case, tmp_path_factory)
    losses = run["losses"]
    assert losses[-1] < losses[0] - 0.5 and sum(losses[-3:]) < sum(losses[:3]) - 1.0
    assert_losses_match(case, run, ref=replay_async(case, PS_STEPS))


def test_async_replay_differs_from_sync():
    """The replay is not data parallelism in disguise: staleness changes the losses."""
    sync = replay_async(ASYNC[0], 4, staleness=0)
    stale = replay_async(ASYNC[0], 4)
    assert abs(sync[2] - stale[2]) > 1e-2


def test_shards_are_contiguous_and_balanced():
    for total, k in [(10, 3), (7, 7), (1000003, 4)]:
        bounds = shard_bounds(total, k)
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1


def replay_async(case: Case, steps: int, staleness: int | None = None) -> list[float]:
    """The protocol of executor/ps_protocol.py in one process: the servers' state is one flat vector
    (AdamW is elementwise, so its cut into shards does not matter); pushes are applied in the order
    (step, worker), each as one AdamW step on gradient / N; worker w computes step t with the state
    right after push (w, t-1-s). With s = 0 it runs the sync rule instead (one averaged step a round)."""
    s = case.ps_staleness if staleness is None else staleness
    n = case.dp
    spec, model = reference_model(case)
    params = list(model.parameters())
    theta = torch.nn.Parameter(flat_params(params))  # (P,) the servers' parameters
    opt = torch.optim.AdamW([theta], **ADAMW)
    after: dict[tuple[int, int], torch.Tensor] = {}  # (worker, step) -> state right after that push
    initial = theta.detach().clone()
    loss_fn = loss_function(spec)
    m = case.global_batch // (n * case.micro_batch)
    losses = []
    for t in range(steps):
        total, grads = 0.0, []
        for w in range(n):
            source = BatchSource(spec=spec, seed=case.seed, global_batch=case.global_batch, seq_length=SEQ, dp=n,
                                 dp_rank=w)
            pulled = t - 1 if s == 0 else t - 1 - s
            load_flat(params, after[(w, pulled)] if pulled >= 0 else initial)
            x, y = source.batch(t)
            for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
                loss = loss_fn(model(xi), yi)
                (loss / m).backward()
                total += loss.item() / (m * n)
            grads.append(flat_grads(params))
            model.zero_grad(set_to_none=True)
            if s > 0:  # async: this push is applied at once, in (step, worker) order
                apply(theta, opt, grads[-1] / n)
                after[(w, t)] = theta.detach().clone()
        if s == 0:
            apply(theta, opt, sum(grads[1:], grads[0].clone()) / n)
            for w in range(n):
                after[(w, t)] = theta.detach().clone()
        losses.append(total)
    return losses


def apply(theta: torch.nn.Parameter, opt: torch.optim.Optimizer, grad: torch.Tensor) -> None:
    theta.grad = grad
    opt.step()
    theta.grad = None


def test_replay_with_no_staleness_is_data_parallelism():
    """Sanity of the replay itself: with s = 0 it is the single-process run."""
    from executor_cases import reference_losses

    case = SYNC[0]
    got, want = replay_async(case, 3, staleness=0), reference_losses(case, 3)
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)), (got, want)

"""Gradient equivalence for the executor tests: one training step of a plan under several processes (gloo),
each parameter's whole gradient compared with the single process's.

Loss equality over a few AdamW steps cannot see a gradient that is wrong by a constant factor per tensor
(Adam normalises each tensor's update), and MoE expert-parallel gradients are exactly that kind of risk:
so the MoE and context-parallel tests also compare the gradients of the first step directly.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from executor_cases import SEQ, Case, reference_model
from spawned_rank import exit_passed_rank

GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-7  # for gradients that are zero but for rounding (a key bias under softmax: ~1e-10)


def _grad_worker(rank: int, world: int, port: int, plans: list[str], outs: list[str], folder: str) -> None:
    """One rank: for each plan, build the rank model, run step 0's forward, backward and gradient syncs, and
    save every parameter's whole gradient (by whole-model name) instead of updating."""
    import faulthandler

    from paraplan.executor.job import Job
    from paraplan.executor.parallelize import build_rank_model
    from paraplan.executor.trainer import Trainer

    # a native crash writes every thread's Python stack where gradient_runs reads it (kept open until the exit)
    faulthandler.enable(file=open(os.path.join(folder, f"faults{rank}.txt"), "w"))  # noqa: SIM115
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        for plan, out in zip(plans, outs, strict=True):
            job = Job.load(plan)
            rm = build_rank_model(job, rank, torch.device("cpu"), timedelta(seconds=120))
            rm.optimizer = _Capture(rm.chunks)
            Trainer.create(rm).train_step(0)
            os.makedirs(out, exist_ok=True)
            torch.save(rm.optimizer.grads, os.path.join(out, f"grads{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_passed_rank()  # not the interpreter's finalization, where gloo's teardown can crash (spawned_rank.py)


class _Capture:
    """An optimizer whose step keeps each parameter's whole gradient (collective for sharded ones: every rank
    of a stage visits its parameters in the same order)."""

    def __init__(self, chunks):
        self.chunks, self.grads = chunks, {}

    def step(self) -> None:
        from paraplan.executor.chunks import canonical_fqn

        for chunk in self.chunks:
            for name, p in chunk.module.named_parameters(remove_duplicate=False):
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    self.grads[canonical_fqn(name)] = g.detach().clone()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


_RUNS: dict[str, dict[str, str]] = {}


def gradient_runs(key: str, cases: list[Case], folder_factory) -> dict[str, str]:
    """Run every case of ``cases`` (one world size) in one group of processes, once per session and ``key``;
    {case name: folder of its per-rank gradient files}."""
    if key not in _RUNS:
        import torch.multiprocessing as mp

        from paraplan.executor.machine import free_port

        (world,) = {c.world_size for c in cases}
        for attempt in (1, 2):
            folder = str(folder_factory.mktemp(f"grads-{key}"))
            plans = [c.write(folder) for c in cases]
            outs = [os.path.join(folder, c.name) for c in cases]
            try:
                mp.start_processes(_grad_worker, args=(world, free_port("127.0.0.1"), plans, outs, folder),
                                   nprocs=world, join=True, start_method="spawn")
                break
            except mp.ProcessExitedException as e:
                if e.signal_name is None or attempt == 2:
                    raise AssertionError(f"{e}\n{native_stacks(folder, world)}") from e
                # a rank killed by a signal (gloo on CPU segfaulted once in CI, in a run that the same layouts
                # passed right after): run the group again, and say so with the stacks the crash left
                warnings.warn(f"gradient runs {key!r}: {e}; ran again\n{native_stacks(folder, world)}", stacklevel=2)
        _RUNS[key] = dict(zip([c.name for c in cases], outs, strict=True))
    return _RUNS[key]


def native_stacks(folder: str, world: int) -> str:
    """What faulthandler wrote for each rank of the run in ``folder`` (empty where a rank did not crash)."""
    texts = []
    for rank in range(world):
        path = os.path.join(folder, f"faults{rank}.txt")
        text = open(path).read().strip() if os.path.exists(path) else ""  # noqa: SIM115
        if text:
            texts.append(f"rank {rank}:\n{text}")
    return "\n".join(texts) or "(no rank wrote a Python stack)"


def reference_grads(case: Case) -> dict[str, torch.Tensor]:
    """Step 0's gradient of the whole global batch's mean loss (MoE auxiliary losses included) in one process."""
    from paraplan.executor.batches import BatchSource
    from paraplan.models import loss_function, set_aux_loss_scale

    spec, model = reference_model(case)
    x, y = BatchSource(spec=spec, seed=case.seed, global_batch=case.global_batch, seq_length=SEQ).batch(0)
    set_aux_loss_scale(1.0)
    loss_function(spec)(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def assert_grads_match(case: Case, folder: str) -> None:
    """Every gradient every rank holds equals the single process's (norm of the difference, relative to the
    gradient's norm)."""
    ref = reference_grads(case)
    world = case.world_size
    seen = set()
    for rank in range(world):
        grads = torch.load(os.path.join(folder, f"grads{rank}.pt"))
        for name, g in grads.items():
            want = ref[name]
            assert g.shape == want.shape, f"{case.name} rank {rank}: {name} {tuple(g.shape)} vs {tuple(want.shape)}"
            diff = float((g - want).norm())
            assert diff <= GRAD_RTOL * float(want.norm()) + GRAD_ATOL, (
                f"{case.name} rank {rank}: gradient of {name} off by {diff:.2e} (norm {float(want.norm()):.2e})")
            seen.add(name)
    missing = sorted(set(ref) - seen)
    assert not missing, f"{case.name}: no rank holds a gradient for {missing[:3]}"

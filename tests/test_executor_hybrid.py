"""Hybrid per-layer parallelism (head_parallel k): a data-parallel trunk with a class-sharded classifier
trains exactly like the single-process model (losses to 1e-4 relative, 3 steps, CPU/gloo), and the
gradients it applies are those of the global mean loss (checked directly: AdamW's losses alone would
hide a uniform gradient scale)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from executor_cases import STEPS, Case, assert_losses_match, launched_run, reference_losses, reference_model
from spawned_rank import exit_passed_rank

from paraplan.executor.batches import BatchSource
from paraplan.executor.machine import free_port
from paraplan.models import loss_function

CASES = {
    2: [
        Case("mlp-dp2-head2", "mlp-1k-classes", dp=2, micro_batch=2, head_parallel=2),  # 2 micro-batches
        Case("resnet18-dp2-head2", "resnet18-tiny", dp=2, micro_batch=2, head_parallel=2),  # pooled features, BN
    ],
    4: [
        Case("mlp-dp4-head2", "mlp-1k-classes", dp=4, micro_batch=1, head_parallel=2),  # 2 groups of 2
        Case("mlp-dp4-head4", "mlp-1k-classes", dp=4, micro_batch=2, head_parallel=4),
    ],
}


def reference(case: Case) -> list[float]:
    """The single-process run; BatchNorm models accumulate over the same micro-batch size."""
    uses_bn = case.model.startswith("resnet")
    return reference_losses(case, STEPS, micro_batch=case.micro_batch if uses_bn else None)


@pytest.mark.parametrize("case", CASES[2] + [pytest.param(c, marks=pytest.mark.slow) for c in CASES[4]],
                         ids=lambda c: c.name)  # 4 ranks: slow
def test_class_sharded_head_matches_single_process(case, tmp_path_factory):
    run = launched_run(f"hybrid{case.world_size}", CASES[case.world_size], case, STEPS, tmp_path_factory)
    assert run["world_size"] == case.dp and run["steps"] == STEPS and len(run["peak_memory_gib"]) == case.dp
    assert run["plan"]["layer_strategies"] == {"head": {"parallel": "tensor", "degree": case.head_parallel}}
    assert_losses_match(case, run, ref=reference(case))
    # each rank keeps AdamW state (2 fp32 moments, and a step count) for the trunk and 1/k of the classifier
    _, model = reference_model(case)
    head = sum(p.numel() for p in model.head.parameters())
    trunk = sum(p.numel() for p in model.parameters()) - head
    for gib in run["optimizer_state_gib"]:
        assert gib * 2**30 == pytest.approx(8 * (trunk + head / case.head_parallel), rel=1e-3)


GRAD_CASE = Case("mlp-dp4-head2-grads", "mlp-1k-classes", dp=4, micro_batch=1, head_parallel=2)


def test_gradients_are_those_of_the_global_mean_loss(tmp_path):
    """dp 4, k 2, two micro-batches: after one step's backward and syncs, every rank's trunk gradient
    and head-shard gradient equal the single-process gradient of the global batch's mean loss."""
    port = free_port("127.0.0.1")
    mp.spawn(_capture_gradients, args=(GRAD_CASE, port, str(tmp_path)), nprocs=GRAD_CASE.dp, join=True)
    spec, model = reference_model(GRAD_CASE)
    x, y = BatchSource(spec=spec, seed=GRAD_CASE.seed, global_batch=GRAD_CASE.global_batch, seq_length=None).batch(0)
    loss_function(spec)(model(x), y).backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    for rank in range(GRAD_CASE.dp):
        got = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        lo, hi = got.pop("classes")
        assert set(got) == set(want)
        for name, grad in got.items():
            ref = want[name][lo:hi] if name.startswith("head.") else want[name]
            err = (grad - ref).norm() / ref.norm()
            assert err < 1e-5, f"rank {rank} {name}: relative gradient error {err:.2e}"


def _capture_gradients(rank: int, case: Case, port: int, folder: str) -> None:
    """One rank of the gradient test: build the hybrid as the executor does, run step 0 with an
    "optimizer" that records the gradients it would apply."""
    from paraplan.executor.job import Job
    from paraplan.executor.parallelize import build_rank_model
    from paraplan.executor.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=case.dp,
                            timeout=timedelta(seconds=60))
    try:
        plan = case.plan()
        job = Job(plan=plan, spec=reference_model(case)[0], source=case.name)
        job.check()
        rm = build_rank_model(job, rank, torch.device("cpu"), timedelta(seconds=60))
        (model,) = rm.trained
        capture = _Capture(model)
        rm.optimizer = capture
        Trainer.create(rm).step(0)
        torch.save({**capture.grads, "classes": model.head.classes}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


class _Capture:
    """Stands in for the optimizer: keeps the gradients, named as in the whole model."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.grads = model, {}

    def step(self) -> None:
        for name, p in self.model.named_parameters():
            self.grads[name.removeprefix("trunk.").removeprefix("module.")] = p.grad.detach().clone()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def test_hybrid_with_zero_is_refused_in_one_line(tmp_path):
    from conftest import assert_one_line_error, run_cli

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(Case("h", "mlp-1k-classes", dp=2, micro_batch=2, head_parallel=2, zero=1)
                               .plan().to_dict()))
    p = run_cli("execute", "--plan", str(path))
    assert_one_line_error(p, "head_parallel", "zero 0")
    assert p.returncode == 2


@pytest.mark.parametrize("mapping,in_features,pool", [
    (dict(family="resnet", depth=50, image_size=224, num_classes=1000), 2048, True),
    (dict(family="vgg", depth=16, image_size=224, num_classes=1000), 4096, False),
    (dict(family="mlp", input_size=64, hidden_sizes=[128, 96], num_classes=1000), 96, False),
])
def test_every_classifier_family_splits_into_trunk_and_head(mapping, in_features, pool):
    """On the meta device (no memory): the trunk keeps every block but ``head``, under its own names."""
    from paraplan.executor.hybrid import split_head
    from paraplan.models import block_names, spec_from_mapping

    spec = spec_from_mapping({"name": "m", **mapping}, source="test")
    blocks = block_names(spec)
    chunk, got_in, got_pool = split_head(spec, [blocks])
    assert (got_in, got_pool) == (in_features, pool)
    assert chunk.module.present_blocks() == blocks[:-1] and blocks[-1] == "head"

"""In-process checks of the executor's parts: rank layout, stage placement, data, recomputation,
ZeRO-1 partitioning and the failure diagnosis (no processes started, fast)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paraplan.executor.batches import BatchSource
from paraplan.executor.checkpointing import apply_ac
from paraplan.executor.chunks import build_chunks, local_stages, materialize
from paraplan.executor.errors import ExecutionError
from paraplan.executor.launch import Outcome, diagnose, torchrun_failures
from paraplan.executor.optim import partition
from paraplan.executor.parallel_dims import ParallelDims
from paraplan.executor.status import RankStatus
from paraplan.models import block_names, build_model, initialize, load_model_spec, loss_function
from paraplan.planner.placement import rank_of
from paraplan.planner.schedules import stage_rank


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (3, 2, 1)])
def test_mesh_coordinates_match_the_planner_placement(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    for rank in range(dims.world_size):
        p, d, t = dims.coords(rank)
        assert rank_of(t, d, p, tp, dp) == rank == dims.rank(p, d, t)
    with pytest.raises(ExecutionError, match="ranks"):
        dims.check_world(dims.world_size + 1)


@pytest.mark.parametrize("schedule,pp,v", [("1f1b", 4, 1), ("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 2, 3),
                                           ("zb-v", 2, 2), ("zb-v", 4, 2)])
def test_local_stages_follow_the_planner(schedule, pp, v):
    held = [local_stages(schedule, r, pp, pp * v) for r in range(pp)]
    assert sorted(s for stages in held for s in stages) == list(range(pp * v))
    for r, stages in enumerate(held):
        assert len(stages) == v and all(stage_rank(schedule, s, pp) == r for s in stages)
    if schedule == "zb-v":  # the V: the first rank holds the first and the last stage
        assert held[0] == [0, 2 * pp - 1]


def test_chunks_keep_names_and_weights_of_the_whole_model():
    spec = load_model_spec("gpt-tiny")
    stages = [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
    whole = build_model(spec, "cpu")
    initialize(whole, spec, seed=7)
    for pp_rank in range(2):
        (chunk,) = build_chunks(spec, stages, "1f1b", pp_rank, 2)
        materialize(chunk.module, spec, 7, torch.device("cpu"))
        assert chunk.module.present_blocks() == stages[pp_rank]
        for name, p in chunk.module.named_parameters():
            assert torch.equal(p, whole.get_parameter(name)), name
    # the tied head, alone in the last stage, starts as a copy of the embedding
    (last,) = build_chunks(spec, stages, "1f1b", 1, 2)
    materialize(last.module, spec, 7, torch.device("cpu"))
    assert torch.equal(last.module.head.proj.weight, whole.embed.tok.weight)


def test_whole_model_chunk_stays_tied():
    spec = load_model_spec("gpt-tiny")
    (chunk,) = build_chunks(spec, [block_names(spec)], "1f1b", 0, 1)
    materialize(chunk.module, spec, 0, torch.device("cpu"))
    assert chunk.module.head.proj.weight is chunk.module.embed.tok.weight


@pytest.mark.parametrize("model", ["gpt-tiny", "resnet50"])
def test_batches_are_layout_independent(model):
    spec = load_model_spec(model)
    seq = 16 if spec.is_transformer else None
    whole = BatchSource(spec=spec, seed=3, global_batch=8, seq_length=seq)
    x, y = whole.batch(5)
    parts = [BatchSource(spec=spec, seed=3, global_batch=8, seq_length=seq, dp=4, dp_rank=d).batch(5) for d in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(whole.batch(6)[0], x)  # another step, other samples
    assert torch.equal(whole.batch(5)[0], x)  # the same step, the same samples
    if spec.is_transformer:
        assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
        assert int(x.max()) < spec.vocab_size


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model_name: str, mode: str) -> dict[str, int]:
    spec = load_model_spec(model_name)
    model = build_model(spec, "cpu")
    initialize(model, spec, 0)
    assert apply_ac(model, mode) == (0 if mode == "none" else spec.num_layers)
    x, y = BatchSource(spec=spec, seed=0, global_batch=2, seq_length=16).batch(0)
    loss = loss_function(spec)(model(x), y)
    with _CountOps() as counter:
        loss.backward()
    return counter.ops


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_recomputation_reruns_exactly_what_the_mode_says(model):
    """In backward: none reruns no forward op; selective reruns only the attention core (one SDPA forward
    per layer, no linear); full reruns whole layers (norms and linears too)."""
    layers = load_model_spec(model).num_layers
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu"
    none, sel, full = (_backward_ops(model, m) for m in ("none", "selective", "full"))
    assert none.get(sdpa, 0) == 0
    assert sel.get(sdpa, 0) == layers and sel.get("aten.mm") == none.get("aten.mm")
    assert sel.get("aten.addmm", 0) == none.get("aten.addmm", 0)
    assert full.get(sdpa, 0) == layers
    assert full.get("aten.mm", 0) + full.get("aten.addmm", 0) > none.get("aten.mm", 0) + none.get("aten.addmm", 0)


def _kept_bytes(model_name: str, mode: str) -> int:
    """Bytes of the tensors one forward leaves alive for backward (the loss's graph holds them), as the dry run
    counts them (executor/trace.py: every storage an op makes, until it is freed)."""
    from paraplan.executor.trace import RankTrace

    spec = load_model_spec(model_name)
    model = build_model(spec, "cpu")
    initialize(model, spec, 0)
    apply_ac(model, mode)
    x, y = BatchSource(spec=spec, seed=0, global_batch=2, seq_length=16).batch(0)
    with RankTrace() as trace:
        loss = loss_function(spec)(model(x), y)
        kept = trace.total
    loss.backward()
    return kept


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "deepseek-tiny"])
def test_selective_recomputation_keeps_less_than_none(model):
    """Selective recomputation keeps the attention core's inputs instead of its internals (and, for multi-head
    latent attention, the latents instead of the up-projected queries, keys and values): never more than no
    recomputation. torch's selective checkpointing, which this executor used before, cached every op it did not
    recompute and kept more than none with grouped-query attention (llama-tiny) and MLA."""
    none, sel = _kept_bytes(model, "none"), _kept_bytes(model, "selective")
    assert sel < none, (sel, none)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_recomputation_stops_early_as_the_cost_model_says(model):
    """mlp reruns each layer's MLP forward in backward and nothing of the attention; torch's non-reentrant
    checkpoint stops once the tensors backward needs are rebuilt, so the MLP's last linear (whose output
    nothing saves) is not rerun — under mlp, and under full recomputation of these pre-norm layers: GELU MLPs
    rerun 1 of their 2 linears, SwiGLU 2 of 3, full recomputation all linears but the last (one matmul each).
    planner/costmodel.py prices this executor's recomputation so (Framework.recompute_early_stop)."""
    spec = load_model_spec(model)
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu"
    none, mlp, full = (_backward_ops(model, m) for m in ("none", "mlp", "full"))

    def matmuls(ops):
        return ops.get("aten.mm", 0) + ops.get("aten.addmm", 0)

    assert mlp.get(sdpa, 0) == 0
    mlp_linears = 3 if spec.family == "llama" else 2
    assert matmuls(mlp) - matmuls(none) == (mlp_linears - 1) * spec.num_layers
    assert matmuls(full) - matmuls(none) == (4 + mlp_linears - 1) * spec.num_layers  # q, k, v, o and the MLP's


@pytest.mark.parametrize("model", ["gpt-tiny", "deepseek-tiny"])
def test_selective_and_mlp_recomputation_together_rerun_and_keep_what_each_does(model):
    """selective+mlp reruns the attention core as selective does and the MLP as mlp does (one SDPA forward per
    layer, the MLP's matmuls), and keeps less than either alone: what the cost model prices as their union."""
    spec = load_model_spec(model)
    none, mlp, both = (_backward_ops(model, m) for m in ("none", "mlp", "selective+mlp"))

    def cores(ops):  # attention cores run forward (the fused CPU kernel; MLA's unequal head dims take the math path)
        return ops.get("aten._scaled_dot_product_flash_attention_for_cpu", 0) + ops.get("aten._safe_softmax", 0)

    def matmuls(ops):
        return ops.get("aten.mm", 0) + ops.get("aten.addmm", 0) + ops.get("aten.bmm", 0)

    assert cores(both) == spec.num_layers and cores(mlp) == cores(none) == 0
    if not getattr(spec, "mla", False):  # MLA's prologue (its up-projections) reruns with the core: more matmuls
        assert matmuls(both) == matmuls(mlp)
    assert matmuls(both) > matmuls(none)
    kept = {m: _kept_bytes(model, m) for m in ("selective", "mlp", "selective+mlp")}
    assert kept["selective+mlp"] < min(kept["selective"], kept["mlp"]), kept


def test_zero1_partition_is_balanced_and_complete():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 10, 500, 490, 7, 3)]
    owner = partition(params, 2)
    loads = [sum(p.numel() for p, o in zip(params, owner, strict=True) if o == r) for r in range(2)]
    assert sorted(set(owner)) == [0, 1] and abs(loads[0] - loads[1]) <= 20


FAILURE_TEXT = """
Failures:
[1]:
  time      : 2026-01-01_00:00:00
  host      : node
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 1234)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1233)
"""


def test_torchrun_failures_are_parsed():
    assert torchrun_failures(FAILURE_TEXT) == {3: -9, 0: 1}


def _st(rank, state, step=1, phase="train", message="", t=0.0):
    return RankStatus(rank=rank, state=state, phase=phase, step=step, time=t, message=message)


def test_diagnosis_names_the_rank_that_caused_the_failure():
    own = Outcome(1, {0: _st(0, "peer", message="RuntimeError: Connection closed by peer"),
                      1: _st(1, "error", message="ValueError: bad", t=1.0)}, "", world_size=2)
    assert diagnose(own) == "rank 1 failed step 2: ValueError: bad"
    died = Outcome(1, {0: _st(0, "peer", message="RuntimeError: Connection closed by peer"),
                       1: _st(1, "running", step=0)}, FAILURE_TEXT.replace("3 (local", "1 (local"), world_size=2)
    assert diagnose(died) == "rank 1 died step 1 (killed by signal SIGKILL)"
    hung = Outcome(1, {0: _st(0, "peer", message="RuntimeError: Timed out waiting 5000ms"),
                       1: _st(1, "terminated", step=2)}, "", world_size=2)
    assert diagnose(hung).startswith("rank 1 hung step 3")
    remote = Outcome(1, {0: _st(0, "peer", message="RuntimeError: Connection reset by peer"),
                         1: _st(1, "peer", message="RuntimeError: Connection reset by peer")}, "", world_size=4)
    assert diagnose(remote).startswith("a rank on another node (one of ranks 2, 3) failed; rank 0 here saw")


def _weight_pass(mode: str) -> tuple[int, int]:
    """A middle zb-v stage of llama-tiny (its layers, the head and the loss, from a hidden state that needs a
    gradient) under recomputation ``mode``: torch's input pass, then its weight pass traced; (attention cores the
    weight pass runs, bytes it rises by)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from paraplan.executor.trace import RankTrace

    spec = load_model_spec("llama-tiny")
    model = build_model(spec, "cpu")
    initialize(model, spec, 0)
    apply_ac(model, mode)
    x, y = BatchSource(spec=spec, seed=0, global_batch=2, seq_length=16).batch(0)
    hidden = model.embed(x).detach().requires_grad_()  # (b, s, h)
    out = hidden
    for name in model.layers:
        out = model.layers[name](out)
    loss = loss_function(spec)(model.head(out), y)
    stage = [*model.layers.parameters(), *model.head.parameters()]
    _, groups = stage_backward_input([loss], None, [hidden], iter(stage))
    with _CountOps() as counter, RankTrace() as trace:
        before = trace.total
        stage_backward_weight(iter(stage), groups)
        rise = trace.peak - before
    return counter.ops.get("aten._scaled_dot_product_flash_attention_for_cpu", 0), rise


def test_zero_bubble_weight_pass_recomputes_checkpointed_layers_once_per_parameter_group():
    """Why zb-v refuses recomputation that checkpoints weights (layout.zero_bubble_recompute_refusal): torch's
    weight pass (stage_backward_weight) asks autograd once per parameter group, so a fully recomputed llama layer
    reruns its forward (its attention core) once per weight it holds — nine times, where the plain backward reruns
    it once — and keeps the copies until the pass ends: the pass rises above its rise without recomputation by more
    than everything no recomputation keeps. Should torch change this, this test fails and the refusal can go."""
    spec = load_model_spec("llama-tiny")
    model = build_model(spec, "cpu")
    per_layer = len(list(model.layers["0"].parameters()))  # two norms, q, k, v, o and the MLP's three
    cores, rise = _weight_pass("full")
    cores_none, rise_none = _weight_pass("none")
    assert per_layer == 9 and cores == per_layer * spec.num_layers and cores_none == 0, (cores, per_layer)
    assert rise - rise_none > _kept_bytes("llama-tiny", "none"), (rise, rise_none)

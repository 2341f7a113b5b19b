"""Helpers for the executor tests: small plans written directly (independent of the planner's search),
and an independent single-process reference run to compare their losses with."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from paraplan.executor.batches import BatchSource
from paraplan.executor.errors import JobFailed
from paraplan.executor.launch import LaunchOptions, launch
from paraplan.executor.machine import free_port
from paraplan.executor.optim import ADAMW
from paraplan.models import PRESETS, block_names, build_model, initialize, loss_function, spec_from_mapping
from paraplan.planner.layout import Layout
from paraplan.planner.plan import Plan

SEQ = 32  # short sequences keep CPU runs fast
STEPS = 3
RTOL = 1e-4

# Small variants beyond the presets: an odd number of layers, for uneven pipeline stages.
EXTRA_MODELS = {
    "gpt-3layer": dict(family="gpt", num_layers=3, hidden_size=128, num_attention_heads=4, vocab_size=1024,
                       seq_length=128),
    # a vocabulary tensor parallelism does not divide: uneven vocabulary shards (1,021 rows: 511 and 510 at tp 2) in
    # the embedding, the head and the vocab-parallel loss (the byte tokens use ids below 256 alone: the embedding's
    # other rows are checked in tests/test_vocab_parallel.py)
    "gpt-odd-vocab": dict(family="gpt", num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1021,
                          seq_length=128),
    "llama-3layer": dict(family="llama", num_layers=3, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=352, vocab_size=1024, seq_length=128),
    # Qwen3-MoE style: per-head q/k norms, a head size that is not hidden / heads, no shared experts
    "qwen3-moe-tiny": dict(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                           head_dim=48, qk_norm=True, ffn_hidden_size=256, moe_ffn_hidden_size=64, num_experts=8,
                           experts_per_token=2, vocab_size=1024, seq_length=128),
    # Llama 4 Maverick's pattern: experts in every other layer (a dense MLP between), one shared expert, top-1 sigmoid
    "llama4-tiny": dict(family="llama", num_layers=4, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                        ffn_hidden_size=352, moe_ffn_hidden_size=192, num_experts=4, experts_per_token=1,
                        num_shared_experts=1, moe_layer_step=2, moe_score_function="sigmoid", moe_norm_topk=False,
                        vocab_size=1024, seq_length=128),
    # GPT-OSS's experts: biases on every routed expert's linears and on the router (spec field expert_bias)
    "moe-bias-tiny": dict(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                          ffn_hidden_size=256, moe_ffn_hidden_size=64, num_experts=4, experts_per_token=2,
                          expert_bias=True, vocab_size=1024, seq_length=128),
    # DeepSeek-V3's node-limited routing: each token's 2 experts within 2 of 4 groups of 2
    "deepseek-groups-tiny": {**PRESETS["deepseek-tiny"], "moe_router_num_groups": 4, "moe_router_group_topk": 2},
    "bert-small": dict(family="bert", num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1024,
                       seq_length=128),
    "mlp-small": dict(family="mlp", input_size=64, hidden_sizes=[128, 128], num_classes=10),
    # a classifier much larger than its trunk: what a class-sharded head (head_parallel) is for
    "mlp-1k-classes": dict(family="mlp", input_size=64, hidden_sizes=[128, 128], num_classes=1000),
    "resnet18-tiny": dict(family="resnet", depth=18, image_size=64, num_classes=100),
}


def model_mapping(model: str) -> dict:
    return {"name": model, **(PRESETS.get(model) or EXTRA_MODELS[model])}


def split_stages(blocks: list[str], n: int) -> list[list[str]]:
    """Contiguous, as even as possible, earlier stages taking the extra block."""
    q, r = divmod(len(blocks), n)
    out, i = [], 0
    for s in range(n):
        size = q + (1 if s < r else 0)
        out.append(blocks[i:i + size])
        i += size
    return out


@dataclass(frozen=True)
class Case:
    """One layout of one model, named for the test id."""

    name: str
    model: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int = 8
    seed: int = 0
    dp_mode: str = "allreduce"
    ps_servers: int = 1
    ps_staleness: int = 0
    head_parallel: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp + (self.ps_servers if self.dp_mode == "ps" else 0)

    def plan(self) -> Plan:
        spec = spec_from_mapping(model_mapping(self.model), source=self.model)
        layout = Layout(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch=self.micro_batch,
                        global_batch=self.global_batch, schedule=self.schedule, virtual_stages=self.virtual_stages,
                        zero=self.zero, recompute=self.recompute, sequence_parallel=self.sequence_parallel,
                        dtype="fp32", dp_mode=self.dp_mode, ps_servers=self.ps_servers,
                        ps_staleness=self.ps_staleness, head_parallel=self.head_parallel, cp=self.cp, ep=self.ep,
                        etp=self.etp)
        stages = split_stages(block_names(spec), layout.num_stages)
        return Plan(model=self.model, cluster="local", layout=layout, stages=stages, seed=self.seed,
                    model_spec=spec.to_dict(), seq_length=SEQ, nodes=1,
                    prediction={"iteration_time_s": 0.1, "peak_memory_gib": 0.3}, **self.extra)

    def write(self, folder: str) -> str:
        path = os.path.join(folder, f"{self.name}.json")
        with open(path, "w") as f:
            json.dump(self.plan().to_dict(), f, indent=1)
        return path


_REFERENCE: dict[tuple, list[float]] = {}


def reference_model(case: Case):
    """(spec, model) of the case, reference-initialised in this process, on CPU."""
    spec = spec_from_mapping(model_mapping(case.model), source=case.model)
    with torch.random.fork_rng():
        model = build_model(spec, "cpu")
    initialize(model, spec, case.seed)
    return spec, model


def reference_losses(case: Case, steps: int = STEPS, micro_batch: int | None = None) -> list[float]:
    """The same model, seed and global batch trained in this process without any parallelism: one
    forward of the whole global batch per step (or, given ``micro_batch``, gradient accumulation over
    contiguous micro-batches of that size: what BatchNorm models need to match), AdamW with the
    executor's settings."""
    key = (case.model, case.seed, case.global_batch, steps, micro_batch)
    if key in _REFERENCE:
        return _REFERENCE[key]
    spec, model = reference_model(case)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    source = BatchSource(spec=spec, seed=case.seed, global_batch=case.global_batch, seq_length=SEQ)
    loss_fn = loss_function(spec)
    m = case.global_batch // (micro_batch or case.global_batch)
    losses = []
    for k in range(steps):
        x, y = source.batch(k)  # (B, s) each
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = loss_fn(model(xi), yi)
            (loss / m).backward()
            total += loss.item() / m
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    _REFERENCE[key] = losses
    return losses


def read_run(folder: str) -> dict:
    with open(os.path.join(folder, "run.json")) as f:
        return json.load(f)


# Per launch key: {case name: output folder} and the launch's error (None when it ended well).
_LAUNCHED: dict[str, tuple[dict[str, str], str | None]] = {}


def launch_once(key: str, cases: list[Case], steps: int, tmp_path_factory) -> tuple[dict[str, str], str | None]:
    """Run ``cases`` (all of one world size) in one torchrun launch, once per test session and ``key``."""
    if key not in _LAUNCHED:
        worlds = {c.world_size for c in cases}
        assert len(worlds) == 1, worlds
        world = worlds.pop()
        for attempt in (1, 2):
            folder = str(tmp_path_factory.mktemp(f"executor-{key}"))
            plans = [c.write(folder) for c in cases]
            outs = {c.name: os.path.join(folder, c.name) for c in cases}
            error = None
            try:
                launch(plans, list(outs.values()), LaunchOptions(nproc_per_node=world,
                                                                 master_port=free_port("127.0.0.1"), steps=steps,
                                                                 timeout_s=120, threads_per_rank=1))
            except JobFailed as e:
                error = str(e)
            if error is None or "killed by signal" not in error or attempt == 2:
                break
            # a rank died of a native crash (gloo on CPU segfaulted once in CI, in a group of layouts that passed
            # when run again): launch once more and say so; its rank log holds faulthandler's Python stacks
            warnings.warn(f"launch {key!r}: {error}; launched again", stacklevel=2)
        _LAUNCHED[key] = (outs, error)
    return _LAUNCHED[key]


def launched_run(key: str, cases: list[Case], case: Case, steps: int, tmp_path_factory) -> dict:
    """``case``'s run.json from :func:`launch_once`; fails the test with the launch's error if it did not run."""
    outs, error = launch_once(key, cases, steps, tmp_path_factory)
    if not os.path.exists(os.path.join(outs[case.name], "run.json")):
        pytest.fail(f"{case.name} did not run: {error}")
    return read_run(outs[case.name])


def assert_losses_match(case: Case, run: dict, ref: list[float] | None = None) -> None:
    ref = ref if ref is not None else reference_losses(case, len(run["losses"]))
    assert len(run["losses"]) == len(ref)
    for k, (got, want) in enumerate(zip(run["losses"], ref, strict=True)):
        assert abs(got - want) <= RTOL * abs(want), (
            f"{case.name}: step {k + 1} loss {got!r} differs from the single-process {want!r} "
            f"(rel {abs(got - want) / abs(want):.2e})")

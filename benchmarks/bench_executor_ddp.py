"""The executor's overhead on pure data parallelism: its step time against a plain DDP script (issue 6:
the ratio should be within 1.05).

Both train the same model (gpt-tiny, sequence 128) on the same global batch over 2 ranks with gloo,
with the same AdamW settings and the same batches: the executor through ``paraplan execute`` (plan:
dp 2, one micro-batch per replica, ZeRO 0), the baseline as the textbook torchrun + DDP loop below
(``--baseline`` mode of this file). Each step is timed on rank 0 from fetching the batch to having
the loss (as the executor's record does); the first steps are warm-up. The two run alternately,
round after round, and each round's ratio of median step times is taken (the two runs of a round are
adjacent in time, so a shared machine's drifts cancel); the median of the rounds' ratios is reported.
Both are compute-bound, so the ratio measures the executor's bookkeeping per step (one scalar
all-reduce for the global loss, a status heartbeat, the progress line: about 1 ms on CPU).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_executor_ddp.py [--steps 15] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODEL, SEQ, GLOBAL_BATCH, DP, WARMUP = "gpt-tiny", 128, 16, 2, 3


def baseline_worker(steps: int, out: str) -> None:
    """A plain DDP training loop (what a user would write by hand), run by torchrun."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from paraplan.executor.batches import BatchSource
    from paraplan.executor.optim import ADAMW
    from paraplan.models import build_model, initialize, load_model_spec, loss_function

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_model_spec(MODEL)
    model = build_model(spec, "cpu")
    initialize(model, spec, 0)
    model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    source = BatchSource(spec=spec, seed=0, global_batch=GLOBAL_BATCH, seq_length=SEQ, dp=world, dp_rank=rank)
    loss_fn = loss_function(spec)
    times, losses = [], []
    for k in range(steps):
        start = time.perf_counter()
        x, y = source.batch(k)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_time_s": times, "losses": losses}, f)
    dist.destroy_process_group()


def write_plan(path: str) -> None:
    from paraplan.models import block_names, load_model_spec
    from paraplan.planner.layout import Layout
    from paraplan.planner.plan import Plan

    spec = load_model_spec(MODEL)
    layout = Layout(dp=DP, tp=1, pp=1, micro_batch=GLOBAL_BATCH // DP, global_batch=GLOBAL_BATCH, dtype="fp32")
    Plan(model=MODEL, cluster="local", layout=layout, stages=[block_names(spec)], seed=0, model_spec=spec.to_dict(),
         seq_length=SEQ, nodes=1).write(path)


def run_executor(plan: str, steps: int, folder: str) -> list[float]:
    subprocess.run([sys.executable, "-m", "paraplan", "execute", "--plan", plan, "--steps", str(steps), "--out",
                    folder], check=True, capture_output=True, text=True)
    with open(os.path.join(folder, "run.json")) as f:
        return json.load(f)["step_time_s"]


def run_baseline(steps: int, out: str) -> list[float]:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(DP),
                    __file__, "--baseline", "--steps", str(steps), "--out", out], check=True, capture_output=True,
                   text=True)
    with open(out) as f:
        return json.load(f)["step_time_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline:
        baseline_worker(args.steps, args.out)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = tempfile.mkdtemp(prefix="paraplan-bench-ddp-")
    plan = os.path.join(folder, "plan.json")
    write_plan(plan)
    executor, baseline = [], []
    for r in range(args.rounds):  # alternate the order too, so drifts in machine load hit both alike
        runs = [(executor, run_executor, (plan, args.steps, os.path.join(folder, f"run{r}"))),
                (baseline, run_baseline, (args.steps, os.path.join(folder, f"ddp{r}.json")))]
        for medians, run, run_args in runs if r % 2 == 0 else runs[::-1]:
            medians.append(statistics.median(run(*run_args)[WARMUP:]))
    ratios = [e / b for e, b in zip(executor, baseline, strict=True)]
    print(f"{MODEL}, seq {SEQ}, global batch {GLOBAL_BATCH}, dp {DP} (gloo, CPU, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}), {args.rounds} rounds x {args.steps - WARMUP} steps")
    print(f"executor (paraplan execute): median step {statistics.median(executor) * 1e3:.1f} ms")
    print(f"plain DDP script:            median step {statistics.median(baseline) * 1e3:.1f} ms")
    print(f"ratio executor / DDP: {statistics.median(ratios):.3f} (median of rounds; "
          f"{min(ratios):.3f} .. {max(ratios):.3f}; target <= 1.05)")


if __name__ == "__main__":
    main()

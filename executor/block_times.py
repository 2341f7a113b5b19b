"""Measure a model's per-block times on this machine and save them where the cost model finds them.

The cost model prices a block from its FLOPs and bytes unless a measurement of exactly that workload
(GPU spec, model, micro-batch, sequence length, dtype) exists (profiler/measurements.py); then it uses
the measured forward and backward times. `validate` and `calibrate` measure the micro-batch sizes their
layouts use the way `paraplan execute` will run them: on a CPU, ``ranks`` processes profile at once,
each with one rank's threads, so the times include what the ranks cost each other (shared caches and
memory bandwidth); the first process's times are saved, with the threads and processes they were taken
with. Never more processes than cores: time-sliced processes would each record whatever slice its fastest
round happened to get (4 ranks on 2 cores timed at about one core each, not half); the cost model
stretches the times to the run's share of the cores instead (planner/cpu_share.py).

Every size is timed in ``ROUNDS`` rounds that go over all the sizes in turn (each round a median of
``REPEATS`` runs), and a block's time is its fastest round: on a shared machine a burst of other work
then slows a round, not the result (seen: a 4-sample micro-batch timed 8x slower than 4 single samples
when all its runs fell in one burst). Others' work only ever adds time, so the fastest round is the
closest to what this machine does; on an idle machine the rounds agree within a few percent.
"""

from __future__ import annotations

import os
import tempfile

from paraplan.hardware_specs.identity import threads_per_rank
from paraplan.models import ModelSpec

ROUNDS = 3
REPEATS = 5  # timed runs per block and round (after warm-up)


def _profile_worker(rank: int, spec_dict: dict, micro_batches: list[int], dtype: str, gpu_name: str, threads: int,
                    device: str, directory: str | None, out: str, procs: int) -> None:
    import torch

    from paraplan.models import spec_from_mapping
    from paraplan.profiler import profile_model
    from paraplan.profiler.measurements import save_measurements

    torch.set_num_threads(threads)
    spec = spec_from_mapping(spec_dict, "measured model")
    paths = []
    rounds: dict[int, list] = {mb: [] for mb in micro_batches}
    for r in range(ROUNDS):
        for mb in micro_batches:
            rounds[mb].append(profile_model(spec, device, micro_batch=mb, dtype=dtype, warmup=3 if r == 0 else 1,
                                            repeats=REPEATS))
    for mb in micro_batches:
        prof = rounds[mb][0]
        for i, layer in enumerate(prof.layers):  # each block's fastest round
            layer.fwd_ms = min(p.layers[i].fwd_ms for p in rounds[mb])
            layer.bwd_ms = min(p.layers[i].bwd_ms for p in rounds[mb])
        if rank == 0:
            from pathlib import Path

            paths.append(str(save_measurements(prof, gpu=gpu_name, directory=Path(directory) if directory else None,
                                               ranks=procs)))
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(paths))


def measure_block_times(spec: ModelSpec, micro_batches: set[int], dtype: str, gpu_name: str, ranks: int,
                        device: str = "cpu") -> list[str]:
    """Profile ``spec`` at each micro-batch size and save the times as GPU spec ``gpu_name``'s."""
    import torch.multiprocessing as mp

    from paraplan.hardware_specs import measurements_dir

    procs = min(max(1, ranks), os.cpu_count() or 1) if device == "cpu" else 1
    threads = threads_per_rank(procs)
    out = tempfile.mktemp(prefix="paraplan-blocks-")
    mp.start_processes(_profile_worker, args=(spec.to_dict(), sorted(micro_batches), dtype, gpu_name, threads, device,
                                              str(measurements_dir()), out, procs), nprocs=procs, start_method="spawn")
    with open(out) as f:
        paths = f.read().split("\n")
    os.unlink(out)
    return paths

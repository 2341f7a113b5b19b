"""One rank's training run around the step (trainer.py): where it starts, what it reads, when it
saves, what it logs.

- Start: step 0, or the checkpoint ``--resume`` names, or, when torchrun has restarted the job after
  a failure (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` > 0), the latest complete checkpoint
  under ``--checkpoint-dir`` (falling back to ``--resume``, then to step 0). Rank 0 decides and
  tells the others, so every rank loads the same one.
- Weights: the checkpoint's, or, starting afresh with ``--init-from``, a Hugging Face LLaMA's
  (hf_weights.py), or the reference initialisation.
- Data: the user's token file (``--data``, token_data.py) from the checkpoint's data position, or
  the bundled corpus (batches.py).
- Saves: ``--checkpoint-dir DIR`` writes ``DIR/step-N/`` after every step N that ``--checkpoint-every``
  divides and after the last step (checkpoint_io.py), with the losses of every step so far, so a run
  that restarts still reports every step.
- Metrics: rank 0 appends one line per step to ``metrics.jsonl`` (metrics.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist

from . import checkpoint_io
from .batches import BatchSource
from .errors import ExecutionError
from .launch import TrainingOptions
from .metrics import MetricsLog
from .rank_model import RankModel
from .token_data import open_tokens
from .trainer import StepResult, Trainer

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def resume_folder(opts: TrainingOptions, rank: int, restarts: int) -> str | None:
    """Collective when checkpoints are in play (every rank has the same options): the checkpoint folder
    this attempt starts from (None: step 0), decided by rank 0."""
    if not opts.resume and not opts.checkpoint_dir:
        return None  # no collective: parameter servers, which never get here, would not join it
    choice = [None]
    if rank == 0:
        found = checkpoint_io.latest(opts.checkpoint_dir, opts.run_id) if restarts and opts.checkpoint_dir else None
        choice[0] = found or (checkpoint_io.resolve(opts.resume) if opts.resume else None)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


@dataclass
class TrainingRun:
    """The run on this rank: ``start_step`` .. ``steps`` - 1 (0-based) still to train."""

    rm: RankModel
    opts: TrainingOptions
    steps: int
    trainer: Trainer
    start_step: int = 0
    prior: list[StepResult] = field(default_factory=list)  # steps before start_step (from the checkpoint)
    resumed_from: str | None = None
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    metrics: MetricsLog | None = None
    _parameters: dict | None = None

    @classmethod
    def start(cls, rm: RankModel, opts: TrainingOptions, steps: int, out: str | None) -> TrainingRun:
        """Collective: resolve the starting point, load it, open the data and the metrics."""
        job = rm.job
        restarts = restart_count()
        folder = resume_folder(opts, rm.rank, restarts)
        state = checkpoint_io.load(rm, folder) if folder else None
        tokens = open_tokens(opts.data, opts.data_dtype, job.spec.vocab_size) if opts.data else None
        _, dp_rank, _ = rm.coords
        source = BatchSource(spec=job.spec, seed=job.plan.seed, global_batch=job.layout.global_batch,
                             seq_length=job.seq_length, dp=job.layout.dp, dp_rank=dp_rank, tokens=tokens,
                             start_step=state.step if state else 0, start_sample=state.samples if state else 0)
        run = cls(rm=rm, opts=opts, steps=steps, trainer=Trainer(rm=rm, source=source), restarts=restarts,
                  resumed_from=folder)
        if state is not None:
            run.start_step = state.step
            run.prior = [StepResult(step=i, loss=loss, time_s=t)
                         for i, (loss, t) in enumerate(zip(state.losses, state.step_time_s, strict=True))]
            run.notes.append(f"resumed from step {state.step} ({folder})"
                             + (f" after restart {restarts}" if restarts else ""))
            now = tokens.describe()["path"] if tokens else None
            was = (state.data or {}).get("path")
            if now != was:
                run.notes.append(f"the checkpoint trained on {was or 'the bundled corpus'}; this run reads "
                                 f"{now or 'the bundled corpus'}")
        elif restarts:
            run.notes.append(f"restart {restarts}: no complete checkpoint yet, training from step 1")
        if state is None and opts.init_from:
            from .hf_weights import load_into

            count = load_into(rm, opts.init_from)
            run.notes.append(f"initial weights from {opts.init_from} ({count} tensors on rank {rm.rank})")
        elif opts.init_from:
            run.notes.append(f"--init-from {opts.init_from} is not read: the checkpoint holds the weights")
        if rm.rank == 0:
            run.metrics = MetricsLog(job, out, rm.device, start_step=run.start_step, restart=restarts)
        return run

    @property
    def resumed_from_step(self) -> int | None:
        return self.start_step if self.resumed_from else None

    def step(self, k: int) -> StepResult:
        """Train step ``k`` (0-based), log it, and save a checkpoint after it when one is due."""
        r = self.trainer.step(k)
        if self.metrics is not None:
            self.metrics.log(k, r.loss, r.time_s)
        return r

    def checkpoint_due(self, k: int) -> bool:
        """After every ``--checkpoint-every``-th step, and after the run's last step."""
        every = self.opts.checkpoint_every
        return bool(self.opts.checkpoint_dir) and ((every and (k + 1) % every == 0) or k + 1 == self.steps)

    def save(self, k: int) -> str:
        """Collective: write the checkpoint of the state after step ``k`` (0-based)."""
        job, results = self.rm.job, self.results()
        if self._parameters is None:
            self._parameters = checkpoint_io.model_parameters(job)
        tokens = self.trainer.source.tokens
        state = checkpoint_io.TrainerState(
            step=k + 1, samples=self.trainer.source.position(k + 1), losses=[r.loss for r in results],
            step_time_s=[r.time_s for r in results], plan=job.plan.to_dict(), model=job.spec.name,
            parameters=self._parameters, data=tokens.describe() if tokens else None, world_size=job.world_size,
            restarts=self.restarts, run_id=self.opts.run_id)
        if len(state.losses) != state.step:
            raise ExecutionError(f"internal: {len(state.losses)} losses recorded for {state.step} steps")
        return checkpoint_io.save(self.rm, self.opts.checkpoint_dir, state)

    def results(self) -> list[StepResult]:
        """Every step of the run so far: the checkpoint's, then this attempt's."""
        return self.prior + self.trainer.results

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

"""What rank 0 shows while training: a progress bar (plain lines when stdout is not a terminal), then
the measured step time and throughput beside the plan's prediction."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .job import Job
from .record import RunSummary


class _Console(Console):
    """rich's Console, except that a closed stdout (``| head``) silences the display instead of ending
    the rank (rich's default exits, which would fail the whole job)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class TrainingDisplay:
    def __init__(self, job: Job, steps: int, enabled: bool, notes: list[str] | None = None, start: int = 0):
        self.job, self.steps, self.enabled, self.notes, self.start = job, steps, enabled, notes or [], start
        self.console = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        self.progress: Progress | None = None
        self.task = None

    def __enter__(self) -> TrainingDisplay:
        if not self.enabled:
            return self
        lay = self.job.layout
        self.console.print(f"executing {self.job.spec.name}: {lay.short()}, global batch {lay.global_batch}, "
                           f"{lay.micro_batches_text} per replica, {self.job.world_size} ranks")
        for note in self.notes:
            self.console.print(f"note: {note}")
        if self.console.is_terminal:
            self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.steps, completed=self.start, info="")
        return self

    def note(self, text: str) -> None:
        """A line between the steps (a checkpoint written)."""
        if self.enabled:
            self.console.print(text)

    def step(self, index: int, loss: float, time_s: float) -> None:
        if not self.enabled:
            return
        info = f"step {index + 1}/{self.steps}  loss {loss:.4f}  {time_s:.3f} s"
        if self.progress is not None:
            self.progress.update(self.task, advance=1, info=info)
        else:
            self.console.print(info)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def summary(self, s: RunSummary) -> None:
        if not self.enabled:
            return
        predicted = s.predicted_iteration_time_s
        table = Table(title=f"{s.job.spec.name} on {s.device} ({s.backend}), "
                            f"{s.job.world_size} ranks", title_justify="left")
        table.add_column("")
        table.add_column("measured", justify="right")
        table.add_column("predicted", justify="right")
        first, last = s.timed_steps
        note = "" if first == last == 1 else " (mean without step 1)" if first == 2 else \
            f" (mean of steps {first}-{last})" if first < last else f" (step {first})"
        table.add_row("step time" + note, f"{s.mean_step_time_s:.4g} s",
                      f"{predicted:.4g} s" if predicted else "-")
        tps = s.job.layout.global_batch * s.job.tokens_per_sample / predicted if predicted else None
        unit = "tokens/s" if s.job.spec.is_transformer else "samples/s"  # a CNN's or MLP's sample is one "token"
        table.add_row("throughput", f"{s.tokens_per_s:,.0f} {unit}", f"{tps:,.0f} {unit}" if tps else "-")
        if predicted:
            table.add_row("measured / predicted", f"{s.mean_step_time_s / predicted:.2f}x", "")
        table.add_row("loss first -> last", f"{s.losses[0]:.4f} -> {s.losses[-1]:.4f}", "")
        known = [m for m in s.peak_memory_gib if m is not None]
        if known:
            table.add_row("peak memory (max rank)", f"{max(known):.2f} GiB",
                          f"{s.job.plan.prediction['peak_memory_gib']:.2f} GiB"
                          if s.job.plan.prediction and "peak_memory_gib" in s.job.plan.prediction else "-")
        self.console.print(table)

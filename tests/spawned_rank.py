"""How a rank started by ``torch.multiprocessing.spawn`` in a test ends once it has passed."""

from __future__ import annotations

from paraplan.executor.worker import exit_now


def exit_passed_rank() -> None:
    """Flush the rank's output and leave with status 0, skipping the interpreter's finalization.

    Why: a rank whose checks all passed was seen to die at exit with SIGABRT ("terminate called without an
    active exception"): once in CI on the torchtitan FSDP2 check, once in 13 repeated runs of it on a 2-core
    machine, never with a failed check before it. At finalization gloo's threads and the FSDP/DTensor objects
    still holding the process groups are torn down in no fixed order; what the test checks is already done.
    Only called after the process group is destroyed; a rank that raises still reports through spawn's error
    file as before. The executor's worker leaves the same way (executor/worker.exit_now).
    """
    exit_now(0)

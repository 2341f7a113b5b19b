"""How a rank classifies its own failure for the launcher, and the fault injection tests use.

A rank that stops with an exception tells its launcher (status.py) whether the exception is its own
(a bug, a bad plan detail: state ``error``) or a consequence of another rank's failure: a collective
or point-to-point op that failed because a peer died (connection closed or reset), hung (timeout) or
was aborted (state ``peer``). The launcher then names the rank that caused it.
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "PARAPLAN_FAULT"  # "KIND:RANK:STEP[:ATTEMPT]", KIND exit|kill|hang|raise (STEP counts from 1)
PEER_MARKERS = ("connection closed", "connection reset", "connection refused", "broken pipe", "timed out",
                "timeout", "peer", "communicator was aborted", "process group has been shut down")


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (pipelining wraps a stage's error in its own)."""
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def is_peer_failure(exc: BaseException) -> bool:
    """Did communication fail (because of another rank) rather than this rank's own code?"""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in PEER_MARKERS)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, shortened to ``limit`` characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def inject_fault(rank: int, step: int) -> None:
    """Tests' fault injection (``PARAPLAN_FAULT``): make rank RANK exit (code 3), die of SIGKILL, hang
    forever or raise at the start of step STEP, in attempt ATTEMPT of the job (torchrun's restart count;
    default 0, so a job restarted by ``--max-restarts`` does not fail again). ``step`` here is 0-based,
    STEP 1-based."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, r, s, *attempt = spec.split(":")
    if int(r) != rank or int(s) != step + 1:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != int(attempt[0] if attempt else 0):
        return
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step + 1}")

"""Per-rank status files: how ranks tell their launcher what they are doing and why they stopped.

Each rank writes ``rank<R>.json`` in the folder the launcher names (``PARAPLAN_STATUS_DIR``):
its state, the step it reached, a timestamp (the heartbeat the launcher's watchdog reads) and, when
it stopped, why. States:

- ``running``: alive, at ``step`` (set at start, then after every phase and step);
- ``done``: finished its work;
- ``error``: raised an exception of its own (the message says what);
- ``peer``: a collective failed because another rank died, hung or failed (a consequence, not a cause);
- ``terminated``: the launcher or torchrun ended it (SIGTERM) while it was still running.

Writes are atomic (write, then rename), so the launcher never reads half a file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

STATUS_DIR_ENV = "PARAPLAN_STATUS_DIR"
FINAL_STATES = ("done", "error", "peer", "terminated")


@dataclass
class RankStatus:
    rank: int
    state: str = "running"
    phase: str = "starting"
    step: int = 0
    time: float = 0.0
    pid: int = 0
    message: str = ""


class StatusWriter:
    """The worker's side: one file, rewritten on every change (a no-op without a status folder)."""

    def __init__(self, rank: int, folder: str | None):
        self.folder = folder
        self.status = RankStatus(rank=rank, pid=os.getpid())
        self.write()

    @classmethod
    def from_env(cls, rank: int) -> StatusWriter:
        return cls(rank, os.environ.get(STATUS_DIR_ENV) or None)

    def update(self, **changes) -> None:
        for k, v in changes.items():
            setattr(self.status, k, v)
        self.write()

    def write(self) -> None:
        if not self.folder:
            return
        self.status.time = time.time()
        path = os.path.join(self.folder, f"rank{self.status.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self.status), f)
        os.replace(tmp, path)


def read_statuses(folder: str) -> dict[int, RankStatus]:
    """Rank -> its last status, for the ranks that wrote one in ``folder``."""
    out: dict[int, RankStatus] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                st = RankStatus(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        out[st.rank] = st
    return out

"""On-disk cache of the schedules' peak matrices (schedules.peak_matrices), beside the profile cache.

A rank's peak matrix depends on the schedule alone (schedule, pp, chunks, micro-batches, whole-chunk gathers), never
on the model; yet walking the orders and keeping the moments no other covers costs the demo's search ~0.2 s of its
~0.8 s on a 2-core machine (68 schedules), each process again. So each one computed is kept as JSON, one small file
per schedule, in a folder named by a digest of schedules.py (a change to the walk starts a new folder), under the
profile cache's folder (``PARAPLAN_CACHE``; ``off`` turns both off). A missing, broken or unwritable entry is
recomputed, never an error; nothing is unpickled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_FORMAT = 1


@functools.cache
def _folder() -> Path | None:
    from paraplan.profiler.cache import cache_folder

    root = cache_folder()
    if root is None:
        return None
    source = Path(__file__).with_name("schedules.py").read_bytes()
    digest = hashlib.sha256(source + str(_FORMAT).encode()).hexdigest()[:16]
    return root / f"schedules-{digest}"


def _path(key: tuple) -> Path | None:
    folder = _folder()
    return None if folder is None else folder / ("-".join(str(int(x) if isinstance(x, bool) else x) for x in key)
                                                 + ".json")


def load(key: tuple, ranks: int) -> list[Any] | None:
    """The ``ranks`` (moments, columns) float matrices stored for ``key``, or None (not stored, or unreadable)."""
    import numpy as np

    path = _path(key)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        out = []
        for shape, flat in data:
            rows, cols = int(shape[0]), int(shape[1])
            if rows * cols != len(flat):
                return None
            out.append(np.array(flat, dtype=float).reshape(rows, cols))
        return out if len(out) == ranks else None
    except (OSError, ValueError, TypeError, IndexError):
        return None


def store(key: tuple, matrices: list[Any]) -> None:
    """Keep ``matrices`` (one per rank, of small integers) for ``key``; atomic (written aside, then renamed)."""
    path = _path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump([[list(m.shape), m.astype(int).ravel().tolist()] for m in matrices], f)
        os.replace(tmp, path)
    except OSError:
        pass

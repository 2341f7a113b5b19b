"""Files written whole or not at all: a report interrupted (Ctrl-C, a full disk) leaves no half-written file.

The text goes to a temporary file beside the target, which replaces the target only once it is complete
(``os.replace`` is atomic on POSIX file systems); on any failure the temporary file is removed and the target,
if it existed, is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str, newline: str | None = None) -> Iterator[IO[str]]:
    """``open(path, "w")`` whose file appears at ``path`` only when the ``with`` block ends without error."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", newline=newline) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

"""Safe reading of the small YAML/JSON files users hand us (model specs, hardware specs, plans).

YAML goes through ``yaml.safe_load``: a tag that would construct Python objects is refused, never
run. Every failure is one line naming the file, raised as the caller's error class.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

MAX_DATA_FILE_BYTES = 16 << 20  # specs and plans are kilobytes; anything this big is the wrong file
# yaml.safe_load's loader, in libyaml's C form where PyYAML was built with it: the same safe constructor (plain data
# only) on a parser about 8 times quicker (a `plan` reads its cluster's files several times)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_data_file(path: str, what: str, error: type[Exception]) -> Any:
    """Parse ``path`` (JSON by extension, else YAML) or raise ``error`` with one clear line."""
    if os.path.isdir(path):
        raise error(f"{path}: is a folder, not a {what} file")
    try:
        size = os.path.getsize(path)
        if size > MAX_DATA_FILE_BYTES:
            raise error(f"{path}: {size} bytes is too large for a {what} file")
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    if b"\x00" in raw:
        raise error(f"{path}: is a binary file, not a {what} (YAML or JSON)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: is not UTF-8 text, not a {what}") from None
    if not text.strip():
        raise error(f"{path}: is empty")
    try:
        if path.endswith(".json"):
            return json.loads(text)
        return yaml.load(text, Loader=SAFE_LOADER)  # noqa: S506 - a safe loader (SafeLoader or its C twin)
    except json.JSONDecodeError as e:
        raise error(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    except yaml.constructor.ConstructorError as e:
        raise error(f"{path}: refused YAML tag ({e.problem}); only plain data is accepted") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{path}: malformed YAML{where}: {problem}") from None

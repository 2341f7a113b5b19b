"""Shared test helpers: run the CLI in-process or as a subprocess, write temp spec files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "paraplan"]

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Hermetic profile cache: shared by this test session (and its subprocesses), empty at its start.
os.environ["PARAPLAN_CACHE"] = tempfile.mkdtemp(prefix="paraplan-test-cache-")
# Hermetic measurements: no calibration or measured block times of the developer's machine leak in.
os.environ["PARAPLAN_MEASUREMENTS"] = tempfile.mkdtemp(prefix="paraplan-test-measurements-")
# No automatic calibration (about a minute) before predicting on `local`: predictions are labelled uncalibrated.
# tests/test_calibration_identity.py covers the automatic calibration with a stand-in for the measuring.
os.environ["PARAPLAN_NO_CALIBRATE"] = "1"


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``paraplan ARGS`` as a user would, in a subprocess; returns the completed process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def run_cli_json(*args: str, timeout: float = 600) -> dict:
    p = run_cli(*args, "--json", timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    """The error contract: non-zero exit, one line on stderr naming what is wrong, no traceback."""
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "Traceback" not in err and "Traceback" not in p.stdout
    assert len(err.splitlines()) == 1, err
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture
def write(tmp_path):
    def _write(name: str, text: str | bytes) -> str:
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return str(path)

    return _write

"""``tiered-kv`` in a real process, as a user runs it: its exit status and its stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "tiered_kv.cli.main"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

# `run` at its smallest: a few seconds.
TINY_RUN = [
    "--no-progress",
    *("--users", "2", "--active-users", "1", "--rounds", "1", "--docs", "1"),
    *("--system-tokens", "64", "--doc-tokens", "64", "--question-tokens", "16"),
    *("--answer-tokens", "4", "--page-size", "16", "--chunk-tokens", "64"),
]


def tiered_kv(*argv: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COMMAND, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def spawn(*argv: str, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        [*COMMAND, *argv],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_refused(done: subprocess.CompletedProcess, *needles: str, usage: bool = False) -> str:
    """Exit status 2, no traceback, and one error line holding every needle (after argparse's
    usage lines where ``usage``; else the only line on stderr). Returns that line."""
    err = done.stderr
    assert done.returncode == 2, (done.returncode, err[-2000:])
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    if usage:
        assert lines[0].startswith("usage: tiered-kv"), err
        lines = [line for line in lines if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]

"""``tiered-kv run``'s progress on stderr: on a terminal (the real command, its stderr a
pseudo-terminal) a bar per mode naming the mode, its place and the turns done; nothing with
``--no-progress``; off a terminal one line per mode as it ends (``RunProgress`` directly, and
the subprocess runs of ``test_cli_observe``)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from tiered_kv.cli import progress
from tiered_kv.cli.progress import RunProgress

RUN = ["run", "--preset", "qwen2.5-7b", "--users", "2", "--active-users", "1", "--docs", "1"]
RUN += ["--rounds", "1", "--scale", "0.05", "--page-size", "16", "--chunk-tokens", "256"]
MODES = ("tiered", "device_only", "recompute", "tiered_planner")
SCRIPT = Path(sys.executable).with_name("tiered-kv")
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "tiered_kv.cli.main"]


def run_on_a_terminal(argv: list[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """The command with its stderr on a pseudo-terminal (stdout a pipe): its exit status, the
    terminal's text, stdout."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the command closed its end
                break
            if not chunk:
                break
            seen += chunk
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        proc.kill()
        os.close(master)
    return proc.returncode, seen.decode(errors="replace"), out.decode()


def test_a_terminal_shows_a_bar_per_mode(tmp_path):
    code, tty, out = run_on_a_terminal([*RUN, "--store-dir", str(tmp_path)])
    assert code == 0, tty
    assert "Traceback" not in tty
    for i, mode in enumerate(MODES, 1):
        bar = f"{mode} [{i}/{len(MODES)}]: 100%"
        assert bar in tty, tty
        final = tty[tty.index(bar) :].splitlines()[0]
        # Turns done, elapsed, the rate (turn/s, or s/turn when a turn takes over a second).
        assert "2/2 [00:" in final and re.search(r"(turn/s|s/turn)\]", final), final
    assert "\r" in tty  # redrawn in place
    assert "tiered-kv run: " not in tty  # the log-style lines are for logs, not terminals
    assert "MODELED times" in out  # the report stays on stdout


def test_no_progress_on_a_terminal_shows_nothing(tmp_path):
    code, tty, out = run_on_a_terminal([*RUN, "--store-dir", str(tmp_path), "--no-progress"])
    assert code == 0, tty
    assert "turn" not in tty and "%|" not in tty and "tiered-kv run: " not in tty, tty
    assert "Traceback" not in tty
    assert "MODELED times" in out


def test_off_a_terminal_one_line_per_mode_as_it_ends():
    stream = io.StringIO()
    p = RunProgress(("tiered", "hisparse"), 4, stream)
    assert not p.bar  # a StringIO is no terminal
    p.start("tiered")
    for done in range(5):
        p.update("tiered", done, 4)
    assert stream.getvalue() == ""  # nothing while the mode serves
    p.mode_done("tiered", {"requests": 4})
    p.start("hisparse")  # a mode that tells no turns: only its end
    p.mode_done("hisparse", {"requests": 4})
    lines = stream.getvalue().splitlines()
    assert [line.split(" done: ")[0] for line in lines] == [
        "tiered-kv run: tiered [1/2]",
        "tiered-kv run: hisparse [2/2]",
    ]
    assert all(" done: 4/4 turns in " in line for line in lines), lines
    p.close()


def test_a_bar_redraws_the_elapsed_time_while_a_turn_runs(monkeypatch):
    stream = io.StringIO()
    p = RunProgress(("tiered",), 3, stream, bar=True)
    clock = [100.0]
    monkeypatch.setattr(progress, "_clock", lambda: clock[0])
    p.start("tiered")
    p.update("tiered", 0, 3)
    drawn = stream.getvalue()
    p.update("tiered", 0, 3)  # no turn done, too soon: not redrawn
    assert stream.getvalue() == drawn
    clock[0] += 1.0
    p.update("tiered", 0, 3)  # no turn done, but time has passed: redrawn
    assert len(stream.getvalue()) > len(drawn)
    p.update("tiered", 2, 3)
    p.mode_done("tiered", {"requests": 3})
    assert "tiered [1/1]: 100%" in stream.getvalue() and "3/3" in stream.getvalue()
    p.close()

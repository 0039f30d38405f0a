"""Issue 38: Ctrl-C pressed twice. A second SIGINT after the first one's line (``tiered-kv:
interrupted``) lands in the interpreter's exit-time clean-up (``weakref.finalize``'s and
``atexit``'s hooks, which close what is still open): it must neither print a
``KeyboardInterrupt`` traceback nor cut that clean-up short (it did about 1 run in 9 with
``tiered-kv run`` and a second Ctrl-C 50 ms later). One during the command's own clean-up, right
after the first (a double tap), is the same Ctrl-C; one later still ends the process at once.

Real processes whose command (``sim``'s, replaced) waits for Ctrl-C, then cleans up for a
while, and that hold an object with a slow exit-time finalizer: each SIGINT is sent once the
process says it is in the phase under test, so it lands there every time."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.cli.cli_process import ENV, ROOT

SCRIPT = """
import sys, time, weakref
from tiered_kv.cli import main, sim_cmd

class Store:
    pass

def close():
    print("closing", flush=True)
    time.sleep(1.0)
    print("closed", flush=True)

STORE = Store()
weakref.finalize(STORE, close)  # runs at exit: STORE is alive then

def serve(args):
    try:
        print("serving", flush=True)
        time.sleep(60)
    finally:
        print("cleaning", flush=True)
        time.sleep(float(sys.argv[1]))
        print("cleaned", flush=True)
    return 0

sim_cmd.main = serve
sys.exit(main.main(["sim", "--no-progress"]))
"""


def _spawn(cleanup_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(cleanup_s)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _next_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline()
    if line != expected + "\n":
        proc.kill()
        raise AssertionError((expected, line, proc.communicate(timeout=30)))


def _interrupted(proc: subprocess.Popen, out: str, err: str) -> None:
    """One line, status 130, no traceback; the exit-time clean-up ran to its end."""
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines() == ["tiered-kv: interrupted"], err
    assert out == "closed\n", out
    assert proc.returncode == 130, (proc.returncode, err)


def test_second_sigint_during_exit_cleanup_is_ignored_and_the_cleanup_completes():
    proc = _spawn(cleanup_s=0)
    try:
        _next_line(proc, "serving")
        proc.send_signal(signal.SIGINT)
        for line in ("cleaning", "cleaned", "closing"):
            _next_line(proc, line)
        proc.send_signal(signal.SIGINT)  # inside weakref.finalize._exitfunc, at exit
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    _interrupted(proc, out, err)


def test_double_tap_during_the_commands_cleanup_is_one_ctrl_c():
    proc = _spawn(cleanup_s=0.3)
    try:
        _next_line(proc, "serving")
        proc.send_signal(signal.SIGINT)
        _next_line(proc, "cleaning")
        proc.send_signal(signal.SIGINT)  # right after the first: the clean-up goes on
        for line in ("cleaned", "closing"):
            _next_line(proc, line)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    _interrupted(proc, out, err)


def test_second_sigint_later_in_a_hung_cleanup_exits_at_once():
    proc = _spawn(cleanup_s=60)
    try:
        _next_line(proc, "serving")
        proc.send_signal(signal.SIGINT)
        _next_line(proc, "cleaning")
        time.sleep(1.2)  # past main.DOUBLE_TAP_S
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 10
    assert err.splitlines() == ["tiered-kv: interrupted again; exiting without cleanup"], err
    assert proc.returncode == 130 and out == "", (proc.returncode, out, err)

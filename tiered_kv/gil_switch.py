"""The interpreter's GIL switch interval, shortened while tiered_kv's Python threads work beside
a model's forward, and given back when they stop.

CPython hands the GIL to a waiting thread when the holder blocks, or after the switch interval
(``sys.getswitchinterval``, 5 ms by default) when it does not. A connector's load or save thread
releases the GIL around every system call and copy; when the engine's main thread is running
Python (a forward's layers, the scheduler), it takes the GIL at each release and keeps it, so
each release costs the background thread up to a whole interval. Measured in vLLM's in-process
CPU engine (issue 40, ``bench_vllm --quick``, 2 cores): a store read cost 6.0 ms per 128 KiB
block at 5 ms against 0.05 ms outside the engine, and 0.64 ms at 0.5 ms.

``shorten(seconds)`` opens a hold: while any hold is open the interval is at most the shortest
one asked for (never lengthened). When the last hold closes, the interval found when the first
one opened is put back, unless something else set the interval in between (then that value is
left alone). Holds are counted per process and are safe to open and close from any thread.
"""

from __future__ import annotations

import sys
import threading

from tiered_kv.errors import InvalidArgumentError

_lock = threading.Lock()
_open: dict[int, int] = {}  # hold id -> the interval it asked for, in microseconds
_state = {"next": 0, "found": None, "ours": None}


class SwitchHold:
    """One open ``shorten``; ``close`` (or leaving its ``with``) ends it, once."""

    def __init__(self, hold_id: int, seconds: float) -> None:
        self.id = hold_id
        self.seconds = seconds

    def close(self) -> None:
        with _lock:
            if _open.pop(self.id, None) is None:
                return
            _apply_locked()

    def __enter__(self) -> SwitchHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shorten(seconds: float) -> SwitchHold:
    """Keep the interpreter's switch interval at most ``seconds`` (> 0) until the hold closes.
    Raises InvalidArgumentError naming the value for anything but a positive finite number."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not (0 < seconds < float("inf"))
    ):
        raise InvalidArgumentError(
            f"switch interval {seconds!r} is invalid: give a positive number of seconds"
        )
    with _lock:
        if not _open:
            _state["found"] = _now_us()
            _state["ours"] = None
        hold = SwitchHold(_state["next"], float(seconds))
        _state["next"] += 1
        _open[hold.id] = max(1, round(seconds * 1e6))
        _apply_locked()
        return hold


def open_holds() -> int:
    """How many holds are open in this process."""
    with _lock:
        return len(_open)


def _now_us() -> int:
    return round(sys.getswitchinterval() * 1e6)


def _set_us(us: int) -> None:
    # The interpreter keeps whole microseconds, truncated: set the middle of the one wanted, so a
    # value read back and set again never drifts down by one.
    sys.setswitchinterval((us + 0.5) / 1e6)


def _apply_locked() -> None:
    now = _now_us()
    ours = _state["ours"]
    if ours is not None and now != ours:
        # Someone else set the interval while we held it: theirs stands, and is what we give
        # back to (a later hold may still shorten it).
        _state["found"] = now
    found = _state["found"]
    if found is None:
        return
    want = min([found, *_open.values()]) if _open else found
    if want != now:
        _set_us(want)
    _state["ours"] = _now_us() if _open else None
    if not _open:
        _state["found"] = None

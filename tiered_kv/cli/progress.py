"""What ``tiered-kv run`` shows on stderr while it serves (``--no-progress``: nothing).

On a terminal, a tqdm bar per mode: the mode, its place among the run's modes, the workload's
turns finished out of ``users * rounds``, elapsed and the rate; the bar stays as the mode's
line when it ends. Elsewhere (a log file, CI, a pipe) no bar, whose carriage returns would
fill the log: one line per mode as it ends, with its turns and seconds.

The engine only calls hooks (``serve_workload``'s ``on_progress``, ``run_scale``'s
``on_cache`` and ``on_mode_done``); everything printed is printed here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

# A turn can take seconds (a long prefill in chunks): the elapsed time is redrawn this often
# between turns, from the serving loop's per-step calls, never more.
_REDRAW_S = 0.5
_clock = time.perf_counter  # (a test's fake clock replaces it)


def _screen(stream: TextIO) -> dict:
    """tqdm's size arguments: the terminal's, followed as it resizes; 80 x 24 where the
    terminal says it has no size (tqdm draws nothing then: a pseudo-terminal nobody sized)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    return {"dynamic_ncols": True} if size.columns and size.lines else {"ncols": 80, "nrows": 24}


def add_progress_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="print no progress on stderr (without it: a bar per mode on a terminal, else a "
        "line per mode as it ends)",
    )


class RunProgress:
    """The progress of a run of ``modes`` (in order), ``turns`` turns each, written to
    ``stream`` (stderr); ``bar`` None: a bar when ``stream`` is a terminal."""

    def __init__(
        self,
        modes: tuple[str, ...],
        turns: int,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.modes, self.turns = modes, turns
        self.stream = sys.stderr if stream is None else stream
        self.bar = self.stream.isatty() if bar is None else bar
        self._t0 = _clock()
        self._mode: str | None = None
        self._started = 0.0
        self._done = 0
        self._tqdm: tqdm | None = None
        self._drawn = 0.0

    def start(self, mode: str, _cache: object = None) -> None:
        """A mode's cache is built and about to serve (``run_scale``'s ``on_cache``)."""
        self._end_bar()
        self._mode, self._started, self._done = mode, _clock(), 0
        if self.bar:
            self._tqdm = tqdm(
                total=self.turns,
                desc=f"{mode} [{self._place(mode)}]",
                unit="turn",
                file=self.stream,
                leave=True,
                **_screen(self.stream),
            )
            self._drawn = _clock()

    def update(self, mode: str, done: int, total: int) -> None:
        """Turns ``done`` out of ``total`` (``serve_workload``'s ``on_progress``, every step)."""
        if mode != self._mode:
            self.start(mode)
        self._done = done
        bar = self._tqdm
        if bar is None:
            return
        if total != bar.total:
            bar.total = total
        now = _clock()
        if done != bar.n:
            bar.update(done - bar.n)  # tqdm redraws at most every mininterval (0.1 s)
        elif now - self._drawn >= _REDRAW_S:
            bar.refresh()  # the elapsed time moves on while a turn is still running
        else:
            return
        self._drawn = now

    def mode_done(self, mode: str, report: dict) -> None:
        """A mode ended with ``report`` (``run_scale``'s ``on_mode_done``)."""
        if mode != self._mode:  # its cache was never shown to ``start``
            self.start(mode)
        self._done = report.get("requests", self._done)
        if self._tqdm is not None:
            self._tqdm.update(self._done - self._tqdm.n)
            self._end_bar()
        else:
            took = _clock() - self._started
            run = _clock() - self._t0
            self.stream.write(
                f"tiered-kv run: {mode} [{self._place(mode)}] done: {self._done}/{self.turns} "
                f"turns in {took:.1f} s (run {run:.1f} s)\n"
            )
            self.stream.flush()
        self._mode = None

    def close(self) -> None:
        """Take down a bar left open (a run that raised). Safe twice."""
        self._end_bar()

    def _end_bar(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def _place(self, mode: str) -> str:
        n = len(self.modes)
        return f"{self.modes.index(mode) + 1}/{n}" if mode in self.modes else f"?/{n}"

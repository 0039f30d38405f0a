"""LogLimiter: a record per kind of event at most once per interval, so a store that fails every
call (or a disk that makes every copy slow) leaves a few lines in the log, not one per call.

The first event of a kind is logged at once; later ones of that kind within ``interval_s`` are
counted, and the next one logged after the interval says how many were left out. The library
never configures handlers: the package's top logger has a ``NullHandler`` only (``__init__``),
and an application (``tiered-kv``'s ``--log-level``) chooses where records go.
"""

from __future__ import annotations

import logging
import threading
import time


class LogLimiter:
    """Thread-safe (storage threads and the serving thread may report the same kind)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> when it was last logged
        self._left_out: dict[str, int] = {}  # kind -> events not logged since

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless ``kind`` was logged less than ``interval_s``
        ago (then it is only counted). Returns whether a record was emitted."""
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._left_out[kind] = self._left_out.get(kind, 0) + 1
                return False
            self._last[kind] = now
            left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg = f"{msg} (%d more like it in the last %.0f s not logged)"
            args = (*args, left_out, now - last)
        self.logger.log(level, msg, *args)
        return True

    def reset(self) -> None:
        """Forget every kind (the next event of each is logged)."""
        with self._lock:
            self._last.clear()
            self._left_out.clear()

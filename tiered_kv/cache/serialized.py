"""``serialized``: the facade's methods one call at a time per cache.

Threads sharing a cache take turns on its ``_lock`` (an RLock, so a method may call another),
so its tree, pools and counters never see two calls interleave. Layer waits follow the request
begun last: a thread whose forward reads a loaded prefix calls ``prepare_forward`` first.
"""

from __future__ import annotations

import functools


def serialized(method):
    """``method`` run under ``self._lock``."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return call

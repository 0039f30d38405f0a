"""The schedulers' liveness rule, in one place.

When nothing runs, the head of the waiting queue is admitted, or refused at ``add`` with a
typed error saying why it can never fit (a request that could not run alone in an empty device
pool never enters the queue). Between the two there is only one legitimate reason to admit
nothing: copies in flight hold the pages it needs (a write to host locks its nodes until it
lands), and then the step waits for them (``wait_for_copies``) and tries again. A step that still
admits nothing while nothing runs is a **stall**, a bug in the budget or a leaked slot, never a
state to spin in: ``stalled`` raises ``LivenessError`` with the numbers in a scheduler's debug
mode (``SchedulerConfig.debug``), and otherwise counts it (``SchedulerStats.stalls``) and logs it
(rate-limited), so a serving loop and its metrics see it at once.
"""

from __future__ import annotations

import logging

from tiered_kv.errors import LivenessError
from tiered_kv.log_limit import LogLimiter

IDLE_WAIT_S = 10.0  # at most this long per idle step for copies in flight

log = logging.getLogger(__name__)
_limited = LogLimiter(log)


def wait_for_copies(cache, stats) -> bool:
    """An idle step of a scheduler whose next request does not fit: if copies in flight hold
    pages, wait for them (at most ``IDLE_WAIT_S``, counted in ``stats.idle_waits``) and
    acknowledge what finished. Returns whether there was anything to wait for."""
    if not cache.manager.pending_ops():
        return False
    stats.idle_waits += 1
    cache.manager.wait_all(IDLE_WAIT_S)
    cache.poll()
    return True


def stalled(cache, stats, debug: bool, detail: str) -> None:
    """Nothing runs, nothing was admitted and no copy was left to wait for: raise
    ``LivenessError`` (``debug``) or count the stall and log it. ``detail``: what the head of
    the queue needed and what was reachable."""
    stats.stalls += 1
    pending = cache.manager.pending_ops()
    msg = (
        f"scheduler stall: nothing runs and the head of the queue was not admitted "
        f"({detail}; {pending} copies in flight after waiting {IDLE_WAIT_S} s); a request that "
        "fits an empty pool must be admitted"
    )
    if debug:
        raise LivenessError(msg)
    _limited.log(logging.ERROR, "stall", "%s", msg)

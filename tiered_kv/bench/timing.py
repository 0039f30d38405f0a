"""Timed runs and their statistics.

A timed run reads ``time.perf_counter`` around one call only, with the garbage collector off
during it (as ``timeit`` does: a collection of garbage left by earlier work is not billed to the
call) and a device sync on each side (CUDA work is asynchronous; without the sync the clock stops
at the launch). ``interleave`` runs a candidate and its baseline round-robin in the same run, so
a machine that changes speed during a benchmark slows both, and the ratio survives it.

Percentiles are nearest-rank (the ``ceil(q * n)``-th smallest value): every reported figure is
one that was measured.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from tiered_kv.errors import InvalidArgumentError

Sync = Callable[[], None]
T = TypeVar("T")


def no_sync() -> None:
    """The sync of a device whose work is done when the call returns (CPU)."""


def device_sync(device: Any) -> Sync:
    """A function that waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA,
    nothing elsewhere."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return no_sync


def timed_call(
    fn: Callable[[], T], sync: Sync = no_sync, *, collect: bool = False
) -> tuple[float, T]:
    """``(seconds, result)`` of one call of ``fn``: sync, clock, call, sync, clock, with the
    garbage collector off during the call (and, with ``collect``, a collection right before it).
    The collector is restored to its previous state even if ``fn`` raises."""
    if collect:
        gc.collect()
    sync()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        out = fn()
        sync()
        elapsed = time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()
    return elapsed, out


def timed(fn: Callable[[], object], sync: Sync = no_sync, *, collect: bool = False) -> float:
    """Seconds of one call of ``fn`` (see ``timed_call``)."""
    return timed_call(fn, sync, collect=collect)[0]


def interleave(
    arms: Mapping[str, Callable[[Any], T]],
    repeats: int,
    *,
    setup: Callable[[int], Any] | None = None,
    warmup: int = 0,
    min_repeats: int | None = None,
    budget_s: float = math.inf,
    budget_arms: Collection[str] | None = None,
    after_round: Callable[[int], None] | None = None,
    rotate: bool = False,
) -> dict[str, list[T]]:
    """Round-robin measurement: each round calls every arm once, in the mapping's order.

    A round starts with ``setup(round)`` (untimed; rounds of the warm-up are negative) and hands
    its value to every arm of the round, so a candidate and its baseline see the same draw. An
    arm returns what it measured (seconds, or a dict of them). The first ``warmup`` rounds run
    and are dropped (first copies after an allocation run slow, the baseline's too). After at
    least ``min_repeats`` (default: ``repeats``) kept rounds, stops once the float results of
    ``budget_arms`` (default: every arm) sum to ``budget_s`` or more. Returns each arm's kept
    results, in round order; every list has the same length. ``after_round(round)`` (e.g. a
    progress line) runs after each round. With ``rotate`` round ``i`` starts at arm ``i mod
    len(arms)``, so no arm always runs first (after the same warm or cold caches).
    """
    if repeats < 1 or warmup < 0:
        raise InvalidArgumentError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    floor = repeats if min_repeats is None else max(1, min(min_repeats, repeats))
    counted = set(arms) if budget_arms is None else set(budget_arms)
    out: dict[str, list[T]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(-warmup, repeats):
        arg = setup(i) if setup is not None else None
        start = i % len(names) if rotate and names else 0
        for name in names[start:] + names[:start]:
            result = arms[name](arg)
            if i >= 0:
                out[name].append(result)
        if after_round is not None:
            after_round(i)
        if i + 1 >= floor and budget_s < math.inf:
            spent = sum(v for name in counted for v in out[name] if isinstance(v, (int, float)))
            if spent >= budget_s:
                break
    return out


# -- statistics ---------------------------------------------------------------------------------
def _checked(values: Sequence[float], what: str) -> list[float]:
    if len(values) == 0:
        raise InvalidArgumentError(f"{what} of no values: measure at least one repeat")
    return sorted(values)


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    return statistics.median(_checked(values, "median"))


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``ceil(q * n)``-th smallest value, for ``q`` in (0, 1]."""
    if not 0 < q <= 1:
        raise InvalidArgumentError(f"q={q} must be in (0, 1] (0.9 for the 90th percentile)")
    ordered = _checked(values, "percentile")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spread(values: Sequence[float]) -> float:
    """max / min: 1.0 for identical samples; inf if the smallest is 0."""
    ordered = _checked(values, "spread")
    return ordered[-1] / ordered[0] if ordered[0] > 0 else math.inf


def iqr_ratio(values: Sequence[float]) -> float:
    """(p75 - p25) / median, nearest-rank quartiles: the spread of the middle half."""
    mid = median(values)
    iqr = nearest_rank(values, 0.75) - nearest_rank(values, 0.25)
    return iqr / mid if mid > 0 else math.inf


def gbps(nbytes: int, seconds: float) -> float:
    """1e9 bytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf

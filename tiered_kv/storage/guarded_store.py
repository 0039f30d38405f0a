"""GuardedStorage: a store that keeps failing is reopened, then turned off, never a stall.

Any store absorbs its own trouble into counted misses, but a store whose every call fails (a
corrupted map, a removed directory, a dead remote server) would go on costing the serving path
a failing call per batch for ever. The guard wraps a store and an opener:

- a call *fails* when it raises (anything but a bad argument, which is the caller's bug and
  propagates as the typed error it is) or when it served nothing and the store counted an
  error during it; any other call is a success and resets the count;
- after ``fail_limit`` failing calls in a row the guard logs an error and reopens the store
  (closes it and calls the opener again; a removed directory is recreated, a dropped
  connection redialled);
- if the reopen fails, or the reopened store fails ``fail_limit`` times in a row before it
  succeeds once, the store is turned *off*: every call is a miss without touching it, logged
  once. After ``retry_s`` seconds the next call reopens it as a probe; each probe that fails
  doubles the wait, up to ``max_retry_s``.

A reopen never closes a store under a call in flight: calls hold a shared gate, a reopen takes it
exclusively, and a reopen that cannot have the gate within ``drain_s`` (a call stuck in a hung
store) turns the store off without closing it. The guard's own events are in ``stats()``:
``reopens``, ``turned_off``, ``skipped_while_off``, and ``off`` (whether it is off now). Opening
and closing are logged at INFO, a call that raised at WARNING (once per kind a minute).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.log_limit import LogLimiter
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats

log = logging.getLogger(__name__)


class GuardedStorage(PageStorage):
    """``open_store()`` opens the store (it is called once here: a store that cannot be opened
    at all raises its ``StorageOpenError`` to the constructor's caller, as the store itself
    would), and again for every reopen."""

    def __init__(
        self,
        open_store: Callable[[], PageStorage],
        *,
        fail_limit: int = 8,
        retry_s: float = 30.0,
        max_retry_s: float = 600.0,
        drain_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(fail_limit, bool) or not isinstance(fail_limit, int) or fail_limit < 1:
            raise InvalidArgumentError(f"fail_limit={fail_limit!r} must be an int >= 1")
        for name, value in (
            ("retry_s", retry_s),
            ("max_retry_s", max_retry_s),
            ("drain_s", drain_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(f"{name}={value!r} must be a number > 0")
        if max_retry_s < retry_s:
            raise InvalidArgumentError(f"max_retry_s={max_retry_s} must be >= retry_s={retry_s}")
        store = open_store()
        if not isinstance(store, PageStorage):
            raise InvalidArgumentError(f"open_store() returned {store!r}, not a PageStorage")
        super().__init__(store.namespace, store.page_nbytes)
        self._open_store = open_store
        self._inner: PageStorage | None = store
        self.fail_limit = fail_limit
        self.retry_s, self.max_retry_s, self.drain_s = float(retry_s), float(max_retry_s), drain_s
        self._clock = clock
        self._gate = threading.Condition()
        self._in_flight = 0
        self._exclusive = False
        self._failures = 0  # failing calls in a row
        self._since_reopen = False  # reopened, and not one success since
        self._off_until: float | None = None
        self._retry = self.retry_s
        self._last: StorageStats = store.stats()
        self._events = dict(reopens=0, turned_off=0, skipped_while_off=0)
        self._carried = StorageStats()  # the counters of the stores reopened so far
        self._own_errors: dict[str, int] = {}  # errors the guard saw (calls that raised)
        self._closed = False
        self._raised = LogLimiter(log)
        log.info("storage opened: %s", _describe(store, self._last))

    @property
    def inner(self) -> PageStorage | None:
        """The store the guard calls now (None while off after a failed reopen)."""
        return self._inner

    @property
    def off(self) -> bool:
        return self._off_until is not None

    # -- the gate ----------------------------------------------------------------------------
    def _enter(self) -> PageStorage | None:
        """The store to call, holding the shared gate; or None, holding nothing: the store is
        off and no probe is due, or the probe's reopen failed. The caller whose call finds a
        probe due reopens the store (it claims the probe: others keep missing meanwhile)."""
        with self._gate:
            while self._exclusive:
                self._gate.wait()
            if self._off_until is None:
                self._in_flight += 1
                return self._inner
            if self._closed or self._clock() < self._off_until:
                self._events["skipped_while_off"] += 1
                return None
            self._off_until = self._clock() + self._retry
        if not self._reopen("probe after being off"):
            with self._gate:
                self._events["skipped_while_off"] += 1
            return None
        with self._gate:
            while self._exclusive:
                self._gate.wait()
            if self._inner is None:
                self._events["skipped_while_off"] += 1
                return None
            self._in_flight += 1
            return self._inner

    def _leave(self) -> None:
        with self._gate:
            self._in_flight -= 1
            self._gate.notify_all()

    def _reopen(self, why: str) -> bool:
        """Close the store and open it again, exclusively. True when a store is open after."""
        deadline = time.monotonic() + self.drain_s
        with self._gate:
            while self._exclusive or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._turn_off(f"{why}: a call is still inside the store after {self.drain_s}s")
                    return False
                self._gate.wait(left)
            self._exclusive = True
            old, self._inner = self._inner, None
        try:
            if old is not None:
                self._carry(old)
                try:
                    old.close()
                except Exception:  # noqa: BLE001 - a store failing this way may fail to close
                    log.exception("closing a failing store")
            try:
                store = self._open_store()
            except Exception as exc:  # noqa: BLE001 - a store that cannot reopen is turned off
                with self._gate:
                    self._turn_off(f"{why}: reopening failed: {type(exc).__name__}: {exc}")
                return False
            with self._gate:
                self._inner = store
                self._events["reopens"] += 1
                self._failures = 0
                self._since_reopen = True
                log.warning("storage reopened (%s)", why)
            return True
        finally:
            with self._gate:
                self._exclusive = False
                self._gate.notify_all()

    def _carry(self, old: PageStorage) -> None:
        """Keep the counters of a store being closed, so the totals never go backwards."""
        try:
            part = old.stats()
        except Exception:  # noqa: BLE001 - a store failing this way: its last known stats
            part = self._last
        with self._gate:
            self._carried = _added(self._carried, part)
            self._last = StorageStats(budget_bytes=part.budget_bytes)

    def _turn_off(self, why: str) -> None:
        """Hold ``self._gate``. Calls are misses until the next probe."""
        if self._off_until is None:
            self._events["turned_off"] += 1
            log.error(
                "storage turned off, every lookup is a miss (retrying in %.0fs): %s",
                self._retry,
                why,
            )
        else:
            self._retry = min(self.max_retry_s, self._retry * 2)
        self._off_until = self._clock() + self._retry

    def _outcome(self, failed: bool, why: str) -> None:
        with self._gate:
            if not failed:
                self._failures, self._since_reopen = 0, False
                if self._off_until is not None and self._inner is not None:
                    self._off_until, self._retry = None, self.retry_s
                    log.warning("storage is serving again")
                return
            if self._off_until is not None:  # the probe's call failed: wait longer
                self._turn_off(f"the probe failed ({why})")
                return
            self._failures += 1
            if self._failures < self.fail_limit:
                return
            self._failures = 0
            if self._since_reopen:
                self._turn_off(f"{self.fail_limit} failing calls in a row after a reopen ({why})")
                return
        log.error("storage failed %d calls in a row (%s); reopening it", self.fail_limit, why)
        self._reopen(why)

    def _call(self, name: str, miss, served: Callable[[object], bool], *args):
        store = self._enter()
        if store is None:
            return miss
        try:
            errors = store.error_count()
            try:
                result = getattr(store, name)(*args)
            except InvalidArgumentError:
                raise
            except Exception as exc:  # noqa: BLE001 - store trouble is a miss, never an error
                kind = f"guard: {name} raised {type(exc).__name__}"
                self._count_own(kind)
                failed, why, result = True, f"{name} raised {type(exc).__name__}: {exc}", miss
                self._raised.log(logging.WARNING, kind, "storage call failed: %s", why)
            else:
                failed = not served(result) and store.error_count() > errors
                why = f"{name} served nothing and counted an error"
        finally:
            self._leave()
        self._outcome(failed, why)
        return result

    def _count_own(self, what: str) -> None:
        with self._gate:
            self._own_errors[what] = self._own_errors.get(what, 0) + 1

    # -- the contract ------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        keys = self._check_keys(keys)
        return self._call("batch_exists", 0, lambda n: n > 0 or not keys, keys)

    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        return self._call("batch_get", [False] * len(keys), _any_or_empty, keys, source, pages)

    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        return self._call("batch_set", [False] * len(keys), _any_or_empty, keys, source, pages)

    def delete(self, keys: Sequence[bytes]) -> int:
        keys = self._check_keys(keys)
        return self._call("delete", 0, lambda n: True, keys)

    def clear(self) -> None:
        self._call("clear", None, lambda r: True)

    def flush(self) -> None:
        store = self._inner
        if store is not None and hasattr(store, "flush"):
            self._call("flush", None, lambda r: True)

    def error_count(self) -> int:
        with self._gate:
            own = sum(self._own_errors.values()) + sum(self._carried.errors.values())
        store = self._inner
        return own + (store.error_count() if store is not None else 0)

    def stats(self) -> StorageStats:
        """The store's stats (also while off: stats are not the serving path; its last known ones
        when it has none), plus those of the stores it replaced, the errors the guard saw and its
        events."""
        with self._gate:  # never a probe, never counted as a skipped call; off or not
            while self._exclusive:
                self._gate.wait()
            store = self._inner
            self._in_flight += store is not None
        if store is not None:
            try:
                fresh = store.stats()
            except Exception:  # noqa: BLE001 - stats of a failing store: the last known ones
                fresh = None
            finally:
                self._leave()
            if fresh is not None:
                with self._gate:
                    self._last = fresh
        with self._gate:
            out = _added(self._carried, self._last)
            for what, n in self._own_errors.items():
                out.errors[what] = out.errors.get(what, 0) + n
            for what, n in self._events.items():
                setattr(out, what, n)
            out.off = self._off_until is not None
            return out

    def close(self) -> None:
        """Close the store (waiting for calls in flight up to ``drain_s``). Safe twice."""
        deadline = time.monotonic() + self.drain_s
        with self._gate:
            self._closed = True
            while self._in_flight and time.monotonic() < deadline:
                self._gate.wait(max(0.0, deadline - time.monotonic()))
            store, self._inner = self._inner, None
            self._off_until = self._off_until or float("inf")
        if store is not None:
            try:
                what = _describe(store, store.stats())
            except Exception:  # noqa: BLE001 - a failing store may not report its counters
                what = type(store).__name__
            store.close()
            log.info("storage closed: %s", what)


def _describe(store: PageStorage, stats: StorageStats) -> str:
    return (
        f"{type(store).__name__}, namespace {store.namespace.fingerprint.hex()[:12]}, "
        f"{stats.pages} pages, {stats.bytes} of {stats.budget_bytes} bytes"
    )


def _any_or_empty(result) -> bool:
    return not result or any(result)


_GAUGES = ("pages", "bytes", "budget_bytes")


def _added(total: StorageStats, part: StorageStats) -> StorageStats:
    """``total``'s counters plus ``part``'s, with ``part``'s gauges (its size now)."""
    out = total.snapshot()
    for name, value in part.__dict__.items():
        if name == "errors":
            for what, n in value.items():
                out.errors[what] = out.errors.get(what, 0) + n
        elif name in _GAUGES:
            setattr(out, name, value)
        elif isinstance(value, int) and not isinstance(value, bool):
            setattr(out, name, getattr(out, name) + value)
    return out

"""GuardedStorage: a store that keeps failing is reopened, then turned off (every call a miss
that never touches it), probed again after a back-off, and serves again once it works; bad
arguments still raise; a reopen never closes a store under a call in flight."""

from __future__ import annotations

import logging
import shutil
import threading

import lmdb
import pytest
import torch

from tests.storage._util import ByteSource
from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage import LMDBStorage, MemoryStorage, StorageNamespace, page_keys
from tiered_kv.storage.guarded_store import GuardedStorage

NS = StorageNamespace.create(
    model="test-model",
    kind="mha",
    parts=[("k", (2, 8))],
    dtype="float32",
    layer_ids=[0],
    page_size=4,
    layout="page_first",
)
P = 96


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Switchable(MemoryStorage):
    """A memory store whose calls raise, or count an error and miss, while ``mode`` says so;
    every call is counted in ``calls``."""

    mode = "ok"  # class-wide: a reopened store (a new instance) sees the same trouble

    def __init__(self, log: list) -> None:
        super().__init__(NS, P)
        self.log = log

    def _trouble(self, name: str) -> bool:
        self.log.append(name)
        if Switchable.mode == "raise":
            raise OSError(f"injected: {name}")
        if Switchable.mode == "absorb":
            self._stats.count_error(f"{name}: injected")
            return True
        return False

    def batch_exists(self, keys):
        return 0 if self._trouble("batch_exists") else super().batch_exists(keys)

    def batch_get(self, keys, source, pages):
        if self._trouble("batch_get"):
            return [False] * len(keys)
        return super().batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        if self._trouble("batch_set"):
            return [False] * len(keys)
        return super().batch_set(keys, source, pages)


@pytest.fixture
def guarded(gen):
    Switchable.mode = "ok"
    calls, opened = [], []
    clock = Clock()

    def open_store():
        opened.append(Switchable(calls))
        return opened[-1]

    g = GuardedStorage(open_store, fail_limit=3, retry_s=10.0, max_retry_s=40.0, clock=clock)
    src = ByteSource(P, 6)
    src.buf.copy_(torch.randint(1, 255, src.buf.shape, generator=gen, dtype=torch.uint8))
    keys = page_keys(NS, list(range(6 * 4)), 4)
    yield g, src, keys, calls, opened, clock
    Switchable.mode = "ok"


@pytest.mark.parametrize("mode", ["raise", "absorb"])
def test_a_store_that_keeps_failing_is_reopened_then_turned_off(guarded, caplog, mode):
    g, src, keys, calls, opened, clock = guarded
    assert g.batch_set(keys, src, range(6)) == [True] * 6
    Switchable.mode = mode
    with caplog.at_level(logging.WARNING, logger="tiered_kv.storage.guarded_store"):
        for _ in range(3):
            assert g.batch_exists(keys) == 0
        assert len(opened) == 2 and g.stats().reopens == 1 and not g.off
        for _ in range(3):
            assert g.batch_get(keys, ByteSource(P, 6), range(6)) == [False] * 6
        assert g.off and g.stats().turned_off == 1
    assert "reopening" in caplog.text and "turned off" in caplog.text
    # Off: every call is a miss that never reaches the store.
    before = len(calls)
    for _ in range(20):
        assert g.batch_exists(keys) == 0
        assert g.batch_set(keys, src, range(6)) == [False] * 6
    assert len(calls) == before and g.stats().skipped_while_off == 40
    # A probe after the back-off reopens; it fails, so the wait doubles (10 -> 20 -> 40 -> 40).
    for wait in (10.0, 20.0, 40.0, 40.0):
        clock.now += wait - 0.5
        g.batch_exists(keys)
        assert len(calls) == before, "probed before its back-off ended"
        clock.now += 0.5
        g.batch_exists(keys)
        assert len(calls) == before + 1 and g.off
        before += 1
    # The store recovers: the next probe serves and the guard is on again.
    Switchable.mode = "ok"
    clock.now += 40.0
    assert g.batch_set(keys, src, range(6)) == [True] * 6
    assert not g.off and g.stats().off is False
    dst = ByteSource(P, 6)
    assert g.batch_get(keys, dst, range(6)) == [True] * 6
    assert torch.equal(dst.buf, src.buf)


def test_successes_between_failures_keep_the_store(guarded):
    g, src, keys, calls, opened, clock = guarded
    g.batch_set(keys, src, range(6))
    for _ in range(10):
        Switchable.mode = "raise"
        g.batch_exists(keys)
        g.batch_exists(keys)
        Switchable.mode = "ok"
        assert g.batch_exists(keys) == 6
    assert len(opened) == 1 and not g.off


def test_partial_service_is_a_success(guarded):
    g, src, keys, calls, opened, clock = guarded
    g.batch_set(keys[:2], src, range(2))
    for _ in range(10):  # half the pages missing is a miss of the prefix, not trouble
        assert g.batch_get(keys, ByteSource(P, 6), range(6)) == [True] * 2 + [False] * 4
        assert g.batch_exists(keys[3:]) == 0
    assert len(opened) == 1


def test_bad_arguments_raise_and_are_not_failures(guarded):
    g, src, keys, calls, opened, clock = guarded
    for _ in range(5):
        with pytest.raises(InvalidArgumentError):
            g.batch_get(keys, src, [0, 1])
        with pytest.raises(InvalidArgumentError):
            g.batch_exists([b"short"])
    assert len(opened) == 1 and calls == []


def test_a_failed_reopen_turns_the_store_off(tmp_path, gen):
    path = tmp_path / "s"
    opener_calls = []

    def open_store():
        opener_calls.append(1)
        if len(opener_calls) > 1:
            raise StorageOpenError(f"cannot open {path}")
        return MemoryStorage(NS, P)

    g = GuardedStorage(open_store, fail_limit=2, clock=Clock())
    g.inner.batch_exists = lambda keys: (_ for _ in ()).throw(OSError("dead"))
    keys = page_keys(NS, list(range(8)), 4)
    for _ in range(2):
        assert g.batch_exists(keys) == 0
    assert g.off and g.inner is None and len(opener_calls) == 2
    assert g.stats().turned_off == 1 and g.batch_exists(keys) == 0
    g.close()
    g.close()


@pytest.mark.parametrize("invalid", [0, -1, True, 1.5])
def test_fail_limit_checked(invalid):
    with pytest.raises(InvalidArgumentError, match="fail_limit"):
        GuardedStorage(lambda: MemoryStorage(NS, P), fail_limit=invalid)


def test_checked_arguments():
    with pytest.raises(InvalidArgumentError, match="retry_s"):
        GuardedStorage(lambda: MemoryStorage(NS, P), retry_s=0)
    with pytest.raises(InvalidArgumentError, match="max_retry_s"):
        GuardedStorage(lambda: MemoryStorage(NS, P), retry_s=10, max_retry_s=5)
    with pytest.raises(InvalidArgumentError, match="PageStorage"):
        GuardedStorage(lambda: object())


def test_reopen_waits_for_the_call_in_flight(gen):
    """A call inside the store holds it open: the reopen another thread asks for waits for it
    (and, past ``drain_s``, turns the store off without closing it under the call)."""
    inside, release = threading.Event(), threading.Event()
    closed = []

    class Slow(MemoryStorage):
        def batch_get(self, keys, source, pages):
            inside.set()
            release.wait(10)
            return super().batch_get(keys, source, pages)

        def batch_exists(self, keys):
            raise OSError("failing")

        def close(self):
            closed.append(self)

    g = GuardedStorage(lambda: Slow(NS, P), fail_limit=2, drain_s=0.3, clock=Clock())
    keys = page_keys(NS, list(range(8)), 4)
    reader = threading.Thread(target=g.batch_get, args=(keys, ByteSource(P, 2), [0, 1]))
    reader.start()
    assert inside.wait(10)
    g.batch_exists(keys)
    g.batch_exists(keys)  # the second failure asks for a reopen: the reader is still inside
    assert g.off and closed == [], "closed a store under a call in flight"
    release.set()
    reader.join(10)
    assert g.batch_exists(keys) == 0 and closed == []


def test_lmdb_store_on_a_removed_directory_is_reopened_and_serves(tmp_path, gen):
    path = tmp_path / "s"
    src = ByteSource(P, 6)
    src.buf.copy_(torch.randint(1, 255, src.buf.shape, generator=gen, dtype=torch.uint8))
    keys = page_keys(NS, list(range(6 * 4)), 4)
    g = GuardedStorage(lambda: LMDBStorage(path, NS, P, budget_bytes=16 << 20), fail_limit=3)
    assert g.batch_set(keys, src, range(6)) == [True] * 6
    shutil.rmtree(path)
    results = [g.batch_set(keys, src, range(6)) for _ in range(4)]
    assert results[:3] == [[False] * 6] * 3 and results[3] == [True] * 6
    dst = ByteSource(P, 6)
    assert g.batch_get(keys, dst, range(6)) == [True] * 6
    assert torch.equal(dst.buf, src.buf) and (path / "data.mdb").exists()
    assert g.stats().reopens == 1
    g.close()


def test_lmdb_store_whose_map_keeps_failing_is_turned_off(tmp_path, gen, monkeypatch):
    path = tmp_path / "s"
    keys = page_keys(NS, list(range(6 * 4)), 4)
    stores = []

    def open_store():
        stores.append(LMDBStorage(path, NS, P, budget_bytes=16 << 20))

        def corrupted(fn):
            raise lmdb.CorruptedError("injected")

        stores[-1]._read = corrupted
        return stores[-1]

    g = GuardedStorage(open_store, fail_limit=2)
    for _ in range(4):
        assert g.batch_exists(keys) == 0
    assert g.off and len(stores) == 2
    assert g.batch_get(keys, ByteSource(P, 6), range(6)) == [False] * 6
    st = g.stats()
    assert st.turned_off == 1 and st.errors and g.error_count() >= 4
    g.close()

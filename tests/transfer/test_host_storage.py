"""HostStorageTransfer: host <-> storage jobs in the background (MemoryStorage and LMDBStorage):
round trips, the usable prefix of a prefetch, storage errors as failed results, cancel, checks.

Data is random bits everywhere and every comparison is bit-exact.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.transfer._util import (
    FlakyStorage,
    P,
    Results,
    fill_bits,
    fill_device,
    host_pages,
    keys_for,
    make_host,
    make_pool,
    min_lmdb_budget,
    page_bytes,
    same,
    store_directly,
    wait_for,
)
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction
from tiered_kv.storage import LMDBStorage, MemoryStorage, StorageNamespace
from tiered_kv.transfer import HostStorageTransfer, TransferJob


def _rig(gen, *, dtype=torch.float16):
    pool, alloc = make_pool(dtype=dtype, pages=11, layer_num=3)
    host = make_host(pool, alloc, "page_first", host_pages=17)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return host


@pytest.fixture(params=["memory", "lmdb"])
def store_rig(request, gen, tmp_path):
    """(host pool with random bits, store)."""
    host = _rig(gen)
    ns = StorageNamespace.for_host_pool(host, model="test-model")
    if request.param == "memory":
        store = MemoryStorage(ns, host.page_nbytes)
    else:
        budget = min_lmdb_budget(tmp_path, ns, host.page_nbytes) * 2
        store = LMDBStorage(tmp_path / "store", ns, host.page_nbytes, budget_bytes=budget)
    yield host, store
    store.close()


def test_backup_then_prefetch_round_trips_pages(store_rig, gen):
    host, store = store_rig
    n = 5
    ctl = HostStorageTransfer(host, store, batch_pages=2)
    res = Results(ctl)
    try:
        keys = keys_for(host, n, gen)
        src_pages, src_slots = host_pages(host, n, gen)
        src = page_bytes(host, src_pages)
        assert res.submit(TransferJob.backup(1, keys, src_slots))
        (done,) = wait_for(res.poll)
        assert (done.job_id, done.direction, done.ok) == (1, Direction.HOST_TO_STORAGE, True)
        assert (done.pages_done, done.num_pages, done.error) == (n, n, None)
        assert done.nbytes == n * host.page_nbytes and done.seconds > 0
        assert store.batch_exists(keys) == n
        assert ctl.poll() == []

        dst_pages, dst_slots = host_pages(host, n, gen)
        assert not any(same(src, page_bytes(host, dst_pages)))
        assert res.submit(TransferJob.prefetch(2, keys, dst_slots))
        r = res.result(2)
        assert (r.job_id, r.direction, r.ok) == (2, Direction.STORAGE_TO_HOST, True)
        assert (r.pages_done, r.num_pages, r.error) == (n, n, None)
        assert r.nbytes == n * host.page_nbytes
        for i, (a, b) in enumerate(zip(src, page_bytes(host, dst_pages), strict=True)):
            assert torch.equal(a, b), f"page {i} differs after prefetch"
        stats = ctl.stats.snapshot()
        assert stats["host_to_storage"].bytes == n * host.page_nbytes
        assert stats["host_to_storage"].ops == 3  # batches of 2, 2, 1
        assert stats["host_to_storage"].failed_ops == 0
        assert stats["storage_to_host"].bytes == n * host.page_nbytes
        assert all(x.error is None for x in res.by_id.values())  # no storage error
    finally:
        ctl.close()


@pytest.mark.parametrize("missing", [0, 4, 6])
def test_prefetch_stops_at_the_first_missing_page(store_rig, gen, missing):
    host, store = store_rig
    n = 7
    ctl = HostStorageTransfer(host, store, batch_pages=3)
    res = Results(ctl)
    try:
        keys = keys_for(host, n, gen)
        src_pages, src_slots = host_pages(host, n, gen)
        src = page_bytes(host, src_pages)
        assert res.submit(TransferJob.backup(1, keys, src_slots))
        assert res.result(1).ok
        assert store.delete([keys[missing]]) == 1
        dst_pages, dst_slots = host_pages(host, n, gen)
        dst_before = page_bytes(host, dst_pages)
        assert res.submit(TransferJob.prefetch(2, keys, dst_slots))
        r = res.result(2)
        assert r.pages_done == missing and r.error is None
        assert r.ok is False and r.num_pages == n and r.nbytes == missing * host.page_nbytes
        got = page_bytes(host, dst_pages)
        for i in range(missing):
            assert torch.equal(got[i], src[i]), f"page {i} not loaded"
        for i in range(missing, n):
            assert torch.equal(got[i], dst_before[i]), f"page {i} after the miss was touched"
        stats = ctl.stats.snapshot()["storage_to_host"]
        assert stats.bytes == missing * host.page_nbytes
    finally:
        ctl.close()


def test_storage_errors_become_failed_results(store_rig, gen):
    """(Was: ``ctl.storage_errors`` counted them; the cache manager counts results whose
    ``error`` is set now.)"""
    host, store = store_rig
    n = 5
    flaky = FlakyStorage(store, fail_set_from=2, fail_get_from=2)
    ctl = HostStorageTransfer(host, flaky, batch_pages=2)
    res = Results(ctl)

    def errors() -> int:
        return sum(r.error is not None for r in res.by_id.values())

    try:
        keys = keys_for(host, n, gen)
        src_pages, src_slots = host_pages(host, n, gen)
        src = page_bytes(host, src_pages)
        assert res.submit(TransferJob.backup(1, keys, src_slots))  # no exception here
        (done,) = wait_for(res.poll)
        assert done.job_id == 1 and done.ok is False
        assert done.error is not None and "vanished (set)" in done.error
        assert done.pages_done == 2  # the first batch went through
        assert done.nbytes == 2 * host.page_nbytes
        assert errors() == 1
        assert store.batch_exists(keys) == 2

        dst_pages, dst_slots = host_pages(host, 2, gen)
        assert res.submit(TransferJob.prefetch(2, keys[:2], dst_slots))  # one batch: no failure
        r = res.result(2)
        assert r.pages_done == 2 and r.error is None and r.ok
        assert all(same(src[:2], page_bytes(host, dst_pages)))

        assert res.submit(TransferJob.backup(3, keys[2:], src_slots[2 * P :]))  # set call 3
        b2 = res.result(3)
        assert b2.ok is False and "vanished (set)" in b2.error and b2.pages_done == 0
        store_directly(store, keys, host, src_pages)
        dst_pages, dst_slots = host_pages(host, n, gen)
        assert res.submit(TransferJob.prefetch(4, keys, dst_slots))  # get call 2: fails
        r = res.result(4)
        assert r.error is not None and "vanished (get)" in r.error
        assert r.pages_done == 0 and r.ok is False and r.nbytes == 0
        assert errors() == 3
        assert [res.by_id[i].direction for i in (1, 3)] == [Direction.HOST_TO_STORAGE] * 2
        assert ctl.poll() == [] and ctl.in_flight == 0
        assert ctl.stats.snapshot()["host_to_storage"].bytes == 2 * host.page_nbytes
    finally:
        ctl.close()


def test_prefetch_error_after_a_good_batch_keeps_the_loaded_prefix(store_rig, gen):
    host, store = store_rig
    n = 6
    flaky = FlakyStorage(store, fail_get_from=2)
    ctl = HostStorageTransfer(host, flaky, batch_pages=4)
    res = Results(ctl)
    try:
        keys = keys_for(host, n, gen)
        src_pages, _ = host_pages(host, n, gen)
        src = page_bytes(host, src_pages)
        store_directly(store, keys, host, src_pages)
        dst_pages, dst_slots = host_pages(host, n, gen)
        assert res.submit(TransferJob.prefetch(1, keys, dst_slots))
        r = res.result(1)
        assert r.error is not None and r.pages_done == 4 and r.ok is False
        got = page_bytes(host, dst_pages)
        assert all(torch.equal(got[i], src[i]) for i in range(4))
        assert sum(x.error is not None for x in res.by_id.values()) == 1
    finally:
        ctl.close()


def test_cancel_before_the_job_runs(store_rig, gen):
    host, store = store_rig
    gate = threading.Event()
    blocking = FlakyStorage(store, gate=gate)
    ctl = HostStorageTransfer(host, blocking, batch_pages=2)
    res = Results(ctl)
    try:
        keys = keys_for(host, 3, gen)
        src_pages, src_slots = host_pages(host, 3, gen)
        store_directly(store, keys[:1], host, src_pages[:1])
        other = keys_for(host, 3, gen)
        store_directly(store, other, host, src_pages)

        # Prefetch: the first job holds the worker; the second is cancelled while queued.
        _, first_slots = host_pages(host, 1, gen)
        assert res.submit(TransferJob.prefetch(1, keys[:1], first_slots))
        dst_pages, dst_slots = host_pages(host, 3, gen)
        dst_before = page_bytes(host, dst_pages)
        assert res.submit(TransferJob.prefetch(2, other, dst_slots))
        ctl.cancel(2)
        # Backup: the same, on its own thread.
        assert res.submit(TransferJob.backup(3, keys[1:2], src_slots[P : 2 * P]))
        assert res.submit(TransferJob.backup(4, keys[2:], src_slots[2 * P :]))
        ctl.cancel(4)
        gate.set()
        assert res.result(1).pages_done == 1 and res.result(1).ok
        queued = res.result(2)
        assert queued.pages_done == 0 and queued.error is None and queued.ok is False
        assert all(same(dst_before, page_bytes(host, dst_pages)))
        held, cancelled = res.result(3), res.result(4)
        backups = [i for i in res.order if res.by_id[i].direction is Direction.HOST_TO_STORAGE]
        assert backups == [3, 4]  # in submission order
        assert held.ok and held.pages_done == 1
        assert cancelled.ok is False and cancelled.pages_done == 0 and cancelled.error is None
        assert cancelled.nbytes == 0
        assert store.batch_exists(keys[2:]) == 0
        ctl.cancel(4)  # finished: a no-op
        ctl.cancel(999)  # unknown: a no-op
    finally:
        gate.set()
        ctl.close()


def test_close_with_a_timeout_cancels_what_a_hung_store_holds_up(store_rig, gen):
    """close(timeout_s) (what the exit hook calls) returns by its deadline when the store hangs:
    the queued jobs are cancelled and nothing of theirs is written, the held job's batch in
    progress still completes once the store answers."""
    host, store = store_rig
    gate = threading.Event()
    blocking = FlakyStorage(store, gate=gate)
    ctl = HostStorageTransfer(host, blocking, batch_pages=1)
    res = Results(ctl)
    keys = keys_for(host, 4, gen)
    _, slots = host_pages(host, 4, gen)
    assert res.submit(TransferJob.backup(1, keys[:2], slots[: 2 * P]))
    assert res.submit(TransferJob.backup(2, keys[2:], slots[2 * P :]))
    assert blocking.entered.wait(10.0)
    start = time.monotonic()
    assert ctl.close(timeout_s=0.3) is False  # the backup thread is still inside the store
    assert time.monotonic() - start < 5.0
    assert not ctl.submit(TransferJob.backup(3, keys[:1], slots[:P]))  # closed
    gate.set()
    assert ctl.close(timeout_s=10.0) is True
    held, queued = res.result(1), res.result(2)
    assert held.pages_done == 1 and held.ok is False and held.error is None  # cancelled after 1
    assert queued.pages_done == 0 and queued.ok is False
    assert store.batch_exists(keys[:2]) == 1 and store.batch_exists(keys[2:]) == 0


def test_storage_argument_checks(gen):
    host = _rig(gen)
    store = MemoryStorage(
        StorageNamespace.for_host_pool(host, model="test-model"), host.page_nbytes
    )
    ctl = HostStorageTransfer(host, store)
    try:
        keys = keys_for(host, 2, gen)
        _, page_slots = host_pages(host, 2, gen)
        for make in (TransferJob.backup, TransferJob.prefetch):
            with pytest.raises(InvalidArgumentError, match=f"2 page keys need {2 * P} host slots"):
                ctl.submit(make(1, keys, page_slots[:-1]))
            with pytest.raises(InvalidArgumentError, match=f"need {3 * P} host slots"):
                ctl.submit(make(1, [*keys, keys[0]], page_slots))
            with pytest.raises(InvalidArgumentError, match="whole host pages"):
                ctl.submit(make(1, keys, page_slots + 1))  # slot runs that straddle pages
            with pytest.raises(InvalidArgumentError, match="whole host pages"):
                ctl.submit(make(1, keys, page_slots.flip(0)))  # slots of a page out of order
            with pytest.raises(InvalidArgumentError, match="host_indices"):
                ctl.submit(make(1, keys, page_slots.tolist()))
        assert ctl.poll() == [] and ctl.in_flight == 0
        assert ctl.wait(None, 0.01) is True  # nothing was started
        assert store.stats().sets == 0 and store.stats().gets == 0
        with pytest.raises(InvalidArgumentError, match="storage_batch_pages"):
            HostStorageTransfer(host, store, batch_pages=0)
    finally:
        ctl.close()

"""The one transfer contract (``tiered_kv.transfer.base``) on both workers: every result exactly
once through ``poll``, ``wait`` semantics, ``cancel``, storage trouble as failed results, the
layer events of a load job, failed copies, and refusal of bad jobs.

KV data is fresh random non-zero f32 in an irregular geometry (3 heads, head_dim 5, 3 layers,
page size 4); every comparison is bit-exact. Randomised tests print their seed.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
import torch

from tests.transfer._util import (
    KV_LAYERS,
    TIMEOUT,
    FlakyStorage,
    Results,
    assert_same_bits,
    device_kv,
    fresh_device,
    fresh_host,
    host_pages,
    keys_for,
    kv_rig,
    page_bytes,
    page_run,
    same,
    store_directly,
    stored_bytes,
    token_bytes,
    wait_for,
)
from tiered_kv.errors import InvalidArgumentError, TransferError
from tiered_kv.names import Direction
from tiered_kv.storage import MemoryStorage, StorageNamespace
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob


def _seed(gen: torch.Generator) -> int:
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    print(f"random seed of this test: {seed}")
    return seed


def _memory_store(host) -> MemoryStorage:
    return MemoryStorage(StorageNamespace.for_host_pool(host, model="test-model"), host.page_nbytes)


def _take(alloc_fn, n: int) -> torch.Tensor:
    """``n`` freshly allocated slots (the first of whole pages)."""
    got = alloc_fn(-(-n // 4) * 4)
    assert got is not None
    return got[:n].clone()


def _pick(rng: random.Random, pool: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` distinct entries of ``pool`` in random order."""
    return pool[torch.tensor(rng.sample(range(len(pool)), n))].clone()


@pytest.fixture
def closing():
    """Register workers to close at teardown (after the test's gates are released)."""
    workers = []
    yield workers.append
    for w in workers:
        w.close()


class _Jitter:
    """Random short sleeps in the copy and store calls (thread-safe), so the worker threads
    finish jobs in ever different interleavings with the test's submit / poll / wait calls."""

    def __init__(self, seed: int, most_s: float = 0.002) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.most_s = most_s

    def sleep(self) -> None:
        with self._lock:
            s = self._rng.random() * self.most_s
        time.sleep(s)

    def patch_host(self, monkeypatch, host) -> None:
        for name in ("load_to_device_per_layer", "backup_from_device_all_layer"):
            real = getattr(host, name)

            def slowed(*args, _real=real, **kwargs):
                self.sleep()
                return _real(*args, **kwargs)

            monkeypatch.setattr(host, name, slowed)


class _JitteryStore:
    def __init__(self, inner, jitter: _Jitter) -> None:
        self.inner, self.jitter = inner, jitter

    def batch_exists(self, keys):
        self.jitter.sleep()
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, source, pages):
        self.jitter.sleep()
        return self.inner.batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        self.jitter.sleep()
        return self.inner.batch_set(keys, source, pages)


# -- exactly once ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["device_host", "host_storage"])
def test_every_result_is_delivered_exactly_once_across_random_interleavings(
    gen, monkeypatch, closing, which
):
    seed = _seed(gen)
    rng = random.Random(seed)
    pool, alloc, host = kv_rig(device_pages=12, host_pages=24)
    dev = alloc.alloc(alloc.available_size())
    hst = host.alloc(host.available_size())
    jitter = _Jitter(seed + 1)
    jitter.patch_host(monkeypatch, host)
    if which == "device_host":
        worker = DeviceHostTransfer(alloc, host, layer_slots=rng.choice([1, 2, 3]))
    else:
        store = _JitteryStore(_memory_store(host), jitter)
        worker = HostStorageTransfer(host, store, batch_pages=rng.choice([1, 2, 3]))
    closing(worker)
    res = Results(worker)
    keys = keys_for(host, 16, gen)
    next_id = 0
    deadline = time.monotonic() + 30
    for step in range(160):
        assert time.monotonic() < deadline, f"step {step}: too slow (seed {seed})"
        pending = sorted(res.submitted - res.by_id.keys())
        op = rng.random()
        if op < 0.5:
            if which == "device_host":
                n = rng.randint(1, 9)
                d, h = _pick(rng, dev, n), _pick(rng, hst, n)
                job = rng.choice(
                    [TransferJob.write(next_id, d, h), TransferJob.load(next_id, h, d)]
                )
            else:
                m = rng.randint(1, 4)
                pages = rng.sample(range(host.num_pages), m)
                ks = rng.sample(keys, m)
                make = rng.choice([TransferJob.backup, TransferJob.prefetch])
                job = make(next_id, ks, page_run(pages))
            assert res.submit(job), f"step {step}: job refused (seed {seed})"
            next_id += 1
        elif op < 0.75:
            res.poll()
        elif op < 0.9 and pending:
            ids = rng.sample(pending, rng.randint(1, len(pending)))
            assert worker.wait(ids, TIMEOUT), f"step {step}: wait({ids}) (seed {seed})"
            res.poll()
            # Finished means deliverable: the poll right after a True wait has them all.
            missing = [i for i in ids if i not in res.by_id]
            assert missing == [], f"step {step}: waited for {missing}, not delivered (seed {seed})"
        else:
            assert worker.wait(None, TIMEOUT) is True
        assert worker.in_flight == len(res.submitted) - len(res.by_id), f"step {step}"
    res.drain()
    assert sorted(res.by_id) == list(range(next_id)) == sorted(res.order)
    for r in res.by_id.values():
        assert r.direction in worker.directions
    for _ in range(3):
        assert worker.poll() == []
    assert worker.in_flight == 0


# -- wait ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocked", ["backup", "prefetch"])
def test_wait_is_true_only_once_the_storage_job_has_finished(gen, closing, blocked):
    pool, alloc, host = kv_rig()
    inner = _memory_store(host)
    gate = threading.Event()
    store = FlakyStorage(inner, gate=gate)
    ctl = HostStorageTransfer(host, store, batch_pages=2)
    closing(ctl)
    try:
        keys = keys_for(host, 3, gen)
        src_pages, src_slots = host_pages(host, 3, gen)
        fresh_host(host, src_slots, gen)
        if blocked == "backup":
            job = TransferJob.backup(1, keys, src_slots)
            # Another job that finishes meanwhile (keys not stored: no batch_get is made).
            other = TransferJob.prefetch(2, keys_for(host, 2, gen), host_pages(host, 2, gen)[1])
        else:
            store_directly(inner, keys, host, src_pages)
            job = TransferJob.prefetch(1, keys, host_pages(host, 3, gen)[1])
            other = TransferJob.backup(2, [], torch.empty(0, dtype=torch.int64))  # no batch
        assert ctl.submit(job)
        assert store.entered.wait(TIMEOUT)
        assert ctl.submit(other)
        assert ctl.wait([2], TIMEOUT) is True
        t0 = time.monotonic()
        assert ctl.wait([1], timeout_s=0.01) is False
        assert ctl.wait([1, 2], timeout_s=0.01) is False
        assert ctl.wait(None, timeout_s=0.01) is False
        assert ctl.wait([1], timeout_s=0) is False
        assert time.monotonic() - t0 < 2.0, "a timed wait overstayed its timeout"
        got = ctl.poll()
        assert [(r.job_id, r.error) for r in got] == [(2, None)]
        assert got[0].ok is (blocked == "prefetch")  # a prefetch of keys not stored: not ok
        assert ctl.in_flight == 1
        waited: list[bool] = []
        t = threading.Thread(target=lambda: waited.append(ctl.wait([1])), daemon=True)
        t.start()
        time.sleep(0.1)
        assert t.is_alive() and waited == [], "wait([id]) returned before the job finished"
        assert ctl.poll() == []
        gate.set()
        t.join(TIMEOUT)
        assert waited == [True]
        assert ctl.wait([1], timeout_s=0.01) is True
        (r,) = ctl.poll()  # one poll: a finished job is deliverable
        assert (r.job_id, r.ok, r.pages_done, r.error) == (1, True, 3, None)
        assert ctl.wait([1], timeout_s=0) is True  # delivered: nothing to wait for
        assert ctl.in_flight == 0
    finally:
        gate.set()


class _SlowPut:
    """A finished-jobs queue whose ``put`` takes a while (widens the window between a job
    being signalled done and its result being deliverable)."""

    def __init__(self, inner: queue.SimpleQueue) -> None:
        self.inner = inner

    def put(self, item) -> None:
        time.sleep(0.05)
        self.inner.put(item)

    def get_nowait(self):
        return self.inner.get_nowait()


def test_a_poll_right_after_a_true_wait_delivers_the_result(gen, closing):
    """White-box: the storage worker's finished-jobs queue is slowed down. ``wait`` must not
    say True before ``poll`` can deliver (the prefetch path waits, then polls once, then reads
    ``pages_done`` from the result)."""
    pool, alloc, host = kv_rig()
    store = _memory_store(host)
    ctl = HostStorageTransfer(host, store, batch_pages=2)
    closing(ctl)
    ctl._done = _SlowPut(ctl._done)
    keys = keys_for(host, 2, gen)
    _, src_slots = host_pages(host, 2, gen)
    for job_id, make in enumerate((TransferJob.backup, TransferJob.prefetch, TransferJob.backup)):
        assert ctl.submit(make(job_id, keys, src_slots))
        assert ctl.wait([job_id], TIMEOUT) is True
        assert [r.job_id for r in ctl.poll()] == [job_id]


def test_device_host_wait_returns_once_the_copies_are_done(gen, monkeypatch, closing):
    pool, alloc, host = kv_rig()
    gate = threading.Event()
    real = host.backup_from_device_all_layer

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "backup_from_device_all_layer", gated)
    ctl = DeviceHostTransfer(alloc, host)
    closing(ctl)
    try:
        d, h = alloc.alloc(8), host.alloc(8)
        k, v = fresh_device(pool, d, gen)
        assert ctl.submit(TransferJob.write(1, d, h))
        assert ctl.submit(TransferJob.load(2, h, alloc.alloc(8)))  # behind nothing: own stream
        assert ctl.wait([2]) is True
        waited: list[bool] = []
        t = threading.Thread(target=lambda: waited.append(ctl.wait([1])), daemon=True)
        t.start()
        time.sleep(0.1)
        assert t.is_alive() and waited == []
        assert [r.job_id for r in ctl.poll()] == [2]
        gate.set()
        t.join(TIMEOUT)
        assert waited == [True]
        (r,) = ctl.poll()
        assert (r.job_id, r.ok) == (1, True)
        assert_same_bits(host.part_view("k")[:, h], k, "written K")
        assert_same_bits(host.part_view("v")[:, h], v, "written V")
        assert ctl.wait(None) is True and ctl.in_flight == 0
    finally:
        gate.set()


# -- cancel --------------------------------------------------------------------------------------
def test_cancel_stops_a_prefetch_after_its_batch_in_progress(gen, closing):
    pool, alloc, host = kv_rig()
    inner = _memory_store(host)
    gate = threading.Event()
    store = FlakyStorage(inner, gate=gate)
    ctl = HostStorageTransfer(host, store, batch_pages=2)
    closing(ctl)
    try:
        n = 7
        keys = keys_for(host, n, gen)
        src_pages, src_slots = host_pages(host, n, gen)
        fresh_host(host, src_slots, gen)
        src = page_bytes(host, src_pages)
        store_directly(inner, keys, host, src_pages)
        dst_pages, dst_slots = host_pages(host, n, gen)
        fresh_host(host, dst_slots, gen)
        before = page_bytes(host, dst_pages)
        assert ctl.submit(TransferJob.prefetch(5, keys, dst_slots))
        assert store.entered.wait(TIMEOUT)  # the first batch is in progress
        ctl.cancel(5)
        gate.set()
        assert ctl.wait([5], TIMEOUT)
        (r,) = ctl.poll()
        assert r.job_id == 5
        assert (r.ok, r.pages_done, r.num_pages, r.error) == (False, 2, n, None)
        assert r.nbytes == 2 * host.page_nbytes
        assert store.gets == 1, "batches after the cancel were read"
        got = page_bytes(host, dst_pages)
        assert same(got[:2], src[:2]) == [True, True]
        assert same(got[2:], before[2:]) == [True] * (n - 2), "pages after the cancel touched"
    finally:
        gate.set()


def test_cancel_stops_a_backup_after_its_batch_in_progress(gen, closing):
    pool, alloc, host = kv_rig()
    inner = _memory_store(host)
    gate = threading.Event()
    store = FlakyStorage(inner, gate=gate)
    ctl = HostStorageTransfer(host, store, batch_pages=3)
    closing(ctl)
    try:
        n = 8
        keys = keys_for(host, n, gen)
        src_pages, src_slots = host_pages(host, n, gen)
        fresh_host(host, src_slots, gen)
        src = page_bytes(host, src_pages)
        assert ctl.submit(TransferJob.backup(6, keys, src_slots))
        assert store.entered.wait(TIMEOUT)
        ctl.cancel(6)
        gate.set()
        (r,) = wait_for(ctl.poll)
        assert (r.job_id, r.ok, r.pages_done, r.error) == (6, False, 3, None)
        assert store.sets == 1 and inner.batch_exists(keys) == 3
        assert all(same(stored_bytes(inner, keys[:3], host.page_nbytes), src[:3]))
    finally:
        gate.set()


def test_cancel_of_a_device_host_job_is_a_no_op(gen, closing):
    pool, alloc, host = kv_rig()
    ctl = DeviceHostTransfer(alloc, host)
    closing(ctl)
    h, d = _take(host.alloc, 6), _take(alloc.alloc, 6)
    k, _ = fresh_host(host, h, gen)
    assert ctl.submit(TransferJob.load(1, h, d))
    ctl.cancel(1)
    ctl.cancel(99)
    (r,) = wait_for(ctl.poll)
    assert (r.job_id, r.ok, r.nbytes) == (1, True, 6 * token_bytes(pool))
    assert_same_bits(device_kv(pool, d)[0], k, "loaded K")


# -- storage trouble -------------------------------------------------------------------------
class _BrokenOnce:
    """Raises on the listed call numbers (1-based) of each method, else passes through."""

    def __init__(self, inner, **fail) -> None:
        self.inner = inner
        self.fail = {name: set(calls) for name, calls in fail.items()}
        self.calls = {"batch_exists": 0, "batch_get": 0, "batch_set": 0}

    def _call(self, name, *args):
        self.calls[name] += 1
        if self.calls[name] in self.fail.get(name, ()):
            raise OSError(f"disk on fire during {name} #{self.calls[name]}")
        return getattr(self.inner, name)(*args)

    def batch_exists(self, keys):
        return self._call("batch_exists", keys)

    def batch_get(self, keys, source, pages):
        return self._call("batch_get", keys, source, pages)

    def batch_set(self, keys, source, pages):
        return self._call("batch_set", keys, source, pages)


def test_a_store_that_raises_fails_the_job_and_the_worker_keeps_serving(gen, closing):
    pool, alloc, host = kv_rig()
    inner = _memory_store(host)
    store = _BrokenOnce(inner, batch_set=[1], batch_exists=[2], batch_get=[2])
    ctl = HostStorageTransfer(host, store, batch_pages=4)
    closing(ctl)
    res = Results(ctl)
    n = 3
    keys = keys_for(host, n, gen)
    src_pages, src_slots = host_pages(host, n, gen)
    fresh_host(host, src_slots, gen)
    src = page_bytes(host, src_pages)

    assert res.submit(TransferJob.backup(1, keys, src_slots))
    r = res.result(1)
    assert (r.ok, r.pages_done, r.nbytes) == (False, 0, 0)
    assert r.error == "OSError: disk on fire during batch_set #1"
    assert inner.batch_exists(keys) == 0

    assert res.submit(TransferJob.backup(2, keys, src_slots))  # the same worker, still serving
    r = res.result(2)
    assert (r.ok, r.pages_done, r.error) == (True, n, None)
    assert all(same(stored_bytes(inner, keys, host.page_nbytes), src))

    dst_pages, dst_slots = host_pages(host, n, gen)
    fresh_host(host, dst_slots, gen)
    before = page_bytes(host, dst_pages)
    assert res.submit(TransferJob.prefetch(3, keys, dst_slots))  # batch_exists #1: fine
    assert res.submit(TransferJob.prefetch(4, keys, dst_slots))  # batch_exists #2 raises
    assert res.submit(TransferJob.prefetch(5, keys, dst_slots))  # batch_get #2 raises
    r3, r4, r5 = res.result(3), res.result(4), res.result(5)
    assert (r3.ok, r3.pages_done, r3.error) == (True, n, None)
    assert all(same(page_bytes(host, dst_pages), src))
    assert (r4.ok, r4.pages_done, r4.nbytes) == (False, 0, 0)
    assert r4.error == "OSError: disk on fire during batch_exists #2"
    assert (r5.ok, r5.pages_done) == (False, 0)
    assert r5.error == "OSError: disk on fire during batch_get #2"
    assert not any(same(before, src))  # (the test's data: before and src differ)

    dst_pages, dst_slots = host_pages(host, n, gen)
    assert res.submit(TransferJob.prefetch(6, keys, dst_slots))
    r = res.result(6)
    assert (r.ok, r.pages_done, r.error) == (True, n, None)
    assert all(same(page_bytes(host, dst_pages), src))
    assert ctl.in_flight == 0 and all(t.is_alive() for t in ctl._threads)


# -- load jobs and the layer-done counter ------------------------------------------------------
def test_a_load_jobs_layers_read_through_the_getters_hold_the_loaded_bytes(
    gen, monkeypatch, closing
):
    """Slowed copies: a getter that did not wait for its layer would return the stale bytes.
    Five loads through two producer slots (so submits also wait for the oldest slot)."""
    pool, alloc, host = kv_rig(device_pages=12, host_pages=24)
    real = host.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(0.01)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "load_to_device_per_layer", slow)
    ctl = DeviceHostTransfer(alloc, host, layer_slots=2)
    closing(ctl)
    counter = ctl.layer_done_counter
    dev = alloc.alloc(alloc.available_size())
    hst = host.alloc(host.available_size())
    perm = torch.randperm(len(dev), generator=gen)
    res = Results(ctl)
    for job_id, n in enumerate((7, 13, 1, 10, 5)):
        d = dev[perm[:n]]
        perm = perm.roll(n)
        h = hst[torch.randperm(len(hst), generator=gen)[:n]]
        stale_k, _ = fresh_device(pool, d, gen)
        k, v = fresh_host(host, h, gen)
        assert not torch.equal(stale_k, k)
        assert res.submit(TransferJob.load(job_id, h, d))
        slot = ctl.load_slot(job_id)
        assert slot == job_id % 2 and counter.consumer_is(slot) and counter.producer == slot
        for layer in range(KV_LAYERS):
            assert_same_bits(pool.get_key_buffer(layer)[d][None], k[layer][None], f"job {job_id} K")
            assert_same_bits(
                pool.get_value_buffer(layer)[d][None], v[layer][None], f"job {job_id} V"
            )
    res.drain()
    assert all(r.ok for r in res.by_id.values())


@pytest.mark.parametrize("layer_slots", [1, 3])
def test_a_failed_layer_copy_fails_the_load_and_later_loads_still_succeed(
    gen, monkeypatch, closing, layer_slots
):
    seed = _seed(gen)
    bad_layer = random.Random(seed).randrange(KV_LAYERS)
    pool, alloc, host = kv_rig()
    real = host.load_to_device_per_layer
    doomed: list[torch.Tensor] = []

    def failing(device_pool, h, d, layer_id, io_backend="kernel"):
        if any(h is x for x in doomed) and layer_id == bad_layer:
            raise OSError(f"layer {layer_id} copy lost")
        real(device_pool, h, d, layer_id, io_backend)

    monkeypatch.setattr(host, "load_to_device_per_layer", failing)
    ctl = DeviceHostTransfer(alloc, host, layer_slots=layer_slots)
    closing(ctl)
    counter = ctl.layer_done_counter
    h, d = _take(host.alloc, 6), _take(alloc.alloc, 6)
    fresh_host(host, h, gen)
    doomed.append(h)
    assert ctl.submit(TransferJob.load(1, h, d))
    slot = ctl.load_slot(1)
    assert counter.consumer_is(slot)
    assert ctl.wait([1]) is True
    with pytest.raises(TransferError, match="copy lost"):  # until polled, readers hit the error
        pool.get_key_buffer(bad_layer)
    (r,) = ctl.poll()
    assert (r.job_id, r.ok, r.nbytes) == (1, False, 0)
    # Acknowledged, it stays the consumer: a poll before the forward must not hide the failure
    # (issue 12); the next load (or the next request begun) becomes the consumer.
    assert counter.consumer_is(slot)
    with pytest.raises(TransferError, match="copy lost"):
        pool.get_key_buffer(bad_layer)
    s = ctl.stats.snapshot()["host_to_device"]
    assert (s.ops, s.failed_ops, s.bytes) == (1, 1, 0)

    for job_id in (2, 3, 4):  # later loads, through the same slots, all succeed
        h2, d2 = _take(host.alloc, 5), _take(alloc.alloc, 5)
        k, v = fresh_host(host, h2, gen)
        assert ctl.submit(TransferJob.load(job_id, h2, d2))
        assert counter.consumer_is(ctl.load_slot(job_id))
        for layer in range(KV_LAYERS):
            assert_same_bits(pool.get_key_buffer(layer)[d2][None], k[layer][None], "later K")
            assert_same_bits(pool.get_value_buffer(layer)[d2][None], v[layer][None], "later V")
        (r,) = wait_for(ctl.poll)
        assert (r.job_id, r.ok, r.nbytes) == (job_id, True, 5 * token_bytes(pool))


@pytest.mark.parametrize("layer_slots", [1, 2])
def test_a_failed_load_polled_after_its_slot_was_reused_leaves_the_new_consumer(
    gen, monkeypatch, closing, layer_slots
):
    """A failed load is only acknowledged after a newer load has taken its producer slot again
    (with ``layer_slots`` loads in between): the newer load stays the consumer, so readers keep
    waiting for its layers instead of reading stale bytes."""
    pool, alloc, host = kv_rig()
    real = host.load_to_device_per_layer
    gate = threading.Event()
    doomed: list[torch.Tensor] = []
    gated: list[torch.Tensor] = []

    def copy(device_pool, h, d, layer_id, io_backend="kernel"):
        if any(h is x for x in doomed):
            raise OSError("copy lost")
        if any(h is x for x in gated):
            gate.wait(TIMEOUT)
        real(device_pool, h, d, layer_id, io_backend)

    monkeypatch.setattr(host, "load_to_device_per_layer", copy)
    ctl = DeviceHostTransfer(alloc, host, layer_slots=layer_slots)
    closing(ctl)
    counter = ctl.layer_done_counter
    try:
        h0, d0 = host.alloc(4), alloc.alloc(4)
        doomed.append(h0)
        assert ctl.submit(TransferJob.load(0, h0, d0))
        first = ctl.load_slot(0)
        for job_id in range(1, layer_slots):  # fill the other slots with good loads
            h1, d1 = host.alloc(4), alloc.alloc(4)
            assert ctl.submit(TransferJob.load(job_id, h1, d1))
            assert ctl.wait([job_id])
        assert ctl.wait([0])
        hn, dn = _take(host.alloc, 6), _take(alloc.alloc, 6)
        stale, _ = fresh_device(pool, dn, gen)
        k, _ = fresh_host(host, hn, gen)
        gated.append(hn)
        new_id = layer_slots
        assert ctl.submit(TransferJob.load(new_id, hn, dn))
        assert ctl.load_slot(new_id) == first and counter.consumer_is(first)
        got = {r.job_id: r.ok for r in ctl.poll()}
        assert got == {0: False, **{j: True for j in range(1, layer_slots)}}
        assert counter.consumer_is(first), "acknowledging the old failed load dropped the consumer"
        read: list[torch.Tensor] = []
        t = threading.Thread(
            target=lambda: read.append(pool.get_key_buffer(0)[dn].clone()), daemon=True
        )
        t.start()
        time.sleep(0.1)
        assert t.is_alive() and read == [], "the reader did not wait for the new load"
        gate.set()
        t.join(TIMEOUT)
        assert_same_bits(read[0][None], k[0][None], "new load, layer 0")
        assert not torch.equal(stale, k)
        (r,) = wait_for(ctl.poll)
        assert (r.job_id, r.ok) == (new_id, True)
    finally:
        gate.set()


# -- refusals --------------------------------------------------------------------------------
def test_job_ids_in_flight_are_refused_and_nothing_changes(gen, monkeypatch, closing):
    pool, alloc, host = kv_rig()
    inner = _memory_store(host)
    gate = threading.Event()
    real = host.backup_from_device_all_layer

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "backup_from_device_all_layer", gated)
    dh = DeviceHostTransfer(alloc, host)
    hs = HostStorageTransfer(host, FlakyStorage(inner, gate=gate))
    closing(dh)
    closing(hs)
    try:
        d, h = alloc.alloc(4), host.alloc(4)
        keys = keys_for(host, 1, gen)
        assert dh.submit(TransferJob.write(7, d, h))
        assert hs.submit(TransferJob.backup(7, keys, h))
        for worker, job in (
            (dh, TransferJob.write(7, d, h)),
            (dh, TransferJob.load(7, h, d)),
            (hs, TransferJob.backup(7, keys, h)),
            (hs, TransferJob.prefetch(7, keys, h)),
        ):
            with pytest.raises(InvalidArgumentError, match="job_id=7 is already in flight"):
                worker.submit(job)
            assert worker.in_flight == 1
        assert dh.layer_done_counter.producer == -1  # the refused load took no slot
        gate.set()
        for worker in (dh, hs):
            (r,) = wait_for(worker.poll)
            assert (r.job_id, r.ok) == (7, True)
        # Once delivered, the id may be used again.
        assert dh.submit(TransferJob.load(7, h, d))
        assert hs.submit(TransferJob.prefetch(7, keys, h))
        for worker in (dh, hs):
            (r,) = wait_for(worker.poll)
            assert (r.job_id, r.ok) == (7, True)
    finally:
        gate.set()


def _foreign_jobs(alloc, host, gen):
    d, h = alloc.alloc(4), host.alloc(4)
    keys = keys_for(host, 1, gen)
    return {
        Direction.DEVICE_TO_HOST: TransferJob.write(1, d, h),
        Direction.HOST_TO_DEVICE: TransferJob.load(1, h, d),
        Direction.HOST_TO_STORAGE: TransferJob.backup(1, keys, h),
        Direction.STORAGE_TO_HOST: TransferJob.prefetch(1, keys, h),
    }


@pytest.mark.parametrize("which", ["device_host", "host_storage"])
def test_a_direction_the_worker_does_not_move_is_refused_by_name(gen, closing, which):
    pool, alloc, host = kv_rig()
    store = _memory_store(host)
    if which == "device_host":
        worker = DeviceHostTransfer(alloc, host)
    else:
        worker = HostStorageTransfer(host, store)
    closing(worker)
    jobs = _foreign_jobs(alloc, host, gen)
    foreign = [d for d in Direction if d not in worker.directions]
    assert len(foreign) == 2
    for direction in foreign:
        with pytest.raises(InvalidArgumentError, match=f"{direction.value}.*not moved by this"):
            worker.submit(jobs[direction])
    assert worker.in_flight == 0 and worker.poll() == []
    assert store.stats().sets == 0
    for direction in worker.directions:  # its own directions are taken
        assert worker.submit(jobs[direction])
        assert worker.wait(None, TIMEOUT)
        assert len(worker.poll()) == 1

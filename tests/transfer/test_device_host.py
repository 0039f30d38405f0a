"""DeviceHostTransfer on CPU: layer-wise loads that a consumer can read layer by layer, writes
(device -> host backups), results through ``poll``, stats, argument checks, close.

Data is random bits everywhere (never zeros) and every comparison is bit-exact (integer views).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from tests.transfer._util import (
    TIMEOUT,
    brief,
    dev_rows,
    fill_bits,
    fill_device,
    host_kv,
    host_pages,
    host_snapshot,
    ints,
    keys_for,
    make_host,
    make_pool,
    slots,
    token_bytes,
    wait_for,
)
from tiered_kv.errors import InvalidArgumentError, TransferError
from tiered_kv.names import Direction
from tiered_kv.storage import MemoryStorage, StorageNamespace
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob

H2D, D2H = str(Direction.HOST_TO_DEVICE), str(Direction.DEVICE_TO_HOST)


def _rig(gen, layout="page_first", *, layers=5, start_layer=None, dtype=torch.float32):
    """A device pool (random bits), its allocator, and a host pool (random bits)."""
    pool, alloc = make_pool(dtype=dtype, pages=11, layer_num=layers, start_layer=start_layer)
    host = make_host(pool, alloc, layout, host_pages=17)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return pool, alloc, host


# -- host -> device, layer by layer ------------------------------------------------------------
LOAD_CASES = [
    ("page_first", None, torch.float32),
    ("layer_first", 3, torch.bfloat16),
]


@pytest.mark.parametrize(("layout", "start_layer", "dtype"), LOAD_CASES)
def test_layerwise_load_consumer_sees_each_layer_as_it_lands(
    gen, monkeypatch, layout, start_layer, dtype
):
    """Each layer's copy is held back by a gate: reading layer i returns once layer i has landed
    (never stale bytes), while the layers after i are still blocked, i.e. not waited for."""
    layers = 4
    pool, alloc, host = _rig(gen, layout, layers=layers, start_layer=start_layer, dtype=dtype)
    layer_ids = list(host.decl.layer_ids)
    n = 10
    dev_idx = slots(alloc.alloc, 3, n, gen)
    host_idx = slots(host.alloc, 4, n, gen)
    want = [host_kv(host, i, host_idx) for i in range(layers)]
    stale = [dev_rows(pool.k_buffer[i][dev_idx]).clone() for i in range(layers)]
    for i in range(layers):
        assert not torch.equal(stale[i], want[i][0])  # stale bytes are distinguishable

    ctl = DeviceHostTransfer(alloc, host)
    real = host.load_to_device_per_layer
    gates = [threading.Event() for _ in range(layers)]
    timed_out: list[int] = []

    def gated(device_pool, h, d, layer_id, io_backend="kernel"):
        local = layer_ids.index(layer_id)
        if not gates[local].wait(3.0):
            timed_out.append(local)
        time.sleep(0.02)  # released, but the copy still takes a while
        real(device_pool, h, d, layer_id, io_backend)

    monkeypatch.setattr(host, "load_to_device_per_layer", gated)
    try:
        assert ctl.submit(TransferJob.load(11, host_idx, dev_idx)) is True
        slot = ctl.load_slot(11)
        assert slot == 0 and ctl.layer_done_counter.consumer == slot
        assert ctl.poll() == []
        assert ctl.in_flight == 1
        for i, gid in enumerate(layer_ids):
            gates[i].set()
            k = dev_rows(pool.get_key_buffer(gid)[dev_idx])
            v = dev_rows(pool.get_value_buffer(gid)[dev_idx])
            assert torch.equal(k, want[i][0]), f"layer {gid}: stale K"
            assert torch.equal(v, want[i][1]), f"layer {gid}: stale V"
            for j in range(i + 1, layers):  # later layers are still blocked, still stale
                assert torch.equal(dev_rows(pool.k_buffer[j][dev_idx]), stale[j])
        assert timed_out == [], "a read of layer i waited for the layers after it"
        (r,) = wait_for(ctl.poll)
        assert brief([r]) == [(11, H2D, True, n * token_bytes(pool))]
        assert r.error is None and r.seconds > 0
        assert ctl.in_flight == 0 and ctl.load_slot(11) is None
    finally:
        for g in gates:
            g.set()
        ctl.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_slowed_layerwise_load_first_layer_early_and_exact(gen, monkeypatch, layout):
    """Copies artificially slowed: layer 0 is readable (exact bytes) well before all layers
    are; every later layer reads exact bytes too; stats count every layer's bytes once."""
    layers, delay = 10, 0.1  # layer 0 after ~1 delay vs 5 allowed: robust on a loaded 2-core box
    pool, alloc, host = _rig(gen, layout, layers=layers)
    n = 7
    dev_idx = slots(alloc.alloc, 2, n, gen)
    host_idx = slots(host.alloc, 3, n, gen)
    want = [host_kv(host, i, host_idx) for i in range(layers)]
    before = {i: ints(pool.k_buffer[i]).clone() for i in range(layers)}
    others = torch.ones(pool.num_slots, dtype=torch.bool)
    others[dev_idx] = False

    ctl = DeviceHostTransfer(alloc, host)
    real = host.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(delay)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "load_to_device_per_layer", slow)
    try:
        t0 = time.perf_counter()
        assert ctl.submit(TransferJob.load(17, host_idx, dev_idx))
        k0 = dev_rows(pool.get_key_buffer(0)[dev_idx])
        first = time.perf_counter() - t0
        assert torch.equal(k0, want[0][0])
        assert torch.equal(dev_rows(pool.get_value_buffer(0)[dev_idx]), want[0][1])
        assert first < layers * delay / 2, f"layer 0 took {first:.3f} s: waited for later layers"
        for i in range(1, layers):
            assert torch.equal(dev_rows(pool.get_key_buffer(i)[dev_idx]), want[i][0])
            assert torch.equal(dev_rows(pool.get_value_buffer(i)[dev_idx]), want[i][1])
        assert time.perf_counter() - t0 >= layers * delay * 0.9
        assert brief(wait_for(ctl.poll)) == [(17, H2D, True, n * token_bytes(pool))]
        assert ctl.poll() == []
        for i in range(layers):  # slots outside dev_idx untouched
            assert torch.equal(ints(pool.k_buffer[i])[others], before[i][others])
        s = ctl.stats.snapshot()["host_to_device"]
        assert s.bytes == n * token_bytes(pool) == n * host.page_nbytes // host.page_size
        assert s.ops == 1 and s.failed_ops == 0
        assert s.seconds >= layers * delay * 0.9  # per-layer times summed
        assert ctl.stats.snapshot()["device_to_host"].ops == 0
    finally:
        ctl.close()


def test_loads_submitted_together_each_take_a_slot_and_land_in_order(gen):
    """(Was: loads queued together land in one batch.) One load job is one batch now: two
    jobs submitted back to back take consecutive producer slots, the newest is the consumer,
    both read exact bytes through the getters, and they are acknowledged in order."""
    pool, alloc, host = _rig(gen, "layer_first", layers=3)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        parts = [(slots(host.alloc, 2, m, gen), slots(alloc.alloc, 2, m, gen)) for m in (5, 8)]
        for j, (h, d) in enumerate(parts):
            assert ctl.submit(TransferJob.load(j, h, d))
        assert [ctl.load_slot(j) for j in range(2)] == [0, 1]
        assert ctl.layer_done_counter.consumer == 1 and ctl.layer_done_counter.producer == 1
        for layer in range(3):
            for h, d in parts:
                assert torch.equal(
                    dev_rows(pool.get_key_buffer(layer)[d]), host_kv(host, layer, h)[0]
                )
        tb = token_bytes(pool)
        assert brief(wait_for(ctl.poll, 2)) == [(0, H2D, True, 5 * tb), (1, H2D, True, 8 * tb)]
        assert ctl.in_flight == 0 and ctl.poll() == []  # nothing left in flight
        assert ctl.stats.snapshot()["host_to_device"].bytes == 13 * tb
        assert ctl.stats.snapshot()["host_to_device"].ops == 2
    finally:
        ctl.close()


def test_load_of_a_failing_layer_is_reported_failed(gen, monkeypatch):
    pool, alloc, host = _rig(gen, layers=4)
    ctl = DeviceHostTransfer(alloc, host)
    real = host.load_to_device_per_layer

    def fail_layer_2(device_pool, h, d, layer_id, io_backend="kernel"):
        if layer_id == 2:
            raise OSError("layer 2 copy lost")
        real(device_pool, h, d, layer_id, io_backend)

    monkeypatch.setattr(host, "load_to_device_per_layer", fail_layer_2)
    try:
        h, d = slots(host.alloc, 1, 3, gen), slots(alloc.alloc, 1, 3, gen)
        assert ctl.submit(TransferJob.load(5, h, d))
        (r,) = wait_for(ctl.poll)
        assert brief([r]) == [(5, H2D, False, 0)]
        s = ctl.stats.snapshot()["host_to_device"]
        assert (s.ops, s.failed_ops, s.bytes) == (1, 1, 0)
        # Acknowledged, the failed load stays the consumer: its readers keep hitting its error
        # (a poll before the forward must not hide the failure, issue 12); layers that did land
        # still read exactly.
        assert ctl.layer_done_counter.consumer == ctl.layer_done_counter.producer
        with pytest.raises(TransferError, match="layer 2 copy lost"):
            pool.get_key_buffer(2)
        assert torch.equal(dev_rows(pool.get_key_buffer(3)[d]), host_kv(host, 3, h)[0])
    finally:
        ctl.close()


class CopyLost(RuntimeError):
    """A copy's own error, of a type the transfer code has never heard of."""


def test_a_failed_load_reads_as_one_transfer_error_on_either_copier(gen, monkeypatch, copier):
    """Issue 38: the forward's read of a layer whose load failed raises TransferError on the
    Python copy threads and on the native copy engine alike, the copy's own error as its
    cause; the layers that landed still read exactly."""
    pool, alloc, host = _rig(gen, layers=4)
    bad = int(torch.randint(0, 4, (1,), generator=gen))
    if copier == "engine":  # the engine refuses that layer of the job
        real_job = host.row_job

        def row_job(*args, **kwargs):
            job = real_job(*args, **kwargs)
            order = job.layers.tolist()
            order[bad] = job.shape.total_layers
            return dataclasses.replace(job, shape=job.shape.with_layers(order))

        monkeypatch.setattr(host, "row_job", row_job)
    else:
        real = host.load_to_device_per_layer

        def fail_one(device_pool, h, d, layer_id, io_backend="kernel"):
            if layer_id == bad:
                raise CopyLost(f"layer {layer_id} copy lost")
            real(device_pool, h, d, layer_id, io_backend)

        monkeypatch.setattr(host, "load_to_device_per_layer", fail_one)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        h, d = slots(host.alloc, 1, 3, gen), slots(alloc.alloc, 1, 3, gen)
        assert ctl.submit(TransferJob.load(5, h, d))
        ctl.wait([5])
        for read in (pool.get_key_buffer, pool.get_value_buffer):
            with pytest.raises(TransferError, match=f"layer {bad}") as info:
                read(bad)
            cause = info.value.__cause__
            assert isinstance(cause, CopyLost if copier == "thread" else TransferError), cause
            assert "abort" in str(info.value)
        for layer in set(range(4)) - {bad}:
            assert torch.equal(dev_rows(pool.get_key_buffer(layer)[d]), host_kv(host, layer, h)[0])
        (r,) = wait_for(ctl.poll)
        assert brief([r]) == [(5, H2D, False, 0)]
    finally:
        ctl.close()


def test_load_argument_checks(gen, monkeypatch):
    pool, alloc, host = _rig(gen, layers=2)
    ctl = DeviceHostTransfer(alloc, host)
    calls: list[int] = []
    real = host.load_to_device_per_layer
    monkeypatch.setattr(
        host, "load_to_device_per_layer", lambda *a, **k: (calls.append(1), real(*a, **k))
    )
    try:
        h, d = slots(host.alloc, 2, 6, gen), slots(alloc.alloc, 2, 6, gen)
        before = {i: ints(pool.k_buffer[i]).clone() for i in range(2)}
        with pytest.raises(InvalidArgumentError, match="6 host slots for 5 device slots"):
            ctl.submit(TransferJob.load(1, h, d[:5]))
        with pytest.raises(InvalidArgumentError, match="device_indices"):
            ctl.submit(TransferJob.load(1, h, d.float()))
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            ctl.submit(TransferJob.load(1, h.tolist(), d))
        # Nothing was started: no slot taken, no copy run, nothing in flight or to poll.
        assert ctl.in_flight == 0 and ctl.poll() == []
        assert ctl.layer_done_counter.producer == -1 and ctl.layer_done_counter.consumer is None
        assert ctl.load_slot(1) is None
        time.sleep(0.02)
        assert calls == []
        for i in range(2):
            assert torch.equal(ints(pool.k_buffer[i]), before[i])
    finally:
        ctl.close()


def test_busy_producer_slot_makes_the_next_load_wait_for_the_oldest(gen, monkeypatch):
    """(Was: start_loading raised StateError and kept the queued load.) With every slot still
    loading, submitting a load waits for the oldest load's copies instead of raising; once they
    finish it takes that slot, becomes the consumer and lands."""
    pool, alloc, host = _rig(gen, layers=2)
    ctl = DeviceHostTransfer(alloc, host, layer_slots=2)
    real = host.load_to_device_per_layer
    gate = threading.Event()

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "load_to_device_per_layer", gated)
    try:
        batches = [(slots(host.alloc, 1, 3, gen), slots(alloc.alloc, 1, 3, gen)) for _ in "abc"]
        for j in range(2):
            assert ctl.submit(TransferJob.load(j, *batches[j]))
            assert ctl.load_slot(j) == j
        assert not ctl.layer_done_counter.next_producer_free()
        third: list[object] = []
        t = threading.Thread(
            target=lambda: third.append(ctl.submit(TransferJob.load(2, *batches[2]))), daemon=True
        )
        t.start()
        time.sleep(0.15)
        assert t.is_alive() and third == [], "submit did not wait for the busy slot"
        assert ctl.layer_done_counter.consumer == 1  # nothing changed meanwhile
        gate.set()
        t.join(TIMEOUT)
        assert third == [True]
        assert ctl.layer_done_counter.consumer == 0  # the third load took the oldest slot
        tb = 3 * token_bytes(pool)
        assert brief(wait_for(ctl.poll, 3)) == [(j, H2D, True, tb) for j in range(3)]
        for layer in range(2):
            for h, d in batches:
                assert torch.equal(
                    dev_rows(pool.get_key_buffer(layer)[d]), host_kv(host, layer, h)[0]
                )
    finally:
        gate.set()
        ctl.close()


# -- device -> host ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_write_backs_up_every_layer_exactly(gen, monkeypatch, layout):
    layers = 5
    pool, alloc, host = _rig(gen, layout, layers=layers, start_layer=2)
    n = 9
    dev_idx = slots(alloc.alloc, 3, n, gen)
    host_idx = slots(host.alloc, 3, n, gen)
    before = host_snapshot(host)
    others = torch.ones(host.size, dtype=torch.bool)
    others[host_idx] = False
    ctl = DeviceHostTransfer(alloc, host)
    real = host.backup_from_device_all_layer
    gate = threading.Event()

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "backup_from_device_all_layer", gated)
    try:
        assert ctl.submit(TransferJob.write(21, dev_idx, host_idx))
        t0 = time.perf_counter()
        assert ctl.poll() == []  # in flight: poll answers at once
        assert time.perf_counter() - t0 < 0.5
        assert ctl.in_flight == 1
        gate.set()
        (r,) = wait_for(ctl.poll)
        assert brief([r]) == [(21, D2H, True, n * token_bytes(pool))]
        assert ctl.in_flight == 0
        for local, gid in enumerate(host.decl.layer_ids):
            k, v = host_kv(host, local, host_idx)
            assert torch.equal(k, dev_rows(pool.get_key_buffer(gid)[dev_idx])), f"layer {gid} K"
            assert torch.equal(v, dev_rows(pool.get_value_buffer(gid)[dev_idx])), f"layer {gid} V"
        assert torch.equal(host_snapshot(host)[:, others], before[:, others])
        s = ctl.stats.snapshot()["device_to_host"]
        assert s.bytes == n * token_bytes(pool) and s.ops == 1 and s.failed_ops == 0
        assert s.seconds > 0 and r.seconds > 0
    finally:
        gate.set()
        ctl.close()


def test_writes_are_acknowledged_in_order_and_failures_reported(gen):
    pool, alloc, host = _rig(gen, "layer_first", layers=3)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        pairs = [(slots(alloc.alloc, 1, m, gen), slots(host.alloc, 1, m, gen)) for m in (3, 4)]
        assert ctl.submit(TransferJob.write(1, *pairs[0]))
        # 4 device slots, 2 host slots: refused up front now, nothing started.
        with pytest.raises(InvalidArgumentError, match="2 host slots for 4 device slots"):
            ctl.submit(TransferJob.write(2, pairs[1][0], pairs[1][1][:2]))
        assert ctl.in_flight == 1
        # A copy that raises on the copy thread (a host slot out of range) is a failed result.
        bad_host = pairs[1][1].clone()
        bad_host[0] = host.size + 3
        ctl.wait([1])  # job 1's copy must not land between the two snapshots
        snap = host_snapshot(host)
        with pytest.raises(InvalidArgumentError):  # what the copy thread hits
            host.backup_from_device_all_layer(pool, bad_host, pairs[1][0])
        assert torch.equal(host_snapshot(host), snap)  # and it copied nothing
        assert ctl.submit(TransferJob.write(2, pairs[1][0], bad_host))
        assert ctl.submit(TransferJob.write(3, *pairs[1]))
        tb = token_bytes(pool)
        assert brief(wait_for(ctl.poll, 3)) == [
            (1, D2H, True, 3 * tb),
            (2, D2H, False, 0),
            (3, D2H, True, 4 * tb),
        ]
        s = ctl.stats.snapshot()["device_to_host"]
        assert (s.ops, s.failed_ops, s.bytes) == (3, 1, 7 * tb)
        for d, h in pairs:
            for layer in range(3):
                assert torch.equal(host_kv(host, layer, h)[1], dev_rows(pool.v_buffer[layer][d]))
    finally:
        ctl.close()


def test_a_job_waited_for_is_delivered_while_an_earlier_one_still_runs(gen, monkeypatch):
    """A write whose copy-engine job fails to build finishes at once, behind an earlier write
    still copying on the write stream: ``wait`` returns for it and the next ``poll`` delivers
    it (the contract: the jobs finished since the last call), the earlier one later. Head of
    line only, the failed write was withheld until the first finished (a fault campaign's
    ``wait([17])`` then never saw job 17)."""
    pool, alloc, host = _rig(gen, "page_first", layers=3)
    real = host.backup_from_device_all_layer
    gate, started = threading.Event(), threading.Event()

    def gated(*args, **kwargs):
        started.set()
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    def row_job(device_pool, host_indices, device_indices, to_host, io_backend):
        if len(host_indices) == 3:
            return None  # the copy streams run it (gated above)
        raise OSError("engine refused the job")

    monkeypatch.setattr(host, "backup_from_device_all_layer", gated)
    monkeypatch.setattr(host, "row_job", row_job, raising=False)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        first = (slots(alloc.alloc, 1, 3, gen), slots(host.alloc, 1, 3, gen))
        second = (slots(alloc.alloc, 1, 5, gen), slots(host.alloc, 1, 5, gen))
        assert ctl.submit(TransferJob.write(16, *first))
        assert started.wait(TIMEOUT)
        assert ctl.submit(TransferJob.write(17, *second))
        assert ctl.wait([17])
        assert brief(ctl.poll()) == [(17, D2H, False, 0)]
        assert ctl.in_flight == 1
        gate.set()
        assert brief(wait_for(ctl.poll)) == [(16, D2H, True, 3 * token_bytes(pool))]
        for layer in range(3):
            d, h = first
            assert torch.equal(host_kv(host, layer, h)[1], dev_rows(pool.v_buffer[layer][d]))
        s = ctl.stats.snapshot()["device_to_host"]
        assert (s.ops, s.failed_ops) == (2, 1)
    finally:
        gate.set()
        ctl.close()


# -- argument checks and lifecycle ---------------------------------------------------------------
def test_storage_directions_and_foreign_host_pools_are_refused(gen):
    """(Was: a controller without storage raised StateError "no storage".) The device <-> host
    worker refuses storage jobs naming the direction; a host pool of another device pool is
    refused at construction."""
    pool, alloc, host = _rig(gen, layers=2)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        keys = keys_for(host, 2, gen)
        _, page_slots = host_pages(host, 2, gen)
        for job in (
            TransferJob.backup(1, keys, page_slots),
            TransferJob.prefetch(1, keys, page_slots),
        ):
            with pytest.raises(InvalidArgumentError, match=f"{job.direction}.*not moved by this"):
                ctl.submit(job)
        assert ctl.in_flight == 0 and ctl.poll() == []
        assert ctl.layer_done_counter.producer == -1
    finally:
        ctl.close()
    other_pool, other_alloc = make_pool(layer_num=2)
    with pytest.raises(InvalidArgumentError, match="does not mirror"):
        DeviceHostTransfer(alloc, make_host(other_pool, other_alloc))
    assert pool.layer_transfer_counter is None


def test_close_finishes_work_joins_threads_and_refuses_calls(gen):
    pool, alloc, host = _rig(gen, layers=3)
    store = MemoryStorage(
        StorageNamespace.for_host_pool(host, model="test-model"), host.page_nbytes
    )
    ctl = DeviceHostTransfer(alloc, host)
    st = HostStorageTransfer(host, store)
    assert pool.layer_transfer_counter is ctl.layer_done_counter
    keys = keys_for(host, 2, gen)
    _, page_slots = host_pages(host, 2, gen)
    d = slots(alloc.alloc, 1, 4, gen)
    assert st.submit(TransferJob.backup(1, keys, page_slots))
    assert ctl.submit(TransferJob.write(2, d, page_slots[:4]))
    assert ctl.submit(TransferJob.load(3, page_slots[4:], d))
    ctl.close()
    st.close()
    assert all(not t.is_alive() for t in st._threads) and len(st._threads) == 2
    assert not ctl.write_stream._thread.is_alive() and not ctl.load_stream._thread.is_alive()
    assert pool.layer_transfer_counter is None
    assert store.batch_exists(keys) == 2
    # Finished work can still be acknowledged, once each.
    tb = token_bytes(pool)
    assert brief(ctl.poll()) == [(2, D2H, True, 4 * tb), (3, H2D, True, 4 * tb)]
    (b,) = st.poll()
    assert (b.job_id, b.ok, b.pages_done, b.error) == (1, True, 2, None)
    assert ctl.poll() == [] and st.poll() == []
    # Later submits are refused (False) and start nothing.
    assert ctl.submit(TransferJob.write(4, d, page_slots[:4])) is False
    assert ctl.submit(TransferJob.load(5, page_slots[:4], d)) is False
    assert st.submit(TransferJob.backup(6, keys, page_slots)) is False
    assert st.submit(TransferJob.prefetch(7, keys, page_slots)) is False
    assert ctl.in_flight == 0 and st.in_flight == 0
    assert ctl.poll() == [] and st.poll() == []
    assert store.stats().gets == 0
    ctl.close()  # idempotent
    st.close()


def test_close_leaves_a_newer_workers_counter_registered(gen):
    pool, alloc, host = _rig(gen, layers=2)
    old = DeviceHostTransfer(alloc, host)
    new = DeviceHostTransfer(alloc, host)
    assert pool.layer_transfer_counter is new.layer_done_counter
    old.close()
    assert pool.layer_transfer_counter is new.layer_done_counter
    new.close()
    assert pool.layer_transfer_counter is None

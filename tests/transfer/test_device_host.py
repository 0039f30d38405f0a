"""CacheController on CPU: layer-wise loads that a consumer can read layer by layer, backups to
host, and host <-> storage in the background (MemoryStorage and LMDBStorage).

Data is random bits everywhere (never zeros) and every comparison is bit-exact (integer views).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.host._util import (
    D,
    H,
    fill_bits,
    fill_device,
    host_snapshot,
    ints,
    make_host,
    make_pool,
    part_columns,
)
from tests.host.conftest import torch_threads
from tests.storage._util import min_lmdb_budget
from tiered_kv.cache_controller import CacheController, StorageOp
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.storage import LMDBStorage, MemoryStorage, StorageNamespace, page_keys

TIMEOUT = 10.0
P = 4  # tokens per page


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _wait_for(fn: Callable[[], list], n: int = 1, timeout: float = TIMEOUT) -> list:
    """Call the non-blocking ``fn`` until it has returned ``n`` items in all."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        out.extend(fn())
        if time.monotonic() > deadline:
            raise AssertionError(f"only {out!r} after {timeout} s")
        time.sleep(0.002)
    return out


def _rig(gen, layout="page_first", *, layers=5, start_layer=None, dtype=torch.float32, **kw):
    """A device pool (random bits), its allocator, and a host pool (random bits)."""
    pool, alloc = make_pool("mha", P, dtype, pages=11, layer_num=layers, start_layer=start_layer)
    host = make_host(pool, alloc, layout, host_pages=17)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return pool, alloc, host


def _slots(alloc_fn, pages: int, n: int, gen) -> torch.Tensor:
    """``n`` of the slots of ``pages`` freshly allocated pages, shuffled."""
    slots = alloc_fn(pages * P)
    assert slots is not None
    return slots[torch.randperm(len(slots), generator=gen)][:n].clone()


def _host_kv(host, local: int, host_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of host slots ``host_idx`` in local layer ``local``, as integers ``(n, elems)``,
    read through the test oracle (the documented layout shapes), not the library's views."""
    snap = host_snapshot(host)
    cols = part_columns(host.decl.device_pool)
    return tuple(snap[local, host_idx, a:b].clone() for a, b in (cols["k"], cols["v"]))


def _dev(t: torch.Tensor) -> torch.Tensor:
    """Device rows as integers ``(n, elems)`` (comparable with ``_host_kv``)."""
    return ints(t).reshape(t.shape[0], -1)


def _token_bytes(pool) -> int:
    """Bytes of one token over all layers, from the geometry alone."""
    return pool.layer_num * 2 * H * D * pool.k_buffer[0].element_size()


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
    dev_idx = _slots(alloc.alloc, 3, n, gen)
    host_idx = _slots(host.alloc, 4, n, gen)
    want = [_host_kv(host, i, host_idx) for i in range(layers)]
    stale = [_dev(pool.k_buffer[i][dev_idx]).clone() for i in range(layers)]
    for i in range(layers):
        assert not torch.equal(stale[i], want[i][0])  # stale bytes are distinguishable

    ctl = CacheController(alloc, host)
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
        ctl.load(host_idx, dev_idx, "op-A")
        slot = ctl.start_loading()
        assert slot == 0 and ctl.layer_done_counter.consumer == slot
        assert ctl.poll_loads() == []
        for i, gid in enumerate(layer_ids):
            gates[i].set()
            k = _dev(pool.get_key_buffer(gid)[dev_idx])
            v = _dev(pool.get_value_buffer(gid)[dev_idx])
            assert torch.equal(k, want[i][0]), f"layer {gid}: stale K"
            assert torch.equal(v, want[i][1]), f"layer {gid}: stale V"
            for j in range(i + 1, layers):  # later layers are still blocked, still stale
                assert torch.equal(_dev(pool.k_buffer[j][dev_idx]), stale[j])
        assert timed_out == [], "a read of layer i waited for the layers after it"
        assert _wait_for(ctl.poll_loads) == [("op-A", True)]
    finally:
        for g in gates:
            g.set()
        ctl.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_slowed_layerwise_load_first_layer_early_and_exact(gen, monkeypatch, layout):
    """Copies artificially slowed: layer 0 is readable (exact bytes) well before all layers
    are; every later layer reads exact bytes too; stats count every layer's bytes once."""
    layers, delay = 6, 0.06
    pool, alloc, host = _rig(gen, layout, layers=layers)
    n = 7
    dev_idx = _slots(alloc.alloc, 2, n, gen)
    host_idx = _slots(host.alloc, 3, n, gen)
    want = [_host_kv(host, i, host_idx) for i in range(layers)]
    before = {i: ints(pool.k_buffer[i]).clone() for i in range(layers)}
    others = torch.ones(pool.num_slots, dtype=torch.bool)
    others[dev_idx] = False

    ctl = CacheController(alloc, host)
    real = host.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(delay)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "load_to_device_per_layer", slow)
    try:
        t0 = time.perf_counter()
        ctl.load(host_idx, dev_idx, 17)
        ctl.start_loading()
        k0 = _dev(pool.get_key_buffer(0)[dev_idx])
        first = time.perf_counter() - t0
        assert torch.equal(k0, want[0][0])
        assert torch.equal(_dev(pool.get_value_buffer(0)[dev_idx]), want[0][1])
        assert first < layers * delay / 2, f"layer 0 took {first:.3f} s: waited for later layers"
        for i in range(1, layers):
            assert torch.equal(_dev(pool.get_key_buffer(i)[dev_idx]), want[i][0])
            assert torch.equal(_dev(pool.get_value_buffer(i)[dev_idx]), want[i][1])
        assert time.perf_counter() - t0 >= layers * delay * 0.9
        assert _wait_for(ctl.poll_loads) == [(17, True)]
        assert ctl.poll_loads() == []
        for i in range(layers):  # slots outside dev_idx untouched
            assert torch.equal(ints(pool.k_buffer[i])[others], before[i][others])
        s = ctl.transfer_stats.snapshot()["host_to_device"]
        assert s.bytes == n * _token_bytes(pool) == n * host.page_nbytes // P
        assert s.ops == 1 and s.failed_ops == 0
        assert s.seconds >= layers * delay * 0.9  # per-layer times summed
        assert ctl.transfer_stats.snapshot()["device_to_host"].ops == 0
    finally:
        ctl.close()


def test_loads_queued_together_land_in_one_batch(gen):
    pool, alloc, host = _rig(gen, "layer_first", layers=3)
    ctl = CacheController(alloc, host)
    try:
        parts = [(_slots(host.alloc, 2, m, gen), _slots(alloc.alloc, 2, m, gen)) for m in (5, 8)]
        for j, (h, d) in enumerate(parts):
            ctl.load(h, d, f"op{j}")
        slot = ctl.start_loading()
        assert ctl.start_loading() is None  # nothing queued any more
        assert ctl.layer_done_counter.consumer == slot
        for layer in range(3):
            for h, d in parts:
                assert torch.equal(_dev(pool.get_key_buffer(layer)[d]), _host_kv(host, layer, h)[0])
        assert _wait_for(ctl.poll_loads, 2) == [("op0", True), ("op1", True)]
        assert ctl.transfer_stats.snapshot()["host_to_device"].bytes == 13 * _token_bytes(pool)
    finally:
        ctl.close()


def test_load_of_a_failing_layer_is_reported_failed(gen, monkeypatch):
    pool, alloc, host = _rig(gen, layers=4)
    ctl = CacheController(alloc, host)
    real = host.load_to_device_per_layer

    def fail_layer_2(device_pool, h, d, layer_id, io_backend="kernel"):
        if layer_id == 2:
            raise OSError("layer 2 copy lost")
        real(device_pool, h, d, layer_id, io_backend)

    monkeypatch.setattr(host, "load_to_device_per_layer", fail_layer_2)
    try:
        h, d = _slots(host.alloc, 1, 3, gen), _slots(alloc.alloc, 1, 3, gen)
        ctl.load(h, d, "bad")
        ctl.start_loading()
        assert _wait_for(ctl.poll_loads) == [("bad", False)]
        s = ctl.transfer_stats.snapshot()["host_to_device"]
        assert (s.ops, s.failed_ops, s.bytes) == (1, 1, 0)
        assert torch.equal(_dev(pool.get_key_buffer(3)[d]), _host_kv(host, 3, h)[0])
    finally:
        ctl.close()


def test_load_argument_checks(gen):
    pool, alloc, host = _rig(gen, layers=2)
    ctl = CacheController(alloc, host)
    try:
        h, d = _slots(host.alloc, 2, 6, gen), _slots(alloc.alloc, 2, 6, gen)
        with pytest.raises(InvalidArgumentError, match="6 host slots for 5 device slots"):
            ctl.load(h, d[:5], 1)
        with pytest.raises(InvalidArgumentError, match="device_indices"):
            ctl.load(h, d.float(), 1)
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            ctl.load(h.tolist(), d, 1)
        assert ctl.start_loading() is None  # nothing was queued
    finally:
        ctl.close()


def test_busy_producer_slot_keeps_the_queued_load(gen, monkeypatch):
    """With every slot still loading, start_loading raises and the queued load stays queued;
    once the copies finish it is issued and lands."""
    pool, alloc, host = _rig(gen, layers=2)
    ctl = CacheController(alloc, host, layer_slots=2)
    real = host.load_to_device_per_layer
    gate = threading.Event()

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "load_to_device_per_layer", gated)
    try:
        batches = [(_slots(host.alloc, 1, 3, gen), _slots(alloc.alloc, 1, 3, gen)) for _ in "abc"]
        for j in range(2):
            ctl.load(*batches[j], j)
            assert ctl.start_loading() == j
        ctl.load(*batches[2], 2)
        with pytest.raises(StateError, match="still loading"):
            ctl.start_loading()
        gate.set()
        assert _wait_for(ctl.poll_loads, 2) == [(0, True), (1, True)]
        assert ctl.start_loading() == 0  # the third load was kept
        assert _wait_for(ctl.poll_loads) == [(2, True)]
        for layer in range(2):
            for h, d in batches:
                assert torch.equal(_dev(pool.get_key_buffer(layer)[d]), _host_kv(host, layer, h)[0])
    finally:
        gate.set()
        ctl.close()


# -- device -> host ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_write_backs_up_every_layer_exactly(gen, monkeypatch, layout):
    layers = 5
    pool, alloc, host = _rig(gen, layout, layers=layers, start_layer=2)
    n = 9
    dev_idx = _slots(alloc.alloc, 3, n, gen)
    host_idx = _slots(host.alloc, 3, n, gen)
    before = host_snapshot(host)
    others = torch.ones(host.size, dtype=torch.bool)
    others[host_idx] = False
    ctl = CacheController(alloc, host)
    real = host.backup_from_device_all_layer
    gate = threading.Event()

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        real(*args, **kwargs)

    monkeypatch.setattr(host, "backup_from_device_all_layer", gated)
    try:
        event = ctl.write(dev_idx, host_idx, "w1")
        t0 = time.perf_counter()
        assert ctl.poll_writes() == []  # in flight: poll answers at once
        assert time.perf_counter() - t0 < 0.5
        assert not event.query()
        gate.set()
        assert _wait_for(ctl.poll_writes) == [("w1", True)]
        assert event.query()
        for local, gid in enumerate(host.decl.layer_ids):
            k, v = _host_kv(host, local, host_idx)
            assert torch.equal(k, _dev(pool.get_key_buffer(gid)[dev_idx])), f"layer {gid} K"
            assert torch.equal(v, _dev(pool.get_value_buffer(gid)[dev_idx])), f"layer {gid} V"
        assert torch.equal(host_snapshot(host)[:, others], before[:, others])
        s = ctl.transfer_stats.snapshot()["device_to_host"]
        assert s.bytes == n * _token_bytes(pool) and s.ops == 1 and s.failed_ops == 0
        assert s.seconds > 0
    finally:
        gate.set()
        ctl.close()


def test_writes_are_acknowledged_in_order_and_failures_reported(gen):
    pool, alloc, host = _rig(gen, "layer_first", layers=3)
    ctl = CacheController(alloc, host)
    try:
        pairs = [(_slots(alloc.alloc, 1, m, gen), _slots(host.alloc, 1, m, gen)) for m in (3, 4)]
        ctl.write(*pairs[0], "a")
        bad = ctl.write(pairs[1][0], pairs[1][1][:2], "bad")  # 4 device slots, 2 host slots
        ctl.write(*pairs[1], "b")
        assert _wait_for(ctl.poll_writes, 3) == [("a", True), ("bad", False), ("b", True)]
        with pytest.raises(InvalidArgumentError):
            bad.synchronize()
        s = ctl.transfer_stats.snapshot()["device_to_host"]
        assert (s.ops, s.failed_ops, s.bytes) == (3, 1, 7 * _token_bytes(pool))
        for d, h in pairs:
            for layer in range(3):
                assert torch.equal(_host_kv(host, layer, h)[1], _dev(pool.v_buffer[layer][d]))
    finally:
        ctl.close()


# -- host <-> storage --------------------------------------------------------------------------
class FlakyStorage:
    """Wraps a store; ``batch_get`` / ``batch_set`` raise from call number ``fail_from`` on, or
    block on ``gate`` first when it is given."""

    def __init__(self, inner, *, fail_get_from=None, fail_set_from=None, gate=None) -> None:
        self.inner = inner
        self.fail_get_from, self.fail_set_from = fail_get_from, fail_set_from
        self.gate = gate
        self.gets = self.sets = 0

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, source, pages):
        self.gets += 1
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        if self.fail_get_from is not None and self.gets >= self.fail_get_from:
            raise OSError("store directory vanished (get)")
        return self.inner.batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        self.sets += 1
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        if self.fail_set_from is not None and self.sets >= self.fail_set_from:
            raise OSError("store directory vanished (set)")
        return self.inner.batch_set(keys, source, pages)


@pytest.fixture(params=["memory", "lmdb"])
def store_rig(request, gen, tmp_path):
    """(device pool, allocator, host pool, store) with random bits in both pools."""
    pool, alloc, host = _rig(gen, "page_first", layers=3, dtype=torch.float16)
    ns = StorageNamespace.for_host_pool(host)
    if request.param == "memory":
        store = MemoryStorage(ns, host.page_nbytes)
    else:
        budget = min_lmdb_budget(tmp_path, ns, host.page_nbytes) * 2
        store = LMDBStorage(tmp_path / "store", ns, host.page_nbytes, budget_bytes=budget)
    yield pool, alloc, host, store
    store.close()


def _keys(host, n_pages: int, gen) -> list[bytes]:
    tokens = torch.randint(0, 2**31, (n_pages * P,), generator=gen)
    keys = page_keys(StorageNamespace.for_host_pool(host), tokens, P)
    assert len(keys) == n_pages
    return keys


def _host_pages(host, n_pages: int, gen) -> tuple[list[int], torch.Tensor]:
    """``n_pages`` freshly allocated host pages in shuffled order, and their slots."""
    slots = host.alloc(n_pages * P)
    assert slots is not None
    pages = (slots[::P] // P)[torch.randperm(n_pages, generator=gen)]
    return pages.tolist(), (pages[:, None] * P + torch.arange(P)).reshape(-1)


def _page_bytes(host, pages: list[int]) -> list[torch.Tensor]:
    return [host.get_page_bytes(p).clone() for p in pages]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    """Per page, whether the bytes are equal."""
    return [torch.equal(x, y) for x, y in zip(a, b, strict=True)]


def _done(op: StorageOp) -> StorageOp:
    assert op.done.wait(TIMEOUT), "storage op did not finish"
    return op


def test_backup_then_prefetch_round_trips_pages(store_rig, gen):
    pool, alloc, host, store = store_rig
    n = 5
    ctl = CacheController(alloc, host, store, storage_batch_pages=2)
    try:
        keys = _keys(host, n, gen)
        src_pages, src_slots = _host_pages(host, n, gen)
        src = _page_bytes(host, src_pages)
        op = ctl.backup_to_storage(keys, src_slots, "b1")
        (done,) = _wait_for(ctl.poll_backups)
        assert done is op and op.done.is_set()
        assert (op.op_id, op.ok, op.pages_done, op.error) == ("b1", [True] * n, n, None)
        assert store.batch_exists(keys) == n
        assert ctl.poll_backups() == []

        dst_pages, dst_slots = _host_pages(host, n, gen)
        assert not any(_same(src, _page_bytes(host, dst_pages)))
        op = _done(ctl.prefetch(keys, dst_slots, "p1"))
        assert (op.op_id, op.pages_done, op.error) == ("p1", n, None)
        for i, (a, b) in enumerate(zip(src, _page_bytes(host, dst_pages), strict=True)):
            assert torch.equal(a, b), f"page {i} differs after prefetch"
        stats = ctl.transfer_stats.snapshot()
        assert stats["host_to_storage"].bytes == n * host.page_nbytes
        assert stats["host_to_storage"].ops == 3  # batches of 2, 2, 1
        assert stats["storage_to_host"].bytes == n * host.page_nbytes
        assert ctl.storage_errors == 0
    finally:
        ctl.close()


@pytest.mark.parametrize("missing", [0, 4, 6])
def test_prefetch_stops_at_the_first_missing_page(store_rig, gen, missing):
    pool, alloc, host, store = store_rig
    n = 7
    ctl = CacheController(alloc, host, store, storage_batch_pages=3)
    try:
        keys = _keys(host, n, gen)
        src_pages, src_slots = _host_pages(host, n, gen)
        src = _page_bytes(host, src_pages)
        _done(ctl.backup_to_storage(keys, src_slots, "b"))
        assert store.delete([keys[missing]]) == 1
        dst_pages, dst_slots = _host_pages(host, n, gen)
        dst_before = _page_bytes(host, dst_pages)
        op = _done(ctl.prefetch(keys, dst_slots, "p"))
        assert op.pages_done == missing and op.error is None
        got = _page_bytes(host, dst_pages)
        for i in range(missing):
            assert torch.equal(got[i], src[i]), f"page {i} not loaded"
        for i in range(missing, n):
            assert torch.equal(got[i], dst_before[i]), f"page {i} after the miss was touched"
        stats = ctl.transfer_stats.snapshot()["storage_to_host"]
        assert stats.bytes == missing * host.page_nbytes
    finally:
        ctl.close()


def test_storage_errors_become_failed_ops(store_rig, gen):
    pool, alloc, host, store = store_rig
    n = 5
    flaky = FlakyStorage(store, fail_set_from=2, fail_get_from=2)
    ctl = CacheController(alloc, host, flaky, storage_batch_pages=2)
    try:
        keys = _keys(host, n, gen)
        src_pages, src_slots = _host_pages(host, n, gen)
        src = _page_bytes(host, src_pages)
        op = ctl.backup_to_storage(keys, src_slots, "b")  # no exception here
        (done,) = _wait_for(ctl.poll_backups)
        assert done is op and op.done.is_set()
        assert op.error is not None and "vanished (set)" in op.error
        assert op.ok == [True, True] and op.pages_done == 2  # the first batch went through
        assert ctl.storage_errors == 1
        assert store.batch_exists(keys) == 2

        dst_pages, dst_slots = _host_pages(host, 2, gen)
        op = _done(ctl.prefetch(keys[:2], dst_slots, "p-ok"))  # one batch: no failure
        assert op.pages_done == 2 and op.error is None
        assert all(_same(src[:2], _page_bytes(host, dst_pages)))

        _done(ctl.backup_to_storage(keys[2:], src_slots[2 * P :], "b2"))  # set call 3: fails
        _store_directly(store, keys, host, src_pages)
        dst_pages, dst_slots = _host_pages(host, n, gen)
        op = _done(ctl.prefetch(keys, dst_slots, "p"))  # get call 2 (first batch): fails
        assert op.error is not None and "vanished (get)" in op.error
        assert op.pages_done == 0
        assert ctl.storage_errors == 3
        assert len(_wait_for(ctl.poll_backups)) == 1
    finally:
        ctl.close()


def _store_directly(store, keys, host, pages) -> None:
    assert all(store.batch_set(keys, host, pages))


def test_prefetch_error_after_a_good_batch_keeps_the_loaded_prefix(store_rig, gen):
    pool, alloc, host, store = store_rig
    n = 6
    flaky = FlakyStorage(store, fail_get_from=2)
    ctl = CacheController(alloc, host, flaky, storage_batch_pages=4)
    try:
        keys = _keys(host, n, gen)
        src_pages, _ = _host_pages(host, n, gen)
        src = _page_bytes(host, src_pages)
        _store_directly(store, keys, host, src_pages)
        dst_pages, dst_slots = _host_pages(host, n, gen)
        op = _done(ctl.prefetch(keys, dst_slots, "p"))
        assert op.error is not None and op.pages_done == 4
        got = _page_bytes(host, dst_pages)
        assert all(torch.equal(got[i], src[i]) for i in range(4))
        assert ctl.storage_errors == 1
    finally:
        ctl.close()


def test_cancel_before_the_op_runs(store_rig, gen):
    pool, alloc, host, store = store_rig
    gate = threading.Event()
    blocking = FlakyStorage(store, gate=gate)
    ctl = CacheController(alloc, host, blocking, storage_batch_pages=2)
    try:
        keys = _keys(host, 3, gen)
        src_pages, src_slots = _host_pages(host, 3, gen)
        _store_directly(store, keys[:1], host, src_pages[:1])
        other = _keys(host, 3, gen)
        _store_directly(store, other, host, src_pages)

        # Prefetch: the first op holds the worker; the second is cancelled while queued.
        first_pages, first_slots = _host_pages(host, 1, gen)
        first = ctl.prefetch(keys[:1], first_slots, "first")
        dst_pages, dst_slots = _host_pages(host, 3, gen)
        dst_before = _page_bytes(host, dst_pages)
        queued = ctl.prefetch(other, dst_slots, "queued")
        queued.cancel()
        # Backup: the same, on its own worker.
        held = ctl.backup_to_storage(keys[1:2], src_slots[P : 2 * P], "held")
        cancelled = ctl.backup_to_storage(keys[2:], src_slots[2 * P :], "cancelled")
        cancelled.cancel()
        gate.set()
        assert _done(first).pages_done == 1
        assert _done(queued).pages_done == 0 and queued.error is None
        assert all(_same(dst_before, _page_bytes(host, dst_pages)))
        backups = _wait_for(ctl.poll_backups, 2)
        assert backups == [held, cancelled]
        assert held.ok == [True] and held.pages_done == 1
        assert cancelled.ok == [] and cancelled.pages_done == 0 and cancelled.error is None
        assert store.batch_exists(keys[2:]) == 0
    finally:
        gate.set()
        ctl.close()


def test_storage_argument_checks(gen):
    pool, alloc, host = _rig(gen, layers=2)
    ns = StorageNamespace.for_host_pool(host)
    plain = CacheController(alloc, host)
    try:
        keys = _keys(host, 2, gen)
        _, slots = _host_pages(host, 2, gen)
        with pytest.raises(StateError, match="no storage"):
            plain.backup_to_storage(keys, slots, 1)
        with pytest.raises(StateError, match="no storage"):
            plain.prefetch(keys, slots, 1)
    finally:
        plain.close()
    store = MemoryStorage(ns, host.page_nbytes)
    ctl = CacheController(alloc, host, store)
    try:
        for call in (ctl.backup_to_storage, ctl.prefetch):
            with pytest.raises(InvalidArgumentError, match=f"2 page keys need {2 * P} host slots"):
                call(keys, slots[:-1], 1)
            with pytest.raises(InvalidArgumentError, match=f"need {3 * P} host slots"):
                call([*keys, keys[0]], slots, 1)
            with pytest.raises(InvalidArgumentError, match="whole host pages"):
                call(keys, slots + 1, 1)  # slot runs that straddle pages
            with pytest.raises(InvalidArgumentError, match="whole host pages"):
                call(keys, slots.flip(0), 1)  # slots of a page out of order
        assert ctl.poll_backups() == []
        assert store.stats().sets == 0 and store.stats().gets == 0
        with pytest.raises(InvalidArgumentError):
            CacheController(alloc, make_host(*make_pool("mha", P, layer_num=2)))
    finally:
        ctl.close()


# -- lifecycle -----------------------------------------------------------------------------------
def test_close_finishes_work_joins_threads_and_refuses_calls(gen):
    pool, alloc, host = _rig(gen, layers=3)
    store = MemoryStorage(StorageNamespace.for_host_pool(host), host.page_nbytes)
    ctl = CacheController(alloc, host, store)
    assert pool.layer_transfer_counter is ctl.layer_done_counter
    keys = _keys(host, 2, gen)
    _, slots = _host_pages(host, 2, gen)
    d = _slots(alloc.alloc, 1, 4, gen)
    op = ctl.backup_to_storage(keys, slots, "b")
    ctl.write(d, slots[:4], "w")
    ctl.load(slots[4:], d, "queued-at-close")
    ctl.close()
    assert op.done.is_set() and op.error is None and store.batch_exists(keys) == 2
    assert all(not t.is_alive() for t in ctl._threads) and len(ctl._threads) == 2
    assert not ctl.write_stream._thread.is_alive() and not ctl.load_stream._thread.is_alive()
    assert pool.layer_transfer_counter is None
    assert ctl.poll_writes() == [("w", True)]  # finished work can still be acknowledged
    assert ctl.poll_backups() == [op]
    for call in (
        lambda: ctl.write(d, slots[:4], 1),
        lambda: ctl.load(slots[:4], d, 1),
        ctl.start_loading,
        lambda: ctl.backup_to_storage(keys, slots, 1),
        lambda: ctl.prefetch(keys, slots, 1),
    ):
        with pytest.raises(StateError, match="closed"):
            call()
    ctl.close()  # idempotent


def test_close_leaves_a_newer_controllers_counter_registered(gen):
    pool, alloc, host = _rig(gen, layers=2)
    old = CacheController(alloc, host)
    new = CacheController(alloc, host)
    assert pool.layer_transfer_counter is new.layer_done_counter
    old.close()
    assert pool.layer_transfer_counter is new.layer_done_counter
    new.close()
    assert pool.layer_transfer_counter is None

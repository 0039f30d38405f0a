"""The native copy engine: row jobs copied bit for bit in every layout and pool kind, in order,
per-layer completion, refused layers failing alone, close draining the queue, and the device
<-> host worker using it only where the host pool's own copy code would run."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from tests.host._util import (
    assert_device_equal,
    assert_host_equal,
    device_snapshot,
    expected_device_after_load,
    expected_host_after_backup,
    fill_bits,
    fill_device,
    host_snapshot,
    make_host,
    make_pool,
)
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.kernels import copy_engine
from tiered_kv.kernels.copy_engine import CopyEngine, RowShape, run_rows
from tiered_kv.transfer import DeviceHostTransfer, TransferJob

pytestmark = pytest.mark.skipif(not copy_engine.available(), reason="no C compiler here")

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]
KINDS = ["mha", "mha_v", "mla", "konly"]


def _rig(gen, kind, layout, page_size, dtype=torch.bfloat16, pages=9, host_pages=11):
    pool, alloc = make_pool(kind, page_size, dtype, pages=pages)
    host = make_host(pool, alloc, layout, host_pages=host_pages, kernel_backend="native")
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return pool, alloc, host


def _pairs(gen, alloc, host, n):
    """``n`` device slots and ``n`` host slots, each distinct, in random order."""
    dev = alloc.alloc(alloc.available_size() // alloc.page_size * alloc.page_size)
    hst = host.alloc(host.available_size())
    d = dev[torch.randperm(len(dev), generator=gen)[:n]]
    h = hst[torch.randperm(len(hst), generator=gen)[:n]]
    return h, d


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_jobs_copy_exact_bits_both_ways(gen, kind, layout):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    page_size = rng.choice([1, 4, 16])
    pool, alloc, host = _rig(gen, kind, layout, page_size)
    engine = CopyEngine("test", spin_us=rng.choice([0.0, 50.0]))
    try:
        n = rng.randint(1, min(alloc.available_size(), host.available_size()))
        h, d = _pairs(gen, alloc, host, n)
        host0, dev0 = host_snapshot(host), device_snapshot(pool)
        (event,) = engine.submit(host.row_job(pool, h, d, to_host=True))
        event.synchronize()
        assert event.query() and event.seconds() >= 0.0
        assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, h, d))

        fill_bits(host.buffer, gen)  # fresh bytes to load back, to other device slots
        host1, dev1 = host_snapshot(host), device_snapshot(pool)
        d2 = d[torch.randperm(n, generator=gen)]
        events = engine.submit(host.row_job(pool, h, d2, to_host=False))
        assert len(events) == pool.layer_num
        for e in reversed(events):  # any order of waiting
            e.synchronize()
        want = expected_device_after_load(dev1, _as_device(pool, host1), h, d2)
        assert_device_equal(pool, want)
        assert_host_equal(host, host1)  # a load leaves the host untouched
    finally:
        engine.close()


def _as_device(pool, host_canonical):
    """The canonical host records split into per-part (L, T, elems) like a device snapshot."""
    from tests.host._util import part_columns

    return {name: host_canonical[:, :, a:b] for name, (a, b) in part_columns(pool).items()}


def test_run_rows_on_the_calling_thread_matches_the_engine(gen):
    pool, alloc, host = _rig(gen, "mha_v", "page_first", 4)
    h, d = _pairs(gen, alloc, host, 23)
    host0, dev0 = host_snapshot(host), device_snapshot(pool)
    run_rows(host.row_job(pool, h, d, to_host=True))
    assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, h, d))
    bad = dataclasses.replace(host.row_job(pool, h, d, to_host=True), threads=0)
    with pytest.raises(TransferError, match="refused"):
        run_rows(bad)
    assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, h, d))  # unchanged


def test_a_refused_layer_fails_alone_and_later_jobs_run(gen):
    pool, alloc, host = _rig(gen, "mha", "layer_first", 4)
    engine = CopyEngine("test")
    try:
        h, d = _pairs(gen, alloc, host, 17)
        job = host.row_job(pool, h, d, to_host=False)
        bad = random.Random(int(torch.randint(0, 99, (1,), generator=gen))).randrange(
            pool.layer_num
        )
        order = list(range(pool.layer_num))
        order[bad] = pool.layer_num + 5  # a layer the engine must refuse
        poisoned = dataclasses.replace(job, shape=job.shape.with_layers(order))
        dev0 = device_snapshot(pool)
        events = engine.submit(poisoned)
        for i, e in enumerate(events):
            if i == bad:
                with pytest.raises(TransferError, match=f"local layer {bad}"):
                    e.synchronize()
            else:
                e.synchronize()
        host_c = _as_device(pool, host_snapshot(host))
        want = expected_device_after_load(
            dev0, host_c, h, d, layers=[i for i in range(pool.layer_num) if i != bad]
        )
        assert_device_equal(pool, want)
        # Whole jobs refuse every layer at once; the queue goes on.
        (whole,) = engine.submit(dataclasses.replace(host.row_job(pool, h, d, True), threads=0))
        ok = engine.submit(host.row_job(pool, h, d, to_host=False))
        with pytest.raises(TransferError, match="refused job"):
            whole.synchronize()
        for e in ok:
            e.synchronize()
    finally:
        engine.close()


def test_close_runs_every_queued_job_then_refuses(gen):
    pool, alloc, host = _rig(gen, "mla", "page_first", 1, pages=200, host_pages=200)
    engine = CopyEngine("test", spin_us=0.0)
    h, d = _pairs(gen, alloc, host, 150)
    jobs = [host.row_job(pool, h[i::5], d[i::5], to_host=False) for i in range(5)]
    dev0 = device_snapshot(pool)
    events = [e for j in jobs for e in engine.submit(j)]
    engine.close()
    assert all(e.query() for e in events)
    for e in events:
        e.synchronize()
    assert_device_equal(
        pool, expected_device_after_load(dev0, _as_device(pool, host_snapshot(host)), h, d)
    )
    with pytest.raises(StateError, match="closed"):
        engine.submit(jobs[0])
    engine.close()  # twice is fine


def test_row_job_validates_like_the_copy_methods(gen):
    pool, alloc, host = _rig(gen, "mha", "page_first", 4)
    h, d = _pairs(gen, alloc, host, 8)
    before = host_snapshot(host)
    bad = h.clone()
    bad[3] = host.size + 1
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        host.row_job(pool, bad, d, to_host=True)
    rep = h.clone()
    rep[5] = rep[1]
    with pytest.raises(InvalidArgumentError, match="repeat"):
        host.row_job(pool, rep, d, to_host=True)
    with pytest.raises(InvalidArgumentError, match="io_backend"):
        host.row_job(pool, h, d, to_host=True, io_backend="dma")
    assert host.row_job(pool, h, d, to_host=True, io_backend="direct") is None
    torch_host = make_host(pool, alloc, "page_first", host_pages=4, kernel_backend="torch")
    assert torch_host.row_job(pool, h[:2] % 16, d[:2], to_host=True) is None
    assert_host_equal(host, before)


def test_worker_uses_the_engine_unless_a_copy_method_is_overridden(gen, monkeypatch):
    pool, alloc, host = _rig(gen, "mha", "page_first", 4)
    h, d = _pairs(gen, alloc, host, 12)
    used = []
    real_submit = CopyEngine.submit

    def counted(self, job):
        if self.name != "sync":  # the worker's engines, not the one synchronous copies use
            used.append(job.to_host)
        return real_submit(self, job)

    monkeypatch.setattr(CopyEngine, "submit", counted)
    ctl = DeviceHostTransfer(alloc, host)
    try:
        assert ctl.submit(TransferJob.write(1, d, h))
        assert ctl.submit(TransferJob.load(2, h, d))
        ctl.wait()
        assert [(r.job_id, r.ok) for r in ctl.poll()] == [(1, True), (2, True)]
        assert used == [True, False]
        calls = []
        real = host.load_to_device_per_layer

        def spy(*a, **k):
            calls.append(a[3])
            return real(*a, **k)

        monkeypatch.setattr(host, "load_to_device_per_layer", spy)  # an override: no engine
        assert ctl.submit(TransferJob.load(3, h, d))
        ctl.wait()
        assert [(r.job_id, r.ok) for r in ctl.poll()] == [(3, True)]
        assert used == [True, False] and calls == list(pool.host_pool_decls()[0].layer_ids)
    finally:
        ctl.close()


def test_a_failed_engine_load_is_a_failed_result_and_its_readers_hit_the_error(gen, monkeypatch):
    pool, alloc, host = _rig(gen, "mha", "page_first", 4)
    h, d = _pairs(gen, alloc, host, 12)
    real = host.row_job
    monkeypatch.setattr(
        host, "row_job", lambda *a, **k: dataclasses.replace(real(*a, **k), threads=0)
    )
    ctl = DeviceHostTransfer(alloc, host)
    try:
        stale = device_snapshot(pool)
        assert ctl.submit(TransferJob.load(7, h, d))
        ctl.wait([7])
        with pytest.raises(TransferError, match="refused"):
            pool.get_key_buffer(pool.host_pool_decls()[0].layer_ids[0])
        (r,) = ctl.poll()
        assert (r.job_id, r.ok, r.nbytes) == (7, False, 0)
        assert_device_equal(pool, stale)  # nothing was copied
    finally:
        ctl.close()


def test_many_small_jobs_back_to_back_land_in_order(gen):
    """Writes of the same host slots from changing device rows: the last one wins, every
    intermediate event is set, and the timing entries are filled."""
    pool, alloc, host = _rig(gen, "mha", "page_first", 1, pages=64, host_pages=64)
    engine = CopyEngine("test")
    try:
        h, d = _pairs(gen, alloc, host, 40)
        host0, dev0 = host_snapshot(host), device_snapshot(pool)
        events = []
        for _ in range(60):
            rows = d[torch.randperm(40, generator=gen)[:8]]
            events += engine.submit(host.row_job(pool, h[:8], rows, to_host=True))
        last_rows = rows
        for e in events:
            e.synchronize()
        assert all(e.seconds() >= 0.0 for e in events)
        assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, h[:8], last_rows))
    finally:
        engine.close()


def test_row_shape_copies_every_layer_unless_told_which():
    shape = RowShape(np.zeros((3, 2), dtype=np.int64), [8, 8], [0, 8], 1 << 20, 16)
    assert shape.layers.tolist() == [0, 1, 2]
    assert shape.with_layers([2, 0]).layers.tolist() == [2, 0]


def test_run_copies_on_the_calling_thread_with_helpers_and_refuses_bad_jobs(gen):
    pool, alloc, host = _rig(gen, "mha_v", "page_first", 1, pages=300, host_pages=300)
    engine = CopyEngine("test", spin_us=0.0)
    try:
        h, d = _pairs(gen, alloc, host, 250)  # 16 tokens per unit: units for three threads
        dev0 = device_snapshot(pool)
        job = host.row_job(pool, h, d, to_host=False)
        engine.run(dataclasses.replace(job, whole=True, threads=3))
        want = expected_device_after_load(dev0, _as_device(pool, host_snapshot(host)), h, d)
        assert_device_equal(pool, want)
        fill_bits(host.buffer, gen)
        host0, dev1 = host_snapshot(host), device_snapshot(pool)
        engine.run(dataclasses.replace(host.row_job(pool, h, d, to_host=True), threads=2))
        assert_host_equal(host, expected_host_after_backup(pool, host0, dev1, h, d))
        with pytest.raises(TransferError, match="refused"):
            engine.run(dataclasses.replace(job, whole=True, threads=0))
        order = list(range(pool.layer_num))
        order[-1] = -1
        with pytest.raises(TransferError, match="refused"):
            engine.run(dataclasses.replace(job, shape=job.shape.with_layers(order)))
    finally:
        engine.close()
    with pytest.raises(StateError, match="closed"):
        engine.run(job)


def test_an_engine_dropped_with_jobs_queued_finishes_them_before_its_memory_goes(gen):
    """Nobody keeps the events or the engine: the jobs (and the tensors they point into) stay
    alive until copied, and the bytes land; the engine's thread is stopped when collected."""
    import gc

    pool, alloc, host = _rig(gen, "mha", "page_first", 1, pages=400, host_pages=400)
    h, d = _pairs(gen, alloc, host, 300)
    dev0 = device_snapshot(pool)
    want = expected_device_after_load(dev0, _as_device(pool, host_snapshot(host)), h, d)
    engine = CopyEngine("dropped", spin_us=0.0)
    for i in range(30):
        # fresh index tensors, dropped at once: only the engine keeps them alive
        engine.submit(host.row_job(pool, h[i::30].clone(), d[i::30].clone(), to_host=False))
    del engine
    gc.collect()
    assert_device_equal(pool, want)

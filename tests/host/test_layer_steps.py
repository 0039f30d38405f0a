"""A layer-wise load's later layers run as one native step each (``host.layer_steps``), with the
same bytes, the same refusals and the same one-layer-per-call effect as the full path."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tiered_kv import InvalidArgumentError, StateError
from tiered_kv.host.layer_steps import LayerSteps
from tiered_kv.kernels import copy_engine
from tiered_kv.kernels.row_job import HELPERS_MIN_BYTES, RowJob

from ._util import (
    KINDS,
    device_snapshot,
    expected_device_after_load,
    fill_device,
    make_host,
    make_pool,
    random_host_pages,
    shuffle_free_pages,
)

pytestmark = pytest.mark.skipif(not copy_engine.available(), reason="no native copy engine")


def _loaded(gen, kind, layout, page, n_pages, dtype=torch.float16):
    """A pool with random bytes, a native host pool holding ``n_pages`` of them, and the
    slots to load them back into."""
    pool, alloc = make_pool(kind, page, dtype, pages=3 * n_pages + 2, layer_num=7, start_layer=3)
    fill_device(pool, gen)
    shuffle_free_pages(alloc, gen)
    host = make_host(pool, alloc, layout, host_pages=n_pages + 3, kernel_backend="native")
    src = alloc.alloc(n_pages * page)
    h = random_host_pages(host, n_pages, gen)
    host.backup_from_device_all_layer(pool, h, src)
    dst = alloc.alloc(n_pages * page)
    return pool, host, src, h, dst


def _steps(host) -> LayerSteps | None:
    return host._transfers._steps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [1, 5, 16])
def test_each_call_copies_exactly_its_layer(gen, kind, layout, page):
    n_pages = int(torch.randint(1, 5, (1,), generator=gen))
    pool, host, src, h, dst = _loaded(gen, kind, layout, page, n_pages)
    layer_ids = pool.host_pool_decls()[0].layer_ids
    order = torch.randperm(len(layer_ids), generator=gen).tolist()  # any order, not only 0..L-1
    done: list[int] = []
    for i, k in enumerate(order):
        before = device_snapshot(pool)
        host.load_to_device_per_layer(pool, h, dst, layer_ids[k])
        if i == 0:
            assert _steps(host) is not None  # built by the first call, used by the others
        done.append(k)
        # this layer's destination slots now hold the source's, nothing else changed
        want = expected_device_after_load(before, before, src, dst, layers=[k])
        got = device_snapshot(pool)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, k)


def test_steps_are_taken_not_the_full_path(gen, monkeypatch):
    pool, host, src, h, dst = _loaded(gen, "mha", "page_first", 16, 2)
    layer_ids = pool.host_pool_decls()[0].layer_ids
    host.load_to_device_per_layer(pool, h, dst, layer_ids[0])
    calls = []
    cls = type(host._transfers)
    for name in ("_prepare", "_engine_job", "_check_pool"):  # the full path's steps
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    monkeypatch.setattr("tiered_kv.host.engine_jobs.EngineJobs.run", lambda *a: calls.append("run"))
    for lid in layer_ids[1:]:
        host.load_to_device_per_layer(pool, h, dst, lid)
    assert calls == []  # every later layer was one step
    host.load_to_device_per_layer(pool, h.clone(), dst, layer_ids[0])  # other tensors
    assert calls == ["_check_pool", "_engine_job", "run"]  # the full path, noticed
    want = expected_device_after_load(device_snapshot(pool), device_snapshot(pool), src, dst)
    assert all(torch.equal(device_snapshot(pool)[n], want[n]) for n in want)


def test_refusals_are_the_full_paths(gen):
    pool, host, src, h, dst = _loaded(gen, "mha", "page_first", 4, 3)
    layer_ids = pool.host_pool_decls()[0].layer_ids
    host.load_to_device_per_layer(pool, h, dst, layer_ids[0])
    assert _steps(host) is not None
    before = device_snapshot(pool)
    # True == 1 as a dict key; it is not a layer id
    for bad in (True, layer_ids[-1] + 1, layer_ids[0] - 1, float(layer_ids[1]), None):
        with pytest.raises(InvalidArgumentError, match="layer_id"):
            host.load_to_device_per_layer(pool, h, dst, bad)
    with pytest.raises(InvalidArgumentError):
        host.load_to_device_per_layer(pool, h, dst, layer_ids[1], "bogus")
    other_pool, _ = make_pool("mha", 4, torch.float16, pages=11, layer_num=7, start_layer=3)
    with pytest.raises(InvalidArgumentError, match="device_pool"):
        host.load_to_device_per_layer(other_pool, h, dst, layer_ids[1])
    # a retargeted index tensor is validated again, not copied from the old plan
    h[1] = host.size + 7
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        host.load_to_device_per_layer(pool, h, dst, layer_ids[1])
    for name, t in device_snapshot(pool).items():
        assert torch.equal(t, before[name])  # nothing was copied by any refused call
    host.destroy()
    with pytest.raises(StateError):
        host.load_to_device_per_layer(pool, h, dst, layer_ids[2])


def test_forget_and_new_indices_drop_the_steps(gen):
    pool, host, src, h, dst = _loaded(gen, "mla", "layer_first", 8, 2)
    layer_ids = pool.host_pool_decls()[0].layer_ids
    host.load_to_device_per_layer(pool, h, dst, layer_ids[0])
    first = _steps(host)
    host._transfers.forget()
    assert _steps(host) is None
    dst2 = dst.flip(0)  # new tensor: the same slots, reversed
    before = device_snapshot(pool)
    host.load_to_device_per_layer(pool, h, dst2, layer_ids[2])
    assert _steps(host) is not None and _steps(host) is not first
    want = expected_device_after_load(before, before, src, dst2, layers=[2])
    got = device_snapshot(pool)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_large_layers_stay_on_the_engine_path(gen):
    # 64 tokens x 3 heads x 10 dims x 2 parts x 4 bytes = 15 KiB a layer: stepped; a 1 MiB
    # layer is not (the engine's helpers pay for themselves there)
    pool, host, src, h, dst = _loaded(gen, "mha", "page_first", 16, 4, torch.float32)
    host.load_to_device_per_layer(pool, h, dst, pool.host_pool_decls()[0].layer_ids[0])
    job = host._transfers._last_job[3]
    assert LayerSteps.applies(job) and _steps(host) is not None
    rows = HELPERS_MIN_BYTES // job.shape.token_bytes + 1
    zeros = torch.zeros(rows, dtype=torch.int64)
    assert not LayerSteps.applies(RowJob(job.shape, zeros, zeros, to_host=False, whole=False))
    assert not LayerSteps.applies(
        RowJob(job.shape, zeros[:2], zeros[:2], to_host=True, whole=False)
    )


def test_the_native_step_refuses_a_step_out_of_range(gen):
    pool, host, src, h, dst = _loaded(gen, "mha", "page_first", 4, 2)
    host.load_to_device_per_layer(pool, h, dst, pool.host_pool_decls()[0].layer_ids[0])
    steps = _steps(host)
    before = device_snapshot(pool)
    n = len(steps.local)
    for k in (-1, n, n + 100):
        assert steps._copy(steps._ref, k) == -1
    bad = RowJob(
        steps._job.shape.with_layers([0, 99]),
        steps._job.dev_rows,
        steps._job.host_tok,
        to_host=False,
        whole=False,
    )
    assert steps._copy(ctypes.byref(bad.struct(None)), 1) == -1  # layer 99 is not held
    for name, t in device_snapshot(pool).items():
        assert torch.equal(t, before[name])

"""Device -> host -> device round trips are bit-exact and touch exactly the named slots.

Every byte of the device pool (padding page included) and of the host buffer starts as random
bits, so NaN payloads are present and a stray write anywhere shows up. Expected contents come
from an independent oracle (``_util``): the host buffer is read through the documented layout
shapes, never through tiered_kv's layout code.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.host._util import (
    DTYPE_IDS,
    DTYPES,
    KINDS,
    LAYOUTS,
    assert_device_equal,
    assert_host_equal,
    device_parts,
    device_snapshot,
    expected_device_after_load,
    expected_host_after_backup,
    fill_bits,
    fill_device,
    host_snapshot,
    ints,
    make_host,
    make_pool,
    page_slots,
    part_columns,
    random_host_pages,
    shuffle_free_pages,
)
from tiered_kv.platform import KernelBackend

PAGE_SIZES = (1, 16, 64)
# (io_backend, kernel_backend): the kernel path on each CPU kernel backend, and "direct".
IO = (("kernel", "native"), ("kernel", "torch"), ("direct", "torch"))
IO_IDS = ("kernel-native", "kernel-torch", "direct")
ALL_IO = (*IO, ("kernel", "triton"))


def _pages_moved(page_size: int) -> int:
    """Pages per transfer: at least 3, and at least ~24 tokens."""
    return max(3, 24 // page_size)


def _restore_device(pool, snap: dict[str, torch.Tensor]) -> None:
    for name, bufs in device_parts(pool):
        for layer, b in enumerate(bufs):
            ints(b).view(b.shape[0], -1).copy_(snap[name][layer])


def _round_trip(kind, layout, page_size, dtype, io, kb, gen, *, pages=None, layer_num=5, **kw):
    k = _pages_moved(page_size) if pages is None else pages
    pool, alloc = make_pool(kind, page_size, dtype, pages=3 * k + 2, layer_num=layer_num, **kw)
    host = make_host(pool, alloc, layout, host_pages=k + 4, kernel_backend=kb)
    assert host.kernel_backend is KernelBackend(kb)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    shuffle_free_pages(alloc, gen)
    n = k * page_size
    src, dst, dst2 = alloc.alloc(n), alloc.alloc(n), alloc.alloc(n)
    assert int(torch.cat([src, dst, dst2]).min()) >= page_size
    assert torch.cat([src, dst, dst2]).unique().numel() == 3 * n
    host_idx = random_host_pages(host, k, gen)

    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    host.backup_from_device_all_layer(pool, host_idx, src, io_backend=io)
    assert_device_equal(pool, dev0)  # a backup only reads the device
    assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, host_idx, src))
    host1 = host_snapshot(host)

    # Per layer, in a random order: after each, exactly that layer's dst slots changed.
    expected = dev0
    layer_ids = list(range(pool.start_layer, pool.end_layer + 1))
    for j in torch.randperm(len(layer_ids), generator=gen).tolist():
        host.load_to_device_per_layer(pool, host_idx, dst, layer_ids[j], io_backend=io)
        expected = expected_device_after_load(expected, dev0, src, dst, layers=[j])
        assert_device_equal(pool, expected)
    assert_host_equal(host, host1)  # a load only reads the host

    host.load_to_device_all_layer(pool, host_idx, dst2, io_backend=io)
    expected = expected_device_after_load(expected, dev0, src, dst2)
    assert_device_equal(pool, expected)
    assert_host_equal(host, host1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), IO, ids=IO_IDS)
def test_round_trip_bit_exact(io, kb, layout, kind, page_size, dtype, gen):
    _round_trip(kind, layout, page_size, dtype, io, kb, gen)


def _triton_cases():
    # One dtype per case, rotated so that every dtype meets every page size and pool kind.
    cases = []
    for i, (layout, kind, page_size) in enumerate(itertools.product(LAYOUTS, KINDS, (1, 16))):
        dtype = DTYPES[(i + i // 8) % len(DTYPES)]
        cases.append(
            pytest.param(
                layout, kind, page_size, dtype, id=f"{layout}-{kind}-{page_size}-{DTYPE_IDS[dtype]}"
            )
        )
    return cases


@pytest.mark.parametrize(("layout", "kind", "page_size", "dtype"), _triton_cases())
def test_round_trip_triton_interpreted(layout, kind, page_size, dtype, gen):
    _round_trip(
        kind,
        layout,
        page_size,
        dtype,
        "kernel",
        "triton",
        gen,
        pages=2 if page_size > 1 else 5,
        layer_num=2,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), IO, ids=IO_IDS)
def test_round_trip_with_start_layer(io, kb, layout, gen):
    """A pipeline stage holding global layers 3..6: per-layer loads take global ids."""
    _round_trip("mha_v", layout, 16, torch.bfloat16, io, kb, gen, layer_num=4, start_layer=3)


@pytest.mark.parametrize("page_size", (1, 16))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_backend_writes_identical_bytes(layout, kind, page_size, gen):
    """The same transfer through kernel (torch, native, triton) and direct: identical host
    buffers after the backup, identical device pools after the loads."""
    dtype = (torch.float16, torch.float8_e4m3fn, torch.float32)[LAYOUTS.index(layout)]
    k = 2 if page_size > 1 else 6
    pool, alloc = make_pool(kind, page_size, dtype, pages=3 * k + 1, layer_num=2)
    fill_device(pool, gen)
    shuffle_free_pages(alloc, gen)
    src, dst = alloc.alloc(k * page_size), alloc.alloc(k * page_size)
    hosts = [
        make_host(pool, alloc, layout, host_pages=k + 3, kernel_backend=kb) for _, kb in ALL_IO
    ]
    fill_bits(hosts[0].buffer, gen)
    for h in hosts[1:]:
        h.buffer.copy_(hosts[0].buffer)
    host_idx = random_host_pages(hosts[0], k, gen)
    dev0, host0 = device_snapshot(pool), host_snapshot(hosts[0])

    for h, (io, _) in zip(hosts, ALL_IO, strict=True):
        h.backup_from_device_all_layer(pool, host_idx, src, io_backend=io)
    raw = [ints(h.buffer).reshape(-1) for h in hosts]
    for (io, kb), r in zip(ALL_IO[1:], raw[1:], strict=True):
        assert torch.equal(r, raw[0]), f"{io}/{kb} host bytes differ from kernel/native"
    assert_host_equal(hosts[0], expected_host_after_backup(pool, host0, dev0, host_idx, src))

    results = []
    for h, (io, _) in zip(hosts, ALL_IO, strict=True):
        _restore_device(pool, dev0)
        h.load_to_device_per_layer(pool, host_idx, dst, pool.end_layer, io_backend=io)
        h.load_to_device_all_layer(pool, host_idx[:page_size], dst[:page_size], io_backend=io)
        results.append(device_snapshot(pool))
    for (io, kb), res in zip(ALL_IO[1:], results[1:], strict=True):
        for name in res:
            assert torch.equal(res[name], results[0][name]), f"{io}/{kb} device part {name}"
    _restore_device(pool, dev0)
    expected = expected_device_after_load(dev0, dev0, src, dst, layers=[1])
    expected = expected_device_after_load(expected, dev0, src[:page_size], dst[:page_size])
    for name in expected:
        assert torch.equal(results[0][name], expected[name])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), ALL_IO, ids=(*IO_IDS, "kernel-triton"))
def test_per_layer_load_touches_only_that_layer(io, kb, layout, gen):
    pool, alloc = make_pool("mha_v", 4, torch.float16, pages=8, layer_num=4)
    host = make_host(pool, alloc, layout, host_pages=5, kernel_backend=kb)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)  # host slots hold data of their own: nothing backed up
    shuffle_free_pages(alloc, gen)
    dst = alloc.alloc(8)
    host_idx = random_host_pages(host, 2, gen)
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    layer = int(torch.randint(0, 4, (1,), generator=gen))
    host.load_to_device_per_layer(pool, host_idx, dst, layer, io_backend=io)
    expected = {k: v.clone() for k, v in dev0.items()}
    for name, (a, b) in part_columns(pool).items():
        expected[name][layer, dst] = host0[layer, host_idx, a:b]
    assert_device_equal(pool, expected)
    assert_host_equal(host, host0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), ALL_IO, ids=(*IO_IDS, "kernel-triton"))
@pytest.mark.parametrize("index_dtype", (torch.int64, torch.int32))
def test_empty_transfer_changes_nothing(index_dtype, io, kb, layout, gen):
    pool, alloc = make_pool("mla", 16, torch.bfloat16, pages=4, layer_num=3)
    host = make_host(pool, alloc, layout, host_pages=3, kernel_backend=kb)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    empty = torch.empty(0, dtype=index_dtype)
    host.backup_from_device_all_layer(pool, empty, empty.clone(), io_backend=io)
    host.load_to_device_per_layer(pool, empty, empty.clone(), 1, io_backend=io)
    host.load_to_device_all_layer(pool, empty, empty.clone(), io_backend=io)
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), ALL_IO, ids=(*IO_IDS, "kernel-triton"))
def test_page_size_one_fully_scattered(io, kb, layout, gen):
    """Single slots in random, non-monotone order on both sides, int32 indices."""
    n = 9 if kb == "triton" else 40
    pool, alloc = make_pool("mha_v", 1, torch.float32, pages=3 * n, layer_num=3)
    host = make_host(pool, alloc, layout, host_pages=2 * n + 3, kernel_backend=kb)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    all_dev = torch.arange(1, 3 * n + 1)[torch.randperm(3 * n, generator=gen)]
    src, dst = all_dev[:n].to(torch.int32), all_dev[n : 2 * n].to(torch.int32)
    host_idx = torch.randperm(host.size, generator=gen)[:n].to(torch.int32)
    assert (host_idx[1:] > host_idx[:-1]).any() and (host_idx[1:] < host_idx[:-1]).any()
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    host.backup_from_device_all_layer(pool, host_idx, src, io_backend=io)
    h64, s64, d64 = host_idx.long(), src.long(), dst.long()
    assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, h64, s64))
    host.load_to_device_per_layer(pool, host_idx, dst, 2, io_backend=io)
    host.load_to_device_per_layer(pool, host_idx, dst, 0, io_backend=io)
    host.load_to_device_per_layer(pool, host_idx, dst, 1, io_backend=io)
    assert_device_equal(pool, expected_device_after_load(dev0, dev0, s64, d64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("io", "kb"), IO, ids=IO_IDS)
def test_long_consecutive_runs_across_pages(io, kb, layout, gen):
    """Consecutive device pages to consecutive host pages (from the host allocator): the direct
    backend merges runs that cross page boundaries, and must split them where the layout does."""
    pool, alloc = make_pool("mha", 16, torch.float16, pages=12, layer_num=3)
    host = make_host(pool, alloc, layout, host_pages=9, kernel_backend=kb)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    host.alloc(16 * 2)  # the run starts at host page 2
    host_idx = host.alloc(16 * 5)
    assert torch.equal(host_idx, torch.arange(32, 112))
    src = alloc.alloc(16 * 5)
    dst = alloc.alloc(16 * 5)
    assert torch.equal(src, torch.arange(16, 96)) and torch.equal(dst, torch.arange(96, 176))
    # Break the runs in a few places: one page out of order on each side.
    host_idx = torch.cat([host_idx[48:64], host_idx[:48], host_idx[64:]])
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    host.backup_from_device_all_layer(pool, host_idx, src, io_backend=io)
    assert_host_equal(host, expected_host_after_backup(pool, host0, dev0, host_idx, src))
    host.load_to_device_all_layer(pool, host_idx, dst, io_backend=io)
    assert_device_equal(pool, expected_device_after_load(dev0, dev0, src, dst))


def test_part_views_show_backed_up_rows(gen):
    """host.part_view(name) indexes (layer, host slot) -> the device row that was backed up."""
    for layout in LAYOUTS:
        for kind in KINDS:
            pool, alloc = make_pool(kind, 4, torch.bfloat16, pages=6, layer_num=3)
            host = make_host(pool, alloc, layout, host_pages=4)
            fill_device(pool, gen)
            shuffle_free_pages(alloc, gen)
            src = alloc.alloc(8)
            host_idx = random_host_pages(host, 2, gen)
            host.backup_from_device_all_layer(pool, host_idx, src)
            for name, bufs in device_parts(pool):
                view = host.part_view(name)
                for layer, buf in enumerate(bufs):
                    for h, d in zip(host_idx.tolist(), src.tolist(), strict=True):
                        row = (
                            view[layer, h]
                            if layout != "page_first_direct"
                            else (view[layer, h // 4, h % 4])
                        )
                        assert row.shape == buf.shape[1:]
                        assert torch.equal(ints(row), ints(buf[d])), (layout, kind, name)


def test_random_fill_contains_nan_bit_patterns(gen):
    """Sanity check of the fill the bit-exact tests rely on."""
    pool, _ = make_pool("mha", 16, torch.bfloat16, pages=4, layer_num=2)
    fill_device(pool, gen)
    assert torch.isnan(pool.get_key_buffer(0).float()).any()
    assert page_slots(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]

"""Bad transfer input raises a clear error naming the value and changes nothing; bad settings
are refused at construction; 'auto' picks the native copier on this CPU machine (whether it is
available: ``tests/kernels/test_transfer_native.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.host._util import (
    LAYOUTS,
    assert_device_equal,
    assert_host_equal,
    device_snapshot,
    fill_bits,
    fill_device,
    host_snapshot,
    make_host,
    make_pool,
    shuffle_free_pages,
)
from tiered_kv import platform
from tiered_kv.errors import InvalidArgumentError

P = 4
LAYERS = 3


def _setup(layout, gen):
    pool, alloc = make_pool("mha_v", P, torch.float16, pages=9, layer_num=LAYERS)
    host = make_host(pool, alloc, layout, host_pages=6, kernel_backend="native")
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    shuffle_free_pages(alloc, gen)
    host.alloc(P)
    h = host.alloc(2 * P)
    d = alloc.alloc(2 * P)
    return pool, alloc, host, h, d


@pytest.fixture(params=LAYOUTS)
def setup(request, gen):
    return _setup(request.param, gen)


@pytest.fixture
def setup_one(gen):
    return _setup("page_first", gen)


OPS = {
    "backup": lambda host, pool, h, d, io: host.backup_from_device_all_layer(
        pool, h, d, io_backend=io
    ),
    "load_layer": lambda host, pool, h, d, io: host.load_to_device_per_layer(
        pool, h, d, 1, io_backend=io
    ),
    "load_all": lambda host, pool, h, d, io: host.load_to_device_all_layer(
        pool, h, d, io_backend=io
    ),
}


def _set(t: torch.Tensor, i: int, v: int) -> torch.Tensor:
    t = t.clone()
    t[i] = v
    return t


# Each case: (h, d, host, pool) -> (bad host indices, bad device indices, text the error names).
CASES = {
    "host-index-too-high": lambda h, d, host, pool: (_set(h, 3, host.size), d, f"[{host.size}]"),
    "host-index-far-out": lambda h, d, host, pool: (_set(h, 0, 10**6), d, "[1000000]"),
    "host-index-negative": lambda h, d, host, pool: (_set(h, 5, -1), d, "[-1]"),
    "device-index-too-high": lambda h, d, host, pool: (
        h,
        _set(d, 2, pool.num_slots),
        f"[{pool.num_slots}]",
    ),
    "device-index-negative": lambda h, d, host, pool: (h, _set(d, 7, -3), "[-3]"),
    "device-slot-0": lambda h, d, host, pool: (h, _set(d, 1, 0), "[0]"),
    "device-padding-page": lambda h, d, host, pool: (h, _set(d, 4, P - 1), f"[{P - 1}]"),
    "host-shorter": lambda h, d, host, pool: (h[:7], d, "7 entries"),
    "device-shorter": lambda h, d, host, pool: (h, d[:5], "device_indices 5"),
    "host-repeated": lambda h, d, host, pool: (_set(h, 6, int(h[2])), d, "host_indices repeat"),
    "device-repeated": lambda h, d, host, pool: (h, _set(d, 0, int(d[5])), "device_indices rep"),
    "host-float": lambda h, d, host, pool: (h.float(), d, "torch.float32"),
    "device-float": lambda h, d, host, pool: (h, d.double(), "torch.float64"),
    "host-int16": lambda h, d, host, pool: (h.to(torch.int16), d, "torch.int16"),
    "host-meta": lambda h, d, host, pool: (h.to("meta"), d, "meta"),
    "device-meta": lambda h, d, host, pool: (h, d.to("meta"), "meta"),
    "host-2d": lambda h, d, host, pool: (h.view(2, -1), d.view(2, -1), "1-D"),
    "host-list": lambda h, d, host, pool: (h.tolist(), d, "list"),
    "device-numpy": lambda h, d, host, pool: (h, d.numpy(), "ndarray"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("io", ("kernel", "direct"))
@pytest.mark.parametrize("op", OPS)
def test_bad_indices_raise_and_change_nothing(op, io, case, setup):
    pool, _, host, h, d = setup
    bad_h, bad_d, named = CASES[case](h, d, host, pool)
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    with pytest.raises(InvalidArgumentError) as info:
        OPS[op](host, pool, bad_h, bad_d, io)
    assert named in str(info.value), str(info.value)
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)
    OPS[op](host, pool, h, d, io)  # the good indices still work


@pytest.mark.parametrize("side", ("host", "device"))
def test_repeated_index_error_names_the_slot(side, setup_one):
    """errors.py: each message names the offending value. A repeated slot is named too."""
    pool, _, host, h, d = setup_one
    if side == "host":
        h, slot = _set(h, 6, int(h[2])), int(h[2])
    else:
        d, slot = _set(d, 0, int(d[5])), int(d[5])
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    with pytest.raises(InvalidArgumentError) as info:
        host.backup_from_device_all_layer(pool, h, d)
    assert str(slot) in str(info.value), f"slot {slot} not named: {info.value}"
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)


@pytest.mark.parametrize("io", ("dma", "Kernel", "", None))
@pytest.mark.parametrize("op", OPS)
def test_unknown_io_backend_raises(op, io, setup):
    pool, _, host, h, d = setup
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    with pytest.raises(InvalidArgumentError, match=f"io_backend={io!r}"):
        OPS[op](host, pool, h, d, io)
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)


@pytest.mark.parametrize("op", OPS)
def test_another_device_pool_raises(op, setup):
    pool, _, host, h, d = setup
    twin, _ = make_pool("mha_v", P, torch.float16, pages=9, layer_num=LAYERS)
    fill_device(twin, torch.Generator().manual_seed(1))
    dev0, twin0, host0 = device_snapshot(pool), device_snapshot(twin), host_snapshot(host)
    for other in (twin, None, host):
        with pytest.raises(InvalidArgumentError, match="device_pool is not the pool"):
            OPS[op](host, other, h, d, "kernel")
    assert_device_equal(pool, dev0)
    assert_device_equal(twin, twin0)
    assert_host_equal(host, host0)


@pytest.mark.parametrize("layer_id", (LAYERS, -1, 100))
def test_load_of_a_layer_not_held_raises(layer_id, setup):
    pool, _, host, h, d = setup
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    with pytest.raises(InvalidArgumentError, match=f"layer_id={layer_id}.*0..{LAYERS - 1}"):
        host.load_to_device_per_layer(pool, h, d, layer_id)
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)


def test_layer_ids_are_global_with_start_layer(gen):
    pool, alloc = make_pool("mla", P, torch.bfloat16, pages=4, layer_num=2, start_layer=5)
    host = make_host(pool, alloc, host_pages=2)
    h, d = host.alloc(P), alloc.alloc(P)
    dev0 = device_snapshot(pool)
    for layer_id in (0, 1, 4, 7):
        with pytest.raises(InvalidArgumentError, match=f"layer_id={layer_id}.*5..6"):
            host.load_to_device_per_layer(pool, h, d, layer_id)
    assert_device_equal(pool, dev0)
    host.load_to_device_per_layer(pool, h, d, 5)
    host.load_to_device_per_layer(pool, h, d, 6)


@pytest.mark.parametrize("layer_id", (1.0, True))
def test_load_with_a_non_int_layer_id_raises(layer_id, setup_one):
    """Like the device pool (``KVCache.layer_index``), a layer id must be an int: 1.0 or True
    must not silently select layer 1."""
    pool, _, host, h, d = setup_one
    dev0, host0 = device_snapshot(pool), host_snapshot(host)
    with pytest.raises(InvalidArgumentError, match="layer_id"):
        host.load_to_device_per_layer(pool, h, d, layer_id)
    assert_device_equal(pool, dev0)
    assert_host_equal(host, host0)


def test_unknown_layout_at_construction_raises():
    pool, alloc = make_pool("mha", P, torch.float16, pages=3, layer_num=2)
    for layout in ("row_major", "PAGE_FIRST", ""):
        with pytest.raises(InvalidArgumentError, match=f"layout={layout!r}"):
            make_host(pool, alloc, layout)


def test_unknown_kernel_backend_at_construction_raises():
    pool, alloc = make_pool("mha", P, torch.float16, pages=3, layer_num=2)
    for kb in ("cuda", "c", "numpy"):
        with pytest.raises(InvalidArgumentError, match=f"kernel_backend={kb!r}"):
            make_host(pool, alloc, kernel_backend=kb)


@pytest.mark.parametrize("requested", (None, "auto", "AUTO", " auto "))
def test_auto_picks_native_on_cpu(requested, monkeypatch):
    monkeypatch.delenv(platform.ENV_KERNEL_BACKEND, raising=False)
    pool, alloc = make_pool("mha", P, torch.float16, pages=3, layer_num=2)
    host = make_host(pool, alloc, kernel_backend=requested)
    assert host.kernel_backend.value == "native"


def test_environment_overrides_auto(monkeypatch):
    pool, alloc = make_pool("mha", P, torch.float16, pages=3, layer_num=2)
    monkeypatch.setenv(platform.ENV_KERNEL_BACKEND, "torch")
    assert make_host(pool, alloc, kernel_backend=None).kernel_backend.value == "torch"
    # An explicit request beats the environment.
    assert make_host(pool, alloc, kernel_backend="native").kernel_backend.value == "native"

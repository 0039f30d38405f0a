"""Host pools: sizing, the memory check, pinning, destroy, declarations, and pages as bytes."""

from __future__ import annotations

import gc
import re

import numpy as np
import psutil
import pytest
import torch

from tests.host._util import (
    DTYPE_IDS,
    DTYPES,
    KINDS,
    LAYOUTS,
    assert_device_equal,
    canonical,
    device_snapshot,
    expected_device_after_load,
    fill_bits,
    fill_device,
    host_snapshot,
    ints,
    make_host,
    make_pool,
    random_host_pages,
    shuffle_free_pages,
)
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError, StateError
from tiered_kv.host import (
    HostKVCache,
    HostMemoryError,
    HostPoolDecl,
    MHATokenToKOnlyPoolHost,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    host_pool_for,
)
from tiered_kv.host import host_kv_cache as host_kv_cache_module

GIB = 1 << 30
MIB = 1 << 20


# -- sizing ----------------------------------------------------------------------------------
# mha_v, fp16, page 16, 5 layers: a token-layer is 3 * (10 + 6) * 2 = 96 bytes, a token 480.
TOKEN_BYTES = 480


@pytest.fixture
def mha16():
    pool, alloc = make_pool("mha_v", 16, torch.float16, pages=10, layer_num=5)
    assert pool.bytes_per_token_per_layer() * 5 == TOKEN_BYTES
    return pool, alloc


@pytest.mark.parametrize(("tokens", "expected"), [(1, 16), (16, 16), (17, 32), (33, 48)])
def test_size_tokens_rounds_up_to_pages(tokens, expected, mha16):
    host = make_host(*mha16, size_tokens=tokens)
    assert host.size == expected
    assert host.num_pages == expected // 16
    assert host.nbytes == expected * TOKEN_BYTES
    assert host.available_size() == expected


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (TOKEN_BYTES * 16, 16),
        (TOKEN_BYTES * 48 + TOKEN_BYTES - 1, 48),  # 48.99 tokens
        (TOKEN_BYTES * 47, 32),  # 47 tokens: 2 whole pages
        (TOKEN_BYTES * 31 + 5, 16),
    ],
)
def test_size_bytes_rounds_down_to_pages(nbytes, expected, mha16):
    host = make_host(*mha16, size_bytes=nbytes)
    assert host.size == expected
    assert host.nbytes == expected * TOKEN_BYTES <= nbytes


@pytest.mark.parametrize(("ratio", "expected"), [(1.0, 160), (1.55, 240), (0.2, 32), (0.19, 16)])
def test_ratio_of_device_tokens_rounds_down_to_pages(ratio, expected, mha16):
    # The device pool has 160 usable slots: 1.55 * 160 = 248 -> 240; 0.19 * 160 = 30.4 -> 16.
    host = make_host(*mha16, ratio=ratio)
    assert host.size == expected


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"size_bytes": TOKEN_BYTES * 15}, id="bytes-15-tokens"),
        pytest.param({"size_bytes": TOKEN_BYTES * 16 - 1}, id="bytes-just-short"),
        pytest.param({"ratio": 0.09}, id="ratio-14-tokens"),
    ],
)
def test_below_one_page_raises(kw, mha16):
    ((name, value),) = kw.items()
    with pytest.raises(InvalidArgumentError, match=rf"{name}={re.escape(repr(value))}.*one page"):
        make_host(*mha16, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({}, id="none"),
        pytest.param({"size_tokens": 32, "size_bytes": 10**6}, id="tokens+bytes"),
        pytest.param({"size_tokens": 32, "ratio": 1.0}, id="tokens+ratio"),
        pytest.param({"size_bytes": 10**6, "ratio": 1.0}, id="bytes+ratio"),
        pytest.param({"size_tokens": 32, "size_bytes": 10**6, "ratio": 1.0}, id="all"),
    ],
)
def test_exactly_one_size_setting(kw, mha16):
    pool, alloc = mha16
    with pytest.raises(InvalidArgumentError, match="exactly one of size_tokens, size_bytes, ratio"):
        host_pool_for(pool.host_pool_decls()[0], alloc, reserve_bytes=0, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"size_tokens": 0},
        {"size_tokens": -16},
        {"size_tokens": 16.0},
        {"size_bytes": 0},
        {"ratio": -1.0},
        {"ratio": True},
    ],
)
def test_non_positive_or_wrong_type_size_raises(kw, mha16):
    ((name, value),) = kw.items()
    with pytest.raises(InvalidArgumentError, match=rf"{name}={re.escape(repr(value))}"):
        make_host(*mha16, **kw)


def test_too_much_memory_raises_before_allocating(mha16, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("the host buffer was allocated before the memory check")

    monkeypatch.setattr(host_kv_cache_module, "HostBuffer", no_allocation)
    total = psutil.virtual_memory().total
    asked_bytes = 10 * total
    with pytest.raises(HostMemoryError) as info:
        make_host(*mha16, size_bytes=asked_bytes)
    msg = str(info.value)
    tokens = asked_bytes // TOKEN_BYTES // 16 * 16
    m = re.search(r"asks ([\d.]+) GiB but only ([\d.]+) GiB is available", msg)
    assert m, msg
    assert m.group(1) == f"{tokens * TOKEN_BYTES / GIB:.2f}"
    available = psutil.virtual_memory().available / GIB
    assert abs(float(m.group(2)) - available) < 1.0, msg  # reserve_bytes=0
    assert "lower size_bytes" in msg


@pytest.mark.parametrize(
    "kw", [{"size_tokens": 32}, {"ratio": 0.5}, {"size_bytes": 32 * TOKEN_BYTES}], ids=str
)
def test_reserve_is_kept_and_the_message_names_the_setting(kw, mha16, monkeypatch):
    monkeypatch.setattr(
        host_kv_cache_module, "HostBuffer", lambda *a, **k: pytest.fail("allocated anyway")
    )
    reserve = psutil.virtual_memory().total  # more than is ever available: nothing is usable
    with pytest.raises(HostMemoryError) as info:
        make_host(*mha16, reserve_bytes=reserve, **kw)
    msg = str(info.value)
    ((name, _),) = kw.items()
    assert f"lower {name}" in msg and "reserve_bytes" in msg
    assert "only 0.00 GiB is available" in msg
    assert f"{reserve / GIB:.2f} GiB reserve" in msg


def test_negative_reserve_raises(mha16):
    with pytest.raises(InvalidArgumentError, match="reserve_bytes=-1"):
        make_host(*mha16, size_tokens=16, reserve_bytes=-1)


# -- pinning, destroy, leaks -------------------------------------------------------------------
def test_not_pinned_without_cuda(mha16):
    assert not torch.cuda.is_available()
    assert make_host(*mha16, size_tokens=16).pinned is False
    assert make_host(*mha16, size_tokens=16, pin=False).pinned is False
    with pytest.raises(BackendUnavailableError, match="pin=True"):
        make_host(*mha16, size_tokens=16, pin=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_destroy_then_everything_raises(layout, mha16, gen):
    pool, alloc = mha16
    host = make_host(pool, alloc, layout, size_tokens=32)
    dev = alloc.alloc(16)
    slots = host.alloc(16)
    host.backup_from_device_all_layer(pool, slots, dev)
    page = host.get_page_bytes(0).clone()
    host.destroy()
    assert host.nbytes == 0
    with pytest.raises(StateError):
        host.buffer  # noqa: B018
    with pytest.raises(StateError):
        host.backup_from_device_all_layer(pool, slots, dev)
    with pytest.raises(StateError):
        host.load_to_device_per_layer(pool, slots, dev, 0)
    with pytest.raises(StateError):
        host.load_to_device_all_layer(pool, slots, dev)
    for io in ("kernel", "direct"):
        with pytest.raises(StateError):
            host.backup_from_device_all_layer(pool, slots, dev, io_backend=io)
    with pytest.raises(StateError):
        host.part_view("k")
    with pytest.raises(StateError):
        host.get_page_bytes(0)
    with pytest.raises(StateError):
        host.set_page_bytes(0, page)
    host.destroy()  # a second destroy is harmless
    with pytest.raises(StateError):
        host.buffer  # noqa: B018


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_no_leak_across_create_destroy_cycles():
    pool, alloc = make_pool("mha", 16, torch.bfloat16, pages=4, layer_num=4)
    size = 200 * MIB
    after: list[int] = []
    for _ in range(6):
        host = make_host(pool, alloc, "page_first", size_bytes=size)
        assert host.nbytes > size - 16 * pool.bytes_per_token_per_layer() * 4
        host.buffer.view(-1).view(torch.uint8).fill_(0xA5)  # touch every byte
        alive = _rss()
        host.destroy()
        del host
        after.append(_rss())
        # destroy() hands the memory back to the OS (it does not wait for the process to end).
        assert alive - after[-1] > 150 * MIB, (alive, after[-1])
    assert after[-1] - after[0] < 50 * MIB, [a // MIB for a in after]


# -- declarations -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", (*DTYPES, torch.float8_e5m2), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("start_layer", (None, 0, 3))
@pytest.mark.parametrize("kind", KINDS)
def test_host_pool_decls(kind, start_layer, dtype):
    pool, _ = make_pool(kind, 4, dtype, pages=3, layer_num=3, start_layer=start_layer)
    decls = pool.host_pool_decls()
    assert len(decls) == 1
    decl = decls[0]
    assert isinstance(decl, HostPoolDecl)
    assert decl.name == "kv"
    assert decl.kind == {"mha": "mha", "mha_v": "mha", "mla": "mla", "konly": "k_only"}[kind]
    assert decl.device_pool is pool
    expected_parts = {
        "mha": [("k", (3, 10)), ("v", (3, 10))],
        "mha_v": [("k", (3, 10)), ("v", (3, 6))],
        "mla": [("kv", (1, 17))],
        "konly": [("k", (2, 9))],
    }[kind]
    assert [(p.name, p.item_shape) for p in decl.parts] == expected_parts
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert decl.dtype == (torch.uint8 if fp8 else dtype)
    first = start_layer or 0
    assert decl.layer_ids == (first, first + 1, first + 2)
    assert decl.layer_num == 3
    assert decl.page_size == 4 and decl.num_slots == 16 and decl.size == 12
    assert decl.bytes_per_token_per_layer == pool.bytes_per_token_per_layer()
    for part in decl.parts:
        for local in range(3):
            buf = part.buffer(local)
            assert buf.shape == (16, *part.item_shape) and buf.dtype == decl.dtype
    host = host_pool_for(decl, _allocator(pool), size_tokens=8, reserve_bytes=0)
    assert (
        type(host)
        is {
            "mha": MHATokenToKVPoolHost,
            "mla": MLATokenToKVPoolHost,
            "k_only": MHATokenToKOnlyPoolHost,
        }[decl.kind]
    )
    assert host.buffer.dtype == decl.dtype
    assert host.nbytes == 8 * 3 * decl.bytes_per_token_per_layer


def _allocator(pool):
    return PagedTokenToKVPoolAllocator(pool.size, pool.page_size, pool.dtype, "cpu", kvcache=pool)


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("mha", MLATokenToKVPoolHost),
        ("mha", MHATokenToKOnlyPoolHost),
        ("mla", MHATokenToKVPoolHost),
        ("mla", MHATokenToKOnlyPoolHost),
        ("konly", MHATokenToKVPoolHost),
        ("konly", MLATokenToKVPoolHost),
    ],
)
def test_wrong_host_class_for_the_decl_kind_raises(kind, cls):
    pool, alloc = make_pool(kind, 4, torch.float16, pages=3, layer_num=2)
    decl = pool.host_pool_decls()[0]
    with pytest.raises(InvalidArgumentError, match=f"'{decl.kind}'"):
        cls(decl, alloc, size_tokens=8, reserve_bytes=0)


def test_generic_host_class_takes_any_kind():
    for kind in KINDS:
        pool, alloc = make_pool(kind, 4, torch.float16, pages=3, layer_num=2)
        host = HostKVCache(pool.host_pool_decls()[0], alloc, size_tokens=8, reserve_bytes=0)
        assert host.size == 8


def test_allocator_of_another_pool_raises():
    pool, alloc = make_pool("mha", 4, torch.float16, pages=3, layer_num=2)
    other = MHATokenToKVPool(12, 4, torch.float16, 3, 10, 2, "cpu")
    other_alloc = _allocator(other)
    with pytest.raises(InvalidArgumentError, match="another device pool"):
        host_pool_for(pool.host_pool_decls()[0], other_alloc, size_tokens=8, reserve_bytes=0)
    with pytest.raises(InvalidArgumentError, match="allocator"):
        host_pool_for(pool.host_pool_decls()[0], object(), size_tokens=8, reserve_bytes=0)
    assert isinstance(other, MHATokenToKVPool)
    assert not isinstance(pool, (MLATokenToKVPool, MHATokenToKOnlyPool))


@pytest.mark.parametrize("factory", (HostKVCache, MHATokenToKVPoolHost, host_pool_for))
def test_a_pool_instead_of_its_decl_raises(factory):
    """Passing the device pool itself (not pool.host_pool_decls()[0]) is refused clearly."""
    pool, alloc = make_pool("mha", 4, torch.float16, pages=3, layer_num=2)
    with pytest.raises(InvalidArgumentError, match="HostPoolDecl"):
        factory(pool, alloc, size_tokens=8, reserve_bytes=0)


# -- pages as bytes ---------------------------------------------------------------------------
def _page_format(host, page: int) -> torch.Tensor:
    """Independent oracle of a page's bytes: (P, L, E) for page_first, (L, P, E) otherwise,
    from the canonical (L, T, E) integer view."""
    p = host.page_size
    recs = canonical(host.buffer, host.layout.value, p)[:, page * p : (page + 1) * p]
    if host.layout.value == "page_first":
        recs = recs.transpose(0, 1)
    return recs.contiguous().view(-1).view(torch.uint8)


def _pool_with_host(layout, gen, *, kind="mha_v", dtype=torch.bfloat16, layer_num=3, page=4):
    pool, alloc = make_pool(kind, page, dtype, pages=8, layer_num=layer_num)
    host = make_host(pool, alloc, layout, host_pages=5)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return pool, alloc, host


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_get_page_bytes(layout, kind, dtype, gen):
    _check_get_page_bytes(layout, kind, dtype, 3, gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_get_page_bytes_single_layer_pool(layout, gen):
    """One layer (e.g. a pipeline stage of one layer): still a copy exactly when the pool says
    page_bytes_zero_copy is False."""
    _check_get_page_bytes(layout, "mha_v", torch.float16, 1, gen)


def _check_get_page_bytes(layout, kind, dtype, layer_num, gen):
    pool, alloc, host = _pool_with_host(layout, gen, kind=kind, dtype=dtype, layer_num=layer_num)
    elt = torch.empty((), dtype=pool.store_dtype).element_size()
    assert host.page_nbytes == 4 * layer_num * pool.bytes_per_token_per_layer()
    assert host.page_nbytes == 4 * layer_num * host.elems * elt
    buf = host.buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + host.nbytes
    for page in range(host.num_pages):
        data = host.get_page_bytes(page)
        assert data.dtype == torch.uint8 and data.dim() == 1
        assert data.numel() == host.page_nbytes
        assert torch.equal(data, _page_format(host, page))
    page = 2
    data = host.get_page_bytes(page)
    ptr = data.data_ptr()
    before = host_snapshot(host)
    data[:7] ^= 0xFF  # write through what get_page_bytes returned
    if layout == "layer_first":
        assert host.page_bytes_zero_copy is False
        # A copy (the flag says so): the pool must not see the write, whatever the layer count.
        inside = lo <= ptr < hi
        assert not inside, f"layer_first get_page_bytes returned a view ({layer_num=})"
        assert torch.equal(host_snapshot(host), before)
    else:
        assert host.page_bytes_zero_copy is True
        assert lo <= ptr and ptr + data.numel() <= hi
        assert torch.equal(host.get_page_bytes(page), data)
        assert not torch.equal(host_snapshot(host), before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "as_type",
    [
        pytest.param(lambda t: bytes(t.numpy()), id="bytes"),
        pytest.param(lambda t: bytearray(t.numpy()), id="bytearray"),
        pytest.param(lambda t: memoryview(bytearray(t.numpy())), id="memoryview"),
        pytest.param(lambda t: memoryview(b"xyz" + bytes(t.numpy()))[3:], id="memoryview-slice"),
        pytest.param(lambda t: t.clone(), id="tensor"),
        pytest.param(lambda t: t.clone().view(2, -1), id="tensor-2d"),
        pytest.param(lambda t: torch.cat([torch.zeros(3, dtype=torch.uint8), t])[3:], id="offset"),
        pytest.param(lambda t: torch.stack([t, t], 1)[:, 1], id="tensor-strided"),
    ],
)
def test_set_page_bytes_fills_exactly_that_page(as_type, layout, gen):
    _, _, host = _pool_with_host(layout, gen, dtype=torch.float32)
    page = 3
    new = torch.empty(host.page_nbytes, dtype=torch.uint8).random_(0, 256, generator=gen)
    before = host_snapshot(host)
    host.set_page_bytes(page, as_type(new))
    assert torch.equal(host.get_page_bytes(page), new)
    assert torch.equal(_page_format(host, page), new)
    after = host_snapshot(host)
    p = host.page_size
    outside = torch.ones(host.size, dtype=torch.bool)
    outside[page * p : (page + 1) * p] = False
    assert torch.equal(after[:, outside], before[:, outside])
    # get -> set round trip on another page.
    other = host.get_page_bytes(1).clone()
    host.set_page_bytes(0, other)
    assert torch.equal(host.get_page_bytes(0), other)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_set_page_bytes_bad_input_raises_and_changes_nothing(layout, gen):
    _, _, host = _pool_with_host(layout, gen, dtype=torch.float16)
    n = host.page_nbytes
    good = torch.zeros(n, dtype=torch.uint8)
    before = host_snapshot(host)
    cases = [
        (0, bytes(n - 1), str(n - 1)),
        (0, bytes(n + 1), str(n + 1)),
        (0, b"", "0 bytes"),
        (0, bytearray(n - 2), str(n - 2)),
        (0, torch.zeros(n + 4, dtype=torch.uint8), str(n + 4)),
        (0, torch.zeros(n // 2, dtype=torch.float16), "float16"),
        (0, torch.zeros(n, dtype=torch.int8), "int8"),
        (-1, good, "page=-1"),
        (host.num_pages, good, f"page={host.num_pages}"),
        (1.0, good, "page=1.0"),
        (True, good, "page=True"),
        ("0", good, "page='0'"),
    ]
    for page, data, named in cases:
        with pytest.raises(InvalidArgumentError) as info:
            host.set_page_bytes(page, data)
        assert named in str(info.value), (page, type(data), str(info.value))
        assert torch.equal(host_snapshot(host), before)
    for page in (-1, host.num_pages, 2.0, None):
        with pytest.raises(InvalidArgumentError, match="page="):
            host.get_page_bytes(page)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_moved_as_bytes_to_a_fresh_pool_load_the_original_kv(layout, kind, dtype, gen):
    """Back up, carry every page as bytes into a fresh host pool of the same geometry (other
    page ids), load from there: the device gets the original KV bytes."""
    pool, alloc = make_pool(kind, 4, dtype, pages=12, layer_num=3)
    host_a = make_host(pool, alloc, layout, host_pages=6)
    host_b = make_host(pool, alloc, layout, host_pages=5)
    fill_device(pool, gen)
    fill_bits(host_a.buffer, gen)
    fill_bits(host_b.buffer, gen)
    shuffle_free_pages(alloc, gen)
    src, dst = alloc.alloc(12), alloc.alloc(12)
    slots_a = random_host_pages(host_a, 3, gen)
    slots_b = random_host_pages(host_b, 3, gen)
    dev0 = device_snapshot(pool)
    host_a.backup_from_device_all_layer(pool, slots_a, src)
    for pa, pb in zip(slots_a[::4].tolist(), slots_b[::4].tolist(), strict=True):
        host_b.set_page_bytes(pb // 4, bytes(host_a.get_page_bytes(pa // 4).numpy()))
    host_a.destroy()
    for layer in range(3):
        host_b.load_to_device_per_layer(pool, slots_b, dst, layer)
    assert_device_equal(pool, expected_device_after_load(dev0, dev0, src, dst))
    assert ints(host_b.buffer).numel() > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_bytes_rows_are_the_pages_as_one_view(layout, kind, gen):
    _, _, host = _pool_with_host(layout, gen, kind=kind, dtype=torch.float16)
    rows = host.page_bytes_rows()
    if not host.page_bytes_zero_copy:
        assert rows is None  # layer_first: pages are not contiguous
        return
    assert rows.shape == (host.num_pages, host.page_nbytes) and rows.dtype == np.uint8
    for page in range(host.num_pages):
        assert np.array_equal(rows[page], host.get_page_bytes(page).numpy())
    # a view, not a copy: writing a row writes that page and nothing else
    new = torch.randint(0, 256, (host.page_nbytes,), dtype=torch.uint8, generator=gen)
    before = [host.get_page_bytes(p).clone() for p in range(host.num_pages)]
    rows[2][:] = new.numpy()
    assert torch.equal(host.get_page_bytes(2), new)
    for page in (0, 1, 3, 4):
        assert torch.equal(host.get_page_bytes(page), before[page])
    host.destroy()
    with pytest.raises(StateError):
        host.page_bytes_rows()

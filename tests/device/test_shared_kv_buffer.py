"""Issue 29: a unified sliding-window pool whose two sides share one buffer (``share_bytes``).

Writes through the allocator's plan land in the one buffer and read back byte for byte on
both sides; full layer i and window layer i are the same bytes, so the pool holds the larger
side's layers only; a physical page freed by one side and taken by the other shows its new
owner only what that owner wrote, and the side that gave it up reads the padding page, never
the new owner's bytes; different heads on the two sides are refused by name."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa_pages import FULL, SWA
from tiered_kv.device.kv_cache import mha_kv_bytes
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import InvalidArgumentError

P, PAGES, HEADS, DIM = 4, 10, 2, 8
FULL_IDS, SWA_IDS = [0, 3], [1, 2, 4]  # 2 full layers, 3 window layers


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def rig(share: bool = True, dtype=torch.float16):
    pool = UnifiedSWAKVPool(PAGES, P, dtype, HEADS, DIM, FULL_IDS, SWA_IDS, share_bytes=share)
    alloc = UnifiedSWATokenToKVPoolAllocator(
        PAGES, P, dtype, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    return pool, alloc


def extend(alloc, n: int, prefix: int = 0, last: int = -1) -> torch.Tensor:
    return alloc.alloc_extend(_t(prefix), _t(prefix), _t(prefix + n), _t(prefix + n), _t(last), n)


def random_kv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bits as float16 (NaN payloads included), never an all-zero token."""
    k, v = (
        torch.randint(1, 1 << 15, (n, HEADS, DIM), generator=gen, dtype=torch.int16) for _ in "kv"
    )
    return k.view(torch.float16), v.view(torch.float16)


def write(pool, alloc, virtual, layers, gen) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    loc, want = alloc.plan(virtual), {}
    for layer in layers:
        want[layer] = random_kv(len(virtual), gen)
        pool.set_kv_buffer(layer, loc, *want[layer])
    return want


def read(pool, alloc, virtual, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """What a reader of ``virtual`` sees in ``layer`` (the read translations)."""
    window = pool.layers_mapping[layer][1]
    translate = alloc.translate_loc_from_full_to_swa if window else alloc.translate_kv_loc
    slots = translate(virtual)
    return pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_one_buffer_of_the_larger_sides_layers():
    pool, _ = rig()
    separate, _ = rig(share=False)
    rows = (PAGES + 1) * P
    assert pool.get_kv_size_bytes() == mha_kv_bytes(3, rows, HEADS, DIM, torch.float16)
    assert separate.get_kv_size_bytes() == mha_kv_bytes(5, rows, HEADS, DIM, torch.float16)
    assert pool.buffers() == [pool.shared.buffer]
    full, swa = pool.full_kv_pool, pool.swa_kv_pool
    for i in range(2):  # full layer i and window layer i: the same bytes, contiguous views
        for a, b in ((full.k_buffer[i], swa.k_buffer[i]), (full.v_buffer[i], swa.v_buffer[i])):
            assert a.data_ptr() == b.data_ptr() and a.is_contiguous()
            assert a.shape == (rows, HEADS, DIM)
    base = pool.shared.buffer.data_ptr()
    ends = [b.data_ptr() + b.numel() * 2 - base for b in (*swa.k_buffer, *swa.v_buffer)]
    assert max(ends) == pool.get_kv_size_bytes()


def test_writes_read_back_bitwise_on_both_sides(gen):
    pool, alloc = rig()
    a = extend(alloc, 2 * P + 1)  # 3 pages on each side
    b = extend(alloc, P + 2)  # 2 more: the range is full
    want_a = write(pool, alloc, a, range(5), gen)
    want_b = write(pool, alloc, b, range(5), gen)
    for virtual, want in ((a, want_a), (b, want_b)):
        for layer, (k, v) in want.items():
            got_k, got_v = read(pool, alloc, virtual, layer)
            assert same_bits(got_k, k) and same_bits(got_v, v), layer


def test_a_page_handed_to_the_other_side_shows_only_its_owners_bytes(gen):
    """A window page given up (the tokens left the window) and taken as a full page: the new
    owner reads what it wrote in every full layer; the old tokens read padding in their
    window layers, never the full side's bytes; and back again."""
    pool, alloc = rig()
    pages = alloc.pages
    # Fill the range: 5 virtual pages, full 1..5, window 10..6.
    first = extend(alloc, 5 * P)
    write(pool, alloc, first, range(5), gen)
    window_pages = pages.v2p[SWA][torch.arange(1, 6)].tolist()
    # Every page of it leaves the window (a tombstoned prefix): window pages 10..6 are free.
    alloc.free_swa(first)
    # A new request takes 2 pages: full ones from the low end, now above the old full top.
    second = extend(alloc, 2 * P)
    full_pages = pages.v2p[FULL][torch.unique(second // P)].tolist()
    reused = set(full_pages) & set(window_pages)
    assert reused, (full_pages, window_pages)
    want = write(pool, alloc, second, range(5), gen)
    for layer, (k, v) in want.items():
        got_k, got_v = read(pool, alloc, second, layer)
        assert same_bits(got_k, k) and same_bits(got_v, v), layer
    assert bool((alloc.translate_loc_from_full_to_swa(first) < P).all())
    for layer in SWA_IDS:  # the first request's freed window KV reads the padding page
        k, _ = read(pool, alloc, first, layer)
        for got in k:
            assert not any(same_bits(got, row) for row in want[layer][0])
    # Back: the second request leaves, the first one's freed pages go too; a fresh request's
    # window pages now land where full KV was, and read only their own bytes.
    alloc.free(second)
    alloc.free(first)
    third = extend(alloc, 5 * P)
    window_now = set(pages.v2p[SWA][torch.unique(third // P)].tolist())
    assert window_now & set(full_pages)
    want3 = write(pool, alloc, third, range(5), gen)
    for layer, (k, v) in want3.items():
        got_k, got_v = read(pool, alloc, third, layer)
        assert same_bits(got_k, k) and same_bits(got_v, v), layer


def test_full_layers_beyond_the_window_layers_are_kept_apart(gen):
    """More full layers than window layers: slab 2 is a full layer only; a window page's
    bytes there stay what the full side last wrote."""
    pool = UnifiedSWAKVPool(PAGES, P, torch.float16, HEADS, DIM, [0, 1, 2], [3], share_bytes=True)
    alloc = UnifiedSWATokenToKVPoolAllocator(PAGES, P, torch.float16, "cpu", pool)
    assert pool.shared.num_slabs == 3
    v = extend(alloc, 2 * P)
    want = write(pool, alloc, v, range(4), gen)
    for layer, (k, val) in want.items():
        got_k, got_v = read(pool, alloc, v, layer)
        assert same_bits(got_k, k) and same_bits(got_v, val)


def test_different_heads_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="share_bytes needs the same heads"):
        UnifiedSWAKVPool(PAGES, P, torch.float16, 2, 8, [0], [1], swa_head_num=1, share_bytes=True)
    with pytest.raises(InvalidArgumentError, match="share_bytes must be True or False"):
        UnifiedSWAKVPool(PAGES, P, torch.float16, 2, 8, [0], [1], share_bytes=1)


def test_fp8_is_stored_as_bytes_in_the_shared_buffer(gen):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    pool, alloc = rig(dtype=torch.float8_e4m3fn)
    assert pool.shared.buffer.dtype == torch.uint8
    v = extend(alloc, P)
    k = torch.randn(P, HEADS, DIM, generator=gen)
    pool.set_kv_buffer(1, alloc.plan(v), k, k)
    got, _ = read(pool, alloc, v, 1)
    assert torch.equal(got.to(torch.float32), k.to(torch.float8_e4m3fn).to(torch.float32))

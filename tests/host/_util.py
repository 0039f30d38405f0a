"""Shared helpers of the host-tier tests: pools, random bit fills, and an independent oracle.

The oracle never goes through tiered_kv's layout code: it maps a host buffer to a canonical
``(L, T, E)`` integer view from the documented layout shapes alone, and compares bytes as
integers of the element width, so NaN payloads (which random bit fills produce) compare exactly.
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.host import host_pool_for

CPU = "cpu"
H, D, DV = 3, 10, 6  # MHA heads, K head dim, V head dim of the "mha_v" kind
KH, KD = 2, 9  # K-only heads and head dim
R, DR = 12, 5  # MLA kv_lora_rank, qk_rope_head_dim
L = 5
KINDS = ("mha", "mha_v", "mla", "konly")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8)
DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", FP8: "fp8"}

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ints(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's width (bit-exact comparisons)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def fill_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every byte of a contiguous tensor random (all bit patterns, NaNs included)."""
    assert t.is_contiguous()
    t.view(-1).view(torch.uint8).random_(0, 256, generator=gen)


def make_pool(
    kind: str,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    pages: int = 10,
    layer_num: int = L,
    start_layer: int | None = None,
):
    """A device pool of ``pages`` usable pages and its paged allocator."""
    size = pages * page_size
    kw = {} if start_layer is None else {"start_layer": start_layer}
    if kind == "mha":
        pool = MHATokenToKVPool(size, page_size, dtype, H, D, layer_num, CPU, **kw)
    elif kind == "mha_v":
        pool = MHATokenToKVPool(size, page_size, dtype, H, D, layer_num, CPU, v_head_dim=DV, **kw)
    elif kind == "mla":
        pool = MLATokenToKVPool(size, page_size, dtype, R, DR, layer_num, CPU, **kw)
    elif kind == "konly":
        pool = MHATokenToKOnlyPool(size, page_size, dtype, KH, KD, layer_num, CPU, **kw)
    else:
        raise AssertionError(kind)
    alloc = PagedTokenToKVPoolAllocator(size, page_size, dtype, CPU, kvcache=pool)
    return pool, alloc


def make_host(pool, alloc, layout="page_first", *, host_pages=6, kernel_backend="torch", **kw):
    if not {"size_tokens", "size_bytes", "ratio"} & kw.keys():
        kw["size_tokens"] = host_pages * pool.page_size
    kw.setdefault("reserve_bytes", 0)
    return host_pool_for(
        pool.host_pool_decls()[0], alloc, layout=layout, kernel_backend=kernel_backend, **kw
    )


def device_parts(pool) -> list[tuple[str, list[torch.Tensor]]]:
    """(part name, per-layer buffers) straight from the pool's attributes, in record order."""
    if isinstance(pool, MLATokenToKVPool):
        return [("kv", pool.kv_buffer)]
    if isinstance(pool, MHATokenToKOnlyPool):
        return [("k", pool.k_buffer)]
    return [("k", pool.k_buffer), ("v", pool.v_buffer)]


def part_columns(pool) -> dict[str, tuple[int, int]]:
    """Element columns [start, stop) of each part inside one host record."""
    out, off = {}, 0
    for name, bufs in device_parts(pool):
        width = bufs[0].numel() // bufs[0].shape[0]
        out[name] = (off, off + width)
        off += width
    return out


def fill_device(pool, gen: torch.Generator) -> None:
    for t in pool.buffers():
        fill_bits(t, gen)


def device_snapshot(pool) -> dict[str, torch.Tensor]:
    """Per part, an integer copy ``(L, rows, elems)`` of every layer, padding page included."""
    return {
        name: torch.stack([ints(b).reshape(b.shape[0], -1) for b in bufs]).clone()
        for name, bufs in device_parts(pool)
    }


def assert_device_equal(pool, expected: dict[str, torch.Tensor]) -> None:
    got = device_snapshot(pool)
    assert got.keys() == expected.keys()
    for name in got:
        if not torch.equal(got[name], expected[name]):
            diff = (got[name] != expected[name]).any(dim=-1).nonzero()[:8].tolist()
            raise AssertionError(f"device part {name}: (layer, slot) differ at {diff}")


def canonical(buf: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """An integer view/copy ``(L, T, E)`` of a host buffer, from the layout's documented shape:
    layer_first (L, T, E), page_first (T, L, E), page_first_direct (T/P, L, P, E)."""
    b = ints(buf)
    if layout == "layer_first":
        return b.clone()
    if layout == "page_first":
        return b.permute(1, 0, 2).clone()
    assert layout == "page_first_direct"
    pages, layers, p, e = b.shape
    assert p == page_size
    return b.permute(1, 0, 2, 3).reshape(layers, pages * p, e).clone()


def host_snapshot(host) -> torch.Tensor:
    return canonical(host.buffer, host.layout.value, host.page_size)


def assert_host_equal(host, expected: torch.Tensor) -> None:
    got = host_snapshot(host)
    if not torch.equal(got, expected):
        diff = (got != expected).any(dim=-1).nonzero()[:8].tolist()
        raise AssertionError(f"host buffer: (layer, host slot) differ at {diff}")


def expected_host_after_backup(pool, host0, dev0, host_idx, dev_idx, layers=None):
    """``host0`` (canonical) with every layer (or local ``layers``) of slots ``host_idx`` set
    to device slots ``dev_idx`` of ``dev0``."""
    exp = host0.clone()
    local = range(exp.shape[0]) if layers is None else layers
    for name, (a, b) in part_columns(pool).items():
        for layer in local:
            exp[layer, host_idx, a:b] = dev0[name][layer, dev_idx]
    return exp


def expected_device_after_load(dev_before, dev_src, src_idx, dst_idx, layers=None):
    """``dev_before`` with slots ``dst_idx`` of ``layers`` (local; all when None) set to
    ``dev_src``'s slots ``src_idx``."""
    exp = {k: v.clone() for k, v in dev_before.items()}
    local = range(next(iter(exp.values())).shape[0]) if layers is None else layers
    for name in exp:
        for layer in local:
            exp[name][layer, dst_idx] = dev_src[name][layer, src_idx]
    return exp


def shuffle_free_pages(alloc, gen: torch.Generator) -> None:
    n = len(alloc.free_pages)
    alloc.free_pages = alloc.free_pages[torch.randperm(n, generator=gen)]


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def random_host_pages(host, n_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of ``n_pages`` random host pages in shuffled order (slots in order inside a page)."""
    pages = torch.randperm(host.num_pages, generator=gen)[:n_pages]
    return page_slots(pages, host.page_size)

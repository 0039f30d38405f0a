"""The page view bridge: an SGLang host pool seen as the ``PageSource`` our stores read and fill.

SGLang's host pools (``pool_host/mha.py``, ``pool_host/mla.py``) hand out one page as a flat
tensor (``get_data_page(index, flat=True)``: K then V for MHA, the one latent row for MLA, in
the pool's layout order) and take one back (``set_from_flat_data_page``); a page is named by its
first token slot. The stored bytes are those flat pages, so their order depends on the layout,
which is part of the namespace. ``namespace_of`` fingerprints the pool's geometry (kind, per
token shapes, dtype, layers, page size, layout) with the model and rank identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import HostLayout
from tiered_kv.storage.contract import as_bytes_tensor
from tiered_kv.storage.keys import StorageNamespace

# SGLang's MHA host pool also pages by head (page_head); its MLA pool has no such layout.
PAGE_HEAD = "page_head"
MHA_LAYOUTS = (*HostLayout.values(), PAGE_HEAD)
MLA_LAYOUTS = HostLayout.values()


class SGLangHostPool(Protocol):
    """What we use of SGLang's ``HostKVCache`` (an MHA or an MLA host pool)."""

    page_size: int
    size: int
    layout: str
    dtype: torch.dtype
    layer_num: int

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None: ...


def is_mla_pool(pool: SGLangHostPool) -> bool:
    return hasattr(pool, "kv_cache_dim")


def pool_parts(pool: SGLangHostPool) -> list[tuple[str, tuple[int, ...]]]:
    """The per-token record shapes a page holds, per part."""
    if is_mla_pool(pool):
        return [("kv", (1, int(pool.kv_cache_dim)))]
    heads = int(pool.head_num)
    return [("k", (heads, int(pool.head_dim))), ("v", (heads, int(pool.v_head_dim)))]


def namespace_of(
    pool: SGLangHostPool,
    *,
    model: str,
    rank: str | None,
    tenant: str | None,
    kv_scales: str | None = None,
) -> StorageNamespace:
    """The namespace of this pool's pages, written by ``model`` on ``rank`` (``kv_scales``:
    the identity of fp8 KV's scales, which SGLang's pool does not name)."""
    layouts = MLA_LAYOUTS if is_mla_pool(pool) else MHA_LAYOUTS
    if pool.layout not in layouts:
        raise InvalidArgumentError(
            f"--hicache-mem-layout {pool.layout!r} is not stored by tiered_kv's HiCache "
            f"backend for this {'MLA' if is_mla_pool(pool) else 'MHA'} pool: use one of "
            f"{', '.join(layouts)}"
        )
    start = int(getattr(pool, "start_layer", 0) or 0)
    return StorageNamespace.create(
        kind="sglang-mla" if is_mla_pool(pool) else "sglang-mha",
        parts=pool_parts(pool),
        dtype=pool.dtype,
        layer_ids=range(start, start + int(pool.layer_num)),
        page_size=int(pool.page_size),
        layout=pool.layout,
        tenant=tenant,
        model=model,
        rank=rank,
        kv_scales=kv_scales,
    )


class HostPoolPages:
    """An SGLang host pool as a ``PageSource``: page ``p`` is the pool's page starting at token
    slot ``p * page_size``. ``get_page_bytes`` returns the flat page as uint8 (a copy where the
    layout scatters a page); ``set_page_bytes`` writes one back through the pool."""

    def __init__(self, pool: SGLangHostPool) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        page = pool.get_dummy_flat_data_page()
        self._page_numel = page.numel()
        self.page_nbytes = page.numel() * page.element_size()
        self.num_pages = int(pool.size) // self.page_size

    def get_page_bytes(self, page: int) -> torch.Tensor:
        flat = self.pool.get_data_page(page * self.page_size, flat=True)
        return flat.contiguous().view(torch.uint8)

    def set_page_bytes(self, page: int, data: object) -> None:
        raw = as_bytes_tensor(data)
        if raw.numel() != self.page_nbytes:
            raise InvalidArgumentError(
                f"a page of {raw.numel()} bytes for a host pool of {self.page_nbytes}-byte pages"
            )
        self.pool.set_from_flat_data_page(page * self.page_size, raw.view(self.pool.dtype))

    def pages_of(self, host_indices: torch.Tensor | Sequence[int], num_keys: int) -> list[int]:
        """The pages ``num_keys`` keys name in SGLang's token-slot ``host_indices`` (one whole
        page of slots per key, each starting on a page boundary)."""
        slots = torch.as_tensor(host_indices).reshape(-1).to(torch.int64)
        if slots.numel() != num_keys * self.page_size:
            raise InvalidArgumentError(
                f"{num_keys} keys need {num_keys * self.page_size} host slots "
                f"(page size {self.page_size}), got {slots.numel()}"
            )
        firsts = slots[:: self.page_size]
        expect = firsts.repeat_interleave(self.page_size) + torch.arange(self.page_size).repeat(
            num_keys
        )
        if bool((firsts % self.page_size).any()) or not torch.equal(slots, expect):
            raise InvalidArgumentError(
                "host_indices must be whole host pages (page-aligned runs of page_size slots)"
            )
        return (firsts // self.page_size).tolist()


class FlatPages:
    """Flat page tensors (SGLang's legacy ``batch_get`` / ``batch_set`` arguments) as a
    ``PageSource``: page ``i`` is ``tensors[i]``."""

    def __init__(self, tensors: Sequence[torch.Tensor], page_nbytes: int) -> None:
        for t in tensors:
            if t.numel() * t.element_size() != page_nbytes or not t.is_contiguous():
                raise InvalidArgumentError(
                    f"a flat page of {t.numel() * t.element_size()} bytes (contiguous: "
                    f"{t.is_contiguous()}); this pool's pages are {page_nbytes} contiguous bytes"
                )
        self.tensors = list(tensors)
        self.page_nbytes = page_nbytes
        self.num_pages = len(self.tensors)

    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.tensors[page].reshape(-1).view(torch.uint8)

    def set_page_bytes(self, page: int, data: object) -> None:
        self.get_page_bytes(page).copy_(as_bytes_tensor(data))

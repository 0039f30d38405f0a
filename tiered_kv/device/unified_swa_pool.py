"""UnifiedSWAKVPool: a sliding-window pool whose full and window sub-pools share one page range.

Both sub-pools are addressed by physical slots of the same ``num_pages`` pages (page 0 their
padding page), which ``UnifiedSWATokenToKVPoolAllocator`` hands out from the two ends of the
range: full pages from the low end, window pages from the high end. A physical page is live in
at most one sub-pool at a time, so together they never hold more than ``num_pages`` pages of
KV, split however the running requests need it.

Callers hold virtual ids, so the pool takes only physical write locs
(``requires_physical_write_loc``): the allocator's ``plan`` binds a batch's virtual ids to
``KVWriteLoc(loc=full slots, swa_loc=window slots, physical=True)`` and an unmarked loc is
refused rather than written at ids that name another token's slots. Layer ids, waits, reads
and the host declarations (``full`` and ``swa``) are the ``SWAKVPool``'s.

By default each sub-pool's per-layer buffers span the whole range (each side may grow to all
of it): the budget is shared in pages, not in bytes. With ``share_bytes`` both sides' layers are
views of one ``SharedKVBuffer`` of ``max(full layers, window layers)`` layer slabs: a physical
page holds full-layer KV while the full side owns it and window-layer KV while the window side
does, so the pool holds the bytes of the larger side only (see docs/device_tier.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.shared_kv_buffer import SharedKVBuffer, SharedMHAPool
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.device.write_loc import KVWriteLoc, write_loc_is_physical
from tiered_kv.errors import InvalidArgumentError, PhysicalWriteLocError


class UnifiedSWAKVPool(SWAKVPool):
    """Full-attention and window layers over one range of ``num_pages`` pages."""

    requires_physical_write_loc = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        swa_attention_layer_ids: Sequence[int],
        device: str | torch.device | None = None,
        *,
        v_head_dim: int | None = None,
        swa_head_num: int | None = None,
        swa_head_dim: int | None = None,
        share_bytes: bool = False,
    ) -> None:
        if not isinstance(share_bytes, bool):
            raise InvalidArgumentError(f"share_bytes must be True or False, got {share_bytes!r}")
        self.num_pages = check_positive_int("num_pages", num_pages)
        size = num_pages * check_positive_int("page_size", page_size)
        self.shared: SharedKVBuffer | None = None
        self._share_bytes = share_bytes
        super().__init__(
            size, size, page_size, dtype, head_num, head_dim, full_attention_layer_ids,
            swa_attention_layer_ids, device, v_head_dim=v_head_dim, swa_head_num=swa_head_num,
            swa_head_dim=swa_head_dim,
        )  # fmt: skip
        self.allocator = None

    def _new_sub_pools(
        self,
        sizes: tuple[int, int],
        page_size: int,
        dtype: torch.dtype,
        layer_nums: tuple[int, int],
        device: str | torch.device | None,
        *,
        full_heads: tuple[int, int, int | None],
        swa_heads: tuple[int, int, int | None],
    ) -> tuple[MHATokenToKVPool, MHATokenToKVPool]:
        if not self._share_bytes:
            return super()._new_sub_pools(
                sizes, page_size, dtype, layer_nums, device, full_heads=full_heads,
                swa_heads=swa_heads,
            )  # fmt: skip
        full, swa = ((h, d, d if dv is None else dv) for h, d, dv in (full_heads, swa_heads))
        if full != swa:
            raise InvalidArgumentError(
                f"share_bytes needs the same heads on both sides; full layers have (head_num, "
                f"head_dim, v_head_dim)={full}, window layers {swa}. Build with "
                "share_bytes=False (the sides then keep buffers of their own)"
            )
        rows = sizes[0] + page_size
        self.shared = SharedKVBuffer(
            rows, max(layer_nums), *full, dtype, platform.resolve_device(device)
        )
        return tuple(
            SharedMHAPool(self.shared, size, page_size, dtype, n, device)
            for size, n in zip(sizes, layer_nums, strict=True)
        )

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the pool owns: the one shared buffer, or each sub-pool's layers."""
        return [self.shared.buffer] if self.shared is not None else super().buffers()

    def get_kv_size_bytes(self) -> int:
        return self.shared.nbytes if self.shared is not None else super().get_kv_size_bytes()

    def attach_allocator(self, allocator) -> None:
        """The unified allocator whose tables ``translate_loc_from_full_to_swa`` reads."""
        if self.allocator is not None and self.allocator is not allocator:
            raise InvalidArgumentError("this UnifiedSWAKVPool already has an allocator")
        self.allocator = allocator

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        raise InvalidArgumentError(
            "a UnifiedSWAKVPool has no full -> window table: build it with "
            "UnifiedSWATokenToKVPoolAllocator, not SWATokenToKVPoolAllocator"
        )

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """Window slots of virtual ids (the allocator's read translation)."""
        if self.allocator is None:
            raise InvalidArgumentError("no allocator attached (build the unified allocator)")
        return self.allocator.translate_loc_from_full_to_swa(kv_indices)

    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write a full layer at ``loc``, a window layer at ``swa_loc`` of a physical loc (the
        allocator's ``plan``); an unmarked loc is refused before anything is written."""
        if not write_loc_is_physical(write_loc):
            raise PhysicalWriteLocError(
                "UnifiedSWAKVPool.set_kv_buffer: write loc is not marked physical; callers hold "
                "virtual ids, so pass allocator.plan(virtual_loc)"
            )
        super().set_kv_buffer(layer_id, write_loc, cache_k, cache_v, k_scale, v_scale)

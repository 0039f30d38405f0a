"""TokenToKVPoolAllocator: page_size 1, every slot allocated on its own, no page table."""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.inputs import check_decode_args, check_extend_args, check_need_size
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Slots are pages of one token: ``free_pages`` is the list of free slots (1..size).
    With nothing to continue, extend and decode are plain ``alloc`` of the token count."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool = False,
        sizing: AllocSizingConfig | None = None,
    ) -> None:
        super().__init__(
            size, 1, dtype, device, kvcache, need_sort, debug_mode=debug_mode, sizing=sizing
        )

    def alloc(self, need_size: int) -> torch.Tensor | None:
        check_need_size(need_size, 1)
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        select_index = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return select_index

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        check_extend_args(
            self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        return self.alloc(extend_num_tokens)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        check_decode_args(self, seq_lens, seq_lens_cpu, last_loc)
        return self.alloc(int(seq_lens.shape[0]))

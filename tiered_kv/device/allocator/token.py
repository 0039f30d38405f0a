"""TokenToKVPoolAllocator: page_size 1, every slot allocated on its own, no page table.

The seed's shape: ``alloc(n)`` is a slice of the free list's head and ``free`` appends the freed
slots behind its tail (``free_list.SlotQueue``: written in place, so a free costs the freed slots,
not the whole list as SGLang's ``torch.cat`` does). The slots handed out are views that nothing
writes again. ``free`` does not deduplicate: each slot is listed once, and debug mode refuses a
repeat or an already free slot (``torch.unique``) before anything changes.
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.free_list import SlotQueue
from tiered_kv.device.allocator.inputs import check_decode_args, check_extend_args
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.errors import InvalidArgumentError


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Slots are pages of one token: ``free_pages`` is the list of free slots (1..size), first
    freed first reused. With nothing to continue, extend and decode are plain ``alloc`` of the
    token count."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
    ) -> None:
        super().__init__(
            size, 1, dtype, device, kvcache, need_sort, debug_mode=debug_mode, sizing=sizing
        )

    def _new_free_list(self) -> SlotQueue:
        return SlotQueue(self.size, self.device)

    def _put(self, page_ids: tuple[torch.Tensor, ...]) -> None:
        for ids in page_ids:  # behind the tail, in order
            self.free_list.put(ids)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The first ``need_size`` free slots (a view of the free list), or None if short."""
        if type(need_size) is not int or need_size < 0:
            raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
        out = self.free_list.take(need_size)
        if out is None and self.need_sort:
            self.merge_and_sort_free()
            out = self.free_list.take(need_size)
        return out

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
        out = self.free_list.take(extend_num_tokens)
        return out if out is not None or not self.need_sort else self.alloc(extend_num_tokens)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        check_decode_args(self, seq_lens, seq_lens_cpu, last_loc)
        bs = seq_lens.shape[0]
        out = self.free_list.take(bs)
        return out if out is not None or not self.need_sort else self.alloc(bs)

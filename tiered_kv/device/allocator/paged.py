"""PagedTokenToKVPoolAllocator: pages of ``page_size`` slots, filled by the allocation kernels."""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.inputs import check_decode_args, check_extend_args, check_need_size
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.errors import OwnershipError
from tiered_kv.kernels import alloc_kernels
from tiered_kv.platform import KernelBackend


def num_new_pages(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Exact pages a batch opens: sum(ceil(seq / P) - ceil(prefix / P)), on CPU copies."""
    after = (seq_lens_cpu + page_size - 1) // page_size
    before = (prefix_lens_cpu + page_size - 1) // page_size
    return int((after - before).sum())


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``free_pages`` holds page ids 1..num_pages (page 0 is padding). ``alloc_extend`` and
    ``alloc_decode`` run a kernel that maps every new token to a slot in one pass, with no
    host-device sync on the fast path; the kernel path (Triton or torch) is chosen once here."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool = False,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        super().__init__(
            size, page_size, dtype, device, kvcache, need_sort, debug_mode=debug_mode, sizing=sizing
        )
        self._kernels = alloc_kernels(self.device, kernel_backend)

    @property
    def kernel_backend(self) -> KernelBackend:
        return self._kernels.backend

    def _take_pages(self, n: int) -> torch.Tensor:
        pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return pages

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots in whole pages (``need_size`` must be a multiple of page_size)."""
        num_pages = check_need_size(need_size, self.page_size) // self.page_size
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        pages = self._take_pages(num_pages)
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        out = (pages[:, None] * self.page_size + offsets).reshape(-1)
        self._debug_check_alloc(out)
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
        pre_cpu, seq_cpu = check_extend_args(
            self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        bs = int(prefix_lens.shape[0])
        if extend_num_tokens == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        exact: int | None = None
        # Optimistic bound: a request opens at most ext // P + 1 pages, so the batch opens at
        # most extend_num_tokens // P + bs (+1 of slack). Proving "enough" this way needs no
        # exact count.
        max_new_pages = extend_num_tokens // self.page_size + bs + 1
        if self.need_sort and max_new_pages > len(self.free_pages):
            exact = num_new_pages(pre_cpu, seq_cpu, self.page_size)
            if exact > len(self.free_pages):
                self.merge_and_sort_free()
        if max_new_pages > len(self.free_pages):
            # The bound cannot prove the pool is deep enough, and both kernel paths read past
            # free_pages when it is not (Triton out of bounds, torch clamping to repeated pages).
            # Pay for the exact count before launching.
            if exact is None:
                exact = num_new_pages(pre_cpu, seq_cpu, self.page_size)
            if exact > len(self.free_pages):
                return None
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        self._kernels.alloc_extend(
            prefix_lens.contiguous(),
            seq_lens.contiguous(),
            last_loc.contiguous(),
            self.free_pages,
            out,
            self.page_size,
        )
        if exact is None:
            exact = num_new_pages(pre_cpu, seq_cpu, self.page_size)
        self._take_pages(exact)
        self._debug_check_alloc(out)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        # seq_lens_cpu: the host already has the lengths, so counting pages costs no sync.
        seq_cpu = check_decode_args(self, seq_lens, seq_lens_cpu, last_loc)
        bs = int(seq_lens.shape[0])
        if bs == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        need = num_new_pages(seq_cpu - 1, seq_cpu, self.page_size)
        if self.need_sort and need > len(self.free_pages):
            self.merge_and_sort_free()
        if need > len(self.free_pages):
            return None
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        self._kernels.alloc_decode(
            seq_lens.contiguous(), last_loc.contiguous(), self.free_pages, out, self.page_size
        )
        self._take_pages(need)
        self._debug_check_alloc(out)
        return out

    def _debug_check_alloc(self, out: torch.Tensor) -> None:
        """Debug mode: the slots handed out are distinct, not padding, and none of their pages
        is still in the free list."""
        if not self.debug_mode or out.numel() == 0:
            return
        if torch.unique(out).numel() != out.numel():
            raise OwnershipError("allocation handed out a slot twice within one call")
        if int(out.min()) < self.page_size:
            raise OwnershipError("allocation handed out a slot of the padding page")
        pages = torch.unique(out // self.page_size)
        if torch.isin(pages, self.get_all_free_pages()).any():
            raise OwnershipError("allocation handed out a page that is still in the free list")

"""PagedTokenToKVPoolAllocator: pages of ``page_size`` slots, filled by the allocation kernels."""

from __future__ import annotations

import torch

from tiered_kv.device.allocator import debug
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.inputs import check_decode_args, check_extend_args, check_need_size
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.kernels import alloc_kernels
from tiered_kv.platform import KernelBackend

# Up to this batch size the host counts new pages in Python from ``tolist()`` (one call) rather
# than with four tensor calls; both read only the CPU copies.
PYTHON_COUNT_MAX_BS = 32


def num_new_pages(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Exact pages a batch opens: sum(ceil(seq / P) - ceil(prefix / P)), on CPU copies."""
    if prefix_lens_cpu.shape[0] <= PYTHON_COUNT_MAX_BS:
        p = page_size
        pre, seq = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()
        return sum((-a // p) - (-s // p) for a, s in zip(pre, seq, strict=True))
    after = (seq_lens_cpu + (page_size - 1)) // page_size
    before = (prefix_lens_cpu + (page_size - 1)) // page_size
    return int((after - before).sum())


def num_decode_pages(seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Pages a decode step opens: requests whose previous length filled whole pages."""
    if page_size == 1:
        return seq_lens_cpu.shape[0]
    if seq_lens_cpu.shape[0] <= PYTHON_COUNT_MAX_BS:
        return sum(1 for s in seq_lens_cpu.tolist() if s % page_size == 1)
    return int((seq_lens_cpu % page_size == 1).sum())


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``free_pages`` holds page ids 1..num_pages (page 0 is padding), last freed first reused.
    ``alloc_extend`` and ``alloc_decode`` count the pages they open from the CPU copies of the
    lengths (no sync), return None when fewer are free, and else run a kernel that maps every
    new token to a slot in one pass; the kernel path (Triton or torch) is chosen once here."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        super().__init__(
            size, page_size, dtype, device, kvcache, need_sort, debug_mode=debug_mode, sizing=sizing
        )
        self._kernels = alloc_kernels(self.device, kernel_backend)
        # Triton reads raw pointers: its arguments must be contiguous.
        self._contiguous = self._kernels.backend is KernelBackend.TRITON

    @property
    def kernel_backend(self) -> KernelBackend:
        return self._kernels.backend

    def _fits(self, num_pages: int) -> bool:
        """Whether ``num_pages`` free pages are at the head (merging staged pages if that
        makes them so)."""
        if num_pages <= self.free_list.count:
            return True
        if self.need_sort:
            self.merge_and_sort_free()
        return num_pages <= self.free_list.count

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots in whole pages (``need_size`` must be a multiple of page_size)."""
        num_pages = check_need_size(need_size, self.page_size) // self.page_size
        if not self._fits(num_pages):
            return None
        pages = self.free_list.live[:num_pages]
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        out = (pages[:, None] * self.page_size + offsets).reshape(-1)
        self.free_list.take(num_pages)
        if self.debug_mode:
            debug.check_alloc(self, out)
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
        if extend_num_tokens == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        # The exact count, from the CPU copies: the kernels read past free_pages when it is
        # short (Triton out of bounds, torch clamping to repeated pages), so it comes first.
        need = num_new_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        if not self._fits(need):
            return None
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        if self._contiguous:
            prefix_lens, seq_lens = prefix_lens.contiguous(), seq_lens.contiguous()
            last_loc = last_loc.contiguous()
        self._kernels.alloc_extend(
            prefix_lens,
            seq_lens,
            last_loc,
            self.free_list.live,
            out,
            self.page_size,
            num_new_pages=need,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        self.free_list.take(need)
        if self.debug_mode:
            debug.check_alloc(self, out)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        check_decode_args(self, seq_lens, seq_lens_cpu, last_loc)
        bs = seq_lens.shape[0]
        if bs == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        # seq_lens_cpu: the host already has the lengths, so counting pages costs no sync.
        need = num_decode_pages(seq_lens_cpu, self.page_size)
        if not self._fits(need):
            return None
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        if self._contiguous:
            seq_lens, last_loc = seq_lens.contiguous(), last_loc.contiguous()
        self._kernels.alloc_decode(
            seq_lens,
            last_loc,
            self.free_list.live,
            out,
            self.page_size,
            num_new_pages=need,
            seq_lens_cpu=seq_lens_cpu,
        )
        self.free_list.take(need)
        if self.debug_mode:
            debug.check_alloc(self, out)
        return out

"""The unified sliding-window allocators: full and window KV in one shared page budget.

Callers hold *virtual* token ids (virtual page * page_size + offset); virtual pages come from a
FIFO queue, allocated by the paged kernels exactly as physical pages are elsewhere. Every live
virtual page is bound to a full physical page and, until its tokens leave the window, to a
window physical page (``TwoEndedPages``: full pages from the low end of one range, window pages
from the high end), so capacity moves between full and window KV as the workload needs.

``translate(t) = v2p[t // P] * P + t % P`` per side. The read translations
(``translate_kv_loc``, ``translate_loc_from_full_to_swa``) map an unbound id to the padding page
and -1 to -1, like the table of ``SWATokenToKVPoolAllocator``; the host transfers
(``translate_kv_indices_for_transfer``, the sub-pool routes) and the write plan (``plan``)
refuse an unbound id instead, so neither a copy nor a write ever lands on padding by accident.

Contracts: a short allocation (either side) returns None and changes nothing; bad input raises
the typed errors before anything changes; frees read the tables (a device sync on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.allocator.capacity import CapacityHooks
from tiered_kv.device.allocator.free_list import SlotQueue
from tiered_kv.device.allocator.inputs import (
    check_decode_args,
    check_extend_args,
    check_free_slots,
    check_index,
)
from tiered_kv.device.allocator.paged import (
    PagedTokenToKVPoolAllocator,
    num_decode_pages,
    num_new_pages,
)
from tiered_kv.device.allocator.unified_swa_free import UnifiedSWAFrees
from tiered_kv.device.allocator.unified_swa_pages import FULL, SWA, TwoEndedPages
from tiered_kv.device.allocator.unified_swa_plan import SideView, check_bound, plan_write_loc
from tiered_kv.device.sizing import AllocSizingConfig, resolve_sizing
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError
from tiered_kv.platform import KernelBackend


class _VirtualPages(PagedTokenToKVPoolAllocator):
    """Virtual pages 1..N, first freed first reused (a queue: a freed id waits longest before
    it names another token, which is what a reader holding stale ids needs)."""

    def _new_free_list(self) -> SlotQueue:
        return SlotQueue(self.num_pages, self.device)


class UnifiedSWAAllocatorBase(CapacityHooks):
    """The shared page range of ``num_pages`` pages, the virtual id queue over as many virtual
    pages, and per side the v2p / p2v tables; sizes that answer for both sides."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: UnifiedSWAKVPool | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
        skip_freed_window: bool = False,
    ) -> None:
        if not isinstance(skip_freed_window, bool):
            raise InvalidArgumentError(
                f"skip_freed_window must be True or False, got {skip_freed_window!r}"
            )
        # The cache's host copies of windowless (tombstoned) pages carry full KV only, so its
        # window route skips a token whose window page was freed instead of refusing the job.
        self.skip_freed_window = skip_freed_window
        self.num_pages = check_positive_int("num_pages", num_pages)
        self.page_size = check_positive_int("page_size", page_size)
        if kvcache is not None and not isinstance(kvcache, UnifiedSWAKVPool):
            raise InvalidArgumentError(
                f"kvcache={kvcache!r:.60} ({type(kvcache).__name__}) is not a UnifiedSWAKVPool; "
                "pass the pool the allocator hands out pages of, or None"
            )
        if kvcache is not None and (
            kvcache.num_pages != num_pages or kvcache.page_size != page_size
        ):
            raise InvalidArgumentError(
                f"kvcache has num_pages={kvcache.num_pages}, page_size="
                f"{kvcache.page_size}; the allocator has num_pages={num_pages}, page_size="
                f"{page_size}; build both from one UnifiedSWAKVPool geometry"
            )
        self.device = platform.resolve_device(device)
        self.dtype = dtype
        # Physical pages are handed out nearest each end, so they are sorted already.
        self.need_sort = bool(need_sort)
        self.sizing = resolve_sizing(sizing, page_size)
        debug_on = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self._virtual = _VirtualPages(
            num_pages * page_size, page_size, dtype, self.device, None, False,
            debug_mode=debug_on, sizing=self.sizing, kernel_backend=kernel_backend,
        )  # fmt: skip
        self.pages = TwoEndedPages(num_pages, num_pages, self.device)
        self._kvcache = kvcache
        if kvcache is not None:
            kvcache.attach_allocator(self)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Tokens in the shared budget (the most either side could hold alone)."""
        return self.num_pages * self.page_size

    @property
    def debug_mode(self) -> bool:
        return self._virtual.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        self._virtual.debug_mode = bool(on)

    def get_kvcache(self) -> UnifiedSWAKVPool | None:
        return self._kvcache

    def virtual_available_size(self) -> int:
        """Tokens no one holds (free virtual ids): every held token has its full page, so the
        cache's slot accounting counts tokens here."""
        return self._virtual.available_size()

    def full_available_size(self) -> int:
        """Tokens the full side alone could take now (its holes and the shared gap)."""
        return self.pages.free_pages(FULL) * self.page_size

    def swa_available_size(self) -> int:
        """Tokens the window side alone could take now (its holes and the shared gap)."""
        return self.pages.free_pages(SWA) * self.page_size

    def available_size(self) -> int:
        """Tokens both sides can take now, a full and a window slot each: what the scheduler
        asks, with no branch on the allocator type."""
        return self.pages.joint_free_pages() * self.page_size

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        """Whether ``num_full_pages`` full and ``num_swa_pages`` window pages fit together."""
        pg = self.pages
        more_f = max(0, num_full_pages - pg.holes(FULL))
        more_s = max(0, num_swa_pages - pg.holes(SWA))
        return more_f + more_s <= pg.gap

    def get_all_free_pages(self) -> torch.Tensor:
        """The free virtual page ids (the queue)."""
        return self._virtual.get_all_free_pages()

    # -- translation ------------------------------------------------------------------------
    def _translate(self, side: str, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64)
        table = self.pages.v2p[side]
        if self.page_size == 1:
            return table[ids]
        ps = self.page_size
        return table[torch.div(ids, ps, rounding_mode="floor")] * ps + ids % ps

    def translate_kv_loc(self, virtual: torch.Tensor) -> torch.Tensor:
        """Full physical slots of virtual ids (read path: unbound -> padding, -1 -> -1)."""
        check_index("virtual", virtual, self._virtual)
        return self._translate(FULL, virtual)

    def translate_loc_from_full_to_swa(self, virtual: torch.Tensor) -> torch.Tensor:
        """Window physical slots of virtual ids (read path: a token whose window KV was freed
        reads the padding page, -1 -> -1)."""
        check_index("virtual", virtual, self._virtual)
        return self._translate(SWA, virtual)

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        """Full physical slots of virtual ``indices`` for a host copy; an id outside the pool
        or without a full page is refused (a copy never reads padding)."""
        return self._physical(FULL, indices, "translate_kv_indices_for_transfer")

    def _physical(self, side: str, indices: torch.Tensor, where: str) -> torch.Tensor:
        check_index("indices", indices, self._virtual)
        self._check_ids(f"{where}: indices", indices)
        check_bound(self, side, indices, where)
        return self._translate(side, indices)

    def _check_ids(self, name: str, ids: torch.Tensor) -> None:
        """Every id of ``ids`` in virtual pages 1..N (page 0 is padding), in every
        mode: one ``aminmax``, as every allocator's free checks its range."""
        check_free_slots(self._virtual, name, ids)

    def host_part_route(self, decl) -> tuple[SideView, Callable[[torch.Tensor], torch.Tensor]]:
        """For a host pool group: (the sub-pool of ``decl`` as an allocator, how a job's virtual
        ids become that sub-pool's physical slots). Full member: full slots; window member:
        window slots, a token without window KV refused (never copied from padding), or, with
        ``skip_freed_window``, translated to 0, which the group skips (full KV only)."""
        kv = self._kvcache
        if kv is None:
            raise InvalidArgumentError("host_part_route needs the allocator built with its pool")
        for side, pool in ((FULL, kv.full_kv_pool), (SWA, kv.swa_kv_pool)):
            if decl.device_pool is pool:
                view = SideView(self, side, pool)
                if side == SWA and self.skip_freed_window:
                    return view, view.physical_or_zero
                return view, view.physical
        raise InvalidArgumentError(f"declaration {decl.name!r} is not one of this pool's")

    def plan(self, virtual_loc: torch.Tensor) -> KVWriteLoc:
        """Bind a batch's virtual write ids to physical write slots: ``KVWriteLoc(loc=full
        slots, swa_loc=window slots, physical=True)``. Ids on the padding page map to it (a
        padded batch); an id whose page is not bound on both sides is refused."""
        check_index("virtual_loc", virtual_loc, self._virtual)
        return plan_write_loc(self, virtual_loc)

    # -- binding ------------------------------------------------------------------------------
    def _bind_fresh(self, vpages: torch.Tensor) -> None:
        """Give freshly allocated virtual pages a full page and a window page each (the joint
        check has passed, so the two ends' choices cannot meet in the gap)."""
        n = int(vpages.shape[0])
        self.pages.bind(FULL, vpages, self.pages.choose(FULL, n))
        self.pages.bind(SWA, vpages, self.pages.choose(SWA, n))

    def _check_continued(self, last_loc: torch.Tensor, used: torch.Tensor) -> None:
        """Debug mode: a request continuing a partly filled page still has that page's window
        binding (a freed one would continue the padding page)."""
        if not self.debug_mode or self.page_size == 1 or last_loc.numel() == 0:
            return
        mid = (used.to(last_loc.device) % self.page_size) != 0
        swa = self._translate(SWA, last_loc)
        if bool((mid & (swa < self.page_size)).any()):
            raise OwnershipError(
                "last_loc's window page was freed while its page is still being filled; "
                "free_swa only whole pages that left the window"
            )


class UnifiedSWATokenToKVPoolAllocator(UnifiedSWAFrees, UnifiedSWAAllocatorBase):
    """The allocator interface over the unified space: ``alloc``, ``alloc_extend`` and
    ``alloc_decode`` return virtual ids, with the argument conventions of the paged allocator
    (``last_loc`` is a virtual id, -1 for no prefix); both sides page in step."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` virtual ids in whole pages, each page bound on both sides."""
        if type(need_size) is not int or need_size < 0 or need_size % self.page_size:
            raise InvalidArgumentError(
                f"need_size={need_size!r} must be an int >= 0 and a multiple of page_size="
                f"{self.page_size}"
            )
        return self._take(need_size // self.page_size, lambda: self._virtual.alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Virtual ids for tokens ``prefix_lens[i]..seq_lens[i]-1`` of every request, request
        after request, continuing each request's last page first."""
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        check_extend_args(self._virtual, *args, extend_num_tokens)
        ps = self.page_size
        need = num_new_pages(prefix_lens_cpu, seq_lens_cpu, ps) if ps > 1 else extend_num_tokens
        if need <= self.pages.joint_free_pages():
            self._check_continued(last_loc, prefix_lens_cpu)
        return self._take(need, lambda: self._virtual.alloc_extend(*args, extend_num_tokens))

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One virtual id per request for the token that makes its length ``seq_lens[i]``."""
        check_decode_args(self._virtual, seq_lens, seq_lens_cpu, last_loc)
        need = num_decode_pages(seq_lens_cpu, self.page_size)
        if need <= self.pages.joint_free_pages():
            self._check_continued(last_loc, seq_lens_cpu - 1)
        return self._take(
            need, lambda: self._virtual.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        )

    def _take(self, need_pages: int, run) -> torch.Tensor | None:
        if need_pages > self.pages.joint_free_pages():
            return None
        # The kernels take the queue's first need_pages ids: bind exactly those.
        fresh = self._virtual.free_list.live[:need_pages].clone()
        out = run()
        if out is None:  # the queue always holds a page per free full page: a bug if here
            raise StateError("the virtual id queue refused what the page space reported free")
        self._bind_fresh(fresh)
        return out

    def clear(self) -> None:
        """Every page free on both sides, the queue full again, an open group dropped."""
        self._virtual.clear()
        self.pages.clear()
        self._group = None

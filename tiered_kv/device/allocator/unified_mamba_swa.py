"""UnifiedMambaSWATokenToKVPoolAllocator: full-attention KV, sliding-window KV and per-request
recurrent state (Mamba conv + temporal) in one budget.

The KV side is ``UnifiedSWATokenToKVPoolAllocator`` unchanged: virtual ids, full and window
pages from the two ends of one page range, ``free_swa`` for tokens that left the window, the
write plan and the host routes of both KV declarations. The state side is ``mamba_allocator``
(a ``BudgetedMambaSlots``): slots of a ``MambaPool``, each holding ``state_slot_pages`` pages
of the same range's budget (the conversion from bytes to pages, and why a count of pages rather
than particular pages, is in ``unified_mamba_swa_budget``). SGLang 0.5.23 shares one byte
buffer the same way (``UnifiedKVPool``: mamba state grows from the low end, window KV floats in
the middle, full KV grows from the high end; the scheduler reserves
``mamba_slot_full_token_cost`` per new state slot), so memory moves between KV and state as
the workload needs.

Every capacity answer covers all three: ``available_size`` (tokens both KV sides can still take,
after the state's pages), ``available_state_slots``, and ``prealloc_fits`` /
``prealloc_reqs_fit`` for tokens and state slots together. What they say fits, allocating does
(in either order: the state changes no KV geometry), and a refused allocation changes nothing.

Contracts: as the unified allocator's (frees read the page tables, a device sync on CUDA); a
state slot handed out by ``alloc_state`` is zeroed first (every sibling state too), since state
left by its previous owner gives silently wrong outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int, same_device
from tiered_kv.device.allocator.inputs import check_extend_args
from tiered_kv.device.allocator.paged import num_new_pages
from tiered_kv.device.allocator.unified_mamba_swa_budget import (
    BudgetedMambaSlots,
    pages_per_state_slot,
)
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa_pages import FULL, SWA
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import IntegrityError, InvalidArgumentError, OwnershipError, StateError
from tiered_kv.platform import KernelBackend


class ExtendWithState(NamedTuple):
    """``alloc_extend_with_state``'s result: the virtual KV ids and the zeroed state slots."""

    out_cache_loc: torch.Tensor
    state_slots: torch.Tensor


def _count(name: str, value: object) -> int:
    return check_positive_int(name, value, minimum=0)


class UnifiedMambaSWATokenToKVPoolAllocator(UnifiedSWATokenToKVPoolAllocator):
    """The unified SWA allocator over ``num_pages`` pages plus the state slots of
    ``mamba_pool``, each costing ``state_slot_pages`` pages (from the pools' bytes unless
    given; ``kvcache`` None needs it given)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: UnifiedSWAKVPool | None,
        mamba_pool: MambaPool,
        need_sort: bool = False,
        *,
        state_slot_pages: int | None = None,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        if not isinstance(mamba_pool, MambaPool):
            raise InvalidArgumentError(f"mamba_pool must be a MambaPool, got {mamba_pool!r:.80}")
        if kvcache is None and state_slot_pages is None:
            raise InvalidArgumentError(
                "without a kvcache the page cost of a state slot is unknown; pass the "
                "UnifiedSWAKVPool or state_slot_pages="
            )
        # Every check before the parent's constructor, which attaches this allocator to the pool.
        if not same_device(mamba_pool.device, platform.resolve_device(device)):
            raise InvalidArgumentError(
                f"mamba_pool is on {mamba_pool.device}; the allocator on {device}"
            )
        cost = (
            pages_per_state_slot(kvcache, mamba_pool)  # type: ignore[arg-type]
            if state_slot_pages is None
            else check_positive_int("state_slot_pages", state_slot_pages)
        )
        if cost > check_positive_int("num_pages", num_pages):
            raise InvalidArgumentError(
                f"one state slot costs {cost} pages and the range has num_pages={num_pages}; "
                f"give at least {cost} pages (or smaller state) so one request can run"
            )
        super().__init__(
            num_pages, page_size, dtype, device, kvcache, need_sort,
            debug_mode=debug_mode, sizing=sizing, kernel_backend=kernel_backend,
        )  # fmt: skip
        self.state_slot_pages = cost
        self.mamba_pool = mamba_pool
        self.mamba_allocator = BudgetedMambaSlots(
            mamba_pool.size, mamba_pool.spec_state_size, self.device, slot_pages=cost,
            free_pages=self._free_pages, debug_mode=self._virtual.debug_mode,
        )  # fmt: skip

    @property
    def debug_mode(self) -> bool:
        return self._virtual.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        self._virtual.debug_mode = bool(on)
        self.mamba_allocator.debug_mode = bool(on)

    def attach_req_pool(self, req_pool: HybridReqToTokenPool) -> None:
        """Make ``req_pool`` draw its state and tracking slots from this budget (it replaces
        the pool's own ``mamba_allocator``, as SGLang wires its unified slot allocator). The
        pool must be built on this ``mamba_pool`` and hold no slot yet (OwnershipError)."""
        if not isinstance(req_pool, HybridReqToTokenPool) or req_pool.mamba_pool is not (
            self.mamba_pool
        ):
            raise InvalidArgumentError("req_pool must be a HybridReqToTokenPool on mamba_pool")
        own = req_pool.mamba_allocator
        if own is self.mamba_allocator:
            return
        if own.available_size() != own.size or own.spec_available_size() != own.spec_size:
            raise OwnershipError(
                "req_pool already holds Mamba slots; attach it before its first alloc"
            )
        req_pool.mamba_allocator = self.mamba_allocator

    # -- sizes --------------------------------------------------------------------------------
    def state_pages_held(self) -> int:
        """Pages of the range the handed-out state (and draft) slots hold."""
        return self.mamba_allocator.held_pages()

    def _free_pages(self) -> int:
        """Pages of the range no KV side holds (holes of both sides and the gap)."""
        pg = self.pages
        return pg.num_pages - pg.live[FULL] - pg.live[SWA]

    def _spare(self, more_state_slots: int = 0) -> int:
        """Free pages neither KV nor the state (with ``more_state_slots`` more) holds."""
        held = self.state_pages_held() + more_state_slots * self.state_slot_pages
        return self._free_pages() - held

    def _joint(self, more_state_slots: int = 0) -> int:
        """Pages both KV sides can take, as many each: the two ends' geometry, and two spare
        pages for each (-1: the state alone does not fit)."""
        spare = self._spare(more_state_slots)
        if spare < 0:
            return -1
        return min(self.pages.joint_free_pages(), spare // 2)

    def full_available_size(self) -> int:
        """Tokens the full side alone could take now (its holes and the gap, while spare)."""
        return min(self.pages.free_pages(FULL), self._spare()) * self.page_size

    def swa_available_size(self) -> int:
        """Tokens the window side alone could take now (its holes and the gap, while spare)."""
        return min(self.pages.free_pages(SWA), self._spare()) * self.page_size

    def available_size(self) -> int:
        """Tokens both KV sides can take now (a full and a window slot each), the state's
        pages left out: what the scheduler asks, with no branch on the allocator type."""
        return self._joint() * self.page_size

    def available_state_slots(self) -> int:
        """State slots ``alloc_state`` could return now (free slots the spare pages can pay for)."""
        return self.mamba_allocator.available_size()

    def new_pages_available(
        self, num_full_pages: int, num_swa_pages: int, num_state_slots: int = 0
    ) -> bool:
        """Whether that many full pages, window pages and state slots fit together."""
        pg = self.pages
        if num_state_slots > self.mamba_allocator.free_slot_count():
            return False
        more_f = max(0, num_full_pages - pg.holes(FULL))
        more_s = max(0, num_swa_pages - pg.holes(SWA))
        spare = self._spare(num_state_slots)
        return more_f + more_s <= pg.gap and num_full_pages + num_swa_pages <= spare

    def _fits(self, kv_pages: int, num_state_slots: int) -> bool:
        if num_state_slots > self.mamba_allocator.free_slot_count():
            return False
        return kv_pages <= self._joint(num_state_slots)

    def prealloc_fits(self, num_tokens: int, num_state_slots: int = 0) -> bool:
        """Whether ``num_tokens`` (rounded up to pages, on both KV sides) and
        ``num_state_slots`` state slots fit now, together."""
        return self._fits(self._pages_for(num_tokens), _count("num_state_slots", num_state_slots))

    def prealloc_reqs_fit(
        self,
        seq_lens: Sequence[int],
        prefix_lens: Sequence[int] | None = None,
        *,
        num_state_slots: int = 0,
    ) -> bool:
        """Whether ``alloc_extend`` of these requests (request i from ``prefix_lens[i]``,
        default 0, to ``seq_lens[i]``: each its own pages) and ``alloc_state(num_state_slots)``
        would both succeed now, in either order. Reads nothing but the counts."""
        seq = [_count(f"seq_lens[{i}]", s) for i, s in enumerate(seq_lens)]
        pre = [0] * len(seq) if prefix_lens is None else list(prefix_lens)
        if len(pre) != len(seq) or any(
            _count("prefix_lens", a) > s for a, s in zip(pre, seq, strict=True)
        ):
            raise InvalidArgumentError(
                f"prefix_lens={pre!r} must pair with seq_lens={seq!r}, each <= its seq_len"
            )
        p = self.page_size
        pages = sum((-a // p) - (-s // p) for a, s in zip(pre, seq, strict=True))
        return self._fits(pages, _count("num_state_slots", num_state_slots))

    # -- allocation ---------------------------------------------------------------------------
    def _take(self, need_pages: int, run) -> torch.Tensor | None:
        # Every KV allocation passes here: KV never takes a page the state pays for.
        if need_pages > self._joint():
            return None
        return super()._take(need_pages, run)

    def alloc_state(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` zeroed state slots (int64), or None and nothing taken when slots or
        pages are short."""
        slots = self.mamba_allocator.alloc(need_size)
        if slots is not None and slots.numel():
            self.mamba_pool.clear_slots(slots)
        return slots

    def free_state(self, slots: torch.Tensor) -> None:
        """Return state slots; their pages go back to the budget. More slots than are held is
        refused always; debug mode also refuses a slot out of range, repeated or already
        free, before anything changes."""
        self.mamba_allocator.free(slots)

    def alloc_extend_with_state(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_state_slots: int,
    ) -> ExtendWithState | None:
        """``alloc_extend`` and ``alloc_state(num_state_slots)`` as one step (new requests
        and their state): both, or None and nothing taken."""
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        check_extend_args(self._virtual, *args, extend_num_tokens)
        n = _count("num_state_slots", num_state_slots)
        ps = self.page_size
        need = num_new_pages(prefix_lens_cpu, seq_lens_cpu, ps) if ps > 1 else extend_num_tokens
        if not self._fits(need, n):
            return None
        out = self.alloc_extend(*args, extend_num_tokens)  # may raise: nothing taken yet
        slots = self.alloc_state(n) if out is not None else None
        if out is None or slots is None:
            raise StateError("the budget refused what prealloc_reqs_fit reported free")
        return ExtendWithState(out, slots)

    def clear(self) -> None:
        """Every KV page and every state slot free again. Whoever held a slot (a request row,
        a cached snapshot) must forget it."""
        super().clear()
        self.mamba_allocator.clear()

    def check_budget(self) -> None:
        """IntegrityError (with the counts) if KV and state together hold more pages than the
        range has, or the ends and spans do not add up."""
        pg, held = self.pages, self.state_pages_held()
        spans = pg.full_top + (pg.num_pages + 1 - pg.swa_bottom)
        if pg.live[FULL] + pg.live[SWA] + held > pg.num_pages or spans + pg.gap != pg.num_pages:
            raise IntegrityError(
                f"full {pg.live[FULL]} + window {pg.live[SWA]} + state {held} pages held of "
                f"{pg.num_pages}; full span {pg.full_top} + window span "
                f"{pg.num_pages + 1 - pg.swa_bottom} + gap {pg.gap} must be {pg.num_pages}"
            )

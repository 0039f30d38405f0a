"""The shared budget of ``UnifiedMambaSWATokenToKVPoolAllocator``: what one recurrent-state slot
costs in pages of the unified range, and the Mamba slot allocator that pays it.

Conversion. The unified SWA range is ``num_pages`` pages, each of which is either a full page or
a window page (``UnifiedSWAKVPool``): one page of the range must be able to hold either, so it
counts as ``page_nbytes = page_size * max(full bytes per token, window bytes per token)``, the
bytes per token summed over that side's layers. A state slot holds every part of the Mamba
pool's declaration and of each registered sibling (``slot_nbytes``, conv and temporal state of
every Mamba layer) and costs ``ceil(slot_nbytes / page_nbytes)`` pages of the range: the
rounding is up, so the state never holds fewer bytes than it uses.

Placement. The state holds a number of pages of the range, not particular pages: its bytes
live in the ``MambaPool``'s own buffers, just as each KV side's buffers span the whole range
(``UnifiedSWAKVPool`` shares its range in pages, not in bytes). What is shared is the budget:
live full pages + live window pages + state pages <= ``num_pages`` at all times, and a KV
allocation must also fit the two ends' geometry (full pages below every window page). So a page
freed anywhere (a finished request, window pages of tokens that left the window, a hole inside a
side's span) can pay for state at once, and no page ever has to move. SGLang, which places the
state in its one byte buffer, closes such holes by moving pages (compaction) instead.

Bookkeeping only: counts in, counts out; the slot ids are ``MambaSlotAllocator``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.device.allocator.mamba_slots import MambaSlotAllocator
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import OwnershipError


def page_nbytes(kvcache: UnifiedSWAKVPool) -> int:
    """Bytes one page of the unified range stands for: the larger side's page."""
    sides = (kvcache.full_kv_pool, kvcache.swa_kv_pool)
    per_token = max(p.bytes_per_token_per_layer() * p.layer_num for p in sides)
    return kvcache.page_size * per_token


def state_slot_nbytes(mamba_pool: MambaPool) -> int:
    """Bytes of one state slot: the pool's own parts and every registered sibling's."""
    decls = (mamba_pool.state_decl(), *(s.state_decl() for s in mamba_pool.slot_states))
    return sum(d.slot_nbytes for d in decls)


def pages_per_state_slot(kvcache: UnifiedSWAKVPool, mamba_pool: MambaPool) -> int:
    """Pages of the unified range one state slot costs (rounded up)."""
    return -(-state_slot_nbytes(mamba_pool) // page_nbytes(kvcache))


class BudgetedMambaSlots(MambaSlotAllocator):
    """``MambaSlotAllocator`` whose every handed-out slot (state or draft) holds ``slot_pages``
    of the range's free pages (``free_pages()``: those no KV side holds, read on every call).
    ``alloc`` / ``alloc_spec`` return None, nothing taken, when the slots or the pages are
    short; ``available_size`` / ``spec_available_size`` count what they could return now.
    Frees also refuse, in any mode and before anything changes, more slots than are held (a
    double free found by counting, no value read); debug mode reads the values as
    ``MambaSlotAllocator`` does."""

    def __init__(
        self,
        size: int,
        spec_size: int,
        device: str | torch.device | None,
        *,
        slot_pages: int,
        free_pages: Callable[[], int],
        debug_mode: bool | None = None,
    ) -> None:
        self.slot_pages = check_positive_int("slot_pages", slot_pages)
        self._free_pages = free_pages
        super().__init__(size, spec_size, device, debug_mode=debug_mode)

    # -- counts -------------------------------------------------------------------------------
    def held_slots(self) -> int:
        """State slots handed out (an open group's unused reserve is not held)."""
        return self.size - super().available_size()

    def held_spec_slots(self) -> int:
        return self.spec_size - super().spec_available_size()

    def held_pages(self) -> int:
        """Pages of the range the handed-out slots hold."""
        return (self.held_slots() + self.held_spec_slots()) * self.slot_pages

    def budget_slots(self) -> int:
        """Slots the pages no one holds could pay for now (state and draft share them)."""
        return max(0, self._free_pages() - self.held_pages()) // self.slot_pages

    def free_slot_count(self) -> int:
        """Free state slots, whatever the pages allow."""
        return super().available_size()

    def available_size(self) -> int:
        return min(super().available_size(), self.budget_slots())

    def spec_available_size(self) -> int:
        return min(super().spec_available_size(), self.budget_slots())

    # -- allocation ---------------------------------------------------------------------------
    # A bad need_size (not an int >= 0) passes the comparison and is refused by the parent.
    def alloc(self, need_size: int) -> torch.Tensor | None:
        if type(need_size) is int and need_size > self.budget_slots():
            return None
        return super().alloc(need_size)

    def alloc_spec(self, need_size: int) -> torch.Tensor | None:
        if type(need_size) is int and need_size > self.budget_slots():
            return None
        return super().alloc_spec(need_size)

    def free(self, slots: torch.Tensor) -> None:
        self._check_count(slots, self.held_slots(), "state")
        super().free(slots)

    def free_spec(self, slots: torch.Tensor) -> None:
        self._check_count(slots, self.held_spec_slots(), "draft")
        super().free_spec(slots)

    def _check_count(self, slots: torch.Tensor, held: int, what: str) -> None:
        n = check_index_tensor("slots", slots, self.device).shape[0]
        if n > held:
            raise OwnershipError(
                f"double free: {n} {what} slots freed but only {held} are held; free each "
                "slot once, only slots this allocator handed out"
            )

"""The scheduler-facing capacity hooks every allocator has.

The scheduler calls these unconditionally, with no allocator-type branches on its side;
byte-accounted composites override the token-count defaults. They read only ``page_size``,
``sizing`` and ``available_size()`` of the allocator they are mixed into.
"""

from __future__ import annotations

from collections.abc import Callable

from tiered_kv.device.sizing import AllocSizingConfig, get_alloc_reserve_per_decode
from tiered_kv.errors import InvalidArgumentError


class CapacityHooks:
    """Token-count capacity answers for an allocator with ``page_size`` and ``sizing``."""

    page_size: int
    sizing: AllocSizingConfig
    available_size: Callable[[], int]  # free tokens: the allocator this is mixed into has it

    def request_slot_reserve(self) -> int:
        """Slots to keep per running request beyond its prefill: the per-step decode reserve
        (twice one step's allocation, for overlap scheduling). Plain pools have no private
        per-request workspace."""
        return get_alloc_reserve_per_decode(self.sizing)

    def max_new_tokens_for_memory(
        self,
        input_tokens: int,
        max_new_tokens: int,
        *,
        token_capacity: int,
        sliding_window_size: int | None = None,
        chunk_size: int | None = None,
    ) -> int | None:
        """Clip generation to an empty pool of ``token_capacity`` tokens: the prompt rounded up
        to pages, one more page for the page the last token may open, and one slot, as the seed
        computes it (0 when that budget is used up). None only when the prompt itself, rounded
        up to pages, cannot fit. ``sliding_window_size``/``chunk_size`` matter only to
        sliding-window composites."""
        for name, value in (
            ("input_tokens", input_tokens),
            ("max_new_tokens", max_new_tokens),
            ("token_capacity", token_capacity),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name}={value!r} must be an int >= 0")
        paged_input = -(-input_tokens // self.page_size) * self.page_size
        if paged_input > token_capacity:
            return None
        return max(0, min(max_new_tokens, token_capacity - paged_input - self.page_size - 1))

    def _pages_for(self, num_tokens: int) -> int:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens={num_tokens!r} must be an int >= 0")
        return -(-num_tokens // self.page_size)

    def prealloc_fits(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` (rounded up to pages) fit in the free pages now."""
        return self._pages_for(num_tokens) * self.page_size <= self.available_size()

    def prealloc_ceiling_fits(self, num_tokens: int, evictable_tokens: int = 0) -> bool:
        """Whether ``num_tokens`` could fit after evicting up to ``evictable_tokens`` cached
        tokens: the ceiling the scheduler may admit to, evicting first if ``prealloc_fits`` is
        False."""
        if (
            isinstance(evictable_tokens, bool)
            or not isinstance(evictable_tokens, int)
            or evictable_tokens < 0
        ):
            raise InvalidArgumentError(f"evictable_tokens={evictable_tokens!r} must be an int >= 0")
        evictable = evictable_tokens // self.page_size * self.page_size
        return self._pages_for(num_tokens) * self.page_size <= self.available_size() + evictable

    def evict_to_free_tokens(self, num_tokens: int, evict_fn: Callable[[int], object]) -> bool:
        """Make ``num_tokens`` available: if short, call ``evict_fn(missing_tokens)`` once (it
        evicts cached KV and frees it into this allocator). Returns whether they now fit."""
        missing = self._pages_for(num_tokens) * self.page_size - self.available_size()
        if missing > 0:
            evict_fn(missing)
        return self.prealloc_fits(num_tokens)

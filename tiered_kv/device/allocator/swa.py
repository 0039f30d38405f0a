"""SWATokenToKVPoolAllocator: two allocators (full attention, sliding window) and the table
that pairs their slots.

Every token gets a full slot and a window slot; ``full_to_swa_index_mapping[full] = window``
pairs them (0: no window peer). The table has ``size + page_size + 1`` entries: the last is a -1
sentinel, so a ``last_loc`` of -1 (a request with no prefix) translates to -1 and the window
side, too, opens a new page instead of continuing one. Both sides page in step (one set of
lengths drives both), so they open the same number of pages; an allocation checks both before
taking anything and changes nothing when either is short.

A token that left the window keeps its full slot and gives its window slot back
(``free_swa``; whole pages at page size > 1, as the pages are shared); ``free`` releases both
(the window peer first: it reads the table), ``free_full`` the full slot of a token whose peer
is already gone. Inside a free group the table is read at free time (a later action in the group
may pair the slot again) and both sub-allocators defer their releases to ``free_group_end``.

With a per-request ring (the pool's ``swa_req_ring_size``) window KV is addressed by request row
(``SWAKVPool.ring_loc``): no window allocator is built, the table is never written, window
capacity is free request rows x ring cost, and the full side alone limits token growth. A reader
that kept (row, generation) checks it with ``ring_loc(..., generations=...)``: a row that changed
owner since then is refused, as its ring now holds another request's window.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tiered_kv import platform
from tiered_kv.device.allocator.base import AllocatorState
from tiered_kv.device.allocator.capacity import CapacityHooks
from tiered_kv.device.allocator.inputs import (
    check_decode_args,
    check_extend_args,
    check_free_slots,
    check_index,
)
from tiered_kv.device.allocator.paged import num_decode_pages, num_new_pages
from tiered_kv.device.allocator.peer_table import new_peer_table, release_peers, sub_allocator
from tiered_kv.device.req_to_token_pool import ReqToTokenPool
from tiered_kv.device.sizing import AllocSizingConfig, resolve_sizing
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError
from tiered_kv.platform import KernelBackend


class SWAAllocatorState(NamedTuple):
    allocator_id: int
    full: AllocatorState
    swa: AllocatorState | None
    mapping: torch.Tensor


class SWATokenToKVPoolAllocator(CapacityHooks):
    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: SWAKVPool,
        need_sort: bool = False,
        req_to_token_pool: ReqToTokenPool | None = None,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        if not isinstance(kvcache, SWAKVPool):
            raise InvalidArgumentError(
                f"kvcache must be an SWAKVPool, got {type(kvcache).__name__}"
            )
        self.page_size = page_size
        self.device = platform.resolve_device(device)
        self.sizing = resolve_sizing(sizing, page_size)
        self._kvcache = kvcache
        self._ring = kvcache.swa_req_ring_size is not None
        self._rows = req_to_token_pool
        debug = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self.full_attn_allocator = self._sub(
            size, dtype, kvcache.full_kv_pool, need_sort, debug, kernel_backend
        )
        self.swa_attn_allocator = None
        if self._ring:
            if req_to_token_pool is None:
                raise InvalidArgumentError(
                    "a per-request SWA ring counts capacity in request rows: pass req_to_token_pool"
                )
            self._ring_cost = kvcache.ring_cost
            if req_to_token_pool.size != kvcache.ring_rows:
                raise InvalidArgumentError(
                    f"the window ring holds {kvcache.ring_rows} request rows but "
                    f"req_to_token_pool has {req_to_token_pool.size}; size the window sub-pool "
                    f"to rows x ring cost ({req_to_token_pool.size} x {self._ring_cost})"
                )
            self.size_swa = req_to_token_pool.size * self._ring_cost
        else:
            self._ring_cost = 0
            self.size_swa = size_swa
            self.swa_attn_allocator = self._sub(
                size_swa, dtype, kvcache.swa_kv_pool, need_sort, debug, kernel_backend
            )
        self.size_full = size
        self.swa_req_ring, self.swa_ring_cost_tokens = self._ring, self._ring_cost
        # Trailing -1: a last_loc of -1 (no prefix) indexes it, so the window side sees -1.
        self.full_to_swa_index_mapping = new_peer_table(size + page_size, self.device)
        kvcache.register_mapping(self.full_to_swa_index_mapping)

    def _sub(self, size, dtype, pool, need_sort, debug, kernel_backend):
        return sub_allocator(
            size, self.page_size, dtype, self.device, pool, need_sort, debug, kernel_backend
        )

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self.size_full, self.size_swa)

    @property
    def debug_mode(self) -> bool:
        return self.full_attn_allocator.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        for a in (self.full_attn_allocator, self.swa_attn_allocator):
            if a is not None:
                a.debug_mode = bool(on)

    def get_kvcache(self) -> SWAKVPool:
        return self._kvcache

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        if self._ring:
            return self._rows.available_size() * self._ring_cost
        return self.swa_attn_allocator.available_size()

    def available_size(self) -> int:
        """Tokens both sides can take now (the ring never limits token growth: its slots are
        the request row's)."""
        if self._ring:
            return self.full_available_size()
        return min(self.full_available_size(), self.swa_available_size())

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        if num_full_pages > self.full_available_size() // ps:
            return False
        return self._ring or num_swa_pages <= self.swa_available_size() // ps

    # -- translation ----------------------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self._kvcache.translate_loc_from_full_to_swa(kv_indices)

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        """Full slots are physical: the identity (window slots travel by the table)."""
        return indices

    def host_part_route(self, decl) -> tuple[object, object]:
        """For a host pool group: (the sub-allocator of ``decl``'s sub-pool, how a job's full
        slots become that sub-pool's slots). A token whose window KV was freed translates to 0,
        which the group skips: its window part is neither copied from the padding slot nor
        loaded back (the cache marks such pages windowless)."""
        kv = self._kvcache
        if decl.device_pool is kv.full_kv_pool:
            return self.full_attn_allocator, None
        if decl.device_pool is not kv.swa_kv_pool:
            raise InvalidArgumentError(f"declaration {decl.name!r} is not one of this pool's")
        if self._ring:
            raise InvalidArgumentError(
                "a per-request ring's window KV belongs to the running request's row; it is not "
                "offloaded (build the host tier from the full declaration only)"
            )
        return self.swa_attn_allocator, self._window_slots

    def host_route_version(self) -> int:
        """Changes whenever the table the window route reads does (a host pool group keeps a
        job's routed slots only while it is unchanged)."""
        return self.full_to_swa_index_mapping._version

    def _window_slots(self, full: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_from_full_to_swa(full.to(torch.int64)).clamp_min(0)

    def ring_loc(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        generations: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Window slots of ``positions`` of request ``rows``; with ``generations`` (what the
        reader saw when it took the row) a row that changed owner since is refused."""
        if not self._ring:
            raise InvalidArgumentError("ring_loc: this allocator's window side is paged")
        if generations is not None:
            now = self._rows.req_generation[rows.to(torch.int64).cpu()]
            stale = now != generations.to(torch.int64).cpu()
            if bool(stale.any()):
                bad = rows.cpu()[stale].tolist()[:8]
                raise StateError(
                    f"request rows {bad} changed owner since their generation was read; their "
                    "rings hold another request's window now"
                )
        return self._kvcache.ring_loc(rows, positions)

    # -- allocation -----------------------------------------------------------------------------
    def _pair(self, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
        self.full_to_swa_index_mapping[full] = swa.to(torch.int64)
        return full

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots on both sides (whole pages at page size > 1), paired."""
        if type(need_size) is not int or need_size < 0:
            raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
        pages = -(-need_size // self.page_size)
        if not self.new_pages_available(pages, pages):
            return None
        full = self.full_attn_allocator.alloc(need_size)
        if self._ring or full is None:
            return full
        return self._pair(full, self._take(self.swa_attn_allocator.alloc(need_size), full))

    def _take(self, swa: torch.Tensor | None, full: torch.Tensor) -> torch.Tensor:
        if swa is None:  # both were checked: only a broken sub-allocator gets here
            self.full_attn_allocator.free(full)
            raise StateError("the window allocator refused what it reported free")
        return swa

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Full slots for the extend (the window peers paired in the table); ``last_loc`` is
        the full slot of each request's last prefix token (-1: none)."""
        check_extend_args(
            self.full_attn_allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
            last_loc, extend_num_tokens,
        )  # fmt: skip
        if self.page_size > 1:
            need = num_new_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        else:
            need = extend_num_tokens
        if not self.new_pages_available(need, need):
            return None
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        if self._ring:
            return self.full_attn_allocator.alloc_extend(*args, last_loc, extend_num_tokens)
        swa_last = self._swa_last_loc(last_loc, prefix_lens_cpu)
        full = self.full_attn_allocator.alloc_extend(*args, last_loc, extend_num_tokens)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_extend(*args, swa_last, extend_num_tokens)
        return self._pair(full, self._take(swa, full))

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        check_decode_args(self.full_attn_allocator, seq_lens, seq_lens_cpu, last_loc)
        need = (
            num_decode_pages(seq_lens_cpu, self.page_size)
            if self.page_size > 1
            else int(seq_lens_cpu.shape[0])
        )
        if not self.new_pages_available(need, need):
            return None
        if self._ring:
            return self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        swa_last = self._swa_last_loc(last_loc, seq_lens_cpu - 1)
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last)
        return self._pair(full, self._take(swa, full))

    def _swa_last_loc(self, last_loc: torch.Tensor, prefix_lens_cpu: torch.Tensor) -> torch.Tensor:
        swa_last = self.translate_loc_from_full_to_swa(last_loc)
        if self.debug_mode and self.page_size > 1:
            # A request continuing a partly filled page continues its window page too: that
            # page must still have its window peer (a freed one reads 0, the padding slot).
            mid = (prefix_lens_cpu.to(swa_last.device) % self.page_size) != 0
            if bool((mid & (swa_last <= 0)).any()):
                raise OwnershipError(
                    "last_loc's window peer was freed while its page is still being filled; "
                    "free_swa only whole pages that left the window"
                )
        return swa_last

    # -- freeing ------------------------------------------------------------------------------
    # Every free checks the full slots' range first, in every mode: the table is indexed with
    # them, and -1 would name its sentinel (a later last_loc of -1 would then read 0).
    def _check_free(self, free_index: torch.Tensor) -> bool:
        """Shape and range of full slots to free; False when there are none."""
        full = self.full_attn_allocator
        check_index("free_index", free_index, full)
        if free_index.shape[0] == 0:
            return False
        check_free_slots(full, "free_index", free_index)
        return True

    def free(self, free_index: torch.Tensor) -> None:
        """Release full slots and their window peers (peers already freed are skipped). A slot
        outside the full pool is refused in every mode before either side changes."""
        if not self._check_free(free_index):
            return
        self._free_swa(free_index)
        self._free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Give back the window peers of full slots ``free_index`` (whole pages at page size
        > 1) and clear their table entries; the full slots stay. A no-op for the ring."""
        if self._ring or not self._check_free(free_index):
            return
        self._free_swa(free_index)

    def _free_swa(self, free_index: torch.Tensor) -> None:
        if self._ring:
            return
        if self.page_size == 1:
            entries = free_index.to(torch.int64)
        else:
            base = free_index.to(torch.int64) // self.page_size * self.page_size
            offsets = torch.arange(self.page_size, dtype=torch.int64, device=base.device)
            entries = (base[:, None] + offsets).reshape(-1)
        release_peers(self.full_to_swa_index_mapping, entries, self.swa_attn_allocator)

    def free_full(self, free_index: torch.Tensor) -> None:
        """Release full slots whose window peers are already gone (``free_swa`` or ring)."""
        if self._check_free(free_index):
            self._free_full(free_index)

    def _free_full(self, free_index: torch.Tensor) -> None:
        if self.debug_mode and not self._ring:
            live = self.full_to_swa_index_mapping[free_index.to(torch.int64)] > 0
            if bool(live.any()):
                raise OwnershipError(
                    f"full slots {free_index[live].tolist()[:8]} still have window peers; "
                    "free() releases both"
                )
        self.full_attn_allocator._free_checked(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """``free`` for a page-aligned segment (see the base allocator's ``free_segment``). The
        full side goes first: it checks everything (start, shape, range, the layout in debug
        mode) before it changes, and it never reads the table the window release clears."""
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)
        if free_index.shape[0]:
            self._free_swa(free_index)

    def free_group_begin(self) -> None:
        for a in (self.full_attn_allocator, self.swa_attn_allocator):
            if a is not None:
                a.free_group_begin()

    def free_group_end(self) -> None:
        for a in (self.full_attn_allocator, self.swa_attn_allocator):
            if a is not None:
                a.free_group_end()

    # -- state ----------------------------------------------------------------------------------
    def clear(self) -> None:
        for a in (self.full_attn_allocator, self.swa_attn_allocator):
            if a is not None:
                a.clear()
        self.full_to_swa_index_mapping[:-1].fill_(0)  # the -1 sentinel stays

    def backup_state(self) -> SWAAllocatorState:
        swa = self.swa_attn_allocator
        return SWAAllocatorState(
            id(self),
            self.full_attn_allocator.backup_state(),
            None if swa is None else swa.backup_state(),
            self.full_to_swa_index_mapping.clone(),
        )

    def restore_state(self, state: SWAAllocatorState) -> None:
        if not isinstance(state, SWAAllocatorState) or state.allocator_id != id(self):
            raise InvalidArgumentError(
                "restore_state needs an SWAAllocatorState from this allocator's backup_state"
            )
        self.full_attn_allocator.restore_state(state.full)
        if self.swa_attn_allocator is not None:
            self.swa_attn_allocator.restore_state(state.swa)
        self.full_to_swa_index_mapping.copy_(state.mapping)

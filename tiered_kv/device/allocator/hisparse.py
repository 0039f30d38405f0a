"""HiSparseTokenToKVPoolAllocator: logical slots for every token, device slots only for some.

A sparse-attention layer reads only the tokens its indexer selects, so a long context need not
live on the device. Two allocators of the same kind share one page size:

- the *logical* allocator (``size * host_to_device_ratio`` slots, no device memory behind it):
  every token gets one; it is what the request table and the prefix tree hold;
- the *device* allocator (``size`` slots, the device KV pool's rows): a token gets one while it
  is on the device (its prefill, then a request's fixed device buffer that selected tokens are
  swapped into).

``logical_to_device[logical]`` is the token's device slot, 0 while it has none; the table has
``logical size + page_size + 1`` entries and its last is a -1 sentinel, so a ``last_loc`` of
-1 translates to -1. Prefill (``alloc_extend``) takes both sides (the model writes its KV on the
device, then it is staged to host); decode (``alloc_decode``) and ``alloc_logical_only`` take
logical slots only; ``alloc_device_buffer`` turns a staged request's device slots into its
fixed buffer (keeping the first ``need``, freeing the surplus pages, topping a short one up);
``free_device`` gives a token's device slot back while its logical slot stays; ``free``
releases both. ``translate_kv_indices_for_transfer`` maps logical ids to device slots for every
transfer: a token without a device slot cannot be copied from or to the device, and is refused.
"""

from __future__ import annotations

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.allocator.capacity import CapacityHooks
from tiered_kv.device.allocator.inputs import (
    check_decode_args,
    check_extend_args,
    check_free_slots,
    check_index,
)
from tiered_kv.device.allocator.paged import num_decode_pages, num_new_pages
from tiered_kv.device.allocator.peer_table import new_peer_table, release_peers, sub_allocator
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError
from tiered_kv.platform import KernelBackend


class HiSparseTokenToKVPoolAllocator(CapacityHooks):
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        host_to_device_ratio: int = 2,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        self.ratio = check_positive_int("host_to_device_ratio", host_to_device_ratio)
        self.page_size = check_positive_int("page_size", page_size)
        self.device = platform.resolve_device(device)
        self.sizing = sizing if sizing is not None else AllocSizingConfig(page_size=page_size)
        self._kvcache = kvcache
        debug = platform.debug_mode() if debug_mode is None else bool(debug_mode)

        def make(n: int, pool: KVCache | None):
            return sub_allocator(
                n, page_size, dtype, self.device, pool, need_sort, debug, kernel_backend
            )

        self.logical_allocator = make(size * self.ratio, None)
        self.device_allocator = make(size, kvcache)
        self.logical_to_device = new_peer_table(size * self.ratio + page_size, self.device)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Logical slots: what the request table and the tree address."""
        return self.logical_allocator.size

    @property
    def size_device(self) -> int:
        return self.device_allocator.size

    @property
    def debug_mode(self) -> bool:
        return self.logical_allocator.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        self.logical_allocator.debug_mode = self.device_allocator.debug_mode = bool(on)

    def get_kvcache(self) -> KVCache | None:
        return self._kvcache

    def logical_available_size(self) -> int:
        return self.logical_allocator.available_size()

    def device_available_size(self) -> int:
        return self.device_allocator.available_size()

    def available_size(self) -> int:
        """Tokens a prefill can take now: both sides."""
        return min(self.logical_available_size(), self.device_available_size())

    # -- translation ----------------------------------------------------------------------------
    def translate_loc(self, logical: torch.Tensor) -> torch.Tensor:
        """Device slots of logical slots (0: none; -1 stays -1)."""
        return self.logical_to_device[logical]

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        """Device slots of logical ``indices``, for a host <-> device copy; a token without a
        device slot is refused (its KV is on the host only)."""
        check_index("indices", indices, self.logical_allocator)
        out = self.logical_to_device[indices.to(torch.int64)]
        if out.numel() and bool((out <= 0).any()):
            bad = indices[out <= 0].tolist()[:8]
            raise StateError(
                f"logical slots {bad} have no device slot; give them one "
                "(alloc_device_buffer) before copying them to or from the device"
            )
        return out

    # -- allocation -----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` logical slots, each with a device slot (whole pages when paged)."""
        if type(need_size) is not int or need_size < 0:
            raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
        if -(-need_size // self.page_size) * self.page_size > self.available_size():
            return None
        logical = self.logical_allocator.alloc(need_size)
        dev = self.device_allocator.alloc(need_size)
        self.logical_to_device[logical] = dev
        return logical

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Prefill: logical and device slots for the extend, paired; None (nothing changed)
        when either side is short. A continued page must still have its device peer."""
        check_extend_args(
            self.logical_allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
            last_loc, extend_num_tokens,
        )  # fmt: skip
        p = self.page_size
        need = num_new_pages(prefix_lens_cpu, seq_lens_cpu, p) if p > 1 else extend_num_tokens
        if need * p > self.logical_available_size() or need * p > self.device_available_size():
            return None
        dev_last = self.logical_to_device[last_loc.to(torch.int64)]
        if p > 1:
            mid = (prefix_lens_cpu.to(dev_last.device) % p) != 0
            if bool((mid & (dev_last <= 0)).any()):
                raise OwnershipError(
                    "a request continues a page whose device slots were given back; a prefill "
                    "continuing a partial page needs that page on the device"
                )
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        logical = self.logical_allocator.alloc_extend(*args, last_loc, extend_num_tokens)
        dev = self.device_allocator.alloc_extend(*args, dev_last, extend_num_tokens)
        if logical is None or dev is None:  # both were checked: a broken sub-allocator
            raise StateError("a sub-allocator refused what it reported free")
        self.logical_to_device[logical] = dev
        return logical

    def alloc_logical_only(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Logical slots only (reservations that are not computed now)."""
        return self.logical_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """A logical slot per request; its device slot comes from the request's buffer."""
        check_decode_args(self.logical_allocator, seq_lens, seq_lens_cpu, last_loc)
        if self.page_size > 1:
            need = num_decode_pages(seq_lens_cpu, self.page_size)
            if need * self.page_size > self.logical_available_size():
                return None
        return self.logical_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_device_buffer(self, logical: torch.Tensor, need: int) -> torch.Tensor | None:
        """A request's fixed device buffer of ``need`` slots (whole pages) from its tokens'
        device slots ``logical`` (all of them lose their device peer): the first ``need`` are
        kept in order, the surplus pages freed; a short set is completed to its last page and
        topped up with new pages. None (nothing changed) when the device is short."""
        p = self.page_size
        if type(need) is not int or need < 0 or need % p:
            raise InvalidArgumentError(f"need={need!r} must be an int >= 0, a multiple of {p}")
        check_index("logical", logical, self.logical_allocator)
        if logical.shape[0]:  # the table is cleared at these ids: -1 would name its sentinel
            check_free_slots(self.logical_allocator, "logical", logical)
        held = self.logical_to_device[logical.to(torch.int64)]
        held = held[held > 0]
        if held.numel() >= need:
            keep, surplus = held[:need], held[need:]
            extra = None
        else:
            tail = (-int(held.numel())) % p
            fill = held[-1] + 1 + torch.arange(tail, device=held.device) if tail else held[:0]
            short = need - int(held.numel()) - tail
            extra = self.device_allocator.alloc(short) if short > 0 else held[:0]
            if extra is None:
                return None
            keep, surplus = torch.cat([held, fill, extra]), held[:0]
        self.logical_to_device[logical.to(torch.int64)] = 0
        if surplus.numel():
            # whole pages only: a page shared with the kept part stays
            kept_pages = keep // p
            pages = torch.unique(surplus // p)
            pages = pages[~torch.isin(pages, kept_pages)]
            if pages.numel():
                self.device_allocator.free_page_ids(pages if p > 1 else pages.clone())
        return keep

    # -- freeing ----------------------------------------------------------------------------
    # Every free checks the range of its ids first, in every mode, before anything changes:
    # the table is indexed with logical ids, and -1 would name its sentinel.
    def _check_logical(self, logical: torch.Tensor) -> bool:
        """Shape and range of logical slots to free; False when there are none."""
        check_index("logical", logical, self.logical_allocator)
        if logical.shape[0] == 0:
            return False
        check_free_slots(self.logical_allocator, "logical", logical)
        return True

    def free_device(self, logical: torch.Tensor) -> None:
        """Give back the device slots of logical slots (whole pages when paged); the logical
        slots stay. Tokens without one are skipped."""
        if self._check_logical(logical):
            self._free_device(logical)

    def _free_device(self, logical: torch.Tensor) -> None:
        release_peers(self.logical_to_device, logical.to(torch.int64), self.device_allocator)

    def free_device_slots(self, device_slots: torch.Tensor) -> None:
        """Give back device slots a caller holds directly (a request's buffer)."""
        check_index("device_slots", device_slots, self.device_allocator)
        if device_slots.numel():
            self.device_allocator.free(device_slots)

    def free(self, logical: torch.Tensor) -> None:
        """Release logical slots and the device slots they still have."""
        if not self._check_logical(logical):
            return
        self._free_device(logical)
        self.logical_allocator._free_checked(logical)

    def free_group_begin(self) -> None:
        self.logical_allocator.free_group_begin()
        self.device_allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.logical_allocator.free_group_end()
        self.device_allocator.free_group_end()

    def clear(self) -> None:
        self.logical_allocator.clear()
        self.device_allocator.clear()
        self.logical_to_device[:-1].fill_(0)  # the -1 sentinel stays

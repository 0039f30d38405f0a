"""MambaSlotAllocator: the free list of a recurrent-state pool's slots (one slot per owner).

A Mamba (or other linear-attention) layer keeps a fixed-size state per request instead of KV
per token, so this allocator hands out whole slots, not token slots, and is not a
``BaseTokenToKVPoolAllocator``. Slots ``1..size`` are the state slots (slot 0 is the padding
row padded batches read and write); ``size + 1 .. size + spec_size`` are speculative draft
slots, allocated from a list of their own so a draft never takes a slot a request or the cache
needs. The owners are request rows (their own state and tracking slots) and the prefix cache
(snapshots it takes directly); the allocator never hands one slot to two of them.

Bookkeeping only, as the token allocator: the free ids live in a ``SlotQueue`` (first freed,
first reused; ``alloc`` returns a view nothing writes again). Every mode refuses a freed slot
out of range or the padding slot (one ``aminmax`` over the slots: a slot outside the range
would enter the free list, be handed out and turn a later free into a double free); debug mode
(``TIERED_KV_DEBUG``) also reads the slots against each other and the free list and refuses a
repeat or a double free. Each raises OwnershipError before anything changes.
"""

from __future__ import annotations

import torch

from tiered_kv import platform
from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.device.allocator.free_list import SlotQueue
from tiered_kv.device.allocator.inputs import outside
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError


def _queue(first: int, n: int, device: torch.device) -> SlotQueue:
    """A queue holding ``first .. first + n - 1``."""
    q = SlotQueue(n, device)
    if first != 1:
        q.replace(torch.arange(first, first + n, dtype=torch.int64, device=device))
    return q


def _need(need_size: object) -> int:
    if type(need_size) is not int or need_size < 0:
        raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
    return need_size


class MambaSlotAllocator:
    """Free slots ``1..size`` and draft slots ``size + 1 .. size + spec_size``.

    ``alloc`` returns int64 slots or None (nothing taken) when too few are free;
    ``available_size()`` counts every slot ``alloc`` could return now, the slots reserved by an
    open group included."""

    def __init__(
        self,
        size: int,
        spec_size: int = 0,
        device: str | torch.device | None = None,
        *,
        debug_mode: bool | None = None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.spec_size = check_positive_int("spec_size", spec_size, minimum=0)
        self.device = platform.resolve_device(device)
        self.debug_mode = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self.clear()

    def clear(self) -> None:
        """Every slot free again, draft slots too; an open group is dropped. The caller owns
        the consequence: whoever held a slot (a row, a cached snapshot) must forget it."""
        self.free_list = _queue(1, self.size, self.device)
        self.spec_free_list = _queue(self.size + 1, self.spec_size, self.device)
        self._reserve: torch.Tensor | None = None

    def available_size(self) -> int:
        reserved = 0 if self._reserve is None else self._reserve.shape[0]
        return self.free_list.count + reserved

    def spec_available_size(self) -> int:
        return self.spec_free_list.count

    def get_all_free_slots(self) -> torch.Tensor:
        """A copy of every free slot (an open group's reserve included), for checks."""
        if self._reserve is None:
            return self.free_list.live.clone()
        return torch.cat((self._reserve, self.free_list.live))

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots (int64, on ``device``), or None and nothing taken. Inside a
        group the reserve is used first."""
        n = _need(need_size)
        r = self._reserve
        if r is None:
            return self.free_list.take(n)
        if n <= r.shape[0]:
            self._reserve = r[n:]
            return r[:n]
        if n > r.shape[0] + self.free_list.count:
            return None
        rest = self.free_list.take(n - r.shape[0])
        self._reserve = r[:0]
        return torch.cat((r, rest))

    def alloc_group_begin(self, num_reqs: int) -> None:
        """Reserve up to ``num_reqs`` slots for the ``alloc`` calls until ``alloc_group_end``
        (one take for a batch of one-slot requests). Fewer are reserved when fewer are free;
        ``available_size`` does not change. StateError if a group is already open."""
        n = _need(num_reqs)
        if self._reserve is not None:
            raise StateError("alloc_group_begin called twice; call alloc_group_end first")
        self._reserve = self.free_list.take(min(n, self.free_list.count))

    def alloc_group_end(self) -> None:
        """Return the group's unused reserve to the free list. StateError without a group."""
        if self._reserve is None:
            raise StateError("alloc_group_end without alloc_group_begin")
        rest, self._reserve = self._reserve, None
        if rest.shape[0]:
            self.free_list.put(rest)

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (1-D int32/int64 on ``device``), each listed once. A slot outside
        ``1..size`` (padding slot 0 included) raises OwnershipError first in every mode; in
        debug mode so does a slot repeated or already free."""
        idx = check_index_tensor("slots", slots, self.device)
        if not idx.shape[0]:
            return
        self._check_range(idx, 1, self.size, "slots")
        if self.debug_mode:
            self._check_owned(idx, self.get_all_free_slots(), "slots")
        self.free_list.put(idx)

    # -- speculative draft slots ----------------------------------------------------------
    def alloc_spec(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` draft slots from ``size + 1 .. size + spec_size``, or None."""
        return self.spec_free_list.take(_need(need_size))

    def free_spec(self, slots: torch.Tensor) -> None:
        """Return draft slots, checked as ``free`` checks state slots (the range always, the
        rest in debug mode)."""
        idx = check_index_tensor("slots", slots, self.device)
        if not idx.shape[0]:
            return
        if not self.spec_size:
            raise OwnershipError("this allocator has no draft slots (spec_size=0); none to free")
        self._check_range(idx, self.size + 1, self.size + self.spec_size, "draft slots")
        if self.debug_mode:
            self._check_owned(idx, self.spec_free_list.live, "draft slots")
        self.spec_free_list.put(idx)

    @staticmethod
    def _check_range(idx: torch.Tensor, lo: int, hi: int, what: str) -> None:
        """Every slot in ``lo..hi`` (inclusive), in every mode."""
        bad = outside(idx, lo, hi + 1)
        if bad is not None:
            pad = " (slot 0 is padding: never handed out, never freed)" if 0 in bad else ""
            raise OwnershipError(
                f"{what} {bad} cannot be freed; valid {what} are {lo}..{hi}{pad}; nothing was "
                "changed"
            )

    @staticmethod
    def _check_owned(idx: torch.Tensor, free_now: torch.Tensor, what: str) -> None:
        """Debug mode: no slot listed twice or already free."""
        uniq = torch.unique(idx)
        if uniq.numel() != idx.numel():
            raise OwnershipError(f"{what} {sorted(idx.tolist())[:16]} repeat; each frees once")
        dup = idx[torch.isin(idx, free_now.to(idx.dtype))]
        if dup.numel():
            raise OwnershipError(f"double free: {what} {dup[:8].tolist()} are already free")

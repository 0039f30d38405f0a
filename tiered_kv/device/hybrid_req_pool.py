"""HybridReqToTokenPool: request rows that each own a Mamba state slot (hybrid linear models).

Every request row holds, besides its token row, one slot of the :class:`MambaPool` (its
recurrent state, and every registered sibling state) and, with the extra buffer, tracking slots
where the state at a tracking boundary is kept for the prefix cache: two under overlap
scheduling (a ping-pong pair: step t writes while step t-1's copy is still read), one
otherwise, one now and one deferred in lazy mode (``ensure_tracking_slots``). See
``sizing.get_mamba_tracking_slots``.

The Mamba slot count is the pool's own, independent of the row count: tracking slots and the
snapshots the prefix cache takes straight from ``mamba_allocator`` share it. Ownership:

- a slot is owned by at most one of: a row (own or tracking), the cache, the free list;
- a slot handed to a row is cleared first (Mamba buffers and every sibling): recurrent state
  leaking from the slot's previous owner would give silently wrong outputs;
- ``req_generation[row]`` (bumped per row allocation) and ``mamba_slot_generation[slot]``
  (bumped each time a row is given the slot; the request keeps it as ``mamba_generation``) are
  never reset, so an asynchronous reader can detect reuse.

Who owns the buffer declares its host copy: this pool declares the state (``state_pool_decls``),
the hybrid KV pool only the KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int, same_device
from tiered_kv.device.allocator.mamba_slots import MambaSlotAllocator
from tiered_kv.device.mamba_pool import MambaPool, State
from tiered_kv.device.req_to_token_pool import ReqToTokenPool, RequestKV
from tiered_kv.device.sizing import get_mamba_tracking_slots
from tiered_kv.device.slot_states import NGramPool, ShortConvPool
from tiered_kv.device.state_decl import StatePoolDecl
from tiered_kv.errors import IntegrityError, InvalidArgumentError, OwnershipError


@dataclass
class HybridRequestKV(RequestKV):
    """``RequestKV`` plus the request's Mamba slot, its tracking slots (one entry per
    ping-pong position, -1 where a lazily deferred slot is not allocated yet) and the slot's
    generation when it was bound."""

    mamba_pool_idx: int | None = None
    mamba_tracking: list[int] = field(default_factory=list)
    mamba_generation: int = 0

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None


def _hybrid_kv(req: Any) -> HybridRequestKV:
    kv = getattr(req, "kv", req)
    if not isinstance(kv, HybridRequestKV):
        raise InvalidArgumentError(
            f"request {req!r:.80} has no HybridRequestKV; a hybrid pool needs HybridRequestKV "
            "objects or objects with a .kv HybridRequestKV"
        )
    return kv


class HybridReqToTokenPool(ReqToTokenPool):
    """Rows ``1..size`` as ``ReqToTokenPool``, each bound to a Mamba slot of ``mamba_pool``.

    ``req_index_to_mamba_index_mapping[row]`` (int32) is the row's slot, 0 for a free row (the
    padding slot); with the extra buffer ``req_index_to_mamba_tracking_mapping[row]`` (int64,
    ``tracking_buffer_size`` entries) its tracking slots, -1 for a deferred one."""

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device | None = None,
        *,
        mamba_pool: MambaPool,
        enable_extra_buffer: bool = False,
        overlap: bool = True,
        lazy: bool = False,
        short_conv: ShortConvPool | None = None,
        ngram: NGramPool | None = None,
        debug_mode: bool | None = None,
    ) -> None:
        if not isinstance(mamba_pool, MambaPool):
            raise InvalidArgumentError(f"mamba_pool must be a MambaPool, got {mamba_pool!r:.80}")
        dev = platform.resolve_device(device)
        if not same_device(mamba_pool.device, dev):
            raise InvalidArgumentError(f"mamba_pool is on {mamba_pool.device}; this pool on {dev}")
        for sib, cls in ((short_conv, ShortConvPool), (ngram, NGramPool)):
            if sib is not None and not isinstance(sib, cls):
                raise InvalidArgumentError(f"{cls.__name__} expected, got {sib!r:.60}")
        siblings = [s for s in (short_conv, ngram) if s is not None and s.enabled]
        for s in siblings:  # every check before the first registration: no half-registered pool
            mamba_pool.check_slot_state(s)
        self.enable_extra_buffer = bool(enable_extra_buffer)
        self.initial_tracking_slots = get_mamba_tracking_slots(
            extra_buffer=self.enable_extra_buffer, overlap=overlap, lazy=lazy
        )
        ping_pong = get_mamba_tracking_slots(extra_buffer=True, overlap=overlap)
        self.tracking_buffer_size = ping_pong if self.enable_extra_buffer else 0
        self.mamba_pool, self.short_conv_pool, self.ngram_pool = mamba_pool, short_conv, ngram
        self.mamba_allocator = MambaSlotAllocator(
            mamba_pool.size, mamba_pool.spec_state_size, dev, debug_mode=debug_mode
        )
        self.mamba_map = dict(mamba_pool.mamba_map)
        rows = check_positive_int("size", size) + 1
        self.req_index_to_mamba_index_mapping = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.req_index_to_mamba_tracking_mapping = (
            torch.zeros((rows, self.tracking_buffer_size), dtype=torch.int64, device=dev)
            if self.enable_extra_buffer
            else None
        )
        self.mamba_slot_generation = torch.zeros(mamba_pool.num_rows, dtype=torch.int64)
        # Host-side mirror of who holds what (row -> own slot, 0 for a free row; row -> its
        # tracking entries), so ownership checks never read the device.
        self._row_mamba = np.zeros(rows, dtype=np.int64)
        self._row_tracking: dict[int, list[int]] = {}
        super().__init__(size, max_context_len, dev)
        for s in siblings:
            mamba_pool.register_slot_state(s)

    def clear(self) -> None:
        """Free every row and every Mamba slot, the cache's snapshots included (the cache must
        drop them too). Generations stay monotonic."""
        super().clear()
        self.mamba_allocator.clear()
        self._row_mamba[:] = 0
        self._row_tracking.clear()
        self.req_index_to_mamba_index_mapping.zero_()
        if self.req_index_to_mamba_tracking_mapping is not None:
            self.req_index_to_mamba_tracking_mapping.zero_()

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """Rows for ``reqs``. A fresh request gets a row, a cleared Mamba slot and
        ``initial_tracking_slots`` cleared tracking slots; a continuing one (holding a row and
        its slot) keeps them. Returns every request's row, or None with nothing taken and
        nothing bound when rows or Mamba slots are short. A request with a slot but no row is
        refused: slots come with a row (copy a cached state into it after ``alloc``)."""
        kvs = [_hybrid_kv(r) for r in reqs]
        fresh = [kv for kv in kvs if not kv.holds_kv]
        for kv in fresh:
            if kv.holds_mamba or kv.mamba_tracking:
                raise OwnershipError(
                    f"request holds Mamba slot {kv.mamba_pool_idx} / tracking "
                    f"{kv.mamba_tracking} but no row; a slot is bound with a row by alloc()"
                )
        for kv in kvs:
            if kv.holds_kv:
                self._check_binding(kv)
        per = 1 + self.initial_tracking_slots
        if len(fresh) * per > self.mamba_allocator.available_size():
            return None
        out = super().alloc(reqs)
        if out is None or not fresh:
            return out
        rows = [kv.req_pool_idx for kv in fresh]
        slots = self.mamba_allocator.alloc(len(fresh) * per)
        if slots is None:  # cannot happen after the check above; never leave rows behind
            ReqToTokenPool.free(self, rows)  # type: ignore[arg-type]
            self.req_generation[rows] -= 1
            for kv in fresh:
                kv.req_pool_idx = None
            return None
        self.mamba_pool.clear_slots(slots)
        ids = slots.tolist()
        self.mamba_slot_generation[ids] += 1
        tracks = []
        for j, kv in enumerate(fresh):
            own, track = ids[j * per], ids[j * per + 1 : (j + 1) * per]
            track += [-1] * (self.tracking_buffer_size - len(track))
            kv.mamba_pool_idx, kv.mamba_tracking = own, list(track)
            kv.mamba_generation = int(self.mamba_slot_generation[own])
            self._row_mamba[kv.req_pool_idx] = own
            self._row_tracking[kv.req_pool_idx] = list(track)  # type: ignore[index]
            tracks.append(track)
        self._write_mapping(rows, ids[::per], tracks)  # type: ignore[arg-type]
        return out

    def ensure_tracking_slots(self, req: Any) -> bool:
        """Fill every empty tracking entry of ``req`` (the lazily deferred slot) with a cleared
        slot. True when the request now holds all ``tracking_buffer_size`` (always True
        without the extra buffer); False, nothing taken, when slots are short."""
        kv = _hybrid_kv(req)
        self._check_binding(kv)
        empty = [i for i, s in enumerate(kv.mamba_tracking) if s < 0]
        if not empty:
            return True
        slots = self.mamba_allocator.alloc(len(empty))
        if slots is None:
            return False
        self.mamba_pool.clear_slots(slots)
        ids = slots.tolist()
        self.mamba_slot_generation[ids] += 1
        for i, s in zip(empty, ids, strict=True):
            kv.mamba_tracking[i] = s
        self._set_tracking(kv)
        return True

    def release_tracking_slot(self, req: Any, index: int) -> int:
        """Hand tracking entry ``index`` of ``req`` to the caller (the prefix cache keeping the
        tracked state as a snapshot) and leave the entry empty (-1; ``ensure_tracking_slots``
        refills it). The caller owns the returned slot and frees it through
        ``mamba_allocator.free``. OwnershipError if the entry is empty."""
        kv = _hybrid_kv(req)
        self._check_binding(kv)
        if type(index) is not int or not 0 <= index < len(kv.mamba_tracking):
            raise InvalidArgumentError(
                f"index={index!r}; tracking entries are 0..{len(kv.mamba_tracking) - 1}"
            )
        slot = kv.mamba_tracking[index]
        if slot < 0:
            raise OwnershipError(f"tracking entry {index} of row {kv.req_pool_idx} is empty")
        kv.mamba_tracking[index] = -1
        self._set_tracking(kv)
        return slot

    def free(self, rows: int | Iterable[int] | torch.Tensor | Any) -> None:
        """Free rows (ints, a tensor, or a request) with their Mamba and tracking slots; a
        request's fields are reset. A row that is padding, out of range, free or repeated,
        or a request whose slots disagree with its row, raises and frees nothing."""
        is_req = isinstance(rows, RequestKV) or hasattr(rows, "kv")
        if is_req:
            kv = _hybrid_kv(rows)
            self._check_binding(kv)
            idx = [kv.req_pool_idx]
        elif isinstance(rows, torch.Tensor):
            idx = [int(x) for x in rows.reshape(-1).tolist()]
        else:
            idx = [rows] if isinstance(rows, int) else [int(x) for x in rows]
        bad = [i for i in idx if isinstance(i, bool) or not 1 <= i <= self.size]
        if bad or len(set(idx)) != len(idx) or any(self._row_mamba[i] == 0 for i in idx):
            raise OwnershipError(
                f"rows {idx[:16]} cannot be freed: each must be an allocated row in "
                f"1..{self.size}, listed once (row 0 is padding)"
            )
        if not idx:
            return
        slots = [int(self._row_mamba[i]) for i in idx]
        slots += [s for i in idx for s in self._row_tracking.get(i, []) if s >= 0]
        self.mamba_allocator.free(torch.tensor(slots, dtype=torch.int64, device=self.device))
        ReqToTokenPool.free(self, rows if is_req else idx)
        self._row_mamba[idx] = 0
        for i in idx:
            self._row_tracking.pop(i, None)
        self._write_mapping(idx, [0] * len(idx), [[0] * self.tracking_buffer_size] * len(idx))
        if is_req:
            kv.mamba_pool_idx, kv.mamba_tracking = None, []

    # -- reads ------------------------------------------------------------------------------
    def get_mamba_indices(self, rows: torch.Tensor) -> torch.Tensor:
        """The Mamba slots of request ``rows`` (0 for a free row)."""
        return self.req_index_to_mamba_index_mapping[rows]

    def mamba2_layer_cache(self, layer_id: int) -> State:
        return self.mamba_pool.layer_cache(layer_id)

    def copy_mamba_state(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy slots' state, every sibling too (e.g. a cached snapshot into a row's slot)."""
        self.mamba_pool.copy_from(src_slots, dst_slots)

    def mamba_slots_in_use(self) -> list[int]:
        """Every slot rows hold (their own and their tracking slots), sorted."""
        own = [int(s) for s in self._row_mamba if s]
        return sorted(own + [s for t in self._row_tracking.values() for s in t if s >= 0])

    def state_pool_decls(self) -> tuple[StatePoolDecl, ...]:
        """The Mamba pool's declaration and each registered sibling's, in registration order."""
        pool = self.mamba_pool
        return (pool.state_decl(), *(s.state_decl() for s in pool.slot_states))

    def check_integrity(self) -> None:
        """Rows hold distinct slots, none of them free. IntegrityError with the counts."""
        held = self.mamba_slots_in_use()
        free = set(self.mamba_allocator.get_all_free_slots().tolist())
        both = sorted(set(held) & free)
        if len(set(held)) != len(held) or both:
            raise IntegrityError(
                f"{len(held)} slots held by rows, {len(set(held))} distinct; {len(both)} of "
                f"them also free: {both[:8]}"
            )

    # -- internals ----------------------------------------------------------------------------
    def _check_binding(self, kv: HybridRequestKV) -> None:
        row = kv.req_pool_idx
        if (
            not isinstance(row, int)
            or not 1 <= row <= self.size
            or kv.mamba_pool_idx is None
            or self._row_mamba[row] != kv.mamba_pool_idx
            or self._row_tracking.get(row) != kv.mamba_tracking
        ):
            raise OwnershipError(
                f"request claims row {row!r} with Mamba slot {kv.mamba_pool_idx!r} and tracking "
                f"{kv.mamba_tracking}, which this pool did not bind together"
            )

    def _set_tracking(self, kv: HybridRequestKV) -> None:
        self._row_tracking[kv.req_pool_idx] = list(kv.mamba_tracking)  # type: ignore[index]
        self._write_mapping([kv.req_pool_idx], None, [kv.mamba_tracking])  # type: ignore[list-item]

    def _write_mapping(
        self, rows: list[int], own: list[int] | None, tracks: list[list[int]]
    ) -> None:
        r = torch.tensor(rows, dtype=torch.int64, device=self.device)
        if own is not None:
            own_t = torch.tensor(own, dtype=torch.int32, device=self.device)
            self.req_index_to_mamba_index_mapping[r] = own_t
        if self.req_index_to_mamba_tracking_mapping is not None:
            t = torch.tensor(tracks, dtype=torch.int64, device=self.device)
            self.req_index_to_mamba_tracking_mapping[r] = t

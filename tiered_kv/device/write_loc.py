"""KVWriteLoc: where a batch's KV is written, carried in attention metadata, not in the pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv._checks import as_index_tensor, check_index_tensor, check_range
from tiered_kv.errors import InvalidArgumentError


@dataclass
class KVWriteLoc:
    """Write target(s) for ``KVCache.set_kv_buffer``.

    - ``loc``: the per-token write slots (the allocator's ``out_cache_loc``).
    - ``swa_loc``: the same tokens' slots in a sliding-window sub-pool (hybrid pools only).
    - ``full_loc``: optional slots in the full-attention sub-pool, same id space as ``loc``;
      pools fall back to ``loc`` when it is None.
    - ``physical``: True when ``loc`` is already in physical slot space. Pools whose ids are
      virtual (``requires_physical_write_loc``) refuse an unmarked loc rather than write to the
      wrong page.

    ``swa_loc``/``full_loc`` are resolved once from the padded ``out_cache_loc``; paths that later
    narrow ``loc`` (piecewise or DP padding) narrow them to the same length here, which is valid
    because all three share one per-token order. A sub-loc shorter than ``loc`` cannot be
    narrowed and is refused.
    """

    loc: torch.Tensor
    swa_loc: torch.Tensor | None = None
    full_loc: torch.Tensor | None = None
    physical: bool = False

    def __post_init__(self) -> None:
        check_index_tensor("KVWriteLoc.loc", self.loc, None)
        n = self.loc.shape[0]
        for name in ("swa_loc", "full_loc"):
            sub = getattr(self, name)
            if sub is None:
                continue
            check_index_tensor(f"KVWriteLoc.{name}", sub, self.loc.device)
            if sub.shape[0] < n:
                raise InvalidArgumentError(
                    f"KVWriteLoc.{name} has {sub.shape[0]} entries but loc has {n}; a sub-pool "
                    "loc must cover every token of loc (it may be longer, then it is narrowed)"
                )
            if sub.shape[0] != n:
                setattr(self, name, sub[:n])

    def __len__(self) -> int:
        return int(self.loc.shape[0])

    @property
    def target_full_loc(self) -> torch.Tensor:
        return self.full_loc if self.full_loc is not None else self.loc

    @classmethod
    def for_batch(
        cls,
        forward_batch: Any,
        *,
        swa_loc: torch.Tensor | None = None,
        full_loc: torch.Tensor | None = None,
    ) -> KVWriteLoc:
        """The batch's ``out_cache_loc`` as a write loc, carrying the batch's physical mark
        (``out_cache_loc_is_physical``, False when absent). ``swa_loc``/``full_loc`` passed here
        travel under the same mark, so they must come from the same plan; a loc produced
        separately states its own mark with ``KVWriteLoc(loc, physical=...)``."""
        loc = getattr(forward_batch, "out_cache_loc", None)
        if loc is None:
            raise InvalidArgumentError(
                f"forward_batch {type(forward_batch).__name__} has no out_cache_loc"
            )
        physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
        return cls(loc, swa_loc, full_loc, physical=physical)


def as_write_loc(loc_info: KVWriteLoc | torch.Tensor) -> KVWriteLoc:
    """A bare tensor is an unmarked (not physical) write loc."""
    if isinstance(loc_info, KVWriteLoc):
        return loc_info
    return KVWriteLoc(loc_info)


def write_loc_is_physical(loc_info: KVWriteLoc | torch.Tensor) -> bool:
    return isinstance(loc_info, KVWriteLoc) and loc_info.physical


def write_loc_of(allocator: Any, pool: Any, slots: object) -> KVWriteLoc:
    """The write loc of ``slots``, ids as ``allocator`` hands them out: its physical plan where
    ``pool`` takes physical locs only (virtual ids: a unified sliding-window pool), the device
    slots of logical ids (a HiSparse allocator's), else the slots themselves with their window
    slots where the allocator has a full -> window table.

    ``slots``: a 1-D integer tensor, or a numpy integer array or sequence of ints (made an int64
    tensor on the pool's device). Ids that index a table here are checked against it first
    where that is free (CPU tensors, converted sequences) or the pool is in debug mode, as the
    pools and the plan check theirs. Raises InvalidArgumentError naming a bad value."""
    converted = not isinstance(slots, torch.Tensor)
    slots = as_index_tensor("slots", slots, torch.device("cpu"))
    check = slots.device.type == "cpu" or getattr(pool, "debug_mode", False)
    if converted:
        slots = slots.to(pool.device)
    ids = slots.to(torch.int64)
    to_device = getattr(allocator, "logical_to_device", None)
    if to_device is not None:  # HiSparse: logical ids, their device rows through the table
        _check_ids(ids, to_device, check)
        return KVWriteLoc(to_device[ids])
    if pool.requires_physical_write_loc:
        return allocator.plan(ids)
    to_window = getattr(allocator, "translate_loc_from_full_to_swa", None)
    if to_window is None:
        return KVWriteLoc(slots)
    _check_ids(ids, allocator.full_to_swa_index_mapping, check)
    return KVWriteLoc(slots, swa_loc=to_window(ids))


def _check_ids(ids: torch.Tensor, table: torch.Tensor, check: bool) -> None:
    # Indexing would wrap a negative id, or fail untyped past the end; the table's last entry
    # is a -1 sentinel (for a last_loc of -1), never a slot's.
    if check:
        check_range("slots", ids, 0, table.shape[0] - 1)

"""Virtual ids to physical slots for writes and host copies of the unified SWA allocator.

``plan_write_loc`` is the write plan's bind step: a batch's virtual write ids become one
``KVWriteLoc`` marked physical (full slots in ``loc``, window slots in ``swa_loc``), the only
kind of loc the unified pool accepts. ``SideView`` is one sub-pool as the host tier sees an
allocator: its ``physical`` gives that sub-pool's physical slots of virtual ids. Both refuse an id
whose page is unbound rather than map it to the padding page, so a write or a copy never
lands on padding (or on another token's bytes) by accident.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tiered_kv.device.allocator.unified_swa_pages import TwoEndedPages
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, StateError


class UnifiedSWAView(Protocol):
    """What these helpers read of the unified allocator (``UnifiedSWAAllocatorBase`` has it all)."""

    page_size: int
    num_pages: int
    device: torch.device
    debug_mode: bool
    pages: TwoEndedPages

    def _translate(self, side: str, ids: torch.Tensor) -> torch.Tensor: ...

    def _physical(self, side: str, indices: torch.Tensor, where: str) -> torch.Tensor: ...


def check_bound(alloc: UnifiedSWAView, side: str, ids: torch.Tensor, where: str) -> None:
    """Every id (valid, not padding) lies on a virtual page bound on ``side``."""
    if ids.numel() == 0:
        return
    pages = torch.div(ids.to(torch.int64), alloc.page_size, rounding_mode="floor")
    unbound = alloc.pages.v2p[side][pages] <= 0
    if bool(unbound.any()):
        what = "full" if side == "full" else "window"
        raise StateError(
            f"{where}: virtual ids {ids[unbound][:8].tolist()} have no {what} page (freed, "
            f"{'or never allocated' if side == 'full' else 'or left the window'}); copy or "
            "write only ids that are live on that side"
        )


def plan_write_loc(alloc: UnifiedSWAView, virtual_loc: torch.Tensor) -> KVWriteLoc:
    """``KVWriteLoc(full slots, swa_loc=window slots, physical=True)`` of ``virtual_loc``.

    Ids on virtual page 0 (a padded batch's lanes) map to the padding page of both sides. The
    value checks (range, both sides bound) read the ids: always on a CPU, in debug mode on a
    GPU, as the pools check their write slots."""
    ps = alloc.page_size
    if virtual_loc.is_cpu or alloc.debug_mode:
        top = (alloc.num_pages + 1) * ps
        if virtual_loc.numel() and (int(virtual_loc.min()) < 0 or int(virtual_loc.max()) >= top):
            bad = virtual_loc[(virtual_loc < 0) | (virtual_loc >= top)][:8].tolist()
            raise InvalidArgumentError(
                f"plan: virtual ids {bad} are outside [0, {top}) (0..{ps - 1}: padding)"
            )
        real = virtual_loc[virtual_loc >= ps]
        check_bound(alloc, "full", real, "plan")
        check_bound(alloc, "swa", real, "plan")
    return KVWriteLoc(
        alloc._translate("full", virtual_loc),
        swa_loc=alloc._translate("swa", virtual_loc),
        physical=True,
    )


class SideView:
    """One sub-pool of the unified allocator as a host pool group member sees its allocator.
    The group's route translates a job's virtual ids first (``physical``), for every member
    before any member copies, so one member's refusal leaves every host buffer untouched; the
    member's own ``translate_kv_indices_for_transfer`` then receives physical slots already
    and passes them through."""

    def __init__(self, alloc: UnifiedSWAView, side: str, pool: MHATokenToKVPool) -> None:
        self._alloc, self.side, self._pool = alloc, side, pool
        self.page_size = alloc.page_size
        self.device = alloc.device

    @property
    def debug_mode(self) -> bool:
        return self._alloc.debug_mode

    def get_kvcache(self):
        return self._pool

    def physical(self, indices: torch.Tensor) -> torch.Tensor:
        """This sub-pool's physical slots of virtual ``indices``; an unbound id is refused."""
        where = f"host transfer ({self.side} sub-pool)"
        return self._alloc._physical(self.side, indices, where)

    def physical_or_zero(self, indices: torch.Tensor) -> torch.Tensor:
        """This sub-pool's physical slots of virtual ``indices``, 0 for an id whose page is
        unbound on this side (a host pool group skips it: a cached page whose window KV was
        freed is copied and loaded with its full KV only). Ids outside the pool are refused."""
        alloc = self._alloc
        alloc._physical("full", indices, f"host transfer ({self.side} sub-pool)")
        ids = indices.to(torch.int64)
        pages = torch.div(ids, alloc.page_size, rounding_mode="floor")
        bound = alloc.pages.v2p[self.side][pages] > 0
        return torch.where(bound, alloc._translate(self.side, ids), torch.zeros_like(ids))

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        return indices

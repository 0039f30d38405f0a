"""TwoEndedPages: one range of physical pages shared by a full-attention and a window sub-pool.

Pages 1..N are one budget: the full side takes pages from the low end growing up, the window
side from the high end growing down, so how the budget splits between full and window KV is
decided by what runs, not fixed up front. Page 0 is both sides' padding page. Each side keeps
a page table per direction: ``v2p[virtual page]`` (0: unbound; a trailing -1 sentinel) and
``p2v[physical page]`` (0: free on this side). The two ends never cross: every live full page
lies below every live window page.

A side takes its free pages nearest its own end first (the lowest free pages below the lowest
live window page for full, the highest free pages above the highest live full page for the
window), so holes left by frees are refilled before the shared gap between the ends shrinks.

Bookkeeping only: ids in, ids out, no value checks of the caller's ids (the allocator does
those). Choosing pages reads the tables (a device sync on CUDA).
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.peer_table import new_peer_table

FULL, SWA = "full", "swa"


def joint_pages(holes_full: int, holes_swa: int, gap: int) -> int:
    """The most n such that n full pages and n window pages fit: each side fills its own holes
    first, and what is left of both demands must fit in the gap between the ends."""
    lo, hi = sorted((holes_full, holes_swa))
    if gap <= hi - lo:
        return lo + gap  # only the side with fewer holes draws on the gap
    return (gap + lo + hi) // 2


class TwoEndedPages:
    """Physical pages 1..``num_pages`` and, per side, the v2p / p2v tables over
    ``num_virtual_pages`` virtual pages."""

    def __init__(self, num_pages: int, num_virtual_pages: int, device: torch.device) -> None:
        self.num_pages = num_pages
        self.num_virtual_pages = num_virtual_pages
        self.device = device
        # v2p's trailing -1 sentinel: a last_loc of -1 (no prefix) translates to -1.
        self.v2p = {s: new_peer_table(num_virtual_pages + 1, device) for s in (FULL, SWA)}
        self.p2v = {
            s: torch.zeros(num_pages + 1, dtype=torch.int64, device=device) for s in (FULL, SWA)
        }
        self.clear()

    def clear(self) -> None:
        """Every page free on both sides, every virtual page unbound (the sentinels stay)."""
        for t in self.v2p.values():
            t[:-1].zero_()
        for t in self.p2v.values():
            t.zero_()
        self.live = {FULL: 0, SWA: 0}
        self.full_top = 0  # the highest live full page (0: none)
        self.swa_bottom = self.num_pages + 1  # the lowest live window page (N + 1: none)

    # -- capacity -------------------------------------------------------------------------------
    @property
    def gap(self) -> int:
        """Pages between the two ends, free for either side."""
        return self.swa_bottom - self.full_top - 1

    def holes(self, side: str) -> int:
        """Free pages inside a side's own span (left by frees, refilled first)."""
        if side == FULL:
            return self.full_top - self.live[FULL]
        return self.num_pages + 1 - self.swa_bottom - self.live[SWA]

    def free_pages(self, side: str) -> int:
        """Pages ``side`` alone could take now: its holes and the whole gap."""
        return self.holes(side) + self.gap

    def joint_free_pages(self) -> int:
        """Pages both sides could take now, as many on each (every new token needs both)."""
        return joint_pages(self.holes(FULL), self.holes(SWA), self.gap)

    # -- choosing and binding -------------------------------------------------------------------
    def choose(self, side: str, n: int) -> torch.Tensor:
        """The ``n`` free pages ``side`` takes next, nearest its end first (nothing changes;
        the caller has checked they exist). Full: ascending; window: descending."""
        if side == FULL:
            span = self.p2v[FULL][1 : self.swa_bottom]
            return torch.nonzero(span == 0).reshape(-1)[:n] + 1
        low = self.full_top + 1
        span = self.p2v[SWA][low:]
        return torch.flip(torch.nonzero(span == 0).reshape(-1), (0,))[:n] + low

    def bind(self, side: str, vpages: torch.Tensor, ppages: torch.Tensor) -> None:
        """Bind virtual pages to free physical pages of ``side`` (same length)."""
        n = int(vpages.shape[0])
        if n == 0:
            return
        self.v2p[side][vpages] = ppages
        self.p2v[side][ppages] = vpages
        self.live[side] += n
        if side == FULL:
            self.full_top = max(self.full_top, int(ppages.max()))
        else:
            self.swa_bottom = min(self.swa_bottom, int(ppages.min()))

    def unbind(self, side: str, vpages: torch.Tensor) -> torch.Tensor:
        """Unbind virtual pages (distinct) of ``side``; those not bound there are skipped.
        Returns the physical pages released."""
        table = self.v2p[side]
        phys = table[vpages]
        phys = phys[phys > 0]
        if phys.numel() == 0:
            return phys
        table[vpages] = 0
        self.p2v[side][phys] = 0
        self.live[side] -= int(phys.numel())
        self._retreat(side)
        return phys

    def _retreat(self, side: str) -> None:
        """Move a side's end back to its outermost live page after a release."""
        live = torch.nonzero(self.p2v[side]).reshape(-1)
        if side == FULL:
            self.full_top = int(live.max()) if live.numel() else 0
        else:
            self.swa_bottom = int(live.min()) if live.numel() else self.num_pages + 1

    def snapshot(self) -> tuple:
        """Everything, copied (tests compare a refused call's before and after)."""
        return (
            *(t.clone() for t in (*self.v2p.values(), *self.p2v.values())),
            dict(self.live),
            self.full_top,
            self.swa_bottom,
        )

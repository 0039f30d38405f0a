"""DraftTrees: the KV a speculative decoder's draft tree takes each decode step, held and freed.

After a request's decode token, an EAGLE-style drafter proposes ``speculative_num_steps``
tokens along each of ``speculative_eagle_topk`` branches; their KV goes into the device pool.
With pages and topk > 1 every branch gets pages of its own, starting with a copy of the
request's partial last page (``sizing.draft_tree_spans``); otherwise one run of the step's
length continues the request. The slots are allocated from the cache's allocator (evicting
cached pages when short), the first ``speculative_num_draft_tokens`` of them written into the
request's row after its committed tokens (the headroom ``request_row_width`` adds), and freed
when the step's tree is verified; under overlap scheduling one step's tree is freed only after
the next one is allocated (the double buffer the 2x reserve is for). Verification here accepts
no draft token (the drafter is a stand-in), so every output stays the plain greedy decode's.
"""

from __future__ import annotations

import torch

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.device.sizing import draft_tree_spans, resolve_sizing, span_pages
from tiered_kv.errors import StateError


class DraftTrees:
    def __init__(self, cache: TieredKVCache) -> None:
        self.cache = cache
        self.allocator = cache.allocator
        self.page_size = cache.config.page_size
        self.sizing = resolve_sizing(cache.config.device.sizing, self.page_size)
        self.overlap = self.sizing.overlap_schedule
        self.row_tokens = self.sizing.speculative_num_draft_tokens
        # rid -> the page ids' first slots of each tree not yet freed, oldest first
        self._held: dict[int, list[torch.Tensor]] = {}
        self.trees = self.pages = 0  # allocated so far (counters)

    @property
    def enabled(self) -> bool:
        return self.sizing.speculative_algorithm is not None

    def pages_for(self, seq_len: int) -> int:
        """New pages the tree of a request holding ``seq_len`` tokens takes."""
        return sum(span_pages(s, self.page_size) for s in draft_tree_spans(self.sizing, seq_len))

    def held_tokens(self) -> int:
        """Device slots the trees not yet freed hold (whole pages)."""
        pages = sum(t.numel() for trees in self._held.values() for t in trees)
        return pages * self.page_size

    def grow(self, rid: int, req: Request) -> bool:
        """Allocate the tree of ``req`` (after its newest token); under overlap the one before
        it is freed now, else the caller frees this one (``release``) once verified. False,
        with nothing taken, when the device cannot hold it even after evicting."""
        if not self.enabled:
            return True
        slots = self._alloc(req)
        if slots is None:
            return False
        held = self._held.setdefault(rid, [])
        held.append(slots)
        if self.overlap and len(held) > 1:
            self._free(held.pop(0))
        return True

    def release(self, rid: int) -> None:
        """Free every tree of request ``rid`` (verified, finished or retracted)."""
        for slots in self._held.pop(rid, []):
            self._free(slots)

    # -- the allocator ------------------------------------------------------------------------
    def _alloc(self, req: Request) -> torch.Tensor | None:
        seq_len, ps = len(req.tokens), self.page_size
        spans = draft_tree_spans(self.sizing, seq_len)
        need = sum(span_pages(s, ps) for s in spans) * ps
        if not self.allocator.evict_to_free_tokens(need, self.cache.manager.evict_device):
            return None
        pre = torch.tensor([start for start, _ in spans])
        seq = torch.tensor([end for _, end in spans])
        last = torch.tensor(
            [int(req.slots[start - 1]) if start else -1 for start, _ in spans], dtype=torch.int64
        )
        out = self.allocator.alloc_extend(pre, pre, seq, seq, last, int((seq - pre).sum()))
        if out is None:
            return None
        # Slots in the request's own partial page belong to its page: only new pages are the
        # tree's (a branch's copy of the partial page starts a page of its own).
        # Each span's own part starts on a page boundary: every ps-th slot names one page.
        pages, at = [], 0
        for start, end in spans:
            skip = (-start) % ps if start % ps else 0
            pages.append(out[at + skip : at + end - start : ps])
            at += end - start
        self._write_row(req, out, seq_len)
        self.trees += 1
        self.pages += need // ps
        return torch.cat(pages)

    def _write_row(self, req: Request, slots: torch.Tensor, seq_len: int) -> None:
        n = min(len(slots), self.row_tokens or len(slots))
        rows = self.cache.req_to_token
        width = rows.req_to_token.shape[1]
        if seq_len + n > width:
            raise StateError(
                f"a draft tree of {n} tokens after {seq_len} does not fit a request row of "
                f"{width} columns; the sizing's headroom is too small"
            )
        rows.write((req.row, slice(seq_len, seq_len + n)), slots[:n].to(torch.int32))

    def _free(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self.allocator.free(pages)

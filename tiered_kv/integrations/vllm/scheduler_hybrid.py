"""The connector's scheduler half for hybrid models (vLLM's ``SupportsHMA``): several KV cache
groups, each with its own block table, one chain of page digests for all of them.

What differs from one group (``SchedulerSide``, whose digests, tracking and hit sources this
reuses):

- **The hit** is the longest prefix every group can restore exactly (``GroupGrid.hit_end``):
  full attention as a prefix, a sliding-window group only the pages a query at the hit end can
  still read, a recurrent-state group the one state saved at the hit end. Each page counts only
  where every rank holding the group holds it (``present``). Loads are always async.
- **Loads** fill every block vLLM allocated (non-null) for the external tokens, per group;
  pages that fell out of a window are neither loaded nor required (counted,
  ``window_skipped_blocks``). Where vLLM's allocation lacks a block the hit needs, the request
  is sent ``doomed``: the workers report it failed and vLLM recomputes it, never a wrong block.
- **Failures** come back in ``failed_recving`` (vLLM raises on block-level errors with several
  groups): vLLM recomputes the request from its start and looks it up again; such a request
  gets no external hit again (the store deletes a damaged page; a copy that failed would fail
  again) and its blocks are saved anew.
- **Saves**: blocks of attention groups in the step that makes them full, null blocks (out of
  a window) skipped, never waited for; recurrent state only where vLLM offers a block boundary's
  state (``scheduler_output.kv_connector_block_state``), copied by the worker after the
  forward of the step that carries the offer (that forward computes it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.integrations.vllm.groups import GroupGrid, GroupKind
from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata
from tiered_kv.integrations.vllm.scheduler_side import NULL_BLOCK, SchedulerSide, _Tracked
from tiered_kv.integrations.vllm.tiers import TierCounters


class HybridSchedulerSide(SchedulerSide):
    """``present(group, digests)``: whether every rank holding the group holds each page;
    ``host_lead(group, digests)``: leading pages every such rank holds on its host tier;
    ``block_ids(req_id)``: the request's block ids per group (vLLM's KV cache manager)."""

    def __init__(
        self,
        grid: GroupGrid,
        present: Callable[[int, Sequence[bytes]], list[bool]],
        host_lead: Callable[[int, Sequence[bytes]], int],
        block_ids: Callable[[str], tuple[list[int], ...]],
        counters: TierCounters,
    ) -> None:
        super().__init__(grid.step, True, lambda d: (0, 0), lambda r: [])
        self.grid = grid
        self._present = present
        self._host_lead = host_lead
        self._group_ids = block_ids
        self.counters = counters
        self._doomed: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        t = self._tracked(request)
        if t is None or t.failed_load:
            return 0, False
        bs = self.block_size
        limit = (len(request.all_token_ids) - 1) // bs
        local = num_computed_tokens
        t.lookup = None
        if local // bs >= limit:
            return 0, False
        digests = self._digests(t, limit)
        end = self.grid.hit_end(
            local,
            limit * bs,
            lambda g, blocks: self._present(g.index, [digests[b] for b in blocks]),
        )
        if end <= local:
            return 0, False
        t.lookup = (local, end)
        full = [g for g in self.grid.groups if g.kind is GroupKind.FULL]
        span = digests[local // bs : end // bs]
        host = min((self._host_lead(g.index, span) for g in full), default=0) * bs
        t.sources = (host, end - local - host)
        t.saved = max(t.saved, end // bs)
        return end - local, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        t = self._reqs.get(request.request_id)
        if t is None or num_external_tokens <= 0 or t.lookup is None:
            return
        local, end = t.lookup
        end = min(end, local + num_external_tokens)
        t.lookup = None
        per_group = blocks.get_block_ids()
        bs, parts, complete, skipped = self.block_size, [], True, 0
        for g in self.grid.groups:
            ids = list(per_group[g.index])
            span = range(local // bs, end // bs)
            real = [i for i in span if i < len(ids) and ids[i] != NULL_BLOCK]
            complete &= set(g.needed(local, end)) <= set(real)
            if g.kind is GroupKind.WINDOW:
                skipped += len(span) - len(real)
            blocks_g = [ids[i] for i in real]
            parts.append(
                BlockPages(request.request_id, blocks_g, [t.digests[i] for i in real], g.index)
            )
        if not complete:  # told vLLM these tokens are external: fail it, vLLM recomputes
            self._doomed.append(request.request_id)
            return
        self.counters.add(window_skipped_blocks=skipped)
        self._loads[request.request_id] = parts

    def build_connector_meta(self, out) -> TieredKVMetadata:
        meta = TieredKVMetadata(doomed=list(self._doomed))
        self._doomed.clear()
        for req_id, parts in self._loads.items():
            meta.loads.extend(parts)
            self._in_flight[req_id] = parts
            self.hit_tokens += max((len(p.digests) for p in parts), default=0) * self.block_size
        self._loads.clear()
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            self._in_flight.pop(req_id, None)
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed in scheduled:
            meta.saves.extend(
                self._saves_of(req_id, computed + out.num_scheduled_tokens.get(req_id, 0))
            )
        meta.state_saves = self._state_saves(getattr(out, "kv_connector_block_state", None))
        return meta

    def _saves_of(self, req_id: str, computed_after: int) -> list[BlockPages]:
        """Blocks of attention groups that became full, each group's null blocks left out."""
        t = self._reqs.get(req_id)
        if t is None:
            return []
        full = min(computed_after, len(t.request.all_token_ids)) // self.block_size
        if full <= t.saved:
            return []
        digests = self._digests(t, full)
        saves = []
        per_group = self._group_ids(req_id)
        for g in self.grid.groups:
            if g.kind is GroupKind.STATE:
                continue
            ids = per_group[g.index]
            idx = [i for i in range(t.saved, min(full, len(ids))) if ids[i] != NULL_BLOCK]
            if idx:
                saves.append(
                    BlockPages(req_id, [ids[i] for i in idx], [digests[i] for i in idx], g.index)
                )
        t.saved = full
        return saves

    def _state_saves(self, block_state) -> list[BlockPages]:
        """The recurrent states vLLM offered this step (``(group, block, boundary tokens)`` per
        request), where the boundary ends a block and the block is real."""
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        saves = []
        for req_id, entries in offers.items():
            t = self._reqs.get(req_id)
            if t is None:
                continue
            for group, block, boundary in entries:
                if not self._is_state_offer(t, group, block, boundary):
                    continue
                digest = self._digests(t, boundary // self.block_size)[-1]
                saves.append(BlockPages(req_id, [block], [digest], group))
        return saves

    def _is_state_offer(self, t: _Tracked, group: int, block: int, boundary: int) -> bool:
        bs = self.block_size
        return (
            0 <= group < len(self.grid.groups)
            and self.grid.groups[group].kind is GroupKind.STATE
            and block != NULL_BLOCK
            and boundary >= bs
            and boundary % bs == 0
            and boundary <= len(t.request.all_token_ids)
        )

    def update_connector_output(self, output) -> None:
        """A request whose load failed on any rank is recomputed by vLLM from its start: no
        external hit for it again, and its blocks are saved anew."""
        for req_id in getattr(output, "failed_recving", None) or ():
            t = self._reqs.get(req_id)
            if t is not None:
                t.failed_load = True
                t.saved = 0
            self.counters.add(failed_load_requests=1)
        for req_id in getattr(output, "finished_recving", None) or ():
            self._in_flight.pop(req_id, None)

"""The batched scheduler's admission (``Scheduler`` takes it as a base): the waiting queue's
order, deferral behind a running request that will cache a shared prefix, what fits (predicted
from the cached prefixes, checked again with what each begin really locked), the steps' begins
together, and the liveness rule when nothing runs (``_alone``: the cheapest form that fits;
``engine.liveness``: waiting for copies, stalls). Decisions only; the cache moves the bytes.
"""

from __future__ import annotations

from tiered_kv.engine.batch_state import EngineRequest, ReqState, admission_order, shared_len
from tiered_kv.engine.budget import Need
from tiered_kv.engine.liveness import stalled, wait_for_copies
from tiered_kv.engine.prefix_probe import CachedPrefix, cached_prefix
from tiered_kv.engine.serve import PagedKV


class Admission:
    """Admission for ``Scheduler`` (its cache, budget, queues, stats and ``_fits``)."""

    def _order(self) -> list[EngineRequest]:
        probe_store = self.config.storage_weight > 0

        def cached(w: EngineRequest) -> CachedPrefix:
            tokens = (w.prompt + w.output)[:-1]
            return cached_prefix(self.cache, tokens, storage=probe_store, prior=w.prior)

        return admission_order(self.waiting, self.step_count, self.config, cached)

    def _admit(self) -> tuple[int, ...]:
        """Admit what fits (``_admit_fitting``); when nothing runs and nothing was admitted, try
        again after the copies in flight landed, or with no prefix where the head's begun form
        failed its re-check (at most twice); a step that still admits nothing is a stall
        (``engine.liveness``)."""
        admitted = self._admit_fitting()
        if admitted or self.running or not self.waiting:
            return admitted
        for _ in range(2):
            if not wait_for_copies(self.cache, self.stats) and self._escalate is None:
                break
            admitted = self._admit_fitting()
            if admitted or self.running:
                return admitted
        stalled(self.cache, self.stats, self.config.debug, self._head_detail())
        return ()

    def _admit_fitting(self) -> tuple[int, ...]:
        """Choose what fits (predicted from the cached prefixes), begin them together (one
        layer-wise load job for all their host hits), then check each again with the prefix
        its begin really locked: one that no longer fits (a load failed, or another's load
        evicted its device prefix) and every one after it go back to the queue, unbegun. The
        head admitted alone takes the cheapest form that fits (``_alone``); if its begun form
        fails that check, it is admitted with no prefix on the next try."""
        chosen: list[tuple[EngineRequest, list[int]]] = []
        committed = self._claims() + Need(self.reserve * len(self.running))
        base, locking, budget, uncached = committed, 0, self.budget, False
        for w in self._order():
            running = len(self.running) + len(chosen)
            if running >= self.config.max_running or not budget.state_room(running + 1):
                break
            tokens = w.prompt + w.output
            device, host, _, unlocked = cached_prefix(self.cache, tokens[:-1], prior=w.prior)
            same = [t for c, t in chosen if c.prior == w.prior]  # only its identity's pages
            if self._defer(w, tokens, device + host, same):
                continue
            need = budget.admission(w, len(tokens), device, host) + Need(self.reserve)
            if not self.running and not chosen:
                # Alone: nothing else's claim is at stake, so it may give up its host hit (its
                # load back takes what the pools have; the rest is computed) or its whole
                # prefix (what the prefix locks may be what it lacks).
                need, unlocked, uncached = self._alone(w, len(tokens), need, device, unlocked)
            if not self._fits(need + committed, locking=locking + unlocked):
                break  # no skipping: the head waits for room (nothing starves behind it)
            chosen.append((w, tokens))
            committed, locking = committed + need, locking + unlocked
            if uncached:
                break  # begun alone, with no prefix
        if not chosen:
            return ()
        reqs = self.cache.begin_many(
            [tokens for _, tokens in chosen],
            extra_keys=[w.extra_key for w, _ in chosen],
            cached=not uncached,
        )
        if uncached:
            self.stats.uncached_admissions += 1
        admitted, committed, full = [], base, False
        for (w, tokens), req in zip(chosen, reqs, strict=True):
            need = self.budget.admission(w, len(tokens), req.prefix_len, 0) + Need(self.reserve)
            full = full or not self._fits(need + committed)
            if full:
                self.stats.admission_recheck_failed += 1
                self.cache.abort(req)
                if not self.running and not admitted:
                    self._escalate = w.rid  # its next admission alone takes no prefix
                continue
            committed += need
            w.target, w.cache_req = tokens, req
            self.waiting.remove(w)
            self.running.append(w)
            self._kv[w.rid] = PagedKV(self.cache, req, self.model.embed.dtype)
            w.state = ReqState.RUNNING
            w.admit_seq, self._seq = self._seq, self._seq + 1
            w.note_admitted(self.step_count, len(tokens), req.prefix_len, self.stats)
            admitted.append(w.rid)
        return tuple(admitted)

    def _alone(
        self, w: EngineRequest, tokens: int, need: Need, device: int, unlocked: int
    ) -> tuple[Need, int, bool]:
        """The head of the queue with nothing running: (need, device tokens it locks, whether
        it is begun with no prefix) of the cheapest form that fits: its whole cached prefix,
        its device part only, or none. The last fits an empty pool: ``add`` checked its pages
        and decode reserve against the device capacity, and ``Budget`` its window peak
        against the window pool."""
        if self._escalate != w.rid:
            if self._fits(need, locking=unlocked):
                return need, unlocked, False
            device_only = self.budget.admission(w, tokens, device, 0) + Need(self.reserve)
            if self._fits(device_only, locking=unlocked):
                return device_only, unlocked, False
        self._escalate = None
        return self.budget.admission(w, tokens, 0, 0) + Need(self.reserve), 0, True

    def _head_detail(self) -> str:
        """What the head of the queue needs alone with no prefix, and what is reachable."""
        w = self._order()[0]
        need = self.budget.admission(w, len(w.prompt) + len(w.output), 0, 0) + Need(self.reserve)
        return f"request {w.rid}: {self.budget.describe(need)}"

    def _defer(self, w: EngineRequest, tokens: list[int], cached: int, chosen: list) -> bool:
        """Whether ``w`` should wait for a running request (or one chosen in this step) to
        cache what they share."""
        threshold = self.config.defer_threshold
        if not threshold or self.step_count - w.queued_step >= self.config.max_wait_steps:
            return False
        ahead = [r.target for r in self.running if r.prior == w.prior] + chosen
        shared = max((shared_len(tokens, t, self.page_size) for t in ahead), default=0)
        return shared - cached >= threshold

"""Continuous batching over a :class:`TieredKVCache`: a waiting queue and a running batch.

Each ``step``: admit waiting requests in policy order while the budget says they fit (begun
together: their host hits load back as one layer-wise job, one layer-done slot); compute
up to ``chunk_size`` prompt tokens of each prefilling request (within the step's prefill
budget); feed one token of every decoding request. The budget, in whole pages, is what the
allocator has free plus what the tree could evict; each running request claims from it the
rest of its prefill. A new request is admitted only if its prefill and decode reserve fit
beside those claims (the allocator's capacity hooks, asked before ``begin`` and again with
the prefix it really locked). Only decode may run out: before a decode step the least
advanced requests are retracted until its new pages fit beside the claims. A retracted
request's computed pages go into the tree (``finish``: cached, backed up per the write
policy); it waits again with ``prompt + output`` as its prompt, served from what is still
cached. With speculative decoding in the cache's sizing, every decode step also allocates
each request's draft tree (``draft_tree.DraftTrees``), counted in that step's budget. The model
is chunk-aligned deterministic: every logit is the no-cache run's, bit for bit, however a
request was split or retracted. Sliding-window and hybrid-linear caches are budgeted on their
window and state sides too (``budget.Budget``); a hybrid forward reports its page boundaries
(``track_state``) so retracted requests resume from a state snapshot.

Liveness: when nothing runs, the head of the queue is admitted (``add`` refuses, with
InvalidArgumentError, a request that could not run alone in an empty device pool). Alone, it
takes the cheapest form that fits: its cached prefix with the host part loaded back, else its
device part only (the host part computed), else no prefix at all (``begin_many(cached=False)``:
what an empty pool always has room for, once the copies in flight have landed). A step that
admits nothing while nothing runs and no copy is in flight is a stall (``engine.liveness``):
LivenessError with the numbers under ``SchedulerConfig.debug``, else counted and logged.
"""

from __future__ import annotations

import functools

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.request import token_ids
from tiered_kv.engine.admission import Admission
from tiered_kv.engine.batch_state import (
    EngineRequest,
    ReqState,
    SchedulerConfig,
    SchedulerStats,
    StepResult,
)
from tiered_kv.engine.budget import Budget, Need
from tiered_kv.engine.draft_tree import DraftTrees
from tiered_kv.engine.model import TinyLlama
from tiered_kv.engine.serve import PagedKV
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.storage.keys import extra_key_prior


class Scheduler(Admission):
    def __init__(self, cache: TieredKVCache, model: TinyLlama, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise InvalidArgumentError(
                f"config must be a SchedulerConfig, got {type(config).__name__}"
            )
        self.cache, self.model, self.config = cache, model, config
        self.page_size = cache.config.page_size
        config.check_against(self.page_size, cache.config.device.max_requests)
        self.budget = Budget(cache, config.chunk_size)  # raises: a request could never fit
        alloc = cache.allocator
        self.drafts = DraftTrees(cache)
        reserve = config.decode_reserve_tokens
        self.reserve = self._paged(alloc.request_slot_reserve() if reserve is None else reserve)
        free = getattr(alloc, "full_available_size", alloc.available_size)  # every token's side
        self.capacity = free() + cache.tree.device_tokens  # what no request holds
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.finished: list[EngineRequest] = []
        self.stats = SchedulerStats()
        self.step_count = 0
        self._next_id = self._seq = 0  # request ids; admission order (the newest is retracted)
        self._kv: dict[int, PagedKV] = {}
        self._finishing: list = []  # cache requests done this phase, finished together
        self._escalate: int | None = None  # a request whose next admission takes no prefix

    # -- public -------------------------------------------------------------------------------
    def add(
        self, prompt, max_new_tokens: int, extra_key: str | bytes | None = None
    ) -> EngineRequest:
        """Queue a request (arriving at the current step). ``extra_key``: its identity beyond
        its tokens (see ``TieredKVCache.begin``). Raises InvalidArgumentError when it could not
        run even alone in an empty device pool, or for a bad extra key."""
        prompt = token_ids(prompt)
        prior = extra_key_prior(extra_key)
        check_positive_int("max_new_tokens", max_new_tokens)
        if not prompt:
            raise InvalidArgumentError("prompt needs at least one token")
        limit = self.cache.config.device.max_context_len
        if len(prompt) + max_new_tokens > limit:
            raise InvalidArgumentError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed max_context_len={limit}"
            )
        fit = self.cache.allocator.max_new_tokens_for_memory(
            len(prompt), max_new_tokens, token_capacity=self.capacity - self.reserve
        )
        if fit is None or fit < max_new_tokens:
            raise InvalidArgumentError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens cannot fit a device pool of "
                f"{self.capacity} tokens even alone (at most {fit or 0} new tokens would)"
            )
        req = EngineRequest(
            self._next_id, prompt, max_new_tokens, self.step_count, extra_key, prior
        )
        req.queued_step = self.step_count
        self._next_id += 1
        self.waiting.append(req)
        return req

    def step(self) -> StepResult:
        """One scheduling step: admit, prefill (chunked), decode. Returns what happened."""
        admitted = self._admit()
        ready = {r.rid for r in self.running if not r.prefilling}  # a prefill ending now waits
        prefilled, finished = self._prefill()
        self._finish_pending()
        decoded, done, retracted = self._decode(ready)
        self._finish_pending()
        self.cache.poll()
        self.step_count += 1
        self.stats.steps += 1
        return StepResult(
            self.step_count - 1, admitted, prefilled, decoded, finished + done, retracted
        )

    def run_until_done(self, max_steps: int) -> list[EngineRequest]:
        """Step until nothing waits or runs; the finished requests. StateError after
        ``max_steps`` steps with work left."""
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return self.finished
            self.step()
        if self.waiting or self.running:
            raise StateError(
                f"{len(self.waiting)} waiting and {len(self.running)} running requests left "
                f"after {max_steps} steps; allow more steps"
            )
        return self.finished

    # -- the budget (tokens, whole pages) -----------------------------------------------------
    def _paged(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _claims(self) -> Need:
        """What the running requests may still take (``budget.Budget.claim``)."""
        return self.budget.claims(self.running)

    def _fits(self, need: Need, locking: int = 0) -> bool:
        return self.budget.fits(need, locking)

    # -- prefill and decode -------------------------------------------------------------------
    def _forward(self, r: EngineRequest, tokens: list[int]) -> torch.Tensor | None:
        """Allocate ``tokens``' slots for ``r`` and run them; the last row's logits. None when
        the allocation was refused (an over-commit, counted) or the prefix load failed."""
        cache, req = self.cache, r.cache_req
        start = len(req.tokens)
        try:
            cache.prepare_forward(req)
        except StateError:
            self.stats.load_failures += 1
            self._requeue(r, insert=False)
            return None
        try:
            cache.extend(req, tokens)
        except StateError:
            self.stats.overcommits += 1
            return None
        extra = {}
        if cache.states is not None:  # the state at every page boundary, for the snapshots
            extra["on_boundary"] = functools.partial(cache.track_state, req)
        try:
            logits = self.model.forward(
                torch.tensor(tokens), start, self._kv[r.rid], self.page_size, **extra
            )
        except TransferError:
            # A layer of its prefix load failed under the forward (the layer wait raises
            # TransferError): its prefix slots do not hold its KV.
            cache.drain()  # the failed load's result arrives once its last layer is done
            if not cache.manager.holds_stale(req.node):
                raise
            self.stats.load_failures += 1
            self._requeue(r, insert=False)
            return None
        return logits[-1]

    def _emit(self, r: EngineRequest, logits: torch.Tensor) -> bool:
        """Choose ``r``'s next token (greedy); finish it when done. Returns whether it did."""
        r.output.append(int(logits.argmax()))
        if self.config.record_logits:
            r.logits.append(logits.clone())
        if r.first_token_step is None:
            r.first_token_step = self.step_count
        if not r.done:
            return False
        self._finishing.append(r.cache_req)  # finished with the phase's others (one write job)
        self._leave(r)
        r.state, r.finish_step = ReqState.FINISHED, self.step_count
        self.finished.append(r)
        self.stats.finished += 1
        return True

    def _finish_pending(self) -> None:
        if self._finishing:
            reqs, self._finishing = self._finishing, []
            self.cache.finish_many(reqs)

    def _leave(self, r: EngineRequest) -> None:
        self.drafts.release(r.rid)
        self.running.remove(r)
        del self._kv[r.rid]
        r.cache_req, r.target = None, []

    def _prefill(self) -> tuple[int, tuple[int, ...]]:
        budget, total, finished = self.config.prefill_budget, 0, []
        for r in [r for r in self.running if r.prefilling]:
            left = len(r.target) - len(r.cache_req.tokens)
            n = min(left, self.config.chunk_size, budget)
            if n < left:
                n = n // self.page_size * self.page_size  # every chunk but the last whole pages
            if n == 0:
                break
            chunk = r.target[len(r.cache_req.tokens) : len(r.cache_req.tokens) + n]
            # Admission and decode keep every running request's prefill claim (this chunk
            # included) within reach: if they no longer fit together, admission over-committed.
            if not self._fits(self._claims()):
                self.stats.overcommits += 1
            logits = self._forward(r, chunk)
            if logits is None:
                continue
            budget, total = budget - n, total + n
            if not r.prefilling and self._emit(r, logits):
                finished.append(r.rid)
        return total, tuple(finished)

    def _decode_need(self, rs: list[EngineRequest]) -> Need:
        """Slots one decode step takes: a page for each request whose last page is full,
        and with speculative decoding each one's draft tree after its new token."""
        ps, drafts = self.page_size, self.drafts
        need = sum(ps for r in rs if len(r.cache_req.tokens) % ps == 0)
        if drafts.enabled:
            need += sum(drafts.pages_for(len(r.cache_req.tokens) + 1) * ps for r in rs)
        return Need(need)

    def _decode(self, ready: set[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """One token for every request in ``ready`` (its prefill done before this step) still
        running, retracting the least advanced requests first while the step does not fit."""
        retracted = []
        while True:
            batch = [r for r in self.running if r.rid in ready]
            need = self._decode_need(batch) + self._claims()
            if not batch or self._fits(need):
                break
            victim = min(self.running, key=lambda r: (len(r.output), -r.admit_seq))
            self._requeue(victim, insert=True)
            retracted.append(victim.rid)
        decoded, finished = [], []
        for r in batch:
            logits = self._forward(r, [r.output[-1]])
            if logits is None:
                continue
            decoded.append(r.rid)
            if self._emit(r, logits):
                finished.append(r.rid)
            elif not self.drafts.grow(r.rid, r.cache_req):
                self.stats.overcommits += 1  # the step's budget counted this tree
        if not self.drafts.overlap:
            for r in batch:  # verified within the step (no draft token is accepted)
                self.drafts.release(r.rid)
        self.stats.draft_trees, self.stats.draft_pages = self.drafts.trees, self.drafts.pages
        return tuple(decoded), tuple(finished), tuple(retracted)

    def _requeue(self, r: EngineRequest, *, insert: bool) -> None:
        """Back to the waiting queue. ``insert``: its computed whole pages go into the tree
        (a retraction); else they are dropped (its prefix load failed)."""
        if insert:
            self.cache.finish(r.cache_req)
            r.retractions += 1
            self.stats.retracted += 1
        else:
            self.cache.abort(r.cache_req)
        self._leave(r)
        r.state, r.queued_step = ReqState.WAITING, self.step_count
        self.waiting.append(r)

    def held_device_tokens(self) -> int:
        """Device slots the running requests hold outside the tree (for integrity checks)."""
        held = sum(
            self._paged(len(r.cache_req.tokens)) - r.cache_req.prefix_len for r in self.running
        )
        return held + self.drafts.held_tokens()

"""SparseScheduler: continuous batching of HiSparse requests (a DSA model, ``HiSparseServing``).

Each ``step``: admit waiting requests (first come, first served) while their prefill fits, and
prefill each whole (its cached prefix read from the tree's host copies into staging rows), then
``admit`` it into its fixed device buffer; feed one token of every decoding request, each layer's
selected tokens swapped in from host (``SparseDSA``). The budget:

- device: a running request holds its buffer and a page, whatever its context; a prefill needs
  staging rows for its prompt until it is admitted (then the rows become the buffer). A request is
  begun only if the larger of the two fits in what is free (and what the tree's device copies
  would give back);
- logical slots (one per token of every running request): a request is begun only if its whole
  life (prompt and every new token) fits beside what the running ones may still take;
- host slots come from the host tier as tokens are committed; when a decode token finds none, the
  least advanced request is retracted: its committed pages go into the tree (host-only) and it
  waits again with ``prompt + output`` as its prompt.

Faults: a failed admit backup is tried again next step (then the request is aborted and waits
again); a failed commit is tried again before the next token; a swap-in that keeps failing
(``SwapInFailed``) retracts the request (counted in ``load_failures``). The model is
chunk-aligned deterministic: every logit is the no-cache run's, bit for bit.
"""

from __future__ import annotations

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.cache.hisparse_serving import HiSparseServing
from tiered_kv.cache.request import token_ids
from tiered_kv.engine.batch_state import (
    EngineRequest,
    ReqState,
    SchedulerConfig,
    SchedulerStats,
    StepResult,
)
from tiered_kv.engine.hisparse_model import SparseDSA, StagedKV, SwapInFailed, SwapKV
from tiered_kv.engine.liveness import stalled, wait_for_copies
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.storage.keys import extra_key_prior

ADMIT_TRIES = 3  # admits of one prefilled request before it is aborted and waits again


class SparseScheduler:
    def __init__(self, serving: HiSparseServing, model: SparseDSA, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise InvalidArgumentError(
                f"config must be a SchedulerConfig, got {type(config).__name__}"
            )
        if not isinstance(model, SparseDSA) and not (
            callable(getattr(model, "forward", None)) and hasattr(model, "embed")
        ):  # SparseDSA, or a stand-in with its calls (``SyntheticSparseDSA``)
            raise InvalidArgumentError(
                f"model must be a SparseDSA (or have its forward and embed), got "
                f"{type(model).__name__}"
            )
        self.serving, self.model, self.config = serving, model, config
        self.cache, self.allocator = serving.cache, serving.allocator
        self.page_size = serving.page_size
        config.check_against(self.page_size, self.cache.config.device.max_requests)
        self.held = serving.buffer_tokens + self.page_size  # device slots per admitted request
        if self.held > self.allocator.size_device:
            raise InvalidArgumentError(
                f"a request's buffer ({serving.buffer_tokens} + a page) exceeds the device "
                f"pool's {self.allocator.size_device} slots"
            )
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.finished: list[EngineRequest] = []
        self.stats = SchedulerStats()
        self.step_count = self._next_id = 0
        self._tries: dict[int, int] = {}  # admits tried per prefilled request

    # -- public -------------------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int, extra_key=None) -> EngineRequest:
        """Queue a request. Raises InvalidArgumentError when it could never run alone."""
        prompt = token_ids(prompt)
        prior = extra_key_prior(extra_key)
        check_positive_int("max_new_tokens", max_new_tokens)
        if not prompt:
            raise InvalidArgumentError("prompt needs at least one token")
        total, limit = len(prompt) + max_new_tokens, self.cache.config.device.max_context_len
        if total > limit:
            raise InvalidArgumentError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed max_context_len={limit}"
            )
        if self._paged(total - 1) > self.allocator.size_device:  # a resumed prefill's length
            raise InvalidArgumentError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens: its prefill's staging rows "
                f"cannot fit the device pool of {self.allocator.size_device} slots"
            )
        if self._paged(total) > self.allocator.size:
            raise InvalidArgumentError(
                f"{total} tokens exceed the {self.allocator.size} logical slots "
                "(raise hisparse_logical_ratio)"
            )
        req = EngineRequest(
            self._next_id, prompt, max_new_tokens, self.step_count, extra_key, prior
        )
        req.queued_step = self.step_count
        self._next_id += 1
        self.waiting.append(req)
        return req

    def step(self) -> StepResult:
        ready = [r for r in self.running if r.cache_req.swapper is not None]
        admitted, prefilled, done = self._admit()
        decoded, finished, retracted = self._decode(ready)
        self.cache.poll()
        self.step_count += 1
        self.stats.steps += 1
        return StepResult(
            self.step_count - 1, admitted, prefilled, decoded, done + finished, retracted
        )

    def run_until_done(self, max_steps: int) -> list[EngineRequest]:
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

    def held_slots(self) -> tuple[int, int, int]:
        """(device, logical, host) slots the running requests hold outside the tree."""
        device = logical = host = 0
        for r in self.running:
            req = r.cache_req
            device += self.held if req.swapper is not None else self._paged(len(req.tokens))
            logical += self._paged(len(req.tokens))
            host += int((req.own_host >= 0).sum())
        return device, logical, host

    # -- the budget ---------------------------------------------------------------------------
    def _paged(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _life(self, r: EngineRequest) -> int:
        """Logical slots ``r`` holds at its last token (the last output is never fed)."""
        return self._paged(len(r.prompt) + r.max_new_tokens - 1)

    def _logical_claims(self) -> int:
        """Logical slots the running requests may still take (to their last token)."""
        return sum(self._life(r) - self._paged(len(r.cache_req.tokens)) for r in self.running)

    def _fits(self, tokens: list[int], r: EngineRequest) -> bool:
        a, evictable = self.allocator, self.cache.tree.evictable_device_tokens
        staging = max(self._paged(len(tokens)), self.held)
        life = max(self._life(r), self._paged(len(tokens)))
        logical = a.logical_available_size() + evictable - self._logical_claims()
        return staging <= a.device_available_size() + evictable and life <= logical

    # -- admission and prefill ------------------------------------------------------------------
    def _admit(self) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """``_admit_fitting``; when nothing runs and nothing was admitted, wait for the copies
        in flight (they hold host and device pages) and try once more: a step that still
        admits nothing is a stall (``engine.liveness``)."""
        result = self._admit_fitting()
        if result[0] or self.running or not self.waiting:
            return result
        if wait_for_copies(self.cache, self.stats):
            result = self._admit_fitting()
            if result[0] or self.running:
                return result
        w = self.waiting[0]
        tokens = w.prompt + w.output
        a, evictable = self.allocator, self.cache.tree.evictable_device_tokens
        stalled(
            self.cache, self.stats, self.config.debug,
            f"request {w.rid}: {len(tokens)} tokens, staging {self._paged(len(tokens))} of "
            f"{a.device_available_size()} free + {evictable} evictable device slots, life "
            f"{self._life(w)} of {a.logical_available_size()} free logical slots",
        )  # fmt: skip
        return result

    def _admit_fitting(self) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """Admit again what was prefilled but not admitted; then begin and prefill waiting
        requests while they fit (the step's prefill budget, at least one)."""
        for r in [r for r in self.running if r.cache_req.swapper is None]:
            self._try_admit(r)
        admitted, prefilled, done, budget = [], 0, [], self.config.prefill_budget
        while self.waiting and len(self.running) < self.config.max_running:
            w = self.waiting[0]
            tokens = w.prompt + w.output
            if prefilled and prefilled + len(tokens) > budget:
                break
            if not self._fits(tokens, w):
                break  # the head waits for room (nothing starves behind it)
            req = self.serving.begin(tokens, w.extra_key)
            if req is None:  # host or device short after all: wait for a finish
                break
            self.waiting.pop(0)
            w.cache_req, w.target, w.state = req, tokens, ReqState.RUNNING
            self.running.append(w)
            w.note_admitted(self.step_count, len(tokens), req.prefix_len, self.stats)
            admitted.append(w.rid)
            start = req.prefix_len
            kv = StagedKV(self.serving, req, self.model.embed.dtype)
            logits = self.model.forward(torch.tensor(tokens[start:]), start, kv, self.page_size)
            prefilled += len(tokens) - start
            self._try_admit(w)  # before the token: a request done now still caches its prompt
            if w.cache_req is not None and self._emit(w, logits[-1]):
                done.append(w.rid)
        return tuple(admitted), prefilled, tuple(done)

    def _try_admit(self, r: EngineRequest) -> None:
        if self.serving.admit(r.cache_req):
            self._tries.pop(r.rid, None)
            return
        self._tries[r.rid] = self._tries.get(r.rid, 0) + 1
        if self._tries[r.rid] >= ADMIT_TRIES:  # give its slots back; it begins again later
            self._tries.pop(r.rid)
            self.stats.load_failures += 1
            self._requeue(r, insert=False)

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self, ready: list[EngineRequest]):
        decoded, finished, retracted = [], [], []
        for r in ready:
            if r not in self.running:
                continue  # retracted earlier in this step
            req = r.cache_req
            if req.swapper.newest is not None and not self.serving.commit_token(req):
                retracted.append(self._retract(r))  # its last token is computed again
                continue
            slot = self.serving.begin_token(req, r.output[-1])
            while slot is None and len(self.running) > 1:  # host or logical slots short
                victim = min(self.running, key=lambda v: (len(v.output), -v.rid))
                retracted.append(self._retract(victim))
                if victim is r:
                    break
                slot = self.serving.begin_token(req, r.output[-1])
            if slot is None:
                if r in self.running:
                    retracted.append(self._retract(r))
                continue
            pos = len(req.tokens) - 1
            try:
                kv = SwapKV(self.serving, req, slot, dtype=self.model.embed.dtype)
                logits = self.model.forward(torch.tensor([r.output[-1]]), pos, kv, self.page_size)
            except SwapInFailed:
                self.stats.load_failures += 1
                retracted.append(self._retract(r))
                continue
            self.serving.commit_token(req)  # a failure is tried again before its next token
            decoded.append(r.rid)
            if self._emit(r, logits[-1]):
                finished.append(r.rid)
        return tuple(decoded), tuple(finished), tuple(retracted)

    def _emit(self, r: EngineRequest, logits: torch.Tensor) -> bool:
        r.output.append(int(logits.argmax()))
        if self.config.record_logits:
            r.logits.append(logits.clone())
        if r.first_token_step is None:
            r.first_token_step = self.step_count
        if not r.done:
            return False
        req = r.cache_req
        if req.swapper is None:
            self.serving.abort(req)  # never admitted: nothing of it was backed up
        else:
            if req.swapper.newest is not None:  # a last try; else inserted without it
                self.serving.commit_token(req)
            self.serving.finish(req)
        self._leave(r)
        r.state, r.finish_step = ReqState.FINISHED, self.step_count
        self.finished.append(r)
        self.stats.finished += 1
        return True

    def _retract(self, r: EngineRequest) -> int:
        self.stats.retracted += 1
        r.retractions += 1
        self._requeue(r, insert=True)
        return r.rid

    def _requeue(self, r: EngineRequest, *, insert: bool) -> None:
        req = r.cache_req
        if insert and req.swapper is not None:
            self.serving.finish(req)  # its committed pages are cached
        else:
            self.serving.abort(req)
        self._leave(r)
        r.state, r.queued_step = ReqState.WAITING, self.step_count
        self.waiting.append(r)

    def _leave(self, r: EngineRequest) -> None:
        self.running.remove(r)
        self._tries.pop(r.rid, None)
        r.cache_req, r.target = None, []

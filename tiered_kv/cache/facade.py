"""TieredKVCache: the one object a serving loop calls.

```
cache = TieredKVCache(TieredKVConfig(...))
req = cache.begin(prompt_tokens)        # match, prefetch from storage, load host hits (layer-wise)
slots = cache.extend(req, n)            # device slots for the next n tokens (prefill)
cache.write_kv(layer, slots, k, v)      # the model writes KV (through KVWriteLoc)
slot = cache.decode(req, token)         # one more token
cache.finish(req)                       # insert the sequence into the tree, release everything
cache.stats(); cache.prometheus()
```
``req.prefix_len`` tokens of the prompt have KV on the device after ``begin`` (its slots are
``req.slots[:req.prefix_len]``; layer i is readable once the layer-done counter says so, which
the device pool's buffer getters wait for). At least the last prompt token is always left to
compute, so the model has a position to produce logits from.
"""

from __future__ import annotations

import threading

import torch
from prometheus_client import CollectorRegistry, generate_latest

from tiered_kv._checks import check_seconds
from tiered_kv.cache import batch_begin, lifecycle, verify
from tiered_kv.cache.build import build_cache_parts
from tiered_kv.cache.prom import cache_registry, register_cache
from tiered_kv.cache.request import (
    Request,
    batch_identities,
    batch_list,
    check_rows_free,
    prompt_ids,
    token_ids,
)
from tiered_kv.cache.serialized import serialized
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.req_to_token_pool import RequestKV
from tiered_kv.device.write_loc import write_loc_of
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.storage.keys import extra_key_prior


class TieredKVCache(verify.RestoreChecks):  # + set_verifier, verify_restored
    def __init__(self, config: TieredKVConfig, registry: CollectorRegistry | None = None) -> None:
        if not isinstance(config, TieredKVConfig):
            raise InvalidArgumentError(
                f"config must be a TieredKVConfig, got {type(config).__name__}"
            )
        self.config = config
        self.registry, transfers = cache_registry(registry)  # refused before anything is built
        parts = build_cache_parts(config)
        self.device_pool = parts.device_pool
        self.allocator = parts.allocator
        self.req_to_token = parts.req_to_token
        self.host_pool = parts.host_pool
        self.storage = parts.storage
        self.device_host = parts.device_host
        self.host_storage = parts.host_storage
        self.manager = parts.manager
        self.states = parts.states  # a hybrid model's recurrent-state snapshots (or None)
        self.tree, self.metrics = parts.manager.tree, parts.manager.metrics
        self.load_planner = parts.planner  # load or recompute, per request (None: off, no host)
        self._closed = False
        self._lock = threading.RLock()
        self._initial = self.free_sizes()
        register_cache(self, transfers)  # its jobs to the histograms, its counters when scraped

    # -- request lifecycle --------------------------------------------------------------------
    @serialized
    def begin(self, tokens, extra_key: str | bytes | None = None) -> Request:
        """Start a request for prompt ``tokens``: find its cached prefix on every tier, bring
        storage hits to host (per the prefetch policy) and host hits to the device (layer by
        layer), lock that prefix and give the request a row. ``extra_key`` (str or bytes): its
        identity beyond its tokens (LoRA adapter and revision, cache salt, multimodal hashes):
        only pages and state written under the same extra key are matched for it, anywhere."""
        self._check_open()
        prior = extra_key_prior(extra_key)
        req = self._begin_one(self._prompt(tokens), extra_key, prior)
        self.metrics.hits.add(req.hits)
        if self.device_host is not None:
            # The layer waits follow this request: its own load, the one in flight its prefix
            # shares, or none (not an earlier request's, failed or not); an earlier-begun
            # request's forward calls prepare_forward first.
            self.device_host.layer_done_counter.set_consumer(req.load_slot)
        return req

    @serialized
    def begin_many(self, prompts, extra_keys=None, *, cached: bool = True) -> list[Request]:
        """``begin`` for a batch whose forward runs together: the storage hits of all of them
        are fetched as one storage job (each request's chain stopping at its own first
        missing page; one wait, ``prefetch_wait_s`` of the tokens it reads), the host hits
        loaded back as one layer-wise job (one plan, one wait per layer for the whole batch),
        and the layer waits follow that batch. ``extra_keys``: None, or one per prompt (see
        ``begin``). ``cached=False``: every prompt is begun with no prefix (computed whole,
        nothing matched, fetched or loaded; a scheduler's last resort). Every prompt, key and
        free request row is checked first."""
        self._check_open()
        prompts = [self._prompt(t) for t in batch_list("begin_many", "prompts", prompts)]
        extra_keys, priors = batch_identities(len(prompts), extra_keys)
        if not prompts:
            return []
        if not isinstance(cached, bool):
            raise InvalidArgumentError(f"cached={cached!r} must be a bool")
        self._check_rows(len(prompts))
        if not cached:
            return batch_begin.begin_uncached(self, prompts, extra_keys, priors)
        return batch_begin.begin_many(self, prompts, extra_keys, priors)

    def _prompt(self, tokens) -> list[int]:
        return prompt_ids(tokens, self.config.device.max_context_len)

    def _check_rows(self, n: int) -> None:
        check_rows_free(n, self.req_to_token.available_size(), self.config.device.max_requests)

    def _begin_one(
        self, tokens: list[int], extra_key=None, prior: bytes = b"", first=None, cached=True
    ) -> Request:
        """One request's row and grant (``first``: its ``lifecycle.look_many`` look;
        ``cached=False``: no prefix)."""
        kv = self.states.alloc_row() if self.states is not None else RequestKV()
        if kv is None or (self.states is None and self.req_to_token.alloc([kv]) is None):
            raise StateError(
                f"all {self.config.device.max_requests} request rows (or state slots) are in use"
            )
        try:
            grant = (
                self._grant(tokens, prior, first)
                if cached
                else lifecycle.begin_uncached(self.manager, prompt_tokens=len(tokens), prior=prior)
            )
            if self.states is not None:  # the state at the prefix's end, or a shorter prefix
                grant = self.states.settle(self.manager, grant, tokens[:-1], kv.mamba_pool_idx)
        except BaseException:
            self.req_to_token.free(kv.req_pool_idx)  # begin takes nothing it does not give back
            raise
        prefix = grant.prefix_len
        req = Request(
            tokens[:prefix], kv, grant.slots, prefix, grant.hits, grant.node, grant.load_slot
        )
        req.grant, req.owner = grant, self
        req.extra_key, req.prior = extra_key, prior
        if prefix:
            self.req_to_token.write(
                (kv.req_pool_idx, slice(0, prefix)), grant.slots.to(torch.int32)
            )
        kv.kv_allocated_len = prefix
        return req

    def _grant(self, tokens: list[int], prior: bytes, first) -> lifecycle.PrefixGrant:
        return lifecycle.begin(
            self.manager,
            tokens[:-1],  # the last prompt token is always computed
            prompt_tokens=len(tokens),
            prefetch_threshold=self.config.policies.prefetch_threshold,
            prefetch_wait=self.config.policies.prefetch_wait_s,
            prior=prior,
            plan=None if self.load_planner is None else self.load_planner.plan,
            first=first,
        )

    @serialized
    def prepare_forward(self, req: Request | list[Request]) -> None:
        """Make the device pool's per-layer waits follow the host -> device loads of ``req``
        (one request, or the list whose forward runs together). ``begin`` and ``begin_many``
        do this for what they start; call it before the forward pass of earlier-begun
        requests when several are begun before their forwards run. Raises StateError when a
        request's prefix load failed (abort it: its prefix slots do not hold its KV)."""
        reqs = list(req) if isinstance(req, (list, tuple)) else [req]
        if not reqs:
            raise InvalidArgumentError("prepare_forward needs a request or a non-empty list")
        for r in reqs:
            self._check_live(r)
        self.manager.chain_loads.settle_older([r.node for r in reqs])  # one slot covers all
        self.manager.poll()
        for r in reqs:
            if self.manager.holds_stale(r.node):
                raise StateError(
                    f"the host -> device load of this request's prefix failed (request row "
                    f"{r.row}); abort it (its prefix slots do not hold its KV) and begin it again"
                )
        self._follow(reqs)

    def _follow(self, reqs: list[Request]) -> None:
        if self.device_host is None:
            return
        # The newest load still in flight into any of the paths (None when all have landed):
        # the slot begin saw may have been reused by a later load since, failed or not.
        for r in reqs:
            r.load_slot = self.manager.load_slot(r.node)
        slot = self.manager.load_slot(*(r.node for r in reqs))
        self.device_host.layer_done_counter.set_consumer(slot)

    def _alloc(self, req: Request, n: int, decode: bool) -> torch.Tensor | None:
        a = self.allocator
        length = len(req.tokens)
        last = req.slots[-1:].to(torch.int64) if length else torch.tensor([-1])
        if decode:
            seq = torch.tensor([length + 1])
            return a.alloc_decode(seq, seq, last)
        pre, seq = torch.tensor([length]), torch.tensor([length + n])
        return a.alloc_extend(pre, pre, seq, seq, last, n)

    @serialized
    def extend(self, req: Request, tokens) -> torch.Tensor:
        """Device slots for ``tokens`` appended to ``req`` (evicting unlocked device pages if
        needed). Raises StateError when the device cannot hold them."""
        self._check_live(req)
        tokens = token_ids(tokens)
        n = len(tokens)
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if len(req.tokens) + n > self.config.device.max_context_len:
            raise InvalidArgumentError(
                f"request would hold {len(req.tokens) + n} tokens; max_context_len is "
                f"{self.config.device.max_context_len}"
            )
        if self.manager.window is not None:
            self.manager.window.release(req)  # window KV every later query has left behind
        out = self._alloc(req, n, decode=False)
        reachable = self.allocator.available_size() + self.tree.device_tokens
        if out is None and n > reachable:
            # Even evicting every cached page could not make the room: say so before evicting
            # anything (a call that raises changes nothing).
            raise StateError(
                f"device pool cannot hold {n} more tokens: {self.allocator.available_size()} "
                f"free and {self.tree.device_tokens} cached ({self.tree.evictable_device_tokens} "
                "evictable now); finish or abort other requests, or extend in smaller steps"
            )
        if out is None:
            self.manager.make_device_room(n + self.config.device.page_size)
            out = self._alloc(req, n, decode=False)
        if out is None and self.manager.pending_ops():
            # make_device_room waits for device <-> host copies only; a host -> storage backup
            # in flight protects its node's ancestors too, and a device-only ancestor (its host
            # copy evicted) cannot leave the device without dropping that node. Wait for
            # everything in flight before calling the device full.
            self.drain()
            self.manager.make_device_room(n + self.config.device.page_size)
            out = self._alloc(req, n, decode=False)
        if out is None:
            raise StateError(
                f"device pool cannot hold {n} more tokens ({self.allocator.available_size()} "
                f"free, {self.tree.evictable_device_tokens} evictable)"
            )
        start = len(req.tokens)
        self.req_to_token.write((req.row, slice(start, start + n)), out.to(torch.int32))
        req.tokens.extend(tokens)
        req.slots = torch.cat([req.slots, out])
        req.kv.kv_allocated_len = len(req.tokens)
        return out

    @serialized
    def decode(self, req: Request, token: int) -> torch.Tensor:
        """The slot for one more token of ``req``."""
        return self.extend(req, [token])

    @serialized
    def write_kv(self, layer_id: int, slots, k: torch.Tensor, v: torch.Tensor | None):
        """The model's KV for ``slots`` (``extend``'s, as a 1-D integer tensor or any sequence
        of ints) of global layer ``layer_id``; a bad one is an InvalidArgumentError, unwritten."""
        # Window layers write at the tokens' window slots; virtual ids through the plan.
        loc = write_loc_of(self.allocator, self.device_pool, slots)
        self.device_pool.set_kv_buffer(layer_id, loc, k, v)

    @serialized
    def write_index_k(self, layer_id: int, slots, index_k: torch.Tensor) -> None:
        """The sparse indexer's keys for ``slots`` of layer ``layer_id`` (DSA pools only)."""
        write = getattr(self.device_pool, "set_index_k_buffer", None)
        if write is None:
            raise InvalidArgumentError(
                f"this cache's {self.config.geometry.model} pool has no indexer cache; "
                "write_index_k needs geometry model='dsa'"
            )
        write(layer_id, write_loc_of(self.allocator, self.device_pool, slots), index_k)

    @serialized
    def finish(self, req: Request) -> None:
        """Insert ``req``'s whole pages into the tree and release the request: its duplicate
        and partial-page slots are freed, its lock and row returned. A request whose prefix
        load failed is aborted instead."""
        self._check_live(req)
        self._finish_one(req)

    @serialized
    def finish_many(self, reqs) -> None:
        """``finish`` for requests done together: their new pages' write-through copies to
        host go as one job (and, once landed, their backups as one storage job). Every
        request is checked before anything changes."""
        reqs = batch_list("finish_many", "reqs", reqs)
        for r in reqs:
            self._check_live(r)
        if len({id(r) for r in reqs}) != len(reqs):
            raise StateError("finish_many got the same request twice; pass each once")
        batch = self.manager.write_batch
        batch.open()
        try:
            for r in reqs:
                self._finish_one(r)
        finally:
            batch.flush()

    def _finish_one(self, req: Request) -> None:
        inserted = lifecycle.finish(
            self.manager, req.grant, req.tokens, req.slots, windowless=req.window_freed
        )
        if inserted and self.states is not None:
            self.states.capture(req, req.tokens, self.manager)  # the state at its end
        self.req_to_token.free(req.row)
        req.finished = True

    @serialized
    def track_state(self, req: Request, position: int) -> None:
        """Hybrid models: the forward of ``req`` has just absorbed token ``position - 1`` in
        every recurrent layer, ``position`` a page boundary; the cache keeps that state."""
        self._check_live(req)
        if self.states is None:
            raise InvalidArgumentError("track_state needs a hybrid_linear model's cache")
        self.states.track(req, position, self.manager)

    @serialized
    def abort(self, req: Request) -> None:
        """Release ``req`` without inserting anything it computed (a failed forward, a
        cancelled request): its own slots are freed, its lock and row returned."""
        self._check_live(req)
        lifecycle.abort(self.manager, req.grant, req.slots)
        self.req_to_token.free(req.row)
        req.finished = True

    def _check_live(self, req: Request) -> None:
        self._check_open()
        if not isinstance(req, Request) or req.finished or req.owner is not self:
            raise StateError(
                f"request {req!r:.60} is finished or not from this cache; pass a live request "
                "that this cache's begin returned"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this TieredKVCache is closed")

    # -- housekeeping -------------------------------------------------------------------------
    @serialized
    def poll(self) -> None:
        """Acknowledge finished copies (never blocks); a serving loop calls it every step."""
        self.manager.poll()

    @serialized
    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait for every copy and backup in flight and acknowledge them. Raises StateError
        naming what is still in flight if that takes longer than ``timeout_s``."""
        self.manager.drain(check_seconds("timeout_s", timeout_s))

    @serialized
    def free_sizes(self) -> dict[str, int]:
        out = {"device": self.allocator.available_size()}
        out["rows"] = self.req_to_token.available_size()
        if self.host_pool is not None:
            out["host"] = self.host_pool.available_size()
        return out

    @serialized
    def clear_tree(self) -> None:
        """Evict every unlocked node from every tier (storage keeps its pages)."""
        self.drain()
        self.manager.evict_device(1 << 62)
        self.drain()
        self.manager.evict_host(1 << 62)
        self.drain()
        if self.states is not None:
            self.states.evict_all()  # snapshots of prefixes no longer cached go down too

    @serialized
    def stats(self) -> dict:
        return self.metrics.render(self.storage, self.tree)

    @serialized
    def prometheus(self) -> str:
        """The Prometheus text exposition of ``self.registry`` (see ``cache.prom``)."""
        return generate_latest(self.registry).decode()

    @serialized
    def close(self) -> None:
        """Wait for the copies in flight, stop the background threads, close the store. Safe to
        call twice; requests cannot begin, extend or finish afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            for part in (self.device_host, self.host_storage, self.storage, self.states):
                if part is not None:
                    part.close()

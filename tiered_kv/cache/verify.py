"""Sampled live verification: for a fraction of restored prefixes the engine recomputes the
prefix and the cache compares, quarantines what is wrong and makes the request compute it.

Checksums catch bytes that changed after they were checksummed. They cannot see a page that was
wrong before it was (a copy that wrote other rows and reported ok, a store that kept corrupted
bytes under a valid checksum, a store whose index answers one key with another key's intact
value): only recomputing the KV can. The engine registers a verifier (``set_verifier``): a
callable given the request that recomputes its restored prefix ``req.tokens[:req.prefix_len]``,
compares it with what the cache holds (through ``req_to_token`` and the device pool), and
returns True (all equal), False (something differs) or one bool per prefix token (True where
its KV differs). Before the request's first forward the engine calls ``verify_restored(req)``;
the cache decides, with a seeded draw per restored prefix (``verify_fraction``: 0 never, 1
always), whether to call the verifier. A page found wrong is quarantined (``cache.quarantine``:
dropped from every tier), counted (``stats()["verify"]``, ``tiered_kv_verify_*``) and logged
once a minute per kind with its storage keys; the request is cut back to before its first wrong
page and must compute the rest. A verifier that raises or answers nonsense is counted and the
request computes its whole prefix: nothing unverified is passed off as verified.

The reference models verify every restored prefix (``run-reference``: fraction 1.0, recomputed
with caching disabled); the batched engine's synthetic model checks the bytes it wrote; an
engine adapter (the vLLM connector, issue 28) registers its own recompute-and-compare callable
the same way and calls ``verify_restored`` where its scheduler starts a request's forward.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from functools import cached_property

import numpy as np
import torch

from tiered_kv.cache import lifecycle
from tiered_kv.cache.metrics import HitCounters, RequestHits, VerifyCounters
from tiered_kv.cache.quarantine import quarantine_pages
from tiered_kv.cache.request import Request
from tiered_kv.cache.serialized import serialized
from tiered_kv.errors import IntegrityError, InvalidArgumentError, StateError
from tiered_kv.log_limit import LogLimiter
from tiered_kv.tree.node import path_to_root

log = logging.getLogger(__name__)
VERIFY_LOG = LogLimiter(log)  # mismatches and failing verifiers, once a minute per kind
Verifier = Callable[[Request], object]
_TIERS = ("device", "host", "storage")


class RestoreVerifier:
    """Which restored prefixes are checked (a seeded draw for each), the engine's verifier, and
    the storage keys of the pages quarantined last (hex, newest last)."""

    def __init__(self, fraction: float, counts: VerifyCounters, seed: int = 0) -> None:
        self.fraction = float(fraction)
        self.counts = counts
        self.hook: Verifier | None = None
        self._rng = random.Random(seed)
        self.recent: deque[str] = deque(maxlen=64)

    def set(self, hook: Verifier | None, seed: int = 0) -> None:
        if hook is not None and not callable(hook):
            raise InvalidArgumentError(f"the verifier must be callable (or None), got {hook!r:.60}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"seed={seed!r} must be an int")
        self.hook, self._rng = hook, random.Random(seed)

    def sample(self) -> bool:
        """Whether the next restored prefix is checked (no draw at fraction 0 or 1)."""
        if self.fraction >= 1.0:
            return True
        return self.fraction > 0.0 and self._rng.random() < self.fraction


class RestoreChecks:
    """The facade's verification calls (``TieredKVCache`` mixes them in)."""

    @cached_property
    def verifier(self) -> RestoreVerifier:
        return RestoreVerifier(self.config.policies.verify_fraction, self.metrics.verify)

    @serialized
    def set_verifier(self, hook: Verifier | None, *, seed: int = 0) -> None:
        """Register the engine's verifier (see the module; None: none) and seed the draws that
        choose which restored prefixes it checks (``verify_fraction`` of them)."""
        self.verifier.set(hook, seed)

    @serialized
    def verify_restored(self, req: Request) -> bool:
        """Call once ``req``'s restored prefix is to be read, before its first forward computes
        anything (slots ``extend`` gave it may exist, but no KV written to them). For a sampled
        restored prefix: waits for every load in flight into the device (the verifier reads
        every layer), then calls the verifier. True: the prefix stands (nothing restored, not
        sampled, no verifier, or found equal). False: it was cut back, ``req.prefix_len`` is
        shorter, and positions ``req.prefix_len .. len(req.tokens)`` hold slots without KV:
        compute them (a request that had not extended has ``req.tokens`` cut back to its
        prefix: compute the rest of its prompt). Wrong pages are quarantined, whatever else.
        Later calls return True. Raises InvalidArgumentError for a hybrid or sliding-window
        model's request that has extended already (nothing changed), and StateError when no
        device room can be had for the positions to compute again (abort it and begin it
        again; its wrong pages are quarantined and its prefix is stale)."""
        self._check_live(req)
        return check_restored(self, req)


def check_restored(cache, req: Request) -> bool:
    v, counts, manager = cache.verifier, cache.metrics.verify, cache.manager
    if req.verify_decided or req.prefix_len == 0:
        return True
    if len(req.tokens) > req.prefix_len and (
        cache.states is not None or manager.window is not None
    ):
        raise InvalidArgumentError(
            "verify_restored of a hybrid or sliding-window model's request must come before "
            "its first extend (its state or window KV would have to be taken back too)"
        )
    req.verify_decided = True
    # Copies known to be garbage (a failed load's, or pages another request's check
    # quarantined) are never served, sampled or not: cut before them.
    cut = _cut_stale(cache, req)
    if req.prefix_len == 0:
        return not cut
    if v.hook is None or not v.sample():
        counts.skipped += 1
        return not cut
    counts.sampled += 1
    # Hazard: the verifier reads every layer of the prefix at once, and a load in flight into
    # it (this request's, or one it shares) may still fail: wait for them all, acknowledge.
    manager.chain_loads.settle_older()
    manager.poll()
    cache._follow([req])  # noqa: SLF001 - the layer waits follow what is still in flight
    cut = _cut_stale(cache, req) or cut
    if req.prefix_len == 0:
        return False
    try:
        bad = bad_pages(v.hook(req), req.prefix_len, manager.page_size)
    except Exception as exc:  # noqa: BLE001 - a failing verifier is counted; the prefix recomputed
        counts.errors += 1
        VERIFY_LOG.log(
            logging.WARNING, "error", "the verifier failed (%s: %s) on a %d-token prefix "
            "(request row %d); that prefix is computed again", type(exc).__name__, exc,
            req.prefix_len, req.row,
        )  # fmt: skip
        _cut(cache, req, 0)
        return False
    if not bad:
        counts.verified += 1
        counts.verified_tokens += req.prefix_len
        return not cut
    counts.mismatched += 1
    counts.quarantined_pages += len(bad)
    keys = quarantine_pages(
        manager, req.tokens[: req.prefix_len], bad, prior=req.prior, states=cache.states
    )
    v.recent.extend(k.hex() for k in keys)
    VERIFY_LOG.log(
        logging.WARNING, "mismatch", "restored prefix failed verification: %d of its %d pages "
        "differ (request row %d, hits %s); quarantined on every tier, page keys %s",
        len(bad), req.prefix_len // manager.page_size, req.row, req.hits,
        ", ".join(k.hex() for k in keys[:8]) + (" ..." if len(keys) > 8 else ""),
    )  # fmt: skip
    _cut(cache, req, bad[0] * manager.page_size)
    return False


def bad_pages(verdict: object, prefix_len: int, page_size: int) -> list[int]:
    """The prefix's page indices a verifier's answer says are wrong: True none, False all, else
    one bool per prefix token. Anything else is an InvalidArgumentError."""
    pages = prefix_len // page_size
    if isinstance(verdict, (bool, np.bool_)):
        return [] if verdict else list(range(pages))
    try:
        flags = torch.as_tensor(verdict)
    except (TypeError, ValueError, RuntimeError):
        flags = None
    if flags is None or flags.dtype != torch.bool or tuple(flags.shape) != (prefix_len,):
        what = "" if flags is None else f" of dtype {flags.dtype} and shape {tuple(flags.shape)}"
        raise InvalidArgumentError(
            f"the verifier answered {type(verdict).__name__}{what}; it must answer True, False "
            f"or {prefix_len} bools (one per prefix token, True where its KV differs)"
        )
    return flags.view(pages, page_size).any(dim=1).nonzero().flatten().tolist()


def _cut_stale(cache, req: Request) -> bool:
    """Cut ``req`` back to before the first garbage device copy on its prefix, if any (counted
    in ``stale_cut``). Returns whether it cut."""
    pos = 0
    for n in reversed(list(path_to_root(req.node))):
        if n.stale:
            cache.metrics.verify.stale_cut += 1
            _cut(cache, req, pos)
            return True
        pos += len(n)
    return False


def _cut(cache, req: Request, length: int) -> None:
    """Cut ``req``'s prefix back to at most ``length`` tokens (whole pages): a request that has
    not extended keeps the prefix a new match would grant there (the sliding-window and state
    rules applied, a hybrid's state restored) and its tokens are cut back with it; one that has
    extended gets fresh device slots for the tokens taken back. The hits move to ``missed``."""
    manager, old, prefix = cache.manager, req.grant, req.prefix_len
    before = RequestHits(**vars(req.hits))
    fresh = None
    if len(req.tokens) > prefix:
        fresh = manager.alloc_device(prefix - length)
        if fresh is None:
            raise StateError(
                f"no device room to compute {prefix - length} restored tokens again (request "
                f"row {req.row}); abort it and begin it again (its wrong pages are quarantined)"
            )
    else:
        m = manager.match_prefix(
            req.tokens[:length], check_storage=False, count_hit=False, prior=req.prior
        )
        length = m.device_hit_length  # the window or state rule may want a shorter one
    grant = lifecycle.cut_back(manager, old, req.tokens, length)
    if fresh is None:
        if cache.states is not None:
            grant = cache.states.settle(
                manager, grant, req.tokens[: grant.prefix_len], req.kv.mamba_pool_idx
            )
        req.tokens, req.slots = req.tokens[: grant.prefix_len], req.slots[: grant.prefix_len]
    else:
        if grant.prefix_len != length:  # the path to ``length`` is locked, on the device, whole
            raise IntegrityError(f"cut to {length} tokens granted {grant.prefix_len}")
        cache.req_to_token.write((req.row, slice(length, prefix)), fresh.to(torch.int32))
        req.slots = torch.cat([req.slots[:length], fresh.to(req.slots.dtype), req.slots[prefix:]])
    req.grant, req.node, req.prefix_len, req.hits = grant, grant.node, grant.prefix_len, grant.hits
    req.load_slot = None
    req.kv.kv_allocated_len = len(req.tokens)
    cache.metrics.verify.recomputed_tokens += prefix - grant.prefix_len
    _move_hits(cache.metrics.hits, before, grant.hits)


def _move_hits(totals: HitCounters, before: RequestHits, after: RequestHits) -> None:
    """The cache's hit totals as if the request had been granted ``after`` from the start."""
    for tier in (*_TIERS, "missed"):
        setattr(totals, tier, getattr(totals, tier) + getattr(after, tier) - getattr(before, tier))

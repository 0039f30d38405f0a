"""The request lifecycle over the manager, written once: begin, finish, abort.

``begin`` finds a request's cached prefix on every tier, cuts it where a load planner says
(before anything moves), brings a storage hit to host (waiting per the prefetch policy), loads
the host part back to the device (one layer-wise job), and locks that prefix; ``finish``
inserts the request's whole pages, frees its duplicate and partial-page slots and unlocks;
``abort`` frees its own slots and unlocks without inserting. The facade wraps request rows
around these; the simulator calls them on its counting fakes, so both run the same decisions.

Requests begun together (``begin_many``) take ``begin`` in two steps: ``look_many`` matches
every one of them and fetches all their storage hits as one storage job, then ``begin`` with
each one's ``first`` look finishes it (a second look, the load-back, the lock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_kv.cache.manager import CacheManager
from tiered_kv.cache.metrics import RequestHits
from tiered_kv.cache.prefetch import PrefetchOp
from tiered_kv.cache.prefix_match import PrefixMatch
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tree.node import TreeNode


@dataclass
class PrefixGrant:
    """What ``begin`` gave a request: its locked prefix and where it came from."""

    node: TreeNode  # deepest tree node locked for the request
    slots: torch.Tensor  # device slots of the prefix (its first ``len(slots)`` tokens)
    hits: RequestHits
    load_slot: int | None  # layer-done counter slot of its host -> device load
    prior: bytes = b""  # the request's identity (``storage.keys.extra_key_prior``)

    @property
    def prefix_len(self) -> int:
        return len(self.slots)


def begin(
    manager: CacheManager,
    tokens,
    *,
    prompt_tokens: int,
    prefetch_threshold: int = 1,
    prefetch_wait: Callable[[int], float | None] = lambda tokens: None,
    prior: bytes = b"",
    plan: Callable[[PrefixMatch], int] | None = None,
    first: FirstLook | None = None,
) -> PrefixGrant:
    """Lock the cached prefix of ``tokens`` on the device. A storage hit of at least
    ``prefetch_threshold`` tokens is prefetched (waiting ``prefetch_wait(hit tokens)``
    seconds, None: until done). When the device cannot take the host part, that part is
    computed instead. ``prompt_tokens``: the request's prompt length (for the hit counts).
    ``prior``: the request's identity; only pages written under the same one are matched.
    ``plan`` (``LoadPlanner.plan``): given the match, how many of its tokens to take (whole
    pages, at least the device part); the rest is computed, nothing of it fetched or loaded.
    ``first``: this request's ``look_many`` result (its prefetch done with its batch's)."""
    if first is None:
        first = look(manager, tokens, prompt_tokens, prefetch_threshold, prior, plan)
        if first.op is not None:
            first.gained = manager.prefetcher.finish(
                first.op, prefetch_wait(first.match.storage_hit_length)
            )
        again = tokens if first.fetched else None
    else:  # ``look_many``'s: the batch's other requests changed the tree since the look
        again = list(tokens)[: first.end]
    m, hits = first.match, first.hits
    if again is not None:
        # A second look at this request's prefix (no second hit), gained or not: the prefetch
        # acknowledged finished jobs, so a failed load may have made part of the first look
        # stale, and its release may have freed those device slots.
        m = manager.match_prefix(again, check_storage=False, count_hit=False, prior=prior)
        hits.device = m.device_hit_length
        hits.storage = min(first.gained, m.host_hit_length)  # at the end of the host part
        hits.host = m.host_hit_length - hits.storage
    node = m.last_node
    slots = m.device_indices
    if not node.on_device and node.parent is not None:
        loaded = manager.load_back(node)
        if loaded is None:  # no device room: compute the host part instead
            # A last look: making room acknowledged finished jobs, so a failed load may have
            # made the device part stale (and freed it); a match stops before a stale copy.
            m = manager.match_prefix(tokens, check_storage=False, count_hit=False, prior=prior)
            node, slots = m.last_device_node, m.device_indices
            hits.device, hits.host, hits.storage = m.device_hit_length, 0, 0
        else:
            slots = torch.cat([slots, loaded])
    # Hazard: a device part still being loaded (by this request, or by another one begun
    # earlier that shares it) must not be read before its layers land.
    load_slot = manager.load_slot(node) if node.parent is not None else None
    manager.inc_lock_ref(node)
    prefix = len(slots)
    hits.missed = prompt_tokens - prefix
    hits.host = min(hits.host, prefix - hits.device)
    return PrefixGrant(node, slots, hits, load_slot, prior)


def begin_uncached(manager: CacheManager, *, prompt_tokens: int, prior: bytes = b"") -> PrefixGrant:
    """A grant of no prefix: the request computes every token, whatever the tiers hold (a
    scheduler's last resort for a request that must run alone; its whole pages are inserted
    at ``finish`` like any other's, duplicates freed). Nothing is matched, moved or counted
    as a hit; the identity's root is locked like any grant's node."""
    m = manager.match_prefix([], check_storage=False, count_hit=False, prior=prior)
    manager.inc_lock_ref(m.last_node)
    hits = RequestHits(prompt_tokens, 0, 0, 0, prompt_tokens)
    return PrefixGrant(m.last_node, m.device_indices, hits, None, prior)


@dataclass
class FirstLook:
    """``begin``'s first look at a request's prefix: the match (cut per the plan), the hits so
    far, and its storage hit's prefetch, started (``op``) or not."""

    match: PrefixMatch
    hits: RequestHits
    end: int  # tokens the grant may reach: device + host, + the storage hit if fetched
    fetched: bool  # the storage hit was long enough to prefetch (a second look follows)
    op: PrefetchOp | None = None
    gained: int = 0  # tokens the prefetch attached


def look(
    manager: CacheManager,
    tokens,
    prompt_tokens: int,
    threshold: int,
    prior: bytes,
    plan: Callable[[PrefixMatch], int] | None,
) -> FirstLook:
    """Match ``tokens`` (after acknowledging finished jobs), cut per ``plan``, and start the
    prefetch of a storage hit of at least ``threshold`` tokens (held, while the prefetcher's
    batch is open)."""
    manager.poll()
    m = manager.match_prefix(tokens, prior=prior)
    if plan is not None:
        m = _follow_plan(manager, m, tokens, plan, max(1, threshold))
    hits = RequestHits(prompt_tokens, m.device_hit_length, m.host_hit_length, 0, 0)
    fetched = m.storage_hit_length >= max(1, threshold)
    end = m.device_hit_length + m.host_hit_length + (m.storage_hit_length if fetched else 0)
    op = manager.prefetcher.start(m, tokens) if fetched else None
    return FirstLook(m, hits, end, fetched, op)


def look_many(
    manager: CacheManager,
    prompts: list[list[int]],
    priors: list[bytes],
    *,
    prompt_tokens: list[int],
    prefetch_threshold: int = 1,
    prefetch_wait: Callable[[int], float | None] = lambda tokens: None,
    plan: Callable[[PrefixMatch], int] | None = None,
) -> list[FirstLook]:
    """The first looks of requests begun together (``prompts``: each one's tokens to match,
    ``prompt_tokens``: its prompt's length), their storage hits fetched as one job; pass each
    to ``begin`` as ``first``. The batch waits ``prefetch_wait(tokens the job reads)``. Every
    prefetch has ended (attached or freed, its locks returned) when this returns or raises."""
    pf = manager.prefetcher
    looks: list[FirstLook] = []
    pf.open()
    try:
        for tokens, prior, n in zip(prompts, priors, prompt_tokens, strict=True):
            looks.append(look(manager, tokens, n, prefetch_threshold, prior, plan))
    except BaseException:
        pf.flush()
        pf.finish_many([lk.op for lk in looks if lk.op is not None], 0)
        raise
    pf.flush()
    ops = [lk for lk in looks if lk.op is not None]
    wait = prefetch_wait(sum(len(lk.op.host) for lk in ops)) if ops else 0
    for lk, gained in zip(ops, pf.finish_many([lk.op for lk in ops], wait), strict=True):
        lk.gained = gained
    return looks


def _follow_plan(
    manager: CacheManager,
    m: PrefixMatch,
    tokens,
    plan: Callable[[PrefixMatch], int],
    threshold: int,
) -> PrefixMatch:
    """``m`` cut where ``plan`` says, before anything moves; the tokens it declines are
    counted per tier (a storage hit under ``threshold`` is never fetched: not offered)."""
    ps, device, host = manager.page_size, m.device_hit_length, m.host_hit_length
    storage = m.storage_hit_length if m.storage_hit_length >= threshold else 0
    if host + storage == 0:
        return m  # only device hits (or none): nothing to decide
    offered = m._replace(storage_hit_length=storage, storage_keys=m.storage_keys[: storage // ps])
    end = device + host + storage
    cut = plan(offered)
    if isinstance(cut, bool) or not isinstance(cut, int) or not device <= cut <= end or cut % ps:
        raise InvalidArgumentError(
            f"the load plan returned {cut!r}; it must be a whole number of pages (page_size "
            f"{ps}) from the device part ({device}) to the match's end ({end})"
        )
    took_storage = max(0, cut - device - host)
    if took_storage and took_storage < threshold:  # too short to be fetched: computed
        cut, took_storage = device + host, 0
    counts = manager.metrics.planner
    counts.planned += 1
    counts.declined_storage_tokens += storage - took_storage
    counts.declined_host_tokens += device + host - min(cut, device + host)
    if cut == end:
        return m
    if cut >= device + host:  # the first storage pages only (or none: no prefetch)
        pages = took_storage // ps
        return m._replace(
            storage_hit_length=took_storage,
            storage_keys=m.storage_keys[:pages],
            storage_windowless=min(m.storage_windowless, pages),
        )
    # Inside the host part: a second look at the shorter prefix (no second hit) splits the
    # tree at the cut, so only the host pages before it are loaded back.
    return manager.match_prefix(tokens[:cut], check_storage=False, count_hit=False, prior=m.prior)


def finish(
    manager: CacheManager,
    grant: PrefixGrant,
    tokens,
    slots: torch.Tensor,
    *,
    poll: bool = True,
    windowless: int = 0,
) -> bool:
    """Insert ``tokens``' whole pages (their KV in ``slots``, the first ``grant.prefix_len`` of
    them the grant's) and release the grant: duplicate and partial-page slots of the request
    are freed, the lock returned. A request whose prefix load failed is aborted instead (the KV
    it computed on top of garbage is not worth keeping). Returns whether it was inserted.
    ``poll``: acknowledge finished jobs first (a failed load shows up as stale only then).
    ``windowless``: a sliding-window request's first tokens whose window KV it released."""
    if poll:
        manager.poll()
    if manager.holds_stale(grant.node):
        abort(manager, grant, slots)
        return False
    ps = manager.page_size
    full = len(tokens) - len(tokens) % ps
    dup = 0
    if full:
        dup = manager.insert(tokens[:full], slots[:full], min(windowless, full), grant.prior)
    # The first ``prefix_len`` slots came from the tree: they are its, never ours to free.
    if dup > grant.prefix_len:
        manager.device.free(slots[grant.prefix_len : dup])
    if full < len(tokens):
        manager.device.free(slots[full:])
    manager.dec_lock_ref(grant.node)
    return True


def cut_back(manager: CacheManager, grant: PrefixGrant, tokens, length: int) -> PrefixGrant:
    """The grant of ``grant``'s first ``length`` tokens (a whole number of pages, at most its
    prefix): the lock moves to the node ending there (split if needed), the hits cut from the
    deepest tier first count as missed. ``grant`` is spent; use the one returned."""
    length = min(length, grant.prefix_len)
    m = manager.tree.match(list(tokens)[:length], probe=False, prior=grant.prior)
    node, _ = manager.tree.node_at(m)
    # The prefix was on the device: the match stops earlier only before a failed load's copy.
    length = min(length, m.device_len)
    manager.inc_lock_ref(node)
    manager.dec_lock_ref(grant.node)
    h = grant.hits
    cut = grant.prefix_len - length
    for tier in ("storage", "host", "device"):
        take = min(cut, getattr(h, tier))
        setattr(h, tier, getattr(h, tier) - take)
        cut -= take
    h.missed = h.prompt_tokens - length
    return PrefixGrant(node, grant.slots[:length], h, grant.load_slot, grant.prior)


def abort(manager: CacheManager, grant: PrefixGrant, slots: torch.Tensor) -> None:
    """Release ``grant`` without inserting anything: the request's own slots (after the
    prefix) are freed, the lock returned."""
    if len(slots) > grant.prefix_len:
        manager.device.free(slots[grant.prefix_len :])
    manager.dec_lock_ref(grant.node)

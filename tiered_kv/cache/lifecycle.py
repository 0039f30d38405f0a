"""The request lifecycle over the manager, written once: begin, finish, abort.

``begin`` finds a request's cached prefix on every tier, brings a storage hit to host (waiting
per the prefetch policy), loads the host part back to the device (one layer-wise job), and locks
that prefix; ``finish`` inserts the request's whole pages, frees its duplicate and partial-page
slots and unlocks; ``abort`` frees its own slots and unlocks without inserting. The facade wraps
request rows around these; the simulator calls them on its counting fakes, so both run the same
decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_kv.cache.manager import CacheManager
from tiered_kv.cache.metrics import RequestHits
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
) -> PrefixGrant:
    """Lock the cached prefix of ``tokens`` on the device. A storage hit of at least
    ``prefetch_threshold`` tokens is prefetched (waiting ``prefetch_wait(hit tokens)``
    seconds, None: until done). When the device cannot take the host part, that part is
    computed instead. ``prompt_tokens``: the request's prompt length (for the hit counts).
    ``prior``: the request's identity; only pages written under the same one are matched."""
    manager.poll()
    m = manager.match_prefix(tokens, prior=prior)
    hits = RequestHits(prompt_tokens, m.device_hit_length, m.host_hit_length, 0, 0)
    if m.storage_hit_length >= max(1, prefetch_threshold):
        op = manager.prefetcher.start(m, tokens)
        gained = 0
        if op is not None:
            gained = manager.prefetcher.finish(op, prefetch_wait(m.storage_hit_length))
        # A second look at this request's prefix (no second hit), gained or not: the prefetch
        # acknowledged finished jobs, so a failed load may have made part of the first look
        # stale, and its release may have freed those device slots.
        m = manager.match_prefix(tokens, check_storage=False, count_hit=False, prior=prior)
        hits.device = m.device_hit_length
        hits.storage = min(gained, m.host_hit_length)  # attached at the end of the host part
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

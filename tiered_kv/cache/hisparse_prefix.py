"""A sparse request's cached prefix brought to host and protected there (HiSparse in the cache).

A HiSparse request never needs its prefix on the device: decode swaps the tokens each layer's
indexer selects in from host, and only its prefill reads the prefix (from a transient device
copy). So a tree hit ends on the host: a storage hit is prefetched to host (per the prefetch
policy), device-only nodes are written to host first (waiting for the copy), copies to host
still in flight are waited for, and the path is protected there (``inc_host_ref``) until the
request finishes. The prefix ends before the first node whose host copy cannot be had (no host
room, a failed copy): those tokens are computed, never read from an unproven copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_kv.cache.manager import CacheManager
from tiered_kv.cache.metrics import RequestHits
from tiered_kv.names import PendingKind
from tiered_kv.tree.node import TreeNode, path_to_root

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class HostPrefix:
    """The protected prefix: its deepest node (the root when empty), its host slot per token."""

    node: TreeNode
    host_slots: torch.Tensor
    hits: RequestHits
    protected: bool  # ``inc_host_ref(node)`` taken (release with ``dec_host_ref``)

    @property
    def length(self) -> int:
        return len(self.host_slots)


def find_on_host(
    manager: CacheManager, tokens, prompt_tokens: int, prior: bytes, threshold: int, wait
) -> HostPrefix:
    """The cached prefix of ``tokens`` (the prompt without its last token) on host, protected.
    ``threshold``: the shortest storage hit prefetched; ``wait(tokens)``: how long to wait for
    it (None: until done)."""
    manager.poll()
    m = manager.match_prefix(tokens, prior=prior)
    gained = 0
    if m.storage_hit_length >= max(1, threshold):
        op = manager.prefetcher.start(m, tokens)
        if op is not None:
            gained = manager.prefetcher.finish(op, wait(m.storage_hit_length))
    m = manager.match_prefix(tokens, check_storage=False, count_hit=False, prior=prior)
    path = [n for n in reversed(list(path_to_root(m.last_node))) if n.parent is not None]
    if any(PendingKind.WRITE in n.pending for n in path):
        manager.wait_all()  # host bytes still landing: the copy may yet fail (and be undone)
        manager.poll()
    last, slots, device = m.last_node, [], 0
    for n in path:
        if n.stale or n.parent is None:  # a failed load's device copy above: the path ends
            last = n.parent
            break
        if not n.on_host and n.on_device:
            manager.write_to_host(n, wait=True)
            if PendingKind.WRITE in n.pending:  # held by an open batch: settle it now
                manager.wait_all()
                manager.poll()
        if not n.on_host:
            last = n.parent
            break
        device += len(n) if n.on_device else 0
        slots.append(n.host.to(torch.int64))
    else:
        last = path[-1] if path else m.last_node
    host_slots = torch.cat(slots) if slots else _EMPTY
    length = len(host_slots)
    storage = min(gained, max(0, length - min(device, m.device_hit_length)))
    hits = RequestHits(prompt_tokens, device, length - device - storage, storage, 0)
    hits.missed = prompt_tokens - length
    protected = length > 0
    if protected:
        manager.inc_host_ref(last)
    return HostPrefix(last, host_slots, hits, protected)

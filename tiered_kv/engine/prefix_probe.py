"""What of a prompt is cached, on each tier, looked up without taking a hit: the numbers the
scheduler orders and budgets its waiting queue by. Nothing is split, touched or locked."""

from __future__ import annotations

from typing import NamedTuple

from tiered_kv.cache import TieredKVCache
from tiered_kv.storage.keys import page_keys_of


class CachedPrefix(NamedTuple):
    device: int  # tokens of the prefix on the device
    host: int  # the tokens after those, on the host
    storage: int  # the whole pages after those that storage holds (0 unless asked)
    unlocked_device: int  # device tokens no running request holds (begin would lock them)


def cached_prefix(
    cache: TieredKVCache, tokens: list[int], *, storage: bool = False, prior: bytes = b""
) -> CachedPrefix:
    """The cached prefix of ``tokens`` (whole pages) for the request identity ``prior``
    (``storage.keys.extra_key_prior``). ``storage``: also ask the store how many of the
    following pages it holds (one ``batch_exists``; a store that fails counts 0)."""
    tree, manager = cache.tree, cache.manager
    probe = storage and manager.store is not None and manager.namespace is not None
    m = tree.match(tokens, probe=probe, prior=prior)
    unlocked = sum(n for node, n in m.steps if node.on_device and node.lock_ref == 0)
    stored = 0
    if probe and m.probe_digests:
        keys = page_keys_of(manager.namespace, m.probe_digests)
        stored = manager.probe_storage(keys) * tree.page_size
    return CachedPrefix(m.device_len, m.host_len, stored, unlocked)

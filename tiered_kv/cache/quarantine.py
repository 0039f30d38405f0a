"""Quarantine: pages a verifier found wrong, dropped from every tier so that no later request is
served them.

``quarantine_pages`` waits for every copy in flight first (a copy landing on those pages, or a
backup storing them again after their keys are deleted, would undo it), then takes the first
wrong page's node and its subtree off the tree (``tree.quarantine``: copies nobody holds are
freed now, held device copies become stale and go at their last unlock), deletes the wrong
pages' keys from the store (both kinds of a sliding-window model's page) and forgets a hybrid
model's state snapshots at every page it dropped. The store's delete runs on the caller's
thread: a quarantine is rare, and the pages must be gone before the call returns.
"""

from __future__ import annotations

from tiered_kv.cache.manager import CacheManager
from tiered_kv.errors import StateError
from tiered_kv.storage.keys import page_digests, page_keys_of
from tiered_kv.tree.node import first_page, walk
from tiered_kv.tree.quarantine import quarantine

DRAIN_TIMEOUT_S = 600.0


def quarantine_pages(
    manager: CacheManager, tokens, bad_pages: list[int], *, prior: bytes = b"", states=None
) -> list[bytes]:
    """Drop pages ``bad_pages`` (indices, ascending) of the prefix ``tokens`` (whole pages, a
    request's locked prefix under identity ``prior``) from every tier, and every page the tree
    holds below the first of them. ``states``: a hybrid model's ``RecurrentState`` (or None).
    Returns the storage keys of the wrong pages (deleted from the store where it has them; their
    chain digests where the cache has no namespace).
    Blocks until every job in flight has finished; StateError if the prefix is not the tree's."""
    tree, ps = manager.tree, manager.page_size
    key = tree.aligned(tokens)
    if not bad_pages or bad_pages[-1] * ps >= len(key):
        raise StateError(f"quarantine of pages {bad_pages[:8]} of a {len(key)}-token prefix")
    first = bad_pages[0] * ps
    manager.drain(DRAIN_TIMEOUT_S)
    m = tree.match(key[:first], probe=False, prior=prior)
    if m.length != first:
        raise StateError(
            f"quarantine: the tree holds {m.length} of the {first} tokens before the first "
            "wrong page; pass a prefix a live request holds"
        )
    _, above = tree.node_at(m)  # a node now ends where the first wrong page begins
    node = above.children.get(first_page(key[first:], ps))
    digests = page_digests(key, ps, prior)
    dropped = [digests[p] for p in bad_pages]
    if node is not None:
        dropped += [d for n in [node, *walk(node)] for d in n.digests]
        released = quarantine(tree, node)
        for slots in released.device:
            manager.device.free(slots)
        for slots in released.host:
            manager.host.free(slots)
    wrong = [digests[p] for p in bad_pages]
    if manager.namespace is None:  # no store: the pages' chain digests name them
        keys = wrong
    else:
        keys = page_keys_of(manager.namespace, wrong)
    if manager.store is not None:
        doomed = list(keys)
        if manager.window is not None:  # its full-KV-only values of the same pages too
            doomed += page_keys_of(manager.namespace, wrong, windowless=True)
        try:
            manager.store.delete(doomed)
        except Exception as exc:  # noqa: BLE001 - storage trouble is counted, never raised
            manager.jobs.storage_error("delete", f"{type(exc).__name__}: {exc}")
    if states is not None:
        states.ledger.discard(dict.fromkeys(dropped))
    return [bytes(k) for k in keys]

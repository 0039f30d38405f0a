"""check_tree: every structural invariant of a :class:`TieredTree`, raising with the counts.

Checked: links (each child is filed under its first page and points back at its parent), whole
pages, residency (every node on device or host; device residency prefix-closed; slot tensors as
long as the key; no slot owned twice; policies track exactly the resident nodes), refs (a node's
lock and host refs at least its children's sum, never negative), digests (each node's digests
are the page chain from its parent's last digest, where the tree keeps digests), pending marks
(each names a job the tree knows, which lists the node; with ``jobs``, only jobs in flight), and
the residency counters against a walk, and that every evictable node is in its tier's victim
queue (or marked to be looked at).
"""

from __future__ import annotations

from tiered_kv.errors import IntegrityError
from tiered_kv.storage.keys import DIGEST_BYTES, page_digests
from tiered_kv.tree.node import first_page
from tiered_kv.tree.tiered_tree import TieredTree
from tiered_kv.tree.victims import unqueued


def check_tree(tree: TieredTree, *, jobs: set | None = None) -> None:
    """Raise IntegrityError naming the first broken invariant and its counts."""
    P, root = tree.page_size, tree.root
    dev_seen: set[int] = set()
    host_seen: set[int] = set()
    dev_tokens = host_tokens = evictable = nodes = 0

    def fail(where: str, what: str) -> None:
        raise IntegrityError(f"{where}: {what} (tree of {nodes} nodes checked so far)")

    for prior, r in tree.roots.items():
        if r.parent is not None or r.key or r.on_device or r.on_host or r.lock_ref != 1:
            fail(repr(r), f"the root of identity {prior.hex()[:16]!r} is not a bare root")
        if r is not root and (r.digests != [prior] or len(prior) != DIGEST_BYTES):
            fail(repr(r), "an identity's root does not carry its identity's chain prior")
    for n in tree.walk():
        nodes += 1
        where = repr(n)
        if n.parent is None or n.parent.children.get(first_page(n.key, P)) is not n:
            fail(where, "not filed under its first page in its parent")
        if len(n) == 0 or len(n) % P:
            fail(where, f"{len(n)} tokens is not a whole number of pages of {P}")
        for ck, c in n.children.items():
            if ck != first_page(c.key, P) or c.parent is not n:
                fail(where, "a child is filed under the wrong page or points elsewhere")
        if not (n.on_device or n.on_host):
            fail(where, "on neither device nor host")
        if n.on_device:
            if not (n.parent.parent is None or n.parent.on_device):
                fail(where, "on the device below a parent that is not (not prefix-closed)")
            if len(n.device) != len(n):
                fail(where, f"{len(n.device)} device slots for {len(n)} tokens")
            s = n.device.tolist()
            if dev_seen.intersection(s):
                fail(where, f"device slots {sorted(dev_seen.intersection(s))[:8]} owned twice")
            dev_seen.update(s)
            dev_tokens += len(n)
            evictable += len(n) if n.lock_ref == 0 else 0
            if n not in tree.device_policy:
                fail(where, "on the device but unknown to the device policy")
        elif n in tree.device_policy:
            fail(where, "the device policy tracks a node that is not on the device")
        if n.on_host:
            if len(n.host) != len(n):
                fail(where, f"{len(n.host)} host slots for {len(n)} tokens")
            s = n.host.tolist()
            if host_seen.intersection(s):
                fail(where, f"host slots {sorted(host_seen.intersection(s))[:8]} owned twice")
            host_seen.update(s)
            host_tokens += len(n)
            if n not in tree.host_policy:
                fail(where, "on the host but unknown to the host policy")
        elif n in tree.host_policy:
            fail(where, "the host policy tracks a node that is not on the host")
        locks = sum(c.lock_ref for c in n.children.values())
        if not n.lock_ref >= locks >= 0:
            fail(where, f"lock_ref {n.lock_ref} below its children's sum {locks}")
        refs = sum(c.host_ref for c in n.children.values())
        if not n.host_ref >= refs >= 0:
            fail(where, f"host_ref {n.host_ref} below its children's sum {refs}")
        if tree.digests and n.digests != page_digests(list(n.key), P, n.parent.last_digest()):
            fail(where, "digests are not the page chain from the parent's last digest")
        for kind, job_id in n.pending.items():
            if jobs is not None and job_id not in jobs:
                fail(where, f"pending {kind} job {job_id} is not in flight")
            if n not in tree.job_nodes(job_id):
                fail(where, f"pending {kind} job {job_id} does not list the node")
    counted = (tree.device_tokens, tree.host_tokens, tree.evictable_device_tokens)
    if counted != (dev_tokens, host_tokens, evictable):
        raise IntegrityError(
            f"residency counters (device, host, evictable device tokens) = {counted}, but the "
            f"tree holds {(dev_tokens, host_tokens, evictable)} over {nodes} nodes"
        )
    missing = unqueued(tree)
    if missing:
        tier, n = missing[0]
        raise IntegrityError(
            f"{n!r}: evictable from the {tier.value} but not in its victim queue "
            f"({len(missing)} such nodes over {nodes} nodes)"
        )

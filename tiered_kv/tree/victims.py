"""Victim choice: which nodes may leave a tier, in the tier policy's order.

Device: a node may go when it is unlocked, has no copy in flight touching its device slots and
no child on the device (device residency stays prefix-closed). Host: a node may go when nothing
protects it, no copy is in flight, and it is either still on the device (only the host copy is
dropped) or a leaf (it leaves the tree), and is not a failed load's node (whose host copy is
the only good one until the stale device copy goes). ``rank`` orders victims before the policy
does (under ``write_through`` host-only nodes go first, so the host stays inclusive while it
can).

:func:`victims` *yields* candidates; it frees nothing. The caller acts on each (frees its slots,
writes it back first, or skips it) before asking for the next; a parent that became evictable
meanwhile joins the queue then. The candidates come from the tree's per-tier
:class:`~tiered_kv.tree.victim_queue.VictimQueue`, not from a walk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import PendingKind, Tier
from tiered_kv.tree.node import TreeNode
from tiered_kv.tree.tiered_tree import TieredTree


def device_evictable(n: TreeNode) -> bool:
    return (
        n.parent is not None
        and n.on_device
        and n.lock_ref == 0
        and PendingKind.WRITE not in n.pending
        and PendingKind.LOAD not in n.pending
        and not any(c.on_device for c in n.children.values())
    )


def host_evictable(n: TreeNode) -> bool:
    return (
        n.parent is not None
        and n.on_host
        and n.host_ref == 0
        and not n.pending
        and not n.stale  # its device copy is garbage: the host copy is the only good one
        and (n.on_device or not n.children)
    )


def victims(
    tree: TieredTree, tier: Tier, rank: Callable[[TreeNode], int] | None = None
) -> Iterator[TreeNode]:
    """Evictable nodes of ``tier`` (device or host), lowest ``rank`` then policy priority first.
    Each yielded node is evictable at the moment it is yielded. ``rank`` should be one function
    kept for the tier (a different one re-sorts the tier's queue from a walk)."""
    if tier is Tier.DEVICE:
        policy, evictable, queue = tree.device_policy, device_evictable, tree.device_queue
    elif tier is Tier.HOST:
        policy, evictable, queue = tree.host_policy, host_evictable, tree.host_queue
    else:
        raise InvalidArgumentError(f"tier={tier!r}: the tree evicts from device or host only")
    bucket, order = policy.bucket, policy.order

    def keyof(n: TreeNode) -> tuple:
        return (bucket(n), rank(n) if rank else 0, order(n))

    for n in policy.take_changed():
        queue.mark(n)
    queue.prepare(rank, tree.walk, evictable, keyof)
    while True:
        n = queue.pop(evictable, keyof, policy.bucket_rank)
        if n is None:
            return
        if policy.second_chance(n):
            queue.offer(n, keyof(n))
            continue
        parent = n.parent
        queue.mark(n)  # seen again at the next eviction if the caller leaves it
        yield n
        if parent is not None and evictable(parent):
            queue.offer(parent, keyof(parent))


def unqueued(tree: TieredTree) -> list[tuple[Tier, TreeNode]]:
    """Evictable nodes that their tier's queue would not offer in time (for ``check_tree``:
    always empty unless a change to the tree was not marked)."""
    out = []
    for tier, policy, evictable, queue in (
        (Tier.DEVICE, tree.device_policy, device_evictable, tree.device_queue),
        (Tier.HOST, tree.host_policy, host_evictable, tree.host_queue),
    ):
        for n in policy.take_changed():
            queue.mark(n)
        rank = queue.rank_fn
        for n in tree.walk():
            if evictable(n):
                key = (policy.bucket(n), rank(n) if rank else 0, policy.order(n))
                if not queue.covers(n, key):
                    out.append((tier, n))
    return out


def device_resident_last(n: TreeNode) -> int:
    """The host's rank under inclusive tiers: host-only nodes first."""
    return 1 if n.on_device else 0

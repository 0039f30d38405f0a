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
meanwhile joins the queue then.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import PendingKind, Tier
from tiered_kv.tree.node import TreeNode, walk
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
    Each yielded node is evictable at the moment it is yielded."""
    if tier is Tier.DEVICE:
        policy, evictable = tree.device_policy, device_evictable
    elif tier is Tier.HOST:
        policy, evictable = tree.host_policy, host_evictable
    else:
        raise InvalidArgumentError(f"tier={tier!r}: the tree evicts from device or host only")

    def key(n: TreeNode) -> tuple:
        return ((rank(n),) if rank else ()) + tuple(policy.priority(n))

    heap, order = [], itertools.count()
    for n in walk(tree.root):
        if evictable(n):
            heapq.heappush(heap, (key(n), next(order), n))
    while heap:
        prio, _, n = heapq.heappop(heap)
        if not evictable(n):
            continue
        now = key(n)
        if now != prio:
            heapq.heappush(heap, (now, next(order), n))
            continue
        if policy.second_chance(n):
            heapq.heappush(heap, (key(n), next(order), n))
            continue
        parent = n.parent
        yield n
        if parent is not None and evictable(parent):
            heapq.heappush(heap, (key(parent), next(order), parent))

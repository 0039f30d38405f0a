"""quarantine: a node whose pages were found wrong, and everything below it, off every tier of
the tree at once (bookkeeping only: the slots come back for the manager to free).

Pages below a wrong page were matched through it and, in a real model, computed on top of it:
none of them is kept. A node no request holds leaves the tree now with both its copies. A node a
request holds (``lock_ref`` > 0) cannot give its device slots back while that request reads
them: its host copy goes now and its device copy is marked stale, so it is never matched again,
nothing is inserted, loaded or fetched below it, a holder is refused its forward and its finish
inserts nothing (``holds_stale``), and its last unlock frees it and unlinks it
(``TieredTree.dec_lock_ref``).
"""

from __future__ import annotations

from tiered_kv.errors import StateError
from tiered_kv.tree.node import TreeNode, walk
from tiered_kv.tree.results import Released
from tiered_kv.tree.tiered_tree import TieredTree


def quarantine(tree: TieredTree, node: TreeNode) -> Released:
    """Take ``node`` and its subtree off every tier (see the module). Returns the slots taken
    now (the caller frees them; device copies still held are not among them) and the tokens
    that left the tree. Refuses, changing nothing, a subtree with a copy in flight or a host
    reference (wait for the jobs in flight first), or a held node that is not on the device."""
    if node.parent is None:
        raise StateError("quarantine of a root: pass the first node of the wrong pages")
    nodes = [node, *walk(node)]
    busy = [n for n in nodes if n.pending or n.host_ref or (n.lock_ref and not n.on_device)]
    if busy:
        raise StateError(
            f"quarantine of {node!r}: {len(busy)} nodes below it have copies in flight or are "
            f"held off the device (first {busy[0]!r}); wait for the jobs in flight first"
        )
    device, host, tokens = [], [], 0
    # Children before parents: a node no one holds has no held descendant (a lock holds the
    # whole path), so its children are gone by the time it is detached.
    for n in reversed(nodes):
        if n.lock_ref == 0:
            gone = tree.detach(n)
            device += gone.device
            host += gone.host
            tokens += gone.tokens
            continue
        if n.on_host:
            host.append(tree.take_host(n))  # on the device too: it stays linked
        tree.mark_stale(n)
    return Released(device, host, tokens)

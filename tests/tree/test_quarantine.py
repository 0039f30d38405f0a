"""tree.quarantine: a wrong node and its subtree off every tier; held copies turn stale and
leave at their last unlock; a busy subtree is refused unchanged."""

from __future__ import annotations

import pytest

from tests.tree.test_tiered_tree import P, Slots
from tiered_kv.errors import StateError
from tiered_kv.names import JobId, PendingKind
from tiered_kv.tree import TieredTree, check_tree
from tiered_kv.tree.quarantine import quarantine


def chain(tree: TieredTree, slots: Slots):
    """Root -> a (8 tokens) -> b (8) -> {c (4), d (4, host-only)}; every node on the host too."""
    seq = list(range(1, 17))
    tree.insert(seq + [90, 91, 92, 93], slots.take(20))
    tree.insert(seq + [70, 71, 72, 73], slots.take(20))
    _, a = tree.node_at(tree.match(seq[:8], probe=False))  # split after 8 tokens
    (b,) = a.children.values()
    c, d = sorted(b.children.values(), key=lambda n: n.key[0], reverse=True)
    for n in (a, b, c, d):
        tree.set_host(n, slots.take(len(n)))
    tree.take_device(d)  # host-only now
    return seq, a, b, c, d


def test_unheld_subtree_leaves_every_tier_at_once():
    tree, slots = TieredTree(P), Slots()
    seq, a, b, c, d = chain(tree, slots)
    gone = quarantine(tree, b)
    assert gone.tokens == 16 and len(gone.device) == 2 and len(gone.host) == 3
    assert not a.children and tree.match(seq).length == 8
    assert tree.device_tokens == tree.host_tokens == 8
    check_tree(tree)


def test_held_nodes_turn_stale_and_leave_at_their_last_unlock():
    tree, slots = TieredTree(P), Slots()
    seq, a, b, c, d = chain(tree, slots)
    tree.inc_lock_ref(c)  # a request reads a, b, c
    gone = quarantine(tree, b)
    # d (no holder) left now; b and c stay on the device, stale, without their host copies.
    assert gone.tokens == 4 and len(gone.host) == 3 and len(gone.device) == 0
    assert b.stale and c.stale and not b.on_host and not c.on_host and not a.stale
    assert list(b.children.values()) == [c] and tree.match(seq + [90]).length == 8
    check_tree(tree)
    freed = tree.dec_lock_ref(c)  # the holder lets go: both leave, deepest first
    assert [len(f) for f in freed] == [4, 8] and not a.children
    assert tree.device_tokens == tree.host_tokens == 8
    check_tree(tree)


def test_a_busy_subtree_is_refused_unchanged():
    tree, slots = TieredTree(P), Slots()
    seq, a, b, c, d = chain(tree, slots)
    tree.begin_job(JobId(7), PendingKind.BACKUP, [d])
    with pytest.raises(StateError, match="copies in flight"):
        quarantine(tree, b)
    assert not b.stale and b.on_host and len(b.children) == 2
    with pytest.raises(StateError, match="root"):
        quarantine(tree, tree.root)
    tree.end_job(JobId(7))
    check_tree(tree)

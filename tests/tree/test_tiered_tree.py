"""TieredTree on its own: bookkeeping without pools or copies. ``match`` is a pure read, victims
are returned (never freed), the residency counters follow every change, and ``check_tree``
catches broken invariants with the counts in its message."""

from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.errors import IntegrityError, InvalidArgumentError, StateError
from tiered_kv.names import JobId, PendingKind, Tier
from tiered_kv.tree import TieredTree, check_tree, victims
from tiered_kv.tree.node import walk

P = 4


class Slots:
    """Slot ids handed out in order; freeing is the caller's business (the tree never frees)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out


def snapshot(tree: TieredTree) -> tuple:
    """Everything observable about the tree: structure, per-node fields, policy state, counters."""
    nodes = []
    for n in walk(tree.root):
        nodes.append(
            (
                id(n),
                id(n.parent),
                n.key,
                None if n.device is None else tuple(n.device.tolist()),
                None if n.host is None else tuple(n.host.tolist()),
                tuple(n.digests),
                n.in_storage,
                n.lock_ref,
                n.host_ref,
                tuple(sorted(n.pending.items())),
                n.hit_count,
                n.stale,
                tuple(sorted(n.children)),
            )
        )
    policies = tuple(
        tuple(sorted((k, tuple(v)) for k, v in pol._state.items()))
        for pol in (tree.device_policy, tree.host_policy)
    )
    clocks = (tree.device_policy._clock, tree.host_policy._clock)
    counters = (tree.device_tokens, tree.host_tokens, tree.evictable_device_tokens)
    return tuple(sorted(nodes)), policies, clocks, counters


def random_tree(rng: random.Random, digests: bool = True) -> tuple[TieredTree, list[list[int]]]:
    tree, slots, seqs = TieredTree(P, digests=digests), Slots(), []
    for _ in range(rng.randint(3, 12)):
        if seqs and rng.random() < 0.6:
            base = rng.choice(seqs)
            seq = base[: rng.randint(1, len(base) // P) * P] + [
                rng.randint(1, 9) for _ in range(P * rng.randint(1, 3))
            ]
        else:
            seq = [rng.randint(1, 9) for _ in range(P * rng.randint(1, 5))]
        tree.insert(seq, slots.take(len(seq)))
        seqs.append(seq)
    for n in list(walk(tree.root)):  # some host copies, some host-only leaves
        if rng.random() < 0.5:
            tree.set_host(n, slots.take(len(n)))
    for n in list(walk(tree.root)):
        if n.on_host and not n.children and rng.random() < 0.5:
            tree.take_device(n)
    return tree, seqs


@pytest.mark.parametrize("seed", range(12))
def test_match_leaves_the_tree_unchanged(seed):
    rng = random.Random(seed)
    tree, seqs = random_tree(rng, digests=seed % 2 == 0)
    check_tree(tree)
    for _ in range(30):
        seq = list(rng.choice(seqs))
        cut = rng.randint(0, len(seq))
        probe = seq[:cut] + [rng.randint(1, 12) for _ in range(rng.randint(0, 2 * P))]
        before = snapshot(tree)
        m = tree.match(probe)
        assert snapshot(tree) == before, "match changed the tree"
        assert m.device_len + m.host_len == sum(n for _, n in m.steps)
        assert len(m.device_indices) == m.device_len
        assert m.length % P == 0 and m.length <= len(probe)
        if tree.digests and m.length < len(m.key):
            assert len(m.probe_digests) == (len(m.key) - m.length) // P
        else:
            assert m.probe_digests == ()
    check_tree(tree)


def test_node_at_splits_only_the_partial_node():
    tree, slots = TieredTree(P), Slots()
    seq = list(range(1, 13))
    tree.insert(seq, slots.take(12))
    (node,) = tree.root.children.values()
    m = tree.match(seq[:8] + [99] * 4)
    assert m.steps == ((node, 8),) and m.device_len == 8
    last_dev, last = tree.node_at(m)
    assert last is last_dev and len(last) == 8 and node.parent is last
    assert torch.equal(torch.cat([last.device, node.device]), torch.arange(1, 13))
    assert tree.device_tokens == 12 and tree.evictable_device_tokens == 12
    check_tree(tree)


def test_victims_are_yielded_not_freed():
    tree, slots = TieredTree(P), Slots()
    a, b = list(range(1, 9)), list(range(1, 5)) + list(range(20, 28))
    tree.insert(a, slots.take(8))
    tree.insert(b, slots.take(12))
    before = snapshot(tree)
    got = list(victims(tree, Tier.DEVICE))  # nobody acts on them: only leaves qualify
    assert snapshot(tree)[0] == before[0], "choosing victims changed a node"
    assert {n.key for n in got} == {(5, 6, 7, 8), (20, 21, 22, 23, 24, 25, 26, 27)}
    assert all(n.on_device for n in got)
    # Acting on the first: its slots come back to the caller, the tree keeps no reference.
    queue = victims(tree, Tier.DEVICE)
    first = next(queue)
    released = tree.detach(first)
    assert released.tokens == len(first) and len(released.device) == 1
    assert first.parent is None and tree.device_tokens == 16 - len(first)
    # Its parent (the shared page) becomes a victim once both children are gone.
    second = next(queue)
    tree.detach(second)
    assert next(queue).key == (1, 2, 3, 4)
    check_tree(tree)


def test_locked_and_pending_nodes_are_not_victims():
    tree, slots = TieredTree(P), Slots()
    tree.insert(list(range(1, 9)), slots.take(8))
    (node,) = tree.root.children.values()
    tree.inc_lock_ref(node)
    assert list(victims(tree, Tier.DEVICE)) == [] and tree.evictable_device_tokens == 0
    assert tree.dec_lock_ref(node) == [] and tree.evictable_device_tokens == 8
    tree.set_host(node, slots.take(8))
    tree.begin_job(JobId(7), PendingKind.WRITE, [node])
    assert list(victims(tree, Tier.DEVICE)) == [] and list(victims(tree, Tier.HOST)) == []
    assert tree.end_job(JobId(7)) == [node] and not node.pending
    assert list(victims(tree, Tier.HOST)) == [node]
    with pytest.raises(InvalidArgumentError, match="tier"):
        next(victims(tree, Tier.STORAGE))


def _held_stale_copy(locks: int = 1):
    """A tree of one node on both tiers whose device copy came from a failed load, held
    ``locks`` times; its device slots are 1..8."""
    tree, slots = TieredTree(P), Slots()
    tree.insert(list(range(1, 9)), slots.take(8))
    (node,) = tree.root.children.values()
    tree.set_host(node, slots.take(8))
    for _ in range(locks):
        tree.inc_lock_ref(node)
    tree.mark_stale(node)
    return tree, node


def test_stale_copy_is_returned_on_last_unlock():
    tree, node = _held_stale_copy(locks=2)
    assert tree.dec_lock_ref(node) == []  # still held
    (freed,) = tree.dec_lock_ref(node)
    assert torch.equal(freed, torch.arange(1, 9)) and not node.on_device and not node.stale
    with pytest.raises(InvalidArgumentError, match="unlocked"):
        tree.dec_lock_ref(node)
    check_tree(tree)


def test_a_stale_copy_whose_host_copy_is_being_backed_up_is_returned_on_last_unlock():
    """A backup to storage reads the host copy only. It used to keep the stale device copy at
    the last unlock, and nothing freed it when the backup ended (found by the Mooncake fault
    campaign: "a stale copy outlived its holders"). A copy into or out of the device copy
    still keeps it until its own end."""
    tree, node = _held_stale_copy()
    tree.begin_job(JobId(5), PendingKind.BACKUP, [node])
    (freed,) = tree.dec_lock_ref(node)
    assert torch.equal(freed, torch.arange(1, 9)) and not node.on_device and not node.stale
    assert node.on_host and node.pending == {PendingKind.BACKUP: JobId(5)}
    tree.end_job(JobId(5))
    check_tree(tree)
    other, held = _held_stale_copy()
    other.begin_job(JobId(6), PendingKind.LOAD, [held])
    assert other.dec_lock_ref(held) == [] and held.stale and held.on_device


def test_set_and_take_refuse_impossible_changes():
    tree, slots = TieredTree(P), Slots()
    tree.insert(list(range(1, 9)), slots.take(8))
    (node,) = tree.root.children.values()
    with pytest.raises(StateError):
        tree.set_device(node, slots.take(8))
    with pytest.raises(StateError):
        tree.take_host(node)
    with pytest.raises(StateError):
        tree.set_host(node, slots.take(4))
    with pytest.raises(InvalidArgumentError, match="whole pages"):
        tree.insert(list(range(1, 7)), slots.take(6))
    check_tree(tree)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t, n: setattr(n, "lock_ref", -1), "lock_ref"),
        (lambda t, n: setattr(t, "device_tokens", t.device_tokens + 4), "residency counters"),
        (lambda t, n: setattr(n, "digests", n.digests[::-1]), "digests"),
        (lambda t, n: t.device_policy.on_remove(n), "device policy"),
        (lambda t, n: n.pending.__setitem__(PendingKind.LOAD, JobId(99)), "job 99"),
        (lambda t, n: setattr(n, "host", torch.tensor([1])), "host slots"),
    ],
)
def test_check_tree_names_the_broken_invariant(corrupt, message):
    tree, slots = TieredTree(P, digests=True), Slots()
    tree.insert(list(range(1, 13)), slots.take(12))
    tree.insert(list(range(1, 5)) + [40] * 8, slots.take(12))
    node = next(n for n in walk(tree.root) if n.children)
    child = next(iter(node.children.values()))
    check_tree(tree)
    corrupt(tree, child if message != "lock_ref" else node)
    with pytest.raises(IntegrityError, match=message):
        check_tree(tree, jobs=set())


def test_stale_copy_is_never_matched_nor_built_upon():
    tree, slots = TieredTree(P), Slots()
    seq = list(range(1, 13))
    tree.insert(seq[:8], slots.take(8))
    (node,) = tree.root.children.values()
    tree.set_host(node, slots.take(8))  # the load's source
    tree.inc_lock_ref(node)  # its request still holds it
    tree.mark_stale(node)
    m = tree.match(seq)
    assert m.steps == () and m.device_len == m.host_len == 0 and m.probe_digests == ()
    dup, new, kept = tree.insert(seq, slots.take(12))
    assert (dup, new, kept) == (0, [], 0) and not node.children  # nothing below garbage
    (freed,) = tree.dec_lock_ref(node)
    assert len(freed) == 8 and not node.on_device and node.on_host and not node.stale
    check_tree(tree)
    with pytest.raises(StateError, match="not on the device"):
        tree.mark_stale(node)


def test_page_key_is_whole_pages_of_python_ints_from_any_token_container():
    import numpy as np

    from tiered_kv.tree.node import page_key

    gen = np.random.default_rng(11)
    toks = gen.integers(0, 2**31, 37).tolist()
    want = tuple(toks[:32])
    for given in (toks, np.asarray(toks), torch.tensor(toks), [np.int64(t) for t in toks]):
        got = page_key(given, 8)
        assert got == want and all(type(t) is int for t in got)
    assert page_key(toks[:5], 8) == ()
    assert page_key([True, 2, 3, 4], 4) == (1, 2, 3, 4)  # not all ints: converted one by one

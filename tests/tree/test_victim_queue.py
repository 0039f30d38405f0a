"""VictimQueue (tiered_kv/tree/victim_queue.py): the tree's per-tier evictable nodes kept across
evictions instead of a walk per eviction.

A seeded random driver applies every kind of tree change (inserts that split, host copies,
locks, host refs, copies in flight, hits, stale copies, evictions acted on in part or left
half-way) under every policy, and checks after each change that every evictable node is queued
(``check_tree``), and at each yield that the node is evictable and has the lowest current key
among the nodes the eviction may offer (those evictable when it began, plus parents its victims
freed): the order a walk of the whole tree would give.
"""

from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.errors import IntegrityError
from tiered_kv.names import JobId, PendingKind, Tier
from tiered_kv.tree import TieredTree, check_tree, victims
from tiered_kv.tree.node import walk
from tiered_kv.tree.policies import POLICIES, LRUPolicy
from tiered_kv.tree.victim_queue import REBUILD_AT, VictimQueue
from tiered_kv.tree.victims import device_evictable, device_resident_last, host_evictable

P = 2


class Driver:
    def __init__(self, policy: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tree = TieredTree(P, device_policy=policy, host_policy=policy)
        self.next_slot = 1
        self.locked: list = []
        self.protected: list = []
        self.jobs: list[JobId] = []
        self.job_id = 0
        self.yields = 0

    def slots(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return out

    def nodes(self) -> list:
        return list(walk(self.tree.root))

    def insert(self) -> None:
        r = self.rng
        pages = r.randint(1, 6)
        tokens = [r.choice((1, 2, 3)) if i < 3 else r.randint(1, 9) for i in range(pages * P)]
        self.tree.insert(tokens, self.slots(len(tokens)))

    def step(self) -> None:
        r, tree = self.rng, self.tree
        nodes = self.nodes()
        op = r.choice(
            ("insert", "insert", "host", "lock", "unlock", "ref", "unref", "job", "end", "touch")
            + ("stale", "evict_device", "evict_host", "evict_host")
        )
        if op == "insert" or not nodes:
            self.insert()
            return
        n = r.choice(nodes)
        if op == "host" and not n.on_host:
            tree.set_host(n, self.slots(len(n)))
        elif op == "lock" and n.on_device:
            tree.inc_lock_ref(n)
            self.locked.append(n)
        elif op == "unlock" and self.locked:
            tree.dec_lock_ref(self.locked.pop(r.randrange(len(self.locked))))
        elif op == "ref" and n.on_host:
            tree.inc_host_ref(n)
            self.protected.append(n)
        elif op == "unref" and self.protected:
            tree.dec_host_ref(self.protected.pop(r.randrange(len(self.protected))))
        elif op == "job":
            self.job_id += 1
            kind = r.choice(list(PendingKind))
            tree.begin_job(JobId(self.job_id), kind, [n])
            self.jobs.append(JobId(self.job_id))
        elif op == "end" and self.jobs:
            tree.end_job(self.jobs.pop(r.randrange(len(self.jobs))))
        elif op == "touch":
            tree.touch(n)
        elif op == "stale" and n.on_device and n.on_host and n.lock_ref:
            tree.mark_stale(n)
        elif op == "evict_device":
            self.evict(Tier.DEVICE, None)
        elif op == "evict_host":
            self.evict(Tier.HOST, r.choice((None, device_resident_last)))

    def key(self, tier: Tier, rank, n) -> tuple:
        policy = self.tree.device_policy if tier is Tier.DEVICE else self.tree.host_policy
        return ((rank(n),) if rank else ()) + tuple(policy.priority(n))

    def evict(self, tier: Tier, rank) -> None:
        r, tree = self.rng, self.tree
        evictable = device_evictable if tier is Tier.DEVICE else host_evictable
        offered = {n for n in walk(tree.root) if evictable(n)}
        yielded: set = set()
        budget = r.randint(1, 6)
        for n in victims(tree, tier, rank):
            assert evictable(n), f"{n!r} was offered but is not evictable"
            assert n not in yielded, f"{n!r} offered twice in one eviction"
            rivals = [m for m in offered - yielded if m is not n and evictable(m)]
            mine = self.key(tier, rank, n)
            early = [m for m in rivals if self.key(tier, rank, m) < mine]
            assert not early, f"{n!r} (key {mine}) offered before {early[:3]}"
            yielded.add(n)
            self.yields += 1
            parent = n.parent
            if r.random() < 0.2:
                pass  # the caller leaves it (it must come back at the next eviction)
            elif tier is Tier.DEVICE:
                if n.on_host and PendingKind.WRITE not in n.pending:
                    tree.take_device(n)
                elif tree.subtree_free(n):
                    tree.detach(n)
            else:
                tree.take_host(n)
            if parent is not None:  # offered again (once its child is gone it may be freed)
                offered.add(parent)
                yielded.discard(parent)
            budget -= 1
            if budget == 0:
                break  # a half-used eviction: the generator is dropped


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_random_changes_keep_every_evictable_node_queued_in_order(policy, seed):
    d = Driver(policy, seed)
    for _ in range(700):
        d.step()
        check_tree(d.tree)
    assert d.yields > 50, "the driver hardly evicted"


def test_an_unmarked_change_is_caught_by_check_tree():
    tree = TieredTree(P)
    tree.insert([1, 2, 3, 4], torch.arange(1, 5))
    (node,) = tree.root.children.values()
    tree.begin_job(JobId(1), PendingKind.WRITE, [node])
    assert list(victims(tree, Tier.DEVICE)) == []  # the queue drops the busy node
    del node.pending[PendingKind.WRITE]  # behind the tree's back: no mark
    tree._jobs.pop(JobId(1))
    with pytest.raises(IntegrityError, match="not in its victim queue"):
        check_tree(tree)


def test_an_unmarked_tier_overflows_into_one_rebuild():
    q = VictimQueue()
    q.prepare(None, lambda: [], lambda n: True, lambda n: (0, 0, ()))
    assert q.rebuilds == 1
    for i in range(REBUILD_AT + 1):
        q.mark(i)
    assert not q._dirty, "the marked set is not bounded"
    seen = []
    q.prepare(None, lambda: [5, 3, 9], lambda n: True, lambda n: (0, 0, (n,)))
    assert q.rebuilds == 2
    while (n := q.pop(lambda n: True, lambda n: (0, 0, (n,)), lambda b, n: 0)) is not None:
        seen.append(n)
    assert seen == [3, 5, 9]


def test_buckets_are_ranked_when_a_victim_is_chosen():
    """A policy whose first bucket flips between evictions: the queue follows the flip."""
    q, first = VictimQueue(), {"b": "S"}
    keys = {1: ("S", 0, (1,)), 2: ("M", 0, (2,)), 3: ("S", 0, (3,)), 4: ("M", 0, (4,))}
    q.prepare(None, lambda: list(keys), lambda n: True, keys.__getitem__)

    def pop():
        return q.pop(lambda n: True, keys.__getitem__, lambda b, n: 0 if b == first["b"] else 1)

    assert pop() == 1
    first["b"] = "M"
    assert pop() == 2
    keys[3] = ("M", 0, (0,))  # moved bucket (a second chance): a new entry, found at once
    q.offer(3, keys[3])
    assert pop() == 3
    assert pop() == 4 and pop() is None


class _Demoting(LRUPolicy):
    """LRU in two buckets, cold (0) before hot (1); ``move`` changes a node's bucket outside
    its own events and reports it, as a policy that demotes one node while handling another."""

    def __init__(self) -> None:
        super().__init__()
        self.hot: set[int] = set()
        self.changed: list = []

    def move(self, node, hot: bool) -> None:
        (self.hot.add if hot else self.hot.discard)(id(node))
        self.changed.append(node)

    def take_changed(self) -> list:
        out, self.changed = self.changed, []
        return out

    def bucket(self, node):
        return int(id(node) in self.hot)

    def bucket_rank(self, bucket, head=None):
        return bucket

    def priority(self, node) -> tuple:
        return (self.bucket(node), *self.order(node))

    def order(self, node) -> tuple:
        return (self._state[id(node)][1],)


def test_a_bucket_changed_behind_a_nodes_back_is_seen_through_take_changed():
    tree = TieredTree(P)
    policy = tree.device_policy = _Demoting()
    for first in (1, 3, 5):
        tree.insert([first, first + 1], torch.arange(first, first + 2))
    x, y, z = (tree.root.children[(k, k + 1)] for k in (1, 3, 5))
    policy.move(x, True)
    policy.move(z, True)
    assert next(victims(tree, Tier.DEVICE)) is y  # the queue is built; x and z wait as hot
    policy.move(z, False)  # z is cold now, behind x in the hot heap
    assert list(victims(tree, Tier.DEVICE)) == [y, z, x]
    check_tree(tree)

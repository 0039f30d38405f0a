"""Unit tests of the per-tier eviction policies (tiered_kv/tree/policies.py) on stand-in nodes.

``evict`` drives a policy the way the tree's eviction loop does: take the lowest priority, let
the policy keep it (``second_chance``) or remove it, repeat.
"""

from __future__ import annotations

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tree.policies import (
    POLICIES,
    FIFOPolicy,
    GhostLRUPolicy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)


class Node:
    def __init__(self, name: str, ghost_key=None) -> None:
        self.name = name
        self.ghost_key = ghost_key if ghost_key is not None else ("k", name)

    def __repr__(self) -> str:
        return self.name


def nodes(policy, names: str) -> dict[str, Node]:
    out = {}
    for c in names:
        out[c] = Node(c)
        policy.on_insert(out[c])
    return out


def evict(policy, live: list[Node], k: int | None = None) -> str:
    """Names of the first ``k`` (all) nodes evicted, in order."""
    live = list(live)
    out = []
    guard = 0
    while live and (k is None or len(out) < k):
        guard += 1
        assert guard < 1000, "second_chance never lets go"
        n = min(live, key=policy.priority)
        if policy.second_chance(n):
            continue
        policy.on_remove(n)
        live.remove(n)
        out.append(n.name)
    return "".join(out)


def test_lru_evicts_least_recently_hit():
    p = LRUPolicy()
    ns = nodes(p, "abcd")
    for c in "cab":
        p.on_hit(ns[c])
    assert evict(p, list(ns.values())) == "dcab"


def test_lru_later_hit_moves_node_to_the_back():
    p = LRUPolicy()
    ns = nodes(p, "abc")
    p.on_hit(ns["a"])
    p.on_hit(ns["b"])
    p.on_hit(ns["a"])
    assert evict(p, list(ns.values())) == "cba"


def test_lfu_evicts_fewest_hits_ties_by_recency():
    p = LFUPolicy()
    ns = nodes(p, "abcd")
    # a: 3 hits (all early), b: 1 hit, c: 1 hit (after b), d: 2 hits (latest of all)
    for c in "aaabcdd":
        p.on_hit(ns[c])
    # LRU would evict a first (its hits are the oldest); LFU evicts the 1-hit nodes, the
    # less recently hit of them first.
    assert evict(p, list(ns.values())) == "bcda"


def test_lfu_unhit_nodes_go_first_in_insertion_order():
    p = LFUPolicy()
    ns = nodes(p, "abc")
    p.on_hit(ns["a"])
    assert evict(p, list(ns.values())) == "bca"


def test_fifo_ignores_hits():
    p = FIFOPolicy()
    ns = nodes(p, "abcd")
    for _ in range(5):
        p.on_hit(ns["a"])
        p.on_hit(ns["b"])
    assert evict(p, list(ns.values())) == "abcd"


@pytest.mark.parametrize("cls", [LRUPolicy, LFUPolicy, FIFOPolicy])
def test_split_copies_the_record_to_the_new_parent(cls):
    p = cls()
    ns = nodes(p, "abc")
    p.on_hit(ns["a"])
    p.on_hit(ns["a"])
    front = Node("f")
    p.on_split(ns["a"], front)
    assert front in p
    assert p.priority(front) == p.priority(ns["a"])
    # A node the policy does not track gives its new parent no record.
    other = Node("o")
    p.on_split(Node("x"), other)
    assert other not in p


def test_remove_forgets_and_hit_on_unknown_is_ignored():
    p = LRUPolicy()
    ns = nodes(p, "ab")
    p.on_remove(ns["a"])
    assert ns["a"] not in p and ns["b"] in p
    p.on_hit(ns["a"])  # no record, no error, no resurrection
    p.on_remove(ns["a"])
    assert ns["a"] not in p


def test_s3fifo_hit_in_small_queue_gets_a_second_chance():
    p = S3FIFOPolicy()
    ns = nodes(p, "abcd")
    p.on_hit(ns["b"])
    # One-hit nodes go first; b, hit again while in the small queue, moves to main and goes
    # last.
    assert evict(p, list(ns.values())) == "acdb"


def test_s3fifo_is_fifo_inside_queues_not_lru():
    p = S3FIFOPolicy()
    ns = nodes(p, "abc")
    p.on_hit(ns["b"])
    p.on_hit(ns["a"])  # a is the most recently hit; LRU would evict b before a
    assert evict(p, list(ns.values())) == "cab"


def test_s3fifo_second_chance_moves_to_main():
    p = S3FIFOPolicy()
    ns = nodes(p, "ab")
    p.on_hit(ns["a"])
    before = p.priority(ns["a"])
    assert p.second_chance(ns["a"]) is True
    assert p.priority(ns["a"]) != before
    # Now in main with no credit left: the next pick lets it go.
    assert p.second_chance(ns["a"]) is False
    assert p.second_chance(ns["b"]) is False  # never hit: no second chance


def test_s3fifo_main_queue_credits_one_per_hit_up_to_three():
    p = S3FIFOPolicy()
    ns = nodes(p, "m")
    m = ns["m"]
    p.on_hit(m)
    assert p.second_chance(m)  # small -> main, frequency reset
    for _ in range(10):
        p.on_hit(m)
    chances = 0
    while p.second_chance(m):
        chances += 1
        assert chances < 10
    assert chances == 3


def test_s3fifo_ghost_reinsert_goes_to_main():
    p = S3FIFOPolicy()
    x = Node("x", ghost_key=("prefix", 1))
    p.on_insert(x)
    p.on_remove(x)  # evicted from the small queue without a second hit: remembered as a ghost
    y = Node("y", ghost_key=("prefix", 1))  # the same prefix comes back
    p.on_insert(y)
    fresh = nodes(p, "abc")
    # y is the oldest entry, but it went straight to the main queue: the small queue (3 of 4
    # nodes) is evicted first.
    assert evict(p, [y, *fresh.values()]) == "abcy"


def test_s3fifo_without_ghost_oldest_goes_first():
    p = S3FIFOPolicy()
    y = Node("y", ghost_key=("prefix", 2))
    p.on_insert(y)
    fresh = nodes(p, "abc")
    assert evict(p, [y, *fresh.values()]) == "yabc"


def test_s3fifo_hit_node_is_not_a_ghost():
    p = S3FIFOPolicy()
    x = Node("x", ghost_key=("prefix", 3))
    p.on_insert(x)
    p.on_hit(x)
    p.on_remove(x)  # left with a hit: not remembered
    y = Node("y", ghost_key=("prefix", 3))
    p.on_insert(y)
    fresh = nodes(p, "ab")
    assert evict(p, [y, *fresh.values()]) == "yab"


def test_s3fifo_ghost_list_is_bounded():
    p = S3FIFOPolicy(ghost_limit=2)
    for i in range(3):
        g = Node(f"g{i}", ghost_key=("ghost", i))
        p.on_insert(g)
        p.on_remove(g)
    # ghost 0 fell off the list (oldest); ghost 2 is still there
    old = Node("old", ghost_key=("ghost", 0))
    new = Node("new", ghost_key=("ghost", 2))
    p.on_insert(old)
    p.on_insert(new)
    fresh = nodes(p, "abc")
    # old is a newcomer (small queue, oldest: first out); new came back from the ghost list
    assert evict(p, [old, new, *fresh.values()]) == "oldabcnew"


def test_s3fifo_main_queue_first_when_small_queue_is_small():
    p = S3FIFOPolicy(small_fraction=0.5)
    main = []
    for i in range(3):
        g = Node(f"m{i}", ghost_key=("m", i))
        p.on_insert(g)
        p.on_remove(g)
        m = Node(f"M{i}", ghost_key=("m", i))
        p.on_insert(m)  # from the ghost list: main queue
        main.append(m)
    s = Node("s")
    p.on_insert(s)  # 1 small of 4 < 0.5: main is evicted first
    assert evict(p, [s, *main], k=1) == "M0"


def test_make_policy_known_names():
    classes = (LRUPolicy, LFUPolicy, FIFOPolicy, S3FIFOPolicy, GhostLRUPolicy)
    for name, cls in zip(POLICIES, classes, strict=True):
        pol = make_policy(name)
        assert type(pol) is cls and pol.name == name
    # every call gets its own state
    assert make_policy("lru") is not make_policy("lru")


@pytest.mark.parametrize("bad", ["nope", "LRU", "", None, 3])
def test_make_policy_unknown_lists_valid_names(bad):
    with pytest.raises(InvalidArgumentError) as exc:
        make_policy(bad)
    msg = str(exc.value)
    for name in ("lru", "lfu", "fifo", "s3fifo"):
        assert name in msg

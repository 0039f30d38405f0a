"""GhostLRUPolicy (tiered_kv/tree/policies.py): admission on the second sighting.

Unit tests drive the policy on stand-in nodes the way the tree's victim loop does; the tree
tests run it inside a real tree and manager (SimCache) on fresh random traces with irregular
sizes and check every tree invariant, the policy's own token books and Belady's bound.
"""

from __future__ import annotations

import itertools
import random

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.simulator import SimCache
from tiered_kv.sim.traces import TraceRequest
from tiered_kv.tree import check_tree
from tiered_kv.tree.node import walk
from tiered_kv.tree.policies import GhostLRUPolicy, admission_key, make_policy

_IDS = itertools.count(1)


class Node:
    """What the policy reads of a tree node: id, parent, key, digests, length."""

    def __init__(self, name: str, size: int = 1, parent: Node | None = None) -> None:
        self.id = next(_IDS)
        self.name = name
        self.parent = parent if parent is not None else ROOT
        self.key = tuple(ord(c) for c in name) + tuple(range(size - len(name)))
        self.digests: list[bytes] = []

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return self.name


class _Root:
    id = 0
    parent = None


ROOT = _Root()


def evict(policy, live: list[Node], k: int | None = None) -> str:
    """Names of the first ``k`` (all) nodes evicted, lowest priority first."""
    live, out = list(live), []
    while live and (k is None or len(out) < k):
        n = min(live, key=policy.priority)
        assert not policy.second_chance(n)
        policy.on_remove(n)
        live.remove(n)
        out.append(n.name)
    return "".join(out)


def test_new_nodes_go_before_reused_ones_least_recent_first():
    p = GhostLRUPolicy()
    ns = {c: Node(c, size=1 + i) for i, c in enumerate("abcde")}
    for n in ns.values():
        p.on_insert(n)
    p.on_hit(ns["b"])
    p.on_hit(ns["a"])  # a and b are protected now; a hit after b
    assert not p.is_protected(ns["c"]) and p.is_protected(ns["a"])
    # Probationary c, d, e first (in insertion order, i.e. LRU), then b, then a.
    assert evict(p, list(ns.values())) == "cdeba"
    assert p.tokens == 0 and p.probation_tokens == 0


def test_a_returning_node_is_protected_and_leaves_the_ghost_list():
    p = GhostLRUPolicy()
    a, b = Node("a", 3), Node("b", 5)
    p.on_insert(a)
    p.on_insert(b)
    assert evict(p, [a, b], k=1) == "a" and p.in_ghost(a)
    again = Node("a", 7)  # the same first token under the same parent, another length
    p.on_insert(again)
    assert p.is_protected(again) and not p.in_ghost(again)
    assert evict(p, [b, again]) == "ba"


def test_ghost_key_is_the_digest_when_the_tree_keeps_digests():
    a, b = Node("a"), Node("b")
    a.digests, b.digests = [b"d1", b"d2"], [b"d1"]
    assert admission_key(a) == admission_key(b) == b"d1"
    c = Node("a", parent=Node("p"))
    assert admission_key(c) != admission_key(Node("a"))  # other parent, other block


def test_ghost_list_is_bounded_oldest_forgotten():
    p = GhostLRUPolicy(ghost_limit=2)
    ns = [Node(c) for c in "abc"]
    for n in ns:
        p.on_insert(n)
    evict(p, ns)
    assert [p.in_ghost(Node(c)) for c in "abc"] == [False, True, True]
    off = GhostLRUPolicy(ghost_limit=0)
    a = Node("a")
    off.on_insert(a)
    evict(off, [a])
    assert not off.in_ghost(a)


def test_probation_floor_lets_protected_nodes_go_first_below_it():
    p = GhostLRUPolicy(probation_floor=0.5)
    old = Node("o", 10)
    p.on_insert(old)
    p.on_hit(old)  # protected, 10 tokens
    new = Node("n", 4)
    p.on_insert(new)  # probationary 4 of 14 tokens: under the floor
    assert evict(p, [old, new], k=1) == "o"
    q = GhostLRUPolicy(probation_floor=0.5)
    old, new = Node("o", 4), Node("n", 10)
    q.on_insert(old)
    q.on_hit(old)
    q.on_insert(new)  # 10 of 14: over the floor, probation goes first
    assert evict(q, [old, new], k=1) == "n"


def test_split_keeps_the_token_books():
    p = GhostLRUPolicy()
    n = Node("x", 12)
    p.on_insert(n)
    front = Node("x", 5)
    n.key = n.key[5:]  # the tree cuts before telling the policy
    p.on_split(n, front)
    assert (p.tokens, p.probation_tokens) == (12, 12)
    p.on_hit(front)
    assert p.probation_tokens == 7 and p.is_protected(front) and not p.is_protected(n)
    evict(p, [front, n])
    assert (p.tokens, p.probation_tokens) == (0, 0)


@pytest.mark.parametrize(
    "kwargs", [dict(probation_floor=1.0), dict(probation_floor=-0.1), dict(ghost_limit=-1)]
)
def test_bad_arguments_name_the_field(kwargs):
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        GhostLRUPolicy(**kwargs)


# -- inside a real tree -------------------------------------------------------------------------
def random_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    """Requests that share prefixes of irregular length: a few hot chains, many one-hit tails."""
    chains = [[rng.randrange(1 << 30) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    out = []
    for _ in range(n):
        head = rng.choice(chains)[: rng.randint(0, 40)]
        tail = [rng.randrange(1 << 30) for _ in range(rng.randint(1, 23))]
        out.append(TraceRequest(tuple(head + tail)))
    # prefix-dependent ids, as in Mooncake's hash_ids: a block id names its whole prefix
    ids: dict[tuple, int] = {}
    return [
        TraceRequest(
            tuple(ids.setdefault(r.blocks[: i + 1], len(ids)) for i in range(len(r.blocks)))
        )
        for r in out
    ]


def check_books(policy: GhostLRUPolicy, nodes: list) -> None:
    """The policy's token counters equal a recount over the nodes it holds."""
    held = [n for n in nodes if n in policy]
    assert policy.tokens == sum(len(n) for n in held)
    assert policy.probation_tokens == sum(len(n) for n in held if not policy.is_protected(n))


@pytest.mark.parametrize(
    "host_ratio,write_policy",
    [
        (0, "write_through"),
        (1, "write_through"),
        (1.5, "write_back"),
        (2, "write_through_selective"),
    ],
)
def test_in_the_tree_invariants_books_and_bound_hold(host_ratio, write_policy):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    trace = random_trace(rng, rng.randint(60, 140))
    device = rng.randint(25, 90)
    sim = SimCache(
        device,
        int(device * host_ratio),
        0,
        device_policy="ghost_lru",
        host_policy="ghost_lru",
        write_policy=write_policy,
    )
    tree = sim.tree
    for r in trace:
        sim.request(r.blocks)
        check_tree(tree)
        nodes = list(walk(tree.root))
        check_books(tree.device_policy, [n for n in nodes if n.on_device])
        check_books(tree.host_policy, [n for n in nodes if n.on_host])
        assert all(n in tree.device_policy for n in nodes if n.on_device), seed
        assert all(n.on_device for n in nodes if n.lock_ref), seed
    res = sim.result
    total = device + int(device * host_ratio)
    assert res.device + res.host <= belady_hits(access_sequence(trace), total), seed


def test_in_the_tree_a_one_hit_request_displaces_no_reused_block():
    """LRU lets a long one-hit request push a reused chain out; ghost-LRU evicts the
    probationary newcomers first, so the reused chain survives."""
    rng = random.Random(random.randrange(1 << 30))
    hot = tuple(rng.sample(range(10**6), rng.randint(5, 9)))
    one_hit = [tuple(rng.sample(range(10**6, 2 * 10**6), rng.randint(11, 17))) for _ in range(4)]
    trace = [hot, hot, *one_hit, hot]
    size = len(hot) + max(map(len, one_hit)) + 1  # room for hot plus one newcomer
    hits = {}
    for policy in ("lru", "ghost_lru"):
        sim = SimCache(size, 0, 0, device_policy=policy)
        for blocks in trace:
            sim.request(blocks)
        hits[policy] = sim.result.device
    assert hits == {"lru": len(hot), "ghost_lru": 2 * len(hot)}


def test_make_policy_builds_it_with_its_defaults():
    p = make_policy("ghost_lru")
    assert isinstance(p, GhostLRUPolicy) and p.probation_floor == 0.0

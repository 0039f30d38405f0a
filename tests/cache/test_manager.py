"""CacheManager over a TieredTree on real stacks: MHATokenToKVPool + paged allocator ->
page_first host pool -> MemoryStorage, moved by the transfer workers. KV is random per token
prefix (an oracle in ``_tree_util``) and every copy is compared byte for byte."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from tests.cache._tree_util import (
    HUGE,
    LAYERS,
    attached,
    check_data,
    check_invariants,
    one_torch_thread,
    path_tokens,
    per_token,
    stack_factory,
)
from tiered_kv.cache import lifecycle
from tiered_kv.cache.manager import CacheManager
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.memory_store import MemoryStorage
from tiered_kv.tree.node import path_to_root, walk
from tiered_kv.tree.tiered_tree import TieredTree


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture
def make_stack(gen):
    yield from stack_factory(gen)


def toks(gen: torch.Generator, n: int, lo: int = 1, hi: int = 50_000) -> list[int]:
    return torch.randint(lo, hi, (n,), generator=gen).tolist()


def host_only(node) -> bool:
    return node.on_host and not node.on_device


# -- construction ---------------------------------------------------------------------------
def test_bad_arguments(make_stack):
    s = make_stack()
    with pytest.raises(InvalidArgumentError, match="write_policy"):
        CacheManager(s.tree, s.alloc, s.host, s.device_host, write_policy="nope")
    with pytest.raises(InvalidArgumentError, match="transfer worker"):
        CacheManager(s.tree, s.alloc, s.host, None)
    with pytest.raises(InvalidArgumentError, match="lru"):
        TieredTree(4, device_policy="nope")
    with pytest.raises(InvalidArgumentError, match="digests"):
        CacheManager(
            TieredTree(4),
            s.alloc,
            s.host,
            s.device_host,
            s.host_storage,
            store=s.storage,
            namespace=s.ns,
        )


def test_device_only_tree_without_host(gen, make_stack):
    s = make_stack(device_pages=3)
    tree = CacheManager(TieredTree(4), s.alloc)
    a, b = toks(gen, 8), toks(gen, 8)
    for seq in (a, b):
        slots = s.alloc.alloc(8)
        if slots is None:
            tree.make_device_room(8)
            slots = s.alloc.alloc(8)
        tree.insert(seq, slots)
    s.tree, s.manager = tree.tree, tree
    assert tree.match_prefix(a).device_hit_length == 0  # a was dropped to make room
    assert tree.match_prefix(b).device_hit_length == 8
    assert tree.evict_host(HUGE) == 0
    tree.evict_device(HUGE)
    assert not tree.tree.root.children and s.alloc.available_size() == s.device0


# -- matching, splitting, alignment ---------------------------------------------------------
def test_match_prefix_reports_device_then_host(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    a, b = toks(gen, 8), toks(gen, 12)
    s.put(a)
    s.put(a + b)
    s.drain()
    na, nb = s.node(a), s.node(a + b)
    assert s.manager.evict_device(1) == 12  # the leaf goes; it keeps its host copy
    assert host_only(nb) and na.on_device
    m = s.manager.match_prefix(a + b + toks(gen, 3))  # a partial last page is ignored
    assert (m.device_hit_length, m.host_hit_length, m.storage_hit_length) == (8, 12, 0)
    assert torch.equal(m.device_indices, na.device)
    assert m.last_device_node is na and m.last_node is nb
    s.assert_device(m.device_indices, a)
    s.assert_host(nb.host, a + b)
    # Unknown continuation: nothing on any tier past the tree.
    m2 = s.manager.match_prefix(a + toks(gen, 4, hi=10))
    assert (m2.device_hit_length, m2.host_hit_length, m2.storage_hit_length) == (8, 0, 0)
    assert m2.last_node is na
    # Nothing known at all.
    m3 = s.manager.match_prefix(toks(gen, 9, hi=10))
    assert m3.device_hit_length == m3.host_hit_length == 0 and m3.last_node is s.tree.root
    assert m3.device_indices.numel() == 0
    check_invariants(s)


def test_partial_match_splits_consistently(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 20)
    s.put(seq)
    s.drain()
    node = s.node(seq)
    dev, host, digests = node.device.clone(), node.host.clone(), list(node.digests)
    assert node.in_storage and len(digests) == 5
    probe = seq[:9] + [seq[9] + 1] + seq[10:]  # diverges inside the third page
    m = s.manager.match_prefix(probe)
    assert m.device_hit_length == 8 and m.host_hit_length == 0
    front = m.last_node
    assert front is not node and front.parent is s.tree.root and node.parent is front
    assert len(front) == 8 and len(node) == 12
    assert tuple(seq) == front.key + node.key
    assert torch.equal(torch.cat([front.device, node.device]), dev)
    assert torch.equal(torch.cat([front.host, node.host]), host)
    assert front.digests + node.digests == digests
    assert len(front.digests) == 2 and len(node.digests) == 3
    assert front.in_storage and node.in_storage
    assert torch.equal(m.device_indices, dev[:8])
    for n in (front, node):
        assert n in s.tree.device_policy and n in s.tree.host_policy
    check_invariants(s)
    check_data(s)
    # The chained keys still find the pages in storage after the cut.
    assert s.storage.batch_exists(s.keys_of(seq)) == 5


def test_split_with_pending_write_acknowledges_both_halves(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 16)
    s.put(seq)  # write_through: a device -> host copy is now in flight
    node = s.node(seq)
    assert "write" in node.pending and node.lock_ref == 1
    m = s.manager.match_prefix(seq[:4] + [seq[4] + 1])  # split after one page
    front = m.last_node
    assert len(front) == 4 and node.parent is front
    assert front.pending["write"] == node.pending["write"]
    assert front.lock_ref == node.lock_ref == 1
    op = node.pending["write"]
    assert front in s.tree.job_nodes(op) and node in s.tree.job_nodes(op)
    check_invariants(s)
    s.drain()
    for n in (front, node):
        assert not n.pending and n.lock_ref == 0 and n.on_host and n.in_storage
    check_data(s)
    assert s.storage.batch_exists(s.keys_of(seq)) == 4
    got = s.storage_kv(s.keys_of(seq))
    ek, ev = s.expected(seq)
    assert torch.equal(got[0], ek) and torch.equal(got[1], ev)
    check_invariants(s)


def test_split_with_pending_load_acknowledges_both_halves(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 16)
    s.put(seq)
    s.drain()
    s.manager.evict_device(HUGE)
    node = s.node(seq)
    assert host_only(node)
    slots = s.manager.load_back(node)
    assert slots is not None and len(slots) == 16
    m = s.manager.match_prefix(seq[:8] + toks(gen, 4, hi=3))
    front = m.last_node
    assert front.pending["load"] == node.pending["load"] and front.lock_ref == node.lock_ref
    assert front.host_ref == node.host_ref == 1
    s.drain()
    for n in (front, node):
        assert not n.pending and n.lock_ref == 0 and n.host_ref == 0 and n.on_device
    s.assert_device(torch.cat([front.device, node.device]), seq)
    check_invariants(s)


@pytest.mark.parametrize("page_size", [4, 8])
def test_page_alignment(gen, make_stack, page_size):
    P = page_size
    s = make_stack(page_size=P, device_pages=8, host_pages=8)
    seq = toks(gen, 2 * P)
    slots = s.alloc.alloc(2 * P)
    with pytest.raises(InvalidArgumentError, match="whole pages"):
        s.manager.insert(seq + [7], torch.cat([slots, slots[:1]]))
    with pytest.raises(InvalidArgumentError):
        s.manager.insert(seq, slots[:-1])
    assert not s.tree.root.children and s.manager.pending_ops() == 0
    s.alloc.free(slots)
    # Too short for one page: no match, no split, no storage lookup.
    assert s.put(seq) == 0
    m = s.manager.match_prefix(seq[: P - 1])
    assert m.device_hit_length == 0 and m.last_node is s.tree.root
    # A partial last page is never matched; the node is cut at the page boundary.
    m = s.manager.match_prefix(seq[: 2 * P - 1])
    assert m.device_hit_length == P and len(m.last_node) == P
    m = s.manager.match_prefix(seq + toks(gen, P - 1))
    assert m.device_hit_length == 2 * P
    for n in walk(s.tree.root):
        assert len(n) % P == 0
    check_invariants(s)


def test_insert_returns_length_already_on_device(gen, make_stack):
    s = make_stack(device_pages=12, host_pages=16, write_policy="write_back")
    a, b, c = toks(gen, 8), toks(gen, 8), toks(gen, 4)
    assert s.put(a) == 0
    na_slots = s.node(a).device.clone()
    assert s.put(a + b) == 8
    assert torch.equal(s.node(a).device, na_slots)  # the tree keeps its own slots
    assert s.put(a + b) == 16
    assert s.put(a) == 8  # a prefix of a node: split, all on device
    assert s.put(a[:4]) == 4
    s.drain()
    # Evict b to host: inserting a + b + c again adopts the caller's slots for b.
    assert s.manager.evict_device(1) == 8
    nb = s.node(a + b)
    assert host_only(nb)
    slots = s.alloc.alloc(20)
    s.write_device(slots, a + b + c)
    assert s.manager.insert(a + b + c, slots) == 8
    s.alloc.free(slots[:8])
    assert nb.on_device and nb.on_host and torch.equal(nb.device, slots[8:16])
    assert torch.equal(s.node(a + b + c).device, slots[16:])
    check_invariants(s)
    s.drain()
    check_data(s)


# -- policies through the tree --------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "expect_left"),
    [("lru", "a"), ("lfu", "b"), ("fifo", "c"), ("s3fifo", "b")],
)
def test_device_policy_picks_the_victim(gen, make_stack, policy, expect_left):
    """Inserted a, b, c; then b is hit twice, a once (last), c never. One of the three
    survives: LRU keeps the latest hit (a), LFU the most hit (b), FIFO the newest (c); S3-FIFO
    moves a and b to its main queue in insertion order and evicts a from there first."""
    s = make_stack(device_pages=12, host_pages=16, device_policy=policy)
    seqs = {name: toks(gen, 8) for name in "abc"}
    for name in "abc":
        s.put(seqs[name])
    s.drain()
    for name in "bba":
        s.manager.match_prefix(seqs[name])
    s.manager.evict_device(16)
    left = [name for name in "abc" if s.node(seqs[name]).on_device]
    assert left == [expect_left]
    check_invariants(s)


# -- tiers ----------------------------------------------------------------------------------
def test_overflow_moves_to_host_and_loads_back(gen, make_stack):
    s = make_stack(device_pages=6, host_pages=32)
    seqs = [toks(gen, 4 * (i % 2 + 1) + 4) for i in range(6)]  # 8 or 12 tokens, 60 in all
    for seq in seqs:
        assert s.put(seq) == 0
        check_invariants(s)
    s.drain()
    nodes = [s.node(q) for q in seqs]
    assert all(attached(s.tree, n) for n in nodes)
    assert s.tree.device_tokens <= 24
    evicted = [n for n in nodes if host_only(n)]
    assert evicted and s.manager.metrics.device.evicted_tokens >= 60 - 24
    check_data(s)
    victim = evicted[0]
    want = path_tokens(victim)
    slots = s.manager.load_back(victim)
    assert slots is not None and torch.equal(slots, victim.device)
    assert victim.lock_ref == 1 and victim.host_ref == 1 and "load" in victim.pending
    assert s.manager.load_slot(victim) is not None  # one layer-wise load job in flight
    s.drain()
    assert victim.lock_ref == 0 and victim.host_ref == 0 and not victim.pending
    s.assert_device(victim.device, want)
    assert s.manager.load_back(victim).numel() == 0  # already on the device
    check_invariants(s)


def test_load_back_chain_all_or_nothing(gen, make_stack):
    s = make_stack(device_pages=8, host_pages=32)
    a, b, c = toks(gen, 8), toks(gen, 4), toks(gen, 12)
    s.put(a + b + c)
    s.manager.match_prefix(a + b)  # split a+b | c
    s.manager.match_prefix(a)  # split a | b | c
    s.drain()
    s.manager.evict_device(HUGE)
    chain = [s.node(a), s.node(a + b), s.node(a + b + c)]
    assert all(host_only(n) for n in chain)
    hosts = [n.host.clone() for n in chain]
    # Lock 12 of the 32 device tokens: 20 stay free, the 24-token chain cannot fit, and no
    # part of it (a and b would fit) moves.
    d = toks(gen, 12)
    s.put(d)
    nd = s.node(d)
    s.manager.inc_lock_ref(nd)
    s.drain()  # d's host copy lands first: load_back acknowledges finished copies as it goes
    before = (s.alloc.available_size(), s.host.available_size(), s.manager.pending_ops())
    assert s.manager.load_back(chain[-1]) is None
    assert (s.alloc.available_size(), s.host.available_size(), s.manager.pending_ops()) == before
    for n, h in zip(chain, hosts, strict=True):
        assert host_only(n) and torch.equal(n.host, h)
        assert n.lock_ref == 0 and n.host_ref == 0 and not n.pending
    assert s.device_host.in_flight == 0  # no copy was submitted
    check_invariants(s)
    # Every device slot locked: not even the 8-token head comes back.
    e = toks(gen, 20)
    s.put(e)
    s.manager.inc_lock_ref(s.node(e))
    assert s.manager.load_back(chain[0]) is None and host_only(chain[0])
    s.manager.dec_lock_ref(s.node(e))
    # e released: the 12-token chain a, b comes back whole and top-down (e makes room), c
    # stays on host.
    slots = s.manager.load_back(chain[1])
    assert slots is not None and len(slots) == 12
    assert torch.equal(torch.cat([chain[0].device, chain[1].device]), slots)
    assert host_only(chain[2])
    assert nd.on_device and nd.lock_ref == 1
    s.drain()
    s.assert_device(slots, a + b)
    # d released: c comes back on its own.
    s.manager.dec_lock_ref(nd)
    slots_c = s.manager.load_back(chain[2])
    assert slots_c is not None and len(slots_c) == 12
    s.drain()
    s.assert_device(torch.cat([slots, slots_c]), a + b + c)
    check_invariants(s)
    check_data(s)


def test_load_back_keeps_the_device_parent(gen, make_stack):
    """Room for a load never comes from the chain's own device ancestor, even when that
    ancestor is the least recently used node."""
    s = make_stack(device_pages=4, host_pages=16)
    p, c, x = toks(gen, 4), toks(gen, 4), toks(gen, 8)
    s.put(p + c)
    s.manager.match_prefix(p)  # p | c
    s.drain()
    assert s.manager.evict_device(1) == 4  # c -> host only (p has a device child)
    s.put(x)
    s.put(toks(gen, 4))  # device full: p (oldest), x, and this one
    s.drain()
    s.manager.match_prefix(x)
    np_, nc = s.node(p), s.node(p + c)
    assert s.alloc.available_size() == 0 and host_only(nc)
    slots = s.manager.load_back(nc)
    assert slots is not None
    assert np_.on_device, "the chain's device parent was evicted to make room for it"
    s.drain()
    s.assert_device(torch.cat([np_.device, slots]), p + c)
    check_invariants(s)


def test_host_eviction_drops_host_only_leaves(gen, make_stack):
    s = make_stack(device_pages=12, host_pages=16, storage=False)
    a, b, c = toks(gen, 8), toks(gen, 8), toks(gen, 8)
    s.put(a + b)
    s.manager.match_prefix(a)  # a | b
    s.put(c)
    s.drain()
    s.manager.evict_device(1)  # LRU: c (inserted last, never hit) stays; b goes first
    na, nb, nc = s.node(a), s.node(a + b), s.node(c)
    assert host_only(nb) and na.on_device
    # b is a host-only leaf: it leaves the tree; then a and c only lose their host copies.
    assert s.manager.evict_host(HUGE) == 24
    assert not attached(s.tree, nb) and nb.host is None
    assert na.on_device and not na.on_host and nc.on_device and not nc.on_host
    assert list(s.tree.root.children.values()) and len(list(walk(s.tree.root))) == 2
    assert s.host.available_size() == s.host0
    assert s.manager.metrics.host.dropped_tokens == 8
    check_invariants(s)
    # A host-only chain empties the tree from the leaves up.
    s.clear()
    s.put(a + b)
    s.drain()
    s.manager.evict_device(HUGE)
    assert s.manager.evict_host(HUGE) == 16 and not s.tree.root.children
    check_invariants(s)


def test_protected_host_nodes_keep_their_slots(gen, make_stack):
    s = make_stack(device_pages=12, host_pages=6, storage=False)
    a, b = toks(gen, 16), toks(gen, 16)
    s.put(a)
    s.drain()
    s.manager.evict_device(HUGE)
    na = s.node(a)
    s.manager.inc_host_ref(na)
    held = na.host.clone()
    # b's write-through copy needs a's host room; a is protected, so b's copy is skipped.
    s.put(b)
    s.drain()
    assert torch.equal(na.host, held) and attached(s.tree, na)
    assert not s.node(b).on_host and s.manager.metrics.host.writes_skipped == 1
    assert s.manager.evict_host(HUGE) == 0
    s.manager.dec_host_ref(na)
    with pytest.raises(InvalidArgumentError):
        s.manager.dec_host_ref(na)
    with pytest.raises(InvalidArgumentError):
        s.manager.dec_lock_ref(na)
    assert s.manager.evict_host(HUGE) == 16 and not attached(s.tree, na)
    check_invariants(s)


@pytest.mark.parametrize("hold", ["host_ref", "backup"])
def test_device_eviction_keeps_a_subtree_in_use(gen, make_stack, hold):
    """A device-only node (its host copy dropped) whose host-only child is protected, or is
    being backed up, cannot take that child out of the tree with it."""
    s = make_stack(device_pages=12, host_pages=16)
    a, b = toks(gen, 8), toks(gen, 8)
    s.put(a)
    s.drain()
    assert s.manager.evict_host(1) == 8  # a: device only
    gate = threading.Event()
    if hold == "backup":
        real_set = s.storage.batch_set

        def slow_set(*args):
            gate.wait(10)
            return real_set(*args)

        s.storage.batch_set = slow_set
    s.put(a + b)
    s.device_host.wait()
    s.manager.poll()  # b's host copy landed; its backup is now started
    assert s.manager.evict_device(1) == 8  # b -> host only
    na, nb = s.node(a), s.node(a + b)
    assert na.on_device and not na.on_host and host_only(nb)
    held = nb.host.clone()
    if hold == "host_ref":
        s.drain()
        s.manager.inc_host_ref(nb)
    else:
        assert "backup" in nb.pending
    assert s.manager.evict_device(HUGE) == 0
    assert na.on_device and attached(s.tree, nb) and torch.equal(nb.host, held)
    check_invariants(s)
    if hold == "host_ref":
        s.manager.dec_host_ref(nb)
    gate.set()
    s.drain()
    assert nb.in_storage
    assert s.manager.evict_device(HUGE) == 8
    assert not s.tree.root.children
    assert s.alloc.available_size() == s.device0 and s.host.available_size() == s.host0


def test_storage_hit_after_host_drop_and_prefetch(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 20)
    s.put(seq)
    s.drain()
    keys = s.keys_of(seq)
    assert s.node(seq).in_storage and s.storage.batch_exists(keys) == 5
    s.clear()
    assert not s.tree.root.children
    extra = toks(gen, 3)
    m = s.manager.match_prefix(seq + extra)
    assert (m.device_hit_length, m.host_hit_length, m.storage_hit_length) == (0, 0, 20)
    assert m.storage_keys == keys
    assert s.manager.match_prefix(seq, check_storage=False).storage_hit_length == 0
    op = s.manager.prefetcher.start(m, seq + extra)
    assert op is not None and s.manager.pending_ops() == 1
    assert s.manager.prefetcher.finish(op, None) == 20
    assert s.manager.pending_ops() == 0
    node = s.node(seq)
    assert host_only(node) and node.in_storage and node.host_ref == 0 and node.lock_ref == 0
    s.assert_host(node.host, seq)
    check_invariants(s)
    m = s.manager.match_prefix(seq)
    assert (m.host_hit_length, m.storage_hit_length) == (20, 0)
    slots = s.manager.load_back(node)
    s.drain()
    s.assert_device(slots, seq)
    check_invariants(s)


def test_storage_hit_below_a_device_prefix(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    a, b = toks(gen, 8), toks(gen, 12)
    s.put(a + b)
    s.manager.match_prefix(a)  # a | b
    s.drain()
    nb = s.node(a + b)
    s.manager.evict_device(12)  # b -> host only
    s.manager.evict_host(12)  # b leaves the tree; a loses its host copy
    assert not attached(s.tree, nb) and s.node(a).on_device
    m = s.manager.match_prefix(a + b)
    assert (m.device_hit_length, m.host_hit_length, m.storage_hit_length) == (8, 0, 12)
    assert m.storage_keys == s.keys_of(a + b)[2:]
    assert s.manager.prefetcher.finish(s.manager.prefetcher.start(m, a + b), None) == 12
    nb = s.node(a + b)
    assert host_only(nb) and nb.parent is s.node(a)
    s.assert_host(nb.host, a + b, "prefetched")
    check_invariants(s)
    # A page missing from the middle of the chain ends the storage hit there.
    s.manager.evict_host(HUGE)
    s.storage.delete([s.keys_of(a + b)[3]])
    m = s.manager.match_prefix(a + b)
    assert m.storage_hit_length == 4


def test_prefetch_overlapping_an_insert(gen, make_stack):
    """Pages the tree gained while a prefetch ran are not attached twice: their prefetched
    host slots are freed and the rest hangs below what the tree now holds."""
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 20)
    s.put(seq)
    s.drain()
    s.clear()
    m = s.manager.match_prefix(seq)
    op = s.manager.prefetcher.start(m, seq)
    assert op is not None
    s.put(seq[:8])  # meanwhile a request computes and inserts the first two pages
    assert s.manager.prefetcher.finish(op, None) == 12
    head, tail = s.node(seq[:8]), s.node(seq)
    assert tail.parent is head and host_only(tail) and head.on_device and head.on_host
    s.assert_host(tail.host, seq)
    s.drain()
    check_invariants(s)
    check_data(s)
    # The whole range already there: every prefetched slot goes back.
    s.clear()
    op = s.manager.prefetcher.start(s.manager.match_prefix(seq), seq)
    s.put(seq)
    assert s.manager.prefetcher.finish(op, None) == 0
    s.drain()
    check_invariants(s)


def test_prefetch_limited_by_host_room(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=8)
    seq = toks(gen, 24)
    s.put(seq)
    s.drain()
    s.clear()
    blocker = s.host.alloc(20)  # 3 of 8 host pages stay free
    m = s.manager.match_prefix(seq)
    assert m.storage_hit_length == 24
    op = s.manager.prefetcher.start(m, seq)
    gained = s.manager.prefetcher.finish(op, None)
    assert 0 < gained <= 12 and gained % 4 == 0
    node = next(iter(s.tree.root.children.values()))
    assert tuple(seq[:gained]) == node.key
    s.assert_host(node.host, seq[:gained])
    check_invariants(s, outside_host=20)
    # No room at all: no operation, nothing held.
    s.host.free(blocker)
    s.clear()
    blocker = s.host.alloc(32)
    assert s.manager.prefetcher.start(s.manager.match_prefix(seq), seq) is None
    assert s.manager.metrics.host.writes_skipped >= 1
    s.host.free(blocker)
    check_invariants(s)


def test_prefetch_with_timeout_zero_keeps_a_valid_prefix(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16, storage_batch_pages=1)
    seq = toks(gen, 24)
    s.put(seq)
    s.drain()
    s.clear()
    m = s.manager.match_prefix(seq)
    gained = s.manager.prefetcher.finish(s.manager.prefetcher.start(m, seq), 0)
    assert 0 <= gained <= 24 and gained % 4 == 0
    if gained:
        s.assert_host(s.node(seq[:gained]).host, seq[:gained])
    check_invariants(s)
    s.clear()
    assert s.host.available_size() == s.host0


# -- write policies ----------------------------------------------------------------------
def test_write_through_copies_on_insert_then_backs_up(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16)
    seq = toks(gen, 12)
    s.put(seq)
    node = s.node(seq)
    assert node.on_host and "write" in node.pending
    assert s.host.available_size() == s.host0 - 12
    s.device_host.wait()  # the copy landed, but nobody acknowledged it yet
    assert s.storage.stats().sets == 0 and not node.in_storage
    s.manager.poll()  # acknowledgement starts the backup
    s.drain()
    assert node.in_storage and not node.pending and node.lock_ref == 0 and node.host_ref == 0
    s.assert_host(node.host, seq)
    got = s.storage_kv(s.keys_of(seq))
    ek, ev = s.expected(seq)
    assert torch.equal(got[0], ek) and torch.equal(got[1], ev)
    check_invariants(s)


def test_write_through_selective_copies_on_second_hit(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16, write_policy="write_through_selective")
    seq = toks(gen, 12)
    s.put(seq)
    s.drain()
    node = s.node(seq)
    assert not node.on_host and s.host.available_size() == s.host0
    s.manager.match_prefix(seq)
    s.drain()
    assert not node.on_host
    s.manager.match_prefix(seq + toks(gen, 2))
    assert node.on_host and "write" in node.pending
    s.drain()
    s.assert_host(node.host, seq)
    assert node.in_storage and s.storage.batch_exists(s.keys_of(seq)) == 3
    check_invariants(s)


def test_write_through_selective_threshold(gen, make_stack):
    s = make_stack(write_policy="write_through_selective", selective_hits=3)
    seq = toks(gen, 8)
    s.put(seq)
    for _ in range(2):
        s.manager.match_prefix(seq)
    assert not s.node(seq).on_host
    s.manager.match_prefix(seq)
    s.drain()
    assert s.node(seq).on_host
    s.assert_host(s.node(seq).host, seq)


def test_write_back_copies_only_on_eviction(gen, make_stack):
    s = make_stack(device_pages=10, host_pages=16, write_policy="write_back")
    seq = toks(gen, 12)
    s.put(seq)
    for _ in range(3):
        s.manager.match_prefix(seq)
    s.drain()
    node = s.node(seq)
    assert not node.on_host and s.host.available_size() == s.host0
    dev_slots = node.device.clone()
    dev_k, dev_v = s.device_kv(dev_slots)
    # Record the host contents at the moment the device slots are freed.
    seen = []
    real_free = s.alloc.free

    def spy_free(idx):
        if node.host is not None:
            seen.append((idx.clone(), s.host_kv(node.host)))
        real_free(idx)

    s.alloc.free = spy_free
    assert s.manager.evict_device(1) == 12
    s.alloc.free = real_free
    assert host_only(node)
    assert len(seen) == 1 and torch.equal(seen[0][0], dev_slots)
    hk, hv = seen[0][1]
    assert torch.equal(hk, dev_k) and torch.equal(hv, dev_v)  # copied before the free
    s.assert_host(node.host, seq)
    assert s.storage.stats().sets == 0 and not node.in_storage
    # Storage is written when the host copy goes.
    s.drain()
    assert s.storage.stats().sets == 0
    assert s.manager.evict_host(HUGE) == 12 and not attached(s.tree, node)
    got = s.storage_kv(s.keys_of(seq))
    ek, ev = s.expected(seq)
    assert torch.equal(got[0], ek) and torch.equal(got[1], ev)
    m = s.manager.match_prefix(seq)
    assert m.storage_hit_length == 12
    assert s.manager.prefetcher.finish(s.manager.prefetcher.start(m, seq), None) == 12
    s.assert_host(s.node(seq).host, seq)
    check_invariants(s)


def test_write_back_eviction_makes_host_room(gen, make_stack):
    s = make_stack(device_pages=4, host_pages=4, write_policy="write_back")
    seqs = [toks(gen, 8) for _ in range(5)]
    for q in seqs:
        s.put(q)
        check_invariants(s)
    s.drain()
    # 16 device + 16 host tokens for 40: the first sequence went device -> host -> storage.
    assert s.storage.batch_exists(s.keys_of(seqs[0])) == 2
    got = s.storage_kv(s.keys_of(seqs[0]))
    assert torch.equal(got[0], s.expected(seqs[0])[0])
    check_data(s)


# -- failures -------------------------------------------------------------------------------
class FlakyStorage(MemoryStorage):
    fail: set[str] = set()

    def batch_exists(self, keys):
        if "exists" in self.fail:
            raise OSError("exists broke")
        return super().batch_exists(keys)

    def batch_get(self, keys, source, pages):
        if "get" in self.fail:
            raise OSError("get broke")
        return super().batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        if "set" in self.fail:
            raise OSError("set broke")
        return super().batch_set(keys, source, pages)


def flaky_stack(make_stack, **kw):
    s = make_stack(storage_cls=FlakyStorage, **kw)
    s.storage.fail = set()
    return s


def test_storage_exists_error_is_a_miss(gen, make_stack):
    s = flaky_stack(make_stack)
    seq = toks(gen, 8)
    s.put(seq)
    s.drain()
    s.clear()
    s.storage.fail = {"exists"}
    m = s.manager.match_prefix(seq)
    assert m.storage_hit_length == 0 and m.storage_keys == []
    assert s.manager.metrics.storage_errors == 1
    assert s.manager.prefetcher.start(m, seq) is None
    s.storage.fail = set()
    assert s.manager.match_prefix(seq).storage_hit_length == 8


def test_storage_get_error_is_a_miss(gen, make_stack):
    s = flaky_stack(make_stack)
    seq = toks(gen, 8)
    s.put(seq)
    s.drain()
    s.clear()
    m = s.manager.match_prefix(seq)
    assert m.storage_hit_length == 8
    s.storage.fail = {"get"}
    op = s.manager.prefetcher.start(m, seq)
    assert op is not None
    assert s.manager.prefetcher.finish(op, None) == 0
    assert s.manager.metrics.storage_errors >= 1
    assert not s.tree.root.children and s.manager.pending_ops() == 0
    assert s.host.available_size() == s.host0
    check_invariants(s)


def test_prefetch_submit_error_is_a_miss(gen, make_stack, monkeypatch):
    s = make_stack()
    seq = toks(gen, 8)
    s.put(seq)
    s.drain()
    s.clear()
    m = s.manager.match_prefix(seq)

    def broken(*a, **k):
        raise RuntimeError("queue gone")

    monkeypatch.setattr(s.host_storage, "submit", broken)
    assert s.manager.prefetcher.start(m, seq) is None
    assert s.manager.metrics.storage_errors == 1 and s.manager.pending_ops() == 0
    assert s.host.available_size() == s.host0
    check_invariants(s)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_storage_set_error_is_counted_not_raised(gen, make_stack, policy):
    s = flaky_stack(make_stack, write_policy=policy)
    s.storage.fail = {"set"}
    seq = toks(gen, 12)
    s.put(seq)
    s.drain()
    node = s.node(seq)
    s.clear()  # write_back: the backup runs (and fails) on host eviction
    assert not node.in_storage and not attached(s.tree, node)
    assert s.manager.metrics.storage_errors >= 1
    assert s.manager.pending_ops() == 0
    assert s.alloc.available_size() == s.device0 and s.host.available_size() == s.host0
    s.storage.fail = set()
    assert s.manager.match_prefix(seq).storage_hit_length == 0


def test_failed_device_to_host_copy_frees_the_host_slots(gen, make_stack, monkeypatch):
    s = make_stack()

    def broken(*a, **k):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(s.host, "backup_from_device_all_layer", broken)
    seq = toks(gen, 8)
    s.put(seq)
    s.drain()
    node = s.node(seq)
    assert node.on_device and not node.on_host and node.lock_ref == 0 and not node.pending
    assert s.host.available_size() == s.host0 and s.storage.stats().sets == 0
    check_invariants(s)


def test_failed_load_drops_device_copy_keeps_host(gen, make_stack, monkeypatch):
    s = make_stack(write_policy="write_back")
    a, b = toks(gen, 8), toks(gen, 8)
    s.put(a)
    s.drain()
    s.manager.evict_device(HUGE)
    na = s.node(a)
    assert host_only(na)

    def broken(*a, **k):
        raise RuntimeError("load failed")

    monkeypatch.setattr(s.host, "load_to_device_per_layer", broken)
    assert s.manager.load_back(na) is not None
    # Before the failure is acknowledged, a longer sequence goes in below the loading node.
    assert s.put(a + b) == 8
    s.device_host.wait()
    s.manager.poll()
    assert s.manager.pending_ops() == 0 and na.lock_ref == 0 and na.host_ref == 0
    assert na.on_host
    check_invariants(s)
    # Without anything below it, a failed load leaves the node host-only.
    s.manager.evict_device(HUGE)
    s.manager.load_back(na)
    s.drain()
    assert host_only(na) and s.alloc.available_size() == s.device0
    check_invariants(s)


def test_selective_write_keeps_the_matched_host_part(gen, make_stack):
    """A selective write-through during match_prefix must not evict the host part of the very
    match it is returning."""
    s = make_stack(
        device_pages=10,
        host_pages=3,
        write_policy="write_through_selective",
        host_policy="fifo",
        storage=False,
    )
    p0, a = toks(gen, 8), toks(gen, 4)
    s.put(p0)
    s.manager.match_prefix(p0)
    s.manager.match_prefix(p0)  # second hit: p0 -> host (FIFO time 1)
    s.put(p0 + a)
    s.manager.match_prefix(p0 + a)
    s.manager.match_prefix(p0 + a)  # a's second hit: a -> host (FIFO time 2)
    s.drain()
    s.manager.evict_device(HUGE)  # both host-only now
    s.put(p0)  # p0 adopts device slots again
    s.manager.evict_host(1)  # FIFO: p0's host copy goes, a stays host-only
    na = s.node(p0 + a)
    assert host_only(na) and s.node(p0).on_device and not s.node(p0).on_host
    blocker = s.host.alloc(4)  # host full: p0's selective write needs a's room
    m = s.manager.match_prefix(p0 + a)
    assert m.host_hit_length == 4 and m.last_node is na
    assert attached(s.tree, na) and na.on_host, "the match's host part was evicted"
    s.drain()
    slots = s.manager.load_back(m.last_node)
    assert slots is not None
    s.drain()
    s.assert_device(torch.cat([m.device_indices, slots]), p0 + a)
    check_invariants(s, outside_host=4)
    s.host.free(blocker)


# -- a load failing under a request's feet (issue 12, found by tests/cache/test_fault_campaign) --
def fail_next_load(s, monkeypatch, go: threading.Event) -> None:
    """The next load waits for ``go``, copies layer 1 from the wrong host rows and fails there
    (layers 0 and 2 land); every later load is real."""
    real = s.host.load_to_device_per_layer
    calls = itertools.count()

    def load(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
        i = next(calls)
        if i < LAYERS:
            go.wait(10)
        if i == 1:
            real(pool, host_indices.flip(0), device_indices, layer_id, io_backend)
            raise RuntimeError("load failed at layer 1")
        real(pool, host_indices, device_indices, layer_id, io_backend)

    monkeypatch.setattr(s.host, "load_to_device_per_layer", load)


def split_host_only(s, gen) -> tuple[list[int], list[int]]:
    """Two host-only nodes a | b (in storage too when the stack has it)."""
    a, b = toks(gen, 8), toks(gen, 8)
    s.put(a + b)
    s.manager.match_prefix(a)  # a | b
    s.drain()
    s.manager.evict_device(HUGE)
    assert host_only(s.node(a)) and host_only(s.node(a + b))
    return a, b


def check_grant(s, grant, tokens) -> None:
    """The grant holds no stale copy, its hits add up, and its prefix reads back (through the
    layer waits, as a forward reads it) as the oracle's KV."""
    h = grant.hits
    assert not s.manager.holds_stale(grant.node), "a failed load's copy was served"
    assert h.device + h.host + h.storage == grant.prefix_len, h
    assert h.missed == h.prompt_tokens - grant.prefix_len, h
    assert all(n.on_device for n in path_to_root(grant.node) if n.parent is not None)
    s.device_host.layer_done_counter.set_consumer(grant.load_slot)
    k = torch.stack([s.pool.get_key_buffer(i)[grant.slots] for i in range(LAYERS)])
    v = torch.stack([s.pool.get_value_buffer(i)[grant.slots] for i in range(LAYERS)])
    ek, ev = s.expected(tokens[: grant.prefix_len])
    assert torch.equal(k, ek) and torch.equal(v, ev), "the served prefix is not its KV"


def test_load_back_below_a_load_in_flight_waits_for_it(gen, make_stack, monkeypatch):
    """A chain loaded below a device part whose own load was still in flight was read through
    the new load's layer events only, which cannot tell that the older load failed: the older
    load's garbage was served. load_back waits for (and acknowledges) the loads in flight above
    the chain first, and loads nothing below a failed one."""
    s = make_stack(storage=False)
    a, b = split_host_only(s, gen)
    na, nb = s.node(a), s.node(a + b)
    go = threading.Event()
    fail_next_load(s, monkeypatch, go)
    assert s.manager.load_back(na) is not None  # in flight; fails at layer 1
    timer = threading.Timer(0.05, go.set)
    timer.start()
    slots = s.manager.load_back(nb)
    timer.join()
    assert slots is None, "a chain was loaded below a load in flight that failed"
    assert host_only(na) and host_only(nb) and s.alloc.available_size() == s.device0
    check_invariants(s)
    slots = s.manager.load_back(nb)  # the next load is real: the whole chain comes back
    s.drain()
    s.assert_device(slots, a + b)
    check_invariants(s)


@pytest.mark.parametrize("held", [True, False], ids=["held", "unheld"])
def test_begin_looks_again_after_a_prefetch_acknowledged_a_failed_load(
    gen, make_stack, monkeypatch, held
):
    """begin kept its first look at the tree after a prefetch, whose poll may acknowledge a
    failed load of that look's device part: the request was handed the stale copy (another
    request held it) or, once the prefetch let go of it, its freed slots (hits that did not add
    up). It looks again after every prefetch."""
    s = make_stack(device_pages=10, host_pages=16)
    a, b = split_host_only(s, gen)
    s.manager.evict_host(8)  # b leaves the tree (the store keeps it); a stays host-only
    na = s.node(a)
    assert not na.children and s.storage.batch_exists(s.keys_of(a + b)) == 4
    go = threading.Event()
    fail_next_load(s, monkeypatch, go)
    first = lifecycle.begin(s.manager, a, prompt_tokens=9) if held else None
    if not held:
        assert s.manager.load_back(na) is not None
    real_get = s.storage.batch_get

    def get(keys, source, pages):  # the load above fails while the prefetch runs
        go.set()
        s.device_host.wait()
        if held:
            return real_get(keys, source, pages)
        raise OSError("EIO")

    monkeypatch.setattr(s.storage, "batch_get", get)
    grant = lifecycle.begin(s.manager, a + b, prompt_tokens=17)
    check_grant(s, grant, a + b)
    assert grant.prefix_len == (0 if held else 8), grant.hits  # unheld: a is loaded again
    for g in (grant, first):
        if g is not None:
            lifecycle.abort(s.manager, g, g.slots)
    s.drain()
    check_invariants(s)


@pytest.mark.parametrize("held", [True, False], ids=["held", "unheld"])
def test_begin_whose_load_back_met_a_failed_load_serves_no_stale_slots(
    gen, make_stack, monkeypatch, held
):
    """When load_back gives up because a failed load of the device part above surfaced while
    it made room, begin fell back on its first look's device part: the stale copy, or its
    freed slots once load_back let go of it. It looks again instead."""
    s = make_stack(storage=False)
    a, b = split_host_only(s, gen)
    go = threading.Event()
    fail_next_load(s, monkeypatch, go)
    first = lifecycle.begin(s.manager, a, prompt_tokens=9) if held else None
    if not held:
        assert s.manager.load_back(s.node(a)) is not None
    timer = threading.Timer(0.05, go.set)
    timer.start()
    grant = lifecycle.begin(s.manager, a + b, prompt_tokens=17)
    timer.join()
    check_grant(s, grant, a + b)
    for g in (grant, first):
        if g is not None:
            lifecycle.abort(s.manager, g, g.slots)
    s.drain()
    check_invariants(s)
    assert s.alloc.available_size() == s.device0


# -- random operation sequences -------------------------------------------------------------
class Driver:
    """Random inserts, matches, locks, host protections, loads, prefetches and evictions, with
    the invariants checked after every step."""

    def __init__(self, stack, rng: random.Random, gen: torch.Generator) -> None:
        self.s, self.rng, self.gen = stack, rng, gen
        self.P = stack.P
        self.seqs: list[list[int]] = []
        self.locks: list[tuple] = []  # (node, per-token device slots at lock time)
        self.protects: list[tuple] = []  # (node, per-token host slots at protect time)

    def new_seq(self) -> list[int]:
        P, rng = self.P, self.rng
        base: list[int] = []
        if self.seqs and rng.random() < 0.7:
            src = rng.choice(self.seqs)
            cut = rng.randint(0, len(src) // P) * P
            base = src[:cut]
            if base and rng.random() < 0.3:  # diverge inside the last kept page
                base = base[:-1] + [base[-1] + 1]
        tail = toks(self.gen, rng.randint(1, 3) * P, hi=8)  # small alphabet: shared pages
        seq = base + tail
        return seq[: 6 * P]

    def probe(self) -> list[int]:
        """A prefix of a known sequence (recent ones more often), sometimes with a tail."""
        rng = self.rng
        if self.seqs and rng.random() < 0.9:
            pool = self.seqs[-6:] if rng.random() < 0.6 else self.seqs
            seq = list(rng.choice(pool))
            if rng.random() < 0.5:
                seq = seq[: rng.randint(len(seq) // 2, len(seq))]
            if rng.random() < 0.4:
                seq += toks(self.gen, rng.randint(1, self.P + 2), hi=8)
            return seq
        return toks(self.gen, rng.randint(1, 4 * self.P), hi=8)

    def check_match(self, seq, m) -> None:
        tree = self.s.tree
        assert attached(tree, m.last_node) or m.last_node is tree.root
        path = list(reversed(list(path_to_root(m.last_node))))
        dev = [n for n in path if n.on_device]
        assert path[: len(dev)] == dev, "device part is not a prefix of the match"
        assert all(n.on_host for n in path[len(dev) :])
        assert m.device_hit_length == sum(len(n) for n in dev)
        assert m.host_hit_length == sum(len(n) for n in path[len(dev) :])
        assert torch.equal(
            m.device_indices,
            torch.cat([n.device for n in dev]) if dev else torch.empty(0, dtype=torch.int64),
        )
        assert (m.last_device_node is tree.root and not dev) or m.last_device_node is dev[-1]
        aligned = len(seq) - len(seq) % self.P
        total = m.device_hit_length + m.host_hit_length + m.storage_hit_length
        assert total <= aligned
        assert tuple(seq[: m.device_hit_length + m.host_hit_length]) == path_tokens(m.last_node)

    def step(self) -> None:
        s, rng = self.s, self.rng
        tree = s.manager
        r = rng.random()
        if r < 0.25:
            seq = self.new_seq()
            if s.put(seq) is not None:
                self.seqs.append(seq)
        elif r < 0.43:
            seq = self.probe()
            m = tree.match_prefix(seq)
            self.check_match(seq, m)
            if m.storage_hit_length and rng.random() < 0.8:
                op = tree.prefetcher.start(m, seq)
                if op is not None:
                    tree.prefetcher.finish(op, rng.choice([None, None, 0]))
        elif r < 0.58:
            if len(self.locks) >= 3:
                node, _ = self.locks.pop(0)
                tree.dec_lock_ref(node)
            seq = self.probe()
            m = tree.match_prefix(seq)
            self.check_match(seq, m)
            node = m.last_node
            if node is not m.last_device_node:
                slots = tree.load_back(node)
                if slots is None:
                    node = m.last_device_node
                else:
                    assert len(slots) == m.host_hit_length
            if node is not s.tree.root:
                tree.inc_lock_ref(node)
                self.locks.append((node, per_token(node, "device")))
        elif r < 0.66 and self.locks:
            node, _ = self.locks.pop(rng.randrange(len(self.locks)))
            tree.dec_lock_ref(node)
        elif r < 0.72 and len(self.protects) < 3:
            hosted = [n for n in walk(s.tree.root) if n.on_host]
            if hosted:
                node = rng.choice(hosted)
                tree.inc_host_ref(node)
                self.protects.append((node, per_token(node, "host")))
        elif r < 0.77 and self.protects:
            node, _ = self.protects.pop(rng.randrange(len(self.protects)))
            tree.dec_host_ref(node)
        elif r < 0.86:
            tree.evict_device(rng.randint(1, 6) * self.P)
        elif r < 0.93:
            tree.evict_host(rng.randint(1, 6) * self.P)
        elif r < 0.97:
            tree.poll()
        else:
            s.drain()
            check_data(s)
        self.check()

    def check(self) -> None:
        tree = self.s.tree
        check_invariants(self.s)
        for node, slots in self.locks:
            assert attached(tree, node), f"locked {node!r} left the tree"
            assert all(n.on_device for n in path_to_root(node)), f"locked {node!r} evicted"
            assert per_token(node, "device") == slots, f"locked {node!r} changed slots"
            assert node.lock_ref > 0
        for node, slots in self.protects:
            assert attached(tree, node), f"protected {node!r} left the tree"
            now = per_token(node, "host")
            assert all(a == b for a, b in zip(now, slots, strict=True) if b is not None), (
                f"protected {node!r} lost host slots"
            )
            assert node.host_ref > 0

    def finish(self) -> None:
        s, tree = self.s, self.s.tree
        for node, _ in self.locks:
            s.manager.dec_lock_ref(node)
        for node, _ in self.protects:
            s.manager.dec_host_ref(node)
        self.locks, self.protects = [], []
        s.drain()
        check_invariants(s)
        check_data(s)
        for n in walk(tree.root):
            assert n.lock_ref == 0 and n.host_ref == 0 and not n.pending
        s.clear()
        assert not tree.root.children
        assert s.manager.pending_ops() == 0
        assert s.alloc.available_size() == s.device0
        assert s.host.available_size() == s.host0
        assert not tree.device_policy._state and not tree.host_policy._state


@pytest.mark.parametrize(
    ("write_policy", "device_policy", "host_policy", "page_size", "device_pages", "host_pages"),
    [
        ("write_through", "lru", "lru", 4, 10, 14),
        ("write_through_selective", "lfu", "s3fifo", 4, 16, 6),
        ("write_through_selective", "lru", "lru", 4, 14, 5),
        ("write_back", "s3fifo", "fifo", 8, 10, 14),
        ("write_through", "fifo", "lfu", 8, 10, 14),
    ],
)
def test_random_operations_keep_invariants(
    gen, make_stack, write_policy, device_policy, host_policy, page_size, device_pages, host_pages
):
    s = make_stack(
        page_size=page_size,
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy=write_policy,
        device_policy=device_policy,
        host_policy=host_policy,
        storage_batch_pages=2,
    )
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    d = Driver(s, rng, gen)
    for _ in range(200):
        d.step()
    d.finish()

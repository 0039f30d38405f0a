"""SimCache: the real TieredRadixCache driven with one token per block and counting stand-ins.

Every run here is checked request by request against the tree it drives: the tier a hit is
counted at must hold that block before the request, hits are a prefix of the request, and the
slot pools account for exactly the slots the tree holds. No policy may beat Belady's bound at
the same total capacity.
"""

from __future__ import annotations

import random
from dataclasses import astuple

import pytest
import torch

from tiered_kv.cli.sim_cmd import sweep
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import WritePolicy
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.simulator import CountingSlots, KeyStore, SimCache, SimResult
from tiered_kv.sim.traces import TraceRequest, long_doc_qa, multi_round_qa, unique_blocks
from tiered_kv.storage.keys import page_digests
from tiered_kv.tree.node import walk
from tiered_kv.tree.policies import POLICIES

WRITE_POLICIES = WritePolicy.values()

# (device, host, storage) block capacities; storage 0: no storage tier.
CAPACITIES = [(1, 0, 0), (3, 0, 0), (4, 4, 0), (6, 3, 0), (2, 8, 0), (3, 5, 4), (5, 5, 6)]


def _trace(blocks) -> list[TraceRequest]:
    return [TraceRequest(tuple(b)) for b in blocks]


def random_trace(rng: random.Random, requests: int, alphabet: int = 3, max_len: int = 6):
    """Requests as random paths in a small content tree; a block's id is its whole content
    prefix (so ids are prefix-dependent, as in Mooncake's hash_ids)."""
    ids: dict[tuple, int] = {}
    out = []
    for _ in range(requests):
        n = rng.randint(1, max_len)
        content = tuple(rng.randrange(2 if i == 0 else alphabet) for i in range(n))
        out.append(
            TraceRequest(tuple(ids.setdefault(content[: i + 1], len(ids)) for i in range(n)))
        )
    return out


def _mrq(seed=0):
    return multi_round_qa(
        users=4, rounds=3, shared_prompt=48, history=16, answer=16, num_shared_prompts=2, seed=seed
    )


def resident(tree, blocks) -> tuple[int, int]:
    """(blocks on the device, blocks on device or host) of the longest cached prefix of
    ``blocks``, read without touching the tree (no splits, no hits). Asserts that device
    residency is prefix-closed."""
    node, pos, dev, both = tree.root, 0, 0, 0
    while pos < len(blocks):
        child = node.children.get((blocks[pos],))
        if child is None:
            break
        n = 0
        while n < len(child.key) and pos + n < len(blocks) and child.key[n] == blocks[pos + n]:
            n += 1
        assert child.on_device or child.on_host, child
        if child.on_device:
            assert dev == pos, "device residency is not prefix-closed"
            dev = pos + n
        both = pos + n
        if n < len(child.key):
            break
        node, pos = child, pos + n
    return dev, both


def check_pools(sim: SimCache) -> None:
    """The pools lend exactly the slots the tree's nodes hold, each slot once."""
    tree = sim.tree
    dev = [s for n in walk(tree.root) if n.on_device for s in n.device.tolist()]
    assert len(dev) == len(set(dev))
    assert sim.device.capacity - sim.device.available_size() == len(dev)
    assert set(dev).isdisjoint(sim.device._free)
    if sim.host is not None:
        host = [s for n in walk(tree.root) if n.on_host for s in n.host.tolist()]
        assert len(host) == len(set(host))
        assert sim.host.capacity - sim.host.available_size() == len(host)
    for n in walk(tree.root):
        assert n.on_device or n.on_host, n


def run_checked(sim: SimCache, trace) -> list[tuple[int, int, int, int]]:
    """``sim.run(trace)`` one request at a time, checking each request's counts; returns
    (device, host, storage, missed) per request."""
    res, tree = sim.result, sim.tree
    seen: set[int] = sim.__dict__.setdefault("_test_seen", set())  # across calls on one sim
    out = []
    for req in trace:
        blocks = req.blocks
        dev, both = resident(tree, blocks)
        in_store = 0
        if sim.store is not None:
            keys = [sim.manager.namespace.fingerprint + d for d in page_digests(list(blocks), 1)]
            while both + in_store < len(blocks) and keys[both + in_store] in sim.store._keys:
                in_store += 1
        before = astuple(res)
        sim.request(blocks)
        after = astuple(res)
        nreq, nblocks, d, h, s, m = (a - b for a, b in zip(after, before, strict=True))
        assert (nreq, nblocks) == (1, len(blocks))
        assert d + h + s + m == len(blocks)
        assert d == dev  # the device part is counted at the device
        if h or s:  # the host part was loaded back: all of it, and storage only after it
            assert h == both - dev
            assert s <= in_store
        else:  # or nothing below the device counts (no room to load it back)
            assert h == 0 and s == 0
        if sim.host is None:
            assert h == 0 and s == 0
        if sim.store is None:
            assert s == 0
        hits = d + h + s
        assert set(blocks[:hits]) <= seen  # a hit block was seen before
        seen.update(blocks)
        sim.manager.poll()  # what the next request's poll does: nothing runs in between
        check_pools(sim)
        assert all(n.lock_ref == 0 and n.host_ref == 0 for n in walk(tree.root))
        assert sim.manager.pending_ops() == 0  # every stand-in copy completes at once
        out.append((d, h, s, m))
    return out


def evict_everything(sim: SimCache) -> None:
    tree = sim.tree
    for _ in range(3):  # write_back moves device victims to the host on the way out
        sim.manager.evict_device(sim.device.capacity)
        if sim.host is not None:
            sim.manager.evict_host(sim.host.capacity)
    assert not tree.root.children
    assert sim.device.available_size() == sim.device.capacity
    if sim.host is not None:
        assert sim.host.available_size() == sim.host.capacity


def _sim(device, host, storage, policy="lru", write_policy="write_through"):
    return SimCache(
        device,
        host,
        storage,
        device_policy=policy,
        host_policy=policy,
        write_policy=write_policy,
    )


# -- the offline bound ---------------------------------------------------------------------------
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_no_policy_beats_belady(policy, write_policy):
    rng = random.Random(f"{policy}-{write_policy}")
    traces = [random_trace(rng, 20) for _ in range(6)]
    traces += [random_trace(rng, 15, alphabet=2, max_len=8) for _ in range(2)]
    traces.append(_mrq(seed=2))
    traces.append(long_doc_qa(documents=3, document_length=40, questions=3, block_size=16))
    for trace in traces:
        accesses = access_sequence(trace)
        for device, host, storage in CAPACITIES:
            sim = _sim(device, host, storage, policy, write_policy)
            per_request = run_checked(sim, trace)
            res = sim.result
            hits = res.device + res.host + res.storage
            assert hits <= belady_hits(accesses, device + host + storage), (device, host, storage)
            assert [sum(r) for r in per_request] == [len(r.blocks) for r in trace]
            assert res.blocks == len(accesses) and res.requests == len(trace)
            if not host:
                assert (res.host, res.storage) == (0, 0)
            evict_everything(sim)


def test_bound_is_tight_enough_to_matter():
    # Guard the test above: the bound is below "every reuse hits" at these sizes, and the
    # simulator does get hits, so the comparison is not vacuous.
    rng = random.Random(3)
    trace = random_trace(rng, 20)
    accesses = access_sequence(trace)
    assert belady_hits(accesses, 4) < len(accesses) - len(set(accesses))
    assert _sim(4, 0, 0).run(trace).device > 0


# -- behaviour -----------------------------------------------------------------------------------
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("host", [0, 4])
def test_repeated_request_hits_on_the_device(policy, write_policy, host):
    sim = _sim(5, host, 0, policy, write_policy)
    res = sim.run(_trace([(1, 2, 3, 4, 5)] * 3))
    assert (res.device, res.host, res.storage, res.missed) == (10, 0, 0, 5)
    assert res.rate("device") == pytest.approx(10 / 15)
    # A longer request sharing the prefix hits the prefix and misses the rest.
    sim.request((1, 2, 3, 6))
    assert (sim.result.device, sim.result.missed) == (13, 6)


def test_request_larger_than_the_device_is_served_not_cached():
    sim = _sim(3, 0, 0)
    res = run_checked(sim, _trace([(1, 2, 3, 4)] * 2 + [(1, 2)] * 2))
    assert res == [(0, 0, 0, 4), (0, 0, 0, 4), (0, 0, 0, 2), (2, 0, 0, 0)]


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_blocks_come_back_from_the_host(write_policy):
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    sim = _sim(4, 8, 0, "lru", write_policy)
    out = run_checked(sim, _trace([a, b, a]))
    if write_policy == "write_through_selective":
        # Copied to the host only on its second hit: A never got one, so it left the tree.
        assert out[2] == (0, 0, 0, 4)
    else:  # write_back copies A on eviction; write_through copied it on insert
        assert out[2] == (0, 4, 0, 0)
        assert sim.result.rate("host") == pytest.approx(4 / 12)


def test_selective_write_copies_on_the_second_hit():
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    sim = _sim(4, 8, 0, "lru", "write_through_selective")
    out = run_checked(sim, _trace([a, a, a, b, a]))
    assert out == [(0, 0, 0, 4), (4, 0, 0, 0), (4, 0, 0, 0), (0, 0, 0, 4), (0, 4, 0, 0)]


def test_write_back_host_hits_on_a_generated_trace():
    trace = _mrq()
    need = max(len(r.blocks) for r in trace)
    res = _sim(need, 3 * need, 0, "lru", "write_back").run(trace)
    assert res.host > 0 and 0 < res.rate("host") <= 1
    assert res.hit_rate == pytest.approx(res.rate("device") + res.rate("host"))


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_storage_hits_after_the_host_is_overwhelmed(write_policy):
    a, b, c = (1, 2), (3, 4), (5, 6)
    sim = _sim(2, 2, None, "lru", write_policy)  # unbounded storage
    out = run_checked(sim, _trace([a, b, c, a]))
    assert out[3] == (0, 0, 2, 0)
    assert sim.result.rate("storage") == pytest.approx(2 / 8)
    assert len(sim.store) >= 4  # a and b at least were stored
    # Without a storage tier the same requests miss.
    assert run_checked(_sim(2, 2, 0, "lru", write_policy), _trace([a, b, c, a]))[3] == (0, 0, 0, 2)


def test_storage_hit_extends_a_device_prefix():
    # The device holds (1, 2); (3, 4) below it was pushed out to storage: the next request
    # hits 2 on the device and 2 in storage.
    sim = _sim(4, 4, None)
    out = run_checked(sim, _trace([(1, 2, 3, 4), (9, 8, 7, 6), (1, 2), (1, 2, 3, 4)]))
    assert out[2] == (0, 0, 2, 0)
    assert out[3] == (2, 0, 2, 0)


def test_storage_hits_on_a_generated_trace():
    trace = _mrq()
    need = max(len(r.blocks) for r in trace)
    for write_policy in ("write_through", "write_back"):
        res = _sim(need, need, None, "lru", write_policy).run(trace)
        assert res.storage > 0, write_policy


def test_bounded_storage_forgets_the_oldest():
    sim = _sim(2, 2, 2, "lru", "write_back")  # storage holds 2 blocks
    out = run_checked(sim, _trace([(1, 2), (3, 4), (5, 6), (7, 8), (1, 2)]))
    assert out[4] == (0, 0, 0, 2)
    assert sim.store.evictions > 0 and len(sim.store) == 2


def test_prefetch_counts_one_hit_on_the_matched_path():
    # The re-match after a storage prefetch is a second look at the same request: it must not
    # count a second hit on the prefix (hit counts drive LFU, S3-FIFO and selective writes).
    sim = _sim(4, 4, None)
    run_checked(sim, _trace([(1, 2, 3, 4), (9, 8, 7, 6), (1, 2), (1, 2, 3, 4)]))
    front = sim.tree.root.children[(1,)]
    assert front.key == (1, 2)
    # Matched by request 4 only (request 3 brought it back from storage: not a hit on it).
    assert front.hit_count == 1


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_hit_counts_never_exceed_the_requests_through_a_node(policy, write_policy):
    rng = random.Random(17)
    for storage in (None, 4):
        trace = random_trace(rng, 30, alphabet=2, max_len=6)
        sim = _sim(4, 4, storage, policy, write_policy)
        for k, req in enumerate(trace):
            sim.request(req.blocks)
            for n in walk(sim.tree.root):
                path = []
                m = n
                while m.parent is not None:
                    path[:0] = m.key
                    m = m.parent
                through = sum(r.blocks[: len(path)] == tuple(path) for r in trace[: k + 1])
                # the request that first cached a node does not hit it
                assert n.hit_count <= through - 1, (k, n, n.hit_count, through)


def test_write_through_writes_every_block_when_the_host_has_room():
    trace = _mrq(seed=1)
    for policy in POLICIES:
        sim = _sim(12, unique_blocks(trace), 0, policy, "write_through")
        for req in trace:
            sim.request(req.blocks)
            sim.manager.poll()
            assert all(n.on_host for n in walk(sim.tree.root) if n.on_device)
        assert sim.result.host > 0
        # write_back copies only on eviction: while nothing was evicted, nothing is on host
        sim = _sim(unique_blocks(trace), unique_blocks(trace), 0, policy, "write_back")
        sim.run(trace)
        sim.manager.poll()
        assert sim.manager.metrics.device.evicted_nodes == 0
        assert not any(n.on_host for n in walk(sim.tree.root))


def test_write_through_tiers_are_inclusive():
    # Minimal case: device = host = 4 blocks. (3, 4) needs room on the host; LRU there picks
    # (0,)'s host copy (last hit before (1, 2) was inserted) over the host-only (1, 2).
    sim = _sim(4, 4, 0)
    sim.run(_trace([(0,), (0, 1, 2), (3, 4)]))
    sim.manager.poll()
    missing = [n for n in walk(sim.tree.root) if n.on_device and not n.on_host]
    assert not missing, missing
    # And in general, for every policy, with the host at least as large as the device.
    rng = random.Random(5)
    for _ in range(10):
        trace = random_trace(rng, 25)
        for policy in POLICIES:
            for device, host in ((4, 4), (3, 6), (5, 5)):
                sim = _sim(device, host, 0, policy)
                for req in trace:
                    sim.request(req.blocks)
                    sim.manager.poll()
                    missing = [n for n in walk(sim.tree.root) if n.on_device and not n.on_host]
                    assert not missing, (policy, device, host, missing)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("storage", [0, 3, None])
def test_slot_pools_never_leak(write_policy, storage):
    rng = random.Random(11)
    for policy in POLICIES:
        for trace in (random_trace(rng, 30), _mrq(seed=3)):
            sim = _sim(6, 6, storage, policy, write_policy)
            run_checked(sim, trace)  # checks the pools after every request
            evict_everything(sim)
            # and the emptied cache still works: a repeated request that fits hits the device
            first = next(r for r in trace if len(r.blocks) <= 6)
            again = run_checked(sim, [first, first])[1]
            assert again == (len(first.blocks), 0, 0, 0)


def _shape(sim):
    return sorted(
        (n.key, n.on_device, n.on_host, n.in_storage, n.hit_count) for n in walk(sim.tree.root)
    )


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_results_are_deterministic(write_policy):
    trace = random_trace(random.Random(8), 40) + _mrq(seed=4)
    for policy in POLICIES:
        a, b = _sim(5, 4, 3, policy, write_policy), _sim(5, 4, 3, policy, write_policy)
        ra, rb = a.run(trace), b.run(trace)
        assert ra == rb
        assert _shape(a) == _shape(b)
        # The checked replay (which acknowledges copies after each request instead of before
        # the next one) gets the same result too.
        c = _sim(5, 4, 3, policy, write_policy)
        run_checked(c, trace)
        assert c.result == ra


# -- pieces and arguments ------------------------------------------------------------------------
def test_counting_slots():
    pool = CountingSlots(4)
    a = pool.alloc(3)
    assert sorted(a.tolist()) == [1, 2, 3] and a.dtype == torch.int64
    assert pool.alloc(2) is None and pool.available_size() == 1
    assert pool.alloc(0).numel() == 0
    pool.free(a[:2])
    b = pool.alloc(3)
    assert 0 not in b.tolist() and len(set(b.tolist()) | {a[2].item()}) == 4
    assert pool.available_size() == 0


def test_key_store_is_lru_under_its_capacity():
    store = KeyStore(3)
    assert store.add([b"a", b"b", b"c"]) == [True] * 3
    assert store.batch_exists([b"a", b"x", b"b"]) == 1  # stops at the first missing key
    assert store.add([b"d"]) == [True]  # b went (a was just used)
    assert store.batch_exists([b"b"]) == 0 and store.batch_exists([b"a", b"c", b"d"]) == 3
    assert store.evictions == 1
    assert store.add([b"e", b"f", b"g", b"h"]) == [False, True, True, True]
    assert len(store) == 3
    unbounded = KeyStore(None)
    unbounded.add([bytes([i]) for i in range(100)])
    assert len(unbounded) == 100 and unbounded.evictions == 0


def test_sim_result_rates():
    assert SimResult().hit_rate == 0.0 and SimResult().rate("device") == 0.0
    r = SimResult(requests=2, blocks=10, device=3, host=2, storage=1, missed=4)
    assert r.hit_rate == pytest.approx(0.6)
    assert [r.rate(t) for t in ("device", "host", "storage", "missed")] == [0.3, 0.2, 0.1, 0.4]


def test_storage_needs_a_host_tier():
    sim = _sim(2, 0, None)
    assert sim.store is None and sim.transfer is None and sim.manager.store is None
    assert _sim(2, 2, 0).store is None and _sim(2, 2, 0).manager.store is None
    assert _sim(2, 2, None).manager.store is not None


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 4), {}, "device_blocks"),
        ((4, -1), {}, "host_blocks"),
        ((4, 4), {"device_policy": "mru"}, "mru"),
        ((4, 4), {"host_policy": "clock"}, "clock"),
        ((4, 4), {"write_policy": "write_around"}, "write_policy"),
    ],
)
def test_bad_arguments_raise(args, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SimCache(*args, **kwargs)


# -- the CLI sweep -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host_ratio, storage, write_policy",
    [(1.0, 0.0, "write_through"), (2.0, 0.25, "write_back"), (0.0, 0.0, "write_through")],
)
def test_sweep_smoke(host_ratio, storage, write_policy):
    trace = _mrq(seed=6)
    capacities = [0.1, 0.5, 1.0, 30]
    out = sweep(trace, capacities, list(POLICIES), host_ratio, storage, write_policy, False)
    unique = unique_blocks(trace)
    assert out["unique_blocks"] == unique
    assert out["accesses"] == len(access_sequence(trace)) and out["requests"] == len(trace)
    rows = out["rows"]
    assert [(r["capacity"], r["policy"]) for r in rows] == [
        (c, p) for c in capacities for p in POLICIES
    ]
    expected_device = {0.1: round(0.1 * unique), 0.5: round(0.5 * unique), 1.0: unique, 30: 30}
    for r in rows:
        assert r["device_blocks"] == expected_device[r["capacity"]]
        assert r["host_blocks"] == min(int(r["device_blocks"] * host_ratio), unique)
        rates = ("device_rate", "host_rate", "storage_rate", "hit_rate", "effective_rate")
        for key in (*rates, "total_rate"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["hit_rate"] <= r["total_rate"] + 1e-12
        assert r["effective_rate"] <= r["total_rate"]
        assert r["effective_blocks"] <= r["total_blocks"]
        assert r["hit_rate"] == pytest.approx(r["device_rate"] + r["host_rate"] + r["storage_rate"])
        if not host_ratio:
            assert r["host_rate"] == 0.0 and r["storage_rate"] == 0.0
    # With the whole trace fitting on the device, every policy reaches the optimum.
    full = [r for r in rows if r["capacity"] == 1.0]
    assert all(r["hit_rate"] == pytest.approx(r["effective_rate"]) for r in full)
    assert all(r["of_optimum"] == pytest.approx(1.0) for r in full)
    assert full[0]["effective_rate"] > 0

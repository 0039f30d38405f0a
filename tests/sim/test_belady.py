"""Belady's MIN (with bypass) against a brute-force optimum over every cache decision."""

from __future__ import annotations

import itertools
import random
from functools import cache

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.traces import TraceRequest


def brute_force_hits(accesses, capacity):
    """The most hits any cache of ``capacity`` blocks can get: after each access, the cache
    may become any subset of (what it held) + (the accessed block) of at most ``capacity``
    blocks: evict anything, cache the new block or not. A recursive search over cache states."""
    accesses = tuple(accesses)

    @cache
    def best(i, state):
        if i == len(accesses):
            return 0
        b = accesses[i]
        hit = 1 if b in state else 0
        pool = sorted(state | {b})
        out = 0
        for k in range(min(capacity, len(pool)) + 1):
            for keep in itertools.combinations(pool, k):
                out = max(out, best(i + 1, frozenset(keep)))
        return hit + out

    return best(0, frozenset())


@pytest.mark.parametrize(
    "accesses, capacity, hits",
    [
        ([], 3, 0),
        ([1, 1, 1], 0, 0),
        ([1, 1, 1], 1, 2),
        ([1, 2, 1, 2], 1, 1),  # keep 1 (bypass 2), or keep 2 after it arrives: one hit either way
        ([1, 2, 3, 1, 2, 3], 2, 2),
        # The textbook sequence: MIN with 3 frames faults 7 times on 12 accesses, 5 hits
        # (1 1 2 2 3 after keeping {1, 2, 3}); bypassing 4 and 5 does not do better.
        ([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], 3, 5),
        ([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], 4, 6),
        # Bypass matters: with one slot, caching 2 would lose the hit on 1.
        ([1, 2, 1], 1, 1),
        ([1, 2, 3, 2, 1], 1, 1),
        ([1, 2, 3, 2, 1], 2, 2),
        ([5, 5, 6, 6, 5], 1, 2),
        # Every block used once: nothing to hit.
        ([1, 2, 3, 4], 2, 0),
    ],
)
def test_hand_checked(accesses, capacity, hits):
    assert belady_hits(accesses, capacity) == hits
    assert brute_force_hits(accesses, capacity) == hits


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(20240531)
    checked = 0
    for _ in range(700):
        n = rng.randint(0, 12)
        alphabet = rng.randint(1, 5)
        seq = [rng.randrange(alphabet) for _ in range(n)]
        for capacity in range(5):
            assert belady_hits(seq, capacity) == brute_force_hits(seq, capacity), (seq, capacity)
            checked += 1
    assert checked == 3500


def test_matches_brute_force_on_every_short_sequence():
    # Exhaustive over sequences of length 7 on 3 symbols (canonical relabelings only).
    for seq in itertools.product(range(3), repeat=7):
        if seq[0] != 0 or (2 in seq and 1 not in seq[: seq.index(2)]):
            continue
        for capacity in (1, 2):
            assert belady_hits(list(seq), capacity) == brute_force_hits(seq, capacity), seq


def test_large_capacity_hits_every_reuse():
    rng = random.Random(7)
    for _ in range(50):
        seq = [rng.randrange(20) for _ in range(rng.randint(0, 200))]
        distinct = len(set(seq))
        for capacity in (distinct, distinct + 1, 10_000):
            assert belady_hits(seq, capacity) == len(seq) - distinct
        if distinct > 1 and len(seq) > distinct:
            # one block fewer than needed never hits more, and the bound is monotone
            hits = [belady_hits(seq, c) for c in range(distinct + 1)]
            assert hits == sorted(hits)
            assert hits[0] == 0


def test_long_sequence_is_fast_and_bounded():
    rng = random.Random(1)
    seq = [rng.randrange(500) for _ in range(50_000)]
    hits = belady_hits(seq, 100)
    assert 0 < hits < len(seq) - len(set(seq))


@pytest.mark.parametrize("capacity", [-1, 1.0, 2.5, "3", None, True, False])
def test_bad_capacity_raises(capacity):
    with pytest.raises(InvalidArgumentError, match=r"^capacity="):
        belady_hits([1, 2, 1], capacity)


def test_access_sequence_concatenates_requests():
    trace = [TraceRequest((1, 2, 3)), TraceRequest(()), TraceRequest((1, 2, 4))]
    assert access_sequence(trace) == [1, 2, 3, 1, 2, 4]
    assert access_sequence([]) == []

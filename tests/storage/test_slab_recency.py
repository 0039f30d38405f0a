"""The slab index's recency refresh with the records a read found (``SlabBooks.refresh(...,
known)``): a record still as read is bumped without being parsed again; one changed since the
read (rewritten to another slot, deleted, damaged) is bumped as it is now, or left alone, and
never replaced by the record the read saw."""

from __future__ import annotations

import random

import lmdb
import pytest

from tiered_kv.storage import value_format
from tiered_kv.storage.slab_books import SlabBooks, _lru_key, unpack_value

FP = bytes(range(16))


def _key(i: int) -> bytes:
    return FP + i.to_bytes(16, "little")


def _header(key: bytes, tick: int, csum: int) -> bytes:
    return value_format.pack(FP, b"x" * 100, tick, csum, key=key)


@pytest.fixture
def books(tmp_path):
    env = lmdb.open(str(tmp_path / "idx"), max_dbs=4, map_size=1 << 24)
    try:
        yield env, SlabBooks.open(env)
    finally:
        env.close()


def _fill(env, books: SlabBooks, n: int, rng: random.Random) -> dict[bytes, int]:
    """``n`` pages at random slots; returns their checksums."""
    sums = {}
    with env.begin(write=True) as txn:
        for i in range(n):
            key, csum = _key(i), rng.getrandbits(64)
            books.insert(txn, key, lambda tick, key=key, csum=csum: _header(key, tick, csum), i * 7)
            sums[key] = csum
    return sums


def _read(env, books: SlabBooks, keys):
    with env.begin() as txn:
        return {k: books.lookup(txn, k) for k in keys}


def _lru(env, books: SlabBooks) -> list[bytes]:
    with env.begin() as txn:
        return [bytes(k)[8:] for k in txn.cursor(db=books.lru).iternext(values=False)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_records_as_read_are_bumped_newest_in_read_order(books, seed):
    env, b = books
    rng = random.Random(seed)
    n = rng.randint(20, 60)
    _fill(env, b, n, rng)
    oldest = [_key(i) for i in range(n // 2)]  # outside the newest quarter: each one is bumped
    read = rng.sample(oldest, rng.randint(1, len(oldest)))
    known = _read(env, b, read)
    with env.begin(write=True) as txn:
        b.refresh(txn, read, known)
    assert _lru(env, b)[-len(read) :] == read
    now = _read(env, b, read)
    for key in read:  # same slot, same checksum, a newer tick
        assert now[key].slot == known[key].slot
        assert now[key].header.checksum == known[key].header.checksum
        assert now[key].header.tick > known[key].header.tick


@pytest.mark.parametrize("change", ["rewritten", "deleted", "damaged"])
def test_a_record_changed_after_the_read_is_never_replaced_by_the_one_read(books, change):
    env, b = books
    rng = random.Random(7)
    _fill(env, b, 40, rng)
    key, other = _key(3), _key(4)
    known = _read(env, b, [key, other])
    with env.begin(write=True) as txn:
        if change == "rewritten":  # another slot and checksum, as a set after a delete writes
            b.remove(txn, key)
            b.insert(txn, key, lambda tick: _header(key, tick, 12345), 999)
        elif change == "deleted":
            b.remove(txn, key)
        else:
            raw = bytearray(txn.get(key, db=b.headers))
            raw[30] ^= 0x5A
            txn.put(key, bytes(raw), db=b.headers)
    before = _read(env, b, [key])[key]
    with env.begin(write=True) as txn:
        b.refresh(txn, [key, other], known)
    after = _read(env, b, [key])[key]
    if change == "rewritten":
        assert (after.slot, after.header.checksum) == (999, 12345)
        assert after.header.tick == before.header.tick  # just written: among the newest quarter
    elif change == "deleted":
        assert after is None
    else:
        assert after.raw == before.raw and after.header is None  # still damaged: a miss
    assert _read(env, b, [other])[other].header.tick > known[other].header.tick
    with env.begin() as txn:  # one LRU record per readable page, at its own tick
        lru = {bytes(k) for k in txn.cursor(db=b.lru).iternext(values=False)}
        for k, e in ((k, unpack_value(k, v)) for k, v in txn.cursor(db=b.headers)):
            if e.header is not None:
                assert _lru_key(e.header.tick, bytes(k)) in lru

"""Issue 27: a store that answers one key with another key's intact value (a misfiled,
swapped or replayed record: its header, checksum and namespace all sound) is a miss, never
served: every stored value names the key it was written under (value format 2)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiered_kv.storage.memory_store import MemoryStorage

from ._util import (
    LAYOUTS,
    ByteSource,
    byte_namespace,
    expected_bytes,
    fill_for_keys,
    open_layout,
    raw_key,
)

NBYTES = 3 * 4096 + 77  # irregular: a slab slot's tail and several LMDB overflow pages


def _stored(store, ns, n=4):
    src = ByteSource(NBYTES, 8)
    keys = [raw_key(ns, f"page-{os.urandom(4).hex()}-{i}") for i in range(n)]
    fill_for_keys(src, keys, list(range(n)))
    assert store.batch_set(keys, src, list(range(n))) == [True] * n
    return keys


def _swap_lmdb(store, a: bytes, b: bytes) -> None:
    """Key ``b`` now holds ``a``'s record: its header and page bytes, both intact."""

    def swap(txn):
        header, page = bytes(txn.get(a, db=store._headers)), bytes(txn.get(a, db=store._pages))
        txn.put(b, header, db=store._headers)
        txn.put(b, page, db=store._pages)

    store._write(swap, "test swap")


def _swap_slab(store, a: bytes, b: bytes) -> None:
    """Key ``b``'s index record now points at ``a``'s slot with ``a``'s header."""

    def swap(txn, pending=None):
        txn.put(b, bytes(txn.get(a, db=store._books.headers)), db=store._books.headers)

    store._write(swap, "test swap")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_another_keys_intact_record_is_a_miss_on_disk(tmp_path, layout):
    ns = byte_namespace(NBYTES)
    store = open_layout(layout, tmp_path / layout, ns, NBYTES, budget_bytes=64 << 20)
    try:
        keys = _stored(store, ns)
        (_swap_slab if layout == "slab" else _swap_lmdb)(store, keys[0], keys[2])
        dst = ByteSource(NBYTES, 8)
        assert store.batch_get(keys, dst, [4, 5, 6, 7]) == [True, True, False, True]
        for k, p in ((keys[0], 4), (keys[1], 5), (keys[3], 7)):
            assert np.array_equal(dst.buf[p].numpy(), expected_bytes(k, NBYTES))
        assert store.stats().checksum_failures == 1
    finally:
        store.close()


def test_another_keys_intact_record_is_a_miss_in_memory():
    ns = byte_namespace(NBYTES)
    store = MemoryStorage(ns, NBYTES)
    keys = _stored(store, ns)
    store._pages[keys[1]] = store._pages[keys[3]]
    dst = ByteSource(NBYTES, 8)
    assert store.batch_get(keys, dst, [4, 5, 6, 7]) == [True, False, True, True]
    assert np.array_equal(dst.buf[7].numpy(), expected_bytes(keys[3], NBYTES))

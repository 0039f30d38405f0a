"""LMDB's own errors inside a store call (a corrupted map, a page not found, a map full at the
budget) are counted misses, never exceptions in the serving path; and random flipped bytes in
``data.mdb`` (payloads, headers, page and node headers) never give wrong bytes or a crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from tests.storage._util import ByteSource
from tiered_kv.storage import LMDBStorage, StorageNamespace, page_keys

ROOT = Path(__file__).resolve().parents[2]
NS = StorageNamespace.create(
    model="test-model",
    kind="mha",
    parts=[("k", (2, 8))],
    dtype="float32",
    layer_ids=[0],
    page_size=4,
    layout="page_first",
)
P = 4096 + 512


@pytest.fixture
def filled(tmp_path, gen):
    src = ByteSource(P, 12)
    src.buf.copy_(torch.randint(1, 255, src.buf.shape, generator=gen, dtype=torch.uint8))
    keys = page_keys(NS, list(range(12 * 4)), 4)
    store = LMDBStorage(tmp_path / "s", NS, P, budget_bytes=64 << 20)
    assert all(store.batch_set(keys, src, list(range(12))))
    yield store, src, keys
    store.close()


@pytest.mark.parametrize("error", [lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.MapFullError])
@pytest.mark.parametrize("where", ["_read", "_write"])
def test_lmdb_errors_are_counted_misses(filled, monkeypatch, error, where):
    store, src, keys = filled

    def broken(*args, **kwargs):
        raise error("injected")

    monkeypatch.setattr(store, where, broken)
    before = sum(store._stats.errors.values())
    dst = ByteSource(P, 12)
    calls = [
        lambda: store.batch_exists(keys) in (0, 12),
        lambda: store.batch_get(keys, dst, list(range(12))) in ([False] * 12, [True] * 12),
        lambda: store.batch_set(keys[:3], src, [0, 1, 2]) in ([False] * 3, [True] * 3),
        lambda: store.delete(keys[:2]) in (0, 2),
        lambda: store.clear() is None,
        lambda: store.flush() is None,
        lambda: store.stats() is not None,
    ]
    for call in calls:
        assert call()  # no exception: a miss (or, where the call did not need it, a hit)
    assert sum(store._stats.errors.values()) > before
    got = store.batch_get(keys, dst, list(range(12)))
    for i, ok in enumerate(got):
        assert not ok or torch.equal(dst.buf[i], src.buf[i]), f"page {i} served wrong bytes"


FLIP = """
import os, random, sys, torch
sys.path.insert(0, {root!r})
from tests.storage._util import ByteSource
from tiered_kv.storage import LMDBStorage, StorageNamespace, page_keys
from tiered_kv.errors import StorageOpenError
seed, flips, mode, d = {seed}, {flips}, {mode!r}, {path!r}
rng = random.Random(seed)
ns = StorageNamespace.create(model="test-model", kind="mha", parts=[("k", (2, 8))],
                             dtype="float32", layer_ids=[0], page_size=4, layout="page_first")
P = 4096 + 512 * rng.randint(0, 8)
src = ByteSource(P, 40)
src.buf.copy_(torch.randint(1, 255, src.buf.shape, generator=torch.Generator().manual_seed(seed),
                            dtype=torch.uint8))
keys = page_keys(ns, list(range(40 * 4)), 4)
store = LMDBStorage(d, ns, P, budget_bytes=64 << 20)
assert all(store.batch_set(keys, src, list(range(40))))
store.close()
path = os.path.join(d, "data.mdb")
used = min(os.path.getsize(path), 40 * (P + 4096) + 64 * 4096)
with open(path, "r+b") as f:
    for _ in range(flips):
        if mode == "any":
            off = rng.randrange(0, used)
        elif mode == "meta":
            off = rng.randrange(0, 2 * 4096)
        else:
            off = rng.randrange(0, used // 4096) * 4096 + rng.randrange(0, 1024)
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
try:
    store = LMDBStorage(d, ns, P, budget_bytes=64 << 20)
except StorageOpenError:
    print("refused"); sys.exit(0)
dst = ByteSource(P, 40)
store.batch_exists(keys)
ok = store.batch_get(keys, dst, list(range(40)))
wrong = [i for i, o in enumerate(ok) if o and not torch.equal(dst.buf[i], src.buf[i])]
store.batch_set(keys[:10], src, list(range(10)))
store.delete(keys[10:12]); store.stats(); store.clear(); store.close()
print("wrong", wrong)
sys.exit(1 if wrong else 0)
"""


@pytest.mark.parametrize("mode, flips", [("any", 8), ("meta", 4), ("pages", 24)])
@pytest.mark.parametrize("seed", [1, 2])
def test_flipped_bytes_in_the_map_never_serve_wrong_bytes(tmp_path, gen, mode, flips, seed):
    seed = seed * 1000 + int(torch.randint(0, 1000, (1,), generator=gen))
    code = FLIP.format(root=str(ROOT), seed=seed, flips=flips, mode=mode, path=str(tmp_path / "s"))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"seed {seed}: rc {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Error" not in proc.stderr, proc.stderr[-2000:]


def test_a_flipped_bit_in_the_byte_count_does_not_skip_writes_for_ever(filled):
    """The bytes-in-use counter is a plain value in the ``meta`` database: one flipped bit made
    it larger than the budget, so eviction emptied the store and every later write was skipped
    (clear did not help). With nothing left to evict the count is known to be 0."""
    store, src, keys = filled
    with store._env.begin(write=True) as txn:
        used = int.from_bytes(bytes(txn.get(b"used", db=store._books.meta)), "little")
        txn.put(b"used", (used | 1 << 40).to_bytes(8, "little"), db=store._books.meta)
    more = page_keys(NS, list(range(1000, 1000 + 12 * 4)), 4)
    assert all(store.batch_set(more, src, list(range(12))))  # the old pages were evicted
    assert store.stats().bytes < 1 << 30
    assert all(store.batch_set(keys, src, list(range(12))))
    assert store.batch_exists(more + keys) == 24

"""Opening a sound store is never refused: the structure check a store runs before it trusts an
LMDB environment passes after random sets, deletes, clears and evictions at the budget (pages
inline in leaves, just over the inline size, on overflow pages) with two namespaces on one
directory, and while another process commits as fast as it can or has grown the map. The flips
the check catches are in ``test_lmdb_structure_flips.py``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch

from tests.storage._util import ByteSource, byte_namespace, fill_for_keys, min_lmdb_budget, raw_key
from tiered_kv.errors import StorageOpenError
from tiered_kv.storage import LMDBStorage, lmdb_check

ROOT = Path(__file__).resolve().parents[2]


# 1900 bytes sit in a leaf, 2000 just do not (LMDB puts a node over half a page on overflow pages)
@pytest.mark.parametrize("page_nbytes", [64, 1900, 2000, 4096 + 512, 3 * 4096])
def test_sound_stores_pass_the_check_after_random_work(tmp_path, gen, page_nbytes):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    path = tmp_path / "s"
    spaces = [byte_namespace(page_nbytes, tenant) for tenant in (None, "other")]
    budget = min_lmdb_budget(tmp_path, spaces[0], page_nbytes)
    src, dst = ByteSource(page_nbytes, 64), ByteSource(page_nbytes, 64)
    evictions = 0
    for round in range(5):
        # Opening runs the check: a refusal is a StorageOpenError here.
        stores = [LMDBStorage(path, ns, page_nbytes, budget_bytes=budget) for ns in spaces]
        if round == 2 and page_nbytes >= 4096:  # fill past the budget: eviction frees pages
            fresh = [raw_key(spaces[0], f"fill{i}") for i in range(budget // page_nbytes)]
            for lo in range(0, len(fresh), 64):
                batch = fresh[lo : lo + 64]
                stores[0].batch_set(batch, src, list(range(len(batch))))
        for _ in range(16):
            store = rng.choice(stores)
            tags = {f"k{rng.randrange(3000)}" for _ in range(rng.randint(1, 64))}
            keys = [raw_key(store.namespace, tag) for tag in sorted(tags)]
            pages = list(range(len(keys)))
            fill_for_keys(src, keys, pages)
            op = rng.random()
            if op < 0.6:
                store.batch_set(keys, src, pages)
            elif op < 0.85:
                store.delete(keys)
            elif op < 0.9:
                store.clear()
            else:
                got = store.batch_get(keys, dst, pages)
                assert all(
                    not ok or torch.equal(dst.buf[i], src.buf[i]) for i, ok in enumerate(got)
                )
        assert lmdb_check.check_snapshot(stores[0]._env, path / "data.mdb") is None
        evictions += sum(s.stats().evictions for s in stores)
        for store in stores:
            store.close()
    assert lmdb_check.check_file(path / "data.mdb") is None
    assert evictions > 0 or page_nbytes < 4096  # the big pages reached the budget


WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from tests.storage._util import ByteSource, byte_namespace, fill_for_keys, raw_key
from tiered_kv.storage import LMDBStorage
ns = byte_namespace(256)
store = LMDBStorage({path!r}, ns, 256, budget_bytes=48 << 20)
src = ByteSource(256, 32)
print("open", flush=True)
n = 0
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    keys = [raw_key(ns, f"w{{(n * 32 + i) % 20000}}") for i in range(32)]
    fill_for_keys(src, keys, range(32))
    store.batch_set(keys, src, list(range(32)))
    store.delete(keys[::3])
    n += 1
store.close()
print(n)
"""


def test_opening_beside_a_busy_writer_is_never_refused(tmp_path):
    """Each open checks the newest snapshot under a read transaction while the writer commits
    (and reuses freed pages) as fast as it can: the check sees one consistent snapshot."""
    path = tmp_path / "s"
    code = WRITER.format(root=str(ROOT), path=str(path), seconds=4)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert writer.stdout.readline().strip() == "open"
        opens, deadline = 0, time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                LMDBStorage(path, byte_namespace(256), 256, budget_bytes=48 << 20).close()
            except StorageOpenError as exc:
                pytest.fail(f"a sound store was refused beside a writer: {exc}")
            opens += 1
        commits = int(writer.communicate(timeout=60)[0].strip())
    finally:
        writer.kill()
    assert opens >= 5 and commits >= 20, (opens, commits)


GROWER = """
import sys
sys.path.insert(0, {root!r})
from tests.storage._util import ByteSource, byte_namespace, raw_key
from tiered_kv.storage import LMDBStorage
ns = byte_namespace(4608)
store = LMDBStorage({path!r}, ns, 4608, budget_bytes=256 << 20)
src = ByteSource(4608, 100)
for lo in range(0, 8000, 100):
    store.batch_set([raw_key(ns, f"g{{i}}") for i in range(lo, lo + 100)], src, list(range(100)))
print(store._env.info()["map_size"])
store.close()
"""


def test_a_store_opened_after_another_process_grew_the_map_adopts_it(tmp_path):
    """A second store on a directory this process has open shares its environment; if another
    process grew the map meanwhile, opening the store's databases met MDB_MAP_RESIZED and the
    sound store was refused (StorageOpenError). It adopts the new size instead."""
    path = tmp_path / "s"
    first = LMDBStorage(path, byte_namespace(4608), 4608, budget_bytes=256 << 20)
    size = first._env.info()["map_size"]
    code = GROWER.format(root=str(ROOT), path=str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    grown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert grown.returncode == 0 and int(grown.stdout) > size, grown.stderr[-2000:]
    second = LMDBStorage(path, byte_namespace(4608, "other"), 4608, budget_bytes=256 << 20)
    assert (
        first.stats().pages == 8000 and second.batch_exists([raw_key(second.namespace, "x")]) == 0
    )
    second.close()
    first.close()


def test_a_value_overwritten_in_place_keeps_its_longer_overflow_run(tmp_path):
    """LMDB overwrites a value dirty in the same transaction on the overflow pages it has when
    they are enough (its own free list does this): the run and the database's count stay at
    three pages for a value that needs two. Sound, so not refused."""
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=32 << 20)
    db = env.open_db(b"x")
    with env.begin(write=True) as txn:
        txn.put(b"k", b"a" * 12000, db=db)
        txn.put(b"k", b"b" * 5000, db=db)
    with env.begin() as txn:
        assert txn.stat(db)["overflow_pages"] == 3
    assert lmdb_check.check_snapshot(env, tmp_path / "data.mdb") is None
    env.close()


def test_a_missing_or_empty_data_file_is_left_to_lmdb(tmp_path):
    assert lmdb_check.check_file(tmp_path / "data.mdb") is None
    (tmp_path / "data.mdb").write_bytes(b"")
    assert lmdb_check.check_file(tmp_path / "data.mdb") is None


def test_a_truncated_data_file_is_refused_naming_the_pages(tmp_path, gen):
    path = tmp_path / "s"
    ns = byte_namespace(4096)
    src = ByteSource(4096, 64)
    src.buf.copy_(torch.randint(0, 256, src.buf.shape, generator=gen, dtype=torch.uint8))
    store = LMDBStorage(path, ns, 4096, budget_bytes=64 << 20)
    store.batch_set([raw_key(ns, f"k{i}") for i in range(64)], src, list(range(64)))
    store.close()
    os.truncate(path / "data.mdb", 16 * 4096)
    with pytest.raises(
        StorageOpenError, match=r"corrupt \(meta page \d says pages 0\.\.\d+ are in"
    ):
        LMDBStorage(path, ns, 4096, budget_bytes=64 << 20)
    assert (path / "data.mdb").stat().st_size == 16 * 4096  # nothing reserved, nothing written


CREATOR = """
import os, sys, time, lmdb
env = lmdb.open({path!r}, map_size=1 << 30, max_dbs=4, writemap=False, sync=False, metasync=False)
print("open", flush=True)
db, value, n = env.open_db(b"x"), os.urandom(3000), 0
deadline = time.monotonic() + {seconds}
while n < 20000 and time.monotonic() < deadline:  # each commit grows the file by a page
    with env.begin(write=True) as txn:
        txn.put(n.to_bytes(8, "big"), value, db=db)
    n += 1
print(n)
"""


def test_the_file_check_beside_a_process_growing_a_new_store_is_never_refused(tmp_path):
    """Two servers opening one new store at once: one commits its first transactions (each
    growing the file) while the other checks the file before opening. The check read the size
    and then the meta page, so a commit between them made a sound store look truncated ("meta
    page 1 says pages 0..6 are in use; the file has 5") and the second server refused it."""
    path = tmp_path / "s"
    path.mkdir()
    code = CREATOR.format(path=str(path), seconds=3)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        checks, problems = 0, []
        while writer.poll() is None and checks < 200_000:
            problem = lmdb_check.check_file(path / "data.mdb")
            checks += 1
            if problem:
                problems.append(problem)
        commits = int(writer.communicate(timeout=60)[0].strip())
    finally:
        writer.kill()
    assert not problems, (len(problems), checks, problems[:3])
    assert checks >= 200 and commits >= 200, (checks, commits)

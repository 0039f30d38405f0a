"""LMDBStorage specifics: restart, corruption, budget, open errors, several processes, SIGKILL,
fork. The tests that need only the contract (restart, open errors, two namespaces, fork, a
removed directory, page sources) run on both layouts of the disk tier (``layout``); the slab
layout's own tests are in ``test_slab_store``."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import stat
import time

import lmdb
import numpy as np
import pytest
import torch

from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.storage import (
    LMDBStorage,
    SlabStorage,
    StorageNamespace,
    StorageOpenError,
    page_keys,
)

from ._util import (
    LAYOUTS,
    ByteSource,
    P,
    byte_namespace,
    expected_bytes,
    fill_for_keys,
    make_host,
    min_lmdb_budget,
    open_layout,
    raw_key,
)

BUDGET = 64 << 20


@pytest.fixture(params=LAYOUTS)
def layout(request) -> str:
    return request.param


@pytest.fixture
def host(gen):
    return make_host(gen, host_pages=16)


@pytest.fixture
def ns(host):
    return StorageNamespace.for_host_pool(host, model="test-model")


def _keys(ns, n, seed=0):
    toks = np.random.default_rng(seed).integers(0, 2**32, size=n * P, dtype=np.uint64)
    return page_keys(ns, toks.tolist(), P)


def test_restart_serves_everything(tmp_path, host, ns, layout):
    keys = _keys(ns, 8)
    store = open_layout(layout, tmp_path / "s", ns, host.page_nbytes, budget_bytes=BUDGET)
    assert store.batch_set(keys, host, list(range(8))) == [True] * 8
    before = host.buffer.clone()
    store.close()
    again = open_layout(layout, tmp_path / "s", ns, host.page_nbytes, budget_bytes=BUDGET)
    try:
        assert again.batch_exists(keys) == 8
        assert again.stats().pages == 8
        assert again.batch_get(keys, host, list(range(8, 16))) == [True] * 8
        for i in range(8):
            assert torch.equal(
                host.get_page_bytes(8 + i),
                before[i * P : (i + 1) * P].reshape(-1).view(torch.uint8),
            )
        # Recency and accounting survived too: more writes work.
        assert again.batch_set(_keys(ns, 4, seed=1), host, [0, 1, 2, 3]) == [True] * 4
    finally:
        again.close()


def _flip(path, db: bytes, key: bytes, offset: int) -> None:
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        handle = env.open_db(db)
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=handle))
            value[offset] ^= 0x5A
            txn.put(key, bytes(value), db=handle)
    finally:
        env.close()


@pytest.mark.parametrize(
    "db,offset",
    [(b"pages", 0), (b"pages", -1), (b"headers", 0), (b"headers", 30), (b"headers", 44)],
    ids=["page-first-byte", "page-last-byte", "header-magic", "header-checksum", "header-tick"],
)
def test_corrupt_value_is_a_miss_and_deleted(tmp_path, host, ns, db, offset):
    keys = _keys(ns, 5)
    path = tmp_path / "s"
    store = LMDBStorage(path, ns, host.page_nbytes, budget_bytes=BUDGET)
    assert store.batch_set(keys, host, list(range(5))) == [True] * 5
    store.close()
    _flip(path, db, keys[2], offset)
    store = LMDBStorage(path, ns, host.page_nbytes, budget_bytes=BUDGET)
    try:
        untouched = host.get_page_bytes(12).clone()
        got = store.batch_get(keys, host, [10, 11, 12, 13, 14])
        assert got == [True, True, False, True, True]
        s = store.stats()
        assert s.checksum_failures == 1
        assert s.misses == 1 and s.hits == 4
        assert store.batch_exists(keys) == 2  # the corrupt page was deleted
        assert store.batch_exists(keys[3:]) == 2
        assert s.pages == 4 or store.stats().pages == 4
        for src, dst in ((0, 10), (1, 11), (3, 13), (4, 14)):
            assert torch.equal(host.get_page_bytes(dst), host.get_page_bytes(src))
        if db == b"headers" and offset == 0:
            assert torch.equal(host.get_page_bytes(12), untouched)
        # The key can be written again and is then served.
        assert store.batch_set(keys[2:3], host, [2]) == [True]
        assert store.batch_get(keys[2:3], host, [12]) == [True]
        assert torch.equal(host.get_page_bytes(12), host.get_page_bytes(2))
        assert store.stats().checksum_failures == 1
    finally:
        store.close()


@pytest.mark.parametrize("nbytes", [768, 3072, 16 * 4096 - 16])
def test_budget_is_kept_and_newest_pages_stay(tmp_path, nbytes):
    ns = byte_namespace(nbytes)
    minimum = min_lmdb_budget(tmp_path, ns, nbytes)
    budget = minimum + 4 * (nbytes + 300)
    store = LMDBStorage(tmp_path / "s", ns, nbytes, budget_bytes=budget)
    src = ByteSource(nbytes, 64)
    total = 3 * budget // nbytes + 64  # far more pages than fit
    batch, written = 32, 0
    results = []
    try:
        while written < total:
            keys = [raw_key(ns, f"p{j}") for j in range(written, written + batch)]
            fill_for_keys(src, keys, range(batch))
            results.append(store.batch_set(keys, src, list(range(batch))))  # never raises
            written += batch
            s = store.stats()
            assert s.bytes <= budget
            assert store.disk_bytes() <= budget
        s = store.stats()
        assert s.evictions > 0
        assert s.bytes <= budget and store.disk_bytes() <= budget
        assert results[-1] == [True] * batch, (
            f"newest batch not stored: {results[-1].count(False)} skipped; stats {s}"
        )
        newest = [raw_key(ns, f"p{j}") for j in range(written - batch, written)]
        assert store.batch_exists(newest) == batch
        out = ByteSource(nbytes, batch)
        assert store.batch_get(newest, out, list(range(batch))) == [True] * batch
        for i, k in enumerate(newest):
            assert np.array_equal(out.buf[i].numpy(), expected_bytes(k, nbytes))
    finally:
        store.close()


def test_budget_checks(tmp_path, ns, host):
    minimum = min_lmdb_budget(tmp_path, ns, host.page_nbytes)
    for bad in (minimum - 1, 0, -5):
        with pytest.raises(InvalidArgumentError):
            LMDBStorage(tmp_path / "a", ns, host.page_nbytes, budget_bytes=bad)
    for bad in (float(minimum * 2), True, None):
        with pytest.raises(InvalidArgumentError):
            LMDBStorage(tmp_path / "a", ns, host.page_nbytes, budget_bytes=bad)
    LMDBStorage(tmp_path / "ok", ns, host.page_nbytes, budget_bytes=minimum).close()


def test_bad_io_threads_is_refused_before_opening(tmp_path, ns, host, layout):
    with pytest.raises(InvalidArgumentError, match="io_threads=0"):
        open_layout(layout, tmp_path / "s", ns, host.page_nbytes, budget_bytes=BUDGET, io_threads=0)
    assert not (tmp_path / "s").exists()


def test_path_that_is_a_file_raises_open_error(tmp_path, ns, host, layout):
    f = tmp_path / "plain-file"
    f.write_bytes(b"not a directory")
    for path in (f, f / "below"):
        with pytest.raises(StorageOpenError, match=str(f)) as info:
            open_layout(layout, path, ns, host.page_nbytes, budget_bytes=BUDGET)
        assert isinstance(info.value, TieredKVError)


def test_read_only_directory_raises_open_error(tmp_path, ns, host, layout):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0o500 directory is still writable")
        for path in (ro / "store", ro):
            with pytest.raises(StorageOpenError, match=str(ro)):
                open_layout(layout, path, ns, host.page_nbytes, budget_bytes=BUDGET)
    finally:
        ro.chmod(0o700)


MIX_NBYTES = 3 * 4096 + 40


def _open_lmdb_over(path: str, result_path: str) -> None:
    """In a fresh process: open LMDBStorage on ``path`` and write a page there if it opens;
    what happened goes to ``result_path``."""
    ns = byte_namespace(MIX_NBYTES)
    try:
        store = LMDBStorage(path, ns, MIX_NBYTES, budget_bytes=BUDGET)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = f"{type(exc).__name__}: {exc}"
    else:
        src = ByteSource(MIX_NBYTES, 1)
        fill_for_keys(src, [raw_key(ns, "lmdb")], [0])
        result = f"opened, wrote {store.batch_set([raw_key(ns, 'lmdb')], src, [0])}"
        store.close()
    with open(result_path, "w") as f:
        f.write(result)


@pytest.mark.parametrize("where", ["new_process", "slab_closed", "slab_open"])
def test_a_slab_directory_is_refused_before_anything_is_written(tmp_path, where):
    """Issue 38: LMDBStorage over a slab-layout store refuses it (as SlabStorage refuses an
    lmdb-layout one) before writing there: the slab store's pages stay readable, exactly."""
    path, ns = tmp_path / "s", byte_namespace(MIX_NBYTES)
    keys = [raw_key(ns, f"k{i}") for i in range(6)]
    src = ByteSource(MIX_NBYTES, 6)
    fill_for_keys(src, keys, range(6))
    slab = SlabStorage(path, ns, MIX_NBYTES, budget_bytes=BUDGET)
    assert slab.batch_set(keys, src, list(range(6))) == [True] * 6
    if where != "slab_open":
        slab.close()
    files = {f.name: f.stat().st_size for f in path.rglob("*") if f.is_file()}
    try:
        if where == "new_process":
            child = mp.get_context("spawn").Process(
                target=_open_lmdb_over, args=(str(path), str(tmp_path / "result"))
            )
            child.start()
            child.join(60)
            assert child.exitcode == 0
            text = (tmp_path / "result").read_text()
            assert text.startswith("StorageOpenError: "), text
        else:
            with pytest.raises(StorageOpenError) as info:
                LMDBStorage(path, ns, MIX_NBYTES, budget_bytes=BUDGET)
            text = str(info.value)
        assert str(path) in text and "slab layout" in text and "storage_layout='slab'" in text
        assert {f.name: f.stat().st_size for f in path.rglob("*") if f.is_file()} == files
    finally:
        if where == "slab_open":
            slab.close()
    out = ByteSource(MIX_NBYTES, 6)
    out.buf.random_(0, 256)  # fresh bytes where the pages come back
    again = SlabStorage(path, ns, MIX_NBYTES, budget_bytes=BUDGET)
    try:
        assert again.batch_get(keys, out, list(range(6))) == [True] * 6
        assert torch.equal(out.buf, src.buf)
    finally:
        again.close()


def test_two_namespaces_open_at_once_in_one_process(tmp_path, host, ns, layout):
    """Stores of two namespaces share one directory (eviction and clear are per namespace)."""
    other_ns = StorageNamespace.for_host_pool(host, tenant="other", model="test-model")
    a = open_layout(layout, tmp_path / "s", ns, host.page_nbytes, budget_bytes=BUDGET)
    try:
        b = open_layout(layout, tmp_path / "s", other_ns, host.page_nbytes, budget_bytes=BUDGET)
    except StorageOpenError as exc:
        a.close()
        pytest.fail(f"a second namespace on the same directory cannot be opened: {exc}")
    try:
        ka, kb = _keys(ns, 3), _keys(other_ns, 3)
        assert a.batch_set(ka, host, [0, 1, 2]) == [True] * 3
        assert b.batch_set(kb, host, [3, 4, 5]) == [True] * 3
        a.clear()
        assert a.batch_exists(ka) == 0
        assert b.batch_exists(kb) == 3
    finally:
        a.close()
        b.close()


# -- several processes ------------------------------------------------------------------------
MP_NBYTES = 16 * 4096 - 16
MP_PAGES = 300  # per writer; both writers together outgrow the initial 32 MiB map


def _mp_keys(ns, writer: int, n: int = MP_PAGES):
    return [raw_key(ns, f"writer{writer}-{i}") for i in range(n)]


def _mp_worker(path: str, writer: int, result_path: str) -> None:
    ns = byte_namespace(MP_NBYTES)
    store = LMDBStorage(path, ns, MP_NBYTES, budget_bytes=256 << 20)
    mine, theirs = _mp_keys(ns, writer), _mp_keys(ns, 1 - writer)
    src, out = ByteSource(MP_NBYTES, 8), ByteSource(MP_NBYTES, 8)
    seen, checked = 0, 0
    for start in range(0, MP_PAGES, 8):
        keys = mine[start : start + 8]
        fill_for_keys(src, keys, range(len(keys)))
        assert store.batch_set(keys, src, list(range(len(keys)))) == [True] * len(keys)
        # Read the other writer's pages that have appeared (it writes them in order).
        seen = store.batch_exists(theirs)
        for k in theirs[checked : min(seen, checked + 8)]:
            assert store.batch_get([k], out, [0]) == [True]
            assert np.array_equal(out.buf[0].numpy(), expected_bytes(k, MP_NBYTES))
            checked += 1
    store.close()
    with open(result_path, "w") as f:
        f.write(f"{seen} {checked}")


def test_two_processes_write_and_read_at_once(tmp_path):
    ctx = mp.get_context("spawn")
    path = tmp_path / "s"
    procs = [
        ctx.Process(target=_mp_worker, args=(str(path), w, str(tmp_path / f"r{w}"))) for w in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    ns = byte_namespace(MP_NBYTES)
    store = LMDBStorage(path, ns, MP_NBYTES, budget_bytes=256 << 20)
    try:
        out = ByteSource(MP_NBYTES, 1)
        for w in (0, 1):
            keys = _mp_keys(ns, w)
            assert store.batch_exists(keys) == MP_PAGES
            for k in keys:
                assert store.batch_get([k], out, [0]) == [True]
                assert np.array_equal(out.buf[0].numpy(), expected_bytes(k, MP_NBYTES))
        assert store.stats().evictions == 0
    finally:
        store.close()


# -- SIGKILL ----------------------------------------------------------------------------------
KILL_NBYTES = 4096 * 2 - 16
KILL_BUDGET = 24 << 20
KILL_MAX = 6000  # pages one writer may write before it stops on its own


def _kill_keys(ns, run: int):
    return [raw_key(ns, f"run{run}-{i}") for i in range(KILL_MAX)]


def _kill_writer(path: str, run: int, ready) -> None:
    ns = byte_namespace(KILL_NBYTES)
    store = LMDBStorage(path, ns, KILL_NBYTES, budget_bytes=KILL_BUDGET)
    keys = _kill_keys(ns, run)
    src = ByteSource(KILL_NBYTES, 16)
    ready.set()
    for start in range(0, KILL_MAX, 16):
        batch = keys[start : start + 16]
        fill_for_keys(src, batch, range(len(batch)))
        store.batch_set(batch, src, list(range(len(batch))))
    time.sleep(60)  # wait to be killed


@pytest.mark.slow
def test_sigkill_during_writes_loses_no_integrity(tmp_path, gen):
    # forkserver: every writer is a fresh process forked from a server that has the imports.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    path = tmp_path / "s"
    ns = byte_namespace(KILL_NBYTES)
    survived, runs = 0, 20
    t0 = time.monotonic()
    out = ByteSource(KILL_NBYTES, 64)
    for run in range(runs):
        ready = ctx.Event()
        p = ctx.Process(target=_kill_writer, args=(str(path), run, ready))
        p.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        store = LMDBStorage(path, ns, KILL_NBYTES, budget_bytes=KILL_BUDGET)
        try:
            keys = _kill_keys(ns, run)
            present = [store.batch_exists([k]) == 1 for k in keys]
            for start in range(0, KILL_MAX, 64):
                chunk = keys[start : start + 64]
                got = store.batch_get(chunk, out, list(range(len(chunk))))
                assert got == present[start : start + 64], (run, start)
                for i, k in enumerate(chunk):
                    if got[i]:
                        assert np.array_equal(out.buf[i].numpy(), expected_bytes(k, KILL_NBYTES)), (
                            run,
                            start + i,
                        )
            s = store.stats()
            assert s.checksum_failures == 0
            assert s.bytes <= KILL_BUDGET and store.disk_bytes() <= KILL_BUDGET
            survived += sum(present)
        finally:
            store.close()
    assert survived > 0
    assert time.monotonic() - t0 < 120


# -- fork -------------------------------------------------------------------------------------
def _fork_child(store, nbytes: int) -> None:
    ns = store.namespace
    keys = [raw_key(ns, f"child-{i}") for i in range(6)]
    src = ByteSource(nbytes, 6)
    fill_for_keys(src, keys, range(6))
    assert store.batch_exists([raw_key(ns, "parent-0")]) == 1
    assert store.batch_set(keys, src, list(range(6))) == [True] * 6
    out = ByteSource(nbytes, 1)
    assert store.batch_get([raw_key(ns, "parent-0")], out, [0]) == [True]
    assert np.array_equal(out.buf[0].numpy(), expected_bytes(raw_key(ns, "parent-0"), nbytes))
    store.close()


def test_store_used_after_fork_reopens(tmp_path, layout):
    nbytes = 4096
    ns = byte_namespace(nbytes)
    store = open_layout(layout, tmp_path / "s", ns, nbytes, budget_bytes=BUDGET)
    try:
        pk = [raw_key(ns, f"parent-{i}") for i in range(3)]
        src = ByteSource(nbytes, 3)
        fill_for_keys(src, pk, range(3))
        assert store.batch_set(pk, src, [0, 1, 2]) == [True] * 3
        p = mp.get_context("fork").Process(target=_fork_child, args=(store, nbytes))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        keys = [raw_key(ns, f"child-{i}") for i in range(6)]
        assert store.batch_exists(keys) == 6
        out = ByteSource(nbytes, 6)
        assert store.batch_get(keys, out, list(range(6))) == [True] * 6
        for i, k in enumerate(keys):
            assert np.array_equal(out.buf[i].numpy(), expected_bytes(k, nbytes))
        assert store.batch_set([raw_key(ns, "after")], src, [0]) == [True]
        assert store.batch_exists(pk) == 3
    finally:
        store.close()


def _grow_writer(path: str) -> None:
    ns = byte_namespace(MP_NBYTES)
    store = LMDBStorage(path, ns, MP_NBYTES, budget_bytes=256 << 20)
    src = ByteSource(MP_NBYTES, 8)
    keys = _mp_keys(ns, 7, n=640)  # ~42 MB: the map grows past its initial 32 MiB
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        fill_for_keys(src, batch, range(8))
        assert store.batch_set(batch, src, list(range(8))) == [True] * 8
    assert store.stats().map_resizes > 0
    store.close()


def test_reads_after_another_process_grew_the_map(tmp_path):
    """A store open in this process keeps working (reads do not raise) after another process
    grew the LMDB map past this process's map size."""
    path = tmp_path / "s"
    ns = byte_namespace(MP_NBYTES)
    store = LMDBStorage(path, ns, MP_NBYTES, budget_bytes=256 << 20)
    try:
        mine = raw_key(ns, "mine")
        src = ByteSource(MP_NBYTES, 1)
        fill_for_keys(src, [mine], [0])
        assert store.batch_set([mine], src, [0]) == [True]
        p = mp.get_context("spawn").Process(target=_grow_writer, args=(str(path),))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        theirs = _mp_keys(ns, 7, n=640)
        assert store.batch_exists(theirs) == 640  # raised MapResizedError
        out = ByteSource(MP_NBYTES, 1)
        assert store.batch_get([theirs[-1]], out, [0]) == [True]
        assert np.array_equal(out.buf[0].numpy(), expected_bytes(theirs[-1], MP_NBYTES))
        assert store.stats().pages == 641
        assert store.batch_set([raw_key(ns, "after")], src, [0]) == [True]
    finally:
        store.close()


def test_removed_directory_is_counted_misses_and_a_new_store_starts_clean(
    tmp_path, host, ns, layout
):
    import shutil

    keys = _keys(ns, 3)
    path = tmp_path / "s"
    store = open_layout(layout, path, ns, host.page_nbytes, budget_bytes=BUDGET)
    try:
        assert store.batch_set(keys, host, [0, 1, 2]) == [True] * 3
        shutil.rmtree(path)
        # Reads would come from the deleted file and writes be lost: misses and skips, counted.
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys, host, [5, 6, 7]) == [False] * 3
        assert store.batch_set(keys[:1], host, [0]) == [False]
        errors = store.stats().errors
        assert errors.get("store directory removed or replaced", 0) == 3
        # A store opened on the recreated path gets its own, empty environment.
        fresh = open_layout(layout, path, ns, host.page_nbytes, budget_bytes=BUDGET)
        try:
            assert fresh.batch_exists(keys) == 0
            assert fresh.batch_set(keys[:2], host, [0, 1]) == [True, True]
            assert fresh.batch_get(keys[:2], host, [8, 9]) == [True, True]
            assert torch.equal(host.get_page_bytes(8), host.get_page_bytes(0))
        finally:
            fresh.close()
    finally:
        store.close()


# -- how pages reach the host: views, row tables, copies -------------------------------------
class ViewSource(ByteSource):
    """Zero-copy pages, one tensor view at a time (no row table)."""

    page_bytes_zero_copy = True


class RowSource(ViewSource):
    """Zero-copy pages with the whole buffer as one numpy row table."""

    def page_bytes_rows(self):
        return self.buf.numpy()


class BadRowSource(ViewSource):
    def page_bytes_rows(self):
        return self.buf.numpy()[:, :-1]


@pytest.mark.parametrize("source_type", [ByteSource, ViewSource, RowSource])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_kind_of_page_source_round_trips_exactly(tmp_path, source_type, threads, layout):
    nbytes = 3 * 4096 + 40
    ns = byte_namespace(nbytes)
    store = open_layout(layout, tmp_path / "s", ns, nbytes, budget_bytes=BUDGET, io_threads=threads)
    try:
        keys = [raw_key(ns, f"k{i}") for i in range(11)]
        src = source_type(nbytes, 13)
        src.buf.random_(0, 256)
        pages = [12, 0, 5, 3, 7, 1, 9, 2, 11, 4, 6]
        assert store.batch_set(keys, src, pages) == [True] * 11
        out = source_type(nbytes, 13)
        out.buf.random_(0, 256)
        untouched = out.buf[[8, 10]].clone()
        dst = [9, 7, 6, 5, 4, 3, 2, 1, 0, 12, 11]  # 8 and 10 are left alone
        assert store.batch_get(keys, out, dst) == [True] * 11
        for key, p, d in zip(keys, pages, dst, strict=True):
            assert torch.equal(out.buf[d], src.buf[p]), f"{key.hex()[:8]} page {d}"
        assert torch.equal(out.buf[[8, 10]], untouched)
    finally:
        store.close()


def test_a_row_table_of_the_wrong_shape_is_refused_and_changes_nothing(tmp_path, layout):
    nbytes = 4096 + 8
    ns = byte_namespace(nbytes)
    store = open_layout(layout, tmp_path / "s", ns, nbytes, budget_bytes=BUDGET)
    try:
        keys = [raw_key(ns, f"k{i}") for i in range(3)]
        good = RowSource(nbytes, 3)
        good.buf.random_(0, 256)
        assert store.batch_set(keys, good, [0, 1, 2]) == [True] * 3
        bad = BadRowSource(nbytes, 3)
        bad.buf.random_(0, 256)
        before = bad.buf.clone()
        for call in (store.batch_get, store.batch_set):
            with pytest.raises(InvalidArgumentError, match=r"page_bytes_rows\(\) has shape"):
                call(keys, bad, [0, 1, 2])
        assert torch.equal(bad.buf, before)
        s = store.stats()
        assert (s.pages, s.gets, s.sets) == (3, 0, 3)
    finally:
        store.close()


# -- recency of reads ------------------------------------------------------------------------
def _tick(store: LMDBStorage, key: bytes) -> int:
    from tiered_kv.storage import value_format

    return store._read(lambda txn: value_format.unpack(txn.get(key, db=store._headers)).tick)


def test_a_read_protects_an_old_page_from_eviction(tmp_path):
    nbytes = 8192 + 100
    ns = byte_namespace(nbytes)
    budget = min_lmdb_budget(tmp_path, ns, nbytes) + 40 * (nbytes + 4096)
    store = LMDBStorage(tmp_path / "s", ns, nbytes, budget_bytes=budget, io_threads=1)
    src = ByteSource(nbytes, 8)
    try:
        written = 0

        def write(n):
            nonlocal written
            for _ in range(n):
                key = raw_key(ns, f"p{written}")
                fill_for_keys(src, [key], [0])
                assert store.batch_set([key], src, [0]) == [True]
                written += 1

        write(16)
        first, second = raw_key(ns, "p0"), raw_key(ns, "p1")
        out = ByteSource(nbytes, 1)
        assert store.batch_get([first], out, [0]) == [True]  # p0 is now the newest
        while store.batch_exists([second]) == 1:
            write(1)
            assert written < 100_000
        assert store.stats().evictions > 0
        assert store.batch_exists([first]) == 1, "the page read last was evicted before p1"
        assert store.batch_get([first], out, [0]) == [True]
        assert np.array_equal(out.buf[0].numpy(), expected_bytes(first, nbytes))
    finally:
        store.close()


def test_reads_of_pages_already_among_the_newest_quarter_keep_their_place(tmp_path):
    nbytes = 4096 + 16
    ns = byte_namespace(nbytes)
    store = LMDBStorage(tmp_path / "s", ns, nbytes, budget_bytes=BUDGET, io_threads=1)
    src = ByteSource(nbytes, 40)
    try:
        keys = [raw_key(ns, f"k{i}") for i in range(40)]
        fill_for_keys(src, keys, range(40))
        assert store.batch_set(keys, src, list(range(40))) == [True] * 40
        ticks = [_tick(store, k) for k in keys]
        assert ticks == sorted(ticks) and len(set(ticks)) == 40
        out = ByteSource(nbytes, 4)
        # the 10 newest are the newest quarter: reading k39 and k31 leaves them where they are,
        # reading k0 and k29 (just older than the quarter) makes them the newest
        read = [keys[39], keys[0], keys[31], keys[29]]
        assert store.batch_get(read, out, [0, 1, 2, 3]) == [True] * 4
        store.flush()
        after = {k: _tick(store, k) for k in keys}
        assert after[keys[39]] == ticks[39] and after[keys[31]] == ticks[31]
        assert min(after[keys[0]], after[keys[29]]) > max(ticks)
        assert after[keys[0]] != after[keys[29]]
        for k in keys[1:29] + keys[30:31] + keys[32:39]:
            assert after[k] == ticks[keys.index(k)]
    finally:
        store.close()

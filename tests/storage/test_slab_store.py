"""SlabStorage in one process: bytes exact on irregular page sizes, the budget on disk (``du``)
with one and two namespaces, corrupt records and slab bytes, a reader racing a slot's reuse, and
the layout a directory holds. Several processes, SIGKILL, a full disk and flips in the index are
in ``test_slab_processes``; the contract (both layouts) in ``test_contract``."""

from __future__ import annotations

import os
import random
import subprocess

import lmdb
import numpy as np
import pytest
import torch

from tiered_kv.errors import StorageOpenError
from tiered_kv.storage import LMDBStorage, value_format
from tiered_kv.storage.layouts import layout_of, open_store
from tiered_kv.storage.slab_books import VALUE_BYTES, Entry
from tiered_kv.storage.slab_file import BLOCK, SlabFile
from tiered_kv.storage.slab_reads import PARALLEL_READ_BYTES, read_plan
from tiered_kv.storage.slab_store import SlabStorage, min_budget

from ._util import ByteSource, byte_namespace, expected_bytes, fill_for_keys, raw_key

BUDGET = 64 << 20


class RowSource(ByteSource):
    """Zero-copy pages with the whole buffer as one numpy row table (a page_first host pool)."""

    page_bytes_zero_copy = True

    def page_bytes_rows(self):
        return self.buf.numpy()


def _random(src: ByteSource, gen: torch.Generator) -> None:
    src.buf.copy_(torch.randint(0, 256, src.buf.shape, generator=gen, dtype=torch.uint8))


def _slab_path(store: SlabStorage):
    return store.path / "slabs" / f"{store.namespace.fingerprint.hex()}.slab"


@pytest.mark.parametrize("nbytes", [1, 100, 4095, 4097, 3 * 4096 + 40, 65536 + 1234])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("source_type", [ByteSource, RowSource])
def test_irregular_page_sizes_round_trip_exactly(tmp_path, gen, nbytes, threads, source_type):
    ns = byte_namespace(nbytes)
    path = tmp_path / "s"
    store = SlabStorage(path, ns, nbytes, budget_bytes=BUDGET, io_threads=threads)
    src, out = source_type(nbytes, 12), source_type(nbytes, 12)
    _random(src, gen)
    _random(out, gen)
    keys = [raw_key(ns, f"k{i}") for i in range(11)]
    pages = torch.randperm(12, generator=gen)[:11].tolist()
    try:
        assert store.batch_set(keys, src, pages) == [True] * 11
        dst = torch.randperm(12, generator=gen)[:11].tolist()
        assert store.batch_get(keys, out, dst) == [True] * 11
        for p, d in zip(pages, dst, strict=True):
            assert torch.equal(out.buf[d], src.buf[p])
        slot = -(-nbytes // BLOCK) * BLOCK
        assert os.path.getsize(_slab_path(store)) == 11 * slot  # slots on 4 KiB boundaries
    finally:
        store.close()
    again = SlabStorage(path, ns, nbytes, budget_bytes=BUDGET, io_threads=threads)
    try:
        _random(out, gen)
        assert again.batch_get(keys[::-1], out, list(range(11))) == [True] * 11
        for i, p in enumerate(pages[::-1]):
            assert torch.equal(out.buf[i], src.buf[p])
    finally:
        again.close()


def _du(path) -> int:
    """Bytes of disk blocks under ``path`` as ``du`` counts them."""
    got = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    return (
        int(got.stdout.split()[0])
        - os.stat(path).st_blocks * 512
        - os.stat(path / "slabs").st_blocks * 512
    )  # the store's files, not the directories' own blocks


@pytest.mark.parametrize("nbytes", [768, 3 * 4096 + 40, 16 * 4096 - 16])
def test_the_budget_is_never_exceeded_on_disk(tmp_path, nbytes):
    ns = byte_namespace(nbytes)
    budget = min_budget(nbytes) + 40 * (nbytes + 4096)
    store = SlabStorage(tmp_path / "s", ns, nbytes, budget_bytes=budget)
    src = ByteSource(nbytes, 16)
    written, results = 0, []
    try:
        while written < 4 * budget // nbytes + 64:
            keys = [raw_key(ns, f"p{j}") for j in range(written, written + 16)]
            fill_for_keys(src, keys, range(16))
            results.append(store.batch_set(keys, src, list(range(16))))
            written += 16
            assert store.disk_bytes() <= budget and store.stats().bytes <= budget
        assert _du(tmp_path / "s") <= budget
        s = store.stats()
        assert s.evictions > 0 and s.errors == {}
        assert all(all(r) for r in results[-3:]), f"the newest batches were skipped: {s}"
        newest = [raw_key(ns, f"p{j}") for j in range(written - 16, written)]
        out = ByteSource(nbytes, 16)
        assert store.batch_get(newest, out, list(range(16))) == [True] * 16
        for i, k in enumerate(newest):
            assert np.array_equal(out.buf[i].numpy(), expected_bytes(k, nbytes))
    finally:
        store.close()


def test_two_namespaces_share_the_budget_and_give_blocks_back(tmp_path):
    """A namespace that filled the budget gives its blocks back (holes punched in its slab) when
    another namespace of another page size writes; the disk never holds more than the budget."""
    sizes = (3 * 4096 + 40, 5 * 4096 + 7)
    budget = min_budget(sizes[1]) + 48 * 5 * 4096
    stores = [SlabStorage(tmp_path / "s", byte_namespace(n), n, budget_bytes=budget) for n in sizes]
    srcs = [ByteSource(n, 8) for n in sizes]
    try:
        for round_ in range(3):
            for w, (store, src) in enumerate(zip(stores, srcs, strict=True)):
                ns, n = store.namespace, store.page_nbytes
                stored = 0
                for b in range(12):
                    keys = [raw_key(ns, f"r{round_}-b{b}-{i}") for i in range(8)]
                    fill_for_keys(src, keys, range(8))
                    stored += sum(store.batch_set(keys, src, list(range(8))))
                    assert store.disk_bytes() <= budget
                assert stored >= 8 * 12 - 8, (round_, w, stored)  # at most one batch skipped
                last = [raw_key(ns, f"r{round_}-b11-{i}") for i in range(8)]
                out = ByteSource(n, 8)
                assert store.batch_get(last, out, list(range(8))) == [True] * 8
                for i, k in enumerate(last):
                    assert np.array_equal(out.buf[i].numpy(), expected_bytes(k, n))
        assert _du(tmp_path / "s") <= budget
        assert all(s.stats().errors == {} for s in stores)
    finally:
        for s in stores:
            s.close()


def _edit_record(path, key: bytes, offset: int) -> None:
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"slab_headers")
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=db))
            assert len(value) == VALUE_BYTES
            value[offset] ^= 0x5A
            txn.put(key, bytes(value), db=db)
    finally:
        env.close()


@pytest.mark.parametrize(
    "where, offset",
    [("record", 0), ("record", 30), ("record", 44), ("record", value_format.HEADER_BYTES),
     ("record", VALUE_BYTES - 1), ("slab", 0), ("slab", -1)],
    ids=["header-magic", "header-checksum", "header-tick", "slot-number", "slot-check",
         "slab-first-byte", "slab-last-byte"],
)  # fmt: skip
def test_a_corrupt_record_or_slot_is_a_miss_and_deleted(tmp_path, gen, where, offset):
    nbytes = 2 * 4096 + 100
    ns = byte_namespace(nbytes)
    path = tmp_path / "s"
    src = ByteSource(nbytes, 10)
    _random(src, gen)
    keys = [raw_key(ns, f"k{i}") for i in range(5)]
    store = SlabStorage(path, ns, nbytes, budget_bytes=BUDGET)
    assert store.batch_set(keys, src, list(range(5))) == [True] * 5
    slab = _slab_path(store)
    store.close()
    if where == "record":
        _edit_record(path, keys[2], offset)
    else:  # slot 2 holds keys[2]; -1: the page's last byte (not the slot's zero padding)
        slot = -(-nbytes // BLOCK) * BLOCK
        at = 2 * slot + (offset if offset >= 0 else nbytes - 1)
        with open(slab, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x5A]))
    store = SlabStorage(path, ns, nbytes, budget_bytes=BUDGET)
    try:
        got = store.batch_get(keys, src, [5, 6, 7, 8, 9])
        assert got == [True, True, False, True, True]
        s = store.stats()
        assert (s.checksum_failures, s.misses, s.hits) == (1, 1, 4)
        assert store.batch_exists(keys) == 2 and s.pages == 4  # the corrupt page was deleted
        for a, b in ((0, 5), (1, 6), (3, 8), (4, 9)):
            assert torch.equal(src.buf[a], src.buf[b])
        assert store.batch_set(keys[2:3], src, [2]) == [True]  # written again, then served
        assert store.batch_get(keys[2:3], src, [7]) == [True]
        assert torch.equal(src.buf[7], src.buf[2])
    finally:
        store.close()


def test_random_flips_in_the_slab_never_serve_wrong_bytes(tmp_path, gen):
    nbytes = 4096 + 1000
    ns = byte_namespace(nbytes)
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    src, out = ByteSource(nbytes, 40), ByteSource(nbytes, 40)
    _random(src, gen)
    keys = [raw_key(ns, f"k{i}") for i in range(40)]
    store = SlabStorage(tmp_path / "s", ns, nbytes, budget_bytes=BUDGET)
    try:
        assert all(store.batch_set(keys, src, list(range(40))))
        slab = _slab_path(store)
        size = os.path.getsize(slab)
        with open(slab, "r+b") as f:
            for _ in range(24):
                at = rng.randrange(size)
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        got = store.batch_get(keys, out, list(range(40)))
        wrong = [i for i, ok in enumerate(got) if ok and not torch.equal(out.buf[i], src.buf[i])]
        assert not wrong
        assert store.stats().checksum_failures == got.count(False) > 0
        assert all(store.batch_set(keys, src, list(range(40))))  # the missed ones come back
        assert store.batch_get(keys, out, list(range(40))) == [True] * 40
    finally:
        store.close()


def test_a_reader_racing_a_slot_reuse_gets_a_miss_never_other_bytes(tmp_path, gen):
    """Between a read's index lookup and its file read, the page is deleted and its slot handed
    to another page (a later transaction, as in another process): the read fails its checksum,
    and the new page under that slot is left alone."""
    nbytes = 3 * 4096 + 8
    ns = byte_namespace(nbytes)
    store = SlabStorage(tmp_path / "s", ns, nbytes, budget_bytes=BUDGET, io_threads=1)
    src = ByteSource(nbytes, 4)
    _random(src, gen)
    old, new = raw_key(ns, "old"), raw_key(ns, "new")
    try:
        assert store.batch_set([old], src, [0]) == [True]
        real_read, raced = store._read, []

        def racing_read(fn):
            result = real_read(fn)
            if not raced and isinstance(result, list):
                raced.append(True)
                assert store.delete([old]) == 1
                assert store.batch_set([new], src, [1]) == [True]  # reuses old's slot
            return result

        store._read = racing_read
        assert store.batch_get([old], src, [2]) == [False]
        store._read = real_read
        assert raced and store.stats().checksum_failures == 1
        assert os.path.getsize(_slab_path(store)) == -(-nbytes // BLOCK) * BLOCK  # one slot
        assert store.batch_get([new], src, [3]) == [True]  # still mapped, still exact
        assert torch.equal(src.buf[3], src.buf[1])
    finally:
        store.close()


def test_a_durable_store_round_trips(tmp_path, gen):
    nbytes = 8192 + 3
    ns = byte_namespace(nbytes)
    src = ByteSource(nbytes, 8)
    _random(src, gen)
    keys = [raw_key(ns, f"k{i}") for i in range(4)]
    store = SlabStorage(tmp_path / "s", ns, nbytes, budget_bytes=BUDGET, durable=True)
    try:
        assert store.batch_set(keys, src, [0, 1, 2, 3]) == [True] * 4
        assert store.batch_get(keys, src, [4, 5, 6, 7]) == [True] * 4
        assert torch.equal(src.buf[4:], src.buf[:4])
    finally:
        store.close()


def test_a_directory_keeps_its_layout(tmp_path):
    ns = byte_namespace(4096)
    LMDBStorage(tmp_path / "l", ns, 4096, budget_bytes=BUDGET).close()
    SlabStorage(tmp_path / "s", ns, 4096, budget_bytes=BUDGET).close()
    assert (layout_of(tmp_path / "l"), layout_of(tmp_path / "s")) == ("lmdb", "slab")
    assert layout_of(tmp_path / "new") is None
    with pytest.raises(StorageOpenError, match="lmdb layout"):
        SlabStorage(tmp_path / "l", ns, 4096, budget_bytes=BUDGET)
    for layout, path in (("slab", "l"), ("lmdb", "s")):
        with pytest.raises(StorageOpenError, match=f"storage_layout='{layout_of(tmp_path / path)}"):
            open_store(layout, tmp_path / path, ns, 4096, budget_bytes=BUDGET)
    for layout, cls in (("lmdb", LMDBStorage), ("slab", SlabStorage)):
        store = open_store(layout, tmp_path / layout, ns, 4096, budget_bytes=BUDGET)
        assert type(store) is cls
        store.close()
    with pytest.raises(StorageOpenError, match="slots of 4096 bytes"):
        SlabStorage(tmp_path / "s", ns, 4097 + 4096, budget_bytes=BUDGET)


@pytest.mark.parametrize("nbytes", [3 * 4096 + 40, (1 << 20) + 40])
def test_a_batch_from_the_disk_is_read_on_one_thread_in_file_order(tmp_path, nbytes):
    slab = SlabFile(tmp_path / "x.slab", nbytes)
    in_order = [0, 1, 4, 5]
    try:
        assert slab.allocate(0, 6) == 0
        for i in range(6):
            slab.write(i, memoryview(np.full(nbytes, i + 1, dtype=np.uint8)))
        jobs = [(i, Entry(b"", None, slot)) for i, slot in enumerate([4, 1, 5, 0])]
        got, threads = read_plan(slab, jobs, 2)
        if nbytes < PARALLEL_READ_BYTES:  # small pages: one thread, in the page cache or not
            assert threads == 1 and [e.slot for _, e in got] == in_order
        else:
            assert (got, threads) == (jobs, 2)  # in the page cache: as given, two threads
        os.fsync(slab.fd)
        os.posix_fadvise(slab.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if slab.cached(0):
            pytest.skip("no cachestat here, or the pages were not dropped")
        got, threads = read_plan(slab, jobs, 2)
        assert threads == 1 and [e.slot for _, e in got] == in_order
        got, threads = read_plan(slab, jobs, 1)
        assert threads == 1 and [e.slot for _, e in got] == in_order
    finally:
        slab.close()


@pytest.mark.parametrize("nbytes", [4096 - 3, 3 * 4096 + 40, (512 << 10), (512 << 10) + 4096 + 7])
def test_read_into_checks_whole_pages_of_one_chunk_and_of_several(tmp_path, gen, nbytes):
    slab = SlabFile(tmp_path / "x.slab", nbytes)
    page = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).numpy()
    try:
        assert slab.allocate(0, 2) == 0
        csum = slab.write(1, memoryview(page))
        dst = np.zeros(nbytes, dtype=np.uint8)
        assert slab.read_into(1, dst, csum) and np.array_equal(dst, page)
        assert not slab.read_into(1, dst, csum ^ 1)  # another checksum
        assert not slab.read_into(0, dst, csum)  # another slot's bytes (zeros)
        assert not slab.read_into(2, dst, csum)  # past the file's end: a short read
        with open(tmp_path / "x.slab", "r+b") as f:  # one flipped byte in the page's last chunk
            f.seek(slab.slot_bytes + nbytes - 1)
            last = f.read(1)[0]
            f.seek(slab.slot_bytes + nbytes - 1)
            f.write(bytes([last ^ 0x01]))
        assert not slab.read_into(1, dst, csum)
    finally:
        slab.close()

"""ConnectorTiers over a real embedded store: pages saved from vLLM's blocks come back bit for
bit from the host tier and, once evicted there, from the store; whatever cannot be proven to be
the page written (never stored, a damaged value, a dead store, a failed copy) fails its block
and every later block of the chain, and nothing raises. A randomized run injects faults
everywhere and checks that no block reported loaded ever holds other bytes."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sys

import pytest
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.block_layout import describe_layers
from tiered_kv.integrations.vllm.settings import read_settings
from tiered_kv.integrations.vllm.tiers import ConnectorTiers
from tiered_kv.storage.slab_store import SlabStorage

from ._kv import KINDS, fill_bits_, make_caches, page_bytes, refill_, set_page_

NB, H, N, D = 13, 2, 4, 6
LAYERS = [0, 1, 2]
PAGE = len(LAYERS) * H * N * 2 * D * 4  # float32


def _digest(tag) -> bytes:
    return hashlib.sha256(repr(tag).encode()).digest()


def _settings(tmp_path, pages: float = 3, **extra):
    return read_settings(
        {
            "model_id": "org/tiny@rev1",
            "storage_path": str(tmp_path / "store"),
            "storage_bytes": 64 << 20,
            "host_bytes": int(pages * PAGE),
            **extra,
        }
    )


class Engine:
    """One engine's caches and tiers."""

    def __init__(self, tmp_path, gen, kind="LBNHC", pages=3, **extra):
        self.kind, self.gen = kind, gen
        caches, self.physical = make_caches(kind, LAYERS, NB, H, N, D, gen)
        self.layout = describe_layers(caches, NB)
        assert self.layout.page_nbytes == PAGE
        self.tiers = ConnectorTiers(_settings(tmp_path, pages, **extra), self.layout, rank=None)

    def page(self, block: int) -> torch.Tensor:
        return page_bytes(self.kind, self.physical, block)

    def save(self, blocks, digests, wait=True):
        """Copy ``blocks`` to the tiers as the worker does: layer by layer, then finish."""
        save = self.tiers.begin_save(blocks, digests)
        order = list(range(len(LAYERS)))
        random.Random(len(blocks)).shuffle(order)
        for li in order[:-1]:  # the last one is left to finish_save
            self.tiers.copy_layer(save, li)
        future = self.tiers.finish_save(save)
        if wait and future is not None:
            future.result()
        return future

    def close(self):
        self.tiers.close()


@pytest.fixture
def engine(tmp_path, gen):
    e = Engine(tmp_path, gen)
    yield e
    e.close()


@pytest.mark.parametrize("kind", KINDS)
def test_saved_pages_load_back_bit_exact(tmp_path, gen, kind):
    e = Engine(tmp_path, gen, kind, pages=4)
    try:
        blocks, digests = [7, 2, 11], [_digest(i) for i in range(3)]
        want = [e.page(b) for b in blocks]
        e.save(blocks, digests)
        assert e.tiers.lookup(digests) == (3, 0)
        assert e.tiers.store.batch_exists(e.tiers.keys(digests)) == 3

        refill_(e.physical, gen)
        targets = [4, 12, 0]
        others = {b: e.page(b) for b in range(NB) if b not in targets}
        layers = []
        assert e.tiers.load(targets, digests, layers.append) == set()
        assert sorted(set(layers)) == [0, 1, 2]
        for t, w in zip(targets, want, strict=True):
            assert torch.equal(e.page(t), w)
        for b, w in others.items():
            assert torch.equal(e.page(b), w)
        c = e.tiers.counters.snapshot()
        assert c["loaded_host_blocks"] == 3 and c["loaded_store_blocks"] == 0
        assert c["saved_blocks"] == 3 and c["store_written_blocks"] == 3
        assert c["loaded_bytes"] == 3 * PAGE and c["load_failed_blocks"] == 0
        assert e.tiers.slots.counts()["pinned"] == 0
    finally:
        e.close()


def test_pages_evicted_from_the_host_load_from_the_store(engine, gen):
    e = engine
    first, second = [_digest(("a", i)) for i in range(3)], [_digest(("b", i)) for i in range(3)]
    want = {}
    for blocks, digests in (([1, 5, 9], first), ([3, 8, 10], second)):
        want.update({d: e.page(b) for b, d in zip(blocks, digests, strict=True)})
        e.save(blocks, digests)
        refill_(e.physical, gen)
    assert e.tiers.slots.lookup(first) == 0  # three host slots: the first three were replaced
    assert e.tiers.lookup(first) == (0, 3)
    assert e.tiers.lookup(second) == (3, 0)
    targets = [12, 6, 2]
    assert e.tiers.load(targets, first) == set()
    for t, d in zip(targets, first, strict=True):
        assert torch.equal(e.page(t), want[d])
    c = e.tiers.counters.snapshot()
    assert c["loaded_store_blocks"] == 3 and c["loaded_host_blocks"] == 0
    assert e.tiers.slots.counts()["evictions"] >= 3
    assert e.tiers.lookup(first) == (3, 0)  # fetched pages stay on the host

    # a chain needing more host slots than there are: the pages without one fail, in order
    refill_(e.physical, gen)
    chain = [second[0], first[0], second[1], second[2]]
    assert e.tiers.slots.lookup(second) == 0
    # first[0] is pinned on the host: two slots for three fetches
    assert e.tiers.load([4, 7, 11, 0], chain) == {0}
    for t, d in zip([4, 7, 11], chain, strict=False):
        assert torch.equal(e.page(t), want[d])
    c = e.tiers.counters.snapshot()
    assert c["load_no_slot_blocks"] == 1 and c["load_failed_blocks"] == 1
    assert e.tiers.slots.counts()["pinned"] == 0


def test_saving_a_page_the_host_holds_is_skipped(engine):
    e = engine
    e.save([1, 2], [_digest(1), _digest(2)])
    assert e.save([3, 4], [_digest(1), _digest(2)]) is None
    c = e.tiers.counters.snapshot()
    assert c["save_present_blocks"] == 2 and c["saved_blocks"] == 2


def test_one_page_saved_twice_in_one_step_is_kept_once(engine, gen):
    """Two requests with one prompt fill the same page in the same step."""
    e = engine
    d = _digest("twice")
    set_page_(e.kind, e.physical, 4, e.page(2))
    want = e.page(2)
    e.save([2, 4], [d, d])
    assert e.tiers.slots.counts() == dict(slots=3, cached=1, pinned=0, free=2, evictions=0)
    assert e.tiers.store.stats().pages == 1
    c = e.tiers.counters.snapshot()  # copied and written once, not once per request
    assert c["saved_blocks"] == 1 and c["save_present_blocks"] == 1
    assert c["store_written_blocks"] == 1
    refill_(e.physical, gen)
    assert e.tiers.load([9], [d]) == set()
    assert torch.equal(e.page(9), want)


def test_a_page_never_stored_fails_its_block_and_every_later_one(engine, gen):
    e = engine
    digests = [_digest(i) for i in range(3)]
    want = e.page(5)
    e.save([5, 6, 7], digests)
    chain = [digests[0], _digest("never"), digests[1], digests[2]]
    assert e.tiers.lookup(chain) == (1, 0)
    refill_(e.physical, gen)
    assert e.tiers.load([9, 10, 11, 12], chain) == {10, 11, 12}
    assert torch.equal(e.page(9), want)
    assert e.tiers.counters.snapshot()["load_failed_blocks"] == 3
    assert e.tiers.slots.counts()["pinned"] == 0


def _corrupt(store, key: bytes) -> None:
    """Flip one byte of the page bytes stored under ``key``, in place on disk."""
    if isinstance(store, SlabStorage):
        entry = store._read(lambda txn: store._books.lookup(txn, key))
        slab = store._files.slab
        at = entry.slot * slab.slot_bytes + PAGE // 2
        (old,) = os.pread(slab.fd, 1, at)
        os.pwrite(slab.fd, bytes([old ^ 0x20]), at)
        return

    def flip(txn):
        value = bytearray(txn.get(key, db=store._pages))
        value[len(value) // 2] ^= 0x20
        txn.put(key, bytes(value), db=store._pages)

    store._write(flip, "test flip")


@pytest.mark.parametrize("layout", ["slab", "lmdb"])
def test_a_damaged_stored_value_is_a_miss_never_wrong_bytes(tmp_path, gen, layout):
    e = Engine(tmp_path, gen, pages=3, storage_layout=layout)
    try:
        digests = [_digest(("c", i)) for i in range(3)]
        want = [e.page(b) for b in (1, 2, 3)]
        e.save([1, 2, 3], digests)
        e.save([4, 5, 6], [_digest(("pad", i)) for i in range(3)])  # evict them from the host
        assert e.tiers.lookup(digests) == (0, 3)
        _corrupt(e.tiers.store.inner, e.tiers.keys(digests[1:2])[0])
        refill_(e.physical, gen)
        before = e.page(10)
        assert e.tiers.load([8, 9, 10], digests) == {9, 10}
        assert torch.equal(e.page(8), want[0])
        assert torch.equal(e.page(10), before)  # never reached
        assert e.tiers.store.stats().checksum_failures == 1
        assert e.tiers.lookup(digests) == (1, 0)  # the damaged page was dropped
        assert e.tiers.slots.lookup(digests[1:]) == 0
        assert e.tiers.slots.counts()["pinned"] == 0
        # saved again, it is served again
        set_page_(e.kind, e.physical, 11, want[1])
        e.save([11], digests[1:2])
        assert e.tiers.load([9, 10], digests[1:]) == set()
        assert torch.equal(e.page(9), want[1]) and torch.equal(e.page(10), want[2])
    finally:
        e.close()


@pytest.mark.parametrize("how", ["closed", "removed"])
def test_a_dead_store_is_counted_misses_and_nothing_raises(tmp_path, gen, how):
    e = Engine(tmp_path, gen, pages=3)
    try:
        digests = [_digest(("d", i)) for i in range(3)]
        e.save([1, 2, 3], digests)
        e.save([4, 5, 6], [_digest(("pad", i)) for i in range(3)])
        if how == "closed":
            e.tiers.store.inner.close()
        else:
            shutil.rmtree(tmp_path / "store")
        assert e.tiers.lookup(digests) == (0, 0)
        assert e.tiers.load([7, 8, 9], digests) == {7, 8, 9}
        future = e.save([10, 11], [_digest(("e", 0)), _digest(("e", 1))])
        assert future.exception() is None
        c = e.tiers.counters.snapshot()
        assert c["load_failed_blocks"] == 3 and c["store_write_failed_blocks"] == 2
        # the host tier still serves what it holds
        assert e.tiers.load([12], [_digest(("e", 0))]) == set()
        assert e.tiers.slots.counts()["pinned"] == 0
    finally:
        e.close()


def test_host_bytes_below_a_page_are_refused(tmp_path, gen):
    caches, _ = make_caches("LBHNC", LAYERS, NB, H, N, D, gen)
    layout = describe_layers(caches, NB)
    with pytest.raises(InvalidArgumentError, match=f"host_bytes={PAGE - 1}.*{PAGE} bytes"):
        ConnectorTiers(_settings(tmp_path, (PAGE - 1) / PAGE), layout, rank=None)


def test_a_failed_copy_is_a_miss_and_names_no_slot(engine, gen, monkeypatch):
    e = engine
    digests = [_digest(("f", i)) for i in range(2)]
    real = e.tiers.pages.copy

    def broken(*args, **kw):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(e.tiers.pages, "copy", broken)
    save = e.tiers.begin_save([1, 2], digests)
    e.tiers.copy_layer(save, 1)  # inside the forward: must not raise into vLLM's model
    assert e.tiers.finish_save(save) is None
    assert e.tiers.slots.lookup(digests) == 0
    assert e.tiers.slots.counts()["pinned"] == 0
    monkeypatch.setattr(e.tiers.pages, "copy", real)
    e.save([1, 2], digests)
    monkeypatch.setattr(e.tiers.pages, "copy", broken)
    assert e.tiers.load([3, 4], digests) == {3, 4}
    assert e.tiers.counters.snapshot()["copy_errors"] >= 2
    assert e.tiers.slots.counts()["pinned"] == 0


class Faults:
    """Random trouble at the store's and the copier's edges (the store's own contract kept: a
    page reported served holds its bytes; one reported missed may hold anything)."""

    def __init__(self, tiers, rng: random.Random, gen: torch.Generator) -> None:
        self.rng, self.gen = rng, gen
        self.on = True
        tiers.store.fail_limit = 1 << 30  # keep the faulty store: no reopen replaces it
        inner = tiers.store.inner
        self._get, self._set, self._copy = inner.batch_get, inner.batch_set, tiers.pages.copy
        inner.batch_get, inner.batch_set = self.batch_get, self.batch_set
        tiers.pages.copy = self.copy

    def _roll(self, p: float) -> bool:
        return self.on and self.rng.random() < p

    def batch_get(self, keys, source, pages):
        if self._roll(0.05):
            raise OSError("injected: the store's read failed")
        served = self._get(keys, source, pages)
        for i, page in enumerate(pages):
            if self._roll(0.1):  # a checksum failure after partial bytes landed
                fill_bits_(source.get_page_bytes(page), self.gen)
                served[i] = False
        return served

    def batch_set(self, keys, source, pages):
        if self._roll(0.05):
            raise OSError("injected: the store's write failed")
        keep = [i for i in range(len(keys)) if not self._roll(0.1)]
        stored = self._set([keys[i] for i in keep], source, [pages[i] for i in keep])
        out = [False] * len(keys)
        for i, ok in zip(keep, stored, strict=True):
            out[i] = ok
        return out

    def copy(self, plan, to_host, layers=None):
        if self._roll(0.03):
            raise RuntimeError("injected: copy failed before a byte moved")
        self._copy(plan, to_host, layers)
        if self._roll(0.02):
            raise RuntimeError("injected: copy failed after it ran")


def test_random_faults_never_load_wrong_bytes(tmp_path, gen):
    rng = random.Random(int(torch.randint(1 << 30, (1,), generator=gen)))
    e = Engine(tmp_path, gen, kind=rng.choice(KINDS), pages=5)
    faults = Faults(e.tiers, rng, gen)
    truth: dict[bytes, torch.Tensor] = {}
    pending = []
    loaded_ok = failed_total = 0
    try:
        for step in range(600):
            if rng.random() < 0.5:  # save 1..4 blocks: new pages, or known ones again
                blocks = rng.sample(range(NB), rng.randint(1, 4))
                refill_(e.physical, gen)
                digests = []
                for b in blocks:
                    if truth and rng.random() < 0.3:
                        d = rng.choice(list(truth))
                        if d in digests:
                            d = _digest(("s", step, b))
                        else:
                            set_page_(e.kind, e.physical, b, truth[d])
                    else:
                        d = _digest(("s", step, b))
                    digests.append(d)
                    truth.setdefault(d, e.page(b))
                pending.append(e.save(blocks, digests, wait=rng.random() < 0.5))
            else:  # load a chain of known (and now and then unknown) pages
                known = list(truth)
                recent = known[-10:]
                chain = [
                    rng.choice(recent if rng.random() < 0.7 else known)
                    if known and rng.random() < 0.95
                    else _digest(rng.random())
                    for _ in range(rng.randint(1, 4))
                ]
                chain = list(dict.fromkeys(chain))
                targets = rng.sample(range(NB), len(chain))
                refill_(e.physical, gen)
                if rng.random() < 0.5:
                    failed = e.tiers.load(targets, chain)
                else:
                    failed = e.tiers.submit_load(targets, chain).result()
                ok = len(targets) - len(failed)
                assert failed == set(targets[ok:]), (targets, failed)
                for t, d in zip(targets[:ok], chain[:ok], strict=True):
                    assert d in truth
                    assert torch.equal(e.page(t), truth[d]), f"step {step}: wrong bytes loaded"
                loaded_ok += ok
                failed_total += len(failed)
            if rng.random() < 0.05:  # a damaged value on disk now and then
                e.tiers.drain()
                stored = [d for d in truth if e.tiers.store.batch_exists(e.tiers.keys([d]))]
                if stored:
                    _corrupt(e.tiers.store.inner, e.tiers.keys([rng.choice(stored)])[0])
        for f in pending:
            assert f is None or f.exception() is None
        e.tiers.drain()
        assert e.tiers.slots.counts()["pinned"] == 0  # no pin leaked through any fault
        faults.on = False
        c = e.tiers.counters.snapshot()
        assert c["load_failed_blocks"] == failed_total
        assert loaded_ok > 0 and failed_total > 0
    finally:
        e.close()


def test_the_load_and_save_threads_copy_beside_compute(engine, monkeypatch):
    """Their copies take only the cores the model's threads leave free (``copy_threads``)."""
    from tiered_kv.kernels import row_job

    monkeypatch.setattr(row_job, "free_cores", lambda: 5)
    monkeypatch.setattr(row_job.torch, "get_num_threads", lambda: 3)
    monkeypatch.delenv(row_job.COPY_THREADS_ENV, raising=False)
    big = row_job.HELPERS_MIN_BYTES
    for pool in (engine.tiers._loader, engine.tiers._saver):
        assert pool.submit(row_job.copy_threads, big).result() == 5
    assert row_job.copy_threads(big) == 3  # the caller (the model's thread) is not marked


def test_a_bad_copy_thread_count_is_refused_at_start(tmp_path, gen, monkeypatch):
    monkeypatch.setenv("TIERED_KV_COPY_THREADS", "0")
    with pytest.raises(InvalidArgumentError, match="TIERED_KV_COPY_THREADS='0'"):
        Engine(tmp_path, gen)


def test_open_tiers_hold_the_gil_switch_interval_short(tmp_path, gen, monkeypatch):
    """The worker's process keeps a 200 us switch interval while any tiers are open (their
    threads would wait the interpreter's 5 ms for the GIL at every release beside vLLM's main
    thread); the last close gives the interpreter's back; 0 leaves it alone."""
    from tiered_kv import gil_switch

    # a module state of its own: tiers another test left open would hold too
    monkeypatch.setattr(gil_switch, "_open", {})
    monkeypatch.setattr(gil_switch, "_state", {"next": 0, "found": None, "ours": None})
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        a = Engine(tmp_path / "a", gen)
        assert abs(sys.getswitchinterval() - 200e-6) < 1e-6
        b = Engine(tmp_path / "b", gen, gil_switch_us=80)
        assert abs(sys.getswitchinterval() - 80e-6) < 1e-6
        b.close()
        assert abs(sys.getswitchinterval() - 200e-6) < 1e-6
        a.close()
        a.close()  # closing twice gives back nothing twice
        assert abs(sys.getswitchinterval() - 0.005) < 1e-6
        c = Engine(tmp_path / "c", gen, gil_switch_us=0)
        assert abs(sys.getswitchinterval() - 0.005) < 1e-6
        c.close()
    finally:
        sys.setswitchinterval(before)

"""A segmented prefetch (several requests' chains in one storage -> host job): each chain stops
at its own first page not served, never at another chain's; one ``batch_get`` per batch
across the chains; a raising call ends only the chains it read; bytes exact.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.transfer._util import (
    FlakyStorage,
    Results,
    host_pages,
    keys_for,
    page_bytes,
    store_directly,
)
from tests.transfer.test_host_storage import _rig
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import MemoryStorage, StorageNamespace
from tiered_kv.transfer import HostStorageTransfer, TransferJob


class CountingStorage(FlakyStorage):
    """Counts calls; ``raise_on`` (get call numbers, from 1) raise."""

    def __init__(self, inner, raise_on=()) -> None:
        super().__init__(inner)
        self.raise_on = set(raise_on)
        self.exists = 0

    def batch_exists(self, keys):
        self.exists += 1
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, source, pages):
        self.gets += 1
        if self.gets in self.raise_on:
            raise OSError("injected read fault")
        return self.inner.batch_get(keys, source, pages)


def _setup(gen, segments, holes):
    host = _rig(gen)
    ns = StorageNamespace.for_host_pool(host, model="test-model")
    store = MemoryStorage(ns, host.page_nbytes)
    n = sum(segments)
    keys = keys_for(host, n, gen)
    src_pages, _ = host_pages(host, n, gen)
    src = page_bytes(host, src_pages)
    store_directly(store, keys, host, src_pages)
    store.delete([keys[i] for i in holes])
    host.free(torch.tensor([s * host.page_size + j for s in src_pages for j in range(4)]))
    dst_pages, dst_slots = host_pages(host, n, gen)
    return host, store, keys, src, dst_pages, dst_slots


def _leading(segments, holes):
    out, at = [], 0
    for n in segments:
        first = next((i - at for i in range(at, at + n) if i in holes), n)
        out.append(first)
        at += n
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch_pages", [1, 3, 32])
def test_each_chain_stops_at_its_own_first_hole(gen, seed, batch_pages):
    rng = random.Random(seed)
    segments = [rng.randint(1, 4) for _ in range(rng.randint(2, 5))]
    n = sum(segments)
    holes = set(rng.sample(range(n), rng.randint(0, n // 2)))
    host, store, keys, src, dst_pages, dst_slots = _setup(gen, segments, holes)
    counted = CountingStorage(store)
    ctl = HostStorageTransfer(host, counted, batch_pages=batch_pages)
    res = Results(ctl)
    try:
        assert res.submit(TransferJob.prefetch(1, keys, dst_slots, segments))
        r = res.result(1)
        want = _leading(segments, holes)
        assert list(r.segment_pages) == want
        assert r.pages_done == sum(want) and r.ok is (sum(want) == n) and r.error is None
        assert r.nbytes == sum(want) * host.page_nbytes
        got, at = page_bytes(host, dst_pages), 0
        for seg, lead in zip(segments, want, strict=True):
            for i in range(at, at + lead):
                assert torch.equal(got[i], src[i]), f"page {i} of a chain's prefix differs"
            at += seg
        assert counted.exists == 0  # no per-chain existence calls
        if not holes:
            assert counted.gets == -(-n // batch_pages)  # one call per batch across chains
    finally:
        ctl.close()


def test_a_raising_call_ends_only_the_chains_it_read(gen):
    segments = [2, 2, 3]  # batches of 2: [a0 a1] [b0 b1] [c0 c1] [c2]
    host, store, keys, src, dst_pages, dst_slots = _setup(gen, segments, set())
    flaky = CountingStorage(store, raise_on={2})
    ctl = HostStorageTransfer(host, flaky, batch_pages=2)
    res = Results(ctl)
    try:
        assert res.submit(TransferJob.prefetch(1, keys, dst_slots, segments))
        r = res.result(1)
        assert list(r.segment_pages) == [2, 0, 3]
        assert r.ok is False and "injected read fault" in r.error
        got = page_bytes(host, dst_pages)
        for i in (0, 1, 4, 5, 6):
            assert torch.equal(got[i], src[i])
    finally:
        ctl.close()


def test_cancel_keeps_what_the_batch_in_progress_landed(gen):
    host, store, keys, src, dst_pages, dst_slots = _setup(gen, [2, 3], set())
    gate = threading.Event()
    blocking = FlakyStorage(store, gate=gate)
    ctl = HostStorageTransfer(host, blocking, batch_pages=2)
    res = Results(ctl)
    try:
        assert res.submit(TransferJob.prefetch(1, keys, dst_slots, [2, 3]))
        assert blocking.entered.wait(10)  # the first batch (the first chain) is being read
        ctl.cancel(1)
        gate.set()
        r = res.result(1)
        assert list(r.segment_pages) == [2, 0] and r.ok is False and r.error is None
        got = page_bytes(host, dst_pages)
        assert torch.equal(got[0], src[0]) and torch.equal(got[1], src[1])
    finally:
        gate.set()
        ctl.close()


def test_bad_segments_are_refused(gen):
    host, store, keys, _, _, dst_slots = _setup(gen, [2, 3], set())
    ctl = HostStorageTransfer(host, store)
    try:
        for bad in ([2, 2], [5, 0], [6, -1]):
            with pytest.raises(InvalidArgumentError, match="segments"):
                ctl.submit(TransferJob.prefetch(1, keys, dst_slots, bad))
        assert ctl.in_flight == 0
    finally:
        ctl.close()

"""Faults injected at random into every copy and every store call while random operations run
(inserts, matches, prefetches, load-backs, locks, protections, evictions): the invariants hold
after every step, every failure is a counted miss (never an exception in the manager), and no
copy that is matchable or resident differs from the bytes that were written.

A failed host -> device load leaves a *stale* device copy that its holder keeps until it lets
go; it is never matched and never built upon, so it is the one resident copy not compared."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.cache._tree_util import (
    assert_bytes_equal,
    check_invariants,
    one_torch_thread,
    path_tokens,
    stack_factory,
)
from tests.cache.test_manager import Driver
from tiered_kv.storage.memory_store import MemoryStorage
from tiered_kv.tree.node import walk


class Faults:
    """Decides, thread-safely and reproducibly per seed, which calls fail."""

    def __init__(self, seed: int, rate: float) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.lock = threading.Lock()
        self.fired = 0

    def maybe(self, what: str) -> None:
        with self.lock:
            hit = self.rng.random() < self.rate
            self.fired += hit
        if hit:
            raise OSError(f"injected fault in {what}")


def flaky_store_class(faults: Faults) -> type[MemoryStorage]:
    class RandomlyFailingStorage(MemoryStorage):
        def batch_exists(self, keys):
            faults.maybe("batch_exists")
            return super().batch_exists(keys)

        def batch_get(self, keys, source, pages):
            faults.maybe("batch_get")
            return super().batch_get(keys, source, pages)

        def batch_set(self, keys, source, pages):
            faults.maybe("batch_set")
            return super().batch_set(keys, source, pages)

    return RandomlyFailingStorage


def check_trusted_data(stack) -> None:
    """Every copy a request could be served from holds its oracle KV (call after a drain)."""
    for n in walk(stack.tree.root):
        toks = path_tokens(n)
        k, v = stack.expected(toks)
        ek, ev = k[:, len(toks) - len(n) :], v[:, len(toks) - len(n) :]
        if n.on_device and not n.stale:
            gk, gv = stack.device_kv(n.device)
            assert_bytes_equal(gk, ek, f"{n!r} device K")
            assert_bytes_equal(gv, ev, f"{n!r} device V")
        if n.on_host:
            gk, gv = stack.host_kv(n.host)
            assert_bytes_equal(gk, ek, f"{n!r} host K")
            assert_bytes_equal(gv, ev, f"{n!r} host V")
    for n in walk(stack.tree.root):
        if n.in_storage and not n.pending:
            got = stack.storage_kv_or_none(n)
            if got is not None:  # evicted from the store, or a read fault: a miss, fine
                toks = path_tokens(n)
                k, v = stack.expected(toks)
                assert_bytes_equal(got[0], k[:, len(toks) - len(n) :], f"{n!r} stored K")
                assert_bytes_equal(got[1], v[:, len(toks) - len(n) :], f"{n!r} stored V")


class FaultDriver(Driver):
    """The random operations of the manager tests; its full data check (every resident copy)
    is replaced by the trusted-data check, since a stale copy is garbage by design."""

    def step(self) -> None:
        import tests.cache.test_manager as mod

        real = mod.check_data
        mod.check_data = check_trusted_data
        try:
            super().step()
        finally:
            mod.check_data = real

    def check(self) -> None:
        check_invariants(self.s)
        for node, _ in self.locks:
            assert node.lock_ref > 0 and all(n.on_device for n in _path(node))


def _path(node):
    while node.parent is not None:
        yield node
        node = node.parent


@pytest.mark.parametrize(
    ("write_policy", "page_size", "device_pages", "host_pages"),
    [
        ("write_through", 4, 10, 14),
        ("write_back", 4, 10, 12),
        ("write_through_selective", 8, 8, 10),
    ],
)
def test_random_faults_never_serve_wrong_kv(
    gen, monkeypatch, write_policy, page_size, device_pages, host_pages
):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    print(f"fault seed {seed}")
    faults = Faults(seed, rate=0.12)
    stacks = stack_factory(gen)
    make = next(stacks)
    s = make(
        page_size=page_size,
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy=write_policy,
        storage_cls=flaky_store_class(faults),
        storage_batch_pages=2,
    )
    for name in ("backup_from_device_all_layer", "load_to_device_per_layer"):
        real = getattr(s.host, name)

        def flaky(*args, _real=real, _name=name, **kwargs):
            faults.maybe(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(s.host, name, flaky)

    def storage_kv_or_none(node):
        keys = [s.ns.fingerprint + d for d in node.digests]
        try:
            return s.storage_kv(keys)
        except OSError:
            return None

    s.storage_kv_or_none = storage_kv_or_none
    rng = random.Random(seed)
    with one_torch_thread():
        d = FaultDriver(s, rng, gen)
        try:
            for i in range(250):
                d.step()
                if i % 25 == 24:
                    s.drain()
                    check_trusted_data(s)
            for node, _ in d.locks:
                s.manager.dec_lock_ref(node)
            for node, _ in d.protects:
                s.manager.dec_host_ref(node)
            d.locks, d.protects = [], []
            s.drain()
            check_invariants(s)
            check_trusted_data(s)
            assert not any(n.stale for n in walk(s.tree.root)), "a stale copy outlived its holders"
            assert faults.fired > 0, "no fault was injected"
            s.clear()
            assert s.alloc.available_size() == s.device0
            assert s.host.available_size() == s.host0
        finally:
            try:
                next(stacks)
            except StopIteration:
                pass

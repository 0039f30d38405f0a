"""The transfer contract seen from the manager: the simulator's instant fake and the real
workers (copy threads, storage threads over a real page store) give the manager the same
results, so the same operations leave the same tree.

Both runs use real pools (so slot numbers match); only the transfer workers and the store the
manager probes differ. After every operation both runs drain (wait, then acknowledge until
nothing is in flight), so what the real workers did asynchronously has been delivered."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cache._tree_util import DTYPE, HEAD_DIM, HEADS, LAYERS, one_torch_thread
from tiered_kv.cache.manager import CacheManager
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host.host_kv_cache import host_pool_for
from tiered_kv.sim.simulator import InstantTransfer, KeyStore
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.storage.memory_store import MemoryStorage
from tiered_kv.transfer.device_host import DeviceHostTransfer
from tiered_kv.transfer.host_storage import HostStorageTransfer
from tiered_kv.tree.node import walk
from tiered_kv.tree.tiered_tree import TieredTree

P = 4


class Run:
    def __init__(self, fake: bool, write_policy: str, gen: torch.Generator) -> None:
        size = 10 * P
        self.pool = MHATokenToKVPool(size, P, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu")
        for buf in self.pool.buffers():
            buf.copy_(torch.randn(buf.shape, generator=gen))
        self.alloc = PagedTokenToKVPoolAllocator(size, P, DTYPE, "cpu", kvcache=self.pool)
        self.host = host_pool_for(
            self.pool.host_pool_decls()[0],
            self.alloc,
            layout="page_first",
            size_tokens=12 * P,
            reserve_bytes=0,
            kernel_backend="torch",
        )
        ns = StorageNamespace.for_host_pool(self.host, model="test-model")
        if fake:
            store = KeyStore(None)
            self.device_host = self.host_storage = InstantTransfer(store)
        else:
            store = MemoryStorage(ns, self.host.page_nbytes)
            self.device_host = DeviceHostTransfer(self.alloc, self.host)
            self.host_storage = HostStorageTransfer(self.host, store, batch_pages=2)
        self.tree = TieredTree(P, digests=True)
        self.manager = CacheManager(
            self.tree,
            self.alloc,
            self.host,
            self.device_host,
            self.host_storage,
            store=store,
            namespace=ns,
            write_policy=write_policy,
        )
        self.results: list[tuple] = []
        deliver = self.manager.jobs.deliver

        def recording(result):
            self.results.append(
                (result.job_id, str(result.direction), result.ok, result.pages_done)
            )
            deliver(result)

        self.manager.jobs.deliver = recording

    def drain(self) -> None:
        for _ in range(10_000):
            if not self.manager.pending_ops():
                return
            self.manager.wait_all()
            self.manager.poll()
        raise AssertionError(f"still in flight: {self.manager.jobs.describe()}")

    def snapshot(self) -> list[tuple]:
        return sorted(
            (
                n.key,
                None if n.device is None else tuple(n.device.tolist()),
                None if n.host is None else tuple(n.host.tolist()),
                n.in_storage,
                n.lock_ref,
                n.host_ref,
            )
            for n in walk(self.tree.root)
        )

    def close(self) -> None:
        self.device_host.close()
        self.host_storage.close()


def operations(seed: int, n: int) -> list[tuple]:
    rng = random.Random(seed)
    seqs: list[list[int]] = []
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3 or not seqs:
            if seqs and rng.random() < 0.5:
                base = rng.choice(seqs)
                seq = base[: rng.randint(1, len(base) // P) * P]
                seq += [rng.randint(1, 30) for _ in range(P * rng.randint(1, 2))]
            else:
                seq = [rng.randint(1, 30) for _ in range(P * rng.randint(1, 4))]
            seqs.append(seq)
            ops.append(("put", seq))
        elif r < 0.75:
            ops.append(("serve", list(rng.choice(seqs[-4:]))))
        elif r < 0.85:
            ops.append(("evict_device", rng.randint(1, 4) * P))
        else:
            ops.append(("evict_host", rng.randint(1, 4) * P))
    return ops


def apply(run: Run, op: tuple) -> None:
    m = run.manager
    kind, arg = op
    if kind == "put":
        slots = m.alloc_device(len(arg))
        if slots is not None:
            dup = m.insert(arg, slots)
            if dup:
                run.alloc.free(slots[:dup])
    elif kind == "serve":
        match = m.match_prefix(arg)
        node = match.last_node
        if match.storage_keys:
            pf = m.prefetcher.start(match, arg)
            if pf is not None and m.prefetcher.finish(pf, None):
                node = m.match_prefix(arg, check_storage=False, count_hit=False).last_node
        if not node.on_device and node.parent is not None:
            if m.load_back(node) is None:
                node = match.last_device_node
        m.inc_lock_ref(node)
        run.drain()
        m.dec_lock_ref(node)
    elif kind == "evict_device":
        m.evict_device(arg)
    else:
        m.evict_host(arg)


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fake_and_real_workers_give_the_manager_the_same_results(gen, write_policy, seed):
    with one_torch_thread():
        runs = [Run(fake, write_policy, gen) for fake in (True, False)]
        try:
            for i, op in enumerate(operations(seed, 100)):
                for run in runs:
                    apply(run, op)
                    run.drain()
                    run.manager.check_integrity()
                fake, real = runs
                where = f"op {i} {op[0]}"
                assert sorted(fake.results) == sorted(real.results), where
                assert fake.snapshot() == real.snapshot(), where
            assert fake.results, "the scenario moved nothing"
            kinds = {r[1] for r in fake.results}
            assert {"device_to_host", "host_to_storage"} <= kinds, kinds
        finally:
            for run in runs:
                run.close()

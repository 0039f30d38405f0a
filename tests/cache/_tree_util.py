"""Shared helpers of the prefix-tree tests: a real device/host/storage stack, a per-token KV
oracle, byte-exact readers of every tier, and an invariant checker that walks the tree.

KV is a function of the token prefix (as a model's would be): the oracle draws random,
never-zero values for each prefix the first time it is seen, so a sequence that shares a prefix
with another has the same KV for it, and every copy the tree makes can be compared exactly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tiered_kv.cache.manager import CacheManager
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host.host_kv_cache import host_pool_for
from tiered_kv.storage.keys import StorageNamespace, page_digests
from tiered_kv.storage.memory_store import MemoryStorage
from tiered_kv.transfer.device_host import DeviceHostTransfer
from tiered_kv.transfer.host_storage import HostStorageTransfer
from tiered_kv.tree.node import TreeNode, first_page, path_to_root, walk
from tiered_kv.tree.tiered_tree import TieredTree

HEADS, HEAD_DIM, LAYERS = 3, 5, 3  # irregular on purpose
DTYPE = torch.float32
HUGE = 1 << 40


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: torch's OpenMP workers only fight the copy threads on a 2-core box. With
    two threads on two cores every small op ends at a barrier whose other thread spins or waits
    for a core: next to any other busy process the random workloads ran 4-80x slower (the state
    cache's fault test 2.3 s quiet, 182 s beside a two-thread torch loop; one thread: 2.9 s),
    while quiet they take the same time on one thread. Every cache and engine test runs inside
    it (their ``conftest.py``)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def as_int(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_bytes_equal(got: torch.Tensor, exp: torch.Tensor, what: str) -> None:
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    if not torch.equal(as_int(got), as_int(exp)):
        bad = (as_int(got) != as_int(exp)).reshape(got.shape[0], got.shape[1], -1).any(-1)
        raise AssertionError(f"{what}: (layer, token) differ at {bad.nonzero()[:8].tolist()}")


class Stack:
    """MHATokenToKVPool + paged allocator + page_first host pool + transfer workers (+ storage)
    + the tree and its manager, with a KV oracle."""

    def __init__(
        self,
        gen: torch.Generator,
        *,
        page_size: int = 4,
        device_pages: int = 8,
        host_pages: int = 16,
        write_policy: str = "write_through",
        device_policy: str = "lru",
        host_policy: str = "lru",
        storage: bool | MemoryStorage = True,
        storage_cls: type[MemoryStorage] = MemoryStorage,
        selective_hits: int = 2,
        storage_batch_pages: int = 32,
    ) -> None:
        self.gen = gen
        self.P = page_size
        size = device_pages * page_size
        self.pool = MHATokenToKVPool(size, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu")
        self.alloc = PagedTokenToKVPoolAllocator(size, page_size, DTYPE, "cpu", kvcache=self.pool)
        self.host = host_pool_for(
            self.pool.host_pool_decls()[0],
            self.alloc,
            layout="page_first",
            size_tokens=host_pages * page_size,
            reserve_bytes=0,
            kernel_backend="torch",
        )
        self.ns = StorageNamespace.for_host_pool(self.host, model="test-model")
        if storage is True:
            self.storage = storage_cls(self.ns, self.host.page_nbytes)
        else:
            self.storage = storage or None
        self.device_host = DeviceHostTransfer(self.alloc, self.host)
        self.host_storage = None
        if self.storage is not None:
            self.host_storage = HostStorageTransfer(
                self.host, self.storage, batch_pages=storage_batch_pages
            )
        self.tree = TieredTree(
            page_size,
            device_policy=device_policy,
            host_policy=host_policy,
            digests=self.storage is not None,
        )
        self.manager = CacheManager(
            self.tree,
            self.alloc,
            self.host,
            self.device_host,
            self.host_storage,
            store=self.storage,
            namespace=self.ns if self.storage is not None else None,
            write_policy=write_policy,
            selective_hits=selective_hits,
        )
        self.device0 = self.alloc.available_size()
        self.host0 = self.host.available_size()
        self._kv: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drain()
        self.device_host.close()
        if self.host_storage is not None:
            self.host_storage.close()

    # -- the oracle --------------------------------------------------------------------------
    def _rand(self) -> torch.Tensor:
        shape = (LAYERS, HEADS, HEAD_DIM)
        mag = torch.rand(shape, generator=self.gen) + 0.125  # never zero
        sign = torch.randint(0, 2, shape, generator=self.gen) * 2 - 1
        return mag * sign

    def expected(self, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Oracle K and V of ``tokens`` as ``(L, n, H, D)``."""
        tokens = tuple(int(t) for t in tokens)
        ks, vs = [], []
        for i in range(len(tokens)):
            p = tokens[: i + 1]
            if p not in self._kv:
                self._kv[p] = (self._rand(), self._rand())
            k, v = self._kv[p]
            ks.append(k)
            vs.append(v)
        if not ks:
            empty = torch.empty(LAYERS, 0, HEADS, HEAD_DIM)
            return empty, empty
        return torch.stack(ks, 1), torch.stack(vs, 1)

    def write_device(self, slots: torch.Tensor, tokens) -> None:
        k, v = self.expected(tokens)
        for layer in range(LAYERS):
            self.pool.set_kv_buffer(layer, slots, k[layer], v[layer])

    # -- readers -----------------------------------------------------------------------------
    def device_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.stack([self.pool.k_buffer[i][slots] for i in range(LAYERS)])
        v = torch.stack([self.pool.v_buffer[i][slots] for i in range(LAYERS)])
        return k, v

    def host_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.host.part_view("k"), self.host.part_view("v")
        return k[:, slots].clone(), v[:, slots].clone()

    def storage_kv(self, keys: list[bytes]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pages stored under ``keys``, read back through a scratch host pool."""
        scratch = host_pool_for(
            self.pool.host_pool_decls()[0],
            self.alloc,
            layout="page_first",
            size_tokens=max(1, len(keys)) * self.P,
            reserve_bytes=0,
            kernel_backend="torch",
        )
        ok = self.storage.batch_get(keys, scratch, list(range(len(keys))))
        if not all(ok):
            return None
        slots = torch.arange(len(keys) * self.P)
        return scratch.part_view("k")[:, slots].clone(), scratch.part_view("v")[:, slots].clone()

    def _suffix(self, tokens, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Oracle KV of the last ``n`` tokens of ``tokens`` (a node's part of its path)."""
        ek, ev = self.expected(tokens)
        return ek[:, len(tokens) - n :], ev[:, len(tokens) - n :]

    def assert_device(self, slots, tokens, what="device") -> None:
        """Device slots ``slots`` hold the KV of the last ``len(slots)`` tokens of ``tokens``."""
        k, v = self.device_kv(slots)
        ek, ev = self._suffix(tokens, len(slots))
        assert_bytes_equal(k, ek, f"{what} K")
        assert_bytes_equal(v, ev, f"{what} V")

    def assert_host(self, slots, tokens, what="host") -> None:
        k, v = self.host_kv(slots)
        ek, ev = self._suffix(tokens, len(slots))
        assert_bytes_equal(k, ek, f"{what} K")
        assert_bytes_equal(v, ev, f"{what} V")

    # -- driving the tree --------------------------------------------------------------------
    def put(self, tokens, *, evict: bool = True) -> int | None:
        """Allocate device slots for ``tokens`` (whole pages), write their oracle KV, insert,
        and free the duplicate slots. Returns insert's result, or None if no room."""
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        slots = self.alloc.alloc(n)
        if slots is None and evict:
            self.manager.make_device_room(n)
            slots = self.alloc.alloc(n)
        if slots is None:
            return None
        self.write_device(slots, tokens)
        dup = self.manager.insert(tokens, slots)
        if dup:
            self.alloc.free(slots[:dup])
        return dup

    def drain(self, timeout_s: float = 20.0) -> None:
        """Wait for every copy and backup in flight and acknowledge them."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.manager.wait_all()
            self.manager.poll()
            if not self.manager.pending_ops():
                return
            assert time.monotonic() < deadline, f"{self.manager.pending_ops()} ops never finished"
            time.sleep(0.001)

    def clear(self) -> None:
        self.drain()
        self.manager.evict_device(HUGE)
        self.drain()
        self.manager.evict_host(HUGE)
        self.drain()

    def node(self, tokens) -> TreeNode:
        """The node whose path ends exactly at ``tokens``."""
        key = tuple(int(t) for t in tokens)
        n, pos = self.tree.root, 0
        while pos < len(key):
            n = n.children[first_page(key[pos:], self.P)]
            assert key[pos : pos + len(n)] == n.key, "no node ends exactly there"
            pos += len(n)
        return n

    def keys_of(self, tokens, prior: bytes = b"") -> list[bytes]:
        return [self.ns.fingerprint + d for d in page_digests(list(tokens), self.P, prior)]


def stack_factory(gen: torch.Generator):
    """Body of a ``make_stack`` fixture: yields a Stack factory, closes every stack after."""
    stacks: list[Stack] = []

    def factory(**kw) -> Stack:
        s = Stack(gen, **kw)
        stacks.append(s)
        return s

    yield factory
    for s in stacks:
        s.close()


# -- tree structure ---------------------------------------------------------------------------
def path_tokens(node: TreeNode) -> tuple:
    parts = [n.key for n in path_to_root(node)]
    return tuple(t for key in reversed(parts) for t in key)


def attached(tree: TieredTree, node: TreeNode) -> bool:
    """Whether ``node`` is reachable from the root."""
    n = node
    while n.parent is not None:
        if n.parent.children.get(first_page(n.key, tree.page_size)) is not n:
            return False
        n = n.parent
    return n is tree.root


def per_token(node: TreeNode, attr: str) -> list[int | None]:
    """Per token of ``node``'s path, its slot on that tier (None where not resident)."""
    out: list[int | None] = []
    for n in reversed(list(path_to_root(node))):
        slots = getattr(n, attr)
        out.extend(slots.tolist() if slots is not None else [None] * len(n))
    return out


def check_invariants(stack: Stack, *, outside_device: int = 0, outside_host: int = 0) -> None:
    """Structural invariants of the tree: the library's own check (``check_integrity``), then
    the same invariants walked here against the real pools. ``outside_*``: slots the test
    itself holds (not in the tree, not free)."""
    stack.manager.check_integrity(outside_device=outside_device, outside_host=outside_host)
    tree, P = stack.tree, stack.P
    root = tree.root
    dev_seen: set[int] = set()
    host_seen: set[int] = set()
    free_dev_pages = set(stack.alloc.get_all_free_pages().tolist())
    dev_tokens = host_tokens = 0
    for n in walk(root):
        where = f"{n!r} at depth {len(path_tokens(n)) - len(n)}"
        assert n.parent is not None and n.parent.children.get(first_page(n.key, P)) is n, where
        assert len(n) > 0 and len(n) % P == 0, f"{where}: not whole pages"
        for ck, c in n.children.items():
            assert ck == first_page(c.key, P) and c.parent is n, f"{where}: bad child link"
        assert n.on_device or n.on_host, f"{where}: on neither device nor host"
        if n.on_device:
            assert n.parent is root or n.parent.on_device, f"{where}: device not prefix-closed"
            assert len(n.device) == len(n), f"{where}: device slots != tokens"
            s = n.device.tolist()
            assert not dev_seen.intersection(s), f"{where}: device slot owned twice"
            dev_seen.update(s)
            pages = {x // P for x in s}
            assert not pages & free_dev_pages, f"{where}: owns device pages the allocator has free"
            assert all(x % P == i % P for i, x in enumerate(s)), f"{where}: device not page runs"
            dev_tokens += len(n)
            assert n in tree.device_policy, f"{where}: on device but unknown to device policy"
        else:
            assert n not in tree.device_policy, f"{where}: device policy tracks a non-resident"
        if n.on_host:
            assert len(n.host) == len(n), f"{where}: host slots != tokens"
            s = n.host.tolist()
            assert not host_seen.intersection(s), f"{where}: host slot owned twice"
            host_seen.update(s)
            assert bool(stack.host.allocator.is_allocated(n.host).all()), f"{where}: host free"
            host_tokens += len(n)
            assert n in tree.host_policy, f"{where}: on host but unknown to host policy"
        else:
            assert n not in tree.host_policy, f"{where}: host policy tracks a non-resident"
        assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()) >= 0, where
        assert n.host_ref >= sum(c.host_ref for c in n.children.values()) >= 0, where
        if tree.digests:
            exp = page_digests(list(n.key), P, n.parent.last_digest())
            assert n.digests == exp, f"{where}: digests are not the page chain"
        for kind, job_id in n.pending.items():
            assert n in tree.job_nodes(job_id), f"{where}: pending {kind} job does not list it"
    assert stack.alloc.available_size() + dev_tokens + outside_device == stack.device0, (
        "device slots leaked or double counted: "
        f"{stack.alloc.available_size()} free + {dev_tokens} in tree + {outside_device} held "
        f"!= {stack.device0}"
    )
    assert stack.host.available_size() + host_tokens + outside_host == stack.host0, (
        "host slots leaked or double counted: "
        f"{stack.host.available_size()} free + {host_tokens} in tree + {outside_host} held "
        f"!= {stack.host0}"
    )


def check_data(stack: Stack) -> None:
    """Every resident copy holds its oracle KV (call after ``drain``)."""
    for n in walk(stack.tree.root):
        toks = path_tokens(n)
        k, v = stack.expected(toks)
        ek, ev = k[:, len(toks) - len(n) :], v[:, len(toks) - len(n) :]
        if n.on_device:
            gk, gv = stack.device_kv(n.device)
            assert_bytes_equal(gk, ek, f"{n!r} device K")
            assert_bytes_equal(gv, ev, f"{n!r} device V")
        if n.on_host:
            gk, gv = stack.host_kv(n.host)
            assert_bytes_equal(gk, ek, f"{n!r} host K")
            assert_bytes_equal(gv, ev, f"{n!r} host V")

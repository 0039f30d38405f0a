"""Shared helpers of the transfer-worker tests: small CPU pools filled with random bits, an
independent oracle for host buffers (from the documented layout shapes alone, compared as
integers so NaN payloads compare exactly), a result collector that fails on a second delivery,
and a store wrapper that fails, blocks or slows down on demand.

Copied (not imported) from tests/host/_util.py and tests/storage/_util.py so that these tests
do not move when those helpers do.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator

import torch

from tests.host._util import canonical, host_snapshot  # noqa: F401 - re-exported for the tests here
from tests.storage._util import ByteSource  # noqa: F401 - re-exported
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host import host_pool_for
from tiered_kv.storage import LMDBStorage, StorageNamespace, page_keys
from tiered_kv.transfer import TransferResult, TransferWorker

TIMEOUT = 10.0
P = 4  # tokens per page
H, D = 3, 10  # heads and head dim of the rig pools
CPU = "cpu"

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -- pools ---------------------------------------------------------------------------------------
def ints(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's width (bit-exact comparisons)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def fill_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every byte of a contiguous tensor random (all bit patterns, NaNs included)."""
    assert t.is_contiguous()
    t.view(-1).view(torch.uint8).random_(0, 256, generator=gen)


def fill_device(pool, gen: torch.Generator) -> None:
    for t in pool.buffers():
        fill_bits(t, gen)


def make_pool(
    page_size: int = P,
    dtype: torch.dtype = torch.float32,
    *,
    pages: int = 10,
    layer_num: int = 5,
    start_layer: int | None = None,
    heads: int = H,
    head_dim: int = D,
):
    """An MHA device pool of ``pages`` usable pages and its paged allocator."""
    size = pages * page_size
    kw = {} if start_layer is None else {"start_layer": start_layer}
    pool = MHATokenToKVPool(size, page_size, dtype, heads, head_dim, layer_num, CPU, **kw)
    alloc = PagedTokenToKVPoolAllocator(size, page_size, dtype, CPU, kvcache=pool)
    return pool, alloc


# The kernel backend of make_host's pools: "torch" (the worker's Python copy threads) or
# "native" (the copy engine); set per test by conftest's ``copier`` fixture.
COPIER = {"kernel_backend": "torch"}


def make_host(pool, alloc, layout: str = "page_first", *, host_pages: int = 6):
    return host_pool_for(
        pool.host_pool_decls()[0],
        alloc,
        layout=layout,
        size_tokens=host_pages * pool.page_size,
        reserve_bytes=0,
        kernel_backend=COPIER["kernel_backend"],
    )


def part_columns(pool) -> dict[str, tuple[int, int]]:
    """Element columns [start, stop) of K and V inside one host record (K then V)."""
    k = pool.k_buffer[0].numel() // pool.k_buffer[0].shape[0]
    v = pool.v_buffer[0].numel() // pool.v_buffer[0].shape[0]
    return {"k": (0, k), "v": (k, k + v)}


def host_kv(host, local: int, host_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of host slots ``host_idx`` in local layer ``local``, as integers ``(n, elems)``,
    read through the oracle (the documented layout shapes), not the library's views."""
    snap = host_snapshot(host)
    cols = part_columns(host.decl.device_pool)
    k, v = (snap[local, host_idx, a:b].clone() for a, b in (cols["k"], cols["v"]))
    return k, v


def dev_rows(t: torch.Tensor) -> torch.Tensor:
    """Device rows as integers ``(n, elems)`` (comparable with ``host_kv``)."""
    return ints(t).reshape(t.shape[0], -1)


def token_bytes(pool) -> int:
    """Bytes of one token over all layers, K and V, from the geometry alone."""
    k = pool.k_buffer[0]
    return pool.layer_num * 2 * (k.numel() // k.shape[0]) * k.element_size()


def slots(alloc_fn, pages: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` of the slots of ``pages`` freshly allocated pages, shuffled."""
    got = alloc_fn(pages * P)
    assert got is not None
    return got[torch.randperm(len(got), generator=gen)][:n].clone()


# -- storage -------------------------------------------------------------------------------------
def keys_for(host, n_pages: int, gen: torch.Generator) -> list[bytes]:
    tokens = torch.randint(0, 2**31, (n_pages * host.page_size,), generator=gen)
    keys = page_keys(
        StorageNamespace.for_host_pool(host, model="test-model"), tokens, host.page_size
    )
    assert len(keys) == n_pages
    return keys


def page_run(pages: list[int] | torch.Tensor, page_size: int = P) -> torch.Tensor:
    """Host slots of ``pages``, whole pages in order (what a storage job takes)."""
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def host_pages(host, n_pages: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """``n_pages`` freshly allocated host pages in shuffled order, and their slots."""
    got = host.alloc(n_pages * host.page_size)
    assert got is not None
    pages = (got[:: host.page_size] // host.page_size)[torch.randperm(n_pages, generator=gen)]
    return pages.tolist(), page_run(pages, host.page_size)


def page_bytes(host, pages: list[int]) -> list[torch.Tensor]:
    return [host.get_page_bytes(p).clone() for p in pages]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    """Per page, whether the bytes are equal."""
    return [torch.equal(x, y) for x, y in zip(a, b, strict=True)]


def store_directly(store, keys, host, pages) -> None:
    assert all(store.batch_set(list(keys), host, list(pages)))


def min_lmdb_budget(tmp_path, ns: StorageNamespace, page_nbytes: int) -> int:
    """The smallest budget LMDBStorage accepts for these pages (read from its error message)."""
    try:
        LMDBStorage(tmp_path / "probe-min-budget", ns, page_nbytes, budget_bytes=1)
    except ValueError as exc:
        m = re.search(r"give at least (\d+)", str(exc))
        assert m, str(exc)
        return int(m.group(1))
    raise AssertionError("budget_bytes=1 was accepted")


class FlakyStorage:
    """Wraps a store. ``batch_get`` / ``batch_set`` raise from call number ``fail_*_from`` on;
    with ``gate`` they first block on it (bounded); ``entered`` is set when a call starts."""

    def __init__(self, inner, *, fail_get_from=None, fail_set_from=None, gate=None) -> None:
        self.inner = inner
        self.fail_get_from, self.fail_set_from = fail_get_from, fail_set_from
        self.gate = gate
        self.entered = threading.Event()
        self.gets = self.sets = 0

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, source, pages):
        self.gets += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        if self.fail_get_from is not None and self.gets >= self.fail_get_from:
            raise OSError("store directory vanished (get)")
        return self.inner.batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        self.sets += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        if self.fail_set_from is not None and self.sets >= self.fail_set_from:
            raise OSError("store directory vanished (set)")
        return self.inner.batch_set(keys, source, pages)


# -- results -------------------------------------------------------------------------------------
def wait_for(fn: Callable[[], list], n: int = 1, timeout: float = TIMEOUT) -> list:
    """Call the non-blocking ``fn`` until it has returned ``n`` items in all (never more)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        out.extend(fn())
        if time.monotonic() > deadline:
            raise AssertionError(f"only {out!r} after {timeout} s")
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} items, got {out!r}"
    return out


def brief(results: list[TransferResult]) -> list[tuple]:
    """(job_id, direction, ok, nbytes) of each result: what most assertions compare."""
    return [(r.job_id, str(r.direction), r.ok, r.nbytes) for r in results]


class Results:
    """Every result a worker's ``poll`` delivers, by job id; a second delivery of one id (or a
    result for a job never submitted) fails the test."""

    def __init__(self, worker: TransferWorker) -> None:
        self.worker = worker
        self.by_id: dict[int, TransferResult] = {}
        self.order: list[int] = []
        self.submitted: set[int] = set()

    def submit(self, job) -> bool:
        ok = self.worker.submit(job)
        if ok:
            self.submitted.add(job.job_id)
        return ok

    def poll(self) -> list[TransferResult]:
        got = self.worker.poll()
        for r in got:
            assert r.job_id not in self.by_id, f"job {r.job_id} delivered twice"
            assert r.job_id in self.submitted, f"result for job {r.job_id}, never submitted"
            self.by_id[r.job_id] = r
            self.order.append(r.job_id)
        return got

    def result(self, job_id: int, timeout: float = TIMEOUT) -> TransferResult:
        """Wait for ``job_id`` (bounded) and poll until its result has come."""
        assert self.worker.wait([job_id], timeout), f"job {job_id} did not finish"
        deadline = time.monotonic() + timeout
        while job_id not in self.by_id:
            self.poll()
            assert time.monotonic() < deadline, f"job {job_id} finished but never delivered"
            if job_id not in self.by_id:
                time.sleep(0.001)
        return self.by_id[job_id]

    def drain(self, timeout: float = TIMEOUT) -> None:
        """Wait for everything in flight and poll until every submitted job has a result."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.worker.wait(None, timeout), "jobs in flight never finished"
            self.poll()
            if self.submitted <= self.by_id.keys():
                assert self.worker.in_flight == 0
                return
            assert time.monotonic() < deadline, (
                f"never delivered: {sorted(self.submitted - self.by_id.keys())}"
            )
            time.sleep(0.001)


# -- the irregular KV geometry of the contract tests ---------------------------------------------
KV_HEADS, KV_HEAD_DIM, KV_LAYERS = 3, 5, 3  # irregular on purpose


def kv_rig(*, device_pages: int = 12, host_pages: int = 24):
    """An f32 MHA pool (3 heads, head_dim 5, 3 layers, page size 4), its allocator and a
    page_first host pool; no data yet (``fresh_*`` fill it)."""
    pool, alloc = make_pool(
        P,
        torch.float32,
        pages=device_pages,
        layer_num=KV_LAYERS,
        heads=KV_HEADS,
        head_dim=KV_HEAD_DIM,
    )
    return pool, alloc, make_host(pool, alloc, "page_first", host_pages=host_pages)


def nonzero(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random f32 values that are never zero (so a missing copy never matches by accident)."""
    mag = torch.rand(shape, generator=gen) + 0.125
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return mag * sign


def fresh_device(pool, idx: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh random K and V into device slots ``idx`` of every layer; returns them
    ``(L, n, H, D)``."""
    k = nonzero(gen, pool.layer_num, len(idx), *pool.k_buffer[0].shape[1:])
    v = nonzero(gen, pool.layer_num, len(idx), *pool.v_buffer[0].shape[1:])
    for i in range(pool.layer_num):
        pool.k_buffer[i][idx] = k[i]
        pool.v_buffer[i][idx] = v[i]
    return k, v


def fresh_host(host, idx: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh random K and V into host slots ``idx`` of every layer; returns them."""
    kv, vv = host.part_view("k"), host.part_view("v")
    k = nonzero(gen, kv.shape[0], len(idx), *kv.shape[2:])
    v = nonzero(gen, vv.shape[0], len(idx), *vv.shape[2:])
    kv[:, idx] = k
    vv[:, idx] = v
    return k, v


def device_kv(pool, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of device slots ``idx``, raw buffers (no layer wait), ``(L, n, H, D)``."""
    k = torch.stack([pool.k_buffer[i][idx] for i in range(pool.layer_num)])
    v = torch.stack([pool.v_buffer[i][idx] for i in range(pool.layer_num)])
    return k, v


def host_kv_all(host, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return host.part_view("k")[:, idx].clone(), host.part_view("v")[:, idx].clone()


def assert_same_bits(got: torch.Tensor, exp: torch.Tensor, what: str) -> None:
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    g, e = ints(got.contiguous()), ints(exp.contiguous())
    if not torch.equal(g, e):
        bad = (g != e).reshape(g.shape[0], g.shape[1], -1).any(-1).nonzero()[:8].tolist()
        raise AssertionError(f"{what}: (layer, slot) differ at {bad}")


def stored_bytes(store, keys: list[bytes], page_nbytes: int) -> list[torch.Tensor] | None:
    """The pages stored under ``keys``, read back through a ByteSource (None if one is not)."""
    src = ByteSource(page_nbytes, max(1, len(keys)))
    if not all(store.batch_get(list(keys), src, list(range(len(keys))))):
        return None
    return [src.buf[i].clone() for i in range(len(keys))]

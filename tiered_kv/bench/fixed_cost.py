"""Fixed cost of one transfer op per direction: the intercept of time against bytes.

For each page count in ``PAGE_COUNTS`` (1 .. 256 pages) one op is timed end to end through the
worker's contract, the way the cache manager drives it:

- ``device_to_host``: ``DeviceHostTransfer.submit(TransferJob.write(...))`` .. ``wait`` ..
  ``poll`` returning its ok result;
- ``host_to_device``: the same for ``TransferJob.load`` (one layer-wise job, every layer);
- ``host_to_storage`` / ``storage_to_host``: ``HostStorageTransfer`` backup / prefetch of the
  pages as one batch (``batch_pages`` >= the largest count) into a fresh slab store.

Each (direction, page count) keeps its median; a least-squares line through (bytes, median
seconds), weighted for relative error, gives the fixed cost (intercept) and the streaming rate
(1 / slope). With ``warm`` the ops of one direction and size run back to back (after
``WARM_OPS`` untimed ones), as an engine issues a step's copies; without, cells are interleaved
round-robin (``timing.interleave``) and each op follows another cell's op: often a blocking
wait, or a copy of up to 256 pages that has streamed tens of MiB through the caches the
interpreter runs from. :func:`idle_penalty`
measures what a blocking wait alone costs the code run after it on this machine (a control).
Every op's result must be ok and the loaded / prefetched bytes are compared with their source
(``verify.fail`` on a mismatch).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tiered_kv.bench.timing import interleave, median
from tiered_kv.bench.transfer import Geometry, make_allocator, make_pool
from tiered_kv.bench.verify import fail, fill_random, int_view
from tiered_kv.errors import TransferError
from tiered_kv.host import host_pool_for
from tiered_kv.names import Direction
from tiered_kv.storage import SlabStorage, StorageNamespace, page_keys
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob

PAGE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARM_OPS = 5  # untimed ops before a cell's timed ones, back to back


@dataclass(frozen=True)
class FixedCost:
    """One direction's fit: ``fixed_us`` + bytes / ``gbps``; points are (bytes, median s)."""

    direction: str
    fixed_us: float
    gbps: float
    points: tuple[tuple[int, float], ...]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept seconds, slope seconds per byte) of a least-squares line of relative error:
    the points span 2.5 decades of bytes, and a plain fit lets the largest ones set the
    intercept (plus or minus hundreds of us: even negative ones)."""
    x = np.array([b for b, _ in points], dtype=np.float64)
    y = np.array([s for _, s in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    return float(intercept), float(slope)


def _cost(direction: str, nbytes: list[int], seconds: dict[int, list[float]]) -> FixedCost:
    points = [(b, median(seconds[n])) for n, b in zip(PAGE_COUNTS, nbytes, strict=True)]
    intercept, slope = fit(points)
    return FixedCost(
        direction, intercept * 1e6, 1 / slope / 1e9 if slope > 0 else 0.0, tuple(points)
    )


def _timed_op(worker, job: TransferJob) -> float:
    t = time.perf_counter()
    if not worker.submit(job):
        raise TransferError(f"{job.direction} job {job.job_id} was refused")
    worker.wait([job.job_id])
    results = worker.poll()
    elapsed = time.perf_counter() - t
    if [(r.job_id, r.ok) for r in results] != [(job.job_id, True)]:
        fail(str(job.direction), f"results {results}, expected job {job.job_id} ok", TransferError)
    return elapsed


def idle_penalty(repeats: int = 200) -> tuple[float, float]:
    """Median us of a fixed mix of small torch ops and Python (what submitting an op runs)
    back to back, and right after a 5 ms blocking wait: a control for the machine, not a
    measurement of tiered_kv."""
    x = torch.arange(8)
    pause = threading.Event()

    def work() -> float:
        t = time.perf_counter()
        for _ in range(10):
            y = x.clone().to(torch.int64).contiguous()
            torch.empty(8, dtype=torch.int64).copy_(y)
        return time.perf_counter() - t

    warm, after = [], []
    for _ in range(repeats):
        warm.append(work())
        pause.wait(0.005)
        after.append(work())
    return median(warm) * 1e6, median(after) * 1e6


def measure_fixed_cost(
    geom: Geometry, page_size: int, repeats: int, seed: int = 0, warm: bool = False
) -> list[FixedCost]:
    """The four directions' fits on CPU (see the module docstring)."""
    most = max(PAGE_COUNTS) * page_size
    size = 2 * most + 2 * page_size
    device = torch.device("cpu")
    pool = make_pool(geom, size, page_size, device)
    alloc = make_allocator(pool, size)
    fill_random(pool.buffers(), seed, device)
    (decl,) = pool.host_pool_decls()
    host = host_pool_for(decl, alloc, layout="page_first", size_tokens=2 * most)
    int_view(host.buffer).fill_(1)
    src, dst = alloc.alloc(most), alloc.alloc(most)
    hst, back = host.alloc(most), host.alloc(most)
    page_nbytes = host.page_nbytes
    namespace = StorageNamespace.for_host_pool(host, model="fixed-cost")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2**31, (max(PAGE_COUNTS) * page_size,), generator=gen)
    keys = page_keys(namespace, tokens, page_size)
    tmp = tempfile.mkdtemp(prefix="tkv-fixed-")
    store = SlabStorage(
        tmp, namespace, page_nbytes, budget_bytes=(64 << 20) + 4 * most * page_nbytes
    )
    dh = DeviceHostTransfer(alloc, host, io_backend="kernel")
    hs = HostStorageTransfer(host, store, batch_pages=max(PAGE_COUNTS))
    ids = iter(range(1 << 62))
    counter = {"n": 0}

    def device_host(n: int, load: bool) -> float:
        t = n * page_size
        if load:
            return _timed_op(dh, TransferJob.load(next(ids), hst[:t].clone(), dst[:t].clone()))
        return _timed_op(dh, TransferJob.write(next(ids), src[:t].clone(), hst[:t].clone()))

    def storage(n: int, to_storage: bool) -> float:
        t = n * page_size
        if to_storage:
            # Fresh keys every round: a key already stored would be skipped, not written.
            counter["n"] += 1
            fresh = page_keys(namespace, tokens[:t] + counter["n"] * 7919, page_size)
            return _timed_op(hs, TransferJob.backup(next(ids), fresh, hst[:t].clone()))
        return _timed_op(hs, TransferJob.prefetch(next(ids), keys[:n], back[:t].clone()))

    try:
        # The timed writes copy src into hst again, so what was stored stays hst's bytes.
        host.backup_from_device_all_layer(pool, hst, src)
        _timed_op(hs, TransferJob.backup(next(ids), keys, hst.clone()))  # what prefetch reads
        arms = {}
        for n in PAGE_COUNTS:
            arms[("d2h", n)] = lambda _r, n=n: device_host(n, False)
            arms[("h2d", n)] = lambda _r, n=n: device_host(n, True)
            arms[("h2s", n)] = lambda _r, n=n: storage(n, True)
            arms[("s2h", n)] = lambda _r, n=n: storage(n, False)
        if warm:  # each cell's ops back to back after WARM_OPS untimed ones (the cell before
            # may have streamed 32 MiB through the caches: measured, one op is not enough to
            # recover); prefetches before the backups, whose fresh pages would evict what the
            # prefetches read
            order = sorted(arms, key=lambda key: ["d2h", "h2d", "s2h", "h2s"].index(key[0]))
            got = {
                key: [arms[key](None) for _ in range(repeats + WARM_OPS)][WARM_OPS:]
                for key in order
            }
        else:
            got = interleave(arms, repeats, warmup=1)
        _verify(pool, host, decl.layer_ids, src, dst, hst, back, most)
    finally:
        dh.close()
        hs.close()
        store.close()
        host.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    nbytes = [n * page_nbytes for n in PAGE_COUNTS]
    names = {
        "d2h": Direction.DEVICE_TO_HOST,
        "h2d": Direction.HOST_TO_DEVICE,
        "h2s": Direction.HOST_TO_STORAGE,
        "s2h": Direction.STORAGE_TO_HOST,
    }
    return [_cost(str(d), nbytes, {n: got[(k, n)] for n in PAGE_COUNTS}) for k, d in names.items()]


def _verify(pool, host, layer_ids, src, dst, hst, back, most: int) -> None:
    for layer in layer_ids:
        for name, buf in (("K", pool.get_key_buffer(layer)), ("V", pool.get_value_buffer(layer))):
            if not torch.equal(int_view(buf[dst]), int_view(buf[src])):
                fail("fixed cost", f"layer {layer} {name}: loaded bytes differ", TransferError)
    for i in range(0, most, host.page_size):
        got = host.get_page_bytes(int(back[i]) // host.page_size)
        want = host.get_page_bytes(int(hst[i]) // host.page_size)
        if not torch.equal(got, want):
            fail("fixed cost", f"prefetched page at slot {int(back[i])} differs", TransferError)

"""Why a write through LMDB's map is slower than ``write()`` into a new file, and what helps.

The same random bytes (in chunks) go into a new file five ways, round-robin within each repeat
(``timing.interleave``: ``pwrite``, the baseline, runs in every round next to the others):

- ``pwrite``: ``os.pwrite`` of each chunk (what the file-per-page store's set does): the kernel
  allocates page-cache folios and copies; no zero-fill for whole pages;
- ``map sparse``: ``ftruncate`` to the size, then a memcpy of each chunk into a shared writable
  mapping (what LMDB with ``writemap`` does on a fresh region): one write fault per 4 KiB page,
  each allocating a page-cache page, zero-filling it and reserving its disk block;
- ``map reserved``: the same after ``fallocate`` of the whole file (what ``LMDBStorage`` does:
  ``storage.map_file.reserve``): the blocks exist, the faults remain;
- ``map reserved+huge``: the same with ``MADV_HUGEPAGE`` on the mapping;
- ``map reused``: a memcpy into the mapping of a file whose pages are already in the page cache
  and mapped (a store at its budget reusing freed pages: no allocation, no fault).

The file is ``os.sync``-ed before and removed after each way; every way's file is read back and
compared with the source first (a mismatch is a ``verify.fail``).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_kv.bench.timing import interleave, median
from tiered_kv.bench.verify import fail
from tiered_kv.errors import StateError
from tiered_kv.storage import map_file

MIB = 1 << 20
WAYS = ("pwrite", "map sparse", "map reserved", "map reserved+huge", "map reused")


@dataclass
class Result:
    way: str
    gbps: float
    ratio: float  # median GB/s over pwrite's median GB/s
    samples_gbps: list[float]


def write_once(way: str, path: Path, src: np.ndarray, chunk: int) -> float:
    """Seconds to write ``src`` into a new file at ``path`` the given way (the mapping is
    compared with ``src`` after the clock stops)."""
    n = src.size
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if way == "pwrite":
            t0 = time.perf_counter()
            for off in range(0, n, chunk):
                os.pwrite(fd, memoryview(src[off : off + chunk]), off)
            return time.perf_counter() - t0
        if way == "map sparse":
            os.ftruncate(fd, n)
        else:
            err = map_file.reserve(path, n)
            if err:
                raise StateError(
                    f"fallocate failed on {path}: {os.strerror(err)}; pass --dir on a file "
                    "system that supports it"
                )
        m = mmap.mmap(fd, n, mmap.MAP_SHARED)
        dst = np.frombuffer(m, dtype=np.uint8)
        try:
            if way == "map reserved+huge":
                map_file.advise_hugepages(path)
            if way == "map reused":
                dst[:] = src[::-1]  # every page in the page cache and mapped, other bytes
                os.sync()
            t0 = time.perf_counter()
            for off in range(0, n, chunk):
                dst[off : off + chunk] = src[off : off + chunk]
            seconds = time.perf_counter() - t0
            if not np.array_equal(dst, src):
                fail(way, "the mapping differs from src")
            return seconds
        finally:
            del dst
            m.close()
    finally:
        os.close(fd)


def _way_arm(way: str, src: np.ndarray, chunk: int, workdir: str):
    def arm(_: object) -> float:
        path = Path(tempfile.mkdtemp(prefix="map-write-", dir=workdir)) / "data"
        os.sync()
        try:
            seconds = write_once(way, path, src, chunk)
            with open(path, "rb") as f:
                if f.read() != src.tobytes():
                    fail(way, "file differs from src")
        finally:
            path.unlink(missing_ok=True)
            path.parent.rmdir()
        return src.size / seconds / 1e9

    return arm


def measure_map_write(mib: int, chunk_mib: float, repeats: int, workdir: str) -> list[Result]:
    """GB/s of every way, ``repeats`` rounds, medians; ratios over ``pwrite``."""
    chunk = max(4096, int(chunk_mib * MIB))
    src = np.random.default_rng(0).integers(0, 256, mib * MIB, dtype=np.uint8)
    samples = interleave({w: _way_arm(w, src, chunk, workdir) for w in WAYS}, repeats)
    base = median(samples["pwrite"])
    return [Result(w, median(s), median(s) / base, s) for w, s in samples.items()]

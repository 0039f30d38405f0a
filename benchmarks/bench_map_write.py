"""Why a write through LMDB's map is slower than ``write()`` into a new file, and what helps.

The same random bytes (``--mib``, in chunks of ``--chunk-mib``) go into a new file on the
benchmark's file system, five ways, in the same run (each repeat, every way once, in order):

- ``pwrite``: ``os.pwrite`` of each chunk (what the file-per-page store's set does): the kernel
  allocates page-cache folios and copies; no zero-fill for whole pages;
- ``map sparse``: ``ftruncate`` to the size, then a memcpy of each chunk into a shared writable
  mapping (what LMDB with ``writemap`` does on a fresh region): one write fault per 4 KiB page,
  each allocating a page-cache page, zero-filling it and reserving its disk block;
- ``map reserved``: the same after ``fallocate`` of the whole file (what ``LMDBStorage`` does:
  ``storage.map_file.reserve``): the blocks exist, the faults remain;
- ``map reserved+huge``: the same with ``MADV_HUGEPAGE`` on the mapping
  (``LMDBStorage(hugepages=True)``);
- ``map reused``: a memcpy into the mapping of a file whose pages are already in the page cache
  and mapped (a store at its budget reusing freed pages: no allocation, no fault).

GB/s is 1e9 bytes/s; ``vs pwrite`` is a way's median over pwrite's median. The file is
``os.sync``-ed and removed between ways; every way's file is read back and compared with the
source before it is removed.

Run::

    .venv/bin/python benchmarks/bench_map_write.py
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_kv.storage import map_file

MIB = 1 << 20
WAYS = ("pwrite", "map sparse", "map reserved", "map reserved+huge", "map reused")


@dataclass
class Result:
    way: str
    gbps: float
    ratio: float
    samples_gbps: list[float]


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _one(way: str, path: Path, src: np.ndarray, chunk: int) -> float:
    """Seconds to write ``src`` into a new file at ``path`` the given way (checked after)."""
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
                raise SystemExit(f"fallocate failed on {path}: {os.strerror(err)}")
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
                raise SystemExit(f"CORRECTNESS FAILURE [{way}]: the mapping differs from src")
            return seconds
        finally:
            del dst
            m.close()
    finally:
        os.close(fd)


def run(mib: int, chunk_mib: float, repeats: int, workdir: str) -> list[Result]:
    n = mib * MIB
    chunk = max(4096, int(chunk_mib * MIB))
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    samples: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(repeats):
        for way in WAYS:
            path = Path(tempfile.mkdtemp(prefix="map-write-", dir=workdir)) / "data"
            os.sync()
            try:
                seconds = _one(way, path, src, chunk)
                with open(path, "rb") as f:
                    if f.read() != src.tobytes():
                        raise SystemExit(f"CORRECTNESS FAILURE [{way}]: file differs from src")
            finally:
                path.unlink(missing_ok=True)
                path.parent.rmdir()
            samples[way].append(n / seconds / 1e9)
    base = statistics.median(samples["pwrite"])
    return [
        Result(w, statistics.median(s), statistics.median(s) / base, s) for w, s in samples.items()
    ]


def main(argv: Sequence[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes written per way, MiB")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per write / memcpy")
    ap.add_argument("--repeats", type=int, default=5, help="repeats (median)")
    ap.add_argument("--dir", default=None, help="parent of the files (default TMPDIR)")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or args.chunk_mib <= 0:
        ap.error("--mib and --repeats must be >= 1 and --chunk-mib > 0")
    workdir = args.dir or tempfile.gettempdir()
    print(
        f"{args.mib} MiB per way in {args.chunk_mib:g} MiB chunks, {args.repeats} repeats "
        f"(median), under {workdir}; load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    results = run(args.mib, args.chunk_mib, args.repeats, workdir)
    print(f"{'way':<20} {'GB/s':>6} {'vs pwrite':>9}  samples")
    for r in results:
        samples = " ".join(f"{x:.2f}" for x in r.samples_gbps)
        print(f"{r.way:<20} {r.gbps:>6.2f} {r.ratio:>9.2f}  {samples}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

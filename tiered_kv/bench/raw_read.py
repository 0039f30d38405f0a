"""The best raw read of a case's bytes from a cold page cache: the baseline of a cold get.

The case's pages are written once into one file, in order (buffered, then fsync-ed), and read
back three ways, each after the page cache was dropped: ``raw_buffered`` (``preadv`` of each
page whole into the destination host pages: kernel readahead), ``raw_buffered_chunks`` (the same
in 256 KiB reads, as the slab store reads) and ``raw_odirect`` (``O_DIRECT`` reads of each page
into a page-aligned buffer, where the page size allows it and the file system takes it). Every
read-back is compared with the source. A cold get is graded against the fastest of them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import numpy as np

from tiered_kv.bench.disk import cached_mib, drop_page_cache
from tiered_kv.bench.odirect import AlignedBuffer
from tiered_kv.bench.storage import Case, Times
from tiered_kv.bench.timing import timed
from tiered_kv.bench.verify import fail

RAW_OPS = ("raw_buffered", "raw_buffered_chunks", "raw_odirect")
CHUNK = 256 << 10


def _read_all(fd: int, views: list[memoryview], page_nbytes: int, chunk: int) -> None:
    for i, view in enumerate(views):
        for start in range(0, page_nbytes, chunk):
            part = view[start : start + chunk]
            if os.preadv(fd, [part], i * page_nbytes + start) != len(part):
                fail("raw read", f"short read of page {i} at {start}")


def raw_read_times(case: Case, workdir: str, drop: Callable[[], bool] = drop_page_cache) -> Times:
    """``RAW_OPS`` seconds of reading the case's bytes cold (``raw_odirect`` absent where
    O_DIRECT cannot be used: a page size not a multiple of 4 KiB, or a refusing file system)."""
    path = os.path.join(workdir, "raw-read.bin")
    n, size = case.n, case.page_nbytes
    src = case.src_rows()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i in range(n):
            os.pwrite(fd, memoryview(src[i]), i * size)
        os.fsync(fd)
    finally:
        os.close(fd)
    out: Times = {}
    dst = case.dst_rows()
    views = [memoryview(dst[i]) for i in range(n)]
    try:
        for op, chunk in (("raw_buffered", size), ("raw_buffered_chunks", CHUNK)):
            dst.fill(0)
            if not drop():
                fail("raw read", "dropping the page cache failed")
            before = cached_mib()
            fd = os.open(path, os.O_RDONLY)
            try:
                out[op] = (timed(lambda fd=fd, c=chunk: _read_all(fd, views, size, c)), before)
            finally:
                os.close(fd)
            if not np.array_equal(dst, src):
                fail(f"size={case.size_mib:g} MiB {op}", "read-back differs from written")
        if size % 4096 == 0:
            got = _odirect(path, case, drop)
            if got is not None:
                out["raw_odirect"] = got
    finally:
        os.unlink(path)
    return out


def _odirect(path: str, case: Case, drop: Callable[[], bool]) -> tuple[float, float] | None:
    buf = AlignedBuffer(case.n * case.page_nbytes)
    try:
        views = [buf.view[i * case.page_nbytes : (i + 1) * case.page_nbytes] for i in range(case.n)]
        if not drop():
            fail("raw read", "dropping the page cache failed")
        before = cached_mib()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise
        try:
            seconds = timed(lambda: _read_all(fd, views, case.page_nbytes, case.page_nbytes))
        finally:
            os.close(fd)
        views.clear()
        if not np.array_equal(buf.array.reshape(case.n, -1), case.src_rows()):
            fail(f"size={case.size_mib:g} MiB raw_odirect", "read-back differs from written")
        return seconds, before
    finally:
        buf.close()

"""The disk's own limit: the same bytes written and read sequentially with ``O_DIRECT``.

One file, in chunks of the value size, from a page-aligned buffer (what O_DIRECT needs). If the
file system refuses ``O_DIRECT`` (EINVAL), buffered I/O with fsync and
``posix_fadvise(DONTNEED)`` stands in, and a note says so. O_DIRECT always reads the disk, so
there is a ``set`` and a ``cold_get`` only.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from tiered_kv.bench.disk import cached_mib
from tiered_kv.bench.storage import Case, Times
from tiered_kv.bench.timing import timed
from tiered_kv.bench.verify import fail

REFUSED = "O_DIRECT refused (EINVAL): buffered I/O + fsync + fadvise DONTNEED instead"


class AlignedBuffer:
    """A page-aligned anonymous mapping, as a numpy array."""

    def __init__(self, nbytes: int) -> None:
        # private: not counted as page cache (shmem) in /proc/meminfo
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.view = memoryview(self.map)

    def close(self) -> None:
        del self.array
        self.view.release()
        self.map.close()


def odirect_times(case: Case, workdir: str, notes: list[str]) -> Times:
    """Sequential write and read of the case's bytes, O_DIRECT, in chunks of the value size;
    the read-back is compared with the source. Appends ``REFUSED`` to ``notes`` on fallback."""
    fd_path = os.path.join(workdir, "odirect.bin")
    total = case.n * case.page_nbytes
    chunk = case.page_nbytes
    buf = AlignedBuffer(total)
    buf.array[:] = case.src_rows().reshape(-1)
    direct = getattr(os, "O_DIRECT", 0)
    out: Times = {}

    def write(flags: int) -> None:
        fd = os.open(fd_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            for off in range(0, total, chunk):
                os.pwrite(fd, buf.view[off : off + chunk], off)
            if not flags:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(flags: int) -> None:
        fd = os.open(fd_path, os.O_RDONLY | flags)
        try:
            for off in range(0, total, chunk):
                if os.preadv(fd, [buf.view[off : off + chunk]], off) != chunk:
                    fail("odirect", f"short read at {off}")
        finally:
            os.close(fd)

    try:
        try:
            out["set"] = (timed(lambda: write(direct), collect=True), None)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not direct:
                raise
            if REFUSED not in notes:
                notes.append(REFUSED)
            direct = 0
            out["set"] = (timed(lambda: write(0), collect=True), None)
        buf.array.fill(0)
        if not direct:
            fd = os.open(fd_path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        before = cached_mib()
        out["cold_get"] = (timed(lambda: read(direct), collect=True), before)
        if not np.array_equal(buf.array, case.src_rows().reshape(-1)):
            fail(f"size={case.size_mib:g} MiB store=odirect", "read-back differs from written")
    finally:
        buf.close()
        os.unlink(fd_path)
    return out

"""The data file under LMDB's memory map: reserving its disk blocks and advising the kernel.

With ``writemap`` LMDB writes pages through a shared mapping of a sparse file. A page fault that
needs a disk block on a full file system cannot return an error: the kernel sends ``SIGBUS`` and
the process dies. ``reserve`` allocates the blocks of the whole map with ``fallocate`` before
LMDB may touch them, so a full disk shows up as a failed reservation (the map then does not
grow, and writes evict or are skipped) instead of a crash. Allocated blocks also make the first
write fault on each page cheaper (no delayed-allocation reservation inside the fault).

``advise_hugepages`` marks the map ``MADV_HUGEPAGE``: the kernel then reads a cold value in
2 MiB folios and maps them with one fault each instead of one fault per 4 KiB page, and the
first write into a fresh region faults per folio as well. It is advice: where transparent huge
pages are off for files, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_MADV_HUGEPAGE = 14

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

# errno values that mean "this file system cannot reserve blocks ahead" (not "it is full")
UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


LOCK_BYTES = 64 << 10  # LMDB's lock file: its reader table for 256 readers, with room to spare


def reserve_new(path: Path, size: int) -> int:
    """Create ``path`` if missing and allocate disk blocks for its first ``size`` bytes (LMDB
    maps its lock file and writes through the mapping: on a full disk a sparse one is a
    SIGBUS). Returns 0 or the errno that stopped it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        return exc.errno or errno.EIO
    try:
        if _libc.fallocate(fd, 0, 0, size) != 0:
            return ctypes.get_errno() or errno.EIO
        return 0
    finally:
        os.close(fd)


def reserve(data_file: Path, size: int) -> int:
    """Allocate disk blocks for the first ``size`` bytes of ``data_file`` (growing the file to
    at least ``size``). Returns 0, or the errno that stopped it: ENOSPC / EDQUOT / EFBIG when
    there is no room, one of ``UNSUPPORTED`` when the file system has no ``fallocate``."""
    try:
        fd = os.open(data_file, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno or errno.EIO
    try:
        if _libc.fallocate(fd, 0, 0, size) != 0:
            return ctypes.get_errno() or errno.EIO
        return 0
    finally:
        os.close(fd)


def mappings_of(data_file: Path) -> list[tuple[int, int]]:
    """[start, end) address ranges of this process's mappings of ``data_file``."""
    try:
        st = data_file.stat()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[4] == str(st.st_ino) and fields[3] == dev:
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def advise_hugepages(data_file: Path) -> bool:
    """Ask for huge pages on every mapping of ``data_file``; True when at least one took it."""
    done = False
    for lo, hi in mappings_of(data_file):
        done |= _libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0
    return done

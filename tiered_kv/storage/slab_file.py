"""The file of slots behind :class:`SlabStorage`: one preallocated file per namespace, slot ``i``
at byte ``i * slot_bytes``, page bytes moved with ``pwritev`` / ``preadv`` straight from and into
host page memory.

``slot_bytes`` is the page size rounded up to 4 KiB, so a slot starts on a file-system block and
a write covers whole blocks (the tail is padded with zeros: the kernel never reads a block to
merge a partial write into it). Blocks are allocated with ``fallocate`` before a slot is first
written: a full disk is a failed allocation (an errno), never a lost write or a signal. Freed
slots give their blocks back with ``FALLOC_FL_PUNCH_HOLE`` when another namespace needs the room.

Writes and reads go in cache-sized chunks, each hashed (xxh3-64) right after it is written from
or read into the host page, while it is still in cache. Nothing here knows which slot is in
use: that is ``slab_books``' job, inside LMDB's transaction.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np
import xxhash

from tiered_kv.storage import map_file

BLOCK = 4096
CHUNK = 512 << 10  # write/read-then-hash chunk: in L2 (1 MiB here) when hashed; 256 KiB read 0.85x
_ZEROS = bytes(BLOCK)
_PUNCH_HOLE, _KEEP_SIZE = 0x02, 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


_CACHESTAT = 451  # the syscall's number on every architecture (Linux 6.5)
_has_cachestat = [True]


def _cached_blocks(fd: int, offset: int, length: int) -> int | None:
    """Pages of ``[offset, offset + length)`` in the page cache, or None where ``cachestat``
    is missing (then never asked again)."""
    if not _has_cachestat[0]:
        return None
    span, stat = _Range(offset, length), _CacheStat()
    call = map_file._libc.syscall
    if call(_CACHESTAT, ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(stat), ctypes.c_uint(0)):
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _has_cachestat[0] = False
        return None
    return stat.cache


def slot_bytes_for(page_nbytes: int) -> int:
    """Bytes one slot takes in the file: the page rounded up to whole 4 KiB blocks."""
    return -(-page_nbytes // BLOCK) * BLOCK


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    if map_file._libc.fallocate(fd, mode, offset, length) != 0:
        return ctypes.get_errno() or errno.EIO
    return 0


class SlabFile:
    """One namespace's file of slots. ``path`` is created if missing; every method that
    touches the disk returns an errno (0 on success) or raises ``OSError`` from the system
    call, never a signal (nothing here is memory-mapped)."""

    def __init__(self, path: Path, page_nbytes: int, create: bool = True) -> None:
        self.path = path
        self.page_nbytes = page_nbytes
        self.slot_bytes = slot_bytes_for(page_nbytes)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o644)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- blocks -------------------------------------------------------------------------------
    def allocate(self, first: int, count: int) -> int:
        """Allocate disk blocks for slots ``first .. first+count-1`` (growing the file if they
        lie past its end). 0, or the errno: ENOSPC / EDQUOT when the disk has no room. Where the
        file system cannot allocate ahead (one of ``map_file.UNSUPPORTED``), the file is only
        extended and 0 returned: a full disk then shows up as a write error instead."""
        off, length = first * self.slot_bytes, count * self.slot_bytes
        err = _fallocate(self.fd, 0, off, length)
        if err in map_file.UNSUPPORTED:
            try:
                if os.fstat(self.fd).st_size < off + length:
                    os.ftruncate(self.fd, off + length)
            except OSError as exc:
                return exc.errno or errno.EIO
            return 0
        return err

    def release(self, first: int, count: int = 1) -> int:
        """Give back the disk blocks of slots ``first .. first+count-1`` (a hole; the file keeps
        its size). 0, or the errno (EOPNOTSUPP where the file system cannot punch holes)."""
        mode = _PUNCH_HOLE | _KEEP_SIZE
        return _fallocate(self.fd, mode, first * self.slot_bytes, count * self.slot_bytes)

    def trim(self, slots: int) -> None:
        """Cut the file to ``slots`` slots if it is longer (blocks a writer allocated and never
        committed: it crashed or its transaction aborted)."""
        if os.fstat(self.fd).st_size > slots * self.slot_bytes:
            os.ftruncate(self.fd, slots * self.slot_bytes)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def disk_bytes(self) -> int:
        """Bytes of disk blocks the file holds (what ``du`` counts)."""
        return os.fstat(self.fd).st_blocks * 512

    # -- bytes --------------------------------------------------------------------------------
    def write(self, slot: int, page: memoryview) -> int:
        """Write ``page`` (exactly ``page_nbytes``) into ``slot``, zero-padded to the slot's
        end; returns its xxh3-64 checksum, each chunk hashed right after it was written.
        Raises ``OSError`` on a write error (a short write is retried, as the kernel may)."""
        base = slot * self.slot_bytes
        n = self.page_nbytes
        pad = self.slot_bytes - n
        hasher = xxhash.xxh3_64()
        for start in range(0, n, CHUNK):
            part = page[start : start + CHUNK]
            last = start + CHUNK >= n
            iov = [part, _ZEROS[:pad]] if last and pad else [part]
            want = len(part) + (pad if last else 0)
            done = os.pwritev(self.fd, iov, base + start)
            if done != want:
                self._finish_write(iov, done, base + start)
            hasher.update(part)
        return hasher.intdigest()

    def write_if_room(self, slot: int, page: memoryview) -> int | None:
        """``write``, or None where the disk had no block for the slot (ENOSPC, EDQUOT: a free
        slot whose blocks were given back by a transaction that then aborted). Other errors
        raise."""
        try:
            return self.write(slot, page)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return None
            raise

    def _finish_write(self, iov: list, done: int, offset: int) -> None:
        rest = b"".join(bytes(v) for v in iov)[done:]
        while rest:
            got = os.pwrite(self.fd, rest, offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += got
            rest = rest[got:]

    def cached(self, slot: int) -> bool:
        """Whether every block of ``slot`` is in the page cache and read (``cachestat``, Linux
        6.5+, which reads nothing; then a ``RWF_NOWAIT`` read of its last block, which fails on
        a block still being read in by readahead); True where the kernel cannot tell."""
        want = -(-self.page_nbytes // BLOCK)
        got = _cached_blocks(self.fd, slot * self.slot_bytes, want * BLOCK)
        if got is None:
            return True
        if got < want:
            return False
        try:
            last = slot * self.slot_bytes + (want - 1) * BLOCK
            return os.preadv(self.fd, [bytearray(BLOCK)], last, os.RWF_NOWAIT) > 0
        except BlockingIOError:
            return False
        except (OSError, AttributeError):
            return True

    def read_into(self, slot: int, dst: np.ndarray, checksum: int) -> bool:
        """Read ``slot`` into ``dst`` (a writable uint8 array of ``page_nbytes``), each chunk
        hashed right after it landed; whether the bytes match ``checksum``. A short read (a slot
        past the file's end) is False. ``dst`` may hold partial bytes after False."""
        base = slot * self.slot_bytes
        view = memoryview(dst)
        n = self.page_nbytes
        if n <= CHUNK:  # one chunk: no streaming hasher
            if os.preadv(self.fd, [view], base) != n:
                return False
            return xxhash.xxh3_64_intdigest(view) == checksum
        hasher = xxhash.xxh3_64()
        for start in range(0, n, CHUNK):
            part = view[start : start + CHUNK]
            if os.preadv(self.fd, [part], base + start) != len(part):
                return False
            hasher.update(part)
        return hasher.intdigest() == checksum

"""Checking an LMDB data file's own structure before the environment is trusted.

LMDB 0.9 trusts its page pointers: a flipped bit in a branch page, a node header, a database
record, a meta page or the free list makes it read or write outside its map (SIGSEGV) or fail
one of its assertions (SIGABRT), which kills the process where an error was wanted. Two checks
run when a process opens an environment:

- ``check_file``, before ``lmdb.open``: the meta page LMDB will pick must be sane and name
  only pages the file has (a flipped page count made LMDB map, and the store reserve, a file of
  any size);
- ``check_snapshot``, on the open environment inside a read transaction (which pins the
  snapshot's pages against writers in other processes): every tree is walked from that meta
  page, and each page must be where and what its parent says (number, kind, level), with its
  nodes inside it, packed, sorted and within their parent's key range; each page is used once,
  by one tree or the free list; overflow values start at a run of overflow pages long enough;
  free-list records are sorted page lists inside the file; each database's counts match.

The stores' own layout is assumed: the main database holds only named databases, all with
LMDB's default flags (no dupsort, no integer or reversed keys). Both return None for a sound
file, else a sentence naming the first problem. Cost: one read of every branch and leaf page
and of the first page of each overflow value, never the payload pages (the store's own
checksums cover those). A file corrupted while it is open is not covered. The format is LMDB
0.9's, 64-bit (``mdb.c``: ``MDB_page``, ``MDB_node``, ``MDB_db``, ``MDB_meta``).
"""

from __future__ import annotations

import mmap
import struct
import time
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np

P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA, F_SUBDATA = 0x01, 0x02
MDB_INTEGERKEY = 0x08
_DB_FLAGS = 0x7E  # REVERSEKEY, DUPSORT, INTEGERKEY, DUPFIXED, INTEGERDUP, REVERSEDUP
P_INVALID = 2**64 - 1
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_MAX_DEPTH = 32  # LMDB's cursor stack
_LOOKS, _LOOK_AGAIN_S = 6, 0.02  # check_file's looks at a file that seems corrupt
_MAX_KEY = 511
_HDR = 16  # PAGEHDRSZ
_PAGE = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (pages count for overflow)
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_DB = struct.Struct("<IHHQQQQQ")  # pad (psize in FREE's), flags, depth, branch, leaf, overflow,
# entries, root
_META = struct.Struct("<II8xQ48s48sQQ")  # magic, version, mapsize, dbs[2], last_pg, txnid


class _Db(NamedTuple):
    pad: int
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int


class _Meta(NamedTuple):
    index: int
    psize: int
    free: _Db
    main: _Db
    last_pg: int
    txnid: int


class _Corrupt(Exception):
    pass


def _meta(buf: bytes | mmap.mmap, index: int, offset: int) -> _Meta:
    _, _, flags, _, _ = _PAGE.unpack_from(buf, offset)
    magic, version, _, free, main, last_pg, txnid = _META.unpack_from(buf, offset + _HDR)
    if not flags & P_META or magic != _MAGIC or version != _VERSION:
        raise _Corrupt(
            f"meta page {index} has flags {flags:#x}, magic {magic:#x}, version {version}"
        )
    free_db, main_db = _Db(*_DB.unpack(free)), _Db(*_DB.unpack(main))
    return _Meta(index, free_db.pad, free_db, main_db, last_pg, txnid)


def _check_psize(meta: _Meta) -> None:
    if meta.psize & (meta.psize - 1) or not 512 <= meta.psize <= 0x8000:
        raise _Corrupt(f"meta page {meta.index} has page size {meta.psize}")


def _check_meta(meta: _Meta, file_bytes: int) -> None:
    _check_psize(meta)
    psize = meta.psize
    if meta.txnid & 1 != meta.index and meta.txnid:
        raise _Corrupt(f"meta page {meta.index} holds transaction {meta.txnid} (wrong parity)")
    if not 1 <= meta.last_pg or (meta.last_pg + 1) * psize > file_bytes:
        raise _Corrupt(
            f"meta page {meta.index} says pages 0..{meta.last_pg} are in use; the file has "
            f"{file_bytes // psize}"
        )
    # The key order LMDB applies follows these flags (a reversed or duplicate-sorted free list
    # or main database reads its pages as another layout): only the store's own are sound.
    if meta.free.flags & _DB_FLAGS != MDB_INTEGERKEY or meta.main.flags:
        raise _Corrupt(
            f"meta page {meta.index} has database flags {meta.free.flags:#x} (free list), "
            f"{meta.main.flags:#x} (main database)"
        )
    for name, db in (("free list", meta.free), ("main database", meta.main)):
        if (db.root != P_INVALID and not 2 <= db.root <= meta.last_pg) or db.depth > _MAX_DEPTH:
            raise _Corrupt(
                f"meta page {meta.index}: the {name} has root {db.root}, depth {db.depth}"
            )


def _pick(buf: bytes | mmap.mmap, file_bytes: int) -> _Meta:
    """The meta page LMDB picks at open: the higher transaction id (meta 0 on a tie)."""
    first = _meta(buf, 0, 0)
    _check_psize(first)  # LMDB reads the second meta page at this offset
    if file_bytes < 2 * first.psize:
        raise _Corrupt(f"the file has {file_bytes} bytes: less than its two meta pages")
    second = _meta(buf, 1, first.psize)
    meta = second if second.txnid > first.txnid else first
    if meta.psize != first.psize:
        raise _Corrupt(f"meta pages give page sizes {first.psize} and {second.psize}")
    _check_meta(meta, file_bytes)
    return meta


def check_file(data_file: Path) -> str | None:
    """Before ``lmdb.open``: the meta page LMDB will use. None when sound or absent.

    Another process may be committing meanwhile: LMDB writes a commit's pages (growing the
    file) before its meta page, so the head is read before the size; and a problem is reported
    only when a second look, a moment later, finds the same file unchanged (a meta page read
    while being written, or a file being created, looks corrupt for an instant)."""
    seen = None
    for attempt in range(_LOOKS):
        try:
            with open(data_file, "rb") as f:
                head = f.read(2 * 0x8000)
                file_bytes = f.seek(0, 2)
        except OSError:
            return None  # missing or unreadable: LMDB's open reports it
        if file_bytes == 0:
            return None  # LMDB writes a new file's meta pages
        try:
            _pick(head + bytes(max(0, 2 * 0x8000 - len(head))), file_bytes)
        except _Corrupt as exc:
            if seen == (head, file_bytes):
                return str(exc)
            seen = (head, file_bytes)
            time.sleep(_LOOK_AGAIN_S * (attempt + 1))
            continue
        return None
    return None  # the file kept changing: a live writer, so not a corrupt file at rest


def check_snapshot(env: lmdb.Environment, data_file: Path) -> str | None:
    """On an open environment: every tree and the free list of its newest snapshot, read under
    a read transaction. None when sound."""
    for _ in range(8):
        try:
            txn = env.begin()
        except lmdb.MapResizedError:  # another process grew the map (and reserved its blocks)
            env.set_mapsize(0)
            continue
        with txn, open(data_file, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    meta = _meta(mm, txn.id() & 1, (txn.id() & 1) * env.stat()["psize"])
                    if meta.txnid > txn.id():
                        continue  # writers committed twice since the begin: look again
                    if meta.txnid != txn.id():
                        raise _Corrupt(
                            f"the open snapshot is transaction {txn.id()}; its meta page "
                            f"{meta.index} holds {meta.txnid}"
                        )
                    _check_meta(meta, len(mm))
                    _Walk(mm, meta).run()
                except _Corrupt as exc:
                    return str(exc)
                except (struct.error, IndexError, ValueError) as exc:  # a field past the file
                    return f"unreadable structure ({exc})"
                return None
    return None  # writers kept moving the newest snapshot; LMDB's own checks remain


class _Walk:
    """One pass over a snapshot's pages. Tree pages are remembered as they are reached (a page
    reached twice, a cycle among them, is caught there); overflow runs and free pages are
    compared with them at the end, sorted, so memory follows the pages read, not the file."""

    def __init__(self, mm: mmap.mmap, meta: _Meta) -> None:
        self.mm, self.meta, self.psize = mm, meta, meta.psize
        self.seen: set[int] = set()
        self.runs: list[tuple[int, int]] = []  # (first page, pages) of each overflow value
        self.free: list[np.ndarray] = []

    def in_file(self, pgno: int, count: int, what: str) -> None:
        if pgno < 2 or pgno + count - 1 > self.meta.last_pg:
            raise _Corrupt(
                f"{what} points at page {pgno} (+{count}); pages in use are 2..{self.meta.last_pg}"
            )

    def visit(self, pgno: int, what: str) -> None:
        self.in_file(pgno, 1, what)
        if pgno in self.seen:
            raise _Corrupt(f"{what}: page {pgno} is reached twice")
        self.seen.add(pgno)

    def used_once(self) -> None:
        """No page is in two of: the trees, an overflow value, the free list."""
        runs = np.array(self.runs, dtype=np.int64).reshape(-1, 2)
        free = np.concatenate([np.zeros(0, np.int64), *self.free])
        starts = np.concatenate(
            [np.fromiter(self.seen, np.int64, len(self.seen)), runs[:, 0], free]
        )
        counts = np.concatenate([np.ones(len(self.seen), np.int64), runs[:, 1], np.ones_like(free)])
        order = np.argsort(starts, kind="stable")
        starts, counts = starts[order], counts[order]
        twice = np.flatnonzero(starts[1:] < starts[:-1] + counts[:-1])
        if len(twice):
            raise _Corrupt(f"page {int(starts[twice[0] + 1])} is used twice")

    def run(self) -> None:
        free = self.tree("free list", self.meta.free, values=True)
        for name, raw in self.tree("main database", self.meta.main, values=True):
            db = _Db(*_DB.unpack(raw))
            if db.flags:
                raise _Corrupt(f"database {name!r} has flags {db.flags:#x}; expected 0")
            self.tree(repr(bytes(name)), db, values=False)
        for key, idl in free:
            self.free_record(int.from_bytes(key, "little"), idl)
        self.used_once()

    def free_record(self, txnid: int, idl: bytes) -> None:
        what = f"free-list record of transaction {txnid}"
        if txnid > self.meta.txnid or len(idl) < 8 or len(idl) % 8:
            raise _Corrupt(f"{what} has {len(idl)} bytes (snapshot {self.meta.txnid})")
        pages = np.frombuffer(idl, dtype="<u8")
        if int(pages[0]) != len(pages) - 1:
            raise _Corrupt(f"{what} counts {int(pages[0])} pages in {len(pages) - 1} slots")
        pages = pages[1:].astype(np.int64)
        if len(pages) == 0:
            return
        if (pages[:-1] <= pages[1:]).any() or pages[-1] < 2 or pages[0] > self.meta.last_pg:
            raise _Corrupt(f"{what} is not a descending list of pages 2..{self.meta.last_pg}")
        self.free.append(pages)

    def tree(self, name: str, db: _Db, values: bool) -> list[tuple[bytes, bytes]]:
        """Walk one database; its leaf entries (key, value) when ``values``."""
        if db.root == P_INVALID:
            if db.depth or db.entries or db.branch_pages or db.leaf_pages or db.overflow_pages:
                raise _Corrupt(f"{name} is empty but counts {db}")
            return []
        if not 1 <= db.depth <= _MAX_DEPTH:
            raise _Corrupt(f"{name} has depth {db.depth}")
        self.name, self.db, self.values = name, db, values
        self.integer = name == "free list"
        self.entries: list[tuple[bytes, bytes]] = []
        self.counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        stack = [(db.root, 1, None, None)]
        while stack:
            stack.extend(self.page(*stack.pop()))
        found = (db.branch_pages, db.leaf_pages, db.overflow_pages, db.entries)
        if tuple(self.counts) != found:
            raise _Corrupt(
                f"{name} has (branch, leaf, overflow, entries) {self.counts}; its record "
                f"says {found}"
            )
        return self.entries

    def page(self, pgno: int, level: int, low, high) -> list[tuple[int, int, object, object]]:
        """Check one page of the current tree; its children (pgno, level, key bounds)."""
        mm, psize, base = self.mm, self.psize, pgno * self.psize
        branch = level < self.db.depth
        where = f"page {pgno} ({'branch' if branch else 'leaf'} of {self.name}, level {level})"
        self.visit(pgno, where)
        own, _, flags, lower, upper = _PAGE.unpack_from(mm, base)
        if own != pgno or flags != (P_BRANCH if branch else P_LEAF):
            raise _Corrupt(f"{where} has number {own}, flags {flags:#x}")
        count = (lower - _HDR) // 2
        least = 1 if (not branch or self.integer) else 2
        if lower & 1 or not _HDR <= lower <= upper <= psize or count < least:
            raise _Corrupt(f"{where} has lower {lower}, upper {upper}")
        self.counts[0 if branch else 1] += 1
        ptrs = struct.unpack_from(f"<{count}H", mm, base + _HDR)
        nodes, keys = [], []
        for ptr in ptrs:
            if ptr & 1 or ptr < upper or ptr + 8 > psize:
                raise _Corrupt(f"{where} has a node at {ptr} (upper {upper})")
            lo, hi, nflags, ksize = _NODE.unpack_from(mm, base + ptr)
            end = ptr + 8 + ksize
            if branch:
                size = 8 + ksize
            else:
                allowed = (F_SUBDATA,) if self.name == "main database" else (0, F_BIGDATA)
                if nflags not in allowed:
                    raise _Corrupt(f"{where} has a node with flags {nflags:#x}")
                size = 8 + ksize + (8 if nflags & F_BIGDATA else lo | hi << 16)
            size += size & 1
            if ksize > _MAX_KEY or ptr + size > psize:
                raise _Corrupt(f"{where} has a node of {size} bytes at {ptr}")
            nodes.append((ptr, size))
            key = mm[base + ptr + 8 : base + end]
            keys.append(self.order(key, where))
            if not branch:
                self.leaf(base, end, lo | hi << 16, nflags, key, where)
        nodes.sort()
        at = upper
        for ptr, size in nodes:
            if ptr != at:
                raise _Corrupt(f"{where} has nodes that overlap or leave gaps (at {ptr}, not {at})")
            at = ptr + size
        if at != psize:
            raise _Corrupt(f"{where} has nodes ending at {at}, not {psize}")
        bounded = keys[1:] if branch else keys  # a branch page's first key is not compared
        for a, b in zip([low, *bounded], [*bounded, high], strict=True):
            if a is not None and b is not None and not a <= b:
                raise _Corrupt(f"{where} has keys out of order")
        if len(set(bounded)) != len(bounded) or (high is not None and bounded[-1:] == [high]):
            raise _Corrupt(f"{where} has a repeated key")
        if not branch:
            return []
        children = []
        for i, ptr in enumerate(ptrs):
            lo, hi, nflags, _ = _NODE.unpack_from(mm, base + ptr)
            child_low = low if i == 0 else keys[i]
            child_high = keys[i + 1] if i + 1 < count else high
            children.append((lo | hi << 16 | nflags << 32, level + 1, child_low, child_high))
        return children

    def order(self, key: bytes, where: str):
        if not self.integer:
            return key
        if len(key) not in (0, 8):
            raise _Corrupt(f"{where} has a key of {len(key)} bytes")
        return int.from_bytes(key, "little")

    def leaf(self, base: int, end: int, dsize: int, nflags: int, key: bytes, where: str) -> None:
        self.counts[3] += 1
        if nflags & F_SUBDATA and dsize != _DB.size:
            raise _Corrupt(f"{where}: database record {bytes(key)!r} has {dsize} bytes")
        if self.integer and len(key) != 8:
            raise _Corrupt(f"{where} has a key of {len(key)} bytes")
        start = base + end
        if nflags & F_BIGDATA:
            (first,) = struct.unpack_from("<Q", self.mm, start)
            what = f"{where}: overflow value"
            self.in_file(first, 1, what)
            own, _, flags, pages_lo, pages_hi = _PAGE.unpack_from(self.mm, first * self.psize)
            # LMDB overwrites a value in place on the pages it has when they are enough (its
            # free list does), so the run may be longer than the value needs; it frees them all.
            pages = pages_lo | pages_hi << 16
            if own != first or flags != P_OVERFLOW or pages < (_HDR - 1 + dsize) // self.psize + 1:
                raise _Corrupt(
                    f"{what} of {dsize} bytes at page {first}: number {own}, flags {flags:#x}, "
                    f"{pages} pages"
                )
            self.in_file(first, pages, what)
            self.runs.append((first, pages))
            self.counts[2] += pages
            start = first * self.psize + _HDR
        if self.values:
            self.entries.append((key, self.mm[start : start + dsize]))

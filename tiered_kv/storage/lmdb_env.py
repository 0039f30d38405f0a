"""The LMDB environments behind :class:`LMDBStorage`: one per (directory, process), shared.

LMDB refuses to open one directory twice in a process, and a map resize must not race a
transaction of another store object (another namespace) on the same environment: stores on one
directory share one environment and one lock, counted, and the last to close it closes it. An
environment is never used across ``fork``: the child drops the inherited one and opens its own.
An entry remembers its data file's inode, so a store on a directory that was removed and
recreated gets a new environment instead of the one still mapping the deleted file.

Every map size an environment takes has its disk blocks reserved first (``map_file.reserve``),
so writes through the map never fault on a full disk; where blocks cannot be reserved at open
(no ``fallocate``, or no room), the environment is opened without ``writemap`` and LMDB's own
writes report a full disk as an error instead. Each new mapping gets huge-page advice.

A new environment is trusted only after ``lmdb_check`` found its data file sound (its meta page
before ``lmdb.open``, every tree after): LMDB 0.9 crashes the process on a corrupted structure,
so a corrupt file is a typed ``StorageOpenError`` instead.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from tiered_kv.errors import StorageOpenError
from tiered_kv.storage import lmdb_check, map_file, value_format
from tiered_kv.storage.keys import KEY_BYTES

_NODE = 16  # LMDB's per-entry node header, rounded up


def record_cost(payload: int, psize: int = 4096) -> int:
    """Disk bytes one stored page is charged: the payload on whole overflow pages (or twice its
    leaf size when it is small enough to sit in a leaf: leaves may be half full), plus its header
    and LRU entries, likewise doubled."""
    if payload + KEY_BYTES + _NODE > psize // 2:
        data = -(-(payload + _NODE) // psize) * psize
    else:
        data = 2 * (payload + KEY_BYTES + _NODE)
    header = 2 * (value_format.HEADER_BYTES + KEY_BYTES + _NODE)
    lru = 2 * (8 + KEY_BYTES + _NODE)
    return data + header + lru


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


@dataclass
class SharedEnv:
    env: lmdb.Environment
    key: tuple[str, int]
    inode: int | None
    data_file: Path
    hugepages: bool
    writemap: bool  # what the environment runs with (off when blocks could not be reserved)
    users: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)
    last_reader_check: float = float("-inf")

    def _remapped(self) -> None:
        if self.hugepages:
            map_file.advise_hugepages(self.data_file)

    def resize(self, size: int) -> int:
        """Grow the map to ``size`` bytes, reserving its disk blocks first. Returns 0, or the
        errno that left the map as it was (no room on the disk)."""
        if self.writemap:
            err = map_file.reserve(self.data_file, size)
            if err and err not in map_file.UNSUPPORTED:
                return err
        self.env.set_mapsize(size)
        self._remapped()
        return 0

    def clear_stale_readers(self, every_s: float = 0.0) -> int:
        """Free the reader slots of processes that died inside a read (their slots pin old
        pages, so a store at its budget could not reuse them: every other process's writes
        would fail). At most once per ``every_s`` seconds. Returns the slots freed."""
        now = time.monotonic()
        if now - self.last_reader_check < every_s:
            return 0
        self.last_reader_check = now
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0

    def adopt(self) -> None:
        """Take the map size another process set (after ``MapResizedError``); that process
        reserved the blocks."""
        self.env.set_mapsize(0)
        self._remapped()


_ENVS: dict[tuple[str, int], SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def acquire(path: Path, data_file: Path, options: dict) -> SharedEnv:
    """The environment of ``path`` for this process (opened with ``options`` if new)."""
    key = (os.path.realpath(path), os.getpid())
    with _ENVS_LOCK:
        shared = _ENVS.get(key)
        if shared is not None and shared.inode != inode(data_file):
            shared = None  # the directory was removed or replaced: a new environment
        if shared is None:
            writemap = options["writemap"]
            env = _open(path, options, writemap)
            if writemap and map_file.reserve(data_file, env.info()["map_size"]):
                env.close()  # no blocks for the map: let LMDB write (and fail) with pwrite
                writemap = False
                env = _open(path, options, writemap)
            try:
                problem = lmdb_check.check_snapshot(env, data_file)
            except (OSError, lmdb.Error) as exc:
                env.close()
                raise StorageOpenError(f"cannot check LMDB store at {path}: {exc}") from exc
            if problem:
                env.close()
                raise _corrupt(path, problem)
            shared = SharedEnv(
                env, key, inode(data_file), data_file, options["hugepages"], writemap
            )
            shared._remapped()
            shared.clear_stale_readers()  # a reader killed before we opened pins nothing
            _ENVS[key] = shared
        shared.users += 1
        return shared


def _open(path: Path, options: dict, writemap: bool) -> lmdb.Environment:
    durable = options["durable"]
    # LMDB maps lock.mdb and writes its reader table through the mapping: on a full disk a
    # sparse lock file kills the process with SIGBUS inside lmdb.open. Reserve its blocks
    # first and refuse the store when they cannot be had. (data.mdb's first pages are written
    # with pwrite, which reports a full disk as an error: a typed refusal below.)
    err = map_file.reserve_new(path / "lock.mdb", map_file.LOCK_BYTES)
    if err and err not in map_file.UNSUPPORTED:
        raise StorageOpenError(
            f"cannot open LMDB store at {path}: no disk space for its lock file "
            f"({errno.errorcode.get(err, err)}); free space on that file system or use another "
            "storage_path"
        )
    problem = lmdb_check.check_file(path / "data.mdb")
    if problem:
        raise _corrupt(path, problem)
    try:
        return lmdb.open(
            str(path),
            map_size=options["map_size"],
            max_dbs=4,
            subdir=True,
            writemap=writemap,
            sync=durable,
            metasync=durable,
            map_async=not durable,
            readahead=options["readahead"],
            max_readers=256,
        )
    except lmdb.Error as exc:
        raise StorageOpenError(f"cannot open LMDB store at {path}: {exc}") from exc


def _corrupt(path: Path, problem: str) -> StorageOpenError:
    # Checked before LMDB may follow the file's pointers: LMDB 0.9 would crash on them.
    return StorageOpenError(
        f"cannot open LMDB store at {path}: its data file is corrupt ({problem}); move the "
        "directory away (or delete it) and a store there starts empty"
    )


def release(shared: SharedEnv) -> None:
    """One store is done with ``shared``; the last one closes the environment."""
    with _ENVS_LOCK:
        shared.users -= 1
        if shared.users <= 0:
            if _ENVS.get(shared.key) is shared:
                del _ENVS[shared.key]
            shared.env.close()


def drop_inherited(shared: SharedEnv) -> None:
    """In a forked child: close the environment inherited from the parent (LMDB then clears
    only this process's reader slots), so the caller can open its own."""
    with _ENVS_LOCK:
        inherited = _ENVS.pop(shared.key, None)
    if inherited is not None:
        try:
            inherited.env.close()
        except lmdb.Error:
            pass


def disk_trouble(exc: BaseException) -> bool:
    """Whether a write's exception is disk trouble the store absorbs (a full disk or quota, an
    I/O error, any LMDB error) rather than a bug to raise."""
    if isinstance(exc, lmdb.Error):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def absorbs_lmdb_errors(miss):
    """For store methods: an LMDB error escaping the call (a corrupted map, a page not found, a
    map full at the budget) is counted in the store's stats and the call returns
    ``miss(store, *args)``, so the serving path sees a miss, never the exception. A call on a
    closed store raises StorageClosedError first (a caller's bug, not disk trouble)."""

    def wrap(method):
        @functools.wraps(method)
        def call(store, *args, **kwargs):
            store._check_open(method.__name__)
            try:
                return method(store, *args, **kwargs)
            except lmdb.Error as exc:
                store._stats.count_error(f"{method.__name__}: {type(exc).__name__}")
                return miss(store, *args, **kwargs)

        return call

    return wrap


def leading_present(txn: lmdb.Transaction, db, keys: Sequence[bytes]) -> int:
    """How many of ``keys``, from the first, are in database ``db``."""
    n = 0
    for key in keys:
        if txn.get(key, db=db) is None:
            break
        n += 1
    return n

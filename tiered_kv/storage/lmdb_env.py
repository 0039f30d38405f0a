"""The LMDB environments behind :class:`LMDBStorage`: one per (directory, process), shared.

LMDB refuses to open one directory twice in a process, and a map resize must not race a
transaction of another store object (another namespace) on the same environment: stores on one
directory share one environment and one lock, counted, and the last to close it closes it. An
environment is never used across ``fork``: the child drops the inherited one and opens its own.
An entry remembers its data file's inode, so a store on a directory that was removed and
recreated gets a new environment instead of the one still mapping the deleted file.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from tiered_kv.errors import TieredKVError
from tiered_kv.storage import value_format
from tiered_kv.storage.keys import KEY_BYTES

_NODE = 16  # LMDB's per-entry node header, rounded up


class StorageOpenError(TieredKVError):
    """The store directory cannot be created, opened or written. The message says which path."""


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
    users: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)


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
            durable = options["durable"]
            try:
                env = lmdb.open(
                    str(path),
                    map_size=options["map_size"],
                    max_dbs=4,
                    subdir=True,
                    writemap=options["writemap"],
                    sync=durable,
                    metasync=durable,
                    map_async=not durable,
                    readahead=options["readahead"],
                    max_readers=256,
                )
            except lmdb.Error as exc:
                raise StorageOpenError(f"cannot open LMDB store at {path}: {exc}") from exc
            shared = _ENVS[key] = SharedEnv(env, key, inode(data_file))
        shared.users += 1
        return shared


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

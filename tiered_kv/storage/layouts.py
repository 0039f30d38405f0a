"""Choosing the disk tier's layout: ``open_store(layout, ...)`` opens an ``LMDBStorage`` (page
bytes inside LMDB's map) or a ``SlabStorage`` (LMDB holds the index, bytes in a slab file per
namespace) with the same options, and refuses a directory that holds the other layout's store
(its files would sit beside the new store's, outside its budget, and be read by neither)."""

from __future__ import annotations

import os
from pathlib import Path

from tiered_kv.errors import StorageOpenError
from tiered_kv.names import StorageLayout, parse
from tiered_kv.storage.contract import PageStorage
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.storage.lmdb_store import LMDBStorage
from tiered_kv.storage.slab_env import SLABS
from tiered_kv.storage.slab_store import SlabStorage


def layout_of(path: str | os.PathLike[str]) -> StorageLayout | None:
    """The layout of the store in ``path``, or None where there is none yet."""
    path = Path(path)
    if (path / SLABS).is_dir():
        return StorageLayout.SLAB
    if (path / "data.mdb").exists():
        return StorageLayout.LMDB
    return None


def open_store(
    layout: StorageLayout | str,
    path: str | os.PathLike[str],
    namespace: StorageNamespace,
    page_nbytes: int,
    *,
    budget_bytes: int,
    durable: bool = False,
    hugepages: bool = False,
    io_threads: int | None = None,
) -> PageStorage:
    """A store of ``layout`` in ``path`` (``StorageOpenError`` if it holds the other layout)."""
    layout = parse(StorageLayout, layout, "storage_layout")
    found = layout_of(path)
    if found is not None and found is not layout:
        raise StorageOpenError(
            f"{path} holds a store of the {found.value} layout, not {layout.value}: set "
            f"storage_layout='{found.value}', or give the {layout.value} layout another "
            "storage_path (or remove the old store)"
        )
    cls = SlabStorage if layout is StorageLayout.SLAB else LMDBStorage
    return cls(
        path,
        namespace,
        page_nbytes,
        budget_bytes=budget_bytes,
        durable=durable,
        hugepages=hugepages,
        io_threads=io_threads,
    )

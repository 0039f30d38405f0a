"""The storage tier: page-store contract, page keys, value header, the disk store in its two
layouts (LMDB, slab) and the memory store."""

from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats
from tiered_kv.storage.keys import PageKey, StorageNamespace, page_digests, page_keys
from tiered_kv.storage.lmdb_store import LMDBStorage, StorageOpenError
from tiered_kv.storage.memory_store import MemoryStorage
from tiered_kv.storage.slab_store import SlabStorage

__all__ = [
    "LMDBStorage",
    "MemoryStorage",
    "PageKey",
    "PageSource",
    "PageStorage",
    "SlabStorage",
    "StorageNamespace",
    "StorageOpenError",
    "StorageStats",
    "page_digests",
    "page_keys",
]

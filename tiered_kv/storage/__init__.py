"""The storage tier: page-store contract, page keys, value header, LMDB and memory stores."""

from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats
from tiered_kv.storage.keys import PageKey, StorageNamespace, page_digests, page_keys
from tiered_kv.storage.lmdb_store import LMDBStorage, StorageOpenError
from tiered_kv.storage.memory_store import MemoryStorage

__all__ = [
    "LMDBStorage",
    "MemoryStorage",
    "PageKey",
    "PageSource",
    "PageStorage",
    "StorageNamespace",
    "StorageOpenError",
    "StorageStats",
    "page_digests",
    "page_keys",
]

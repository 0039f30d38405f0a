"""tiered_kv: a tiered KV-cache store for LLM serving (device, pinned host and LMDB tiers)."""

import logging

from tiered_kv.errors import (
    BackendUnavailableError,
    HostMemoryError,
    InvalidArgumentError,
    LayoutError,
    OwnershipError,
    PhysicalWriteLocError,
    StateError,
    StorageClosedError,
    StorageOpenError,
    TieredKVError,
    TransferError,
)

__version__ = "0.1.0"

# Loggers are per module (tiered_kv.cache.eviction, tiered_kv.storage.guarded_store, ...); the
# library never configures handlers, an application does (tiered-kv --log-level).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "BackendUnavailableError",
    "HostMemoryError",
    "InvalidArgumentError",
    "LayoutError",
    "OwnershipError",
    "PhysicalWriteLocError",
    "StateError",
    "StorageClosedError",
    "StorageOpenError",
    "TieredKVError",
    "TransferError",
    "__version__",
]

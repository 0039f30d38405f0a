"""tiered_kv: a tiered KV-cache store for LLM serving (device, pinned host and LMDB tiers)."""

from tiered_kv.errors import (
    BackendUnavailableError,
    HostMemoryError,
    InvalidArgumentError,
    LayoutError,
    OwnershipError,
    PhysicalWriteLocError,
    StateError,
    StorageOpenError,
    TieredKVError,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "HostMemoryError",
    "InvalidArgumentError",
    "LayoutError",
    "OwnershipError",
    "PhysicalWriteLocError",
    "StateError",
    "StorageOpenError",
    "TieredKVError",
    "TransferError",
    "__version__",
]

"""tiered_kv: a tiered KV-cache store for LLM serving (device, pinned host and LMDB tiers)."""

from tiered_kv.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    LayoutError,
    OwnershipError,
    PhysicalWriteLocError,
    StateError,
    TieredKVError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "InvalidArgumentError",
    "LayoutError",
    "OwnershipError",
    "PhysicalWriteLocError",
    "StateError",
    "TieredKVError",
    "__version__",
]

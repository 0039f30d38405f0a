"""The host tier: host pools built from device pools' declarations, layouts, transfers."""

from tiered_kv.device.pool_decl import HostPart, HostPoolDecl
from tiered_kv.host.allocator import HostSlotAllocator
from tiered_kv.host.host_kv_cache import (
    HostKVCache,
    MHATokenToKOnlyPoolHost,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    host_pool_for,
)
from tiered_kv.host.layout import HostLayout
from tiered_kv.host.memory import HostMemoryError

__all__ = [
    "HostKVCache",
    "HostLayout",
    "HostMemoryError",
    "HostPart",
    "HostPoolDecl",
    "HostSlotAllocator",
    "MHATokenToKOnlyPoolHost",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "host_pool_for",
]

"""The device tier: request rows, KV pools, allocators, write locations and sizing."""

from tiered_kv.device.allocator import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from tiered_kv.device.kv_cache import KVCache, mha_kv_bytes, mla_kv_bytes
from tiered_kv.device.mha_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.req_to_token_pool import ReqToTokenPool, RequestKV
from tiered_kv.device.sizing import AllocSizingConfig
from tiered_kv.device.write_loc import KVWriteLoc, write_loc_is_physical

__all__ = [
    "AllocSizingConfig",
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "KVCache",
    "KVWriteLoc",
    "MHATokenToKOnlyPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "PagedTokenToKVPoolAllocator",
    "ReqToTokenPool",
    "RequestKV",
    "TokenToKVPoolAllocator",
    "mha_kv_bytes",
    "mla_kv_bytes",
    "write_loc_is_physical",
]

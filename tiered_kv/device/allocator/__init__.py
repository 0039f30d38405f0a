"""Allocators behind one interface: physical KV slots for new tokens, and their release."""

from tiered_kv.device.allocator.base import AllocatorState, BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator, num_new_pages
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "num_new_pages",
]

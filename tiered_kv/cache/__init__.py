"""The cache: the manager that turns tree decisions into frees and transfer jobs, the request
lifecycle, the ``TieredKVCache`` facade, its builder and its metrics."""

from tiered_kv.cache.facade import TieredKVCache
from tiered_kv.cache.manager import CacheManager
from tiered_kv.cache.prefix_match import PrefixMatch
from tiered_kv.cache.request import Request

__all__ = ["CacheManager", "PrefixMatch", "Request", "TieredKVCache"]

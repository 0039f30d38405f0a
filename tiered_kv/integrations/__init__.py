"""Adapters that let other serving engines keep their KV pages in tiered_kv's storage tier
(``sglang_hicache``: an SGLang HiCache storage backend). Nothing here is imported by
``import tiered_kv``; an adapter imports its engine only where that engine is installed."""

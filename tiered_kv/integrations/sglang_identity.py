"""Whether SGLang's storage page hashes carry a request's identity, checked before we store.

tiered_kv's HiCache backend never sees a request: SGLang hands it page hashes only (hex SHA-256
chains over page tokens). Our keys are those hashes under our namespace, so two requests with
the same tokens and different LoRA adapters (SGLang's ``extra_key``) or cache salts
(``cache_salt``) are kept apart only if SGLang seeds its chains with them. SGLang 0.5.23 does
(``mem_cache.utils.get_storage_hash_str`` seeds a new chain with ``storage_namespace_seed``);
an SGLang whose hashes drop either part would let one adapter's KV be served to another, so the
backend refuses to open there. The check asks SGLang's own function, not its version string.
"""

from __future__ import annotations

import importlib
from array import array

from tiered_kv.errors import StorageOpenError

_PROBE = [(None, None), ("lora-a", None), ("lora-b", None), (None, "salt-a"), ("lora-a", "salt-a")]


def sglang_storage_hashes(tokens, page_size: int, extra_key=None, cache_salt=None) -> list[str]:
    """SGLang's storage page hashes of ``tokens`` for a request of that identity (its own
    ``get_storage_hash_str`` over its ``RadixKey``). Raises ImportError without SGLang."""
    utils = importlib.import_module("sglang.srt.mem_cache.utils")
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    key = radix.RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
    return list(utils.get_storage_hash_str(key, None, page_size=page_size))


def check_hashes_carry_identity(page_size: int) -> bool:
    """True when SGLang is importable and its storage hashes differ for every identity of the
    probe (none, two extra keys, a cache salt, both); False without SGLang (a caller handing
    us hashes of its own answers for them). Raises StorageOpenError, naming the part dropped,
    when two identities hash alike."""
    try:
        utils = importlib.import_module("sglang.srt.mem_cache.utils")
        importlib.import_module("sglang.srt.mem_cache.radix_cache")
    except ImportError:
        return False
    if not hasattr(utils, "get_storage_hash_str"):
        raise StorageOpenError(
            "this SGLang has no get_storage_hash_str: its storage page hashes do not carry a "
            "request's extra_key (LoRA adapter) or cache_salt, so requests of different "
            "identities would share stored KV; tiered_kv's HiCache backend needs SGLang 0.5.23"
        )
    tokens = list(range(1, 2 * page_size + 1))
    seen: dict[str, tuple] = {}
    for identity in _PROBE:
        first = sglang_storage_hashes(tokens, page_size, *identity)[0]
        if first in seen:
            other = seen[first]
            part = "extra_key" if other[0] != identity[0] else "cache_salt"
            raise StorageOpenError(
                f"SGLang's storage page hashes are equal for requests with {part} "
                f"{other[0] if part == 'extra_key' else other[1]!r} and "
                f"{identity[0] if part == 'extra_key' else identity[1]!r}: they drop the "
                f"request's {part}, so KV would be shared across LoRA adapters or cache "
                "salts; tiered_kv's HiCache backend refuses to open (use SGLang 0.5.23)"
            )
        seen[first] = identity
    return True

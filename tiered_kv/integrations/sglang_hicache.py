"""tiered_kv's storage tier as an SGLang HiCache storage backend (SGLang 0.5.23).

SGLang loads it by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tiered_kv",
        "module_path": "tiered_kv.integrations.sglang_hicache",
        "class_name": "TieredKVHiCacheStorage", "interface_v1": 1,
        "storage_path": "/var/cache/tiered_kv", "storage_bytes": 107374182400}'

``interface_v1: 1`` makes SGLang's ``HiCacheController`` call the zero-copy methods with host
indices (``batch_exists``, ``batch_get_v1``, ``batch_set_v1``); without it the legacy
``batch_get`` / ``batch_set`` of flat pages work too. Pages go through our own store (the
backend ``StorageConfig.storage_backend`` names: the embedded ``lmdb`` store, ``redis``,
``mooncake``, or any ``module.path:ClassName``), behind a ``GuardedStorage``: every value is
verified on read (a damaged one is a miss, never served), and storage trouble is a counted miss;
nothing raises into SGLang's storage threads. SGLang's page hashes (hex SHA-256 chains over the
page tokens) are our chain digests, so a key is our namespace fingerprint followed by the hash's
bytes. A request's identity beyond its tokens (SGLang's ``extra_key``: the LoRA adapter; its
``cache_salt``) reaches us only inside those hashes, which SGLang 0.5.23 seeds with both; the
backend checks that at registration and refuses to open where they would be dropped
(``sglang_identity``). It cannot tell what else an ``extra_key`` should have held.

Metrics: with ``enable_storage_metrics`` (SGLang's ``--enable-metrics``) ``get_stats`` returns
SGLang's ``StorageMetrics`` of the batches since the last call (pages per prefetch / backup
batch and their GB/s, as its Mooncake backend reports); ``storage_stats`` is our store's
counters (hits, misses, checksum failures, errors by call) at any time.

The module imports SGLang when it is there (the class must subclass its ``HiCacheStorage`` for
SGLang's loader); without SGLang the class still imports and works on any host pool with the
same page calls, which is how ``import tiered_kv.integrations.sglang_hicache`` never fails.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Sequence

import torch

from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.integrations.sglang_config import (
    HiCacheSettings,
    SGLangStorageConfig,
    read_settings,
)
from tiered_kv.integrations.sglang_identity import check_hashes_carry_identity
from tiered_kv.integrations.sglang_pages import (
    FlatPages,
    HostPoolPages,
    SGLangHostPool,
    namespace_of,
)
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats
from tiered_kv.storage.guarded_store import GuardedStorage
from tiered_kv.storage.keys import DIGEST_BYTES, StorageNamespace, page_keys_of

try:  # SGLang's loader requires a HiCacheStorage subclass
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _SGLangBase
except Exception:  # noqa: BLE001 - absent, or a CPU-only install missing a stand-in
    _SGLangBase = object

log = logging.getLogger(__name__)
_OTHER_KEY = b"tiered-kv/sglang-key/1"  # keys that are not a hex SHA-256 (never seen in 0.5.23)


def digest_of_hash(key: str) -> bytes:
    """Our chain digest for one SGLang page hash: its 32 bytes when it is hex SHA-256, else a
    tagged SHA-256 of the string (so any key SGLang makes is a valid, distinct digest)."""
    if len(key) == 2 * DIGEST_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(_OTHER_KEY + key.encode()).digest()


class TieredKVHiCacheStorage(_SGLangBase):
    """One rank's HiCache storage backend. Built by SGLang as ``cls(storage_config, kwargs)``;
    the store opens when SGLang registers the host pool (its geometry is the namespace).

    Every batch call returns per-key results (``batch_exists``: the leading run present) and
    never raises for storage trouble: an exception from the store is logged, counted in
    ``storage_stats().errors`` under the call's name and answered as misses / not stored."""

    def __init__(
        self, storage_config: SGLangStorageConfig, kwargs: dict[str, object] | None = None
    ) -> None:
        self.settings: HiCacheSettings = read_settings(storage_config)
        self.store: PageStorage | None = None
        self.pages: HostPoolPages | None = None
        self.namespace: StorageNamespace | None = None
        self._lock = threading.Lock()
        self._failed_calls: dict[str, int] = {}
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": [],
        }  # fmt: skip

    # -- SGLang's registration ----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: SGLangHostPool) -> None:
        """Bind the host pool and open the store for its namespace (once)."""
        if self.store is not None:
            raise StateError("register_mem_pool_host: this backend already has its host pool")
        s = self.settings
        # Refused before anything opens: an SGLang whose page hashes drop a request's
        # extra_key or cache_salt would have us serve one LoRA adapter's KV to another.
        self.identity_checked = check_hashes_carry_identity(int(mem_pool_host.page_size))
        self.mem_pool_host = mem_pool_host
        pages = HostPoolPages(mem_pool_host)
        namespace = namespace_of(
            mem_pool_host,
            model=s.model_id,
            rank=s.rank,
            tenant=s.storage.namespace_salt,
            kv_scales=s.storage.kv_scales_id,
        )
        namespace.check_complete()  # fail closed: nothing is defaulted
        opener = functools.partial(
            open_backend, s.storage, s.storage.storage_path, namespace, pages.page_nbytes
        )
        self.store = GuardedStorage(opener)
        self.pages, self.namespace = pages, namespace

    def register_mem_host_pool_v2(self, host_pool: SGLangHostPool, host_pool_name: object) -> None:
        """SGLang's per-pool registration (its ``HybridCacheController`` registers every host pool
        of its group, the KV pool included). Only the KV pool is stored: a side pool (a hybrid
        model's Mamba / SWA state, a DSA indexer, a draft model's KV) moves through the v2
        calls, which this backend does not implement, so it is refused here, at attach."""
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise InvalidArgumentError(
            f"tiered_kv's HiCache backend stores the KV pool only, not host pool "
            f"{str(host_pool_name)!r}: models with side pools (hybrid Mamba / SWA, DSA indexer, "
            "speculative draft KV) need one of SGLang's own backends"
        )

    def keys_of(self, hashes: Sequence[str]) -> list[bytes]:
        """Our page keys for SGLang's page hashes under this backend's namespace."""
        if self.namespace is None:
            raise StateError("no host pool registered yet (register_mem_pool_host)")
        return page_keys_of(self.namespace, [digest_of_hash(h) for h in hashes])

    # -- the v1 zero-copy interface ----------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        if not keys:
            return 0
        return self._guarded("batch_exists", 0, lambda: self.store.batch_exists(self.keys_of(keys)))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: object = None
    ) -> list[bool]:
        """Fill the host pages at ``host_indices`` (``page_size`` slots per key)."""
        return self._transfer("prefetch", keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: object = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices``. A rank that is not SGLang's storage writer
        (an MLA rank other than 0) writes nothing and reports its pages stored: the writer's
        copy is theirs too."""
        if not self.settings.writer:
            return [True] * len(keys)
        return self._transfer("backup", keys, host_indices)

    # -- the legacy interface (flat page tensors) ----------------------------------------------
    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        ok = self._run("batch_get", keys, FlatPages(target_locations, self.pages.page_nbytes))
        return [t if good else None for t, good in zip(target_locations, ok, strict=True)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None):
        if not self.settings.writer:
            return True
        flat = [v.reshape(-1).contiguous() for v in values]
        return all(self._run("batch_set", keys, FlatPages(flat, self.pages.page_nbytes)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping --------------------------------------------------------------------------
    def clear(self) -> None:
        if self.store is not None:
            self._guarded("clear", None, self.store.clear)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def storage_stats(self) -> StorageStats:
        """The store's counters, with the calls this adapter answered as misses after an
        exception counted in ``errors`` as ``sglang.<call>``."""
        stats = self.store.stats() if self.store is not None else StorageStats()
        with self._lock:
            for call, n in self._failed_calls.items():
                stats.errors[f"sglang.{call}"] = n
        return stats

    def get_stats(self):
        """SGLang's ``StorageMetrics`` of the batches since the last call (None without
        ``enable_storage_metrics``); the lists are cleared."""
        if not self.settings.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            out = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for v in self._metrics.values():
                v.clear()
        return out

    # -- internals -----------------------------------------------------------------------------
    def _transfer(self, direction: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        call = "batch_get_v1" if direction == "prefetch" else "batch_set_v1"
        try:
            if self.pages is None:
                raise StateError("no host pool registered yet (register_mem_pool_host)")
            pages = self.pages.pages_of(host_indices, len(keys))
        except (InvalidArgumentError, StateError) as exc:  # a caller's bug: never a crash
            self._count_failure(call, exc)
            return [False] * len(keys)
        start = time.perf_counter()
        ok = self._run(call, keys, self.pages, pages)
        if self.settings.metrics:
            seconds = max(time.perf_counter() - start, 1e-9)
            done = sum(ok)
            with self._lock:
                self._metrics[f"{direction}_pgs"].append(len(keys))
                gb = done * self.pages.page_nbytes / (1 << 30)
                self._metrics[f"{direction}_bandwidth"].append(gb / seconds)
        return ok

    def _run(
        self, call: str, keys: list[str], source: PageSource, pages: list[int] | None = None
    ) -> list[bool]:
        pages = list(range(len(keys))) if pages is None else pages
        method = self.store.batch_get if "get" in call else self.store.batch_set
        return self._guarded(
            call, [False] * len(keys), lambda: method(self.keys_of(keys), source, pages)
        )

    def _guarded(self, call: str, miss, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - SGLang's storage threads must keep running
            self._count_failure(call, exc)
            return miss

    def _count_failure(self, call: str, exc: BaseException) -> None:
        with self._lock:
            n = self._failed_calls[call] = self._failed_calls.get(call, 0) + 1
        if n == 1 or n % 1000 == 0:
            log.warning("tiered_kv HiCache %s failed (%d so far): %r", call, n, exc)

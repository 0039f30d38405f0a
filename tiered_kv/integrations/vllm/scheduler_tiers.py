"""The scheduler half's view of the tiers: the store opened under the worker's namespace, and a
mirror of which pages the worker's host tier holds.

vLLM runs the worker in its own process (even with one worker on CPU), so the scheduler half
cannot read the worker's host tier. The worker reports its namespace and the host tier's
changes in every step's worker metadata; until the first report, ``ready`` is False (the
connector answers "ask again" and vLLM steps once). The mirror lags the host tier by a step: a
page it names may be gone by the load, which then misses and is recomputed, never wrong.
The store is the worker's store, opened again in this process (every backend allows several
processes: the embedded store's LMDB index is multi-process, Redis and Mooncake are servers).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tiered_kv.integrations.vllm.metadata import TieredKVWorkerMeta
from tiered_kv.integrations.vllm.settings import ConnectorSettings
from tiered_kv.integrations.vllm.tiers import TierCounters
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.guarded_store import GuardedStorage
from tiered_kv.storage.keys import StorageNamespace, page_keys_of


class SchedulerTiers:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.namespace: StorageNamespace | None = None
        self.store: GuardedStorage | None = None
        self._on_host: set[bytes] = set()
        self.counters = TierCounters()  # the lookups; the worker counts the rest

    @property
    def ready(self) -> bool:
        return self.store is not None

    def apply(self, meta: TieredKVWorkerMeta) -> None:
        """A worker's report: open the store on first sight, then replay the host changes."""
        if self.store is None:
            meta.namespace.check_complete()
            s = self.settings.storage
            opener = functools.partial(
                open_backend, s, s.storage_path, meta.namespace, meta.page_nbytes
            )
            self.store = GuardedStorage(opener)
            self.namespace = meta.namespace
        for cached, digest in meta.changes:
            if cached:
                self._on_host.add(digest)
            else:
                self._on_host.discard(digest)

    def lookup(self, digests: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages on the host tier, pages after those in the store); (0, 0) before the
        worker's first report."""
        if self.store is None:
            return 0, 0
        on_host = 0
        for d in digests:
            if d not in self._on_host:
                break
            on_host += 1
        rest = digests[on_host:]
        in_store = self.store.batch_exists(page_keys_of(self.namespace, rest)) if rest else 0
        self.counters.add(lookups=1, lookup_hit_blocks=on_host + in_store)
        return on_host, in_store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

"""The scheduler half's view of the tiers: per worker rank and KV cache group, the store opened
under that rank's namespace for the group and a mirror of which pages that rank's host tier
holds.

vLLM runs the workers in their own processes (even one worker on CPU), so the scheduler half
cannot read a worker's host tier. Each worker reports its namespace and its host tier's changes
in every step's worker metadata (``RankReport``, one per rank); until every rank of the engine
(tensor x pipeline parallel) has reported, ``ready`` is False (the connector answers "ask again"
and vLLM steps once). A page counts as held only if **every** rank holds its shard of it (on
its host tier or in the store under its own namespace): a page one rank lacks is a miss for all,
as vLLM computes a token on every rank or on none. A rank holding none of a group's layers (a
pipeline stage) reports nothing for it and is not asked. The mirror lags the host tier by a step: a
page it names may be gone by the load, which then fails and is recomputed, never wrong. The
store is the workers' store, opened again in this process (every backend allows several
processes: the embedded store's LMDB index is multi-process, Redis and Mooncake are servers).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiered_kv.integrations.vllm.metadata import RankReport, TieredKVWorkerMeta
from tiered_kv.integrations.vllm.settings import ConnectorSettings
from tiered_kv.integrations.vllm.tiers import TierCounters
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.guarded_store import GuardedStorage
from tiered_kv.storage.keys import StorageNamespace, page_keys_of


@dataclass
class _RankView:
    namespace: StorageNamespace
    store: GuardedStorage
    on_host: set[bytes] = field(default_factory=set)

    def held(self, digests: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages on this rank's host tier, pages after those in its store)."""
        on_host = 0
        for d in digests:
            if d not in self.on_host:
                break
            on_host += 1
        rest = digests[on_host:]
        return on_host, self.store.batch_exists(page_keys_of(self.namespace, rest)) if rest else 0

    def each(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether this rank holds each page (host tier or store), one by one."""
        keys = page_keys_of(self.namespace, digests)
        return [
            d in self.on_host or self.store.batch_exists([k]) == 1
            for d, k in zip(digests, keys, strict=True)
        ]


class SchedulerTiers:
    def __init__(self, settings: ConnectorSettings, world_size: int = 1) -> None:
        self.settings = settings
        self.world_size = world_size  # the ranks that must report before lookups start
        self._ranks: dict[tuple[str | None, int], _RankView] = {}  # by (rank, group)
        self.counters = TierCounters()  # the lookups; the workers count the rest

    @property
    def ready(self) -> bool:
        return len({rank for rank, _ in self._ranks}) >= self.world_size

    @property
    def namespaces(self) -> dict[tuple[str | None, int], StorageNamespace]:
        return {rank: v.namespace for rank, v in self._ranks.items()}

    def apply(self, meta: TieredKVWorkerMeta) -> None:
        """The workers' reports: a rank's store opened on first sight, then its host changes
        replayed. A rank reporting another namespace than before is refused (ValueError)."""
        for rank, report in meta.ranks.items():
            view = self._ranks.get(rank)
            if view is None:
                view = self._ranks[rank] = self._open(report)
            elif view.namespace != report.namespace:
                raise ValueError(f"rank {rank!r} changed its namespace")
            for cached, digest in report.changes:
                if cached:
                    view.on_host.add(digest)
                else:
                    view.on_host.discard(digest)

    def _open(self, report: RankReport) -> _RankView:
        report.namespace.check_complete()
        s = self.settings.storage
        opener = functools.partial(
            open_backend, s, s.storage_path, report.namespace, report.page_nbytes
        )
        return _RankView(report.namespace, GuardedStorage(opener))

    def _views(self, group: int) -> list[_RankView]:
        return [v for (_, g), v in self._ranks.items() if g == group]

    def lookup(self, digests: Sequence[bytes], group: int = 0) -> tuple[int, int]:
        """(leading pages every rank holds on its host tier, pages after those every rank holds
        on its host tier or in the store) of ``group``; (0, 0) until every rank has reported."""
        views = self._views(group)
        if not self.ready or not views:
            return 0, 0
        on_host = held = len(digests)
        for view in views:
            h, s = view.held(digests[:held])
            on_host, held = min(on_host, h), min(held, h + s)
            if held == 0:
                break
        on_host = min(on_host, held)
        self.counters.add(lookups=1, lookup_hit_blocks=held)
        return on_host, held - on_host

    def present(self, group: int, digests: Sequence[bytes]) -> list[bool]:
        """Whether every rank holding ``group`` holds each page (its host tier or the store)."""
        views = self._views(group)
        if not self.ready or not views:
            return [False] * len(digests)
        have = [True] * len(digests)
        for view in views:
            idx = [i for i, ok in enumerate(have) if ok]
            for i, ok in zip(idx, view.each([digests[i] for i in idx]), strict=True):
                have[i] = ok
        self.counters.add(lookups=1, lookup_hit_blocks=sum(have))
        return have

    def close(self) -> None:
        for view in self._ranks.values():
            view.store.close()

"""Hit-rate simulation on the cache's own tree and policies, without KV bytes.

:class:`SimCache` drives a real :class:`TieredRadixCache` (the same matching, locking, eviction
policies, write policies and load-back code the serving cache runs) with one "token" per block
(page size 1) and stand-ins for what moves bytes: slot pools that only count, a controller
whose copies complete at once, and a storage tier that remembers keys (LRU under a block
capacity). Per request it does what ``TieredKVCache.begin`` / ``finish`` do: match, prefetch the
storage hit to host, load the host part back to the device, allocate the missed blocks, insert,
release.

Hits are counted by the fastest tier that holds a block (device, then host, then storage).
Whether the tiers are inclusive depends on the write policy: ``write_through`` copies every
block to host as it is inserted, so in steady state the host holds what the device holds
(inclusive, given a host at least as large as the device; host room taken by storage prefetches
can drop such copies); ``write_through_selective`` and ``write_back`` are not inclusive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiered_kv.cache import lifecycle
from tiered_kv.cache.manager import CacheManager
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction, JobId
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.tiered_tree import TieredTree


class CountingSlots:
    """Slot ids from ``1..capacity`` (0 stays the padding slot, as in the real pools)."""

    page_size = 1

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free):
            return None
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self._free.extend(slots.tolist())

    def available_size(self) -> int:
        return len(self._free)


class KeyStore:
    """Storage that remembers keys, LRU under ``capacity`` blocks (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def batch_exists(self, keys) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            self._keys.move_to_end(k)
            n += 1
        return n

    def add(self, keys) -> list[bool]:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while self.capacity is not None and len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            self.evictions += 1
        return [k in self._keys for k in keys]

    def __len__(self) -> int:
        return len(self._keys)


class InstantTransfer:
    """The transfer contract where every job is complete when submitted: device <-> host
    copies succeed, backups add their keys to the key store, prefetches find its leading keys.
    Results are delivered by the next ``poll``, as a real worker's would be."""

    def __init__(self, store: KeyStore | None) -> None:
        self.store = store
        self._results: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        n, pages = len(job.host_indices), job.num_pages
        if job.direction is Direction.HOST_TO_STORAGE:
            done = sum(self.store.add(job.keys))
            result = TransferResult(job.job_id, job.direction, done == pages, n, 0.0, done, pages)
        elif job.direction is Direction.STORAGE_TO_HOST:
            done = self.store.batch_exists(job.keys)
            result = TransferResult(job.job_id, job.direction, done == pages, n, 0.0, done, pages)
        else:
            result = TransferResult(job.job_id, job.direction, True, n, 0.0)
        self._results.append(result)
        return True

    def poll(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out

    def wait(self, job_ids: Iterable[JobId] | None = None, timeout_s: float | None = None) -> bool:
        return True

    def cancel(self, job_id: JobId) -> None:
        return None

    def close(self) -> None:
        return None

    def load_slot(self, job_id: JobId) -> int | None:
        return None

    @property
    def in_flight(self) -> int:
        return len(self._results)


_NAMESPACE = StorageNamespace("sim", b"sim-namespace-16", "sim")


@dataclass
class SimResult:
    requests: int = 0
    blocks: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    missed: int = 0

    def rate(self, tier: str) -> float:
        return getattr(self, tier) / self.blocks if self.blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return (self.device + self.host + self.storage) / self.blocks if self.blocks else 0.0


class SimCache:
    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        storage_blocks: int | None = 0,
        *,
        device_policy: str = "lru",
        host_policy: str = "lru",
        write_policy: str = "write_through",
    ) -> None:
        """``storage_blocks``: 0 for no storage tier, None for an unbounded one."""
        if device_blocks < 1:
            raise InvalidArgumentError(f"device_blocks={device_blocks} must be >= 1")
        if host_blocks < 0:
            raise InvalidArgumentError(f"host_blocks={host_blocks} must be >= 0")
        self.device = CountingSlots(device_blocks)
        self.host = CountingSlots(host_blocks) if host_blocks else None
        store = None
        if storage_blocks != 0 and self.host is not None:
            store = KeyStore(storage_blocks)
        self.store = store
        self.transfer = InstantTransfer(store) if self.host is not None else None
        self.tree = TieredTree(
            1,
            device_policy=device_policy,
            host_policy=host_policy,
            digests=store is not None,
        )
        self.manager = CacheManager(
            self.tree,
            self.device,
            self.host,
            self.transfer,
            self.transfer if store is not None else None,
            store=store,
            namespace=_NAMESPACE if store is not None else None,
            write_policy=write_policy,
        )
        self.result = SimResult()

    def request(self, blocks) -> None:
        """One request through the cache's own lifecycle: begin (match, prefetch the storage
        hit to host, load the host part back), allocate the missed blocks, finish (insert,
        release)."""
        res, manager = self.result, self.manager
        blocks = tuple(blocks)
        res.requests += 1
        res.blocks += len(blocks)
        grant = lifecycle.begin(manager, blocks, prompt_tokens=len(blocks))
        hits = grant.hits
        res.device += hits.device
        res.host += hits.host
        res.storage += hits.storage
        res.missed += hits.missed
        new = manager.alloc_device(len(blocks) - grant.prefix_len)
        if new is None:  # the device cannot hold this request: served, not cached
            lifecycle.abort(manager, grant, grant.slots)
            return
        slots = torch.cat([grant.slots, new])
        lifecycle.finish(manager, grant, blocks, slots, poll=False)

    def run(self, trace) -> SimResult:
        for r in trace:
            self.request(r.blocks)
        return self.result

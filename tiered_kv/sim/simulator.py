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

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiered_radix_cache import TieredRadixCache


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


class _Done:
    def __init__(self, op_id=None, keys=(), pages_done=0, ok=()):
        self.op_id = op_id
        self.keys = list(keys)
        self.pages_done = pages_done
        self.ok = list(ok)
        self.error = None
        self.done = threading.Event()
        self.done.set()

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def synchronize(self) -> None:
        return None

    def cancel(self) -> None:
        return None


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


class InstantController:
    """The controller interface the tree calls; every copy is complete when issued."""

    def __init__(self, storage: KeyStore | None) -> None:
        self.storage = storage
        self._writes: list = []
        self._loads: list = []
        self._backups: list = []

    def write(self, device, host, op_id):
        self._writes.append((op_id, True))
        return _Done()

    def poll_writes(self):
        out, self._writes = self._writes, []
        return out

    def load(self, host, device, op_id):
        self._loads.append((op_id, True))

    def start_loading(self):
        return None

    def poll_loads(self):
        out, self._loads = self._loads, []
        return out

    def backup_to_storage(self, keys, host, op_id):
        op = _Done(op_id, keys, ok=self.storage.add(keys))
        op.pages_done = sum(op.ok)
        self._backups.append(op)
        return op

    def poll_backups(self):
        out, self._backups = self._backups, []
        return out

    def prefetch(self, keys, host, op_id):
        return _Done(op_id, keys, pages_done=self.storage.batch_exists(keys))

    def wait_all(self) -> None:
        return None


class _Namespace:
    fingerprint = b"sim-namespace-16"


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
        self.controller = InstantController(store) if self.host is not None else None
        self.tree = TieredRadixCache(
            self.device,
            self.host,
            self.controller,
            page_size=1,
            device_policy=device_policy,
            host_policy=host_policy,
            write_policy=write_policy,
            namespace=_Namespace() if store is not None else None,
        )
        self.result = SimResult()

    def request(self, blocks) -> None:
        tree, res = self.tree, self.result
        blocks = tuple(blocks)
        res.requests += 1
        res.blocks += len(blocks)
        tree.check_all()
        m = tree.match_prefix(blocks)
        dev, host, storage = m.device_hit_length, m.host_hit_length, 0
        node = m.last_node
        if m.storage_keys:
            op = tree.start_prefetch(m, blocks)
            if op is not None and tree.finish_prefetch(op, None):
                # A second look at this request's prefix: no second hit (as TieredKVCache.begin).
                m2 = tree.match_prefix(blocks, check_storage=False, count_hit=False)
                storage = max(0, m2.device_hit_length + m2.host_hit_length - dev - host)
                node = m2.last_node
        if node is not m.last_device_node and not node.on_device:
            if tree.load_back(node) is None:
                node, host, storage = m.last_device_node, 0, 0
        tree.inc_lock_ref(node)
        hit = dev + host + storage
        new = tree._alloc_device(len(blocks) - hit)
        tree.dec_lock_ref(node)
        res.device += dev
        res.host += host
        res.storage += storage
        res.missed += len(blocks) - hit
        if new is None:
            return  # the device cannot hold this request: served, not cached
        prefix = self._device_slots(blocks[:hit])
        dup = tree.insert(blocks, torch.cat([prefix, new]))
        if dup > hit:
            self.device.free(new[: dup - hit])

    def _device_slots(self, blocks) -> torch.Tensor:
        m = self.tree.match_prefix(blocks, check_storage=False, count_hit=False) if blocks else None
        return m.device_indices if m is not None else torch.empty(0, dtype=torch.int64)

    def run(self, trace) -> SimResult:
        for r in trace:
            self.request(r.blocks)
        return self.result

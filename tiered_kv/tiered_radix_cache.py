"""TieredRadixCache: one prefix tree over device, host and storage, with locks, per-tier
eviction and the write policies.

Residency rules the tree keeps at all times:
- every node is on the device, on the host, or both (a node that loses both leaves the tree);
- device residency is prefix-closed: a node on the device has its parent on the device, so a
  match is "device part, then host part" and ``load_back`` loads the host part's chain
  all-or-nothing;
- ``lock_ref`` > 0 (a request uses the node, or a copy reads its device slots) keeps a node's
  device slots; ``host_ref`` > 0 (a load, backup or prefetch uses the node's host slots) keeps its
  host slots; a node with a copy in flight is never evicted from the tier the copy touches.
Storage is found by key (``batch_exists`` on the chain digests of the pages after the tree's
match), not by tree nodes: a page stays findable after the host drops it, across restarts and
across processes.

Write policies: ``write_through`` backs every inserted node up to host at once (and host to
storage when that copy lands); ``write_through_selective`` does so on a node's
``selective_hits``-th hit; ``write_back`` copies only on eviction (device -> host, waiting for the
copy before freeing device slots; host -> storage, waiting before freeing host slots).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.eviction import EvictionPolicy, make_policy
from tiered_kv.radix_tree import PendingOp as _Op
from tiered_kv.radix_tree import TreeNode, common_pages, first_page, path_to_root, split, walk
from tiered_kv.storage.keys import page_digests
from tiered_kv.tier_eviction import TierEviction
from tiered_kv.tier_prefetch import TierPrefetch

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # device slots of the device-resident prefix
    last_device_node: TreeNode
    last_node: TreeNode  # deepest matched node (on device or host)
    device_hit_length: int
    host_hit_length: int  # tokens after the device part, on host
    storage_hit_length: int  # tokens after the host part, in storage
    storage_keys: list[bytes] = field(default_factory=list)


@dataclass
class TierCounters:
    evicted_tokens: int = 0
    evicted_nodes: int = 0
    dropped_tokens: int = 0  # left the tree entirely (no copy kept anywhere below)
    writes_skipped: int = 0  # no room on the tier below


class TieredRadixCache(TierEviction, TierPrefetch):
    def __init__(
        self,
        device_allocator: Any,
        host_pool: Any | None = None,
        controller: Any | None = None,
        *,
        page_size: int,
        device_policy: str = "lru",
        host_policy: str = "lru",
        write_policy: str = "write_through",
        selective_hits: int = 2,
        namespace: Any | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise InvalidArgumentError(
                f"write_policy={write_policy!r} is unknown; use one of {', '.join(WRITE_POLICIES)}"
            )
        if host_pool is not None and controller is None:
            raise InvalidArgumentError("a host tier needs a controller to move pages")
        self.device_allocator = device_allocator
        self.host_pool = host_pool
        self.controller = controller
        self.page_size = page_size
        self.write_policy = write_policy
        self.selective_hits = selective_hits
        self.namespace = namespace
        self.device_policy: EvictionPolicy = make_policy(device_policy)
        self.host_policy: EvictionPolicy = make_policy(host_policy)
        self.device_counters = TierCounters()
        self.host_counters = TierCounters()
        self.storage_errors = 0
        self._op_ids = itertools.count(1)
        self._ops: dict[int, _Op] = {}
        self.reset()

    # -- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._ops = {}

    @property
    def storage(self) -> Any | None:
        return getattr(self.controller, "storage", None) if self.namespace is not None else None

    def nodes(self) -> list[TreeNode]:
        return list(walk(self.root))

    def device_tokens(self) -> int:
        return sum(len(n) for n in walk(self.root) if n.on_device)

    def host_tokens(self) -> int:
        return sum(len(n) for n in walk(self.root) if n.on_host)

    def evictable_device_tokens(self) -> int:
        return sum(len(n) for n in walk(self.root) if n.on_device and n.lock_ref == 0)

    def pending_ops(self) -> int:
        return len(self._ops)

    # -- locks --------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        for n in path_to_root(node):
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        path = list(path_to_root(node))
        for n in path:
            if n.lock_ref <= 0:
                raise InvalidArgumentError(f"dec_lock_ref on unlocked {n!r}")
        for n in path:
            n.lock_ref -= 1
        for n in path:  # deepest first: a stale copy goes once nothing holds it
            if n.stale and n.lock_ref == 0 and n.on_device and not n.pending:
                if not any(c.on_device for c in n.children.values()):
                    n.stale = False
                    self._free_device(n)

    def inc_host_ref(self, node: TreeNode) -> None:
        for n in path_to_root(node):
            n.host_ref += 1

    def dec_host_ref(self, node: TreeNode) -> None:
        for n in path_to_root(node):
            if n.host_ref <= 0:
                raise InvalidArgumentError(f"dec_host_ref on unprotected {n!r}")
            n.host_ref -= 1

    # -- matching -----------------------------------------------------------------------------
    def _aligned(self, tokens) -> tuple:
        key = tuple(int(t) for t in tokens)
        return key[: len(key) - len(key) % self.page_size]

    def match_prefix(
        self, tokens, *, check_storage: bool = True, count_hit: bool = True
    ) -> MatchResult:
        """Where the longest cached page-aligned prefix of ``tokens`` lives. Counts a hit on
        every matched node (recency, frequency, selective write-through) unless ``count_hit``
        is False (a second look at the same request's prefix)."""
        key = self._aligned(tokens)
        node, pos = self.root, 0
        dev_parts: list[torch.Tensor] = []
        last_dev, dev_len, host_len = self.root, 0, 0
        path = []
        for child, n in self._descend(key):
            path.append(child)
            if child.on_device:
                dev_parts.append(child.device)
                last_dev, dev_len = child, dev_len + n
            else:
                host_len += n
            node, pos = child, pos + n
        for n in path if count_hit else ():
            n.hit_count += 1
            if n.on_device:
                self.device_policy.on_hit(n)
            if n.on_host:
                self.host_policy.on_hit(n)
        if self.write_policy == "write_through_selective" and count_hit:
            todo = [
                n
                for n in path
                if n.on_device and not n.on_host and n.hit_count >= self.selective_hits
            ]
            if todo:
                # The host room for these copies must not come from this very match: protect
                # its path (host part included) while they allocate.
                self.inc_host_ref(node)
                self.inc_lock_ref(last_dev)
                try:
                    for n in todo:
                        self._write_to_host(n)
                finally:
                    self.dec_lock_ref(last_dev)
                    self.dec_host_ref(node)
        storage_len, storage_keys = 0, []
        if check_storage and self.storage is not None and pos < len(key):
            keys = self._keys(key[pos:], node.last_digest())
            found = self._storage_call(lambda: self.storage.batch_exists(keys), 0)
            storage_keys = keys[:found]
            storage_len = found * self.page_size
        device = torch.cat(dev_parts) if dev_parts else _EMPTY
        return MatchResult(device, last_dev, node, dev_len, host_len, storage_len, storage_keys)

    def _descend(self, key: tuple):
        """Follow ``key`` down from the root, yielding (node, tokens matched in it); a node
        matched only in part is split first, so every yielded node is matched whole."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(first_page(key[pos:], self.page_size))
            if child is None:
                return
            n = common_pages(child.key, key[pos:], self.page_size)
            if n < len(child):
                child = self._split(child, n)
            yield child, n
            node, pos = child, pos + n

    def _keys(self, key: tuple, prior: bytes) -> list[bytes]:
        fp = self.namespace.fingerprint
        return [fp + d for d in page_digests(key, self.page_size, prior)]

    def _storage_call(self, fn, default):
        try:
            return fn()
        except Exception:  # noqa: BLE001 - storage trouble is a miss, never an error
            self.storage_errors += 1
            return default

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        front = split(node, at, self.page_size)
        if node.on_device:
            self.device_policy.on_split(node, front)
        if node.on_host:
            self.host_policy.on_split(node, front)
        return front

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, tokens, device_indices: torch.Tensor) -> int:
        """Record that ``tokens`` (whole pages) have KV in ``device_indices``. Returns how many
        leading tokens were already on the device: the caller frees its own slots for those.
        Host-only nodes on the way adopt the caller's slots (they are on the device again)."""
        key = self._aligned(tokens)
        if len(key) != len(tokens) or len(device_indices) != len(key):
            raise InvalidArgumentError(
                f"insert needs whole pages of page_size={self.page_size} and one slot per token; "
                f"got {len(tokens)} tokens and {len(device_indices)} slots"
            )
        node, pos, dup = self.root, 0, 0
        while pos < len(key):
            child = node.children.get(first_page(key[pos:], self.page_size))
            if child is None:
                child = TreeNode(key[pos:], node)
                child.device = device_indices[pos:]
                if self.namespace is not None:
                    child.digests = page_digests(child.key, self.page_size, node.last_digest())
                node.children[first_page(child.key, self.page_size)] = child
                self.device_policy.on_insert(child)
                if self.write_policy == "write_through":
                    self._write_to_host(child)
                break
            n = common_pages(child.key, key[pos:], self.page_size)
            if n < len(child):
                child = self._split(child, n)
            if child.on_device:
                dup = pos + n
            else:
                child.device = device_indices[pos : pos + n]
                self.device_policy.on_insert(child)
            node, pos = child, pos + n
        return dup

    # -- device -> host -----------------------------------------------------------------------
    def _write_to_host(self, node: TreeNode, wait: bool = False) -> bool:
        """Back ``node`` up to host (device slots locked until the copy lands)."""
        if self.host_pool is None or node.on_host or "write" in node.pending:
            return node.on_host
        host = self._alloc_host(len(node), protect=node)
        if host is None:
            self.host_counters.writes_skipped += 1
            return False
        node.host = host
        self.host_policy.on_insert(node)
        op_id = next(self._op_ids)
        op = _Op("write", [node], lock_node=node)
        self.inc_lock_ref(node)
        node.pending["write"] = op
        self._ops[op_id] = op
        op.handle = self.controller.write(node.device, host, op_id)
        if wait:
            try:
                op.handle.synchronize()
            except Exception:  # noqa: BLE001 - reported by the poll below
                pass
            self.writing_check()
        return node.on_host

    def writing_check(self) -> None:
        """Acknowledge finished device -> host copies (never blocks)."""
        if self.controller is None:
            return
        for op_id, ok in self.controller.poll_writes():
            op = self._ops.pop(op_id)
            self.dec_lock_ref(op.lock_node)
            for n in op.nodes:
                n.pending.pop("write", None)
                if not ok and n.host is not None:
                    self.host_pool.free(n.host)
                    self.host_policy.on_remove(n)
                    n.host = None
            if ok and self.write_policy != "write_back":
                for n in op.nodes:
                    self._backup_to_storage(n)

    # -- host -> device -----------------------------------------------------------------------
    def load_back(self, node: TreeNode) -> torch.Tensor | None:
        """Bring the host-only chain ending at ``node`` back to the device, all or nothing.
        Returns the new device slots (top-down order), ``_EMPTY`` if ``node`` is on the device,
        or None when the device cannot make room (nothing changed). The caller issues the
        copies with ``controller.start_loading`` and should lock ``node`` while it uses it."""
        chain = []
        n = node
        while n.parent is not None and not n.on_device:
            chain.append(n)
            n = n.parent
        if not chain:
            return _EMPTY
        chain.reverse()
        total = sum(len(c) for c in chain)
        # Keep the chain's host pages and its device ancestors while the device makes room.
        self.inc_host_ref(node)
        self.inc_lock_ref(n)
        try:
            device = self._alloc_device(total)
        finally:
            self.dec_host_ref(node)
            self.dec_lock_ref(n)
        if device is None:
            return None
        op_id = next(self._op_ids)
        op = _Op("load", list(chain), lock_node=node)
        pos = 0
        for c in chain:
            c.device = device[pos : pos + len(c)]
            pos += len(c)
            self.device_policy.on_insert(c)
            c.pending["load"] = op
            self.controller.load(c.host, c.device, op_id)
        self.inc_lock_ref(node)
        self.inc_host_ref(node)
        self._ops[op_id] = op
        return device

    def loading_check(self) -> None:
        """Acknowledge finished host -> device loads (never blocks)."""
        if self.controller is None:
            return
        for op_id, ok in self.controller.poll_loads():
            op = self._ops.pop(op_id, None)
            if op is None:
                continue
            for n in op.nodes:
                n.pending.pop("load", None)
                # The device copy of a failed load is garbage: it goes as soon as nothing holds
                # it (deepest first, keeping device residency prefix-closed); the host copy stays.
                n.stale = n.stale or not ok
            self.dec_lock_ref(op.lock_node)
            self.dec_host_ref(op.lock_node)

    def holds_stale(self, node: TreeNode) -> bool:
        """Whether the path to ``node`` has a device copy from a failed load."""
        return any(n.stale for n in path_to_root(node))

    # -- host -> storage ----------------------------------------------------------------------
    def _backup_to_storage(self, node: TreeNode, wait: bool = False) -> None:
        if self.storage is None or node.in_storage or node.host is None or "backup" in node.pending:
            return
        keys = [self.namespace.fingerprint + d for d in node.digests]
        op_id = next(self._op_ids)
        op = _Op("backup", [node], lock_node=node)
        self.inc_host_ref(node)
        node.pending["backup"] = op
        self._ops[op_id] = op
        op.handle = self._storage_call(
            lambda: self.controller.backup_to_storage(keys, node.host, op_id), None
        )
        if op.handle is None:
            self._finish_backup(op_id, False)
        elif wait:
            op.handle.done.wait()
            self.backup_check()

    def backup_check(self) -> None:
        """Acknowledge finished host -> storage backups (never blocks)."""
        if self.controller is None or self.storage is None:
            return
        for done in self.controller.poll_backups():
            ok = done.error is None and len(done.ok) == done.num_pages and all(done.ok)
            if done.error is not None:
                self.storage_errors += 1
            self._finish_backup(done.op_id, ok)

    def _finish_backup(self, op_id: int, ok: bool) -> None:
        op = self._ops.pop(op_id, None)
        if op is None:
            return
        self.dec_host_ref(op.lock_node)
        for n in op.nodes:
            n.pending.pop("backup", None)
            n.in_storage = n.in_storage or ok

    def check_all(self) -> None:
        self.writing_check()
        self.loading_check()
        self.backup_check()

    # -- allocation with eviction -------------------------------------------------------------
    def _alloc_device(self, n: int) -> torch.Tensor | None:
        if n == 0:
            return _EMPTY
        out = self.device_allocator.alloc(n)
        if out is None:
            self.make_device_room(n)
            out = self.device_allocator.alloc(n)
        return out

    def make_device_room(self, n: int) -> None:
        """Evict until ``n`` device slots are free; if nodes locked only by copies in flight
        stand in the way, wait for those copies (the one place the tree blocks on a copy)."""
        short = n - self.device_allocator.available_size()
        if short <= 0:
            return
        self.evict_device(short)
        short = n - self.device_allocator.available_size()
        if short > 0 and self._ops and self.controller is not None:
            # Copies and storage backups in flight protect nodes (a backup protects its node's
            # ancestors too); wait for them, acknowledge, and try again.
            self.controller.wait_all()
            for op in list(self._ops.values()):
                if op.kind == "backup" and op.handle is not None:
                    op.handle.done.wait()
            self.check_all()
            self.evict_device(short)

    def _alloc_host(self, n: int, protect: TreeNode | None = None) -> torch.Tensor | None:
        out = self.host_pool.alloc(n)
        if out is None:
            if protect is not None:
                self.inc_host_ref(protect)
            try:
                self.evict_host(n - self.host_pool.available_size())
            finally:
                if protect is not None:
                    self.dec_host_ref(protect)
            out = self.host_pool.alloc(n)
        return out

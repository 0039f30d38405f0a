"""CacheManager: turns the tree's decisions into frees and transfer jobs.

The tree says which pages live where and which may go; the workers move bytes. The manager does
everything in between: the write policies (``write_through`` backs every inserted node up to
host at once, and host to storage when that copy lands; ``write_through_selective`` does so on a
node's ``selective_hits``-th hit; ``write_back`` copies only on eviction, waiting for the copy
before freeing), host -> device load-back (all or nothing per chain), host -> storage backups,
allocation with eviction (it frees what the tree's victims held), and the storage probe: it is
the only place that asks the store what it holds (building page keys with ``storage.keys``, or
its ``SlidingWindow`` for a sliding-window model's two kinds of page).

Every job it submits is recorded with the node it locks and a completion handler; ``poll``
delivers each result exactly once to its handler. Nothing is served from a destination before
its ok result: a failed write frees its host slots, a failed load marks its device copies stale
(freed once nothing holds them), a failed backup leaves the node out of storage.
"""

from __future__ import annotations

import time

import torch

from tiered_kv.cache.accounting import check_slots, free_device_tokens
from tiered_kv.cache.chain_load import ChainLoads
from tiered_kv.cache.copy_batch import CopyBatch
from tiered_kv.cache.eviction import Evictor
from tiered_kv.cache.interfaces import DeviceSlots, HostSlots, LoadWorker, PageProbe, StateHitRule
from tiered_kv.cache.interfaces import TransferWorker as StorageWorker
from tiered_kv.cache.jobs import Job, JobTable
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.cache.prefetch import Prefetcher
from tiered_kv.cache.prefix_match import PrefixMatch, StorageHit
from tiered_kv.cache.window import SlidingWindow, probe_complete
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.names import Direction, PendingKind, WritePolicy, parse
from tiered_kv.storage.keys import StorageNamespace, page_keys_of
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.integrity import check_tree
from tiered_kv.tree.node import TreeNode, path_to_root
from tiered_kv.tree.tiered_tree import TieredTree

_EMPTY = torch.empty(0, dtype=torch.int64)


class CacheManager:
    def __init__(
        self,
        tree: TieredTree,
        device: DeviceSlots,
        host: HostSlots | None = None,
        device_host: LoadWorker | None = None,
        host_storage: StorageWorker | None = None,
        *,
        store: PageProbe | None = None,
        namespace: StorageNamespace | None = None,
        write_policy: str | WritePolicy = WritePolicy.WRITE_THROUGH,
        selective_hits: int = 2,
        metrics: CacheMetrics | None = None,
        window: SlidingWindow | None = None,
        states: StateHitRule | None = None,
    ) -> None:
        self.write_policy = parse(WritePolicy, write_policy, "write_policy")
        if host is not None and device_host is None:
            raise InvalidArgumentError("a host tier needs a device <-> host transfer worker")
        if host_storage is not None and (store is None or namespace is None or host is None):
            raise InvalidArgumentError(
                "a storage worker needs the store (to probe), its namespace and a host tier"
            )
        if host_storage is not None and not tree.digests:
            raise InvalidArgumentError("a storage tier needs a tree built with digests=True")
        self.tree = tree
        self.device = device
        self.host = host
        self.device_host = device_host
        self.host_storage = host_storage
        self.store = store if host_storage is not None else None
        self.namespace = namespace
        self.selective_hits = selective_hits
        self.window = window  # a sliding-window model's hit rule and window KV (or None)
        self.states = states  # a hybrid model's state snapshots (cache.state_hits, or None)
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.page_size = tree.page_size
        self.jobs = JobTable(device_host, host_storage, self.metrics)
        # Copies set up together go as one job per direction (``copy_batch``).
        self.load_batch = CopyBatch(self.jobs, Direction.HOST_TO_DEVICE, self._submit_copy)
        self.write_batch = CopyBatch(self.jobs, Direction.DEVICE_TO_HOST, self._submit_copy)
        backup = Direction.HOST_TO_STORAGE
        self.backup_batch = CopyBatch(self.jobs, backup, self.jobs.submit_storage)
        self.chain_loads = ChainLoads(
            self, tree, device, self.jobs, self.load_batch, device_host, window,
            self.alloc_device, self._submit_copy, self._load_done,
        )  # fmt: skip
        self.prefetcher = Prefetcher(self, self.jobs, tree, host, host_storage, self.metrics)
        self.evictor = Evictor(self, tree, device, host, self.write_policy, self.metrics)
        self.evictor.states = states.ledger if states is not None else None
        self._device0 = free_device_tokens(device)
        self._host0 = host.available_size() if host is not None else 0

    # -- jobs -----------------------------------------------------------------------------------
    def poll(self) -> None:
        """Acknowledge every finished job (never blocks). The storage backups its handlers
        start (landed write-through copies) go as one job."""
        batch = self.backup_batch
        if self.host_storage is None or batch.is_open:
            self.jobs.poll()
            return
        batch.open()
        try:  # submitted before the storage results are read: an instant one lands now
            self.jobs.poll(between=batch.flush)
        finally:
            if batch.is_open:
                batch.flush()

    def wait_all(self, timeout_s: float | None = None) -> bool:
        """Block until every job in flight has finished (acknowledged by the next ``poll``) or
        ``timeout_s`` passed; True when all finished. Copies held by an open write or backup
        batch are submitted first (what is waited for must be in flight)."""
        for batch in (self.write_batch, self.backup_batch):
            if batch.is_open:
                batch.flush()
        return self.jobs.wait_all(timeout_s)

    def drain(self, timeout_s: float) -> None:
        """Wait for every job in flight and acknowledge it; StateError naming what is still
        in flight after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.pending_ops():
            before = self.pending_ops()
            self.wait_all(max(0.0, deadline - time.monotonic()))
            self.poll()
            if self.pending_ops() >= before:
                time.sleep(0.001)  # a storage thread is between its batch and its report
            if self.pending_ops() and time.monotonic() > deadline:
                raise StateError(
                    f"drain: {self.pending_ops()} jobs still in flight after {timeout_s} s "
                    f"({self.jobs.describe()})"
                )

    def pending_ops(self) -> int:
        return len(self.jobs)

    # -- locks ----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Unlock; stale device copies (from failed loads) nothing holds any more are freed."""
        for slots in self.tree.dec_lock_ref(node):
            self.device.free(slots)

    def inc_host_ref(self, node: TreeNode) -> None:
        self.tree.inc_host_ref(node)

    def dec_host_ref(self, node: TreeNode) -> None:
        self.tree.dec_host_ref(node)

    # -- matching and inserting -----------------------------------------------------------------
    def match_prefix(
        self, tokens, *, check_storage: bool = True, count_hit: bool = True, prior: bytes = b""
    ) -> PrefixMatch:
        """Where the longest cached page-aligned prefix of ``tokens`` lives, on every tier,
        for the request identity ``prior`` (``storage.keys.extra_key_prior``; b"": none).
        Splits the tree at the match's end; counts a hit on every matched node unless
        ``count_hit`` is False (a second look at the same request's prefix), which may start
        selective write-throughs; probes storage for the pages after the tree's match."""
        probe = check_storage and self.store is not None
        m = self.tree.match(tokens, probe=probe, prior=prior)
        hit = alt = StorageHit([])
        if probe and m.probe_digests:
            prober = self.window.probe if self.window is not None else probe_complete
            hit, alt = prober(self.namespace, m.probe_digests, self.probe_storage)
        if self.window is not None:
            m, hit = self.window.trim(self.tree, tokens, m, hit, alt, count_hit)
        elif self.states is not None:  # a hit needs the recurrent state at its end
            m, hit = self.states.trim(self.tree, tokens, m, hit, count_hit)
        last_dev, last = self.tree.node_at(m)
        if count_hit:
            path = self.tree.touch(last)
            if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                self._selective_writes(path, last_dev, last)
        return PrefixMatch(
            m.device_indices, last_dev, last, m.device_len, m.host_len,
            hit.pages * self.page_size, hit.keys, hit.windowless, prior,
        )  # fmt: skip

    def probe_storage(self, keys: list[bytes]) -> int:
        """How many of ``keys`` the store holds from the first; a store that raises is a
        counted error and a miss."""
        try:
            return self.store.batch_exists(keys)
        except Exception as exc:  # noqa: BLE001 - storage trouble is a miss, never an error
            self.jobs.storage_error("probe", f"{type(exc).__name__}: {exc}")
            return 0

    def _selective_writes(self, path: list[TreeNode], last_dev: TreeNode, last: TreeNode) -> None:
        todo = [
            n for n in path if n.on_device and not n.on_host and n.hit_count >= self.selective_hits
        ]
        if not todo:
            return
        # The host room for these copies must not come from this very match: protect its path
        # (host part included) while they allocate.
        self.inc_host_ref(last)
        self.inc_lock_ref(last_dev)
        try:
            for n in todo:
                self.write_to_host(n)
        finally:
            self.dec_lock_ref(last_dev)
            self.dec_host_ref(last)

    def insert(
        self, tokens, device_indices: torch.Tensor, windowless: int = 0, prior: bytes = b""
    ) -> int:
        """Record that ``tokens`` (whole pages) have KV in ``device_indices``. Returns how many
        leading tokens were already on the device: the caller frees its own slots for those.
        Slots of tokens the tree declines (below a failed load's stale copy) are freed here.
        Under ``write_through`` new nodes are backed up to host at once. ``windowless``: the
        first tokens hold full KV only (``SlidingWindow.insert``). ``prior``: the request's
        identity (see ``match_prefix``)."""
        if windowless:
            dup = self.window.insert(self, tokens, device_indices, windowless, prior)
        else:
            dup, new, kept = self.tree.insert(tokens, device_indices, prior=prior)
            if kept < len(device_indices):
                self.device.free(device_indices[kept:])
            self.written(new)
        if self.window is not None:
            self.window.drop_adopted(self.tree, tokens, prior)
        return dup

    def written(self, new: list[TreeNode]) -> None:
        """New nodes went into the tree: under ``write_through`` they go to host at once."""
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            for node in new:
                self.write_to_host(node)

    # -- device -> host -------------------------------------------------------------------------
    def write_to_host(self, node: TreeNode, wait: bool = False) -> bool:
        """Back ``node`` up to host (its device slots locked until the copy lands). Returns
        whether the node is on the host now (a copy in flight counts)."""
        if self.host is None or node.on_host or PendingKind.WRITE in node.pending:
            return node.on_host
        host = self.alloc_host(len(node), protect=node)
        if host is None:
            self.metrics.host.writes_skipped += 1
            return False
        self.tree.set_host(node, host)
        job_id = self.jobs.new(PendingKind.WRITE, node, self._write_done)
        self.inc_lock_ref(node)
        self.tree.begin_job(job_id, PendingKind.WRITE, [node])
        job = TransferJob.write(job_id, node.device, host)
        if not wait and self.write_batch.is_open:
            self.write_batch.add(job)  # submitted with the batch's other writes at its flush
        elif self._submit_copy(job) and wait:
            self.device_host.wait([job_id])  # write_back: the device slots are freed next
            self.poll()
        return node.on_host

    def _write_done(self, job: Job, result: TransferResult) -> None:
        self.dec_lock_ref(job.lock_node)
        nodes = self.tree.end_job(result.job_id)
        for n in nodes:
            if not result.ok and n.host is not None:
                self.host.free(self.tree.take_host(n))
        if result.ok and self.write_policy is not WritePolicy.WRITE_BACK:
            for n in nodes:
                self.backup_to_storage(n)

    # -- host -> device -------------------------------------------------------------------------
    def load_back(self, node: TreeNode) -> torch.Tensor | None:
        """Bring the host-only chain ending at ``node`` back to the device as one layer-wise
        load job (``chain_load.ChainLoads.load``: all or nothing, None when it cannot)."""
        return self.chain_loads.load(node)

    def _submit_copy(self, job: TransferJob) -> bool:
        """Submit a device <-> host job. A refusal is a failed result; a worker that raises
        (bad indices: a bug) gets the job failed first, so its handler undoes what was set up
        for it (locks, marks, the new slots), and the error goes on to the caller."""
        try:
            ok = self.device_host.submit(job)
        except BaseException:
            self.jobs.fail(job.job_id, job.direction, None)
            raise
        if not ok:
            self.jobs.fail(job.job_id, job.direction, None)
        return ok

    def load_slot(self, *nodes: TreeNode) -> int | None:
        """The layer-done slot a reader of ``nodes``' paths waits on: the newest load in flight
        into any of them (None if none; loads run in order, so its layers cover every earlier
        load's). A load held by an open batch has no slot yet: ask again after its flush."""
        jobs = [
            self.load_batch.worker_id(n.pending[PendingKind.LOAD])
            for node in nodes
            for n in path_to_root(node)
            if PendingKind.LOAD in n.pending
        ]
        return self.device_host.load_slot(max(jobs)) if jobs else None

    def _load_done(self, job: Job, result: TransferResult) -> None:
        for n in self.tree.end_job(result.job_id):
            if not result.ok:
                # The device copy of a failed load is garbage: it goes as soon as nothing holds
                # it (deepest first, keeping device residency prefix-closed); the host copy stays.
                self.tree.mark_stale(n)
        self.dec_lock_ref(job.lock_node)
        self.dec_host_ref(job.lock_node)

    # -- host -> storage ------------------------------------------------------------------------
    def backup_to_storage(self, node: TreeNode, wait: bool = False) -> None:
        if (
            self.host_storage is None
            or node.in_storage
            or node.host is None
            or PendingKind.BACKUP in node.pending
        ):
            return
        keys = page_keys_of(self.namespace, node.digests, windowless=node.windowless)
        job_id = self.jobs.new(PendingKind.BACKUP, node, self._backup_done)
        self.inc_host_ref(node)
        self.tree.begin_job(job_id, PendingKind.BACKUP, [node])
        job = TransferJob.backup(job_id, keys, node.host)
        if not wait and self.backup_batch.is_open:
            self.backup_batch.add(job)
        elif self.jobs.submit_storage(job) and wait:
            self.host_storage.wait([job_id])  # write_back: the host slots are freed next
            self.poll()

    def _backup_done(self, job: Job, result: TransferResult) -> None:
        self.dec_host_ref(job.lock_node)
        for n in self.tree.end_job(result.job_id):
            if result.ok:
                self.tree.set_in_storage(n)

    # -- allocation with eviction ---------------------------------------------------------------
    def alloc_device(self, n: int) -> torch.Tensor | None:
        if n == 0:
            return _EMPTY
        out = self.device.alloc(n)
        if out is None:
            self.make_device_room(n)
            out = self.device.alloc(n)
        return out

    def alloc_host(self, n: int, protect: TreeNode | None = None) -> torch.Tensor | None:
        """Host slots for ``n`` tokens, evicting host copies if needed (never ``protect``'s
        path)."""
        out = self.host.alloc(n)
        if out is None:
            if protect is not None:
                self.inc_host_ref(protect)
            try:
                self.evict_host(n - self.host.available_size())
            finally:
                if protect is not None:
                    self.dec_host_ref(protect)
            out = self.host.alloc(n)
        return out

    def make_device_room(self, n: int) -> None:
        """Evict until ``n`` device slots are free; if nodes held only by jobs in flight stand
        in the way, wait for those jobs (the one place the manager blocks on a copy)."""
        if self.window is not None and self.window.window_short(n) > 0:
            self.window.evict_window(self.tree, self.window.window_short(n))  # full KV stays
        short = n - self.device.available_size()
        if short <= 0:
            return
        self.evict_device(short)
        short = n - self.device.available_size()
        if short > 0 and len(self.jobs):
            # Copies and storage backups in flight protect nodes (a backup protects its node's
            # ancestors too); wait for them, acknowledge, and try again.
            self.wait_all()
            self.poll()
            self.evict_device(short)

    def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if unlocked nodes allow; returns freed."""
        return self.evictor.evict_device(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if unprotected nodes allow; returns freed."""
        return self.evictor.evict_host(num_tokens)

    # -- checks ---------------------------------------------------------------------------------
    def holds_stale(self, node: TreeNode) -> bool:
        return self.tree.holds_stale(node)

    def check_integrity(self, *, outside_device: int = 0, outside_host: int = 0) -> None:
        """The tree's invariants and every slot accounted for (``cache.accounting``); raises
        IntegrityError with the counts. ``outside_*``: slots held by requests or the caller."""
        check_tree(self.tree, jobs=self.jobs.ids())
        check_slots(self, outside_device, outside_host)

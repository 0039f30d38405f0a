"""ChainLoads: a host-only chain of the tree back onto the device as one layer-wise load job,
and the older loads that one layer-wait slot cannot see fail, acknowledged first.

The manager's ``load_back``: the chain's device slots are allocated (evicting if needed) with
its host pages and device ancestors protected meanwhile, loads still in flight into the device
part above are waited for first (a reader of the chain waits only on this load's layers), and
nothing is loaded below a stale copy. Inside an open load batch the job joins the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_kv.cache.copy_batch import CopyBatch
from tiered_kv.cache.interfaces import DeviceSlots, JobBook, LoadWorker
from tiered_kv.cache.jobs import Job, JobTable
from tiered_kv.cache.window import SlidingWindow
from tiered_kv.names import PendingKind
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.node import TreeNode, path_to_root
from tiered_kv.tree.tiered_tree import TieredTree

_EMPTY = torch.empty(0, dtype=torch.int64)


class ChainLoads:
    """``book``: the manager (acknowledging, locks); ``alloc_device`` allocates with eviction;
    ``submit`` submits a device <-> host job (a refusal fails it); ``on_done`` is the load
    jobs' handler."""

    def __init__(
        self,
        book: JobBook,
        tree: TieredTree,
        device: DeviceSlots,
        jobs: JobTable,
        load_batch: CopyBatch,
        worker: LoadWorker | None,
        window: SlidingWindow | None,
        alloc_device: Callable[[int], torch.Tensor | None],
        submit: Callable[[TransferJob], bool],
        on_done: Callable[[Job, TransferResult], None],
    ) -> None:
        self.book, self.tree, self.device, self.jobs = book, tree, device, jobs
        self.load_batch, self.worker, self.window = load_batch, worker, window
        self.alloc_device, self.submit, self.on_done = alloc_device, submit, on_done

    def load(self, node: TreeNode) -> torch.Tensor | None:
        """Bring the host-only chain ending at ``node`` back to the device, all or nothing, as
        one layer-wise load job. Returns the new device slots (top-down order), an empty tensor
        if ``node`` is on the device, or None when the device cannot make room or the device
        part above the chain turned out stale (nothing changed, or the worker refused the load
        and what was set up for it is undone). Blocks on loads still in flight into that device
        part, and may acknowledge finished jobs. The caller should lock ``node`` while it uses
        it, and look at the tree again after None."""
        chain, n = [], node
        while n.parent is not None and not n.on_device:
            chain.append(n)
            n = n.parent
        if not chain:
            return _EMPTY
        chain.reverse()
        total = sum(len(c) for c in chain)
        # Keep the chain's host pages and its device ancestors while the device makes room.
        self.book.inc_host_ref(node)
        self.book.inc_lock_ref(n)
        try:
            # A load held by the open batch goes in this one's job (one fate, its layers land
            # with these): only loads already submitted are waited for, by their worker's id.
            held = self.load_batch.holds
            above = [
                self.load_batch.worker_id(j)
                for j in (m.pending.get(PendingKind.LOAD) for m in path_to_root(n))
                if j is not None and not held(j)
            ]
            if above:
                # Hazard: a reader of the chain waits on this load's layer events only, which
                # cannot tell that a load still in flight into the device part above failed
                # (that copy is garbage then). Wait for it and acknowledge it first.
                self.worker.wait(above)
                self.book.poll()
            device = self.alloc_device(total)
            if device is not None and self.tree.holds_stale(n):
                # A failed load of the device part above the chain was acknowledged (just
                # above, or while making room): nothing is loaded below garbage.
                self.device.free(device)
                device = None
        finally:
            self.book.dec_host_ref(node)
            self.book.dec_lock_ref(n)
        if device is None:
            return None
        job_id = self.jobs.new(PendingKind.LOAD, node, self.on_done)
        pos = 0
        for c in chain:
            self.tree.set_device(c, device[pos : pos + len(c)])
            pos += len(c)
        if self.window is not None:
            self.window.drop_windowless(chain)  # tombstones get their full KV only
        self.tree.begin_job(job_id, PendingKind.LOAD, chain)
        self.book.inc_lock_ref(node)
        self.book.inc_host_ref(node)
        job = TransferJob.load(job_id, torch.cat([c.host for c in chain]), device)
        if self.load_batch.is_open:
            self.load_batch.add(job)  # submitted with the batch's other loads at its flush
        elif not self.submit(job):
            return None  # refused: its handler dropped the new copies, compute the part instead
        return device

    def settle_older(self, nodes: list[TreeNode] | None = None) -> None:
        """Wait for host -> device loads in flight and acknowledge them: every load (``nodes``
        None; copies to host are not waited for), or all but the newest into ``nodes``' paths.
        Hazard: the layer waits of a forward follow one load's slot, and a newer load's events
        cannot tell that an older one into a path it reads failed (that copy is garbage).
        Acknowledged, a failed load's copies are marked stale: they are not matched again, and a
        request holding one is refused its forward (``prepare_forward``)."""
        worker = self.worker
        if worker is None:
            return
        if nodes is None:
            loads = {self.load_batch.worker_id(j) for j in self.jobs.ids(PendingKind.LOAD)}
            if loads:
                worker.wait(sorted(loads))
                self.book.poll()
            return
        ids = {
            self.load_batch.worker_id(n.pending[PendingKind.LOAD])
            for node in nodes
            for n in path_to_root(node)
            if PendingKind.LOAD in n.pending
        }
        if len(ids) > 1:
            worker.wait(sorted(ids)[:-1])
            self.book.poll()

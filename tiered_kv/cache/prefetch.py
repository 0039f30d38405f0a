"""Prefetcher: storage -> host prefetch of a match's storage hit into the tree.

``start`` takes host slots for the hit (as many pages as the host can hold, halving on
shortage), protects the matched path, and submits one storage -> host job; ``finish`` waits per
the caller's policy (None: until done, 0: not at all, else up to that many seconds), cancels the
rest, waits for the batch in progress (its host slots are about to be used or freed), and
attaches the pages that arrived as host-only nodes already in storage. Slots of pages that did
not arrive, or that the tree gained meanwhile, are freed; if the matched prefix left the tree
meanwhile, everything is freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_kv.cache.interfaces import HostSlots, JobBook, TransferWorker
from tiered_kv.cache.jobs import JobTable
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.names import Direction, JobId
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.node import TreeNode
from tiered_kv.tree.tiered_tree import TieredTree


@dataclass
class PrefetchOp:
    job_id: JobId
    node: TreeNode  # the matched prefix's last node (locked and protected meanwhile)
    key: tuple  # the page-aligned tokens up to the end of what is being fetched
    start: int  # tokens of ``key`` the tree held at the match
    host: torch.Tensor  # host slots being filled
    windowless_end: int = 0  # tokens of ``key`` up to which fetched pages hold full KV only
    result: TransferResult | None = None
    prior: bytes = b""  # the request identity whose pages these are (extra_key_prior)


class Prefetcher:
    def __init__(
        self,
        book: JobBook,
        jobs: JobTable,
        tree: TieredTree,
        host: HostSlots | None,
        worker: TransferWorker | None,
        metrics: CacheMetrics,
    ) -> None:
        self.book = book
        self.jobs = jobs
        self.tree = tree
        self.host = host
        self.worker = worker
        self.metrics = metrics
        self._ops: dict[JobId, PrefetchOp] = {}

    def start(self, match, tokens) -> PrefetchOp | None:
        """Start loading ``match``'s storage hit (a ``PrefixMatch``) into host slots. Returns
        the operation to pass to ``finish``, or None (nothing to fetch, no host room, or the
        worker refused: nothing changed)."""
        if not match.storage_keys or self.worker is None:
            return None
        node, ps = match.last_node, self.tree.page_size
        pages = len(match.storage_keys)
        self.book.inc_lock_ref(node)
        self.book.inc_host_ref(node)
        host = self.book.alloc_host(pages * ps)
        while host is None and pages > 1:
            pages //= 2
            host = self.book.alloc_host(pages * ps)
        if host is None:
            self._release(node)
            self.metrics.host.writes_skipped += 1
            return None
        start = match.device_hit_length + match.host_hit_length
        key = self.tree.aligned(tokens)[: start + pages * ps]
        job_id = self.jobs.new(Direction.STORAGE_TO_HOST, node, self._done)
        bare = start + min(match.storage_windowless, pages) * ps
        op = PrefetchOp(
            job_id, node, key, start, host, bare if bare > start else 0, prior=match.prior
        )
        self._ops[job_id] = op
        job = TransferJob.prefetch(job_id, match.storage_keys[:pages], host)
        if not self.jobs.submit_storage(job):
            self._end(op)
            return None
        return op

    def _done(self, job, result: TransferResult) -> None:
        self._ops.pop(result.job_id).result = result

    def finish(self, op: PrefetchOp, timeout_s: float | None) -> int:
        """Wait up to ``timeout_s`` (None: until done, 0: not at all), stop the rest, and put
        the pages that arrived into the tree as host-only nodes. Returns tokens gained."""
        if op.result is None:
            if timeout_s is None or timeout_s > 0:
                self.worker.wait([op.job_id], timeout_s)
            self.worker.cancel(op.job_id)
            # Hazard: the batch in progress is still writing into ``op.host``; those slots are
            # attached or freed next, so wait for it (one batch at most).
            self.worker.wait([op.job_id])
            self.book.poll()
        return self._end(op)

    def _end(self, op: PrefetchOp) -> int:
        self._release(op.node)
        ps = self.tree.page_size
        got = (op.result.pages_done if op.result is not None else 0) * ps
        if got < len(op.host):
            self.host.free(op.host[got:])
        if got == 0:
            return 0
        return self._attach(
            op.key[: op.start + got], op.start, op.host[:got], op.windowless_end, op.prior
        )

    def _release(self, node: TreeNode) -> None:
        self.book.dec_lock_ref(node)
        self.book.dec_host_ref(node)

    def _attach(
        self, key: tuple, start: int, host: torch.Tensor, bare: int = 0, prior: bytes = b""
    ) -> int:
        """Attach host slots for ``key[start:]`` below the path of ``key[:start]``; slots for
        tokens the tree already holds (or cannot attach) are freed. Tokens before ``bare``
        came from full-KV-only values: they go in as a windowless node of their own. Returns
        tokens attached."""
        m = self.tree.match(key, probe=False, prior=prior)
        _, node = self.tree.node_at(m)
        pos = m.length
        if pos < start:  # the prefix left the tree meanwhile
            self.host.free(host)
            return 0
        if pos > start:
            self.host.free(host[: pos - start])
        if pos == len(key):
            return 0
        if self.tree.has_child(node, key[pos:]):
            # The match stopped at a failed load's stale copy: the pages below it are not kept
            # (nothing is built upon garbage).
            self.host.free(host[pos - start :])
            return 0
        attached = 0
        for lo, hi, windowless in (
            (pos, min(bare, len(key)), True),
            (max(pos, bare), len(key), False),
        ):
            if hi <= lo:
                continue
            node = self.tree.add_child(node, key[lo:hi])
            if windowless:
                self.tree.set_windowless(node)
            self.tree.set_host(node, host[lo - start : hi - start])
            self.tree.set_in_storage(node)
            attached += hi - lo
        return attached

"""Prefetcher: storage -> host prefetch of a match's storage hit into the tree.

``start`` takes host slots for the hit (as many pages as the host can hold, halving on
shortage), protects the matched path, and submits one storage -> host job; ``finish`` waits per
the caller's policy (None: until done, 0: not at all, else up to that many seconds), cancels the
rest, waits for the batch in progress (its host slots are about to be used or freed), and
attaches the pages that arrived as host-only nodes already in storage. Slots of pages that did
not arrive, or that the tree gained meanwhile, are freed; if the matched prefix left the tree
meanwhile, everything is freed.

Requests begun together (``open`` ... ``flush``, then ``finish_many``) share one storage job:
each ``start`` hands its job to a ``CopyBatch``, which submits them as one job of one segment
per request, each chain stopping at its own first missing page. A request whose leading keys
an earlier request of the batch already fetches (the same identity and prefix: a key names its
whole chain) fetches only the pages after them, and takes its pages only if those arrived;
``finish_many`` ends the operations in order, so the earlier one attaches them first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_kv.cache.copy_batch import CopyBatch
from tiered_kv.cache.interfaces import HostSlots, JobBook, TransferWorker
from tiered_kv.cache.jobs import JobTable
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.names import Direction, JobId
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.node import TreeNode
from tiered_kv.tree.tiered_tree import TieredTree

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class PrefetchOp:
    job_id: JobId | None  # None: every page it wants is fetched by earlier ops of its batch
    node: TreeNode  # the matched prefix's last node (locked and protected meanwhile)
    key: tuple  # the page-aligned tokens up to the end of what is being fetched
    start: int  # tokens of ``key`` the tree held at the match
    host: torch.Tensor  # host slots being filled (for the pages after ``after``'s)
    windowless_end: int = 0  # tokens of ``key`` up to which fetched pages hold full KV only
    result: TransferResult | None = None
    prior: bytes = b""  # the request identity whose pages these are (extra_key_prior)
    # Its leading pages fetched by earlier ops of the same batch: (that op, its page index).
    after: tuple[tuple[PrefetchOp, int], ...] = ()

    def own_pages_usable(self) -> bool:
        """Whether every page in ``after`` arrived (its own pages hang below them)."""
        return all(o.result is not None and o.result.pages_done > i for o, i in self.after)


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
        self.batch = CopyBatch(jobs, Direction.STORAGE_TO_HOST, jobs.submit_storage)
        self._claims: dict[bytes, tuple[PrefetchOp, int]] = {}  # key -> op fetching it

    def open(self) -> None:
        """Hold the jobs of the next ``start`` calls until ``flush`` (one job for all)."""
        self.batch.open()
        self._claims = {}

    def flush(self) -> bool:
        """Submit the held jobs as one; False when refused (every part failed then)."""
        self._claims = {}
        return self.batch.flush()

    def start(self, match, tokens) -> PrefetchOp | None:
        """Start loading ``match``'s storage hit (a ``PrefixMatch``) into host slots. Returns
        the operation to pass to ``finish``, or None (nothing to fetch, no host room, or the
        worker refused: nothing changed)."""
        if not match.storage_keys or self.worker is None:
            return None
        node, ps, keys = match.last_node, self.tree.page_size, match.storage_keys
        after: list[tuple[PrefetchOp, int]] = []
        if self.batch.is_open:  # leading pages an earlier request of the batch fetches
            while len(after) < len(keys) and keys[len(after)] in self._claims:
                after.append(self._claims[keys[len(after)]])
        own = len(keys) - len(after)
        self.book.inc_lock_ref(node)
        self.book.inc_host_ref(node)
        host = self.book.alloc_host(own * ps) if own else _EMPTY
        while host is None and own > 1:
            own //= 2
            host = self.book.alloc_host(own * ps)
        if host is None:
            self.metrics.host.writes_skipped += 1
            if not after:
                self._release(node)
                return None
            own, host = 0, _EMPTY
        start = match.device_hit_length + match.host_hit_length
        pages = len(after) + own
        key = self.tree.aligned(tokens)[: start + pages * ps]
        bare = start + min(match.storage_windowless, pages) * ps
        op = PrefetchOp(
            None, node, key, start, host, bare if bare > start else 0, prior=match.prior
        )
        op.after = tuple(after)
        if not own:
            return op
        op.job_id = self.jobs.new(Direction.STORAGE_TO_HOST, node, self._done)
        self._ops[op.job_id] = op
        job = TransferJob.prefetch(op.job_id, keys[len(after) : pages], host)
        if self.batch.is_open:
            self.batch.add(job)
            for i, k in enumerate(job.keys):
                self._claims[k] = (op, i)
        elif not self.jobs.submit_storage(job):
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

    def finish_many(self, ops: list[PrefetchOp], timeout_s: float | None) -> list[int]:
        """``finish`` for the operations of one flushed batch (one wait, one cancel), ended in
        the order they started. Returns each one's tokens gained."""
        ids = {self.batch.worker_id(op.job_id) for op in ops if op.job_id and op.result is None}
        if ids:
            if timeout_s is None or timeout_s > 0:
                self.worker.wait(ids, timeout_s)
            for job_id in ids:
                self.worker.cancel(job_id)
            # Hazard: as in ``finish``, the batch in progress still writes into the ops' slots.
            self.worker.wait(ids)
            self.book.poll()
        return [self._end(op) for op in ops]

    def _end(self, op: PrefetchOp) -> int:
        self._release(op.node)
        ps = self.tree.page_size
        got = 0
        if op.result is not None and op.own_pages_usable():
            got = op.result.pages_done * ps
        if got < len(op.host):
            self.host.free(op.host[got:])
        if got == 0:
            return 0
        first = op.start + len(op.after) * ps  # the earlier ops attached the pages before
        return self._attach(
            op.key[: first + got], first, op.host[:got], op.windowless_end, op.prior
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

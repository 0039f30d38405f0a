"""JobTable: the manager's record of every transfer job in flight, and its delivery of results.

Each job is recorded with the tree node it locks (or protects) and a completion handler; the
table hands out job ids, submits storage jobs so that a refusal or a raising worker becomes a
failed result (a counted storage error, never an exception on the serving path), and delivers
each result from the workers' ``poll`` exactly once to its handler. Each job a worker ran or
refused is shown once to ``observe`` (the cache's transfer histograms); a storage error is
counted, and logged at WARNING once per kind a minute (a dead store fails every call).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tiered_kv.cache.interfaces import TransferWorker
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.log_limit import LogLimiter
from tiered_kv.names import Direction, JobId, PendingKind
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.node import TreeNode

log = logging.getLogger(__name__)


@dataclass
class Job:
    kind: PendingKind | Direction
    lock_node: TreeNode | None
    on_done: Callable[[Job, TransferResult], None]


class JobTable:
    def __init__(
        self,
        device_host: TransferWorker | None,
        host_storage: TransferWorker | None,
        metrics: CacheMetrics,
    ) -> None:
        self.device_host = device_host
        self.host_storage = host_storage
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._jobs: dict[JobId, Job] = {}
        # Sees each worker job's result once (a merged batch once, not per part); the cache
        # sets it to its transfer histograms.
        self.observe: Callable[[TransferResult], None] | None = None
        self._errors = LogLimiter(log)

    def new(
        self,
        kind: PendingKind | Direction,
        lock_node: TreeNode | None,
        on_done: Callable[[Job, TransferResult], None],
    ) -> JobId:
        """Record a job about to be submitted; ``on_done`` gets its result."""
        job_id = JobId(next(self._ids))
        self._jobs[job_id] = Job(kind, lock_node, on_done)
        return job_id

    def fail(self, job_id: JobId, direction: Direction, error: str | None) -> None:
        """Deliver a failed result for a job its worker refused."""
        result = TransferResult(job_id, direction, False, 0, 0.0, error=error)
        if self.observe is not None:
            self.observe(result)
        self.deliver(result)

    def submit_storage(self, job: TransferJob) -> bool:
        """Submit a storage job; a refusal or a worker that raises is a failed result."""
        try:
            if self.host_storage.submit(job):
                return True
            error = "storage worker refused the job"
        except Exception as exc:  # noqa: BLE001 - storage trouble is a miss, never an error
            error = f"{type(exc).__name__}: {exc}"
        self.fail(job.job_id, job.direction, error)
        return False

    def deliver(self, result: TransferResult) -> None:
        job = self._jobs.pop(result.job_id)
        if result.error is not None:
            self.storage_error(str(result.direction), result.error)
        job.on_done(job, result)

    def storage_error(self, what: str, error: str) -> None:
        """Count one failed storage call or job (``what``: the call or the job's direction,
        ``error``: ``ExceptionType: message``) and log it, rate-limited per kind."""
        self.metrics.storage_errors += 1
        kind = f"{what}: {error.partition(':')[0]}"
        self._errors.log(logging.WARNING, kind, "storage %s failed: %s", what, error)

    def poll(self, between: Callable[[], None] | None = None) -> None:
        """Deliver every finished job (never blocks): device <-> host first, then storage, so
        a landed write's backup can be acknowledged in the same call where it is instant.
        ``between`` runs after the first and before the second (submitting batched backups)."""
        for worker in (self.device_host, self.host_storage):
            if worker is self.host_storage and between is not None:
                between()
            if worker is not None:
                for result in worker.poll():
                    if self.observe is not None:
                        self.observe(result)
                    self.deliver(result)

    def wait_all(self, timeout_s: float | None = None) -> bool:
        """Block until every job in flight has finished (results still come from ``poll``), or
        ``timeout_s`` passed (storage jobs; device <-> host copies are always waited for).
        True when everything finished."""
        done = True
        for worker in (self.device_host, self.host_storage):
            if worker is not None:
                done = worker.wait(None, timeout_s) and done
        return done

    def __len__(self) -> int:
        return len(self._jobs)

    def ids(self, kind: PendingKind | Direction | None = None) -> set[JobId]:
        """The jobs in flight (of ``kind`` only, if given)."""
        return {i for i, j in self._jobs.items() if kind is None or j.kind == kind}

    def describe(self) -> str:
        """The jobs in flight by kind, e.g. ``backup: 1, write: 2``."""
        kinds: dict[str, int] = {}
        for job in self._jobs.values():
            kinds[str(job.kind)] = kinds.get(str(job.kind), 0) + 1
        return ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "none"

"""HostStorageTransfer: host <-> storage jobs on two background threads.

- backup jobs (host -> storage) run on the backup thread, in batches of ``batch_pages``;
- prefetch jobs (storage -> host) run on the prefetch thread, in batches, stopping at the first
  page the store does not serve (a missing or corrupt page ends the usable prefix), so the host
  pages after it are never written. A prefetch of several chains (``TransferJob.segments``: a
  step's requests merged into one job) reads them in batches across the chains, one
  ``batch_get`` per batch; each chain stops at its own first page not served (later batches
  skip it; its pages after the miss in the same batch are read and dropped), and a store call
  that raises ends only the chains it read: another request's hole never stops a chain.

Storage trouble (the store raising, a removed directory) becomes a failed result carrying the
error, never an exception in the caller. ``cancel`` stops a job after its batch in progress;
what it finished by then stays valid (``pages_done``).

A ``wait`` without a timeout runs the jobs it waits for that no thread has started yet on the
calling thread (the caller would block until they finish anyway): no handoff to a thread and
back, which costs ~150 us on a 2-core VM. The stores are thread-safe; jobs of one direction may
then run concurrently, which no job depends on (each has its own keys and host pages).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction, JobId
from tiered_kv.storage.contract import PageStorage
from tiered_kv.transfer.base import HostPages, TransferJob, TransferResult, TransferWorker
from tiered_kv.transfer.stats import TransferStats

_CPU = torch.device("cpu")

# Workers their owner did not close are closed at interpreter exit, before Python freezes its
# daemon threads: a thread frozen while inside torch makes the process abort ("terminate called
# without an active exception") instead of exiting with its own status. Their submitted jobs get
# EXIT_WAIT_S to finish; a store that hangs past that cannot hold the exit.
EXIT_WAIT_S = 30.0
_OPEN: weakref.WeakSet[HostStorageTransfer] = weakref.WeakSet()
_registered = False


def _close_open_workers() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for worker in list(_OPEN):
        worker.close(timeout_s=max(0.0, deadline - time.monotonic()))


def _track(worker: HostStorageTransfer) -> None:
    global _registered
    # Registered on first use, after the copy engine's own exit hook (imported with the host
    # pool): exit hooks run last-registered first, so these threads stop while engines still run.
    if not _registered:
        atexit.register(_close_open_workers)
        _registered = True
    _OPEN.add(worker)


@dataclass
class _StorageCopy:
    job: TransferJob
    pages: list[int]  # host page numbers, in key order
    pages_done: int = 0
    segment_done: list[int] = field(default_factory=list)  # a segmented prefetch's, per chain
    ok: list[bool] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    cancelled: bool = False
    claimed: bool = False  # a thread (a worker, or a waiter) has taken it; under the lock
    done: threading.Event = field(default_factory=threading.Event)


class HostStorageTransfer(TransferWorker):
    directions = (Direction.HOST_TO_STORAGE, Direction.STORAGE_TO_HOST)

    def __init__(
        self,
        host_pool: HostPages,
        storage: PageStorage,
        *,
        batch_pages: int = 32,
        stats: TransferStats | None = None,
    ) -> None:
        self.host_pool = host_pool
        self.storage = storage
        self.page_size = host_pool.page_size
        self.batch_pages = check_positive_int("storage_batch_pages", batch_pages)
        self.stats = stats if stats is not None else TransferStats()
        self._done: queue.SimpleQueue[_StorageCopy] = queue.SimpleQueue()
        self._by_id: dict[JobId, _StorageCopy] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._queues = {d: queue.SimpleQueue() for d in self.directions}
        self._runs = {
            Direction.HOST_TO_STORAGE: self._run_backup,
            Direction.STORAGE_TO_HOST: self._run_prefetch,
        }
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(self._queues[d],),
                name=f"tiered-kv-{'backup' if d is Direction.HOST_TO_STORAGE else 'prefetch'}",
                daemon=True,
            )
            for d in self.directions
        ]
        for t in self._threads:
            t.start()
        _track(self)

    # -- the contract ---------------------------------------------------------------------------
    def submit(self, job: TransferJob) -> bool:
        if job.direction not in self.directions:
            raise InvalidArgumentError(
                f"direction={job.direction!r} is not moved by this worker; it moves "
                f"{', '.join(map(str, self.directions))}"
            )
        pages = self._pages_of(job)
        if job.segments and (sum(job.segments) != job.num_pages or min(job.segments) < 1):
            raise InvalidArgumentError(
                f"segments {list(job.segments)[:8]} must be page counts >= 1 summing to the "
                f"job's {job.num_pages} keys"
            )
        with self._lock:
            if self._closed:
                return False
            if job.job_id in self._by_id:
                raise InvalidArgumentError(f"job_id={job.job_id} is already in flight")
            copy = _StorageCopy(job, pages)
            self._by_id[job.job_id] = copy
            self._queues[job.direction].put(copy)
        return True

    def _pages_of(self, job: TransferJob) -> list[int]:
        host = check_index_tensor("host_indices", job.host_indices, _CPU)
        p = self.page_size
        if len(host) != job.num_pages * p:
            raise InvalidArgumentError(
                f"{job.num_pages} page keys need {job.num_pages * p} host slots, got {len(host)}"
            )
        # numpy: a few us per op where torch's dispatch costs ~5 each (60 us for one page)
        slots = host.numpy()
        if p == 1:  # every slot is a whole page: nothing to check (~2 us, not ~17)
            return slots.tolist()
        rows = slots.astype(np.int64, copy=False).reshape(-1, p)
        firsts = rows[:, 0]
        good = (firsts % p == 0) & (np.diff(rows, axis=1) == 1).all(axis=1)
        if not good.all():
            bad = rows[~good][:2].tolist()
            raise InvalidArgumentError(
                f"host_indices must be whole host pages (page * {p} + 0..{p - 1}, in order); "
                f"got slot runs {bad}"
            )
        return (firsts // p).tolist()

    def poll(self) -> list[TransferResult]:
        out = []
        while True:
            try:
                copy = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                del self._by_id[copy.job.job_id]
            out.append(_result(copy))

    def wait(self, job_ids: Iterable[JobId] | None = None, timeout_s: float | None = None) -> bool:
        with self._lock:
            ids = list(self._by_id) if job_ids is None else list(job_ids)
            copies = [self._by_id.get(i) for i in ids]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for copy in copies:
            if copy is None:
                continue  # already delivered by poll
            if deadline is None and self._claim(copy):
                self._execute(copy)  # not started: run it here rather than wait for a thread
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not copy.done.wait(left):
                return False
        return True

    def cancel(self, job_id: JobId) -> None:
        with self._lock:
            copy = self._by_id.get(job_id)
        if copy is not None:
            copy.cancelled = True

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._by_id)

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish what was submitted, then stop the threads. With ``timeout_s``, jobs not done
        by then are cancelled (each stops after its batch in progress, its results stay
        valid); returns whether the threads had stopped by the deadline."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            for q in self._queues.values():
                q.put(None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            with self._lock:
                for copy in self._by_id.values():
                    copy.cancelled = True
            for t in self._threads:
                t.join(1.0)
        return not any(t.is_alive() for t in self._threads)

    # -- the threads ----------------------------------------------------------------------------
    def _claim(self, copy: _StorageCopy) -> bool:
        with self._lock:
            if copy.claimed:
                return False
            copy.claimed = True
            return True

    def _worker(self, q: queue.SimpleQueue) -> None:
        while True:
            copy = q.get()
            if copy is None:
                return
            if self._claim(copy):  # else a waiter is running it
                self._execute(copy)

    def _execute(self, copy: _StorageCopy) -> None:
        try:
            self._runs[copy.job.direction](copy)
        except Exception as exc:  # noqa: BLE001 - storage trouble is a failed result
            copy.error = f"{type(exc).__name__}: {exc}"
        finally:
            # Only now is the copy final (error, pages_done): report it, then signal it, so
            # that a poll after a wait that returned True delivers it.
            self._done.put(copy)
            copy.done.set()

    def _run_backup(self, copy: _StorageCopy) -> None:
        keys, pages, step = copy.job.keys, copy.pages, self.batch_pages
        page_nbytes = self.host_pool.page_nbytes
        for i in range(0, len(pages), step):
            if copy.cancelled:
                return
            start = time.perf_counter()
            ok = self.storage.batch_set(
                list(keys[i : i + step]), self.host_pool, pages[i : i + step]
            )
            seconds = time.perf_counter() - start
            written = sum(ok)
            self.stats.add(
                Direction.HOST_TO_STORAGE, written * page_nbytes, seconds, written == len(ok)
            )
            copy.ok.extend(ok)
            copy.pages_done += written
            copy.nbytes += written * page_nbytes
            copy.seconds += seconds

    def _run_prefetch(self, copy: _StorageCopy) -> None:
        if len(copy.job.segments) > 1:
            self._run_segments(copy)
            return
        keys, pages, step = copy.job.keys, copy.pages, self.batch_pages
        page_nbytes = self.host_pool.page_nbytes
        for i in range(0, len(pages), step):
            if copy.cancelled:
                return
            start = time.perf_counter()
            batch = list(keys[i : i + step])
            # Read only the leading pages the store holds: the host pages after the first
            # missing one are left untouched (and no I/O is spent on pages that are dropped).
            present = self.storage.batch_exists(batch)
            ok = []
            if present:
                ok = self.storage.batch_get(batch[:present], self.host_pool, pages[i : i + present])
            lead = next((j for j, hit in enumerate(ok) if not hit), len(ok))
            seconds = time.perf_counter() - start
            self.stats.add(Direction.STORAGE_TO_HOST, lead * page_nbytes, seconds)
            copy.pages_done += lead
            copy.nbytes += lead * page_nbytes
            copy.seconds += seconds
            if lead < len(batch):
                return

    def _run_segments(self, copy: _StorageCopy) -> None:
        """A prefetch of several chains: ``batch_pages`` pages per ``batch_get`` across the
        chains still going, in job order; ``segment_done`` counts each chain's leading pages.
        No ``batch_exists`` first: it stops at the first miss of the whole list, so it would
        cost a call per chain; a missing key costs ``batch_get`` no read."""
        job, step = copy.job, self.batch_pages
        page_nbytes = self.host_pool.page_nbytes
        owner = [s for s, n in enumerate(job.segments) for _ in range(n)]
        done = copy.segment_done = [0] * len(job.segments)
        ended = [False] * len(job.segments)
        i = 0
        while i < len(owner):
            if copy.cancelled:
                return
            batch: list[int] = []
            while i < len(owner) and len(batch) < step:
                if not ended[owner[i]]:
                    batch.append(i)
                i += 1
            if not batch:
                return
            start = time.perf_counter()
            try:
                ok = self.storage.batch_get(
                    [job.keys[j] for j in batch], self.host_pool, [copy.pages[j] for j in batch]
                )
            except Exception as exc:  # noqa: BLE001 - the chains it read end here, a miss
                ok = []
                copy.error = copy.error or f"{type(exc).__name__}: {exc}"
            ok = list(ok) + [False] * (len(batch) - len(ok))
            landed = 0
            for j, hit in zip(batch, ok, strict=True):
                s = owner[j]
                if ended[s] or not hit:
                    ended[s] = True  # a page after a chain's first miss is dropped
                    continue
                done[s] += 1
                landed += 1
            seconds = time.perf_counter() - start
            self.stats.add(Direction.STORAGE_TO_HOST, landed * page_nbytes, seconds)
            copy.pages_done += landed
            copy.nbytes += landed * page_nbytes
            copy.seconds += seconds


def _result(copy: _StorageCopy) -> TransferResult:
    job = copy.job
    if job.direction is Direction.HOST_TO_STORAGE:
        ok = copy.error is None and len(copy.ok) == job.num_pages and all(copy.ok)
    else:
        ok = copy.error is None and copy.pages_done == job.num_pages
    return TransferResult(
        job.job_id,
        job.direction,
        ok,
        copy.nbytes,
        copy.seconds,
        copy.pages_done,
        job.num_pages,
        copy.error,
        tuple(copy.segment_done or [0] * len(job.segments)) if len(job.segments) > 1 else (),
    )

"""The native copy engine (``native/copy_engine.c``): row-copy jobs on a persistent C thread.

Re-exports what a caller needs with it: :class:`RowJob`, :class:`RowShape`, ``engine_threads``
(``row_job``), :class:`IndexCheck` (``index_check``) and ``available`` (``engine_lib``).

A :class:`RowJob` describes one page transfer the way the C side walks it (device rows, each
token's host record offset, the device buffers' base addresses, the row and part sizes) and
keeps alive every array and tensor it points into. :class:`CopyEngine` queues jobs on its copier
thread without the GIL, and each job's completion is one int64 per layer (or one for a whole
job) that the C side sets after the bytes: :class:`RowEvent` reads and waits on it, in C, with
the GIL released; a thread that waits copies units of the engine's work meanwhile (or runs the
queued job itself when nothing is being copied). ``CopyEngine.run`` runs a job now on the
calling thread and the engine's helpers; ``run_rows`` on the calling thread alone.

Handing a job to a Python thread costs ~75 us on a 2-core VM (a queue put, a wake-up, an
event set and a second wake-up); here a submit is one C call and a copier that has just
finished a job spins ``spin_us`` before sleeping, so back-to-back jobs start without a wake-up.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from collections import deque

import numpy as np

from tiered_kv.errors import BackendUnavailableError, StateError, TransferError
from tiered_kv.kernels.engine_lib import available, lib
from tiered_kv.kernels.index_check import IndexCheck
from tiered_kv.kernels.row_job import RowJob, RowShape, engine_threads


def run_rows(job: RowJob) -> None:
    """Copy every layer of ``job`` on the calling thread (GIL released)."""
    if lib().tkv_rows_copy(ctypes.byref(job.struct(None))) != 0:
        raise TransferError(
            f"the native copy engine refused a job of {job.dev_rows.numel()} rows over layers "
            f"{job.layers.tolist()[:8]}; every layer must be < {job.shape.total_layers}, counts "
            ">= 0, threads >= 1"
        )


class RowEvent:
    """Completion of status entry ``index`` of a submitted job (a ``streams.CopyEvent``)."""

    __slots__ = ("_done", "_index", "_submitted")

    def __init__(self, submitted: SubmittedJob, index: int) -> None:
        self._submitted = submitted
        self._index = index
        self._done = 0

    def _status(self) -> int:
        if self._done == 0:
            self._done = self._submitted.status_of(self._index)
        return self._done

    def query(self) -> bool:
        return self._status() != 0

    def synchronize(self) -> None:
        if self._done == 0:
            self._done = self._submitted.wait_for(self._index)
        if self._done < 0:
            job = self._submitted.job
            what = "job" if job.whole else f"local layer {self._index}"
            raise TransferError(
                f"the native copy engine refused {what}: layers must be < "
                f"{job.shape.total_layers} and counts >= 0"
            )

    def wait(self) -> None:
        self.synchronize()

    @property
    def submitted(self) -> SubmittedJob:
        """The job this event belongs to (``finished`` answers for all of its entries)."""
        return self._submitted

    def seconds(self) -> float:
        if not self._status():
            return 0.0
        return float(self._submitted.track[self._submitted.job.entries + self._index]) / 1e9


class SubmittedJob:
    """A job in the engine: its status entries then durations (``track``), and the job."""

    __slots__ = ("engine", "job", "struct", "track", "_base", "_last_seen")

    def __init__(self, engine: CopyEngine, job: RowJob) -> None:
        self.engine = engine
        self.job = job
        self.track = np.zeros(2 * job.entries, dtype=np.int64)
        self._base = self.track.ctypes.data
        self.struct = job.struct(self.track)
        self._last_seen = False  # the last entry was read set: every entry is (in order)

    def status_of(self, index: int) -> int:
        if not self._last_seen:
            # The last entry first: once it is set every entry is, and the rest are plain
            # reads of ``track`` (a poll of 32 layers is one C call, not 32).
            last = self.job.entries - 1
            if not self.engine.lib.tkv_status(self._base + 8 * last):
                return int(self.engine.lib.tkv_status(self._base + 8 * index))
            self._last_seen = True
        return int(self.track[index])

    def is_done(self) -> bool:
        """Whether every entry is set (never blocks)."""
        return self.status_of(self.job.entries - 1) != 0

    def finished(self) -> tuple[bool, float] | None:
        """(every entry done, total seconds) once the last entry is set, else None."""
        if self.status_of(self.job.entries - 1) == 0:
            return None
        n = self.job.entries
        return bool((self.track[:n] == 1).all()), float(self.track[n:].sum()) / 1e9

    def wait_for(self, index: int) -> int:
        if self._last_seen:
            return int(self.track[index])
        # A waiter spins only for jobs on one thread: it would take a core from the helpers.
        spin = self.engine.spin_ns if self.job.threads == 1 else 0
        value = self.engine.wait_status(self._base + 8 * index, spin)
        if index == self.job.entries - 1:
            self._last_seen = True
        return value


# Engines not closed by their owner are stopped at exit, after their queued jobs.
_OPEN: weakref.WeakSet[CopyEngine] = weakref.WeakSet()


@atexit.register
def _stop_open() -> None:
    for engine in list(_OPEN):
        engine.close()


def _release(engine_lib: ctypes.CDLL, box: list) -> None:
    """An engine dropped without ``close`` (nothing in flight: jobs keep their engine alive):
    stop its thread and free it."""
    handle, box[0] = box[0], None
    if handle:
        engine_lib.tkv_engine_stop(handle)
        engine_lib.tkv_engine_free(handle)


class CopyEngine:
    """One copier thread running :class:`RowJob` s in submission order.

    The engine keeps every submitted job (its arrays, the tensors it points into, its status
    entries) until the job is done, whether or not anyone keeps its events: the C side must
    never read or write memory that was freed."""

    def __init__(self, name: str, spin_us: float = 50.0, nice: int = 0) -> None:
        self.name = name
        self.lib = lib()
        self.spin_ns = int(spin_us * 1000)
        handle = self.lib.tkv_engine_start(self.spin_ns, nice)
        if not handle:
            raise BackendUnavailableError(f"copy engine {name!r}: could not start its thread")
        self._box = [handle]  # shared with the finalizer; None once freed
        self._lock = threading.Lock()
        self._closed = False
        self._stopped = False
        self._waiters = 0
        self._inflight: deque[SubmittedJob] = deque()
        _OPEN.add(self)
        weakref.finalize(self, _release, self.lib, self._box)

    @property
    def _handle(self) -> int | None:
        return self._box[0]

    def submit(self, job: RowJob) -> list[RowEvent]:
        """Queue ``job``; one event per status entry. Raises StateError once closed."""
        submitted = SubmittedJob(self, job)
        with self._lock:
            if self._closed or self.lib.tkv_engine_submit(
                self._handle, ctypes.byref(submitted.struct)
            ):
                raise StateError(f"copy engine {self.name!r} is closed")
            inflight = self._inflight
            while inflight and inflight[0].finished() is not None:
                inflight.popleft()  # done (jobs finish in order): the C side is done with it
            inflight.append(submitted)
        return [RowEvent(submitted, i) for i in range(job.entries)]

    def run(self, job: RowJob) -> None:
        """Copy ``job`` now on the calling thread (GIL released) and up to ``job.threads - 1``
        of the engine's helper threads, after the job being copied. Raises TransferError if
        any entry was refused, StateError once closed."""
        submitted = SubmittedJob(self, job)
        with self._lock:
            if self._closed:
                raise StateError(f"copy engine {self.name!r} is closed")
            self._waiters += 1  # the engine's memory stays until this call is out of it
        try:
            rc = self.lib.tkv_engine_run(self._handle, ctypes.byref(submitted.struct))
        finally:
            with self._lock:
                self._waiters -= 1
                self._free_if_idle()
        if rc != 0:
            RowEvent(submitted, int(np.argmax(submitted.track[: job.entries] != 1))).synchronize()

    def wait_status(self, ptr: int, spin_ns: int = 0) -> int:
        """Block (GIL released) until the status entry at ``ptr`` is set; its value. The
        calling thread copies units of the engine's current job meanwhile, then spins up to
        ``spin_ns``, then sleeps."""
        value = int(self.lib.tkv_status(ptr))
        if value:
            return value
        with self._lock:
            if self._stopped:  # every entry is set once the thread has stopped
                return int(self.lib.tkv_status(ptr))
            self._waiters += 1
        try:
            return int(self.lib.tkv_engine_wait(self._handle, ptr, -1, spin_ns, 1))
        finally:
            with self._lock:
                self._waiters -= 1
                self._free_if_idle()

    def _free_if_idle(self) -> None:
        # Under the lock: the engine's memory goes once it has stopped and nobody waits in it.
        if self._stopped and self._waiters == 0 and self._handle:
            handle, self._box[0] = self._box[0], None
            self.lib.tkv_engine_free(handle)

    def close(self) -> None:
        """Run every queued job, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.lib.tkv_engine_stop(self._handle)
        with self._lock:
            self._stopped = True
            self._inflight.clear()  # every job is done once the thread has stopped
            self._free_if_idle()


__all__ = [
    "CopyEngine",
    "IndexCheck",
    "RowEvent",
    "RowJob",
    "RowShape",
    "SubmittedJob",
    "available",
    "engine_threads",
    "run_rows",
]

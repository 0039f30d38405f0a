"""Copy streams: where device <-> host copies run, and the events that say they are done.

One interface, two implementations, so the cache controller is the same code on both:
- :class:`CudaCopyStream`: a ``torch.cuda.Stream``; a job runs on it after a device-side wait
  for the event it depends on, and its completion is a recorded CUDA event. Waiting for it from
  the compute stream is a GPU-side wait (no host sync).
- :class:`ThreadCopyStream`: a worker thread that runs jobs in submission order; completion is a
  ``threading.Event``. On CPU "the compute stream" is the calling thread, so a device-side wait
  is a host wait.

A job that raises marks its event failed; the error comes back from ``synchronize`` and
``wait``, and later jobs still run (a failed copy of one request must not stall the others).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tiered_kv.errors import StateError


class CopyEvent(ABC):
    """Completion of one copy job (or of the compute work before it)."""

    @abstractmethod
    def query(self) -> bool:
        """True once the work is done (successfully or not); never blocks."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until done; re-raise the job's error if it failed."""

    @abstractmethod
    def wait(self) -> None:
        """Make the *compute* side wait: on CUDA a GPU-side wait on the current stream, on CPU
        a host wait. Re-raises the job's error on CPU."""

    @abstractmethod
    def seconds(self) -> float:
        """How long the job itself ran (0.0 until done, and for compute markers)."""


class ThreadEvent(CopyEvent):
    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._seconds = 0.0
        if done:
            self._done.set()

    def set(self, error: BaseException | None = None, seconds: float = 0.0) -> None:
        self.error = error
        self._seconds = seconds
        self._done.set()

    def seconds(self) -> float:
        return self._seconds if self._done.is_set() else 0.0

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self.synchronize()


class CudaEvent(CopyEvent):
    def __init__(
        self,
        event: torch.cuda.Event,
        error: list[BaseException],
        start: torch.cuda.Event | None = None,
    ) -> None:
        self.event = event
        self.start = start
        self._error = error  # filled by the submitting thread if the job raised

    def seconds(self) -> float:
        if self.start is None or not self.event.query():
            return 0.0
        return self.start.elapsed_time(self.event) / 1e3

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()
        if self._error:
            raise self._error[0]

    def wait(self) -> None:
        if self._error:
            raise self._error[0]
        torch.cuda.current_stream().wait_event(self.event)


class CopyStream(ABC):
    """Runs copy jobs in order, each after an optional event, and returns their events."""

    name: str

    @abstractmethod
    def submit(self, job: Callable[[], object], after: CopyEvent | None = None) -> CopyEvent:
        """Run ``job`` after ``after`` (and after every job submitted before it)."""

    def submit_layers(
        self, job: Callable[[int], object], num_layers: int, after: CopyEvent | None = None
    ) -> list[CopyEvent]:
        """Run ``job(0)`` .. ``job(num_layers - 1)`` in order after ``after``; one event per
        layer, each done when its layer is (a layer that raised fails its event only)."""
        events = [
            self.submit(lambda i=i: job(i), after if i == 0 else None) for i in range(num_layers)
        ]
        return events

    @abstractmethod
    def record_compute(self) -> CopyEvent:
        """An event marking the compute work issued so far (what a device -> host copy of
        freshly written KV must wait for)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Stop accepting jobs; jobs already submitted finish first."""


# Streams not closed by their owner are closed at interpreter exit, before daemon threads are
# frozen: a copy thread frozen inside torch makes the process abort instead of exiting with its
# own status.
_OPEN: weakref.WeakSet[ThreadCopyStream] = weakref.WeakSet()


@atexit.register
def _close_open_streams() -> None:
    for stream in list(_OPEN):
        stream.close()


class ThreadCopyStream(CopyStream):
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"tiered-kv-{name}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, after, event = item
            if isinstance(event, list):
                self._run_layers(job, after, event)
                continue
            error: BaseException | None = None
            start = time.perf_counter()
            try:
                if after is not None:
                    after.synchronize()
                    start = time.perf_counter()
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                error = exc
            event.set(error, time.perf_counter() - start)

    @staticmethod
    def _run_layers(job: Callable[[int], object], after: CopyEvent | None, events: list) -> None:
        # One queue item for every layer: no thread handoff between layers, and each layer's
        # event is set the moment that layer is copied (readers of layer 0 need not wait).
        first: BaseException | None = None
        if after is not None:
            try:
                after.synchronize()
            except BaseException as exc:  # noqa: BLE001 - every layer depends on it
                first = exc
        for i, event in enumerate(events):
            error = first
            start = time.perf_counter()
            if error is None:
                try:
                    job(i)
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    error = exc
            event.set(error, time.perf_counter() - start)

    def submit_layers(
        self, job: Callable[[int], object], num_layers: int, after: CopyEvent | None = None
    ) -> list[CopyEvent]:
        events = [ThreadEvent() for _ in range(num_layers)]
        with self._lock:
            if self._closed:
                raise StateError(f"copy stream {self.name!r} is closed")
            self._jobs.put((job, after, events))
        return list(events)

    def submit(self, job: Callable[[], object], after: CopyEvent | None = None) -> CopyEvent:
        event = ThreadEvent()
        with self._lock:
            if self._closed:
                raise StateError(f"copy stream {self.name!r} is closed")
            self._jobs.put((job, after, event))
        return event

    def record_compute(self) -> CopyEvent:
        # CPU compute runs in the caller's thread: everything issued so far is already done.
        return ThreadEvent(done=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


class CudaCopyStream(CopyStream):
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._closed = False

    def submit(self, job: Callable[[], object], after: CopyEvent | None = None) -> CopyEvent:
        if self._closed:
            raise StateError(f"copy stream {self.name!r} is closed")
        error: list[BaseException] = []
        with torch.cuda.stream(self.stream):
            if isinstance(after, CudaEvent):
                self.stream.wait_event(after.event)
            elif after is not None:
                after.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                error.append(exc)
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
        return CudaEvent(event, error, start)

    def record_compute(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaEvent(event, [])

    def close(self) -> None:
        self._closed = True


def make_copy_stream(name: str, device: torch.device) -> CopyStream:
    """A CUDA stream for a CUDA device, a worker thread otherwise."""
    if device.type == "cuda":
        return CudaCopyStream(name, device)
    return ThreadCopyStream(name)

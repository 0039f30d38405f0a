"""DeviceHostTransfer: device <-> host jobs on two copy streams, never blocking the submitter.

- ``write`` jobs (device -> host, every layer) run on the write stream after an event recorded
  on the compute stream: the KV being copied may have just been written by the model.
- ``load`` jobs (host -> device) run on the load stream one layer at a time; each layer's event
  goes into a fresh producer slot of the :class:`LayerDoneCounter`, which becomes the consumer,
  so the device pool's buffer getters wait for exactly the layer they return.

On CPU, when the host pool can describe a transfer as a copy-engine job (``row_job``: the
native kernel backend, io backend ``kernel``, its copy methods not overridden), the job runs on
the native copy engine's thread instead (``kernels.copy_engine``): the same events, per layer
for loads, at a fraction of a Python thread's handoff cost. Otherwise the copy streams call the
host pool's copy methods.

Results come from ``poll``: every copy finished since the last call, in submission order among
those; the unfinished stay queued (a copy whose job failed to build finishes at once, behind a
copy still running on another thread, and is delivered then). A copy that raised is a failed
result, never an exception in the caller; bytes and seconds per direction go into ``stats``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiered_kv._checks import check_index_tensor
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.kernels.copy_engine import CopyEngine, RowEvent, RowJob, SubmittedJob
from tiered_kv.kernels.row_job import copy_threads_setting
from tiered_kv.names import Direction, IOBackend, JobId, parse
from tiered_kv.transfer.base import HostCopies, TransferJob, TransferResult, TransferWorker
from tiered_kv.transfer.layer_done import LayerDoneCounter
from tiered_kv.transfer.stats import TransferStats
from tiered_kv.transfer.streams import CopyEvent, ThreadEvent, make_copy_stream

_CPU = torch.device("cpu")


@dataclass
class _Copy:
    job: TransferJob
    events: list[CopyEvent]  # one (write) or one per layer (load)
    nbytes: int
    slot: int | None = None  # the layer-done counter slot of a load
    group: SubmittedJob | None = None  # the engine job all the events belong to, if one


class DeviceHostTransfer(TransferWorker):
    directions = (Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE)

    def __init__(
        self,
        device_allocator: BaseTokenToKVPoolAllocator,
        host_pool: HostCopies,
        *,
        io_backend: str | IOBackend = IOBackend.KERNEL,
        layer_slots: int = 3,
        stats: TransferStats | None = None,
        engine_spin_us: float = 200.0,
    ) -> None:
        self.device_pool = device_allocator.get_kvcache()
        if host_pool.decl.device_pool is not self.device_pool:
            raise InvalidArgumentError("host_pool does not mirror the allocator's device pool")
        self.host_pool = host_pool
        self.io_backend = parse(IOBackend, io_backend, "io_backend")
        copy_threads_setting()  # a bad TIERED_KV_COPY_THREADS is refused here, not per job
        self.layer_ids = list(host_pool.decl.layer_ids)
        self.layer_done_counter = LayerDoneCounter(len(self.layer_ids), layer_slots)
        self.device_pool.register_layer_transfer_counter(self.layer_done_counter)
        device = self.device_pool.device
        self.write_stream = make_copy_stream("write", device)
        self.load_stream = make_copy_stream("load", device)
        # The copy engine's threads, started on the first job that can use them.
        self._engine_ok = device.type == "cpu" and hasattr(host_pool, "row_job")
        self._engines: dict[Direction, CopyEngine] = {}
        # How long an idle engine thread, and a waiter, spin before sleeping: a wake-up costs
        # 30-60 us on a 2-core VM, more than the copy of a few pages.
        self._engine_spin_us = float(engine_spin_us)
        self.stats = stats if stats is not None else TransferStats()
        self._token_bytes = host_pool.page_nbytes // host_pool.page_size
        self._writes: deque[_Copy] = deque()
        self._loads: deque[_Copy] = deque()
        self._by_id: dict[JobId, _Copy] = {}
        self._slot_job: dict[int, _Copy] = {}
        self._closed = False

    # -- the contract ---------------------------------------------------------------------------
    def submit(self, job: TransferJob) -> bool:
        if self._closed:
            return False
        if job.direction not in self.directions:
            # Checked first: a storage job has no device_indices to check.
            raise InvalidArgumentError(
                f"direction={job.direction!r} is not moved by this worker; it moves "
                f"{', '.join(map(str, self.directions))}"
            )
        check_index_tensor(f"{job.direction}: host_indices", job.host_indices, _CPU)
        check_index_tensor(
            f"{job.direction}: device_indices", job.device_indices, self.device_pool.device
        )
        if len(job.host_indices) != len(job.device_indices):
            raise InvalidArgumentError(
                f"{job.direction}: {len(job.host_indices)} host slots for "
                f"{len(job.device_indices)} device slots; they pair up one to one"
            )
        if job.job_id in self._by_id:
            raise InvalidArgumentError(f"job_id={job.job_id} is already in flight")
        if job.direction is Direction.DEVICE_TO_HOST:
            copy = self._submit_write(job)
        else:
            copy = self._submit_load(job)
        self._by_id[job.job_id] = copy
        return True

    def _submit_write(self, job: TransferJob) -> _Copy:
        pool, host, io = self.device_pool, self.host_pool, self.io_backend.value
        # Hazard: the model may have written this KV on the compute stream just now; the copy
        # must not read the slots before that work is done (on CPU, where the engine runs, the
        # compute stream is the calling thread: that work is done).
        events = self._engine_events(job, 1)
        if events is None:
            after = self.write_stream.record_compute()

            def run() -> None:
                host.backup_from_device_all_layer(pool, job.host_indices, job.device_indices, io)

            events = [self.write_stream.submit(run, after)]
        copy = _Copy(
            job, events, len(job.host_indices) * self._token_bytes, None, _group_of(events)
        )
        self._writes.append(copy)
        return copy

    def _submit_load(self, job: TransferJob) -> _Copy:
        counter = self.layer_done_counter
        if not counter.next_producer_free():
            # Hazard: the next producer slot still holds the layer events of a load in flight;
            # taking it would make that load's readers wait on this load's copies instead.
            holder = self._slot_job.get(counter.next_producer())
            for e in holder.events if holder is not None else ():
                _done_or_failed(e)
        slot = counter.update_producer()
        pool, host, io = self.device_pool, self.host_pool, self.io_backend.value
        layer_ids = self.layer_ids

        def run(local: int) -> None:
            host.load_to_device_per_layer(
                pool, job.host_indices, job.device_indices, layer_ids[local], io
            )

        # One job for every layer on a persistent copier (one handoff, not one per layer);
        # each layer still gets its own event, recorded before the consumer is pointed here.
        events = self._engine_events(job, len(layer_ids))
        if events is None:
            events = self.load_stream.submit_layers(run, len(layer_ids))
        group = _group_of(events)
        counter.record_all(slot, events, None if group is None else group.is_done)
        copy = _Copy(job, events, len(job.host_indices) * self._token_bytes, slot, group)
        self._loads.append(copy)
        self._slot_job[slot] = copy
        counter.set_consumer(slot)
        return copy

    def _engine_events(self, job: TransferJob, entries: int) -> list[CopyEvent] | None:
        """The job's events on the copy engine, or None where the host pool's copy methods
        must run instead. A job the host pool refuses (a slot out of range, a destroyed pool)
        is failed events, as a copy that raised on a copy thread would be."""
        if not self._engine_ok:
            return None
        to_host = job.direction is Direction.DEVICE_TO_HOST
        try:
            rows: RowJob | None = self.host_pool.row_job(  # type: ignore[attr-defined]
                self.device_pool, job.host_indices, job.device_indices, to_host,
                self.io_backend.value,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported by the job's result
            failed = ThreadEvent()
            failed.set(exc)
            return [failed] * entries
        if rows is None:
            return None
        engine = self._engines.get(job.direction)
        if engine is None:
            engine = CopyEngine(str(job.direction), spin_us=self._engine_spin_us)
            self._engines[job.direction] = engine
        return list(engine.submit(rows))

    def load_slot(self, job_id: JobId) -> int | None:
        """The layer-done counter slot of load ``job_id`` while it is in flight (None after)."""
        copy = self._by_id.get(job_id)
        return copy.slot if copy is not None else None

    def poll(self) -> list[TransferResult]:
        out = []
        for ops in (self._writes, self._loads):
            # Not waiting: every copy whose last event has completed is acknowledged, not only
            # those at the queue's head (the contract: the jobs finished since the last call; a
            # job waited for must be delivered by the next poll).
            kept: list[_Copy] = []
            for copy in ops:
                if copy.events[-1].query():
                    out.append(self._finish(copy))
                else:
                    kept.append(copy)
            ops.clear()
            ops.extend(kept)
        return out

    def _finish(self, copy: _Copy) -> TransferResult:
        summary = copy.group.finished() if copy.group is not None else None
        if summary is not None:
            ok, seconds = summary  # one engine job: its entries read at once
        else:
            ok = all(_done_or_failed(e) for e in copy.events)
            seconds = sum(e.seconds() for e in copy.events)
        direction = copy.job.direction
        self.stats.add(direction, copy.nbytes, seconds, ok)
        # Only while the slot still holds this load's events: a newer load may have taken it.
        # A failed load stays the consumer if it is: its readers must keep hitting its error
        # (acknowledging the failure must not let them read the half-copied slots); the next
        # request begun points the consumer at its own load.
        if copy.slot is not None and self._slot_job.get(copy.slot) is copy:
            del self._slot_job[copy.slot]
        del self._by_id[copy.job.job_id]
        # Host slots come in whole pages; the slow-job warning names the job's page count as it
        # does a storage job's (``pages_done`` stays a storage job's count).
        pages = -(-len(copy.job.host_indices) // self.host_pool.page_size)
        nbytes = copy.nbytes if ok else 0
        return TransferResult(copy.job.job_id, direction, ok, nbytes, seconds, num_pages=pages)

    def wait(self, job_ids: Iterable[JobId] | None = None, timeout_s: float | None = None) -> bool:
        # Device <-> host copies are short and cannot be abandoned half way: wait for each
        # event (the timeout is not applied to a copy already running).
        ids = list(self._by_id) if job_ids is None else list(job_ids)
        for job_id in ids:
            copy = self._by_id.get(job_id)
            if copy is None:
                continue
            # Last layer first: layers finish in order, so the rest are done by then (one
            # wake-up per job, not one per layer); one engine job's are all done then.
            _done_or_failed(copy.events[-1])
            for e in reversed(copy.events[:-1]) if copy.group is None else ():
                _done_or_failed(e)
        return True

    @property
    def in_flight(self) -> int:
        return len(self._by_id)

    def close(self) -> None:
        """Finish what was submitted, stop the streams, unhook the layer counter."""
        if self._closed:
            return
        self._closed = True
        self.write_stream.close()
        self.load_stream.close()
        for engine in self._engines.values():
            engine.close()
        if self.device_pool.layer_transfer_counter is self.layer_done_counter:
            self.device_pool.register_layer_transfer_counter(None)


def _group_of(events: list[CopyEvent]) -> SubmittedJob | None:
    """The engine job every one of ``events`` belongs to, or None."""
    first = events[0] if events else None
    if not isinstance(first, RowEvent):
        return None
    group = first.submitted
    return group if len(events) == group.job.entries else None


def _done_or_failed(event: CopyEvent) -> bool:
    """Block until ``event`` is done; True when its job succeeded."""
    try:
        event.synchronize()
    except Exception:  # noqa: BLE001 - a failed copy is reported by its result, not raised
        return False
    return True

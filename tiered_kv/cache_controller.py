"""CacheController: moves KV pages between the tiers, never blocking the caller on a copy.

- ``write``: device -> host, all layers, on the write stream, after an event recorded on the
  compute stream (the KV being backed up may have just been written by the model).
- ``load`` + ``start_loading``: host -> device one layer at a time on the load stream; each
  layer's event goes into the :class:`LayerDoneCounter`, so the device pool's buffer getters
  wait for exactly the layer they return.
- ``backup_to_storage``: host -> storage in a background thread, in batches of
  ``storage_batch_pages``.
- ``prefetch``: storage -> host in another background thread, in batches, stopping at the first
  page the store does not serve (a missing or corrupt page ends the usable prefix).

Completions are acknowledged through ``poll_*`` calls that never block. Storage trouble (the
store raising, a removed directory) becomes a failed operation and a counted error, never an
exception in the caller. Bytes and seconds per direction are counted in ``transfer_stats``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.copy_streams import CopyEvent, make_copy_stream
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.layer_done import LayerDoneCounter
from tiered_kv.transfer_stats import TransferStats


@dataclass
class StorageOp:
    """A host <-> storage operation. ``pages_done``: pages stored (backup) or loaded
    consecutively from the first (prefetch); the caller reads it once ``done`` is set."""

    op_id: Any
    keys: list[bytes]
    host_indices: torch.Tensor
    pages_done: int = 0
    ok: list[bool] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def cancel(self) -> None:
        """Stop after the batch in progress (prefetch: what is loaded so far stays usable)."""
        self.cancelled = True


@dataclass
class _CopyOp:
    op_ids: list[Any]
    event: CopyEvent
    nbytes: int
    layer_events: list[CopyEvent] = field(default_factory=list)
    slot: int | None = None  # the layer-done counter slot of a load batch


class CacheController:
    def __init__(
        self,
        device_allocator: Any,
        host_pool: Any,
        storage: Any | None = None,
        *,
        io_backend: str = "kernel",
        storage_batch_pages: int = 32,
        layer_slots: int = 3,
    ) -> None:
        self.device_allocator = device_allocator
        self.device_pool = device_allocator.get_kvcache()
        if host_pool.decl.device_pool is not self.device_pool:
            raise InvalidArgumentError("host_pool does not mirror the allocator's device pool")
        self.host_pool = host_pool
        self.storage = storage
        self.io_backend = io_backend
        self.page_size = host_pool.page_size
        self.storage_batch_pages = check_positive_int("storage_batch_pages", storage_batch_pages)
        self.layer_ids = list(host_pool.decl.layer_ids)
        self.layer_done_counter = LayerDoneCounter(len(self.layer_ids), layer_slots)
        self.device_pool.register_layer_transfer_counter(self.layer_done_counter)
        device = self.device_pool.device
        self.write_stream = make_copy_stream("write", device)
        self.load_stream = make_copy_stream("load", device)
        self.transfer_stats = TransferStats()
        self.storage_errors = 0
        self._token_bytes = host_pool.page_nbytes // self.page_size
        self._writes: deque[_CopyOp] = deque()
        self._loads: deque[_CopyOp] = deque()
        self._queued_loads: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self._backups_done: queue.SimpleQueue[StorageOp] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._backup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._prefetch_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        if storage is not None:
            for name, q, fn, done_q in (
                ("backup", self._backup_q, self._run_backup, self._backups_done),
                ("prefetch", self._prefetch_q, self._run_prefetch, None),
            ):
                t = threading.Thread(
                    target=self._worker,
                    args=(q, fn, done_q),
                    name=f"tiered-kv-{name}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)

    # -- device <-> host ----------------------------------------------------------------------
    def write(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor, op_id: Any
    ) -> CopyEvent:
        """Back up ``device_indices`` into ``host_indices`` (all layers) once the compute
        issued so far is done. Returns the copy's event; ``poll_writes`` acknowledges it."""
        self._check_open()
        pool, host = self.device_pool, self.host_pool
        after = self.write_stream.record_compute()

        def job() -> None:
            host.backup_from_device_all_layer(pool, host_indices, device_indices, self.io_backend)

        event = self.write_stream.submit(job, after)
        self._writes.append(_CopyOp([op_id], event, len(host_indices) * self._token_bytes))
        return event

    def poll_writes(self) -> list[tuple[Any, bool]]:
        """(op_id, ok) of every write finished since the last call, in submission order."""
        return self._poll(self._writes, "device_to_host")

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, op_id: Any) -> None:
        """Queue a host -> device load; ``start_loading`` issues every queued load at once."""
        self._check_open()
        check_index_tensor("load: host_indices", host_indices, torch.device("cpu"))
        check_index_tensor("load: device_indices", device_indices, self.device_pool.device)
        if len(host_indices) != len(device_indices):
            raise InvalidArgumentError(
                f"load: {len(host_indices)} host slots for {len(device_indices)} device slots"
            )
        self._queued_loads.append((host_indices, device_indices, op_id))

    def start_loading(self) -> int | None:
        """Issue the queued loads layer by layer into a fresh producer slot of the layer
        counter, and make that slot the consumer. Returns the slot (None if nothing queued)."""
        self._check_open()
        if not self._queued_loads:
            return None
        # Take the slot first: if it is still busy (StateError) the queued loads stay queued.
        slot = self.layer_done_counter.update_producer()
        queued, self._queued_loads = self._queued_loads, []
        host_idx = torch.cat([h for h, _, _ in queued])
        dev_idx = torch.cat([d for _, d, _ in queued])
        pool, host = self.device_pool, self.host_pool
        events = []
        for local, layer_id in enumerate(self.layer_ids):

            def job(layer_id: int = layer_id) -> None:
                host.load_to_device_per_layer(pool, host_idx, dev_idx, layer_id, self.io_backend)

            event = self.load_stream.submit(job)
            self.layer_done_counter.record(slot, local, event)
            events.append(event)
        self._loads.append(
            _CopyOp(
                [op for _, _, op in queued],
                events[-1],
                len(host_idx) * self._token_bytes,
                events,
                slot,
            )
        )
        self.layer_done_counter.set_consumer(slot)
        return slot

    def poll_loads(self) -> list[tuple[Any, bool]]:
        """(op_id, ok) of every load finished since the last call."""
        return self._poll(self._loads, "host_to_device")

    def _poll(self, ops: deque[_CopyOp], direction: str) -> list[tuple[Any, bool]]:
        out = []
        while ops and ops[0].event.query():
            op = ops.popleft()
            events = op.layer_events or [op.event]
            ok = all(not _failed(e) for e in events)
            seconds = sum(e.seconds() for e in events)
            self.transfer_stats.add(direction, op.nbytes, seconds, ok)
            counter = self.layer_done_counter
            if not ok and op.slot is not None and counter.consumer == op.slot:
                # Readers must not keep hitting the failed batch's error; the cache drops the
                # device copies that batch was filling.
                counter.set_consumer(None)
            out.extend((op_id, ok) for op_id in op.op_ids)
        return out

    def wait_all(self) -> None:
        """Block until every issued device <-> host copy is done (they are still polled)."""
        for ops in (self._writes, self._loads):
            for op in list(ops):
                try:
                    op.event.synchronize()
                except Exception:  # noqa: BLE001 - reported by poll
                    pass

    # -- host <-> storage ---------------------------------------------------------------------
    def _pages_of(self, host_indices: torch.Tensor) -> list[int]:
        return (host_indices[:: self.page_size] // self.page_size).tolist()

    def _storage_op(
        self, keys: Sequence[bytes], host_indices: torch.Tensor, op_id: Any
    ) -> StorageOp:
        self._check_open()
        if self.storage is None:
            raise StateError("this controller has no storage tier")
        keys = list(keys)
        check_index_tensor("host_indices", host_indices, torch.device("cpu"))
        if len(host_indices) != len(keys) * self.page_size:
            raise InvalidArgumentError(
                f"{len(keys)} page keys need {len(keys) * self.page_size} host slots, got "
                f"{len(host_indices)}"
            )
        p = self.page_size
        rows = host_indices.to(torch.int64).reshape(-1, p)
        whole = rows - rows[:, :1] == torch.arange(p)
        if not bool(whole.all()) or bool((rows[:, 0] % p).any()):
            bad = rows[~(whole.all(dim=1) & (rows[:, 0] % p == 0))][:2].tolist()
            raise InvalidArgumentError(
                f"host_indices must be whole host pages (page * {p} + 0..{p - 1}, in order); "
                f"got slot runs {bad}"
            )
        return StorageOp(op_id, keys, host_indices)

    def backup_to_storage(
        self, keys: Sequence[bytes], host_indices: torch.Tensor, op_id: Any
    ) -> StorageOp:
        """Store the host pages ``host_indices`` under ``keys`` in the background."""
        op = self._storage_op(keys, host_indices, op_id)
        self._backup_q.put(op)
        return op

    def poll_backups(self) -> list[StorageOp]:
        """Backups finished since the last call (``op.ok`` per page, ``op.error``)."""
        out = []
        while True:
            try:
                out.append(self._backups_done.get_nowait())
            except queue.Empty:
                return out

    def prefetch(self, keys: Sequence[bytes], host_indices: torch.Tensor, op_id: Any) -> StorageOp:
        """Fill host pages ``host_indices`` from storage in the background, page by page in
        order, stopping at the first page the store cannot serve; ``op.pages_done`` says how
        many leading pages are valid once ``op.done`` is set."""
        op = self._storage_op(keys, host_indices, op_id)
        self._prefetch_q.put(op)
        return op

    def _worker(self, q: queue.SimpleQueue, fn, done_q: queue.SimpleQueue | None) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            try:
                fn(op)
            except Exception as exc:  # noqa: BLE001 - storage trouble is a counted failure
                op.error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.storage_errors += 1
            finally:
                # Only now is the op final (error, pages_done): then signal and report it.
                op.done.set()
                if done_q is not None:
                    done_q.put(op)

    def _run_backup(self, op: StorageOp) -> None:
        pages = self._pages_of(op.host_indices)
        step = self.storage_batch_pages
        for i in range(0, len(pages), step):
            if op.cancelled:
                return
            start = time.perf_counter()
            ok = self.storage.batch_set(op.keys[i : i + step], self.host_pool, pages[i : i + step])
            written = sum(ok)
            self.transfer_stats.add(
                "host_to_storage",
                written * self.host_pool.page_nbytes,
                time.perf_counter() - start,
                written == len(ok),
            )
            op.ok.extend(ok)
            op.pages_done += written

    def _run_prefetch(self, op: StorageOp) -> None:
        pages = self._pages_of(op.host_indices)
        step = self.storage_batch_pages
        for i in range(0, len(pages), step):
            if op.cancelled:
                return
            start = time.perf_counter()
            keys = op.keys[i : i + step]
            # Read only the leading pages the store holds: the host pages after the first
            # missing one are left untouched (and no I/O is spent on pages that are dropped).
            present = self.storage.batch_exists(keys)
            ok = []
            if present:
                ok = self.storage.batch_get(keys[:present], self.host_pool, pages[i : i + present])
            lead = next((j for j, hit in enumerate(ok) if not hit), len(ok))
            self.transfer_stats.add(
                "storage_to_host", lead * self.host_pool.page_nbytes, time.perf_counter() - start
            )
            op.pages_done += lead
            if lead < len(keys):
                return

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StateError("cache controller is closed")

    def close(self) -> None:
        """Finish what was issued, stop the background threads and streams."""
        if self._closed:
            return
        self._closed = True
        for q in (self._backup_q, self._prefetch_q):
            q.put(None)
        for t in self._threads:
            t.join()
        self.write_stream.close()
        self.load_stream.close()
        if self.device_pool.layer_transfer_counter is self.layer_done_counter:
            self.device_pool.register_layer_transfer_counter(None)


def _failed(event: CopyEvent) -> bool:
    try:
        event.synchronize()
    except Exception:  # noqa: BLE001 - a failed copy is reported, not raised
        return True
    return False

"""LayerDoneCounter: per-layer completion of host -> device loads, so attention on layer i can
run while layer i+1 is still copying.

A load batch takes a *producer slot* (``update_producer``) and records one event per layer in
it; the forward pass that consumes that batch names the slot (``set_consumer``), and the device
pool's ``get_key_buffer(layer)`` / ``get_value_buffer(layer)`` call ``wait_until(layer)``, which
waits for that layer's event only (on CUDA a GPU-side wait, on CPU a host wait); a layer whose
copy failed raises TransferError there, whichever copier ran it. Several slots rotate so that
the next batch can be loaded while the current one runs (overlap scheduling); taking a slot
whose copies have not all finished is an error, not a silent overwrite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tiered_kv._checks import check_positive_int
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.transfer.streams import CopyEvent


class LayerDoneCounter:
    def __init__(self, num_layers: int, num_slots: int = 3) -> None:
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.num_slots = check_positive_int("num_slots", num_slots)
        self._events: list[list[CopyEvent | None]] = [[None] * num_layers for _ in range(num_slots)]
        # per slot, when its events came as one group: a call saying whether all are done
        self._all_done: list[Callable[[], bool] | None] = [None] * num_slots
        self._producer = -1
        self._consumer: int | None = None
        self._lock = threading.Lock()

    @property
    def producer(self) -> int:
        return self._producer

    @property
    def consumer(self) -> int | None:
        return self._consumer

    def slot_done(self, slot: int) -> bool:
        """Whether every layer event recorded in ``slot`` has completed (never blocks)."""
        self._check_slot(slot)
        all_done = self._all_done[slot]
        if all_done is not None:
            return all_done()
        return all(e is None or e.query() for e in self._events[slot])

    def next_producer(self) -> int:
        """The slot the next ``update_producer`` takes."""
        return (self._producer + 1) % self.num_slots

    def next_producer_free(self) -> bool:
        """Whether the next slot's copies have all completed, so ``update_producer`` will not
        refuse it (never blocks)."""
        return self.slot_done(self.next_producer())

    def consumer_is(self, slot: int | None) -> bool:
        return self._consumer == slot

    def update_producer(self) -> int:
        """Take the next slot for a new load batch and clear its events. Raises StateError if
        that slot still has a copy in flight."""
        with self._lock:
            slot = (self._producer + 1) % self.num_slots
            if not self.slot_done(slot):
                pending = [i for i, e in enumerate(self._events[slot]) if e and not e.query()]
                raise StateError(
                    f"producer slot {slot} is still loading layers {pending}; with "
                    f"{self.num_slots} slots, wait for a batch's load before starting the "
                    f"{self.num_slots}th batch after it"
                )
            self._events[slot] = [None] * self.num_layers
            self._all_done[slot] = None
            self._producer = slot
            return slot

    def record(self, slot: int, layer: int, event: CopyEvent) -> None:
        """The event after which ``layer`` (local index) of batch ``slot`` is on the device."""
        self._check_slot(slot)
        self._check_layer(layer)
        self._events[slot][layer] = event
        self._all_done[slot] = None

    def record_all(
        self,
        slot: int,
        events: list[CopyEvent],
        all_done: Callable[[], bool] | None = None,
    ) -> None:
        """One event per local layer, in layer order (``record`` for each, in one step);
        ``all_done`` (optional) answers "are they all done" at once, for events of one job."""
        self._check_slot(slot)
        if len(events) != self.num_layers:
            raise InvalidArgumentError(
                f"{len(events)} events for {self.num_layers} layers; record one per layer"
            )
        self._events[slot] = list(events)
        self._all_done[slot] = all_done

    def set_consumer(self, slot: int | None) -> None:
        """The slot whose loads the next forward pass reads (None: read without waiting)."""
        if slot is not None:
            self._check_slot(slot)
        self._consumer = slot

    def wait_until(self, layer: int) -> None:
        """Wait until ``layer`` (local index) of the consumer's batch is loaded. Raises
        TransferError, with the copy's own error as its ``__cause__``, when that layer's copy
        failed, whichever copier ran it (copy thread, CUDA stream, native copy engine): the
        slots hold no (or partly copied) KV, and every reader of the layer gets the error."""
        self._check_layer(layer)
        slot = self._consumer
        if slot is None:
            return
        event = self._events[slot][layer]
        if event is None:
            return
        try:
            event.wait()
        except Exception as exc:
            raise TransferError(
                f"the host -> device load of local layer {layer} (layer-done slot {slot}) "
                f"failed: {exc}; abort the requests of this forward (their prefix slots do not "
                "hold their KV) and begin them again"
            ) from exc

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise InvalidArgumentError(f"slot={slot!r} must be in [0, {self.num_slots})")

    def _check_layer(self, layer: int) -> None:
        n = self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidArgumentError(f"layer={layer!r} must be a local layer index in [0, {n})")

"""LayerDoneCounter: producer slots, per-layer waits, argument checks."""

from __future__ import annotations

import threading
import time

import pytest

from tests.transfer._util import make_pool
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.transfer.layer_done import LayerDoneCounter
from tiered_kv.transfer.streams import ThreadEvent

TIMEOUT = 10.0


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_update_producer_rotates_through_the_slots():
    c = LayerDoneCounter(4)
    assert c.producer == -1 and c.consumer is None
    assert [c.update_producer() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.producer == 0
    two = LayerDoneCounter(3, num_slots=2)
    assert [two.update_producer() for _ in range(5)] == [0, 1, 0, 1, 0]
    one = LayerDoneCounter(1, num_slots=1)
    assert [one.update_producer() for _ in range(3)] == [0, 0, 0]


def test_taking_a_busy_slot_raises_and_changes_nothing():
    c = LayerDoneCounter(5, num_slots=3)
    slot = c.update_producer()
    done, pending, failed = ThreadEvent(done=True), ThreadEvent(), ThreadEvent()
    c.record(slot, 0, done)
    c.record(slot, 3, pending)
    c.record(slot, 4, failed)
    c.set_consumer(slot)
    assert not c.slot_done(slot)
    assert c.update_producer() == 1 and c.update_producer() == 2
    failed.set(RuntimeError("layer 4 copy failed"))
    with pytest.raises(StateError, match=r"slot 0 .*layers \[3\]"):
        c.update_producer()
    # Nothing changed: same producer, slot 0 still holds its events.
    assert c.producer == 2 and c.consumer == slot
    assert not c.slot_done(0)
    c.wait_until(0)
    with pytest.raises(TransferError, match="layer 4"):
        c.wait_until(4)
    with pytest.raises(StateError):
        c.update_producer()  # still busy
    pending.set()
    assert c.slot_done(0)
    assert c.update_producer() == 0
    # Taking the slot cleared its events: the failed layer-4 event is gone.
    c.wait_until(4)
    assert c.slot_done(0)


class CopyLost(OSError):
    """A copy's own error, of a type the counter has never heard of."""


@pytest.mark.parametrize(
    "error", [CopyLost(5, "layer 2 copy lost"), TransferError("native copier refused layer 2")]
)
def test_a_failed_layer_waits_as_a_transfer_error_whatever_the_copy_raised(error):
    """Issue 38: one typed error for a failed load's readers, the copy's own as its cause."""
    c = LayerDoneCounter(3, num_slots=2)
    slot = c.update_producer()
    events = [ThreadEvent(done=True), ThreadEvent(done=True), ThreadEvent()]
    events[2].set(error)
    c.record_all(slot, events)
    c.set_consumer(slot)
    c.wait_until(0)
    for _ in range(2):  # every reader of the layer, not only the first
        with pytest.raises(TransferError, match=rf"layer 2 .*slot {slot}.*abort") as info:
            c.wait_until(2)
        assert info.value.__cause__ is error
        assert str(error) in str(info.value)
    c.wait_until(1)


def test_wait_until_waits_for_its_layer_only():
    c = LayerDoneCounter(3)
    slot = c.update_producer()
    events = [ThreadEvent() for _ in range(3)]
    for i, e in enumerate(events):
        c.record(slot, i, e)
    c.set_consumer(slot)
    events[1].set()
    finished: list[int] = []
    t1 = _in_thread(lambda: (c.wait_until(1), finished.append(1)))
    t1.join(TIMEOUT)
    assert finished == [1]  # layer 1 done; layers 0 and 2 pending do not matter
    t0 = _in_thread(lambda: (c.wait_until(0), finished.append(0)))
    time.sleep(0.1)
    assert finished == [1] and t0.is_alive()  # layer 0 is still loading
    events[0].set()
    t0.join(TIMEOUT)
    assert finished == [1, 0]
    events[2].set()


def test_wait_until_without_consumer_never_waits():
    c = LayerDoneCounter(2)
    slot = c.update_producer()
    never = ThreadEvent()
    c.record(slot, 0, never)
    c.record(slot, 1, never)
    done: list[bool] = []
    t = _in_thread(lambda: (c.wait_until(0), c.wait_until(1), done.append(True)))
    t.join(TIMEOUT)
    assert done == [True]  # no consumer named yet
    c.set_consumer(slot)
    c.set_consumer(None)
    t = _in_thread(lambda: (c.wait_until(1), done.append(True)))
    t.join(TIMEOUT)
    assert done == [True, True]
    assert c.consumer is None


def test_a_slot_without_recorded_events_does_not_wait():
    c = LayerDoneCounter(3)
    slot = c.update_producer()
    c.set_consumer(slot)
    for layer in range(3):
        c.wait_until(layer)
    assert c.slot_done(slot)


@pytest.mark.parametrize("slot", [3, -1, 17, True, 1.0, "0", None])
def test_record_rejects_a_bad_slot(slot):
    c = LayerDoneCounter(4)
    with pytest.raises(InvalidArgumentError, match=f"slot={slot!r}"):
        c.record(slot, 0, ThreadEvent())
    if slot is not None:
        with pytest.raises(InvalidArgumentError, match=f"slot={slot!r}"):
            c.set_consumer(slot)
        with pytest.raises(InvalidArgumentError, match=f"slot={slot!r}"):
            c.slot_done(slot)
    assert c.consumer is None


@pytest.mark.parametrize("layer", [4, -1, 9, False, 2.0, "1"])
def test_record_and_wait_until_reject_a_bad_layer(layer):
    c = LayerDoneCounter(4)
    slot = c.update_producer()
    with pytest.raises(InvalidArgumentError, match=f"layer={layer!r}"):
        c.record(slot, layer, ThreadEvent())
    assert c.slot_done(slot)
    c.set_consumer(slot)
    with pytest.raises(InvalidArgumentError, match=f"layer={layer!r}"):
        c.wait_until(layer)
    c.set_consumer(None)
    with pytest.raises(InvalidArgumentError, match=f"layer={layer!r}"):
        c.wait_until(layer)


@pytest.mark.parametrize(("layers", "slots"), [(0, 3), (-2, 3), (4, 0), (True, 3)])
def test_constructor_checks(layers, slots):
    with pytest.raises(InvalidArgumentError):
        LayerDoneCounter(layers, slots)


def test_device_pool_getters_wait_on_the_registered_counter():
    pool, _ = make_pool(3, layer_num=4)
    with pytest.raises(InvalidArgumentError, match="counts 3 layers"):
        pool.register_layer_transfer_counter(LayerDoneCounter(3))
    c = LayerDoneCounter(4)
    pool.register_layer_transfer_counter(c)
    slot = c.update_producer()
    events = [ThreadEvent() for _ in range(4)]
    for i, e in enumerate(events):
        c.record(slot, i, e)
    c.set_consumer(slot)
    got: list[int] = []
    t = _in_thread(lambda: (pool.get_value_buffer(2), got.append(2)))
    time.sleep(0.1)
    assert got == [] and t.is_alive()
    events[2].set()
    t.join(TIMEOUT)
    assert got == [2]
    pool.register_layer_transfer_counter(None)
    pool.get_key_buffer(0)  # unregistered: no wait on the pending layer-0 event
    for e in events:
        e.set()


def test_next_producer_and_next_producer_free_track_the_slot_update_producer_takes():
    c = LayerDoneCounter(2, num_slots=3)
    assert c.next_producer() == 0 and c.next_producer_free()
    pending = [ThreadEvent(), ThreadEvent()]
    for expect in range(3):
        assert c.next_producer() == expect
        slot = c.update_producer()
        assert slot == expect and c.producer == slot
        c.record(slot, 1, pending[0] if slot == 0 else ThreadEvent(done=True))
    # Slot 0 is next again and still loading layer 1: not free, and update_producer refuses.
    assert c.next_producer() == 0 and not c.next_producer_free()
    with pytest.raises(StateError):
        c.update_producer()
    assert c.next_producer() == 0 and c.producer == 2  # the refusal changed nothing
    pending[0].set(RuntimeError("failed copies are done too"))
    assert c.next_producer_free()
    assert c.update_producer() == 0 and c.next_producer() == 1
    # The answer never blocks, and never depends on the consumer.
    c.record(0, 0, pending[1])
    c.set_consumer(0)
    assert c.next_producer() == 1 and c.next_producer_free()  # slot 1 is done
    c.update_producer()
    c.update_producer()
    assert c.next_producer() == 0 and not c.next_producer_free()
    pending[1].set()
    assert c.next_producer_free()


def test_next_producer_of_a_single_slot_is_always_that_slot():
    c = LayerDoneCounter(3, num_slots=1)
    ev = ThreadEvent()
    for _ in range(3):
        assert c.next_producer() == 0
        assert c.update_producer() == 0
    c.record(0, 2, ev)
    assert c.next_producer() == 0 and not c.next_producer_free()
    ev.set()
    assert c.next_producer_free()


def test_consumer_is_names_exactly_the_consumer():
    c = LayerDoneCounter(2, num_slots=3)
    assert c.consumer_is(None)
    assert not any(c.consumer_is(s) for s in range(3))
    for slot in (2, 0, 1):
        c.set_consumer(slot)
        assert c.consumer_is(slot) and not c.consumer_is(None)
        assert [c.consumer_is(s) for s in range(3)] == [s == slot for s in range(3)]
    assert not c.consumer_is(7)  # out of range: simply not the consumer
    c.set_consumer(None)
    assert c.consumer_is(None) and not c.consumer_is(1)
    # A refused set_consumer changes nothing.
    c.set_consumer(1)
    with pytest.raises(InvalidArgumentError):
        c.set_consumer(3)
    assert c.consumer_is(1)

"""HostSlots, the host tier's bookkeeping: pages found by digest, least recently used replaced
first, pinned slots never handed out, a half-filled slot never found, every naming and
unnaming reported in order; and a state machine against a plain model."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.integrations.vllm.host_slots import HostSlots


def dig(i: int) -> bytes:
    return hashlib.sha256(f"page-{i}".encode()).digest()


def _fill(slots: HostSlots, i: int) -> int:
    """Take a slot, name it page ``i`` and unpin it: a cached slot nobody pins."""
    s = slots.take()
    assert s is not None
    slots.publish(s, dig(i))
    slots.unpin(s)
    return s


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_a_bad_slot_count_is_refused(n):
    with pytest.raises(InvalidArgumentError):
        HostSlots(n)


def test_lookup_counts_leading_cached_pages_and_does_not_touch_recency():
    slots = HostSlots(3)
    for i in range(3):
        _fill(slots, i)
    assert slots.lookup([dig(0), dig(1), dig(2)]) == 3
    assert slots.lookup([dig(0), dig(9), dig(2)]) == 1
    assert slots.lookup([dig(9), dig(0)]) == 0
    assert slots.lookup([]) == 0
    for _ in range(5):
        slots.lookup([dig(0)])  # a read: page 0 stays least recently used
    s = slots.take()
    assert slots.lookup([dig(0)]) == 0 and slots.lookup([dig(1), dig(2)]) == 2
    assert slots.take_changes()[-1] == (False, dig(0))
    slots.unpin(s)


def test_eviction_is_least_recently_used_and_pin_cached_refreshes():
    slots = HostSlots(4)
    where = {i: _fill(slots, i) for i in range(4)}
    s = slots.pin_cached(dig(0))  # 0 becomes the most recent
    assert s == where[0]
    slots.unpin(s)
    assert slots.pin_cached(dig(99)) is None
    evicted = []
    for _ in range(4):
        before = {i for i in range(4) if slots.lookup([dig(i)])}
        t = slots.take()
        after = {i for i in range(4) if slots.lookup([dig(i)])}
        (gone,) = before - after
        assert t == where[gone]
        evicted.append(gone)
    assert evicted == [1, 2, 3, 0]
    assert slots.take() is None  # every slot is pinned (taken)
    assert slots.counts() == dict(slots=4, cached=0, pinned=4, free=0, evictions=4)


def test_pinned_slots_are_never_handed_out():
    slots = HostSlots(3)
    for i in range(3):
        _fill(slots, i)
    held = [slots.pin_cached(dig(i)) for i in (0, 2)]
    t = slots.take()
    assert t not in held and slots.lookup([dig(1)]) == 0
    assert slots.take() is None  # 0 and 2 pinned by readers, t by its writer
    assert slots.lookup([dig(0)]) == 1 and slots.lookup([dig(2)]) == 1
    slots.unpin(held[1])
    assert slots.take() == held[1]
    for s in (held[0], held[1], t):
        slots.unpin(s)


def test_a_half_filled_slot_is_never_found():
    slots = HostSlots(2)
    s = slots.take()
    assert slots.lookup([dig(0)]) == 0 and slots.pin_cached(dig(0)) is None
    assert slots.take_changes() == []
    slots.publish(s, dig(0))
    assert slots.lookup([dig(0)]) == 1
    assert slots.take_changes() == [(True, dig(0))]
    # a slot taken and freed without publishing never shows
    t = slots.take()
    slots.unpin(t)
    assert slots.lookup([dig(1)]) == 0 and slots.take_changes() == []
    slots.unpin(s)


def test_a_page_published_twice_keeps_the_first_slot():
    slots = HostSlots(3)
    a, b = slots.take(), slots.take()
    slots.publish(a, dig(5))
    slots.publish(b, dig(5))  # another writer of the same page: b stays unnamed
    slots.publish(a, dig(6))  # a slot is named once
    assert slots.take_changes() == [(True, dig(5))]
    slots.unpin(b)
    assert slots.counts()["free"] == 2  # b freed at its last unpin
    assert slots.pin_cached(dig(5)) == a
    assert slots.pin_cached(dig(6)) is None
    slots.unpin(a)
    slots.unpin(a)


def test_forget_unnames_and_frees_at_the_last_unpin():
    slots = HostSlots(2)
    a = _fill(slots, 0)
    b = _fill(slots, 1)
    assert slots.pin_cached(dig(0)) == a
    slots.forget(a)  # pinned: unnamed now, freed at the unpin
    assert slots.lookup([dig(0)]) == 0
    assert slots.counts()["free"] == 0
    slots.unpin(a)
    assert slots.counts()["free"] == 1
    slots.forget(b)  # unpinned: freed now
    assert slots.counts() == dict(slots=2, cached=0, pinned=0, free=2, evictions=0)
    slots.forget(b)  # twice: nothing
    assert slots.take_changes() == [
        (True, dig(0)),
        (True, dig(1)),
        (False, dig(0)),
        (False, dig(1)),
    ]
    assert slots.take_changes() == []


def test_unpin_or_publish_of_an_unpinned_slot_is_a_state_error():
    slots = HostSlots(2)
    with pytest.raises(StateError):
        slots.unpin(0)
    with pytest.raises(StateError):
        slots.publish(1, dig(0))
    with pytest.raises(StateError):
        slots.unpin(2)
    s = slots.take()
    slots.unpin(s)
    with pytest.raises(StateError):
        slots.unpin(s)
    assert slots.counts()["free"] == 2


class SlotsMachine(RuleBasedStateMachine):
    """HostSlots against a model: free set, LRU-ordered cached pages, pin counts, changes."""

    @initialize(n=st.integers(1, 6))
    def setup(self, n):
        self.slots = HostSlots(n)
        self.n = n
        self.free = set(range(n))
        self.cached: OrderedDict[bytes, int] = OrderedDict()
        self.pins = [0] * n
        self.changes: list[tuple[bool, bytes]] = []
        self.evictions = 0

    def _named(self, slot: int) -> bytes | None:
        return next((d for d, s in self.cached.items() if s == slot), None)

    def _pinned(self) -> list[int]:
        return [s for s in range(self.n) if self.pins[s]]

    @rule()
    def take(self):
        got = self.slots.take()
        if self.free:
            assert got in self.free
            self.free.discard(got)
        else:
            victim = next((d for d, s in self.cached.items() if not self.pins[s]), None)
            if victim is None:
                assert got is None
                return
            assert got == self.cached.pop(victim)
            self.changes.append((False, victim))
            self.evictions += 1
        self.pins[got] = 1

    @rule(i=st.integers(0, 9))
    def pin_cached(self, i):
        got = self.slots.pin_cached(dig(i))
        want = self.cached.get(dig(i))
        assert got == want
        if want is not None:
            self.cached.move_to_end(dig(i))
            self.pins[want] += 1

    @precondition(lambda self: any(self.pins))
    @rule(data=st.data(), i=st.integers(0, 9))
    def publish(self, data, i):
        slot = data.draw(st.sampled_from(self._pinned()))
        self.slots.publish(slot, dig(i))
        if dig(i) not in self.cached and self._named(slot) is None:
            self.cached[dig(i)] = slot
            self.changes.append((True, dig(i)))

    @precondition(lambda self: any(self.pins))
    @rule(data=st.data())
    def unpin(self, data):
        slot = data.draw(st.sampled_from(self._pinned()))
        self.slots.unpin(slot)
        self.pins[slot] -= 1
        if not self.pins[slot] and self._named(slot) is None:
            self.free.add(slot)

    @rule(data=st.data())
    def forget(self, data):
        slot = data.draw(st.integers(0, self.n - 1))
        self.slots.forget(slot)
        d = self._named(slot)
        if d is not None:
            del self.cached[d]
            self.changes.append((False, d))
            if not self.pins[slot]:
                self.free.add(slot)

    @rule(ids=st.lists(st.integers(0, 9), max_size=5))
    def lookup(self, ids):
        want = 0
        for i in ids:
            if dig(i) not in self.cached:
                break
            want += 1
        assert self.slots.lookup([dig(i) for i in ids]) == want

    @rule()
    def take_changes(self):
        assert self.slots.take_changes() == self.changes
        self.changes = []

    @invariant()
    def counts_agree(self):
        if not hasattr(self, "slots"):
            return
        assert self.slots.counts() == dict(
            slots=self.n,
            cached=len(self.cached),
            pinned=sum(1 for p in self.pins if p),
            free=len(self.free),
            evictions=self.evictions,
        )
        # a slot is free, or cached, or pinned (a cached slot may be pinned); never free and more
        assert not self.free & set(self.cached.values())
        assert not self.free & set(self._pinned())


SlotsMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHostSlotsModel = SlotsMachine.TestCase

"""The GIL switch interval hold: it only ever shortens the interval, nested holds keep the
shortest, the last close gives back what was found, a value someone else set meanwhile stands,
bad values change nothing, and holds opened and closed from many threads balance out."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from tiered_kv import gil_switch
from tiered_kv.errors import InvalidArgumentError


@pytest.fixture(autouse=True)
def _interval(monkeypatch):
    """Each test on a module state of its own (tiers another test left open hold too)."""
    before = sys.getswitchinterval()
    monkeypatch.setattr(gil_switch, "_open", {})
    monkeypatch.setattr(gil_switch, "_state", {"next": 0, "found": None, "ours": None})
    yield
    assert gil_switch.open_holds() == 0
    sys.setswitchinterval(before)


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-6  # the interpreter keeps microseconds


def test_a_hold_shortens_and_its_close_gives_back():
    sys.setswitchinterval(0.004)
    with gil_switch.shorten(0.0003) as hold:
        assert _close(sys.getswitchinterval(), 0.0003)
        assert gil_switch.open_holds() == 1
    assert _close(sys.getswitchinterval(), 0.004)
    hold.close()  # a second close is nothing
    assert _close(sys.getswitchinterval(), 0.004)


def test_a_hold_never_lengthens():
    sys.setswitchinterval(0.0001)
    with gil_switch.shorten(0.002):
        assert _close(sys.getswitchinterval(), 0.0001)
    assert _close(sys.getswitchinterval(), 0.0001)


def test_nested_holds_keep_the_shortest_until_the_last_closes():
    sys.setswitchinterval(0.005)
    a = gil_switch.shorten(0.001)
    b = gil_switch.shorten(0.0002)
    c = gil_switch.shorten(0.0007)
    assert _close(sys.getswitchinterval(), 0.0002)
    b.close()
    assert _close(sys.getswitchinterval(), 0.0007)
    c.close()
    assert _close(sys.getswitchinterval(), 0.001)
    a.close()
    assert _close(sys.getswitchinterval(), 0.005)


def test_a_value_set_by_someone_else_during_a_hold_stands():
    sys.setswitchinterval(0.005)
    a = gil_switch.shorten(0.0005)
    b = gil_switch.shorten(0.0004)
    sys.setswitchinterval(0.003)  # the application chose its own while we held ours
    b.close()  # the remaining hold still shortens what they chose
    assert _close(sys.getswitchinterval(), 0.0005)
    a.close()  # and the last close gives back theirs, not the 5 ms found first
    assert _close(sys.getswitchinterval(), 0.003)


@pytest.mark.parametrize("value", [0, -0.001, float("inf"), float("nan"), True, "0.001", None])
def test_a_bad_interval_is_refused_and_changes_nothing(value):
    sys.setswitchinterval(0.0042)
    with pytest.raises(InvalidArgumentError, match="switch interval"):
        gil_switch.shorten(value)
    assert gil_switch.open_holds() == 0
    assert _close(sys.getswitchinterval(), 0.0042)


def test_holds_from_many_threads_balance_out():
    sys.setswitchinterval(0.0035)
    rng = random.Random(11)
    plans = [[rng.uniform(0.00005, 0.004) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    lows: list[float] = []
    failures: list[BaseException] = []

    def worker(values: list[float]) -> None:
        try:
            holds = []
            for v in values:
                holds.append(gil_switch.shorten(v))
                lows.append(sys.getswitchinterval())
                if len(holds) > 2 and rng.random() < 0.5:
                    holds.pop(rng.randrange(len(holds))).close()
            time.sleep(0.001)
            for h in holds:
                h.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures and not any(t.is_alive() for t in threads)
    assert all(x <= 0.0035 + 1e-6 for x in lows)
    assert gil_switch.open_holds() == 0
    assert _close(sys.getswitchinterval(), 0.0035)


def test_holds_opened_and_closed_again_and_again_do_not_drift():
    sys.setswitchinterval(0.003499)  # a value the interpreter stores truncated
    found = sys.getswitchinterval()
    for i in range(50):
        with gil_switch.shorten(0.0002 + i * 1e-7):
            pass
    assert sys.getswitchinterval() == found

"""The storage I/O thread pool: order, real parallelism, errors, argument checks."""

from __future__ import annotations

import threading
import time

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.io_threads import (
    check_io_threads,
    default_io_threads,
    ordered_map,
    shared_map,
    split_map,
)


def test_results_come_back_in_input_order():
    # Later items finish first; the output order must still be the input order.
    def slow_inverse(i):
        time.sleep(0.002 * (10 - i))
        return i * i

    assert list(ordered_map(slow_inverse, range(10), 3)) == [i * i for i in range(10)]


def test_several_threads_run_at_once():
    barrier = threading.Barrier(2, timeout=5)

    def meet(i):
        barrier.wait()  # only returns if two items run at the same time
        return threading.get_ident()

    assert len(set(ordered_map(meet, range(2), 2))) == 2


def test_one_thread_runs_lazily_in_the_caller():
    seen = []
    results = ordered_map(lambda i: seen.append(i) or threading.get_ident(), range(3), 1)
    assert seen == []
    assert list(results) == [threading.get_ident()] * 3


def test_errors_reach_the_caller():
    def boom(i):
        if i == 2:
            raise OSError("disk says no")
        return i

    it = ordered_map(boom, range(4), 2)
    assert next(it) == 0 and next(it) == 1
    with pytest.raises(OSError, match="disk says no"):
        next(it)


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, True, "2"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(InvalidArgumentError, match="io_threads"):
        check_io_threads(bad)


def test_default_is_between_one_and_two():
    assert check_io_threads(None) == default_io_threads()
    assert 1 <= default_io_threads() <= 2


# -- split_map: contiguous runs, the first on the caller's thread --------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_split_map_returns_every_result_in_order(n, threads):
    def slow_inverse(i):
        time.sleep(0.001 * (n - i))
        return i * i + 1

    assert split_map(slow_inverse, list(range(n)), threads) == [i * i + 1 for i in range(n)]


def test_split_map_runs_in_contiguous_runs_with_the_first_on_the_caller():
    caller = threading.get_ident()
    barrier = threading.Barrier(2, timeout=5)

    def who(i):
        if i in (0, 4):  # the first item of each run: both runs must be going at once
            barrier.wait()
        return threading.get_ident()

    idents = split_map(who, list(range(8)), 2)
    assert idents[:4] == [caller] * 4
    assert len(set(idents[4:])) == 1 and idents[4] != caller


def test_split_map_with_one_thread_stays_on_the_caller():
    caller = threading.get_ident()
    assert split_map(lambda i: threading.get_ident(), list(range(5)), 1) == [caller] * 5


@pytest.mark.parametrize("failing", [1, 6])
def test_split_map_raises_only_after_every_run_has_finished(failing):
    finished = []

    def work(i):
        if i == failing:
            raise OSError(f"item {i} failed")
        time.sleep(0.01)
        finished.append(i)
        return i

    with pytest.raises(OSError, match=f"item {failing} failed"):
        split_map(work, list(range(8)), 2)
    # the caller's run stops at a failure in it; the other run always completes first
    other_run = range(4, 8) if failing < 4 else range(0, 4)
    assert set(other_run) - {failing} <= set(finished)
    snapshot = list(finished)
    time.sleep(0.05)
    assert finished == snapshot  # nothing was still running in the background


# -- shared_map: every thread takes the next item from one counter -------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 8, 13])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shared_map_returns_every_result_in_order(n, threads):
    def slow_inverse(i):
        time.sleep(0.001 * (n - i))
        return i * i + 1

    assert shared_map(slow_inverse, list(range(n)), threads) == [i * i + 1 for i in range(n)]


def test_shared_map_leaves_a_stalled_thread_fewer_items():
    """A pool thread that stalls on its first item (a core the OS gives to someone else) does
    not hold back the rest: the caller takes them all."""
    caller = threading.get_ident()
    stalled = threading.Event()

    def who(i):
        if threading.get_ident() != caller and not stalled.is_set():
            stalled.set()
            time.sleep(0.2)
        return threading.get_ident()

    idents = shared_map(who, list(range(8)), 2)
    assert idents.count(caller) >= 6
    assert len(idents) == 8


def test_shared_map_raises_only_after_every_thread_has_stopped():
    finished = []

    def work(i):
        if i == 2:
            raise OSError("item 2 failed")
        time.sleep(0.01)
        finished.append(i)
        return i

    with pytest.raises(OSError, match="item 2 failed"):
        shared_map(work, list(range(8)), 2)
    snapshot = list(finished)
    time.sleep(0.05)
    assert finished == snapshot  # nothing was still running in the background

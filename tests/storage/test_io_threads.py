"""The storage I/O thread pool: order, real parallelism, errors, argument checks."""

from __future__ import annotations

import threading
import time

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.io_threads import check_io_threads, default_io_threads, ordered_map


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

"""ThreadCopyStream (the CPU copy stream): order, dependencies, failures, timing, close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tiered_kv.errors import StateError
from tiered_kv.transfer.streams import ThreadCopyStream, ThreadEvent, make_copy_stream

TIMEOUT = 10.0


def _settle(ev) -> None:
    """Wait (bounded) until ``ev`` is done: a broken stream fails the test instead of hanging."""
    deadline = time.monotonic() + TIMEOUT
    while not ev.query():
        assert time.monotonic() < deadline, "copy job never finished"
        time.sleep(0.001)


@pytest.fixture
def stream():
    s = ThreadCopyStream("test")
    yield s
    s.close()


def test_jobs_run_in_submission_order_one_at_a_time(stream, gen):
    n = 37
    pauses = (torch.rand(n, generator=gen) * 2e-3).tolist()
    log: list[tuple[str, int]] = []

    def job(i: int) -> None:
        log.append(("start", i))
        time.sleep(pauses[i])
        log.append(("end", i))

    events = [stream.submit(lambda i=i: job(i)) for i in range(n)]
    _settle(events[-1])
    events[-1].synchronize()
    assert all(e.query() for e in events)
    # Strictly sequential: each job starts after the previous one ended, in submission order.
    assert log == [(what, i) for i in range(n) for what in ("start", "end")]


def test_submit_after_waits_for_the_event(stream):
    gate = ThreadEvent()
    ran: list[str] = []
    first = stream.submit(lambda: ran.append("first"), after=gate)
    # A later job without a dependency still runs after the blocked one (submission order).
    second = stream.submit(lambda: ran.append("second"))
    time.sleep(0.1)
    assert ran == []
    assert not first.query() and not second.query()
    gate.set()
    _settle(second)
    second.synchronize()
    assert ran == ["first", "second"]
    first.synchronize()


def test_after_a_failed_event_the_job_fails_with_that_error(stream):
    gate = ThreadEvent()
    err = RuntimeError("upstream copy failed 7319")
    ran: list[int] = []
    ev = stream.submit(lambda: ran.append(1), after=gate)
    gate.set(err)
    _settle(ev)
    with pytest.raises(RuntimeError, match="7319"):
        ev.synchronize()
    assert ran == []
    assert ev.error is err


def test_a_failing_job_marks_its_event_failed_and_later_jobs_still_run(stream):
    ran: list[int] = []

    def boom() -> None:
        raise ValueError("copy 4242 exploded")

    before = stream.submit(lambda: ran.append(0))
    bad = stream.submit(boom)
    after = [stream.submit(lambda i=i: ran.append(i)) for i in (1, 2, 3)]
    for e in after:
        _settle(e)
        e.synchronize()  # no error: a failed job does not poison the jobs behind it
    assert ran == [0, 1, 2, 3]
    before.synchronize()
    assert bad.query()
    assert isinstance(bad.error, ValueError)
    with pytest.raises(ValueError, match="4242"):
        bad.synchronize()
    with pytest.raises(ValueError, match="4242"):
        bad.wait()
    # The error stays: asking again raises again.
    with pytest.raises(ValueError, match="4242"):
        bad.synchronize()


def test_query_never_blocks(stream):
    release = threading.Event()
    ev = stream.submit(lambda: release.wait(TIMEOUT))
    t0 = time.perf_counter()
    for _ in range(100):
        assert ev.query() is False
    assert time.perf_counter() - t0 < 0.5
    assert ev.seconds() == 0.0  # not done yet
    release.set()
    _settle(ev)
    ev.synchronize()
    assert ev.query() is True


def test_seconds_measure_the_job_not_the_wait_before_it(stream):
    gate = ThreadEvent()
    ev = stream.submit(lambda: time.sleep(0.03), after=gate)
    time.sleep(0.3)  # the job waits for ``gate`` this long; that is not its run time
    gate.set()
    _settle(ev)
    ev.synchronize()
    assert 0.025 <= ev.seconds() < 0.25
    quick = stream.submit(lambda: None)
    _settle(quick)
    assert 0.0 <= quick.seconds() < 0.025


def test_close_finishes_submitted_jobs_then_refuses_new_ones():
    stream = ThreadCopyStream("closing")
    ran: list[int] = []
    ev = stream.submit(lambda: (time.sleep(0.05), ran.append(1)))
    stream.close()
    assert ev.query() and ran == [1]  # close waited for the job already submitted
    assert not stream._thread.is_alive()
    with pytest.raises(StateError, match="closing"):
        stream.submit(lambda: None)
    stream.close()  # idempotent


def test_thread_event_states():
    assert ThreadEvent(done=True).query()
    ThreadEvent(done=True).synchronize()
    ev = ThreadEvent()
    assert not ev.query() and ev.seconds() == 0.0
    ev.set(seconds=1.25)
    assert ev.query() and ev.seconds() == 1.25
    ev.wait()


def test_make_copy_stream_on_cpu_is_a_thread_stream():
    s = make_copy_stream("x", torch.device("cpu"))
    try:
        assert isinstance(s, ThreadCopyStream)
        assert s.name == "x"
        # On CPU the compute issued so far is already done.
        assert s.record_compute().query()
        out: list[int] = []
        _settle(s.submit(lambda: out.append(5)))
        assert out == [5]
    finally:
        s.close()


def test_submit_layers_sets_each_layer_event_as_that_layer_finishes(stream):
    release = threading.Event()
    ran: list[int] = []

    def job(layer: int) -> None:
        ran.append(layer)
        if layer == 1:
            release.wait(5)
        if layer == 2:
            raise ValueError("layer 2 broke")

    events = stream.submit_layers(job, 4)
    events[0].synchronize()  # layer 0 is usable while layer 1 is still copying
    assert not events[1].query() and not events[3].query()
    release.set()
    events[1].synchronize()
    with pytest.raises(ValueError, match="layer 2 broke"):
        events[2].synchronize()
    events[3].synchronize()  # a failed layer fails only its own event
    assert ran == [0, 1, 2, 3]


def test_submit_layers_after_a_failed_event_fails_every_layer(stream):
    before = ThreadEvent()
    before.set(RuntimeError("compute failed"))
    events = stream.submit_layers(lambda _layer: None, 3, before)
    for e in events:
        with pytest.raises(RuntimeError, match="compute failed"):
            e.synchronize()

"""LogLimiter: the first event of a kind is logged, the rest within the interval only counted
and reported with the next record of that kind; kinds are independent."""

from __future__ import annotations

import logging

from tiered_kv import log_limit
from tiered_kv.log_limit import LogLimiter


def test_once_per_kind_per_interval(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(log_limit.time, "monotonic", lambda: now[0])
    logger = logging.getLogger("tiered_kv.test_log_limit")
    limiter = LogLimiter(logger, interval_s=60.0)
    caplog.set_level(logging.WARNING, logger=logger.name)
    emitted = [limiter.log(logging.WARNING, "a", "store failed: %s", i) for i in range(50)]
    assert emitted == [True] + [False] * 49
    assert limiter.log(logging.WARNING, "b", "other kind") is True
    now[0] += 59.0
    assert limiter.log(logging.WARNING, "a", "store failed: %s", "late") is False
    now[0] += 1.5
    assert limiter.log(logging.WARNING, "a", "store failed: %s", "again") is True
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == ["store failed: 0", "other kind"]
    assert messages[2] == "store failed: again (50 more like it in the last 60 s not logged)"
    assert len(messages) == 3
    limiter.reset()
    assert limiter.log(logging.WARNING, "a", "after reset") is True


def test_disabled_level_records_nothing_and_counts_nothing(caplog):
    logger = logging.getLogger("tiered_kv.test_log_limit.quiet")
    caplog.set_level(logging.ERROR, logger=logger.name)
    limiter = LogLimiter(logger)
    assert limiter.log(logging.WARNING, "a", "hidden") is False
    caplog.set_level(logging.WARNING, logger=logger.name)
    assert limiter.log(logging.WARNING, "a", "shown") is True  # the hidden one left no mark
    assert [r.getMessage() for r in caplog.records] == ["shown"]


def test_the_package_logger_has_only_a_null_handler():
    top = logging.getLogger("tiered_kv")
    assert [type(h) for h in top.handlers] == [logging.NullHandler]

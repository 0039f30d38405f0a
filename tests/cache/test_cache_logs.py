"""The cache's log records: a slow transfer job is a WARNING (once per direction a minute), a
failing store's errors are WARNINGs once per kind however many calls fail, each eviction pass
is one DEBUG summary, the store's open and close are INFO, and a decode loop logs nothing."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch

from tiered_kv.cache import TieredKVCache, transfer_metrics
from tiered_kv.cache.jobs import JobTable
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.config import TieredKVConfig
from tiered_kv.storage import contract


def _config(tmp_path, **over) -> TieredKVConfig:
    kw = dict(
        num_layers=2, head_num=2, head_dim=8, page_size=4, device_tokens=64, host_tokens=128,
        storage_bytes=64 << 20, storage_path=str(tmp_path / "store"), model_id="test-model@1",
        prefetch_threshold=4, prefetch_policy="wait_complete",
    )  # fmt: skip
    return TieredKVConfig.flat(**{**kw, **over})


def _serve(cache: TieredKVCache, prompt: list[int], gen: torch.Generator) -> None:
    req = cache.begin(prompt)
    slots = cache.extend(req, prompt[req.prefix_len :])
    for layer in range(2):
        k = torch.randn(len(slots), 2, 8, generator=gen)
        cache.write_kv(layer, slots, k, -k)
    cache.finish(req)
    cache.drain()


def _prompts(n: int, base: int = 0) -> list[list[int]]:
    return [[base + 1000 * i + j for j in range(33 + 4 * i)] for i in range(n)]


def _records(caplog, logger: str, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno == level]


@pytest.fixture
def cache(tmp_path):
    c = TieredKVCache(_config(tmp_path))
    yield c
    c.close()


def test_a_slow_transfer_job_is_a_warning_once_per_direction(tmp_path, gen, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="tiered_kv")
    normal = TieredKVCache(_config(tmp_path / "normal"))
    try:
        for p in _prompts(3):
            _serve(normal, p, gen)
    finally:
        normal.close()
    name = transfer_metrics.__name__
    assert _records(caplog, name, logging.WARNING) == []  # CPU copies of a few KiB: not slow
    monkeypatch.setattr(transfer_metrics, "SLOW_TRANSFER_S", 0.0)  # every job is slow now
    slow = TieredKVCache(_config(tmp_path / "slow"))
    try:
        for p in _prompts(5):
            _serve(slow, p, gen)
    finally:
        slow.close()
    records = _records(caplog, name, logging.WARNING)
    directions = [r.args[0] for r in records]
    assert "device_to_host" in directions and "host_to_storage" in directions
    assert len(directions) == len(set(directions))  # five requests' jobs, one record a way
    assert all(re.match(r"slow \w+ transfer job: [\d.]+ s for \d+ bytes", r.getMessage())
               for r in records)  # fmt: skip


def test_a_failing_store_logs_each_kind_of_error_once(cache, gen, caplog):
    contract.ERROR_LOG.reset()  # another test's store may have logged these kinds already
    caplog.set_level(logging.WARNING, logger="tiered_kv")
    for p in _prompts(2):
        _serve(cache, p, gen)
    shutil.rmtree(cache.config.storage.storage_path)
    for p in [[50_000 + 1000 * i + j for j in range(33)] for i in range(10)]:
        # Every probe and backup fails until the guard reopens the store.
        _serve(cache, p, gen)
    errors = cache.stats()["storage"]["errors"]
    warnings = [r for r in caplog.records if r.name.startswith("tiered_kv.storage")]
    warnings = [r for r in warnings if r.levelno == logging.WARNING]
    messages = [r.getMessage() for r in warnings]
    assert errors >= 8 and 1 <= len(messages) < errors
    assert len(messages) == len(set(messages)), messages  # one per kind
    assert any("store directory removed" in m for m in messages), messages
    reopened = [r for r in caplog.records if "reopening it" in r.getMessage()]
    assert len(reopened) == 1 and reopened[0].levelno == logging.ERROR


def test_storage_errors_in_the_job_table_are_counted_each_and_logged_per_kind(caplog):
    caplog.set_level(logging.WARNING, logger="tiered_kv")
    metrics = CacheMetrics()
    jobs = JobTable(None, None, metrics)
    for _ in range(100):
        jobs.storage_error("probe", "ConnectionError: Error 111 connecting to 127.0.0.1:1")
    jobs.storage_error("probe", "TimeoutError: timed out")
    jobs.storage_error("host_to_storage", "ConnectionError: Error 111 connecting")
    assert metrics.storage_errors == 102
    messages = [r.getMessage() for r in _records(caplog, "tiered_kv.cache.jobs", logging.WARNING)]
    assert messages == [
        "storage probe failed: ConnectionError: Error 111 connecting to 127.0.0.1:1",
        "storage probe failed: TimeoutError: timed out",
        "storage host_to_storage failed: ConnectionError: Error 111 connecting",
    ]


def test_a_raising_probe_is_counted_and_logged_once(cache, gen, caplog):
    caplog.set_level(logging.WARNING, logger="tiered_kv")

    class Dead:
        def batch_exists(self, keys):
            raise ConnectionError("the store's server is gone")

    cache.manager.store = Dead()
    for p in _prompts(6):
        _serve(cache, p, gen)
    assert cache.stats()["storage"]["errors"] == 6  # one probe per request
    records = _records(caplog, "tiered_kv.cache.jobs", logging.WARNING)
    assert [r.getMessage() for r in records] == [
        "storage probe failed: ConnectionError: the store's server is gone"
    ]


def test_each_eviction_pass_is_one_debug_summary(cache, gen, caplog):
    caplog.set_level(logging.DEBUG, logger="tiered_kv.cache.eviction")
    passes = []
    evict = cache.manager.evictor.evict_device

    def counted(n):
        passes.append(n)
        return evict(n)

    cache.manager.evictor.evict_device = counted
    for p in [[1000 * i + j for j in range(13)] for i in range(16)]:  # 3 pages each
        _serve(cache, p, gen)
    st = cache.stats()["evictions"]["device"]
    records = [r for r in _records(caplog, "tiered_kv.cache.eviction", logging.DEBUG)]
    device = [r for r in records if r.args[0] == "device"]
    assert st["nodes"] > 1 and 1 <= len(device) <= len(passes)
    assert sum(r.args[1] for r in device) == st["tokens"]  # every freed token, in summaries
    assert sum(r.args[2] for r in device) == st["nodes"]
    pattern = r"device eviction: \d+ tokens \(\d+ nodes\) freed, \d+ asked"
    assert all(re.match(pattern, r.getMessage()) for r in device)
    # A pass that frees several nodes is still one record.
    caplog.clear()
    cache.manager.evict_device(1 << 62)
    many = cache.stats()["evictions"]["device"]["nodes"] - st["nodes"]
    records = _records(caplog, "tiered_kv.cache.eviction", logging.DEBUG)
    assert many > 1 and [r.args[:3] for r in records] == [("device", records[0].args[1], many)]


def test_a_decode_loop_logs_nothing(tmp_path, gen, caplog):
    cache = TieredKVCache(_config(tmp_path, device_tokens=512))
    try:
        prompt = list(range(21))
        req = cache.begin(prompt)
        cache.extend(req, prompt)
        caplog.set_level(logging.DEBUG, logger="tiered_kv")
        caplog.clear()
        for t in range(200):
            slot = cache.decode(req, 1000 + t)
            k = torch.randn(1, 2, 8, generator=gen)
            for layer in range(2):
                cache.write_kv(layer, slot, k, -k)
            cache.poll()
        assert caplog.records == []
        cache.finish(req)
    finally:
        cache.close()


def test_the_store_open_and_close_are_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiered_kv")
    cache = TieredKVCache(_config(tmp_path))
    cache.close()
    name = "tiered_kv.storage.guarded_store"
    messages = [r.getMessage() for r in _records(caplog, name, logging.INFO)]
    assert len(messages) == 2, messages
    assert messages[0].startswith("storage opened: ") and messages[1].startswith("storage closed")
    assert "pages" in messages[1] and "of 67108864 bytes" in messages[1]

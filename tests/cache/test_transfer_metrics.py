"""The slow-transfer warning names a job's real page count in every direction: device <-> host
jobs (whose workers count slots, not keys) as well as storage jobs; the bytes it names are that
many host pages."""

from __future__ import annotations

import logging

import torch

from tiered_kv.cache import TieredKVCache, transfer_metrics
from tiered_kv.config import TieredKVConfig
from tiered_kv.names import Direction

PAGE = 4


def _serve(cache: TieredKVCache, prompt: list[int], gen: torch.Generator) -> None:
    req = cache.begin(prompt)
    slots = cache.extend(req, prompt[req.prefix_len :])
    for layer in range(2):
        k = torch.randn(len(slots), 2, 8, generator=gen)
        cache.write_kv(layer, slots, k, -k)
    cache.finish(req)
    cache.drain()


def test_every_directions_slow_job_names_its_pages(tmp_path, gen, caplog, monkeypatch):
    monkeypatch.setattr(transfer_metrics, "SLOW_TRANSFER_S", 0.0)  # every job is slow
    caplog.set_level(logging.WARNING, logger=transfer_metrics.__name__)
    cache = TieredKVCache(
        TieredKVConfig.flat(
            num_layers=2, head_num=2, head_dim=8, page_size=PAGE, device_tokens=64,
            host_tokens=128, storage_bytes=64 << 20, storage_path=str(tmp_path / "store"),
            model_id="test-model@1", prefetch_threshold=PAGE, prefetch_policy="wait_complete",
        )
    )  # fmt: skip
    prompt = [7000 + i for i in range(6 * PAGE + 1)]  # 6 whole pages and a token
    try:
        _serve(cache, prompt, gen)  # device -> host, host -> storage
        cache.manager.evict_device(1 << 62)
        cache.drain()
        _serve(cache, prompt, gen)  # host -> device
        cache.clear_tree()
        _serve(cache, prompt, gen)  # storage -> host (then host -> device)
        page_nbytes = cache.host_pool.page_nbytes
    finally:
        cache.close()
    seen = {}
    for r in caplog.records:
        direction, _seconds, nbytes, pages, _threshold = r.args
        seen[direction] = (nbytes, pages)
        assert f"{nbytes} bytes ({pages} pages;" in r.getMessage()
    assert set(seen) == {str(d) for d in Direction}, seen
    for direction, (nbytes, pages) in seen.items():
        assert pages > 0, (direction, seen)
        assert nbytes == pages * page_nbytes, (direction, seen)

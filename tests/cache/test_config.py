"""TieredKVConfig: impossible settings are rejected naming the field; valid ones build a cache."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError

SMALL = dict(
    num_layers=2,
    head_num=2,
    head_dim=8,
    page_size=8,
    device_tokens=64,
    host_tokens=128,
    model_id="test-model@1",
)


def small(**changes) -> TieredKVConfig:
    return TieredKVConfig.flat(**{**SMALL, **changes})


def test_defaults_are_valid():
    cfg = TieredKVConfig()
    assert cfg.storage_dir is None
    assert cfg.torch_dtype is torch.float32


def test_frozen():
    cfg = small()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.device.page_size = 16  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.device = cfg.device  # type: ignore[misc]


P = 8


@pytest.mark.parametrize(
    "changes, field",
    [
        # host smaller than a page, or not whole pages
        (dict(host_tokens=P // 2), "host_tokens"),
        (dict(host_tokens=P + P // 2), "host_tokens"),
        (dict(host_tokens=-P), "host_tokens"),
        (dict(host_tokens=float(P * 4)), "host_tokens"),
        # page size
        (dict(page_size=12), "page_size"),
        (dict(page_size=3), "page_size"),
        (dict(page_size=0), "page_size"),
        (dict(page_size=-8), "page_size"),
        (dict(page_size=8.0), "page_size"),
        # device pool: whole pages, at least two
        (dict(device_tokens=P), "device_tokens"),
        (dict(device_tokens=100), "device_tokens"),
        (dict(device_tokens=0), "device_tokens"),
        # unknown policies and choices
        (dict(device_policy="mru"), "device_policy"),
        (dict(host_policy="LRU"), "host_policy"),
        (dict(write_policy="write_around"), "write_policy"),
        (dict(prefetch_policy="eager"), "prefetch_policy"),
        (dict(prefetch_policy=None), "prefetch_policy"),
        (dict(model="gqa"), "model"),
        (dict(dtype="int8"), "dtype"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(host_layout="row_major"), "host_layout"),
        (dict(io_backend="dma"), "io_backend"),
        (dict(device="tpu"), "device"),
        # storage
        (dict(storage_bytes=64 << 20), "storage_path"),
        (dict(storage_bytes=64 << 20, storage_path="/tmp/x", host_tokens=0), "storage_bytes"),
        (dict(storage_bytes=-1), "storage_bytes"),
        (dict(storage_bytes=1.5e9, storage_path="/tmp/x"), "storage_bytes"),
        (dict(storage_bytes=64 << 20, storage_path=5), "storage_path"),
        # a store needs the model's identity (issue 12): two models never share a page
        (dict(storage_bytes=64 << 20, storage_path="/tmp/x", model_id=None), "model_id"),
        (dict(model_id=""), "model_id"),
        (dict(rank=3), "rank"),
        (dict(namespace_salt=7), "namespace_salt"),
        (dict(storage_layout="files"), "storage_layout"),
        (dict(storage_layout=None), "storage_layout"),
        # bools and other non-ints where ints are needed
        (dict(num_layers=True), "num_layers"),
        (dict(head_num=True), "head_num"),
        (dict(page_size=True), "page_size"),
        (dict(device_tokens=True), "device_tokens"),
        (dict(host_tokens=True), "host_tokens"),
        (dict(storage_bytes=True, storage_path="/tmp/x"), "storage_bytes"),
        (dict(max_requests=False), "max_requests"),
        (dict(max_context_len=0), "max_context_len"),
        (dict(storage_batch_pages=True), "storage_batch_pages"),
        (dict(selective_hits=0), "selective_hits"),
        (dict(head_dim="8"), "head_dim"),
        (dict(v_head_dim=0), "v_head_dim"),
        (dict(v_head_dim=True), "v_head_dim"),
        (dict(prefetch_threshold=True), "prefetch_threshold"),
        (dict(prefetch_threshold=-1), "prefetch_threshold"),
        (dict(prefetch_threshold=1.5), "prefetch_threshold"),
        (dict(prefetch_threshold="256"), "prefetch_threshold"),
        (dict(prefetch_threshold=None), "prefetch_threshold"),
        # timeouts: numbers of seconds >= 0
        (dict(prefetch_timeout_base_s=-0.1), "prefetch_timeout_base_s"),
        (dict(prefetch_timeout_base_s=True), "prefetch_timeout_base_s"),
        (dict(prefetch_timeout_per_1k_s="1"), "prefetch_timeout_per_1k_s"),
        (dict(prefetch_timeout_max_s=math.nan), "prefetch_timeout_max_s"),
        (dict(prefetch_timeout_max_s=None), "prefetch_timeout_max_s"),
    ],
    ids=lambda x: x if isinstance(x, str) else repr(x),
)
def test_rejects_impossible_settings_naming_the_field(changes, field):
    with pytest.raises(InvalidArgumentError, match=rf"TieredKVConfig\.{field}=") as info:
        small(**changes)
    assert isinstance(info.value, ValueError)
    assert "invalid" in str(info.value)


def test_replace_validates_again():
    cfg = small()
    assert cfg.replace(page_size=4).device.page_size == 4
    with pytest.raises(InvalidArgumentError, match="page_size"):
        cfg.replace(page_size=12)
    with pytest.raises(InvalidArgumentError, match="write_policy"):
        cfg.replace(write_policy="nope")


@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64])
def test_power_of_two_pages_accepted(page_size):
    cfg = small(page_size=page_size, device_tokens=2 * page_size * 4, host_tokens=page_size)
    assert cfg.device.page_size == page_size


def test_host_of_exactly_one_page_and_no_host():
    assert small(host_tokens=P).host.host_tokens == P
    assert small(host_tokens=0).host.host_tokens == 0


@pytest.mark.parametrize(
    "base, per_1k, cap, tokens, expected",
    [
        (0.5, 0.25, 5.0, 0, 0.5),
        (0.5, 0.25, 5.0, 1000, 0.75),
        (0.5, 0.25, 5.0, 4096, 0.5 + 0.25 * 4.096),
        (0.05, 2.0, 5.0, 48, 0.05 + 0.096),
        (0.5, 0.25, 1.0, 4096, 1.0),  # capped
        (0.5, 0.25, 0.2, 0, 0.2),  # a cap below the base wins
        (0, 0, 0, 100_000, 0.0),
    ],
)
def test_prefetch_timeout_formula(base, per_1k, cap, tokens, expected):
    cfg = small(
        prefetch_timeout_base_s=base,
        prefetch_timeout_per_1k_s=per_1k,
        prefetch_timeout_max_s=cap,
    )
    assert cfg.prefetch_timeout_s(tokens) == pytest.approx(expected)


def test_storage_dir_and_dtypes(tmp_path):
    assert small(storage_path=str(tmp_path)).storage_dir is None  # no storage_bytes: no tier
    cfg = small(storage_bytes=64 << 20, storage_path=str(tmp_path / "s"))
    assert cfg.storage_dir == Path(tmp_path / "s")
    assert small(storage_bytes=64 << 20, storage_path=tmp_path).storage_dir == tmp_path
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        assert small(dtype=name).torch_dtype is dtype


@pytest.mark.parametrize(
    "changes, tiers",
    [
        (dict(host_tokens=0), {"device", "rows"}),
        (dict(), {"device", "rows", "host"}),
        (dict(storage_bytes=64 << 20), {"device", "rows", "host"}),
    ],
)
def test_valid_config_builds_a_cache(tmp_path, changes, tiers):
    cfg = small(storage_path=str(tmp_path / "store"), max_requests=5, **changes)
    cache = TieredKVCache(cfg)
    try:
        sizes = cache.free_sizes()
        assert set(sizes) == tiers
        assert sizes["device"] == 64 and sizes["rows"] == 5
        assert sizes.get("host", 128) == 128
        assert (cache.host_pool is None) == (cfg.host.host_tokens == 0)
        assert (cache.storage is None) == (cfg.storage.storage_bytes == 0)
        if cfg.storage.storage_bytes:
            assert (tmp_path / "store").is_dir()
        # one request through whatever tiers there are
        req = cache.begin(list(range(20)))
        slots = cache.extend(req, list(range(20)))
        k = torch.randn(20, 2, 8)
        for layer in range(2):
            cache.write_kv(layer, slots, k, -k)
        cache.finish(req)
        again = cache.begin(list(range(20)))
        assert again.hits.device == 16
        assert torch.equal(cache.device_pool.get_key_buffer(1)[again.slots], k[:16])
        cache.finish(again)
    finally:
        cache.close()


def test_cache_needs_a_config():
    with pytest.raises(InvalidArgumentError, match="TieredKVConfig"):
        TieredKVCache(SMALL)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(device_tokens=2**40), "device_tokens"),
        (dict(max_context_len=2**33), "max_context_len"),
    ],
)
def test_a_cache_too_large_for_the_machine_is_a_typed_error(tmp_path, changes, field):
    """Issue 12: they gave an untyped torch RuntimeError half way through the build."""
    from tiered_kv.errors import HostMemoryError

    with pytest.raises(HostMemoryError, match=rf"TieredKVConfig\.{field}"):
        TieredKVCache(small(storage_path=str(tmp_path / "s"), **changes))


def test_swa_and_dsa_geometry_fields_are_checked():
    with pytest.raises(InvalidArgumentError, match="full_layer_every"):
        small(model="swa", full_layer_every=1)
    with pytest.raises(InvalidArgumentError, match="device_swa_tokens"):
        small(device_swa_tokens=3)
    with pytest.raises(InvalidArgumentError, match="index_head_dim"):
        small(index_head_dim=64)
    full, window = small(model="swa", num_layers=5, full_layer_every=2).geometry.swa_layer_ids()
    assert (full, window) == ([0, 2, 4], [1, 3])


def test_the_sizing_shapes_the_request_rows_and_the_allocators_reserve(tmp_path):
    from tiered_kv.cache import TieredKVCache
    from tiered_kv.device.sizing import AllocSizingConfig

    spec = AllocSizingConfig(
        page_size=4,
        speculative_algorithm="eagle",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
    )
    # eagle: ceil((4 - 1 + 3) / 4) = 2 pages x 4 x topk 2 = 16 a step, 32 reserved (overlap),
    # headroom max(4 + 6, 32 + 4 - 1) = 35
    for sizing, extra, reserve in ((None, 4, 2), (spec, 35, 32)):
        cfg = TieredKVConfig.flat(
            page_size=4, device_tokens=64, host_tokens=0, max_requests=3, max_context_len=50,
            num_layers=1, head_num=1, head_dim=4, sizing=sizing,
        )  # fmt: skip
        cache = TieredKVCache(cfg)
        try:
            assert cache.req_to_token.req_to_token.shape[1] == 50 + extra
            assert cache.allocator.request_slot_reserve() == reserve
        finally:
            cache.close()

"""Issue 38: bad input to ``TieredKVCache``'s public methods is a typed error naming the value
and what would be valid, and changes nothing; slots given as a list of ints (or a numpy integer
array) are taken as a tensor of them would be. Also: a CUDA config in a process without CUDA is
refused when the cache is built, before anything is allocated."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tiered_kv import platform
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError

PAGE = 4
GEOMETRY = {
    "mha": dict(num_layers=2, head_num=2, head_dim=8),
    "swa": dict(model="swa", full_layer_every=2, sliding_window=9, num_layers=4, head_num=2,
                head_dim=8),
    "swa_small_window": dict(model="swa", full_layer_every=2, sliding_window=9, num_layers=4,
                             head_num=2, head_dim=8, device_swa_tokens=32),
    "swa_unified": dict(model="swa", full_layer_every=2, sliding_window=9, num_layers=4,
                        head_num=2, head_dim=8, swa_unified_pool=True),
    "hisparse": dict(model="dsa", num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8,
                     index_head_dim=128, dtype="float32", hisparse_logical_ratio=4),
}  # fmt: skip


def config(tmp_path, kind: str = "mha", storage: bool = False, **changes) -> TieredKVConfig:
    fields = dict(GEOMETRY[kind], page_size=PAGE, device_tokens=64, host_tokens=256,
                  max_requests=4, max_context_len=128)  # fmt: skip
    if storage:
        fields.update(
            storage_bytes=64 << 20, storage_path=str(tmp_path / "store"), model_id="test-model@1"
        )
    fields.update(changes)
    return TieredKVConfig.flat(**fields)


@pytest.fixture
def cache_of(tmp_path):
    caches: list[TieredKVCache] = []

    def make(kind: str = "mha", storage: bool = False) -> TieredKVCache:
        caches.append(TieredKVCache(config(tmp_path, kind, storage)))
        return caches[-1]

    yield make
    for cache in caches:
        cache.close()


def snapshot(cache: TieredKVCache) -> tuple:
    """Everything a refused call must leave as it was: free counts, stats, the device bytes."""
    return (
        cache.free_sizes(),
        cache.stats(),
        [t.clone() for t in cache.device_pool.buffers()],
    )


def assert_unchanged(cache: TieredKVCache, before: tuple) -> None:
    sizes, stats, buffers = snapshot(cache)
    assert (sizes, stats) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(buffers, before[2], strict=True))


def random_kv(cache: TieredKVCache, n: int, gen: torch.Generator):
    """Fresh random K and V (V None for a latent pool) for ``n`` tokens of one layer."""
    g = cache.config.geometry
    if g.model == "dsa":
        return torch.randn(n, 1, g.kv_lora_rank + g.qk_rope_head_dim, generator=gen), None
    k = torch.randn(n, g.head_num, g.head_dim, generator=gen)
    return k, torch.randn(n, g.head_num, g.head_dim, generator=gen)


def started(cache: TieredKVCache, gen: torch.Generator, n: int = 11):
    """A request with ``n`` fresh prompt tokens extended onto the device, and their slots."""
    prompt = torch.randint(0, 50_000, (n,), generator=gen).tolist()
    req = cache.begin(prompt)
    return req, cache.extend(req, prompt)


# -- write_kv's slots ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(GEOMETRY))
@pytest.mark.parametrize(
    "form",
    [list, tuple, lambda t: np.asarray(t), lambda t: np.asarray(t, dtype=np.int32)],
    ids=["list", "tuple", "numpy_int64", "numpy_int32"],
)
def test_write_kv_takes_slots_as_ints_as_it_takes_a_tensor(cache_of, gen, kind, form):
    cache = cache_of(kind)
    req, slots = started(cache, gen)
    for layer in range(cache.config.geometry.num_layers):
        k, v = random_kv(cache, len(slots), gen)
        cache.write_kv(layer, slots, k, v)
        want = [t.clone() for t in cache.device_pool.buffers()]
        other_k, other_v = random_kv(cache, len(slots), gen)
        cache.write_kv(layer, slots, other_k, other_v)  # different bytes in between
        cache.write_kv(layer, form(slots.tolist()), k, v)
        got = cache.device_pool.buffers()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), kind
    cache.abort(req)


def test_write_index_k_takes_slots_as_a_list(cache_of, gen):
    cache = cache_of("hisparse")
    req, slots = started(cache, gen)
    index_k = torch.randn(len(slots), 128, generator=gen)
    cache.write_index_k(1, slots, index_k)
    want = [t.clone() for t in cache.device_pool.buffers()]
    cache.write_index_k(1, slots, torch.randn(len(slots), 128, generator=gen))
    cache.write_index_k(1, slots.tolist(), index_k)
    assert all(torch.equal(a, b) for a, b in zip(cache.device_pool.buffers(), want, strict=True))
    with pytest.raises(InvalidArgumentError, match=re.escape("'x'")):
        cache.write_index_k(1, ["x"] * len(slots), index_k)
    cache.abort(req)


def _bad_slots(slots: list[int]) -> dict:
    """Each bad form of ``slots`` (11 valid ids) and a pattern its error must match: the value,
    and for an id outside the allocator's (or the pool's) range, that range."""
    n, e = len(slots), re.escape
    outside = r"\] (are )?outside (the valid range )?\[0, \d+\)"
    return {
        "float": ([*slots[:-1], 2.5], e("slots[10]=2.5 is not an int")),
        "str": ("a" * n, e("slots='aaaaaaaaaaa'")),
        "none": (None, e("slots=None")),
        "bools": ([True] * n, e("slots[0]=True is not an int")),
        "nested": ([[s] for s in slots], e(f"slots[0]=[{slots[0]}] is not an int")),
        "short": (slots[:-1], e(f"{n - 1} slots but the KV has {n}")),
        "too_big": ([*slots[:-1], 10**6], r"\[1000000" + outside),
        "negative": ([-1, *slots[1:]], r"\[-1" + outside),
        "huge": ([*slots[:-1], 2**70], e(f"[{2**70}] outside the int64 range")),
        "numpy_float": (np.asarray(slots, dtype=np.float64), "dtype float64"),
        "numpy_2d": (np.asarray([slots]), e(f"shape (1, {n})")),
        "tensor_too_big": (torch.tensor([*slots[:-1], 10**6]), r"\[1000000" + outside),
        "tensor_negative": (torch.tensor([-1, *slots[1:]]), r"\[-1" + outside),
        # -2 indexes a table's second-to-last entry (a real one) where -1 hits its sentinel
        "tensor_minus_two": (torch.tensor([-2, *slots[1:]]), r"\[-2" + outside),
    }


@pytest.mark.parametrize("kind", list(GEOMETRY))
@pytest.mark.parametrize("bad", list(_bad_slots([0] * 11)))
def test_write_kv_refuses_bad_slots_naming_them_and_changes_nothing(cache_of, gen, kind, bad):
    cache = cache_of(kind)
    req, slots = started(cache, gen)
    value, pattern = _bad_slots(slots.tolist())[bad]
    k, v = random_kv(cache, len(slots), gen)
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError, match=pattern):
        cache.write_kv(1, value, k, v)
    assert_unchanged(cache, before)
    cache.write_kv(1, slots, k, v)  # the cache still works
    cache.abort(req)


# -- batches: begin_many, finish_many ------------------------------------------------------------
@pytest.mark.parametrize("storage", [False, True], ids=["no_storage", "storage"])
def test_begin_many_refuses_what_is_not_a_list_of_prompts(cache_of, gen, storage):
    cache = cache_of(storage=storage)
    live, _ = started(cache, gen)
    prompts = [torch.randint(0, 50_000, (9,), generator=gen).tolist() for _ in range(2)]
    before = snapshot(cache)
    for value, needle in ((None, "prompts=None"), (7, "prompts=7"), ("abc", "prompts='abc'")):
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)) as info:
            cache.begin_many(value)
        assert "a list of prompts" in str(info.value)
        assert_unchanged(cache, before)
    with pytest.raises(InvalidArgumentError, match=r"extra_keys=5;.*one extra key"):
        cache.begin_many(prompts, extra_keys=5)
    assert_unchanged(cache, before)
    assert len(cache.begin_many(prompts)) == 2  # the cache still works


@pytest.mark.parametrize("storage", [False, True], ids=["no_storage", "storage"])
def test_finish_many_refuses_what_is_not_a_list_of_requests(cache_of, gen, storage):
    cache = cache_of(storage=storage)
    req, slots = started(cache, gen)
    for layer in range(cache.config.geometry.num_layers):
        cache.write_kv(layer, slots, *random_kv(cache, len(slots), gen))
    before = snapshot(cache)
    for value, needle in ((None, "reqs=None"), (3, "reqs=3"), (req, "reqs=Request(")):
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)) as info:
            cache.finish_many(value)
        assert "a list of requests" in str(info.value)
        assert_unchanged(cache, before)
    assert not req.finished
    cache.finish_many([req])  # the request is still live, and finishes
    cache.drain()
    assert cache.stats()["occupancy"]["device_tokens"] == 8


def test_drain_refuses_a_timeout_that_is_not_seconds(cache_of):
    cache = cache_of()
    for bad in ("10", None, -1.0, float("nan")):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"timeout_s={bad!r}")):
            cache.drain(bad)
    cache.drain(0.5)


# -- the device ----------------------------------------------------------------------------------
def test_a_cuda_config_without_cuda_is_refused_when_the_cache_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(platform, "cuda_available", lambda: False)
    cfg = config(tmp_path, device="cuda")  # a config is data: it may be built anywhere
    with pytest.raises(BackendUnavailableError) as info:
        TieredKVCache(cfg)
    text = str(info.value)
    assert "TieredKVConfig.device='cuda'" in text and "CUDA is not available" in text
    assert "'cpu'" in text

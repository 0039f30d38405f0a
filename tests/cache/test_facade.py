"""TieredKVCache end to end: a serving loop over device -> host -> LMDB storage.

A stand-in model gives every (prompt prefix, layer) random K and V (from the seeded ``gen``)
and remembers them, so a token computed again gets the KV it got the first time. Every request
reads its cached prefix back through the device pool's buffer getters and compares it, bit for
bit, with what the model wrote when that prefix was first computed.
"""

from __future__ import annotations

import random
import shutil
import threading
import time

import pytest
import torch

from tests.cache.test_metrics import scrape
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.metrics import RequestHits
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.dsa_pool import quantize_index_k
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.storage import SlabStorage, value_format
from tiered_kv.storage.keys import page_keys

PAGE = 4
LAYERS = 3


def make_config(tmp_path, **changes) -> TieredKVConfig:
    base = dict(
        num_layers=LAYERS,
        head_num=2,
        head_dim=8,
        page_size=PAGE,
        device_tokens=64,
        host_tokens=160,
        storage_bytes=64 << 20,
        storage_path=str(tmp_path / "store"),
        model_id="test-model@1",
        prefetch_threshold=PAGE,
        prefetch_policy="wait_complete",
        max_requests=8,
        max_context_len=512,
    )
    base.update(changes)
    return TieredKVConfig.flat(**base)


@pytest.fixture
def make_cache(tmp_path):
    caches = []

    def make(**changes) -> TieredKVCache:
        cache = TieredKVCache(make_config(tmp_path, **changes))
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def aligned(n_tokens: int) -> int:
    """Tokens of an ``n_tokens`` prompt that can be cached: whole pages, never the last token."""
    usable = n_tokens - 1
    return usable - usable % PAGE


def make_prompts(gen, lengths, *, shared=()) -> list[list[int]]:
    """Distinct prompts (each starts with its own token) of the given lengths."""
    out = []
    for i, n in enumerate(lengths):
        body = torch.randint(0, 50_000, (n - 1 - len(shared),), generator=gen).tolist()
        out.append([*shared, 1_000_000 + i, *body] if shared else [1_000_000 + i, *body])
    return out


class Model:
    """Random KV per (token prefix, layer), remembered: recomputing a token reproduces it."""

    def __init__(self, cache: TieredKVCache, gen: torch.Generator) -> None:
        self.cache = cache
        self.gen = gen
        c = cache.config.geometry
        self.layers = c.num_layers
        self.dtype = c.torch_dtype
        self.mla = c.model in ("mla", "dsa")
        self.dsa = c.model == "dsa"  # plus an indexer key per token, compared as stored rows
        self.index_dim = c.index_head_dim
        if self.mla:  # one latent per token; V is its first kv_lora_rank columns
            self.k_shape = (c.num_layers, 1, c.kv_lora_rank + c.qk_rope_head_dim)
            self.v_cols = c.kv_lora_rank
            self.v_shape = (c.num_layers, 1, c.kv_lora_rank)
        else:
            self.k_shape = (c.num_layers, c.head_num, c.head_dim)
            self.v_shape = (c.num_layers, c.head_num, c.v_head_dim or c.head_dim)
        self._kv: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The request identity (``begin(extra_key=...)``) whose KV is asked for: the same
        # tokens under another LoRA adapter or cache salt have other KV.
        self.identity: str | bytes | None = None
        # A sliding-window model: window layers' KV counts only inside the window of the next
        # query (a window-aware cache frees the rest; reading it gives the padding slot's).
        self.window = c.sliding_window if c.model == "swa" else None
        self.window_layers = list(c.swa_layer_ids()[1]) if self.window else []

    def _in_window(self, k: torch.Tensor, v: torch.Tensor, end: int):
        """K and V of positions 0..end-1 with window layers' rows before the window of a
        query at ``end`` zeroed (what is compared of them is what a hit needs)."""
        if not self.window or not self.window_layers:
            return k, v
        cut = max(0, end - self.window + 1)
        k, v = k.clone(), v.clone()
        for layer in self.window_layers:
            k[layer, :cut] = 0
            v[layer, :cut] = 0
        return k, v

    def _token(self, prefix: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv.get((self.identity, prefix))
        if kv is None:
            k = torch.randn(self.k_shape, generator=self.gen).to(self.dtype)
            if self.dsa:  # "V" is the indexer key (float), stored quantized
                v = torch.randn(self.layers, self.index_dim, generator=self.gen) * 4
            elif self.mla:
                v = k[..., : self.v_cols]
            else:
                v = torch.randn(self.v_shape, generator=self.gen).to(self.dtype)
            kv = self._kv[(self.identity, prefix)] = (k, v)
        return kv

    def expected(self, tokens, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``tokens[start:end]``: [layers, end - start, heads, dim] (for DSA the
        indexer keys' stored rows in place of V)."""
        k, v = self.produced(tokens, start, end)
        if self.dsa and end > start:
            v = torch.stack([quantize_index_k(v[layer]) for layer in range(self.layers)])
        elif self.dsa:
            v = torch.empty((self.layers, 0, 0))
        return self._in_window(k, v, end) if start == 0 else (k, v)

    def produced(self, tokens, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the model computes for ``tokens[start:end]`` (DSA: raw indexer keys as V)."""
        ks, vs = [], []
        for i in range(start, end):
            k, v = self._token(tuple(tokens[: i + 1]))
            ks.append(k)
            vs.append(v)
        if not ks:
            return (
                torch.empty((self.layers, 0, *self.k_shape[1:]), dtype=self.dtype),
                torch.empty((self.layers, 0, *self.v_shape[1:]), dtype=self.dtype),
            )
        return torch.stack(ks, dim=1), torch.stack(vs, dim=1)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.cache.device_pool
        to_device = getattr(self.cache.allocator, "logical_to_device", None)
        if to_device is not None:  # HiSparse: the request holds logical ids
            slots = to_device[slots.to(torch.int64)]
        if self.dsa:
            k = torch.stack([pool.get_key_buffer(i)[slots] for i in range(self.layers)])
            rows = [pool.get_index_k_with_scale_buffer(i)[slots] for i in range(self.layers)]
            return k, (torch.stack(rows) if len(slots) else torch.empty((self.layers, 0, 0)))
        window = getattr(pool, "layers_mapping", {})

        def at(i: int) -> torch.Tensor:  # a sliding-window pool's window layers: window slots
            if window.get(i, (0, False))[1]:
                return self.cache.allocator.translate_loc_from_full_to_swa(slots.to(torch.int64))
            return slots

        k = torch.stack([pool.get_key_buffer(i)[at(i)] for i in range(self.layers)])
        v = torch.stack([pool.get_value_buffer(i)[at(i)] for i in range(self.layers)])
        return self._in_window(k, v, len(slots))

    def check(self, req, end: int | None = None) -> None:
        """The device holds exactly the model's KV for ``req.tokens[:end]``."""
        end = req.prefix_len if end is None else end
        k, v = self.read(req.slots[:end])
        ek, ev = self.expected(req.tokens, 0, end)
        assert torch.equal(k, ek), f"K differs for {end} tokens (hits {req.hits})"
        assert torch.equal(v, ev), f"V differs for {end} tokens (hits {req.hits})"

    def compute(self, req, tokens) -> torch.Tensor:
        start = len(req.tokens)
        slots = self.cache.extend(req, tokens)
        assert len(slots) == len(tokens)
        self.write(req.tokens, start, len(req.tokens), slots)
        return slots

    def write(self, tokens, start: int, end: int, slots: torch.Tensor) -> None:
        """The model's writes of ``tokens[start:end]`` at ``slots``, every layer."""
        k, v = self.produced(tokens, start, end)
        for layer in range(self.layers):
            self.cache.write_kv(layer, slots, k[layer], None if self.mla else v[layer])
            if self.dsa:
                self.cache.write_index_k(layer, slots, v[layer])

    def begin(self, prompt):
        req = self.cache.begin(prompt, extra_key=self.identity)
        h = req.hits
        assert h.prompt_tokens == len(prompt)
        assert h.device + h.host + h.storage + h.missed == len(prompt), h
        assert min(h.device, h.host, h.storage) >= 0
        assert req.prefix_len == h.device + h.host + h.storage
        assert req.prefix_len % self.cache.config.device.page_size == 0 and h.missed >= 1
        assert req.tokens == list(prompt[: req.prefix_len])
        assert len(req.slots) == req.prefix_len
        row = self.cache.req_to_token.req_to_token[req.row, : req.prefix_len]
        assert torch.equal(row.to(torch.int64), req.slots.to(torch.int64))
        self.check(req)
        return req

    def serve(self, prompt, decode: int = 0, drain: bool = False):
        """One request: begin, check the cached prefix, compute the rest, decode, finish."""
        req = self.begin(prompt)
        self.compute(req, list(prompt[req.prefix_len :]))
        for _ in range(decode):
            tok = int(torch.randint(0, 50_000, (1,), generator=self.gen))
            self.compute(req, [tok])
        self.check(req, len(req.tokens))
        self.cache.finish(req)
        if drain:
            self.cache.drain()
        else:
            self.cache.poll()
        return req


def assert_no_leak(cache: TieredKVCache) -> None:
    cache.drain()
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial
    assert cache.stats()["occupancy"] == {"device_tokens": 0, "host_tokens": 0}


# -- 1. hits from every tier, exact bytes ---------------------------------------------------------
def test_workload_fills_device_host_storage_and_returns(make_cache, gen):
    cache = make_cache(device_tokens=64, host_tokens=160)
    initial = cache.free_sizes()
    assert initial == {"device": 64, "host": 160, "rows": 8}
    model = Model(cache, gen)
    prompts = make_prompts(gen, [37, 53, 29, 41, 47, 33, 45, 39])
    for p in prompts:
        req = model.serve(p, drain=True)  # every page reaches storage before the next
        assert req.hits == RequestHits(len(p), 0, 0, 0, len(p))
    cache.drain()
    st = cache.stats()
    assert st["storage"]["pages"] == sum(aligned(len(p)) for p in prompts) // PAGE
    assert st["evictions"]["device"]["tokens"] > 0
    assert st["evictions"]["host"]["tokens"] > 0

    last, before_last = prompts[-1], prompts[-2]
    # The last prompt is still on the device.
    h = model.serve(last).hits
    assert h.device == aligned(len(last)) and h.host == h.storage == 0
    # The one before was pushed off the device but is still on host.
    h = model.serve(before_last).hits
    assert h.host > 0 and h.storage == 0
    assert h.device + h.host == aligned(len(before_last))
    # The first prompts left device and host long ago: storage.
    for p in prompts[:3]:
        h = model.serve(p).hits
        assert (h.device, h.host, h.storage) == (0, 0, aligned(len(p))), h
        assert h.missed == len(p) - aligned(len(p))
    # Right after: the third is on the device.
    h = model.serve(prompts[2]).hits
    assert h.device == aligned(len(prompts[2]))

    st = cache.stats()
    assert st["transfer"]["storage_to_host"]["bytes"] > 0
    assert st["transfer"]["host_to_device"]["bytes"] > 0
    assert_no_leak(cache)
    assert cache.free_sizes() == initial


@pytest.mark.parametrize(
    "changes",
    [
        dict(host_layout="layer_first", io_backend="kernel"),
        dict(host_layout="layer_first", io_backend="direct", dtype="bfloat16"),
        dict(host_layout="page_first", io_backend="direct"),
        dict(host_layout="page_first", io_backend="kernel", dtype="float16"),
        dict(host_layout="page_first_direct", io_backend="direct"),
        dict(host_layout="page_first_direct", io_backend="kernel", v_head_dim=4),
        dict(model="mla", kv_lora_rank=8, qk_rope_head_dim=4),
        dict(model="mla", kv_lora_rank=8, qk_rope_head_dim=4, host_layout="layer_first"),
        dict(page_size=8, device_policy="s3fifo", host_policy="lfu"),
        dict(page_size=1, device_policy="fifo", host_policy="s3fifo", device_tokens=48),
    ],
    ids=str,
)
def test_round_trip_through_every_tier(make_cache, gen, changes):
    """Every layout, backend, dtype, model kind and page size: prompts go down to storage and
    come back bit for bit."""
    page = changes.get("page_size", PAGE)
    cache = make_cache(**changes)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [37, 30, 45, 26])
    for p in prompts:
        model.serve(p, drain=True)
    cache.clear_tree()
    for p in prompts[:2]:
        h = model.serve(p).hits
        usable = len(p) - 1
        assert h.storage == usable - usable % page, h
    h = model.serve(prompts[1]).hits
    assert h.device == (len(prompts[1]) - 1) // page * page
    assert_no_leak(cache)


def test_host_hits_when_device_is_too_small(make_cache, gen):
    cache = make_cache(device_tokens=64, host_tokens=256, storage_bytes=0)
    assert cache.storage is None
    model = Model(cache, gen)
    a, b = make_prompts(gen, [45, 46])
    model.serve(a)
    model.serve(b)  # needs the device room a holds: a goes to host only
    cache.drain()
    h = model.serve(a).hits
    assert (h.device, h.host, h.storage) == (0, aligned(45), 0), h
    h = model.serve(b).hits
    assert h.host > 0 and h.device + h.host == aligned(46)
    assert_no_leak(cache)


def test_device_hits_when_served_again(make_cache, gen):
    cache = make_cache(device_tokens=128)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [53])
    assert model.serve(a).hits.missed == 53
    for _ in range(2):
        h = model.serve(a).hits
        assert h == RequestHits(53, aligned(53), 0, 0, 53 - aligned(53))
    # A longer prompt sharing the whole of ``a`` hits a's pages on the device.
    longer = a + [7, 8, 9, 10, 11, 12]
    h = model.serve(longer).hits
    assert h.device == aligned(53)
    assert_no_leak(cache)


def test_shared_prefixes_random_mix(make_cache, gen):
    """Prompts sharing system prefixes, served in random order across all tiers: every hit
    reads back exactly the KV first computed for it; nothing leaks."""
    cache = make_cache(device_tokens=64, host_tokens=128)
    model = Model(cache, gen)
    sys_a = torch.randint(0, 50_000, (13,), generator=gen).tolist()
    sys_b = torch.randint(0, 50_000, (22,), generator=gen).tolist()
    lengths = torch.randint(26, 48, (9,), generator=gen).tolist()
    prompts = (
        make_prompts(gen, lengths[:3], shared=sys_a)
        + make_prompts(gen, lengths[3:6], shared=sys_b)
        + make_prompts(gen, lengths[6:])
    )
    tiers = {"device": 0, "host": 0, "storage": 0}
    picks = torch.randint(0, len(prompts), (36,), generator=gen).tolist()
    for i in [*range(len(prompts)), *picks]:  # each at least once, then at random
        p = prompts[i]
        decode = int(torch.randint(0, 6, (1,), generator=gen))
        h = model.serve(p, decode=decode).hits
        for t in tiers:
            tiers[t] += getattr(h, t)
    cache.drain()
    cache.clear_tree()  # and back from storage
    for p in prompts[:4]:
        h = model.serve(p).hits
        assert h.host == 0 and h.storage > 0 and h.missed == len(p) - aligned(len(p)), h
        for t in tiers:
            tiers[t] += getattr(h, t)
    assert all(tiers.values()), tiers
    assert_no_leak(cache)


def test_decoded_tokens_are_cached(make_cache, gen):
    cache = make_cache(device_tokens=128)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [30])
    req = model.serve(a, decode=7)  # 37 tokens: 36 in whole pages go into the tree
    assert len(req.tokens) == 37
    h = model.serve(req.tokens + [5]).hits
    assert h.device == 36
    assert_no_leak(cache)


def test_concurrent_duplicates_free_their_own_slots(make_cache, gen):
    """Two requests computing the same prompt at once: the second finish finds the pages on the
    device and frees its own copies; nothing leaks, the cached copy is exact."""
    cache = make_cache(device_tokens=128)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [41])
    r1 = model.begin(a)
    r2 = model.begin(a)
    assert r1.hits.missed == r2.hits.missed == 41
    model.compute(r1, a)
    model.compute(r2, a)
    assert cache.free_sizes()["device"] == 128 - 2 * 44  # whole pages
    cache.finish(r1)
    cache.finish(r2)
    cache.drain()
    assert cache.free_sizes()["device"] == 128 - 40  # one copy of the 10 whole pages
    assert model.serve(a).hits.device == 40
    assert_no_leak(cache)


def test_extend_waits_for_backups_that_pin_the_device(make_cache, gen, monkeypatch):
    """A device-only node whose host-only child has a storage backup in flight can only leave
    the device once the backup lands: extend waits for it instead of calling the device full."""
    cache = make_cache(device_tokens=64, host_tokens=48)
    model = Model(cache, gen)
    a, b, c = make_prompts(gen, [37, 25, 41])
    model.serve(a, drain=True)  # A: device, host, storage
    model.serve(b, drain=True)  # B's host copy pushes A's out; A stays on the device
    node_a = cache.manager.match_prefix(a[:36], check_storage=False).last_node
    assert node_a.on_device and not node_a.on_host and node_a.in_storage

    release = threading.Event()
    real = cache.storage.batch_set

    def blocked(keys, source, pages):
        release.wait(10)
        return real(keys, source, pages)

    monkeypatch.setattr(cache.storage, "batch_set", blocked)
    req = model.serve(a, decode=3)  # A2, the page after A: device, host, backup blocked
    assert req.hits.device == 36
    cache.device_host.wait()  # device <-> host copies only; the backup stays blocked
    cache.poll()
    assert cache.manager.pending_ops() == 1  # A2's backup
    assert cache.free_sizes()["device"] == 0
    timer = threading.Timer(0.2, release.set)
    timer.start()
    try:
        h = model.serve(c).hits  # needs 44 slots: B and A2 give 28, A only after the backup
    finally:
        release.set()
        timer.join()
    assert h.missed == 41
    assert_no_leak(cache)


def test_many_concurrent_host_loads(make_cache, gen, monkeypatch):
    """More requests loading host hits at once than the layer-done counter has slots, with slow
    copies: begin waits for an old batch instead of raising, and every prefix is exact."""
    cache = make_cache(device_tokens=256, host_tokens=512, storage_bytes=0)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [21, 25, 29, 23, 27, 33])
    for p in prompts:
        model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 30)  # all host-only now
    real = cache.host_pool.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", slow)
    reqs = [cache.begin(p) for p in prompts]  # no read in between: the loads pile up
    assert [r.hits.host for r in reqs] == [aligned(len(p)) for p in prompts]
    for r, p in zip(reqs, prompts, strict=True):
        model.check(r)
        model.compute(r, p[r.prefix_len :])
    for r in reqs:
        cache.finish(r)
    assert_no_leak(cache)


def host_only_prefix_with_failing_loads(make_cache, gen, monkeypatch):
    """A cache (no storage) whose one 21-token prompt is host-only, with host -> device loads
    made to fail. Returns (cache, model, prompt, the real load function)."""
    cache = make_cache(device_tokens=128, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [21])
    model.serve(a)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    real = cache.host_pool.load_to_device_per_layer

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", broken)
    return cache, model, a, real


def test_failed_host_load_is_never_served_later(make_cache, gen, monkeypatch):
    cache, model, a, real = host_only_prefix_with_failing_loads(make_cache, gen, monkeypatch)
    req = cache.begin(a)
    assert req.hits.host == 20
    with pytest.raises(TransferError, match="copy failed"):
        cache.device_pool.get_key_buffer(0)  # the failure surfaces to the model
    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", real)
    cache.finish(req)  # the serving loop gives the request up
    cache.drain()
    model.serve(a)  # whatever tier it comes from now, it must be exact
    assert_no_leak(cache)


def test_failed_load_is_not_matched_while_its_request_holds_it(make_cache, gen, monkeypatch):
    """A second request begun while the first still holds a failed load's device copy must not
    be handed that garbage as its prefix: the stale part is a miss for it."""
    cache, model, a, real = host_only_prefix_with_failing_loads(make_cache, gen, monkeypatch)
    first = cache.begin(a)
    assert first.hits.host == 20
    cache.drain()  # the load's failure is acknowledged: its device copy is stale, still held
    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", real)
    second = model.begin(a)
    assert second.prefix_len == 0 and second.hits.device == 0, second.hits
    model.compute(second, a)
    finish_request(model, second, a)
    cache.finish(first)
    cache.drain()
    model.serve(a)  # exact from whatever tier now holds it
    assert_no_leak(cache)


# -- 3. locked prefixes are never evicted ---------------------------------------------------------
@pytest.mark.parametrize("source", ["device", "host", "storage"])
def test_locked_prefix_survives_eviction_pressure(make_cache, gen, source):
    cache = make_cache(device_tokens=128, host_tokens=192)
    model = Model(cache, gen)
    a, *others = make_prompts(gen, [41, 45, 47, 43, 49, 45, 47, 46, 44, 48, 45])
    model.serve(a)
    cache.drain()
    if source == "host":
        model.serve(others[0])
        model.serve(others[1])  # a is pushed to host
    elif source == "storage":
        cache.clear_tree()
    held = model.begin(a)
    assert getattr(held.hits, source) == aligned(41), held.hits
    model.compute(held, a[held.prefix_len :] + [1, 2, 3, 4, 5])  # 46 tokens held on the device
    before = model.read(held.slots)
    evictions = cache.stats()["evictions"]["device"]["tokens"]
    for p in others * 2:
        model.serve(p)
        now = model.read(held.slots)
        assert torch.equal(now[0], before[0]) and torch.equal(now[1], before[1])
    cache.drain()
    assert cache.stats()["evictions"]["device"]["tokens"] > evictions + 300
    model.check(held, len(held.tokens))
    cache.finish(held)
    h = model.serve(held.tokens + [9]).hits
    assert h.device == 44  # a's pages and the computed ones after them
    assert_no_leak(cache)


# -- 4. prefetch policies -------------------------------------------------------------------------
DELAY = 0.05  # seconds per slowed batch_get call (one page per call)


def stored_then_cleared(make_cache, gen, n_tokens=49, **changes):
    """A cache whose storage holds one prompt that device and host no longer hold."""
    changes.setdefault("storage_batch_pages", 1)
    cache = make_cache(**changes)
    model = Model(cache, gen)
    (p,) = make_prompts(gen, [n_tokens])
    model.serve(p)
    cache.drain()
    cache.clear_tree()
    return cache, model, p


def slow_storage(cache, monkeypatch) -> list[int]:
    calls = []
    real = cache.storage.batch_get

    def batch_get(keys, source, pages):
        calls.append(len(keys))
        time.sleep(DELAY)
        return real(keys, source, pages)

    monkeypatch.setattr(cache.storage, "batch_get", batch_get)
    return calls


def timed_begin(model, prompt):
    t0 = time.perf_counter()
    req = model.cache.begin(prompt)
    return req, time.perf_counter() - t0


def finish_request(model, req, prompt):
    """Check the prefix, compute the rest, finish."""
    model.check(req)
    model.compute(req, prompt[req.prefix_len :])
    model.cache.finish(req)


def test_prefetch_wait_complete_gets_whole_storage_hit(make_cache, gen, monkeypatch):
    cache, model, p = stored_then_cleared(make_cache, gen, prefetch_policy="wait_complete")
    calls = slow_storage(cache, monkeypatch)
    req, elapsed = timed_begin(model, p)
    assert req.hits.storage == aligned(49) == 48
    assert calls == [1] * 12
    assert elapsed >= 12 * DELAY * 0.9
    finish_request(model, req, p)
    assert_no_leak(cache)


def test_prefetch_best_effort_does_not_wait(make_cache, gen, monkeypatch):
    cache, model, p = stored_then_cleared(make_cache, gen, prefetch_policy="best_effort")
    calls = slow_storage(cache, monkeypatch)
    req, elapsed = timed_begin(model, p)
    # At most the batch in progress is waited for (its host slots are about to be reused).
    assert req.hits.storage <= 2 * PAGE
    assert req.hits.storage == len(calls) * PAGE
    assert elapsed < 12 * DELAY / 2
    assert req.hits.missed == 49 - req.hits.storage
    finish_request(model, req, p)
    assert_no_leak(cache)


@pytest.mark.parametrize("per_1k, cap", [(2.0, 5.0), (2.0, 0.12)])
def test_prefetch_timeout_gets_partial_hit(make_cache, gen, monkeypatch, per_1k, cap):
    cache, model, p = stored_then_cleared(
        make_cache,
        gen,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.05,
        prefetch_timeout_per_1k_s=per_1k,
        prefetch_timeout_max_s=cap,
    )
    wait = min(0.05 + per_1k * 48 / 1000, cap)  # 0.146 s, or the cap
    assert cache.config.prefetch_timeout_s(48) == pytest.approx(wait)
    calls = slow_storage(cache, monkeypatch)
    req, elapsed = timed_begin(model, p)
    assert 0 < req.hits.storage < 48, req.hits
    assert req.hits.storage == len(calls) * PAGE  # every page read by the time begin returns
    assert wait * 0.9 <= elapsed < 12 * DELAY
    finish_request(model, req, p)
    assert_no_leak(cache)


@pytest.mark.parametrize(
    "policy, base, per_1k, cap, expected",
    [
        ("timeout", 0.05, 2.0, 5.0, 0.05 + 2.0 * 48 / 1000),
        ("timeout", 0.05, 2.0, 0.1, 0.1),
        ("wait_complete", 0.05, 2.0, 5.0, None),
        ("best_effort", 0.05, 2.0, 5.0, 0.0),
    ],
)
def test_prefetch_wait_per_policy(
    make_cache, gen, monkeypatch, policy, base, per_1k, cap, expected
):
    cache, model, p = stored_then_cleared(
        make_cache,
        gen,
        prefetch_policy=policy,
        prefetch_timeout_base_s=base,
        prefetch_timeout_per_1k_s=per_1k,
        prefetch_timeout_max_s=cap,
    )
    waits = []
    real = cache.manager.prefetcher.finish

    def finish_prefetch(op, timeout_s):
        waits.append(timeout_s)
        return real(op, timeout_s)

    monkeypatch.setattr(cache.manager.prefetcher, "finish", finish_prefetch)
    req = model.cache.begin(p)
    assert len(waits) == 1
    if expected is None:
        assert waits[0] is None
    else:
        assert waits[0] == pytest.approx(expected)
    finish_request(model, req, p)
    assert_no_leak(cache)


@pytest.mark.parametrize("threshold, prefetched", [(52, False), (49, False), (48, True)])
def test_prefetch_threshold(make_cache, gen, threshold, prefetched):
    cache, model, p = stored_then_cleared(make_cache, gen, prefetch_threshold=threshold)
    req = model.begin(p)
    if prefetched:
        assert req.hits.storage == 48
    else:
        assert req.hits.storage == 0 and req.hits.missed == 49
        assert cache.stats()["transfer"]["storage_to_host"]["ops"] == 0
    finish_request(model, req, p)
    assert_no_leak(cache)


# -- 5. storage failures --------------------------------------------------------------------------
def test_raising_store_is_a_miss_and_counted(make_cache, gen, monkeypatch):
    cache, model, p = stored_then_cleared(make_cache, gen)

    def broken(*args, **kwargs):
        raise OSError("the disk went away")

    for name in ("batch_exists", "batch_get", "batch_set", "stats"):
        monkeypatch.setattr(cache.storage, name, broken)
    h = model.serve(p).hits
    assert h.storage == 0 and h.missed == 49
    (q,) = make_prompts(gen, [50])
    for _ in range(3):  # backups of new pages fail too; serving goes on
        model.serve(q)
    cache.drain()
    st = cache.stats()
    assert st["storage"]["errors"] > 0
    assert st["hits"]["storage"] == 0
    cache.clear_tree()
    h = model.serve(q).hits  # not in storage: backups failed
    assert h.storage == 0 and h.missed == 50
    assert_no_leak(cache)


def test_store_failing_mid_prefetch(make_cache, gen, monkeypatch):
    cache, model, p = stored_then_cleared(make_cache, gen)
    real = cache.storage.batch_get
    calls = []

    def flaky(keys, source, pages):
        calls.append(1)
        if len(calls) > 3:
            raise OSError("EIO")
        return real(keys, source, pages)

    monkeypatch.setattr(cache.storage, "batch_get", flaky)
    h = model.serve(p).hits
    assert h.storage == 3 * PAGE  # the pages read before the failure are used
    assert cache.stats()["storage"]["errors"] == 1  # one failed operation, counted once
    assert_no_leak(cache)


def test_removed_storage_directory(make_cache, gen):
    """Removing the store's directory under a running cache: serving goes on, begin never raises,
    and whatever is served is exact."""
    cache, model, p = stored_then_cleared(make_cache, gen)
    prompts = make_prompts(gen, [33, 45, 38])
    shutil.rmtree(cache.config.storage.storage_path)
    for q in [p, *prompts, p]:
        model.serve(q)
    cache.drain()
    cache.clear_tree()
    for q in [p, *prompts]:
        h = model.serve(q).hits
        assert h.storage in (0, aligned(len(q)))
    cache.stats()
    cache.prometheus()
    assert_no_leak(cache)


def _corrupt(store, key: bytes, where: str) -> None:
    """Flip a byte in the middle of ``key``'s stored payload or header, in either layout."""
    if isinstance(store, SlabStorage):
        files = store._files
        entry = files.read(lambda txn: files.books.lookup(txn, key))
        if where == "payload":
            with open(files.slab.path, "r+b") as f:
                f.seek(entry.slot * files.slab.slot_bytes + store.page_nbytes // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x5A]))
            return
        raw = bytearray(entry.raw)
        raw[value_format.HEADER_BYTES // 2] ^= 0x5A
        with store._lock, files.env.begin(write=True) as txn:
            txn.put(key, bytes(raw), db=files.books.headers)
        return
    db = store._pages if where == "payload" else store._headers
    with store._lock, store._env.begin(write=True) as txn:
        raw = bytearray(txn.get(key, db=db))
        raw[len(raw) // 2] ^= 0x5A
        txn.put(key, bytes(raw), db=db)


@pytest.mark.parametrize("layout", ["lmdb", "slab"])
@pytest.mark.parametrize("where", ["payload", "header"])
@pytest.mark.parametrize("page", [0, 2])
def test_corrupted_page_is_a_miss(make_cache, gen, layout, where, page):
    cache, model, p = stored_then_cleared(
        make_cache, gen, storage_batch_pages=32, storage_layout=layout
    )
    store = cache.storage.inner
    keys = page_keys(cache.manager.namespace, p[:48], PAGE)
    _corrupt(store, keys[page], where)
    h = model.serve(p).hits  # model.serve checks every served byte
    assert h.storage == page * PAGE
    assert h.missed == 49 - page * PAGE
    assert cache.stats()["storage"]["checksum_failures"] >= 1
    assert_no_leak(cache)
    h = model.serve(p).hits  # the recomputed pages were stored again
    assert h.storage == 48


# -- 6. write policies ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policy_serves_earlier_prompts(make_cache, gen, policy):
    cache = make_cache(write_policy=policy, selective_hits=2, device_tokens=64, host_tokens=128)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [37, 41, 29, 45, 33, 43, 39])
    once = make_prompts(gen, [35])[0]
    model.serve(once)
    cache.drain()
    st = cache.stats()
    if policy == "write_through":
        assert st["occupancy"]["host_tokens"] == 32 and st["storage"]["pages"] == 8
    else:  # nothing goes down before a second hit / an eviction
        assert st["occupancy"]["host_tokens"] == 0 and st["storage"]["pages"] == 0
    for p in prompts:
        for _ in range(3):  # third serve: the second hit
            model.serve(p)
    cache.drain()
    for p in prompts[:3]:
        h = model.serve(p).hits
        assert h.device + h.host + h.storage == aligned(len(p)), h
        assert h.storage > 0
    h = model.serve(once).hits
    if policy == "write_through_selective":  # never hit: never copied, so it is gone
        assert h.missed == 35
    else:
        assert h.storage == 32
    assert_no_leak(cache)


# -- 2. no leaks, and 8. stats -------------------------------------------------------------------
def test_stats_consistent_with_request_hits(make_cache, gen):
    cache = make_cache()
    model = Model(cache, gen)
    prompts = make_prompts(gen, [37, 53, 29, 41, 47, 33])
    served = []
    for p in [*prompts, *prompts[:3], prompts[2]]:
        served.append(model.serve(p, drain=True).hits)
    cache.drain()
    st = cache.stats()
    assert set(st) >= {"requests", "hits", "transfer", "evictions", "storage", "occupancy"}
    assert st["requests"] == len(served)
    hits = st["hits"]
    assert set(hits) == {"prompt", "device", "host", "storage", "missed"}
    assert hits["prompt"] == sum(h.prompt_tokens for h in served)
    for t in ("device", "host", "storage", "missed"):
        assert hits[t] == sum(getattr(h, t) for h in served), t
    assert hits["device"] + hits["host"] + hits["storage"] + hits["missed"] == hits["prompt"]
    assert hits["storage"] > 0 and hits["device"] > 0
    assert set(st["transfer"]) == {
        "device_to_host",
        "host_to_device",
        "host_to_storage",
        "storage_to_host",
    }
    for d, s in st["transfer"].items():
        assert set(s) == {"bytes", "seconds", "ops", "failed_ops", "gbps"}
        assert s["ops"] > 0 and s["bytes"] > 0 and s["failed_ops"] == 0, d
        assert s["gbps"] == pytest.approx(s["bytes"] / s["seconds"] / 1e9)
    page_bytes = cache.host_pool.page_nbytes
    assert st["transfer"]["storage_to_host"]["bytes"] == hits["storage"] // PAGE * page_bytes
    assert st["transfer"]["host_to_storage"]["bytes"] == st["storage"]["pages"] * page_bytes
    assert set(st["evictions"]) == {"device", "host", "storage"}
    assert st["evictions"]["device"]["tokens"] > 0 and st["evictions"]["host"]["tokens"] > 0
    assert st["storage"] == {
        "checksum_failures": 0,
        "errors": 0,
        "pages": sum(aligned(len(p)) for p in prompts) // PAGE,
        "reopens": 0,
        "turned_off": 0,
        "skipped_while_off": 0,
        "off": 0,
    }
    occ = st["occupancy"]
    assert 0 < occ["device_tokens"] <= 64 and 0 < occ["host_tokens"] <= 160
    got = scrape(cache.prometheus())
    sources = got["tiered_kv_prompt_tokens_total"]
    assert sources[(("source", "storage"),)] == hits["storage"]
    assert sources[(("source", "device"),)] == hits["device"]
    assert got["tiered_kv_requests_total"][()] == len(served)
    assert_no_leak(cache)


# -- 9. bad input ---------------------------------------------------------------------------------
def test_bad_prompts(make_cache):
    cache = make_cache(max_context_len=64)
    for bad in ([], list(range(65)), list(range(1000))):
        with pytest.raises(InvalidArgumentError):
            cache.begin(bad)
    assert cache.free_sizes() == cache._initial  # no row taken
    req = cache.begin(list(range(64)))
    with pytest.raises(InvalidArgumentError):
        cache.extend(req, list(range(65)))  # more than max_context_len
    assert len(req.tokens) == 0
    cache.finish(req)
    assert cache.free_sizes() == cache._initial


def test_finished_request_is_rejected(make_cache, gen):
    cache = make_cache()
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [21])
    req = model.serve(a)
    with pytest.raises(StateError):
        cache.finish(req)
    with pytest.raises(StateError):
        cache.extend(req, [1, 2])
    with pytest.raises(StateError):
        cache.decode(req, 3)
    with pytest.raises(StateError):
        cache.finish("not a request")
    assert_no_leak(cache)


def test_out_of_rows(make_cache, gen):
    cache = make_cache(max_requests=2)
    model = Model(cache, gen)
    a, b, c = make_prompts(gen, [9, 10, 11])
    ra, rb = model.begin(a), model.begin(b)
    with pytest.raises(StateError):
        cache.begin(c)
    assert cache.free_sizes()["rows"] == 0
    model.compute(ra, a)
    cache.finish(ra)
    model.serve(c)  # a row is free again
    model.compute(rb, b)
    cache.finish(rb)
    assert_no_leak(cache)


def test_device_too_small_for_request(make_cache, gen):
    cache = make_cache(device_tokens=64)
    model = Model(cache, gen)
    (big,) = make_prompts(gen, [100])
    held = model.begin(big)
    with pytest.raises(StateError):
        cache.extend(held, big)
    assert len(held.tokens) == 0
    model.compute(held, big[:60])
    cache.finish(held)
    assert_no_leak(cache)


def test_token_ids_must_be_integers(make_cache):
    cache = make_cache()
    for bad in ([1.5, 2.0], ["a", "b"], [1, None]):
        with pytest.raises(InvalidArgumentError):
            cache.begin(bad)
    req = cache.begin(torch.arange(9))  # integer tensors are fine
    assert req.hits.prompt_tokens == 9
    with pytest.raises(InvalidArgumentError):
        cache.extend(req, [0.5])
    cache.finish(req)
    assert cache.free_sizes() == cache._initial


def test_close_is_idempotent_and_final(make_cache, gen):
    cache = make_cache()
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [30])
    model.serve(a)
    live = cache.begin(a)
    cache.close()
    cache.close()
    with pytest.raises(StateError):
        cache.begin(a)
    with pytest.raises(StateError):
        cache.extend(live, [1])
    with pytest.raises(StateError):
        cache.finish(live)


def test_config_type_checked(make_cache):
    with pytest.raises(InvalidArgumentError):
        TieredKVCache({"page_size": 4})


def test_prepare_forward_points_layer_waits_at_an_earlier_request(make_cache, gen, monkeypatch):
    """Two requests begun before either forward: prepare_forward(a) makes the layer waits follow
    a's load, and a's restored bytes are exact even while its load is slowed."""
    cache = make_cache(device_tokens=256, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    a, b = make_prompts(gen, [33, 29])
    for p in (a, b):
        model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    real = cache.host_pool.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", slow)
    ra = cache.begin(a)
    rb = cache.begin(b)
    assert ra.hits.host == aligned(33) and rb.hits.host == aligned(29)
    counter = cache.device_host.layer_done_counter
    assert counter.consumer == rb.load_slot != ra.load_slot
    cache.prepare_forward(ra)
    assert counter.consumer == ra.load_slot
    model.check(ra)  # waits per layer on a's load, not b's
    cache.prepare_forward(rb)
    model.check(rb)
    for r in (ra, rb):
        cache.finish(r)
    with pytest.raises(StateError):
        cache.prepare_forward(ra)
    cache.drain()
    assert_no_leak(cache)


def test_prepare_forward_after_its_load_finished_waits_on_no_other(make_cache, gen, monkeypatch):
    """A request whose load has finished must not wait on the layer slot it had at ``begin``:
    later loads reuse that slot, and a failed one there made this request's valid prefix fail
    its forward (found by the fault campaign). Its waits follow the newest load still in
    flight into its path, or none."""
    cache = make_cache(device_tokens=256, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [25, 29, 23, 27])
    for p in prompts:
        model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    first = model.begin(prompts[0])
    cache.drain()  # its load is done; its slot is free for the next loads
    later = [model.begin(p) for p in prompts[1:3]]
    cache.drain()

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", broken)
    failed = cache.begin(prompts[3])
    assert failed.load_slot == first.load_slot  # three slots: the fourth load reuses the first's
    cache.drain()
    cache.prepare_forward(first)
    model.check(first)  # exact, and no error from the failed load in its old slot
    for r in (first, *later):
        cache.finish(r)
    cache.abort(failed)
    cache.drain()
    assert_no_leak(cache)


def test_a_prefix_shared_with_a_load_in_flight_waits_for_that_load(make_cache, gen, monkeypatch):
    """A request whose device prefix is on the device only because an earlier request is still
    loading it must wait for that load's layers: its load slot is that load's."""
    cache = make_cache(device_tokens=256, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [33])
    model.serve(a)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    real = cache.host_pool.load_to_device_per_layer

    calls = []

    def slow(*args, **kwargs):
        # The first layer's copy holds the load for 0.5 s (enough on a loaded machine for the
        # second begin to find it in flight); the others run at once.
        calls.append(1)
        time.sleep(0.5 if len(calls) == 1 else 0)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", slow)
    first = cache.begin(a)
    second = cache.begin(a)  # the whole prefix is "on the device" already: first's load
    assert first.hits.host == aligned(33) and second.hits.device == aligned(33)
    assert first.load_slot is not None and second.load_slot == first.load_slot
    assert cache.device_host.layer_done_counter.consumer == first.load_slot  # begin pointed it
    model.check(second)  # exact bytes: the reads waited for first's layers
    for r in (second, first):
        cache.finish(r)
    cache.drain()
    assert_no_leak(cache)


def test_begin_gives_back_everything_when_a_load_cannot_be_submitted(make_cache, gen, monkeypatch):
    """A transfer worker that raises on a load (a bug) makes begin raise, with every row, lock
    and slot it took given back; one that refuses (closed) turns the host part into a miss."""
    cache = make_cache(device_tokens=128, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [29])
    model.serve(a)
    cache.drain()
    cache.manager.evict_device(1 << 30)  # a's pages are host-only now
    before = cache.free_sizes()
    real = cache.device_host.submit

    def raising(job):
        raise RuntimeError("worker broke")

    monkeypatch.setattr(cache.device_host, "submit", raising)
    with pytest.raises(RuntimeError, match="worker broke"):
        cache.begin(a)
    cache.drain()
    assert cache.free_sizes() == before
    assert all(n.lock_ref == 0 and n.host_ref == 0 and not n.pending for n in cache.tree.nodes())
    assert not any(n.on_device for n in cache.tree.nodes())
    monkeypatch.setattr(cache.device_host, "submit", lambda job: False)
    req = model.begin(a)
    assert req.prefix_len == 0 and req.hits.host == 0 and req.hits.missed == 29, req.hits
    monkeypatch.setattr(cache.device_host, "submit", real)
    model.compute(req, a)
    finish_request(model, req, a)
    cache.drain()
    assert model.serve(a).hits.device == aligned(29) - aligned(29) % PAGE
    assert_no_leak(cache)


def test_drain_names_what_is_still_in_flight(make_cache, gen, monkeypatch):
    """A backup stuck in the store: drain gives up after its timeout with a StateError naming
    the jobs in flight, and finishes once the store answers."""
    cache = make_cache()
    model = Model(cache, gen)
    release = threading.Event()
    real = cache.storage.batch_set

    def stuck(keys, source, pages):
        release.wait(20)
        return real(keys, source, pages)

    monkeypatch.setattr(cache.storage, "batch_set", stuck)
    (a,) = make_prompts(gen, [21])
    model.serve(a)
    with pytest.raises(StateError, match=r"still in flight .*backup: \d"):
        cache.drain(timeout_s=0.3)
    release.set()
    cache.drain()
    assert cache.manager.pending_ops() == 0
    assert_no_leak(cache)


@pytest.mark.parametrize("storage", [True, False])  # without storage they were accepted
@pytest.mark.parametrize("bad", [[-1], [1 << 32], [5, 7, -3, 9], [2**40]])
def test_token_ids_outside_uint32_are_refused_with_nothing_taken(make_cache, gen, bad, storage):
    cache = make_cache() if storage else make_cache(storage_bytes=0, storage_path=None)
    model = Model(cache, gen)
    (a,) = make_prompts(gen, [13])
    before = cache.free_sizes()
    with pytest.raises(InvalidArgumentError, match="outside 0..4294967295"):
        cache.begin(a[:6] + bad)
    assert cache.free_sizes() == before
    req = model.begin(a)
    slots_before = cache.free_sizes()
    with pytest.raises(InvalidArgumentError, match="outside"):
        cache.extend(req, bad)
    with pytest.raises(InvalidArgumentError, match="outside"):
        cache.decode(req, next(t for t in bad if not 0 <= t < 1 << 32))
    assert cache.free_sizes() == slots_before and len(req.tokens) == req.prefix_len
    model.compute(req, a)
    finish_request(model, req, a)  # still finishes (and inserts) normally
    cache.drain()
    assert_no_leak(cache)


def test_a_request_from_another_cache_is_refused(make_cache, gen):
    one, two = make_cache(), make_cache(storage_path=None, storage_bytes=0)
    (a,) = make_prompts(gen, [13])
    req = one.begin(a)
    before = (one.free_sizes(), two.free_sizes())
    for call in (two.finish, two.abort, two.prepare_forward):
        with pytest.raises(StateError, match="not from this cache"):
            call(req)
    with pytest.raises(StateError, match="not from this cache"):
        two.extend(req, [1, 2])
    assert (one.free_sizes(), two.free_sizes()) == before
    one.abort(req)
    assert one.free_sizes() == one._initial


def test_the_default_prefetch_policy_serves_a_restart_from_storage(tmp_path, gen):
    """A cache built with the default policies over a store another cache filled gets the
    stored prefix (best_effort, the old default, got none of it within one begin)."""
    cfg = make_config(tmp_path)
    defaults = TieredKVConfig.flat(
        **{k: v for k, v in cfg.as_flat().items() if "prefetch" not in k}
    )
    assert defaults.policies.prefetch_policy == "timeout"
    (a,) = make_prompts(gen, [49])
    first = TieredKVCache(defaults.replace(prefetch_threshold=PAGE))
    try:
        model = Model(first, gen)
        model.serve(a)
        first.drain()
    finally:
        first.close()
    again = TieredKVCache(defaults.replace(prefetch_threshold=PAGE))
    try:
        restarted = Model(again, gen)
        restarted._kv = model._kv  # the same KV oracle: what the first process wrote
        h = restarted.serve(a).hits
        assert h.storage == aligned(49), h
    finally:
        again.close()


def test_a_poll_before_the_forward_does_not_hide_a_failed_load(make_cache, gen, monkeypatch):
    """Issue 12: acknowledging a failed host -> device load (a poll between begin and the
    forward) must not let the forward read the half-copied slots without an error."""
    cache, model, a, _ = host_only_prefix_with_failing_loads(make_cache, gen, monkeypatch)
    req = cache.begin(a)
    assert req.hits.host == 20
    cache.drain()
    cache.poll()  # the failure is acknowledged now
    with pytest.raises(TransferError, match="copy failed"):
        cache.device_pool.get_key_buffer(0)  # the forward still hits it
    with pytest.raises(StateError, match="load of this request's prefix failed"):
        cache.prepare_forward(req)
    cache.abort(req)
    monkeypatch.undo()
    (b,) = make_prompts(gen, [17])
    model.serve(b)  # the next request is not hit by the old failure
    model.serve(a)  # and the failed prefix is served exactly from wherever it is now
    cache.drain()
    assert_no_leak(cache)


def test_an_extend_that_cannot_fit_evicts_nothing(make_cache, gen):
    """Issue 12: a request larger than free + every cached page is refused before anything is
    evicted (it used to evict every cached device page, then raise)."""
    cache = make_cache(device_tokens=64, host_tokens=128)
    model = Model(cache, gen)
    a, big = make_prompts(gen, [29, 100])
    model.serve(a)
    cache.drain()
    cached = cache.tree.device_tokens
    assert cached > 0
    before = (cache.free_sizes(), cache.stats()["evictions"])
    held = model.begin(big)
    with pytest.raises(StateError, match="cannot hold 100 more tokens"):
        cache.extend(held, big)
    assert cache.tree.device_tokens == cached and len(held.tokens) == held.prefix_len
    cache.abort(held)
    assert (cache.free_sizes(), cache.stats()["evictions"]) == before
    assert model.serve(a).hits.device == aligned(29)  # still cached
    assert_no_leak(cache)


def test_threads_sharing_a_cache_take_turns(make_cache, gen):
    """Issue 12: several threads calling one cache (device tier only, so no layer waits are
    shared) leave exact counts and an intact tree (it used to corrupt the free counts)."""
    cache = make_cache(device_tokens=256, host_tokens=0, storage_bytes=0)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [13, 21, 29, 17, 25, 33, 9, 41])
    for p in prompts:  # the test's KV oracle is filled first: it is not what is under test
        for i in range(len(p)):
            model._token(tuple(p[: i + 1]))
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                model.serve(rng.choice(prompts))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:1]
    cache.manager.check_integrity()
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial


def test_two_models_with_the_same_kv_shape_never_share_a_page(tmp_path, gen):
    """Issue 12: keys cover the model's identity, so a model (or a fine-tune of it) with the
    same KV shape never reads another's pages from a shared store; the same model does."""
    (a,) = make_prompts(gen, [49])
    base = make_config(tmp_path, model_id="base@rev1")

    def serve(cfg, model=None):
        cache = TieredKVCache(cfg)
        try:
            m = Model(cache, gen)
            if model is not None:
                m._kv = model._kv
            hits = m.serve(a).hits
            cache.drain()
            return hits, m
        finally:
            cache.close()

    first, model = serve(base)
    assert first.storage == 0
    other, _ = serve(base.replace(model_id="finetune@rev1"))
    assert other.storage == 0 and other.missed == 49, other
    same, _ = serve(base, model)
    assert same.storage == aligned(49), same
    with pytest.raises(InvalidArgumentError, match="model_id"):
        base.replace(model_id=None)


def test_run_derives_the_model_identity_from_its_config():
    from tiered_kv.cli.run_cmd import model_identity
    from tiered_kv.engine.model import ModelConfig

    one = model_identity(ModelConfig(hidden=128))
    assert one == model_identity(ModelConfig(hidden=128))
    assert one != model_identity(ModelConfig(hidden=256))  # same KV shape, other weights
    assert one != model_identity(ModelConfig(hidden=128, seed=1))


def test_eviction_releases_its_victims_in_one_free_group(make_cache, gen, monkeypatch):
    """Evicting several nodes returns their device pages with one release (free group), and the
    cache still serves exact bytes and leaks nothing afterwards."""
    cache = make_cache(device_tokens=64, host_tokens=160)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [9, 13, 10, 11])  # four small nodes: 8 + 12 + 8 + 8 tokens
    for p in prompts:
        model.serve(p)
    cache.drain()
    alloc = cache.allocator
    releases, groups = [], []
    release, begin = alloc._release, alloc.free_group_begin
    monkeypatch.setattr(alloc, "_release", lambda ids: releases.append(ids) or release(ids))
    monkeypatch.setattr(alloc, "free_group_begin", lambda: groups.append(1) or begin())
    before = alloc.available_size()
    freed = cache.manager.evict_device(1 << 30)
    assert freed == sum(aligned(len(p)) for p in prompts) == 36
    assert len(groups) == 1 and len(releases) == 1  # one group, one release for four victims
    assert sum(t.numel() for t in releases[0]) == freed // PAGE
    assert alloc.available_size() == before + freed
    monkeypatch.undo()
    for p in prompts:  # now host hits: loaded back and compared byte for byte
        assert model.serve(p).hits.host == aligned(len(p))
    assert_no_leak(cache)

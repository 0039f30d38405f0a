"""A hybrid model (full attention + recurrent layers) through the tiered cache: a prefix is
served only with its KV pages and the recurrent state at its end, from every tier and after a
restart, bit for bit; a missing, failed or corrupted snapshot is a miss, never a wrong state."""

from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.hybrid import HybridModelConfig, TinyHybrid
from tiered_kv.engine.serve import Server
from tiered_kv.errors import InvalidArgumentError

MC = HybridModelConfig(
    num_layers=4, hidden=48, num_heads=4, num_kv_heads=2, head_dim=12, intermediate=96,
    full_layer_every=2, conv_kernel=3, linear_heads=2, linear_key_dim=8, linear_value_dim=12,
    seed=5,
)  # fmt: skip
PS = 8


def config(tmp_path, **over) -> TieredKVConfig:
    fields = dict(
        model="hybrid_linear", num_layers=MC.num_layers, head_num=MC.num_kv_heads,
        head_dim=MC.head_dim, full_layer_every=MC.full_layer_every, conv_kernel=MC.conv_kernel,
        linear_heads=MC.linear_heads, linear_key_dim=MC.linear_key_dim,
        linear_value_dim=MC.linear_value_dim, page_size=PS, device_tokens=320, host_tokens=640,
        max_requests=4, storage_bytes=32 << 20, storage_path=str(tmp_path / "store"),
        model_id="hybrid-test@1", prefetch_threshold=PS, prefetch_policy="wait_complete",
        state_snapshot_every=3,
    )  # fmt: skip
    fields.update(over)
    return TieredKVConfig.flat(**fields)


@pytest.fixture(scope="module")
def model() -> TinyHybrid:
    return TinyHybrid(MC)


def conversation(server: Server, rng: random.Random, users=3, rounds=3, system=None):
    """Users sharing a system prompt, each round's prompt its whole history plus a question."""
    system = system or [rng.randrange(1, 500) for _ in range(3 * PS + 5)]
    history = {u: [] for u in range(users)}
    records = []
    for _ in range(rounds):
        for u in range(users):
            q = [rng.randrange(1, 500) for _ in range(rng.randrange(5, 19))]
            prompt = system + history[u] + q
            out, rec = server.serve(prompt, rng.randrange(1, 7), verify=True)
            history[u] += q + out
            records.append(rec)
    return records, system


def no_leak(cache: TieredKVCache) -> None:
    cache.drain()
    rows = cache.req_to_token
    assert rows.available_size() == cache.config.device.max_requests
    ledger = cache.states.ledger
    held = ledger.device_slots()
    assert len(held) == len(set(held))
    assert rows.mamba_allocator.available_size() + len(held) == rows.mamba_pool.size
    host = ledger.host_slots()
    assert len(host) == len(set(host))
    assert ledger.host.available_size() + len(host) == ledger.host.num_slots
    cache.manager.check_integrity()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "page_first_direct"])
def test_logits_are_bitwise_from_every_tier_and_after_a_restart(tmp_path, model, host_layout):
    rng = random.Random(11)
    totals = {"device": 0, "host": 0, "storage": 0}
    restored = {"device": 0, "host": 0, "storage": 0}
    system = None
    for _ in range(2):  # the second cache opens the first one's store: a restart
        cache = TieredKVCache(config(tmp_path, host_layout=host_layout, device_tokens=160))
        records, system = conversation(Server(model, cache), rng, users=4, system=system)
        assert all(r.bitwise for r in records), [r.max_rel_diff for r in records]
        for tier in totals:
            totals[tier] += sum(getattr(r, tier) for r in records)
        st = cache.stats()["state"]
        for tier in restored:
            restored[tier] += st[f"restored_{tier}"]
        no_leak(cache)
        cache.close()
    assert all(totals.values()), totals
    assert all(restored.values()), restored


def test_requests_sharing_a_prompt_hit_its_snapshot_points(tmp_path, model):
    cache = TieredKVCache(config(tmp_path, state_snapshot_every=3))
    server = Server(model, cache)
    rng = random.Random(3)
    system = [rng.randrange(1, 500) for _ in range(3 * PS + 2)]
    first = system + list(range(30, 42))  # cached to 5 pages: its end is past the branch
    server.serve(first, 2, verify=True)
    _, rec = server.serve(system + [10, 11, 12, 13], 2, verify=True)
    assert rec.bitwise and rec.device == 3 * PS  # the snapshot every 3 pages, not the end
    every_end = TieredKVCache(config(tmp_path / "b", state_snapshot_every=0))
    server = Server(model, every_end)
    server.serve(first, 2, verify=True)
    _, rec = server.serve(system + [10, 11, 12, 13], 2, verify=True)
    assert rec.bitwise and rec.device == 0  # KV cached, but no state at the branch point
    assert every_end.stats()["state"]["trimmed_tokens"] >= 3 * PS
    cache.close()
    every_end.close()


def _flip_one_state_element(cache: TieredKVCache, tier: str) -> None:
    ledger = cache.states.ledger
    (digest, snap), *_ = [(d, s) for d, s in ledger.snaps.items() if getattr(s, tier) is not None]
    if tier == "device":
        temporal = cache.req_to_token.mamba_pool.temporal
        temporal[0, snap.device, 0, 0, 0] += 1.0
    else:
        row = ledger.host.get_page_bytes(snap.host)
        row.view(torch.float32)[-1] += 1.0  # the last temporal element of the last layer
        if not ledger.host.page_bytes_zero_copy:
            ledger.host.set_page_bytes(snap.host, row)


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_flipped_state_element_changes_the_logits(tmp_path, model, tier):
    """The negative control: the verification above can fail. One snapshot, one element."""
    cache = TieredKVCache(config(tmp_path, storage_bytes=0, state_snapshot_every=0))
    server = Server(model, cache)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 500) for _ in range(2 * PS - 1)]
    out, _ = server.serve(prompt, 1, verify=True)  # 2 pages cached, a snapshot at their end
    if tier == "host":
        cache.states.ledger.drop_device(list(cache.states.ledger.snaps))
    _flip_one_state_element(cache, tier)
    _, rec = server.serve(prompt + out + [3, 4, 5], 2, verify=True)
    assert rec.device + rec.host == 2 * PS
    assert rec.bitwise is False and rec.max_rel_diff > 0
    cache.close()


def test_kv_without_its_snapshot_is_a_miss_not_a_wrong_state(tmp_path, model):
    cache = TieredKVCache(config(tmp_path, storage_bytes=0, state_snapshot_every=0))
    server = Server(model, cache)
    rng = random.Random(6)
    prompt = [rng.randrange(1, 500) for _ in range(3 * PS + 1)]
    out, _ = server.serve(prompt, 2, verify=True)
    cache.states.ledger.clear_memory()  # the KV pages stay in the tree, every snapshot goes
    assert cache.tree.device_tokens >= 3 * PS
    _, rec = server.serve(prompt + out + [9, 9], 1, verify=True)
    assert rec.bitwise and rec.device == rec.host == rec.storage == 0
    no_leak(cache)
    cache.close()


class FlakyStore:
    """The state store behind a ledger, failing at random: raising, reporting a page present
    that it then fails to serve, scribbling on the host slot before reporting a miss."""

    def __init__(self, inner, rng: random.Random, rate: float) -> None:
        self.inner, self.rng, self.rate, self.fired = inner, rng, rate, 0

    def _fault(self) -> bool:
        hit = self.rng.random() < self.rate
        self.fired += hit
        return hit

    def batch_exists(self, keys):
        if self._fault():
            raise OSError("injected: exists")
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, source, pages):
        if self._fault():
            for p in pages:  # garbage where the snapshot would go, then a miss
                source.set_page_bytes(
                    p, torch.randint(0, 256, (source.page_nbytes,), dtype=torch.uint8)
                )
            return [False] * len(keys)
        if self._fault():
            raise OSError("injected: get")
        return self.inner.batch_get(keys, source, pages)

    def batch_set(self, keys, source, pages):
        if self._fault():
            raise OSError("injected: set")
        return self.inner.batch_set(keys, source, pages)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_state_faults_are_misses(tmp_path, model, seed):
    """Faults at random in the state store and in state copies, with tiny state pools (so
    snapshots move between tiers all the time): every request's logits stay bitwise."""
    rng = random.Random(seed)
    cfg = config(tmp_path, device_state_slots=7, host_state_slots=4, state_snapshot_every=2)
    copies = {"fired": 0}
    system = None
    for _ in range(2):
        cache = TieredKVCache(cfg)
        ledger = cache.states.ledger
        ledger.store = FlakyStore(ledger.store, rng, 0.2)
        for owner, name in ((ledger.pool, "copy_from"), (ledger.host, "load_to_device"),
                            (ledger.host, "backup_from_device")):  # fmt: skip
            real = getattr(owner, name)

            def flaky(*a, _real=real, **k):
                if rng.random() < 0.1:
                    copies["fired"] += 1
                    raise RuntimeError("injected copy failure")
                return _real(*a, **k)

            setattr(owner, name, flaky)
        records, system = conversation(Server(model, cache), rng, users=3, rounds=3, system=system)
        assert all(r.bitwise for r in records)
        fired = ledger.store.fired
        no_leak(cache)
        cache.close()
        assert fired > 0
    assert copies["fired"] > 0


def test_the_ngram_sibling_rides_along_with_the_state(tmp_path, model):
    cache = TieredKVCache(config(tmp_path, ngram_context_len=6, state_snapshot_every=0))
    server = Server(model, cache)
    ngram = cache.req_to_token.ngram_pool
    rng = random.Random(8)
    prompt = [rng.randrange(1, 500) for _ in range(2 * PS - 1)]
    req = cache.begin(prompt)
    cache.extend(req, prompt[req.prefix_len :])
    history = torch.randint(1, 1000, (6,), dtype=torch.int32)
    ngram.push(req.kv.mamba_pool_idx, history)
    cache.track_state(req, 8)  # no KV forward needed for the sibling's bookkeeping
    cache.extend(req, [1])
    cache.track_state(req, 16)
    expect = ngram.context(torch.tensor([req.kv.mamba_pool_idx])).clone()
    cache.finish(req)
    cache.states.ledger.drop_device(list(cache.states.ledger.snaps))  # host copy only now
    again = cache.begin(prompt + [1, 2])
    assert again.prefix_len == 2 * PS
    got = ngram.context(torch.tensor([again.kv.mamba_pool_idx]))
    assert torch.equal(got, expect)
    cache.abort(again)
    fresh = cache.begin([4, 5, 6])  # a new row never shows another request's sibling rows
    assert torch.equal(
        ngram.context(torch.tensor([fresh.kv.mamba_pool_idx])),
        torch.zeros(1, 6, dtype=torch.int32),
    )
    cache.abort(fresh)
    del server
    cache.close()


def test_track_state_checks_its_position(tmp_path):
    cache = TieredKVCache(config(tmp_path, storage_bytes=0))
    req = cache.begin(list(range(1, 12)))
    cache.extend(req, list(range(1, 12)))
    for bad in (0, 3, 16, True, 8.0):
        with pytest.raises(InvalidArgumentError):
            cache.track_state(req, bad)
    cache.track_state(req, 8)
    cache.abort(req)
    plain = TieredKVCache(TieredKVConfig.flat(host_tokens=0))
    r = plain.begin([1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        plain.track_state(r, 16)
    plain.abort(r)
    plain.close()
    cache.close()


def test_a_state_computed_over_a_failed_load_is_never_kept(tmp_path, model, monkeypatch):
    """Request A's prefix load fails; its forward goes on (over garbage KV) past pages that the
    tree holds without snapshots. Its periodic snapshots there must not be taken: request B
    would restore that state with the tree's good KV and compute wrong logits."""
    cache = TieredKVCache(config(tmp_path, storage_bytes=0, state_snapshot_every=1))
    server = Server(model, cache)
    rng = random.Random(9)
    prompt = [rng.randrange(1, 500) for _ in range(5 * PS + 3)]
    out, _ = server.serve(prompt, 1, verify=True)
    cache.drain()
    cache.manager.evict_device(1 << 30)  # KV and snapshots on the host only
    ledger = cache.states.ledger
    digests = [d for n in cache.tree.nodes() for d in n.digests]
    assert len(digests) == 5
    from tiered_kv.storage.keys import page_digests

    chain = page_digests(prompt[: 5 * PS], PS)
    ledger.drop_host(chain[2:])  # snapshots after page 2 gone; their KV pages stay
    real = cache.host_pool.load_to_device_per_layer

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", broken)
    a = cache.begin(prompt + [1])
    assert a.prefix_len == 2 * PS
    cache.extend(a, (prompt + [1])[a.prefix_len :])
    garbage = cache.req_to_token.mamba_pool.temporal
    for pos in (3 * PS, 4 * PS, 5 * PS):
        garbage[:, a.kv.mamba_pool_idx] = torch.randn_like(garbage[:, a.kv.mamba_pool_idx])
        cache.track_state(a, pos)
    assert all(ledger.held(d) is None for d in chain[2:])
    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", real)
    cache.abort(a)
    _, rec = server.serve(prompt + [2, 3], 1, verify=True)
    assert rec.bitwise and rec.device + rec.host == 2 * PS
    no_leak(cache)
    cache.close()


@pytest.mark.parametrize(
    "extra, overlap, lazy, tracking",
    [
        (False, False, False, 0),
        (True, False, False, 1),
        (True, True, False, 2),
        (True, True, True, 2),
    ],
)
def test_every_tracking_mode_serves_bitwise(tmp_path, model, extra, overlap, lazy, tracking):
    cfg = config(
        tmp_path, storage_bytes=0, state_extra_buffer=extra, state_overlap=overlap,
        state_lazy=lazy, state_snapshot_every=0,
    )  # fmt: skip
    cache = TieredKVCache(cfg)
    records, _ = conversation(Server(model, cache), random.Random(4), users=2, rounds=3)
    assert all(r.bitwise for r in records)
    st = cache.stats()["state"]
    if extra:  # each finished request leaves a snapshot at its cached prefix's end
        assert st["captured"] == len(records) and sum(r.device + r.host for r in records) > 0
    req = cache.begin([1, 2, 3])
    assert len([s for s in req.kv.mamba_tracking if s >= 0]) == (1 if lazy else tracking)
    cache.extend(req, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.track_state(req, PS)
    assert len([s for s in req.kv.mamba_tracking if s >= 0]) == tracking  # lazy: taken now
    cache.abort(req)
    no_leak(cache)
    cache.close()


def test_begin_many_restores_each_requests_state(tmp_path, model):
    """A batch begun together: each request gets the state at its own prefix's end (the same
    bytes a lone begin restores), its KV loads going as one job."""
    cache = TieredKVCache(config(tmp_path, storage_bytes=0, device_tokens=160))
    server = Server(model, cache)
    records, system = conversation(server, random.Random(12), users=3, rounds=2)
    cache.drain()
    cache.manager.evict_device(1 << 30)  # host hits: the batch loads them back
    pool = cache.req_to_token.mamba_pool
    rng = random.Random(13)
    prompts = [system + [rng.randrange(1, 500) for _ in range(3)] for _ in range(2)]
    prompts.append(prompts[0][: len(system)] + [7])

    def state_bytes(req):
        idx = torch.tensor([req.kv.mamba_pool_idx])
        parts = [c[idx] for c in pool.conv] + [pool.temporal[:, idx]]
        return [p.view(torch.uint8).clone() for p in parts], req.prefix_len

    alone = []
    for p in prompts:
        r = cache.begin(p)
        alone.append(state_bytes(r))
        cache.abort(r)
    batch = cache.begin_many(prompts)
    for r, (want, prefix) in zip(batch, alone, strict=True):
        got, got_prefix = state_bytes(r)
        assert got_prefix == prefix
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any(prefix for _, prefix in alone)
    for r in batch:
        cache.abort(r)
    no_leak(cache)
    cache.close()


def test_a_corrupted_stored_snapshot_is_a_miss(tmp_path, model):
    """A restart finds the pages and snapshots in the store; every stored snapshot has one
    flipped byte on disk: each fails its checksum, the prefix is cut back (to nothing, there
    being no other snapshot), and the logits stay bitwise."""
    cfg = config(tmp_path, state_snapshot_every=0)
    cache = TieredKVCache(cfg)
    server = Server(model, cache)
    rng = random.Random(21)
    prompt = [rng.randrange(1, 500) for _ in range(3 * PS + 2)]
    out, _ = server.serve(prompt, 2, verify=True)
    cache.close()
    ns = cache.states.ledger.namespace
    slabs = [p for p in (tmp_path / "store").rglob("*.slab") if ns.fingerprint.hex() in p.name]
    assert len(slabs) == 1, sorted(p.name for p in (tmp_path / "store").rglob("*.slab"))
    data = bytearray(slabs[0].read_bytes())
    slot = cache.states.ledger.host.page_nbytes
    for at in range(0, len(data) - slot + 1, 4096 * (-(-slot // 4096))):
        data[at + slot // 2] ^= 0x5A  # the middle of every slot's value
    slabs[0].write_bytes(bytes(data))
    again = TieredKVCache(cfg)
    _, rec = Server(model, again).serve(prompt + out + [5, 6], 1, verify=True)
    st = again.stats()["state"]
    assert rec.bitwise and rec.storage == rec.device == rec.host == 0
    assert st["store_misses"] >= 1 and st["restored_storage"] == 0
    no_leak(again)
    again.close()

"""Issue 13: several requests' host -> device loads in one layer-wise job (``begin_many``).

Each request's restored prefix is read back through the device pool's buffer getters (which
wait per layer on the batch's one job) and compared bit for bit with the KV the stand-in model
gave it; faults in the merged copy fail every request of the batch, never serve wrong bytes.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.cache.test_facade import (
    LAYERS,
    Model,
    aligned,
    assert_no_leak,
    make_cache,
    make_prompts,
)
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.names import Direction

__all__ = ["make_cache"]  # the fixture, imported for pytest


def host_only(make_cache, gen, lengths, **changes):
    """A cache whose prompts of ``lengths`` are all cached on host only."""
    cache = make_cache(**{"device_tokens": 256, "host_tokens": 512, "storage_bytes": 0, **changes})
    model = Model(cache, gen)
    prompts = make_prompts(gen, lengths)
    for p in prompts:
        model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    return cache, model, prompts


def count_loads(cache, monkeypatch) -> list[int]:
    """Token counts of the load jobs the device <-> host worker is given."""
    sizes: list[int] = []
    real = cache.device_host.submit

    def submit(job):
        if job.direction is Direction.HOST_TO_DEVICE:
            sizes.append(len(job.device_indices))
        return real(job)

    monkeypatch.setattr(cache.device_host, "submit", submit)
    return sizes


def slow_loads(cache, monkeypatch, seconds=0.01) -> None:
    real = cache.host_pool.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", slow)


def finish_all(model, reqs, prompts) -> None:
    for r, p in zip(reqs, prompts, strict=True):
        model.compute(r, p[r.prefix_len :])
        model.check(r, len(r.tokens))
        model.cache.finish(r)


@pytest.mark.parametrize("slow", [False, True])
def test_one_job_loads_every_host_hit_of_the_batch(make_cache, gen, monkeypatch, slow):
    lengths = [21, 34, 17, 29, 41]
    cache, model, prompts = host_only(make_cache, gen, lengths)
    (fresh,) = make_prompts(gen, [23])
    fresh[0] = 2_000_000  # a miss in the same batch
    model.serve(prompts[0])  # and a device hit
    cache.drain()
    if slow:
        slow_loads(cache, monkeypatch)
    loads = count_loads(cache, monkeypatch)
    ops_before = cache.stats()["transfer"]["host_to_device"]["ops"]
    batch = [*prompts, fresh]
    reqs = cache.begin_many(batch)
    assert [r.hits.host for r in reqs] == [0, *map(aligned, lengths[1:]), 0]
    assert reqs[0].hits.device == aligned(21) and reqs[-1].prefix_len == 0
    assert loads == [sum(map(aligned, lengths[1:]))]  # one job for the four host hits
    slots = {r.load_slot for r in reqs[1:-1]}
    assert len(slots) == 1 and None not in slots
    assert cache.device_host.layer_done_counter.consumer in slots
    for r in reqs:
        model.check(r)  # each layer read waits on the one job; exact bytes
    finish_all(model, reqs, batch)
    cache.drain()
    assert cache.stats()["transfer"]["host_to_device"]["ops"] == ops_before + 1
    assert_no_leak(cache)


def test_requests_sharing_a_prefix_in_one_batch(make_cache, gen, monkeypatch):
    """The second of two requests on one host-only prefix finds it on the device, set up by the
    first's part of the batch; both read it once the batch's job lands."""
    cache, model, (a, b) = host_only(make_cache, gen, [33, 25])
    slow_loads(cache, monkeypatch)
    loads = count_loads(cache, monkeypatch)
    longer = a + [7, 8, 9, 10, 11]
    reqs = cache.begin_many([a, b, a, longer])
    h = [r.hits for r in reqs]
    assert h[0].host == aligned(33) and h[1].host == aligned(25)
    assert h[2].device == aligned(33) and h[2].host == 0
    assert h[3].device == aligned(33)  # the rest of longer was never cached
    assert loads == [aligned(33) + aligned(25)]
    assert len({r.load_slot for r in reqs}) == 1
    for r in reversed(reqs):
        model.check(r)
    finish_all(model, reqs, [a, b, a, longer])
    assert_no_leak(cache)


def test_a_failed_batch_load_fails_every_request_in_it(make_cache, gen, monkeypatch):
    cache, model, prompts = host_only(make_cache, gen, [21, 29, 25])
    model.serve(prompts[2])  # on the device again: its request in the batch loads nothing
    cache.drain()
    real = cache.host_pool.load_to_device_per_layer
    calls = []

    def broken(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
        calls.append(layer_id)
        if layer_id == 1:  # layers 0 and 2 land, the job fails
            raise RuntimeError("copy failed")
        return real(pool, host_indices, device_indices, layer_id, io_backend)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", broken)
    reqs = cache.begin_many(prompts)
    cache.drain()
    assert sorted(calls) == [0, 1, 2]  # one job: one copy per layer for both loads
    with pytest.raises(TransferError, match="copy failed"):
        model.check(reqs[0])  # the forward hits the copy's error
    for r in reqs[:2]:
        with pytest.raises(StateError, match="load of this request's prefix failed"):
            cache.prepare_forward(r)
    with pytest.raises(StateError):
        cache.prepare_forward(reqs)
    cache.prepare_forward(reqs[2])  # no load in its path
    model.check(reqs[2])
    for r in reqs[:2]:
        cache.abort(r)
    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", real)
    cache.finish(reqs[2])
    cache.drain()
    for p in prompts:
        model.serve(p)  # exact, from wherever each prefix is now
    assert_no_leak(cache)


def test_a_batch_over_a_load_still_in_flight(make_cache, gen, monkeypatch):
    """A batch whose prefix extends a chain an earlier request is still loading: it waits for
    that load before setting its own part up, and its requests read exact bytes."""
    cache, model, (a,) = host_only(make_cache, gen, [21])
    longer = a[:20] + torch.randint(0, 50_000, (20,), generator=gen).tolist()
    model.serve(longer)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    slow_loads(cache, monkeypatch, 0.02)
    first = cache.begin(a)
    assert first.hits.host == aligned(21)
    (r,) = cache.begin_many([longer])
    assert r.hits.device == aligned(21) and r.hits.host == aligned(40) - aligned(21)
    model.check(r)
    cache.prepare_forward(first)
    model.check(first)
    finish_all(model, [first, r], [a, longer])
    assert_no_leak(cache)


def test_bad_input_changes_nothing(make_cache, gen):
    cache, model, prompts = host_only(make_cache, gen, [21, 25])
    before = cache.free_sizes()
    nodes = [(n.lock_ref, n.host_ref, n.on_device) for n in cache.tree.nodes()]

    def unchanged():
        assert cache.free_sizes() == before
        assert [(n.lock_ref, n.host_ref, n.on_device) for n in cache.tree.nodes()] == nodes
        assert cache.manager.pending_ops() == 0

    for bad, match in [
        ([*prompts, []], "prompt of 0 tokens"),
        ([*prompts, [1] * 600], "prompt of 600 tokens; need 1..512"),
        ([prompts[0], [1, -3]], r"token ids \[-3\] are outside"),
        ([prompts[0], ["x"]], "tokens must be integer ids"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            cache.begin_many(bad)
        unchanged()
    with pytest.raises(StateError, match="9 requests need 9 request rows; 8 of 8 are free"):
        cache.begin_many([prompts[0]] * 9)
    unchanged()
    assert cache.begin_many([]) == []
    with pytest.raises(InvalidArgumentError, match="non-empty list"):
        cache.prepare_forward([])
    reqs = cache.begin_many(prompts)
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


def test_a_refused_batch_turns_its_host_parts_into_misses(make_cache, gen, monkeypatch):
    cache, model, prompts = host_only(make_cache, gen, [21, 29])
    real = cache.device_host.submit
    stats_before = cache.stats()
    hits_before = stats_before["hits"]
    monkeypatch.setattr(cache.device_host, "submit", lambda job: False)
    reqs = cache.begin_many(prompts)
    assert [r.prefix_len for r in reqs] == [0, 0]
    assert [r.hits.missed for r in reqs] == [21, 29]
    stats = cache.stats()  # each request counted once, as the miss it became
    hits = stats["hits"]
    assert stats["requests"] == stats_before["requests"] + 2
    assert hits["host"] == hits_before["host"] and hits["missed"] == hits_before["missed"] + 50
    monkeypatch.setattr(cache.device_host, "submit", real)
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


def test_a_raising_worker_gives_back_everything(make_cache, gen, monkeypatch):
    cache, model, prompts = host_only(make_cache, gen, [21, 29])
    before = cache.free_sizes()

    def raising(job):
        raise RuntimeError("worker broke")

    monkeypatch.setattr(cache.device_host, "submit", raising)
    with pytest.raises(RuntimeError, match="worker broke"):
        cache.begin_many(prompts)
    cache.drain()
    assert cache.free_sizes() == before
    assert all(n.lock_ref == 0 and n.host_ref == 0 and not n.pending for n in cache.tree.nodes())
    assert not cache.manager.load_batch.is_open
    monkeypatch.undo()
    reqs = cache.begin_many(prompts)  # the cache still works
    assert [r.hits.host for r in reqs] == [aligned(21), aligned(29)]
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


def test_random_batches_match_one_by_one_begins(make_cache, gen):
    """Random batches over a random mix of device, host and missing prefixes give every
    request the prefix a one-by-one begin would (same hits), with exact bytes."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    cache, model, prompts = host_only(make_cache, gen, [rng.randint(5, 60) for _ in range(10)])
    for _ in range(12):
        batch = [rng.choice(prompts) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.3:
            batch.append(make_prompts(gen, [rng.randint(3, 40)])[0])
        reqs = cache.begin_many(batch)
        for r, p in zip(reqs, batch, strict=True):
            assert r.tokens == p[: r.prefix_len]
            assert r.hits.device + r.hits.host + r.hits.missed == len(p)
        # A repeat of a prompt in the batch gets what its first occurrence got, all of it on
        # the device (the first one's load, shared): the whole aligned prompt, or nothing where
        # the device had no room left for the first one's host part in this batch (then it was
        # computed, and so is the repeat's).
        first: dict[tuple, object] = {}
        for r, p in zip(reqs, batch, strict=True):
            f = first.setdefault(tuple(p), r)
            if f is not r:
                assert r.hits.device == r.prefix_len == f.prefix_len, (r.hits, f.hits)
                assert r.prefix_len in (0, aligned(len(p))), r.hits
        for r in rng.sample(reqs, len(reqs)):
            model.check(r)
        finish_all(model, reqs, batch)
        cache.drain()
        if rng.random() < 0.5:
            cache.manager.evict_device(rng.randint(8, 200))
    assert_no_leak(cache)


def test_a_load_on_top_of_a_failed_batch_waits_for_it_and_serves_no_garbage(
    make_cache, gen, monkeypatch
):
    """A request whose host-only chain hangs below a chain the batch is still loading waits for
    the batch's job (known to the worker by its merged id) before loading below it; when that
    job failed, the garbage part is not served: the request's prefix stops above it."""
    cache, model, (a, b) = host_only(make_cache, gen, [21, 29])
    longer = a[:20] + torch.randint(0, 50_000, (24,), generator=gen).tolist()
    model.serve(longer)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    real = cache.host_pool.load_to_device_per_layer
    jobs: list[int] = []

    def first_job_fails(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
        if layer_id == 0:
            jobs.append(len(device_indices))
        time.sleep(0.02)
        if len(jobs) == 1 and layer_id == 1:  # wrong rows land, then the error
            real(pool, host_indices.flip(0), device_indices, layer_id, io_backend)
            raise RuntimeError("copy failed")
        return real(pool, host_indices, device_indices, layer_id, io_backend)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", first_job_fails)
    ra, rb = cache.begin_many([a, b])
    assert ra.hits.host == 20 and rb.hits.host == aligned(29)
    r = model.begin(longer)  # checks its prefix bytes exactly
    assert jobs[0] == 20 + aligned(29)
    assert r.prefix_len < 20 or r.hits.host == 0 and r.hits.device == 0, r.hits
    for x in (ra, rb):
        with pytest.raises(StateError, match="load of this request's prefix failed"):
            cache.prepare_forward(x)
        cache.abort(x)
    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", real)
    finish_all(model, [r], [longer])
    cache.drain()
    for p in (a, b, longer):
        model.serve(p)
    assert_no_leak(cache)


def _older_load_fails_while_a_batch_loads(make_cache, gen, monkeypatch):
    """A's prefix is host-only; its load (slowed, then failing) is in flight when a batch
    begins: A2 (A's prefix plus more: a device hit through that load's copies) with B (a host
    hit of its own, a new load)."""
    cache = make_cache(device_tokens=256, host_tokens=256, storage_bytes=0)
    model = Model(cache, gen)
    a, b = make_prompts(gen, [21, 29])
    for p in (a, b):
        model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 30)
    real = cache.host_pool.load_to_device_per_layer
    calls = []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) <= LAYERS:  # every layer of the first load: slow, then garbage
            time.sleep(0.01)
            raise RuntimeError("copy failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "load_to_device_per_layer", first_fails)
    ra = cache.begin(a)
    assert ra.hits.host == 20
    return cache, model, ra, a, b


def test_a_batch_never_reads_through_an_older_failed_load(make_cache, gen, monkeypatch):
    cache, model, ra, a, b = _older_load_fails_while_a_batch_loads(make_cache, gen, monkeypatch)
    a2 = a[:-1] + [5, 6, 7, 8, 9]
    r2, rb = cache.begin_many([a2, b])
    # The failed load was acknowledged before the batch began: A2 does not reach its copies.
    assert r2.hits.device == 0 and rb.hits.host == aligned(29)
    model.check(r2)
    model.check(rb)
    with pytest.raises(StateError, match="failed"):
        cache.prepare_forward(ra)
    cache.abort(ra)
    for r in (r2, rb):
        cache.finish(r)
    cache.drain()
    model.serve(a)
    assert_no_leak(cache)


def test_prepare_forward_of_a_list_sees_an_older_failed_load(make_cache, gen, monkeypatch):
    cache, model, ra, a, b = _older_load_fails_while_a_batch_loads(make_cache, gen, monkeypatch)
    rb = cache.begin(b)  # a newer load, into b's path only
    with pytest.raises(StateError, match="failed"):
        cache.prepare_forward([ra, rb])  # one slot (b's) could not show a's failure
    cache.abort(ra)
    cache.prepare_forward([rb])
    model.check(rb)
    cache.finish(rb)
    cache.drain()
    assert_no_leak(cache)

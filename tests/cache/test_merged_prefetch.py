"""Issue 29: a step's storage reads as one storage job (``begin_many``).

The storage hits of requests begun together are fetched by one segmented storage -> host job:
each request's chain stops at its own first missing page, never at another request's; a page
two requests of one identity share is fetched once and attached once; faults in the store's
reads (raising, or a page whose bytes changed: a checksum miss) are counted misses, never
wrong KV; a timeout or a refused job frees every host slot it took. Every served prefix is
read back through the device pool's buffer getters and compared bit for bit with the KV the
stand-in model gave it.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.cache.test_begin_many import finish_all
from tests.cache.test_facade import (
    PAGE,
    Model,
    _corrupt,
    aligned,
    assert_no_leak,
    make_cache,
    make_prompts,
)
from tiered_kv.names import Direction
from tiered_kv.storage.keys import extra_key_prior, page_keys

__all__ = ["make_cache"]  # the fixture, imported for pytest


def stored_only(make_cache, gen, prompts, identities=None, **changes):
    """A cache whose store holds ``prompts``' pages, with nothing on device or host."""
    base = {"device_tokens": 512, "host_tokens": 512, "storage_batch_pages": 4}
    cache = make_cache(**{**base, **changes})
    model = Model(cache, gen)
    for p, ident in zip(prompts, identities or [None] * len(prompts), strict=True):
        model.identity = ident
        model.serve(p)
    model.identity = None
    cache.drain()
    cache.clear_tree()
    return cache, model


def keys_of(cache, prompt, extra_key=None) -> list[bytes]:
    n = aligned(len(prompt))
    return page_keys(cache.manager.namespace, prompt[:n], PAGE, extra_key_prior(extra_key))


class Watch:
    """The storage -> host jobs the cache submits, the ``batch_get`` calls its worker makes,
    and the ``batch_exists`` calls made once the batch's job was submitted."""

    def __init__(self, cache, monkeypatch) -> None:
        self.jobs: list = []
        self.gets: list[int] = []
        self.exists_after_flush = 0
        self.flushed = False
        worker, store = cache.host_storage, cache.host_storage.storage
        prefetcher = cache.manager.prefetcher
        submit, get, exists, flush = (
            worker.submit,
            store.batch_get,
            store.batch_exists,
            prefetcher.flush,
        )

        def watched_submit(job):
            if job.direction is Direction.STORAGE_TO_HOST:
                self.jobs.append(job)
            return submit(job)

        def watched_get(keys, source, pages):
            self.gets.append(len(keys))
            return get(keys, source, pages)

        def watched_exists(keys):
            self.exists_after_flush += self.flushed
            return exists(keys)

        def watched_flush():
            self.flushed = True
            return flush()

        monkeypatch.setattr(worker, "submit", watched_submit)
        monkeypatch.setattr(store, "batch_get", watched_get)
        monkeypatch.setattr(store, "batch_exists", watched_exists)
        monkeypatch.setattr(prefetcher, "flush", watched_flush)


def holes_before_the_read(cache, monkeypatch, keys: list[bytes]) -> None:
    """Delete ``keys`` from the store after the batch's probes, just before its job is
    submitted (pages another process evicted between the look and the read)."""
    prefetcher = cache.manager.prefetcher
    real = prefetcher.flush

    def flush():
        cache.storage.delete(keys)
        return real()

    monkeypatch.setattr(prefetcher, "flush", flush)


@pytest.mark.parametrize("seed", range(4))
def test_each_request_gets_its_pages_up_to_its_own_first_hole(make_cache, gen, monkeypatch, seed):
    rng = random.Random(seed)
    prompts = make_prompts(gen, [rng.randint(9, 60) for _ in range(6)])
    cache, model = stored_only(make_cache, gen, prompts)
    chains = [keys_of(cache, p) for p in prompts]
    holes = {k for ks in chains for k in ks if rng.random() < 0.15}
    holes_before_the_read(cache, monkeypatch, sorted(holes))
    watch = Watch(cache, monkeypatch)
    reqs = cache.begin_many(prompts)
    for r, ks in zip(reqs, chains, strict=True):
        lead = next((i for i, k in enumerate(ks) if k in holes), len(ks))
        assert r.hits.storage == lead * PAGE, (r.hits, lead)
        assert r.prefix_len == lead * PAGE
        model.check(r)  # exact bytes
    (job,) = watch.jobs  # one storage job for the whole batch
    assert list(job.segments) == [len(ks) for ks in chains]
    pages = sum(len(ks) for ks in chains)
    assert len(watch.gets) <= -(-pages // 4) and watch.exists_after_flush == 0
    cache.manager.check_integrity()
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


def test_one_storage_job_and_one_get_per_batch_without_holes(make_cache, gen, monkeypatch):
    prompts = make_prompts(gen, [17, 33, 13, 25, 41])
    cache, model = stored_only(make_cache, gen, prompts, storage_batch_pages=32)
    watch = Watch(cache, monkeypatch)
    reqs = cache.begin_many(prompts)
    assert [r.hits.storage for r in reqs] == [aligned(len(p)) for p in prompts]
    assert len(watch.jobs) == 1 and len(watch.gets) == 1  # 27 pages, one batch_get
    for r in reqs:
        model.check(r)
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


def test_a_single_request_keeps_its_own_job(make_cache, gen, monkeypatch):
    (p,) = make_prompts(gen, [29])
    cache, model = stored_only(make_cache, gen, [p])
    watch = Watch(cache, monkeypatch)
    (r,) = cache.begin_many([p])
    assert r.hits.storage == aligned(29) and watch.jobs[0].segments == ()
    model.check(r)
    finish_all(model, [r], [p])
    r = model.begin(p)  # begin (one request) as before
    cache.finish(r)
    assert_no_leak(cache)


def test_shared_pages_are_fetched_once_and_attached_once(make_cache, gen, monkeypatch):
    shared = torch.randint(0, 50_000, (20,), generator=gen).tolist()
    a, b, c = make_prompts(gen, [33, 29, 41], shared=shared)
    longer = a + torch.randint(0, 50_000, (12,), generator=gen).tolist()
    prompts = [a, b, a, longer, c, a]
    idents = [None, None, None, None, None, "lora=x@1"]  # the last: another identity
    cache, model = stored_only(make_cache, gen, [a, b, longer, c, a], [None] * 4 + ["lora=x@1"])
    watch = Watch(cache, monkeypatch)
    reqs = cache.begin_many(prompts, extra_keys=idents)
    (job,) = watch.jobs
    assert len(set(job.keys)) == len(job.keys)  # no page fetched twice
    ka, klonger, kx = keys_of(cache, a), keys_of(cache, longer), keys_of(cache, a, "lora=x@1")
    assert set(ka) <= set(job.keys) and set(klonger) <= set(job.keys) and set(kx) <= set(job.keys)
    fetched = len(ka) + len(klonger) - len(ka)  # longer's first pages are a's
    fetched += sum(len(keys_of(cache, p)) - len(shared) // PAGE for p in (b, c)) + len(kx)
    assert len(job.keys) == fetched
    h = [r.hits for r in reqs]
    assert h[0].storage == aligned(33) and h[0].device == 0
    assert h[1].device == len(shared) and h[1].storage == aligned(29) - len(shared)
    assert h[2].device == aligned(33) and h[2].storage == 0  # a again: a's pages, loading
    assert h[3].device == aligned(33) and h[3].storage == aligned(len(longer)) - aligned(33)
    assert h[5].storage == aligned(33) and h[5].device == 0  # its own pages, its own fetch
    cache.manager.check_integrity()  # one node per page: nothing attached twice
    for r, ident in zip(reqs, idents, strict=True):
        model.identity = ident
        model.check(r)
    model.identity = None
    for r, p, ident in zip(reqs, prompts, idents, strict=True):
        model.identity = ident
        model.compute(r, p[r.prefix_len :])
        model.check(r, len(r.tokens))
        cache.finish(r)
    model.identity = None
    assert_no_leak(cache)


def test_a_timeout_keeps_what_arrived_and_frees_the_rest(make_cache, gen, monkeypatch):
    prompts = make_prompts(gen, [41, 37, 45, 33])
    cache, model = stored_only(
        make_cache,
        gen,
        prompts,
        storage_batch_pages=1,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.03,
        prefetch_timeout_per_1k_s=0.0,
        prefetch_timeout_max_s=0.03,
    )
    store = cache.host_storage.storage
    real = store.batch_get

    def slow(keys, source, pages):
        threading.Event().wait(0.004)
        return real(keys, source, pages)

    monkeypatch.setattr(store, "batch_get", slow)
    free_host = cache.free_sizes()["host"]
    reqs = cache.begin_many(prompts)
    got = [r.hits.storage for r in reqs]
    assert sum(got) < sum(aligned(len(p)) for p in prompts)  # cut short by the timeout
    for r in reqs:
        model.check(r)
    # what did not arrive was freed: the host holds exactly the attached pages
    assert cache.free_sizes()["host"] == free_host - cache.tree.host_tokens
    cache.manager.check_integrity()
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


@pytest.mark.parametrize("how", ["refused", "raises"])
def test_a_refused_storage_job_makes_every_storage_part_a_miss(make_cache, gen, monkeypatch, how):
    prompts = make_prompts(gen, [21, 29, 25])
    cache, model = stored_only(make_cache, gen, prompts)
    errors = cache.stats()["storage"]["errors"]

    def submit(job):
        if how == "raises":
            raise OSError("store gone")
        return False

    monkeypatch.setattr(cache.host_storage, "submit", submit)
    reqs = cache.begin_many(prompts)
    assert [r.prefix_len for r in reqs] == [0, 0, 0]
    assert [r.hits.missed for r in reqs] == [len(p) for p in prompts]
    assert cache.stats()["storage"]["errors"] == errors + 1  # one job, one counted error
    cache.manager.check_integrity()
    monkeypatch.undo()
    finish_all(model, reqs, prompts)
    assert_no_leak(cache)


@pytest.mark.parametrize("seed", range(3))
def test_random_read_faults_are_misses_never_wrong_kv(make_cache, gen, monkeypatch, seed):
    """Store reads raise at random or meet a page whose stored bytes changed (the store's
    checksum turns it into a miss); random batches over prompts sharing prefixes are served
    exact KV, every host slot accounted for after every batch."""
    rng = random.Random(seed)
    shared = torch.randint(0, 50_000, (16,), generator=gen).tolist()
    prompts = make_prompts(gen, [rng.randint(9, 50) for _ in range(4)])
    prompts += make_prompts(gen, [rng.randint(20, 50) for _ in range(4)], shared=shared)
    cache, model = stored_only(make_cache, gen, prompts, storage_batch_pages=3)
    store = cache.host_storage.storage
    inner = getattr(cache.storage, "inner", cache.storage)
    real = store.batch_get
    fired = {"raise": 0, "corrupt": 0}

    def faulty(keys, source, pages):
        draw = rng.random()
        if draw < 0.15:
            fired["raise"] += 1
            raise OSError("injected read fault")
        key = rng.choice(list(keys))
        if draw < 0.3 and inner.batch_exists([key]):
            fired["corrupt"] += 1
            _corrupt(inner, key, "payload")
        return real(keys, source, pages)

    monkeypatch.setattr(store, "batch_get", faulty)
    errors0 = cache.stats()["storage"]["errors"]
    for _ in range(8):
        batch = [rng.choice(prompts) for _ in range(rng.randint(2, 6))]
        reqs = cache.begin_many(batch)
        for r, p in zip(reqs, batch, strict=True):
            assert r.tokens == p[: r.prefix_len]
            model.check(r)  # a fault is a shorter prefix, never wrong bytes
        cache.manager.check_integrity()
        finish_all(model, reqs, batch)
        cache.drain()
        cache.manager.check_integrity()
        cache.clear_tree()  # next round from storage again (recomputed pages stored again)
    assert fired["raise"] and fired["corrupt"]
    stats = cache.stats()["storage"]
    assert stats["errors"] > errors0 and stats["checksum_failures"] >= 1  # counted misses
    assert_no_leak(cache)

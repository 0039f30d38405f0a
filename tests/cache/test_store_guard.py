"""The cache's store is guarded: one that keeps failing is reopened (a removed directory comes
back and serves storage hits again) or turned off (every lookup a miss, counted in stats and
Prometheus), and serving goes on with every served byte exact."""

from __future__ import annotations

import shutil

import lmdb

from tests.cache.test_facade import aligned, assert_no_leak, make_prompts, stored_then_cleared
from tests.cache.test_metrics import scrape


def test_removed_directory_is_reopened_and_serves_storage_hits_again(make_cache, gen):
    cache, model, p = stored_then_cleared(make_cache, gen)
    shutil.rmtree(cache.config.storage.storage_path)
    prompts = make_prompts(gen, [33, 45, 38, 41, 29, 37])
    for q in prompts:  # their probes and backups fail until the guard reopens the store
        model.serve(q, drain=True)
    assert cache.stats()["storage"]["reopens"] == 1
    for q in prompts[-3:]:
        model.serve(q, drain=True)  # backed up into the new store
    cache.drain()
    cache.clear_tree()
    for q in prompts[-3:]:
        assert model.serve(q).hits.storage == aligned(len(q))
    assert cache.stats()["storage"]["off"] == 0
    assert_no_leak(cache)


def test_a_store_that_keeps_failing_is_turned_off_and_serving_goes_on(make_cache, gen):
    cache, model, p = stored_then_cleared(make_cache, gen)
    store = cache.storage
    opened = []
    real_open = store._open_store

    def open_corrupted():
        inner = real_open()

        def corrupted(*args):
            raise lmdb.CorruptedError("injected: a corrupted map")

        inner._read = inner._write = corrupted  # reads and writes: either layout fails all
        opened.append(inner)
        return inner

    store._open_store = open_corrupted
    open_corrupted()  # the store in use is corrupted too
    store._inner.close()
    store._inner = opened[-1]
    prompts = make_prompts(gen, [29, 41, 36, 50, 33, 45, 38, 27, 44, 31])
    for q in [p, *prompts, p]:
        h = model.serve(q, drain=True).hits  # model.serve checks every served byte
        assert h.storage == 0
    st = cache.stats()["storage"]
    assert st["turned_off"] == 1 and st["off"] == 1 and st["reopens"] == 1
    assert st["skipped_while_off"] > 0 and st["errors"] >= 2 * store.fail_limit
    got = scrape(cache.prometheus())
    assert got["tiered_kv_storage_turned_off_total"][()] == 1
    assert got["tiered_kv_storage_off"][()] == 1
    assert_no_leak(cache)

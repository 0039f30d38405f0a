"""Copies set up together go as one job: ``finish_many``'s write-through copies to host, the
storage backups one poll starts, and the bytes every tier then serves are exact. A merged
job that fails fails every part (nothing wrong is served later); bad input changes nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.cache.test_facade import Model, aligned, assert_no_leak, make_prompts
from tiered_kv.errors import StateError
from tiered_kv.names import Direction


def counting(worker, monkeypatch) -> dict[Direction, list]:
    """Wrap ``worker.submit``: the jobs it is handed, by direction."""
    seen: dict[Direction, list] = {}
    submit = worker.submit

    def counted(job):
        seen.setdefault(job.direction, []).append(job)
        return submit(job)

    monkeypatch.setattr(worker, "submit", counted)
    return seen


def computed(model: Model, prompts):
    reqs = []
    for p in prompts:
        req = model.begin(p)
        model.compute(req, list(p[req.prefix_len :]))
        reqs.append(req)
    return reqs


def test_finish_many_writes_to_host_and_backs_up_as_one_job_each(make_cache, gen, monkeypatch):
    cache = make_cache(device_tokens=128, host_tokens=256, storage_bytes=64 << 20)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [13, 22, 9, 17])  # 12 + 20 + 8 + 16 tokens in whole pages
    reqs = computed(model, prompts)
    writes = counting(cache.device_host, monkeypatch)
    backups = counting(cache.host_storage, monkeypatch)
    cache.finish_many(reqs)
    (write,) = writes[Direction.DEVICE_TO_HOST]  # one copy for the four requests
    assert len(write.device_indices) == sum(aligned(len(p)) for p in prompts) == 56
    cache.drain()
    (backup,) = backups[Direction.HOST_TO_STORAGE]  # their backups: one storage job
    assert backup.num_pages == 56 // 4
    assert all(r.finished for r in reqs)
    monkeypatch.undo()
    # Host hits are byte-exact (the device copies gone), then storage hits (host gone too).
    cache.manager.evict_device(1 << 30)
    for p in prompts:
        assert model.serve(p, drain=True).hits.host == aligned(len(p))
    cache.clear_tree()
    for p in prompts:
        assert model.serve(p, drain=True).hits.storage == aligned(len(p))
    assert_no_leak(cache)


def test_a_failed_merged_write_serves_nothing_it_did_not_copy(make_cache, gen, monkeypatch):
    cache = make_cache(device_tokens=128, host_tokens=256)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [13, 22, 9])
    reqs = computed(model, prompts)
    host = cache.host_pool
    real = host.backup_from_device_all_layer

    def broken(pool, host_indices, device_indices, io_backend="kernel"):
        real(pool, host_indices[: len(host_indices) // 2], device_indices[: len(host_indices) // 2])
        raise RuntimeError("copy engine fault half way")

    monkeypatch.setattr(host, "backup_from_device_all_layer", broken)
    cache.finish_many(reqs)
    cache.drain()
    monkeypatch.undo()
    assert all(not n.on_host for n in cache.tree.nodes() if n.parent is not None)
    cache.manager.evict_device(1 << 30)  # nothing on the host to hit: every prompt misses
    for p in prompts:
        assert model.serve(p, drain=True).hits.host == 0
    assert_no_leak(cache)


def test_finish_many_refuses_bad_input_and_changes_nothing(make_cache, gen):
    cache = make_cache(device_tokens=128, host_tokens=256)
    model = Model(cache, gen)
    a, b = computed(model, make_prompts(gen, [13, 9]))
    before = (cache.allocator.available_size(), cache.tree.device_tokens)
    with pytest.raises(StateError, match="same request twice"):
        cache.finish_many([a, b, a])
    done = computed(model, make_prompts(gen, [5]))[0]
    cache.finish(done)
    with pytest.raises(StateError, match="finished or not from this cache"):
        cache.finish_many([a, done])
    assert not a.finished and not b.finished
    assert (cache.allocator.available_size(), cache.tree.device_tokens)[1] == before[1] + 4
    assert not cache.manager.write_batch.is_open
    cache.finish_many([a, b])
    cache.finish_many([])
    model.check(model.serve(list(a.tokens) + [1]))
    assert_no_leak(cache)


def test_a_poll_acknowledging_several_writes_backs_them_up_together(make_cache, gen, monkeypatch):
    """Plain ``finish`` one by one: the backups the next poll starts still go as one job."""
    cache = make_cache(device_tokens=128, host_tokens=256, storage_bytes=64 << 20)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [13, 22, 9])
    reqs = computed(model, prompts)
    backups = counting(cache.host_storage, monkeypatch)
    gate, real = threading.Event(), cache.host_pool.backup_from_device_all_layer
    calls = []

    def gated(*args, **kwargs):  # the writes land only once all three are submitted
        assert gate.wait(30)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.host_pool, "backup_from_device_all_layer", gated)
    for r in reqs:
        cache.finish(r)
    gate.set()
    cache.device_host.wait(None)  # every write landed; nothing acknowledged yet
    cache.poll()
    assert len(backups.get(Direction.HOST_TO_STORAGE, [])) == 1 and len(calls) == 3
    cache.drain()
    monkeypatch.undo()
    cache.clear_tree()
    for p in prompts:
        assert model.serve(p, drain=True).hits.storage == aligned(len(p))
    assert torch.is_tensor(reqs[0].slots)
    assert_no_leak(cache)

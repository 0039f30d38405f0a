"""``begin`` with the load planner (``load_planner=True``): the plan is taken before anything
moves, so a declined storage hit starts no prefetch (no storage -> host byte moves) and a
declined host hit no load; a cut inside the host part loads only the pages before it; the
first storage load is a one-page probe, the next hit (the link observed) is loaded whole. Every
request still reads exactly the model's KV (the stand-in model of ``test_facade``), its hits
stay truthful (declined = computed), the declines are counted per tier (``stats()`` and
Prometheus), and nothing leaks. A plan that is not a whole number of pages is refused with
nothing taken."""

from __future__ import annotations

import pytest

from tests.cache.test_facade import (
    Model,
    aligned,
    assert_no_leak,
    finish_request,
    make_prompts,
    stored_then_cleared,
)
from tests.cache.test_metrics import by_label, scrape
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction

GLACIAL_GBPS = 1e-6  # a link so slow that computing anything again is faster


def _moved(cache, direction: str) -> tuple[int, int]:
    """Bytes and ops moved in ``direction`` once every copy begun so far has landed."""
    cache.drain()
    t = cache.stats()["transfer"][direction]
    return t["bytes"], t["ops"]


def _host_only(make_cache, gen, n_tokens=49, **changes):
    """A cache whose host (and storage) holds one prompt the device no longer holds."""
    cache = make_cache(load_planner=True, **changes)
    model = Model(cache, gen)
    (p,) = make_prompts(gen, [n_tokens])
    model.serve(p)
    cache.drain()
    cache.manager.evict_device(1 << 62)
    cache.drain()
    return cache, model, p


def test_a_declined_storage_hit_is_never_fetched_and_the_kv_is_computed(make_cache, gen):
    cache, model, p = stored_then_cleared(
        make_cache, gen, load_planner=True, planner_storage_gbps=GLACIAL_GBPS
    )
    assert _moved(cache, "storage_to_host") == (0, 0)
    req = model.begin(p)  # checks the hit split and the (empty) prefix's KV
    assert (req.hits.storage, req.hits.missed, req.prefix_len) == (0, 49, 0)
    assert _moved(cache, "storage_to_host") == (0, 0)  # no prefetch was started
    assert cache.stats()["planner"] == {
        "planned": 1, "declined_host_tokens": 0, "declined_storage_tokens": aligned(49),
    }  # fmt: skip
    assert cache.stats()["hits"]["missed"] == 49 + 49  # the first serve computed it all too
    finish_request(model, req, p)  # computes every token again, then inserts them
    again = model.begin(p)  # now a device hit: the recomputed KV is the model's, bit for bit
    assert again.hits.device == aligned(49)
    finish_request(model, again, p)
    got = by_label(scrape(cache.prometheus()), "tiered_kv_planner_declined_tokens_total", "tier")
    assert got == {"host": 0.0, "storage": float(aligned(49))}
    assert_no_leak(cache)


def test_a_storage_hit_faster_than_recomputing_is_loaded_after_a_probe(make_cache, gen):
    cache = make_cache(load_planner=True, storage_batch_pages=1)
    model = Model(cache, gen)
    first, second = make_prompts(gen, [49, 49])
    model.serve(first)
    model.serve(second)
    cache.drain()
    cache.clear_tree()
    cache.load_planner.set_compute_cost(lambda tokens, context: 1.0 * tokens)  # a slow engine
    page_bytes = cache.host_pool.page_nbytes
    # The disk is only a prior yet: the first storage load is a one-page probe of it ...
    req = model.begin(first)
    assert req.hits.storage == 4 and _moved(cache, "storage_to_host")[0] == page_bytes
    assert cache.stats()["planner"]["declined_storage_tokens"] == aligned(49) - 4
    finish_request(model, req, first)
    # ... observed through the cache's own measured transfers (the facade's feed), after
    # which a storage hit faster to load than to compute is taken whole.
    req = model.begin(second)
    assert cache.load_planner.links[Direction.STORAGE_TO_HOST].observed_ops >= 1
    assert req.hits.storage == aligned(49) and req.hits.missed == 1
    assert _moved(cache, "storage_to_host")[0] == (1 + aligned(49) // 4) * page_bytes
    finish_request(model, req, second)
    assert cache.load_planner.links[Direction.HOST_TO_DEVICE].observed_ops >= 1
    assert_no_leak(cache)


def test_a_declined_host_hit_is_not_loaded(make_cache, gen):
    cache, model, p = _host_only(make_cache, gen, planner_host_gbps=GLACIAL_GBPS)
    loaded = _moved(cache, "host_to_device")
    req = model.begin(p)
    assert (req.hits.device, req.hits.host, req.hits.missed) == (0, 0, 49)
    assert _moved(cache, "host_to_device") == loaded
    pl = cache.stats()["planner"]
    assert (pl["declined_host_tokens"], pl["declined_storage_tokens"]) == (aligned(49), 0)
    finish_request(model, req, p)
    assert_no_leak(cache)


def test_a_cut_inside_the_host_part_loads_only_the_pages_before_it(make_cache, gen):
    # Loading costs ~0.1 s a token; the first 16 positions are dear to compute, the rest
    # nearly free: the cheapest plan loads 16 tokens (four pages) and computes the rest.
    cache, model, p = _host_only(make_cache, gen, planner_host_gbps=3.84e-6)
    per_token = cache.host_pool.page_nbytes // 4
    assert per_token == 384  # 3 layers x K and V x 2 heads x 8 float32s: 0.1 s at 3840 B/s
    cache.load_planner.set_compute_cost(
        lambda n, ctx: sum(10.0 if i < 16 else 1e-9 for i in range(ctx, ctx + n))
    )
    loaded = _moved(cache, "host_to_device")[0]
    req = model.begin(p)
    assert (req.hits.device, req.hits.host, req.hits.missed) == (0, 16, 33), req.hits
    assert _moved(cache, "host_to_device")[0] - loaded == 16 * per_token
    assert cache.stats()["planner"]["declined_host_tokens"] == aligned(49) - 16
    finish_request(model, req, p)
    cache.load_planner.set_compute_cost(lambda n, ctx: 1e3 * n)  # now everything is loaded
    again = model.begin(p)  # every token's KV checked against the model's
    assert again.hits.device + again.hits.host == aligned(49)
    finish_request(model, again, p)
    assert_no_leak(cache)


@pytest.mark.parametrize("bad", [5, -4, 1000, 4.0, True])
def test_a_plan_that_is_not_whole_pages_of_the_match_is_refused(make_cache, gen, bad):
    cache, model, p = _host_only(make_cache, gen)
    cache.load_planner.plan = lambda match: bad
    rows = cache.free_sizes()["rows"]
    with pytest.raises(InvalidArgumentError, match=r"the load plan returned .* whole number"):
        cache.begin(p)
    assert cache.free_sizes()["rows"] == rows
    del cache.load_planner.plan
    finish_request(model, model.begin(p), p)
    assert_no_leak(cache)


def test_the_planner_is_off_by_default_and_needs_a_host_tier(make_cache):
    assert make_cache().load_planner is None
    assert make_cache(load_planner=True, host_tokens=0, storage_bytes=0).load_planner is None
    planner = make_cache(load_planner=True, planner_storage_gbps=0.5).load_planner
    assert planner.links[Direction.STORAGE_TO_HOST].bytes_per_s == pytest.approx(0.5e9)
    assert planner.estimates()["compute"] == "prior"
    for field, value in (("planner_host_gbps", 0), ("planner_storage_op_s", -1.0)):
        with pytest.raises(InvalidArgumentError, match=f"TieredKVConfig.{field}={value}"):
            make_cache(load_planner=True, **{field: value})

"""The scheduler half's bookkeeping with stand-in vLLM requests: hits stop one token short of
the prompt, loads name the right blocks and pages, a block is saved once in the step it fills,
vLLM's null block is never named, a request's identity splits its pages from another's, and
failed loads are saved again; SchedulerTiers mirrors the worker's host tier over the store."""

from __future__ import annotations

import pytest

from tiered_kv.errors import StateError, StorageOpenError
from tiered_kv.integrations.vllm.block_layout import describe_layers
from tiered_kv.integrations.vllm.metadata import BlockPages, RankReport, TieredKVWorkerMeta
from tiered_kv.integrations.vllm.scheduler_side import SchedulerSide, request_identity
from tiered_kv.integrations.vllm.scheduler_tiers import SchedulerTiers
from tiered_kv.integrations.vllm.settings import read_settings
from tiered_kv.integrations.vllm.tiers import ConnectorTiers

from ._kv import make_caches
from ._sched import (
    Blocks,
    CachedReqs,
    ConnectorOutput,
    FakeTiers,
    Lora,
    NewReq,
    Request,
    SchedulerOutput,
    digests_of,
    tokens,
)

BS = 4


def _side(tiers: FakeTiers, load_async: bool = True):
    owned: dict[str, list[int]] = {}
    return SchedulerSide(BS, load_async, tiers.lookup, lambda r: owned.get(r, [])), owned


def _new(req_id, computed, scheduled):
    return SchedulerOutput(
        scheduled_new_reqs=[NewReq(req_id, computed)], num_scheduled_tokens={req_id: scheduled}
    )


def _cached(req_id, computed, scheduled):
    return SchedulerOutput(
        scheduled_cached_reqs=CachedReqs([req_id], [computed]),
        num_scheduled_tokens={req_id: scheduled},
    )


@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_hit_leaves_the_last_prompt_token_to_vllm(gen, k, extra):
    tiers = FakeTiers()
    side, _ = _side(tiers)
    req = Request("r", tokens(gen, k * BS + extra))
    tiers.store.update(digests_of(req, BS))
    usable = k if extra else k - 1  # a prompt of whole blocks keeps its last block to compute
    got = side.get_num_new_matched_tokens(req, 0)
    assert got == ((usable * BS, True) if usable else (0, False))
    if not usable:
        assert tiers.calls == []


def test_no_hit_is_zero_and_synchronous(gen):
    tiers = FakeTiers()
    side, _ = _side(tiers)
    req = Request("r", tokens(gen, 5 * BS + 2))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert tiers.calls == [digests_of(req, BS)]


@pytest.mark.parametrize("load_async", [True, False])
def test_hits_after_the_device_prefix_and_the_async_flag(gen, load_async):
    tiers = FakeTiers()
    side, _ = _side(tiers, load_async)
    req = Request("r", tokens(gen, 6 * BS + 1))
    d = digests_of(req, BS)
    tiers.host.update(d[:3])
    tiers.store.update(d[3:5])
    assert side.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, load_async)
    assert tiers.calls[-1] == d[2:6]  # only the blocks after vLLM's own prefix
    assert side.hit_sources(req, 3 * BS) == (1 * BS, 2 * BS)
    assert side.get_num_new_matched_tokens(req, 6 * BS) == (0, False)  # nothing left to look up


def test_loads_name_the_allocated_blocks_and_their_pages(gen):
    tiers = FakeTiers()
    side, _ = _side(tiers)
    req = Request("r", tokens(gen, 5 * BS + 2))
    d = digests_of(req, BS)
    tiers.host.update(d[:2])
    tiers.store.update(d[2:4])
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    assert side.hit_sources(req, 4 * BS) == (2 * BS, 2 * BS)
    side.update_state_after_alloc(req, Blocks([7, 3, 9, 12, 5, 11]), 4 * BS)
    meta = side.build_connector_meta(SchedulerOutput())
    assert meta.loads == [BlockPages("r", [7, 3, 9, 12], d[:4])]
    assert meta.saves == []
    assert side.hit_tokens == 4 * BS
    assert side.build_connector_meta(SchedulerOutput()).loads == []  # sent once

    # vLLM may take fewer external tokens than offered: the load is cut to them
    other = Request("o", list(req.all_token_ids))
    assert side.get_num_new_matched_tokens(other, BS) == (3 * BS, True)
    side.update_state_after_alloc(other, Blocks([4, 8, 6, 2, 10]), 2 * BS)
    (load,) = side.build_connector_meta(SchedulerOutput()).loads
    assert load == BlockPages("o", [8, 6], d[1:3])
    side.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)  # no external tokens: no load
    assert side.build_connector_meta(SchedulerOutput()).loads == []


def test_a_block_is_saved_in_the_step_it_fills_and_never_twice(gen):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req = Request("r", tokens(gen, 10))
    d = digests_of(Request("x", req.all_token_ids + [7, 9]), BS)  # after two decode steps
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    owned["r"] = [5, 8, 2]

    def saves(out):
        return side.build_connector_meta(out).saves

    assert saves(_new("r", 0, 6)) == [BlockPages("r", [5], d[:1])]  # a chunk of the prompt
    assert saves(_cached("r", 0, 6)) == []  # the same step again: saved already
    assert saves(_cached("r", 6, 4)) == [BlockPages("r", [8], d[1:2])]
    req.all_token_ids.append(7)  # decode: 11 tokens
    assert saves(_cached("r", 10, 1)) == []
    req.all_token_ids.append(9)  # 12 tokens: the third block fills
    assert saves(_cached("r", 11, 1)) == [BlockPages("r", [2], d[2:3])]
    # speculative drafts scheduled past the accepted tokens never reach a page
    req.all_token_ids.append(3)
    assert saves(_cached("r", 12, 1 + 4)) == []


def test_blocks_the_tiers_held_or_loaded_are_not_saved_again(gen):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req = Request("r", tokens(gen, 4 * BS + 2))
    d = digests_of(req, BS)
    tiers.store.update(d[:3])
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    owned["r"] = [4, 9, 6, 3, 1]
    side.update_state_after_alloc(req, Blocks(owned["r"]), 3 * BS)
    meta = side.build_connector_meta(_new("r", 3 * BS, BS + 2))
    assert meta.loads == [BlockPages("r", [4, 9, 6], d[:3])]
    assert meta.saves == [BlockPages("r", [3], d[3:4])]


def test_the_null_block_is_never_saved_or_loaded(gen):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req = Request("r", tokens(gen, 3 * BS + 1))
    tiers.store.update(digests_of(req, BS)[:2])
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    # vLLM was told 2 blocks are external: a load into the null block can be neither skipped
    # (the request would wait for ever, or read unfilled blocks) nor done; it is refused loudly
    with pytest.raises(StateError, match="null"):
        side.update_state_after_alloc(req, Blocks([0, 5, 6, 7]), 2 * BS)
    # without external tokens nothing is loaded, and the null block is never saved
    side.update_state_after_alloc(req, Blocks([0, 5, 6, 7]), 0)
    owned["r"] = [0, 5, 6, 7]
    metas = [side.build_connector_meta(_new("r", 0, 3 * BS + 1))]
    req.all_token_ids += [1, 2, 3]
    metas.append(side.build_connector_meta(_cached("r", 3 * BS + 1, 3)))
    named = [b for m in metas for bp in m.loads + m.saves for b in bp.blocks]
    assert 0 not in named


def test_identity_beyond_the_tokens_splits_pages(gen):
    toks = tokens(gen, 3 * BS)
    variants = {
        "plain": Request("a", toks),
        "salt-a": Request("b", toks, cache_salt="a"),
        "salt-b": Request("c", toks, cache_salt="b"),
        "lora-1": Request("d", toks, lora_request=Lora("ad", 1, "/lora/ad")),
        "lora-2": Request("e", toks, lora_request=Lora("ad", 2, "/lora/ad")),
        "lora-path": Request("f", toks, lora_request=Lora("ad", 1, "/lora/other")),
        "mm": Request("g", toks, mm_features=[type("F", (), {"identifier": "img-1"})()]),
    }
    got = {}
    for name, req in variants.items():
        side, owned = _side(FakeTiers())
        side.get_num_new_matched_tokens(req, 0)
        owned[req.request_id] = [3, 4, 5]
        (save,) = side.build_connector_meta(_new(req.request_id, 0, 3 * BS)).saves
        assert save.digests == digests_of(req, BS)
        got[name] = save.digests[0]
    assert len(set(got.values())) == len(got)
    assert request_identity(variants["plain"]) is None
    again = Request("h", list(toks), cache_salt="a")
    assert digests_of(again, BS) == digests_of(variants["salt-a"], BS)


def test_prompt_embeds_are_never_looked_up_or_saved(gen):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req = Request("r", tokens(gen, 4 * BS), prompt_embeds=object())
    tiers.store.update(digests_of(req, BS))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert tiers.calls == []
    owned["r"] = [1, 2, 3, 4]
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 2 * BS)
    meta = side.build_connector_meta(_new("r", 0, 4 * BS))
    assert meta.loads == [] and meta.saves == []


def _loaded(gen, side, owned, tiers):
    req = Request("r", tokens(gen, 4 * BS + 2))
    d = digests_of(req, BS)
    tiers.store.update(d)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    owned["r"] = [6, 2, 9, 4, 8]
    side.update_state_after_alloc(req, Blocks(owned["r"]), 4 * BS)
    meta = side.build_connector_meta(_new("r", 4 * BS, 2))
    assert meta.loads == [BlockPages("r", [6, 2, 9, 4], d[:4])] and meta.saves == []
    return req, d


def test_failed_loads_are_saved_again_when_recomputed(gen):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req, d = _loaded(gen, side, owned, tiers)
    side.update_connector_output(ConnectorOutput(invalid_block_ids={9, 77}))
    # vLLM recomputes from the first failed block on
    meta = side.build_connector_meta(_cached("r", 2 * BS, 2 * BS + 2))
    assert meta.saves == [BlockPages("r", [9, 4], d[2:4])]
    assert side.build_connector_meta(_cached("r", 4 * BS + 2, 1)).saves == []


@pytest.mark.parametrize("how", ["received", "preempted", "finished"])
def test_a_done_load_no_longer_takes_failures(gen, how):
    tiers = FakeTiers()
    side, owned = _side(tiers)
    req, d = _loaded(gen, side, owned, tiers)
    if how == "received":
        side.update_connector_output(ConnectorOutput(finished_recving={"r"}))
    elif how == "preempted":
        side.build_connector_meta(SchedulerOutput(preempted_req_ids={"r"}))
    else:
        side.request_finished(req)
    side.update_connector_output(ConnectorOutput(invalid_block_ids={6}))
    assert side.build_connector_meta(_cached("r", 0, 4 * BS + 2)).saves == []


# -- SchedulerTiers ---------------------------------------------------------------------------


def _settings(tmp_path, model="org/tiny@rev1"):
    return read_settings(
        {
            "model_id": model,
            "storage_path": str(tmp_path / "store"),
            "storage_bytes": 64 << 20,
            "host_bytes": 3 * 2 * 2 * BS * 16 * 4,
        }
    )


def test_scheduler_tiers_mirror_the_host_and_read_the_store(tmp_path, gen):
    caches, _ = make_caches("LBHNC", [0, 1], 9, 2, BS, 8, gen)
    layout = describe_layers(caches, 9)
    settings = _settings(tmp_path)
    tiers = ConnectorTiers(settings, layout, rank=None)
    sched = SchedulerTiers(settings)
    try:
        req = Request("r", tokens(gen, 6 * BS))
        d = digests_of(req, BS)
        assert not sched.ready and sched.lookup(d) == (0, 0)

        def report():
            changes = tiers.slots.take_changes()
            return TieredKVWorkerMeta(
                {(None, 0): RankReport(tiers.namespace, layout.page_nbytes, changes)}
            )

        def save(blocks, digests):
            tiers.finish_save(tiers.begin_save(blocks, digests)).result()

        save([1, 2, 3], d[:3])
        sched.apply(report())
        assert sched.ready and sched.namespaces == {(None, 0): tiers.namespace}
        for chain in (d, d[:2], d[1:], d[3:]):
            assert sched.lookup(chain) == tiers.lookup(chain)
        assert sched.lookup(d) == (3, 0)
        save([4, 5, 6], d[3:6])  # replaces the first three on the host; they stay in the store
        sched.apply(report())
        for chain in (d, d[3:], d[2:5]):
            assert sched.lookup(chain) == tiers.lookup(chain)
        assert sched.lookup(d) == (0, 6)
        assert sched.lookup(d[3:]) == (3, 0)
        assert sched.counters.snapshot()["lookups"] >= 8
    finally:
        sched.close()
        tiers.close()


def test_worker_reports_aggregate_by_rank_and_a_rank_must_agree(tmp_path, gen):
    caches, _ = make_caches("LBHNC", [0], 5, 1, BS, 8, gen)
    layout = describe_layers(caches, 5)
    ns = layout.namespace(model="m@1", rank="tp0of2-pp0of1", tenant=None, kv_scales=None)
    ns1 = layout.namespace(model="m@1", rank="tp1of2-pp0of1", tenant=None, kv_scales=None)
    other = layout.namespace(model="m@2", rank="tp0of2-pp0of1", tenant=None, kv_scales=None)
    a = TieredKVWorkerMeta({("r0", 0): RankReport(ns, 64, [(True, b"x" * 32)])})
    b = TieredKVWorkerMeta({("r0", 0): RankReport(ns, 64, [(False, b"x" * 32), (True, b"y" * 32)])})
    c = TieredKVWorkerMeta({("r1", 0): RankReport(ns1, 64, [(True, b"z" * 32)])})
    merged = a.aggregate(b).aggregate(c)
    assert (
        merged.ranks[("r0", 0)].changes == a.ranks[("r0", 0)].changes + b.ranks[("r0", 0)].changes
    )
    assert merged.ranks[("r1", 0)] == c.ranks[("r1", 0)]
    assert list(a.ranks[("r0", 0)].changes) == [(True, b"x" * 32)]  # the inputs stay as they were
    with pytest.raises(ValueError, match="two namespaces"):
        a.aggregate(TieredKVWorkerMeta({("r0", 0): RankReport(other, 64, [])}))
    sched = SchedulerTiers(_settings(tmp_path), world_size=2)
    try:
        sched.apply(merged)
        with pytest.raises(ValueError, match="changed its namespace"):
            sched.apply(TieredKVWorkerMeta({("r1", 0): RankReport(other, 64, [])}))
    finally:
        sched.close()
    sched = SchedulerTiers(_settings(tmp_path))
    bad = layout.namespace(model="m", rank=None, tenant=None, kv_scales=None)
    with pytest.raises(StorageOpenError, match="model"):
        sched.apply(TieredKVWorkerMeta({(None, 0): RankReport(bad, 64, [])}))
    assert not sched.ready


def test_a_page_counts_only_where_every_rank_holds_it(tmp_path, gen):
    """Two ranks' tiers (their shards: one KV head each) over one store: the scheduler waits for
    both reports, and offers a page only where both hold it, host or store, whichever."""
    settings = _settings(tmp_path)
    ranks = {}
    for r in range(2):
        caches, _ = make_caches("LBHNC", [0, 1], 9, 1, BS, 8, gen)
        layout = describe_layers(caches, 9)
        ranks[f"tp{r}of2-pp0of1"] = ConnectorTiers(settings, layout, rank=f"tp{r}of2-pp0of1")
    sched = SchedulerTiers(settings, world_size=2)
    try:
        r0, r1 = ranks.values()
        assert r0.namespace != r1.namespace
        req = Request("r", tokens(gen, 8 * BS))
        d = digests_of(req, BS)

        def report(name):
            t = ranks[name]
            changes = t.slots.take_changes()
            return TieredKVWorkerMeta(
                {(name, 0): RankReport(t.namespace, t.layout.page_nbytes, changes)}
            )

        def save(t, blocks, digests):
            t.finish_save(t.begin_save(blocks, digests)).result()

        save(r0, [1, 2, 3, 4, 5], d[:5])
        save(r1, [1, 2, 3], d[:3])
        first, second = ranks
        sched.apply(report(first))
        assert not sched.ready and sched.lookup(d) == (0, 0)  # rank 1 has not reported
        sched.apply(report(second))
        assert sched.ready and sched.lookup(d) == (3, 0)  # rank 1 lacks pages 3 and 4
        save(r1, [6, 7, 8], d[3:6])  # rank 1's host now evicts nothing yet (3 of its slots)
        merged = report(first).aggregate(report(second))
        sched.apply(merged)
        host, store = sched.lookup(d)
        assert host + store == 5  # rank 0 holds five, rank 1 six
        assert host == min(r0.lookup(d)[0], r1.lookup(d)[0])
        assert sched.lookup(d[5:]) == (0, 0)  # only rank 1 holds page 5: a miss for all
    finally:
        sched.close()
        for t in ranks.values():
            t.close()


def test_hybrid_presence_is_per_rank_and_group(tmp_path, gen):
    """Two pipeline stages: stage 0 holds groups 0 and 1, stage 1 only group 1 (its layers of
    group 0 are elsewhere). A page of group 1 counts only where both stages hold it; a page of
    group 0 only needs stage 0; a group no rank reported is never present."""
    import dataclasses

    settings = _settings(tmp_path)
    tiers = {}
    for rank, groups in (("tp0of1-pp0of2", (0, 1)), ("tp0of1-pp1of2", (1,))):
        for g in groups:
            caches, _ = make_caches("LBHNC", [g + 10 * len(tiers)], 9, 1, BS, 8, gen)
            kind = "vllm-window" if g == 0 else "vllm-attention"
            layout = dataclasses.replace(describe_layers(caches, 9), kind=kind)
            tiers[(rank, g)] = ConnectorTiers(settings, layout, rank=rank, num_slots=3)
    sched = SchedulerTiers(settings, world_size=2)
    try:
        d = digests_of(Request("r", tokens(gen, 6 * BS)), BS)

        def save(key, blocks, digests):
            t = tiers[key]
            t.finish_save(t.begin_save(blocks, digests)).result()

        save(("tp0of1-pp0of2", 0), [1, 2], [d[0], d[2]])
        save(("tp0of1-pp0of2", 1), [1, 2, 3], d[:3])
        save(("tp0of1-pp1of2", 1), [4, 5], [d[0], d[2]])
        reports = {
            key: RankReport(t.namespace, t.layout.page_nbytes, t.slots.take_changes(), key[1])
            for key, t in tiers.items()
        }
        sched.apply(
            TieredKVWorkerMeta({k: v for k, v in reports.items() if k[0].endswith("pp0of2")})
        )
        assert not sched.ready and sched.present(1, d[:3]) == [False] * 3
        sched.apply(
            TieredKVWorkerMeta({k: v for k, v in reports.items() if k[0].endswith("pp1of2")})
        )
        assert sched.ready
        assert sched.present(0, d[:4]) == [True, False, True, False]  # stage 0 alone
        assert sched.present(1, d[:4]) == [True, False, True, False]  # both: d[1] on one only
        assert sched.lookup(d[:4], 1) == (1, 0)
        assert sched.present(2, d[:2]) == [False, False]  # nobody holds a group 2
    finally:
        sched.close()
        for t in tiers.values():
            t.close()

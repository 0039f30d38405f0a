"""Speculative decoding's sizing in the scheduler: each decode step allocates a draft tree
(topk branches with their own copy of the partial page) from the real allocator; the
reserve the sizing derives covers the worst-case tree (a request whose last page holds
page_size - 1 tokens), the draft slots land in the request row's headroom, overlap keeps two
trees at once, and outputs stay the plain greedy decode's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_scheduler import (
    MODEL,
    PAGE,
    assert_bitwise,
    check_pools,
    make_cache,
    random_workload,
)
from tiered_kv.cache import TieredKVCache
from tiered_kv.device.sizing import (
    AllocSizingConfig,
    draft_tree_spans,
    get_alloc_len_per_decode,
    span_pages,
)
from tiered_kv.engine.batch_state import SchedulerConfig
from tiered_kv.engine.draft_tree import DraftTrees
from tiered_kv.engine.scheduler import Scheduler

__all__ = ["make_cache"]  # the fixture, imported for pytest

STEPS, TOPK = 3, 3  # ceil((8 - 1 + 3) / 8) = 2 pages a branch: 48 tokens a step


def sizing(overlap: bool = True, **changes) -> AllocSizingConfig:
    base = dict(
        page_size=PAGE,
        speculative_algorithm="eagle",
        speculative_num_steps=STEPS,
        speculative_eagle_topk=TOPK,
        speculative_num_draft_tokens=7,
        overlap_schedule=overlap,
    )
    base.update(changes)
    return AllocSizingConfig(**base)


@pytest.fixture
def make(make_cache):
    """The scheduler tests' cache with a sizing (a bigger device, shorter rows by default)."""

    def build(sizing_cfg: AllocSizingConfig, **changes) -> TieredKVCache:
        return make_cache(**{"device_tokens": 512, "max_context_len": 256, **changes},
                          sizing=sizing_cfg)  # fmt: skip

    return build


def test_a_tree_at_every_offset_takes_its_pages_and_writes_the_headroom(make):
    cfg = sizing()
    cache = make(cfg)
    trees = DraftTrees(cache)
    length = get_alloc_len_per_decode(cfg)
    assert length == 2 * PAGE * TOPK
    worst = 0
    for n in range(1, 3 * PAGE + 1):
        prompt = [1 + (7 * i + n) % 120 for i in range(n)]
        req = cache.begin(prompt)
        cache.extend(req, prompt[req.prefix_len :])
        before = cache.allocator.available_size()
        assert trees.grow(0, req)
        taken = before - cache.allocator.available_size()
        spans = draft_tree_spans(cfg, n)
        assert taken == sum(span_pages(s, PAGE) for s in spans) * PAGE == trees.held_tokens()
        assert taken <= length
        worst = max(worst, taken)
        # The row's headroom after the committed tokens holds the first draft slots.
        row = cache.req_to_token.req_to_token[req.row]
        drafts = row[n : n + 7]
        assert (drafts > 0).all() and not set(drafts.tolist()) & set(req.slots.tolist())
        trees.release(0)
        assert cache.allocator.available_size() == before
        cache.abort(req)
    assert worst == length  # offset page_size - 1: the reserve is tight


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_holds_two_trees_and_the_reserve_covers_them(make, overlap, monkeypatch):
    cfg = sizing(overlap)
    cache = make(cfg)
    trees = DraftTrees(cache)
    prompt = [5 + i % 90 for i in range(PAGE - 1)]  # the worst offset
    req = cache.begin(prompt)
    cache.extend(req, prompt)
    before = cache.allocator.available_size()
    peak = [0]
    free = cache.allocator.free

    def watched(slots):  # what the trees hold just before each release
        peak[0] = max(peak[0], before - cache.allocator.available_size())
        free(slots)

    monkeypatch.setattr(cache.allocator, "free", watched)
    one = get_alloc_len_per_decode(cfg)  # the worst tree, this offset's
    for _ in range(3):
        assert trees.grow(0, req)
        assert trees.held_tokens() == one  # overlap freed the one before, after this one
        if not overlap:
            trees.release(0)  # verified within the step
    assert peak[0] == (2 if overlap else 1) * one
    assert cache.allocator.request_slot_reserve() == peak[0]
    trees.release(0)
    assert cache.allocator.available_size() == before
    cache.abort(req)


def run_alone(make, cfg: AllocSizingConfig, reserve: int | None = None) -> Scheduler:
    """One request that decodes across several pages, in a device pool sized to exactly what
    admission asks for it (its pages, one page, one slot and the per-request reserve)."""
    prompt = [3 + (5 * i) % 100 for i in range(2 * PAGE - 1)]
    new = 3 * PAGE
    probe = make(cfg)
    r = Scheduler(probe, MODEL, SchedulerConfig(chunk_size=2 * PAGE)).reserve
    r = r if reserve is None else reserve
    paged = -(-len(prompt) // PAGE) * PAGE  # what max_new_tokens_for_memory counts
    tokens = -(-(paged + new + PAGE + 1 + r) // PAGE) * PAGE
    cache = make(cfg, device_tokens=tokens, host_tokens=0)
    sched = Scheduler(
        cache,
        MODEL,
        SchedulerConfig(
            chunk_size=2 * PAGE, max_running=1, record_logits=True, decode_reserve_tokens=reserve
        ),
    )
    sched.add(prompt, new)
    for _ in range(200):
        if not sched.waiting and not sched.running:
            break
        sched.step()
        check_pools(sched)
    return sched


@pytest.mark.parametrize("overlap", [True, False])
def test_the_worst_case_tree_fits_the_derived_reserve(make, overlap):
    sched = run_alone(make, sizing(overlap))
    assert len(sched.finished) == 1
    assert sched.stats.retracted == 0 and sched.stats.overcommits == 0
    assert sched.stats.draft_trees == 3 * PAGE - 2  # after every decode step but the last
    assert_bitwise(sched.finished)


def test_a_reserve_without_the_partial_page_copy_is_too_small(make):
    """The formula without the page_size - 1 term (one page a branch here) leaves a pool that
    cannot hold the tree at the worst offsets: the only request keeps being retracted."""
    cfg = sizing(True)
    short = 2 * (PAGE * TOPK) + PAGE  # two trees of one page a branch, and the token's page
    sched = run_alone(make, cfg, reserve=short)
    assert sched.stats.retracted > 0 or not sched.finished


@pytest.mark.parametrize("seed, overlap", [(11, True), (12, False)])
def test_random_workloads_with_draft_trees_never_overcommit(make, seed, overlap):
    cache = make(sizing(overlap), device_tokens=320, host_tokens=512)
    sched = random_workload(cache, seed, 260, "fcfs", max_running=4, max_new=60)
    assert sched.stats.draft_trees > 100
    assert sched.drafts.held_tokens() == 0
    assert_bitwise(sched.finished)


def test_a_request_at_the_context_limit_drafts_into_the_headroom(make):
    cache = make(sizing(True), max_context_len=40)
    sched = Scheduler(cache, MODEL, SchedulerConfig(chunk_size=16, record_logits=True))
    sched.add([9 + i % 77 for i in range(30)], 10)  # 40 tokens: the whole context
    sched.run_until_done(100)
    check_pools(sched)
    # 10 tokens: the first from the prefill, 9 decode steps, a tree after all but the last
    assert sched.stats.draft_trees == 8 and torch.is_tensor(sched.finished[0].logits[0])
    assert_bitwise(sched.finished)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_gives_back_the_trees(make, overlap):
    """Two long decodes outgrow a small pool with their trees: one is retracted (its trees
    freed with it), resumes from its cached prefix, and both finish bit for bit."""
    cache = make(sizing(overlap), device_tokens=256, host_tokens=512)
    sched = Scheduler(cache, MODEL, SchedulerConfig(chunk_size=32, record_logits=True))
    for k in range(2):
        sched.add([11 + k + (3 * i) % 90 for i in range(20)], 90)
    freed = []
    release = sched.drafts.release
    sched.drafts.release = lambda rid: freed.append(rid) or release(rid)
    sched.step()
    assert len(sched.running) == 2  # both admitted in one step, begun together
    for _ in range(400):
        if not sched.waiting and not sched.running:
            break
        sched.step()
        check_pools(sched)
    assert len(sched.finished) == 2 and sched.stats.retracted > 0
    assert sched.drafts.held_tokens() == 0 and set(freed) == {0, 1}
    assert any(r.resumed_cached for r in sched.finished)
    assert_bitwise(sched.finished)

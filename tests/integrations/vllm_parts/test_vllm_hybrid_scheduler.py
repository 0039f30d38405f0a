"""The hybrid scheduler half (``HybridSchedulerSide``) on stand-ins: the hit is the longest prefix
every group restores exactly, loads fill every real block vLLM allocated, saves skip null blocks
without stalling, recurrent state is saved only from vLLM's boundary offers, and a failed load
makes the request compute everything itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.integrations.vllm_parts._sched import (
    CachedReqs,
    NewReq,
    Request,
    SchedulerOutput,
    digests_of,
    tokens,
)
from tiered_kv.integrations.vllm.groups import GroupGrid, GroupKind, GroupPlan
from tiered_kv.integrations.vllm.scheduler_hybrid import HybridSchedulerSide
from tiered_kv.integrations.vllm.tiers import TierCounters

BS = 32


@dataclass
class GroupBlocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self):
        return tuple(list(x) for x in self.ids)


@dataclass
class BlockState:
    boundary_state_offloads: dict = field(default_factory=dict)


@dataclass
class Output:
    failed_recving: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)


class World:
    """Per group, the pages every rank holds (``have[g]``), and per request its block ids."""

    def __init__(self, *kinds: GroupKind, window: int = 64) -> None:
        plans = [
            GroupPlan(i, k, BS, window if k is GroupKind.WINDOW else 0) for i, k in enumerate(kinds)
        ]
        self.grid = GroupGrid(tuple(plans))
        self.have: dict[int, set[bytes]] = {i: set() for i in range(len(kinds))}
        self.host: dict[int, set[bytes]] = {i: set() for i in range(len(kinds))}
        self.owned: dict[str, tuple[list[int], ...]] = {}
        self.counters = TierCounters()
        self.sched = HybridSchedulerSide(
            self.grid, self.present, self.host_lead, lambda r: self.owned[r], self.counters
        )

    def present(self, group, digests):
        return [d in self.have[group] for d in digests]

    def host_lead(self, group, digests):
        n = 0
        while n < len(digests) and digests[n] in self.host[group]:
            n += 1
        return n


def gemma(gen, blocks=8):
    w = World(GroupKind.WINDOW, GroupKind.FULL)
    req = Request("r", tokens(gen, blocks * BS + 5))
    return w, req, digests_of(req, BS)


def test_a_window_hit_needs_only_the_in_window_pages(gen):
    w, req, d = gemma(gen)
    w.have[1] = set(d[:6])  # full attention: six blocks
    w.have[0] = {d[4], d[5]}  # window: only the last two (W=64: blocks 4, 5 for E=192)
    n, is_async = w.sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (6 * BS, True)
    # vLLM's allocation: window blocks before the window are the null block 0
    w.sched.update_state_after_alloc(
        req, GroupBlocks(([0, 0, 0, 0, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7])), n
    )
    meta = w.sched.build_connector_meta(SchedulerOutput())
    by_group = {ld.group: ld for ld in meta.loads}
    assert by_group[0].blocks == [11, 12] and by_group[0].digests == [d[4], d[5]]
    assert by_group[1].blocks == [1, 2, 3, 4, 5, 6] and by_group[1].digests == d[:6]
    assert w.counters.snapshot()["window_skipped_blocks"] == 4


def test_a_missing_window_page_lowers_the_hit_to_where_the_window_is_whole(gen):
    w, req, d = gemma(gen)
    w.have[1] = set(d[:8])
    w.have[0] = {d[1], d[2], d[3], d[5], d[6]}  # block 4 missing, 7 missing
    # E=256 needs window {6,7}: 7 missing; E=224 needs {5,6}: present
    assert w.sched.get_num_new_matched_tokens(req, 0) == (7 * BS, True)
    w.have[0] = {d[2], d[3]}
    assert w.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    w.have[0] = set()
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # never without its window


def test_state_hits_end_only_where_a_state_was_saved(gen):
    w = World(GroupKind.STATE, GroupKind.FULL)
    req = Request("q", tokens(gen, 10 * BS + 3))
    d = digests_of(req, BS)
    w.have[1] = set(d[:10])
    w.have[0] = {d[2], d[6]}  # states after blocks 2 and 6: hits of 96 or 224 tokens
    assert w.sched.get_num_new_matched_tokens(req, 0) == (7 * BS, True)
    ids = ([0] * 6 + [21, 22], list(range(1, 9)))
    w.sched.update_state_after_alloc(req, GroupBlocks(ids), 7 * BS)
    meta = w.sched.build_connector_meta(SchedulerOutput())
    loads = {ld.group: ld for ld in meta.loads}
    assert loads[0].blocks == [21] and loads[0].digests == [d[6]]
    assert loads[1].blocks == list(range(1, 8))
    w.have[1] = set(d[:5])  # the attention prefix now ends before the later state
    req2 = Request("q2", list(req.all_token_ids))
    assert w.sched.get_num_new_matched_tokens(req2, 0) == (3 * BS, True)


def test_a_local_hit_is_extended_not_repeated(gen):
    w, req, d = gemma(gen)
    w.have[1], w.have[0] = set(d[:8]), set(d[:8])
    assert w.sched.get_num_new_matched_tokens(req, 2 * BS) == (6 * BS, True)
    ids = ([0, 0, 0, 0, 0, 0, 31, 32, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    w.sched.update_state_after_alloc(req, GroupBlocks(ids), 6 * BS)
    loads = {ld.group: ld for ld in w.sched.build_connector_meta(SchedulerOutput()).loads}
    assert loads[1].blocks == [3, 4, 5, 6, 7, 8] and loads[1].digests == d[2:8]
    assert loads[0].blocks == [31, 32] and loads[0].digests == d[6:8]


def test_an_allocation_without_a_needed_block_is_sent_doomed_not_raised(gen):
    w, req, d = gemma(gen)
    w.have[1], w.have[0] = set(d[:6]), set(d[:6])
    n, _ = w.sched.get_num_new_matched_tokens(req, 0)
    w.sched.update_state_after_alloc(req, GroupBlocks(([0] * 7, list(range(1, 8)))), n)
    meta = w.sched.build_connector_meta(SchedulerOutput())
    assert meta.doomed == ["r"] and meta.loads == []


def test_saves_skip_null_blocks_without_stalling(gen):
    w, req, d = gemma(gen)
    w.owned["r"] = ([0, 0, 0, 14, 15, 16, 17, 18], [1, 2, 3, 4, 5, 6, 7, 8])
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    out = SchedulerOutput([NewReq("r", 0)], num_scheduled_tokens={"r": 5 * BS + 7})
    saves = {s.group: s for s in w.sched.build_connector_meta(out).saves}
    assert saves[0].blocks == [14, 15] and saves[0].digests == [d[3], d[4]]
    assert saves[1].blocks == [1, 2, 3, 4, 5] and saves[1].digests == d[:5]
    out = SchedulerOutput(
        scheduled_cached_reqs=CachedReqs(["r"], [5 * BS + 7]),
        num_scheduled_tokens={"r": 3 * BS - 7},
    )
    saves = {s.group: s for s in w.sched.build_connector_meta(out).saves}
    assert saves[0].blocks == [16, 17, 18] and saves[1].blocks == [6, 7, 8]
    assert saves[0].digests == d[5:8]


def test_state_is_saved_only_from_valid_boundary_offers(gen):
    w = World(GroupKind.STATE, GroupKind.FULL)
    req = Request("q", tokens(gen, 6 * BS + 1))
    d = digests_of(req, BS)
    w.owned["q"] = ([0] * 7, list(range(1, 8)))
    w.sched.get_num_new_matched_tokens(req, 0)
    offers = {
        "q": [(0, 40, 2 * BS), (0, 0, 3 * BS), (0, 41, 2 * BS + 5), (1, 42, 4 * BS), (0, 43, 0)],
        "unknown": [(0, 44, BS)],
    }
    out = SchedulerOutput(num_scheduled_tokens={})
    out.kv_connector_block_state = BlockState(offers)
    meta = w.sched.build_connector_meta(out)
    assert [(s.group, s.blocks, s.digests) for s in meta.state_saves] == [(0, [40], [d[1]])]


def test_a_failed_load_gets_no_hit_again_and_saves_anew(gen):
    w, req, d = gemma(gen)
    w.have[1], w.have[0] = set(d[:8]), set(d[:8])
    n, _ = w.sched.get_num_new_matched_tokens(req, 0)
    assert n == 8 * BS
    w.sched.update_connector_output(Output(failed_recving={"r"}, finished_recving={"r"}))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert w.counters.snapshot()["failed_load_requests"] == 1
    w.owned["r"] = ([9] * 9, list(range(1, 10)))
    out = SchedulerOutput([NewReq("r", 0)], num_scheduled_tokens={"r": 2 * BS})
    saves = {s.group: s for s in w.sched.build_connector_meta(out).saves}
    assert saves[1].digests == d[:2]


@pytest.mark.parametrize("seed", range(4))
def test_random_worlds_never_offer_a_page_any_group_lacks(seed):
    """Random presence per group: whatever hit is offered, every page its loads name is held."""
    g = torch.Generator().manual_seed(seed)
    w = World(GroupKind.WINDOW, GroupKind.FULL, GroupKind.STATE, window=80)
    req = Request("x", tokens(g, 12 * BS + 9))
    d = digests_of(req, BS)
    for grp in range(3):
        w.have[grp] = {x for x in d if torch.rand(1, generator=g).item() < 0.8}
    local = int(torch.randint(0, 3, (1,), generator=g)) * BS
    n, _ = w.sched.get_num_new_matched_tokens(req, local)
    if n == 0:
        return
    end = local + n
    ids = tuple(
        [
            0 if b not in set(p.needed(local, end)) else 100 * (p.index + 1) + b
            for b in range(end // BS)
        ]
        for p in w.grid.groups
    )
    w.sched.update_state_after_alloc(req, GroupBlocks(ids), n)
    meta = w.sched.build_connector_meta(SchedulerOutput())
    assert not meta.doomed
    for ld in meta.loads:
        assert all(x in w.have[ld.group] for x in ld.digests)
    full = next(ld for ld in meta.loads if ld.group == 1)
    assert full.digests == d[local // BS : end // BS]

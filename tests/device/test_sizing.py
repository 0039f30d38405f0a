"""Sizing helpers against hand-computed values of the SGLang-derived formulas."""

from __future__ import annotations

import dataclasses

import pytest

from tiered_kv.device.sizing import (
    AllocSizingConfig,
    draft_tree_spans,
    get_alloc_len_per_decode,
    get_alloc_page_size,
    get_alloc_reserve_per_decode,
    get_req_to_token_extra_context_len,
    request_row_width,
    resolve_sizing,
    span_pages,
)
from tiered_kv.errors import InvalidArgumentError, TieredKVError


def _cfg(algo=None, page=1, dcp=1, steps=None, topk=None, draft=None) -> AllocSizingConfig:
    return AllocSizingConfig(
        page_size=page,
        attn_dcp_size=dcp,
        speculative_algorithm=algo,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=draft,
    )


@pytest.mark.parametrize(
    "page, dcp, expected",
    [(1, 1, 1), (16, 1, 16), (16, 4, 64), (1, 8, 8), (64, 2, 128), (7, 3, 21)],
)
def test_alloc_page_size_is_page_size_times_dcp(page, dcp, expected):
    assert get_alloc_page_size(_cfg(page=page, dcp=dcp)) == expected


@pytest.mark.parametrize("page, dcp", [(1, 1), (16, 1), (64, 4), (3, 5)])
@pytest.mark.parametrize("draft", [None, 8])
def test_without_speculative_decoding(page, dcp, draft):
    # Draft settings without an algorithm are ignored.
    cfg = _cfg(
        page=page, dcp=dcp, steps=3 if draft else None, topk=4 if draft else None, draft=draft
    )
    assert get_alloc_len_per_decode(cfg) == 1
    assert get_alloc_reserve_per_decode(cfg) == 2
    assert get_req_to_token_extra_context_len(cfg) == 4


# (config, len_per_decode, reserve_per_decode, extra_context_len), each computed by hand.
CASES = {
    # page 1: max(steps * topk, draft) = max(12, 8); extra = 4 + 8.
    "eagle_p1_topk4": (_cfg("eagle", 1, 1, 3, 4, 8), 12, 24, 12),
    # topk 1: max(5 * 1, 6) = 6; page 1 so extra = 4 + 6.
    "eagle_p1_topk1": (_cfg("eagle", 1, 1, 5, 1, 6), 6, 12, 10),
    # topk 1 with pages: max(3, 4) = 4; extra = max(4 + 4, 8 + 16 - 1) = 23.
    "eagle_p16_topk1": (_cfg("eagle", 16, 1, 3, 1, 4), 4, 8, 23),
    # ceil((16 - 1 + 3) / 16) = 2 -> 2 * 16 * 4 = 128; extra = max(12, 256 + 15) = 271.
    "eagle_p16_topk4": (_cfg("eagle", 16, 1, 3, 4, 8), 128, 256, 271),
    # Upper case names are accepted (normalised to lower case): same as above.
    "EAGLE_p16_topk4": (_cfg("EAGLE", 16, 1, 3, 4, 8), 128, 256, 271),
    # ceil((64 - 1 + 2) / 64) = 2 -> 2 * 64 * 2 = 256 > 16; extra = max(20, 512 + 63) = 575.
    "eagle3_p64_topk2": (_cfg("eagle3", 64, 1, 2, 2, 16), 256, 512, 575),
    # ceil((4 - 1 + 7) / 4) = ceil(10 / 4) = 3 -> 3 * 4 * 3 = 36; extra = max(14, 72 + 3) = 75.
    "standalone_p4_topk3": (_cfg("standalone", 4, 1, 7, 3, 10), 36, 72, 75),
    # ceil(16 / 16) = 1 -> 1 * 16 * 2 = 32 < 200 draft; extra = max(204, 400 + 15) = 415.
    "eagle_p16_draft_dominates": (_cfg("eagle", 16, 1, 1, 2, 200), 200, 400, 415),
    # dcp: alloc page = 2 * 4 = 8; ceil((7 + 3) / 8) = 2 -> 2 * 8 * 2 = 32;
    # extra = max(4 + 5, 64 + 8 - 1) = 71.
    "eagle_p2_dcp4_topk2": (_cfg("eagle", 2, 4, 3, 2, 5), 32, 64, 71),
    # page 1 but dcp 3 makes the alloc page 3: ceil((2 + 4) / 3) = 2 -> 2 * 3 * 2 = 12;
    # extra = max(4 + 6, 24 + 2) = 26.
    "eagle_p1_dcp3_topk2": (_cfg("eagle", 1, 3, 4, 2, 6), 12, 24, 26),
    # steps/topk default to 1: max(1, 8) = 8; extra = 4 + 8.
    "eagle_defaults": (_cfg("eagle", 1, 1, None, None, 8), 8, 16, 12),
    # ngram writes no draft KV tree: max(3 * 4, 8) = 12 even with pages and topk > 1;
    # extra = max(12, 24 + 15) = 39.
    "ngram_p16_topk4": (_cfg("ngram", 16, 1, 3, 4, 8), 12, 24, 39),
    # ngram page 1: max(2 * 3, 10) = 10; extra = 4 + 10.
    "ngram_p1": (_cfg("ngram", 1, 1, 2, 3, 10), 10, 20, 14),
    # uno: draft + 1 = 9; page 1 but uno so extra = max(4 + 8, 18 + 1 - 1) = 18.
    "uno_p1": (_cfg("uno", 1, 1, None, None, 8), 9, 18, 18),
    # uno ignores steps/topk: 8 + 1 = 9; extra = max(12, 18 + 15) = 33.
    "uno_p16": (_cfg("uno", 16, 1, 3, 4, 8), 9, 18, 33),
    # uno with dcp: alloc page 4 * 2 = 8; len 3 + 1 = 4; extra = max(7, 8 + 7) = 15.
    "uno_p4_dcp2": (_cfg("uno", 4, 2, None, None, 3), 4, 8, 15),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_speculative_sizing_matches_hand_computed_values(case):
    cfg, length, reserve, extra = CASES[case]
    assert get_alloc_len_per_decode(cfg) == length
    assert get_alloc_reserve_per_decode(cfg) == reserve
    assert reserve == 2 * length
    assert get_req_to_token_extra_context_len(cfg) == extra


def test_algorithm_name_is_normalised_to_lower_case():
    assert _cfg("Eagle3", 1, 1, 1, 1, 2).speculative_algorithm == "eagle3"


@pytest.mark.parametrize("page", [1, 16])
def test_uno_without_num_draft_tokens_raises(page):
    cfg = _cfg("uno", page, 1, 3, 2, None)
    before = dataclasses.asdict(cfg)
    for fn in (
        get_alloc_len_per_decode,
        get_alloc_reserve_per_decode,
        get_req_to_token_extra_context_len,
    ):
        with pytest.raises(InvalidArgumentError) as ei:
            fn(cfg)
        assert "uno" in str(ei.value) and "speculative_num_draft_tokens" in str(ei.value)
    assert dataclasses.asdict(cfg) == before


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"page_size": 0}, ["page_size", "0"]),
        ({"page_size": -16}, ["page_size", "-16"]),
        ({"page_size": 1.5}, ["page_size", "1.5"]),
        ({"page_size": True}, ["page_size", "True"]),
        ({"attn_dcp_size": -1}, ["attn_dcp_size", "-1"]),
        ({"attn_dcp_size": 0}, ["attn_dcp_size", "0"]),
        ({"speculative_algorithm": "foo"}, ["speculative_algorithm", "'foo'"]),
        ({"speculative_algorithm": "medusa"}, ["speculative_algorithm", "'medusa'"]),
        ({"speculative_num_steps": 0}, ["speculative_num_steps", "0"]),
        ({"speculative_eagle_topk": -2}, ["speculative_eagle_topk", "-2"]),
        ({"speculative_num_draft_tokens": 0}, ["speculative_num_draft_tokens", "0"]),
        ({"speculative_num_draft_tokens": "8"}, ["speculative_num_draft_tokens", "'8'"]),
    ],
)
def test_invalid_config_raises_naming_the_field(kwargs, needles):
    with pytest.raises(InvalidArgumentError) as ei:
        AllocSizingConfig(**kwargs)
    assert isinstance(ei.value, TieredKVError) and isinstance(ei.value, ValueError)
    for needle in needles:
        assert needle in str(ei.value)


def test_config_is_frozen():
    cfg = _cfg("eagle", 16, 1, 3, 4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 32  # type: ignore[misc]
    assert cfg.page_size == 16
    assert get_alloc_len_per_decode(cfg) == 128


def test_non_string_algorithm_is_refused():
    with pytest.raises(InvalidArgumentError, match="speculative_algorithm=5"):
        AllocSizingConfig(speculative_algorithm=5)


# -- overlap, the draft tree's spans, the allocators' and the cache's use of a sizing -----------
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_reserve_is_one_step_without_overlap(case):
    cfg = dataclasses.replace(CASES[case][0], overlap_schedule=False)
    assert get_alloc_reserve_per_decode(cfg) == get_alloc_len_per_decode(cfg)


def test_overlap_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="overlap_schedule=1"):
        AllocSizingConfig(overlap_schedule=1)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_draft_tree_never_takes_more_than_one_step_allocates(case):
    """Every offset in the last page, and every length up to a few pages: the tree's new pages
    fit one step's allocation, and the worst offset takes all of it where the tree is the
    bound (a paged draft tree with topk > 1 whose draft tokens do not dominate)."""
    cfg = CASES[case][0]
    page = get_alloc_page_size(cfg)
    length = get_alloc_len_per_decode(cfg)
    worst = 0
    for seq_len in range(0, 3 * page + 2):
        spans = draft_tree_spans(cfg, seq_len)
        assert spans and all(end > max(start, seq_len - 1) for start, end in spans)
        pages = sum(span_pages(s, page) for s in spans)
        assert pages * page <= -(-length // page) * page  # what the scheduler reserves, paged
        tree = cfg.speculative_algorithm in ("eagle", "eagle3", "standalone")
        if tree and page > 1 and (cfg.speculative_eagle_topk or 1) > 1:
            assert len(spans) == cfg.speculative_eagle_topk
            assert all(start % page == 0 and start <= seq_len for start, _ in spans)
            assert pages * page <= length
            worst = max(worst, pages * page)
        else:
            assert spans == [(seq_len, seq_len + length)]
    if case in ("eagle_p16_topk4", "eagle3_p64_topk2", "standalone_p4_topk3"):
        assert worst == length  # the formula is tight: offset page - 1 takes all of it


def test_no_draft_tree_without_speculative_decoding():
    assert draft_tree_spans(_cfg(page=16), 37) == []
    with pytest.raises(InvalidArgumentError, match="seq_len=-1"):
        draft_tree_spans(_cfg("eagle", 16, 1, 3, 4, 8), -1)


def test_request_row_width_adds_the_headroom():
    assert request_row_width(_cfg(page=16), 100) == 104
    assert request_row_width(_cfg("eagle", 16, 1, 3, 4, 8), 100) == 371


def test_a_sizing_for_other_pages_is_refused_everywhere():
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator

    with pytest.raises(InvalidArgumentError, match="8 tokens per allocation page.*16"):
        resolve_sizing(_cfg(page=8), 16)
    with pytest.raises(InvalidArgumentError, match="allocator's page_size is 16"):
        PagedTokenToKVPoolAllocator(64, 16, None, "cpu", sizing=_cfg(page=4))
    # decode context parallelism: 4 ranks' pages of 4 are one allocation page of 16
    alloc = PagedTokenToKVPoolAllocator(64, 16, None, "cpu", sizing=_cfg("eagle", 4, 4, 3, 2, 8))
    assert alloc.request_slot_reserve() == 2 * 16 * 2 * 2  # ceil((15 + 3) / 16) = 2 pages
    with pytest.raises(InvalidArgumentError, match="TieredKVConfig.sizing"):
        TieredKVConfig.flat(page_size=16, sizing=_cfg(page=16, dcp=2))
    with pytest.raises(InvalidArgumentError, match="AllocSizingConfig or None"):
        TieredKVConfig.flat(sizing={"page_size": 16})

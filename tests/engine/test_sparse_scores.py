"""IndexerScores: a request's scores equal scoring every key afresh whether its pages came from
the cross-request cache or not (a shared prefix, a later turn, a prefix cut mid-page); the kept
selection is torch.topk's set at every step; the cache stays within its bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_sparse_run import _cfg
from tiered_kv.device.dsa_pool import quantize_index_k
from tiered_kv.engine.sparse_run import hisparse_config
from tiered_kv.engine.sparse_scores import IndexerScores
from tiered_kv.engine.synthetic_kv import SyntheticKV, token_digests
from tiered_kv.errors import InvalidArgumentError

PS = 16  # the tiny config's page size


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("scores"), page_size=PS)
    return SyntheticKV(hisparse_config(cfg, str(tmp_path_factory.mktemp("store"))))


def _fresh(kv, digests, end) -> np.ndarray:
    """Every key of positions 0..end-1 scored at once, no cache."""
    s = IndexerScores(kv, 8, PS, page_cache_bytes=0)
    memo = s.memo(list(digests))
    s.score_upto(memo, end)
    return memo.scores[:, :end]


def test_cached_pages_score_what_a_fresh_scoring_does(kv):
    gen = np.random.default_rng(5)
    shared = gen.integers(0, 50_000, 3 * PS + 5).tolist()
    a = shared + gen.integers(0, 50_000, 40).tolist()
    b = shared + gen.integers(0, 50_000, 29).tolist()  # the same first 3 pages
    scores = IndexerScores(kv, 8, PS)
    da = token_digests(a, 0, len(a), PS)
    ma = scores.memo(da)
    scores.score_upto(ma, 23)  # cut mid-page, then the rest
    scores.score_upto(ma, len(a))
    assert scores.pages_reused == 0 and scores.pages_scored == len(a) // PS
    db = token_digests(b, 0, len(b), PS)
    mb = scores.memo(db)
    scores.score_upto(mb, len(b))
    assert mb.pages_reused == 3  # the shared whole pages; its fourth page differs
    for memo, d, n in ((ma, da, len(a)), (mb, db, len(b))):
        assert np.array_equal(memo.scores[:, :n], _fresh(kv, d, n))


def test_decode_scores_fill_pages_a_later_turn_reuses(kv):
    gen = np.random.default_rng(6)
    toks = gen.integers(0, 50_000, PS + 3).tolist()
    scores = IndexerScores(kv, 4, PS)
    memo = scores.memo(token_digests(toks, 0, len(toks), PS))
    scores.score_upto(memo, len(toks))
    for _ in range(2 * PS):  # decode: one token at a time, its key from its quantized rows
        toks.append(int(gen.integers(0, 50_000)))
        memo.digests[:] = token_digests(toks, 0, len(toks), PS)
        pos = len(toks) - 1
        layers = np.asarray(kv.kv_layers)

        rows = quantize_index_k(
            kv.index_k_of([memo.digests[pos]] * len(layers), [pos] * len(layers), layers)
        )
        scores.score_upto(memo, pos)
        scores.score_own(memo, pos, rows)
    assert scores.pages_scored == len(toks) // PS
    later = scores.memo(token_digests(toks, 0, len(toks), PS))
    scores.score_upto(later, len(toks))
    assert later.pages_reused == len(toks) // PS
    assert np.array_equal(later.scores[:, : len(toks)], _fresh(kv, later.digests, len(toks)))


def test_the_kept_selection_is_topks_set_at_every_step(kv):
    gen = np.random.default_rng(7)
    toks = gen.integers(0, 50_000, 300).tolist()
    scores = IndexerScores(kv, 24, PS)
    memo = scores.memo(token_digests(toks, 0, len(toks), PS))
    scores.score_upto(memo, len(toks))
    steps = list(range(1, 60)) + [90, 91, 92, 150] + list(range(151, 300))
    for pos in steps:  # consecutive steps (kept) and jumps (selected again)
        top = scores.top(memo, pos)
        k = min(24, pos)
        for i in range(len(kv.kv_layers)):
            want = torch.topk(torch.from_numpy(memo.scores[i, :pos]), k).indices
            assert set(np.asarray(top[i]).tolist()) == set(want.tolist()), (pos, i)


def test_the_page_cache_keeps_its_bound(kv):
    gen = np.random.default_rng(8)
    page_bytes = len(kv.kv_layers) * PS * 4
    scores = IndexerScores(kv, 4, PS, page_cache_bytes=5 * page_bytes + 7)
    for _ in range(4):
        toks = gen.integers(0, 50_000, 3 * PS).tolist()
        scores.score_upto(scores.memo(token_digests(toks, 0, len(toks), PS)), len(toks))
        assert len(scores._pages) <= 5
    assert scores.pages_scored == 12
    with pytest.raises(InvalidArgumentError, match="page_cache_bytes=-1"):
        IndexerScores(kv, 4, PS, page_cache_bytes=-1)

"""IndexerScores: what :class:`~tiered_kv.engine.synthetic_sparse.SyntheticSparseDSA`'s indexer
scores and selects - per live request its query per layer, every token's score against it and
each layer's ``topk`` best - with the scores of whole pages kept across requests.

A token's indexer key is a function of its prefix digest, position and layer
(:class:`~tiered_kv.engine.synthetic_kv.SyntheticKV`), scored as the cache holds it (quantized
to fp8 with block scales, then dequantized); the query is a function of the request's first
prefix digest and the layer. So a page's scores are a function of its last position's prefix
digest (which chains the whole prefix, the first page included): a later turn, a resumed
request or another user with the same prefix reuses them (``page_cache_bytes`` bound them,
least recently used dropped first) instead of scoring every earlier token again.

The selection is kept per request: positions only gain scores, so the step after the last one
compares only the newest score with each layer's worst kept one (the set ``torch.topk`` over
every score would pick, up to ties); any other step selects over every score.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_kv.device.dsa_pool import dequantize_index_k, quantize_index_k
from tiered_kv.engine.synthetic_kv import SyntheticKV
from tiered_kv.errors import InvalidArgumentError

QUERY_STREAM = 1 << 16  # the query's rows: another stream than any layer's indexer keys
PAGE_CACHE_BYTES = 256 << 20  # scores of whole pages kept across requests


@dataclass
class ScoreMemo:
    """One live request's scores: the query and the scores so far of each layer, and each
    layer's selection."""

    queries: torch.Tensor  # (layers, index_head_dim)
    scores: np.ndarray  # (layers, capacity): the first ``scored`` filled
    scored: int = 0
    top: np.ndarray | None = None  # (layers, topk): each layer's best positions below top_end
    top_scores: np.ndarray | None = None  # their scores
    top_end: int = 0
    pages_reused: int = 0  # pages whose scores came from the cache
    digests: list[bytes] = field(default_factory=list)  # the request's, by position


class IndexerScores:
    def __init__(
        self,
        kv: SyntheticKV,
        topk: int,
        page_size: int,
        *,
        page_cache_bytes: int = PAGE_CACHE_BYTES,
    ) -> None:
        if not isinstance(kv, SyntheticKV) or not kv.index_dim:
            raise InvalidArgumentError("kv must be the SyntheticKV of a DSA cache")
        if type(page_cache_bytes) is not int or page_cache_bytes < 0:
            raise InvalidArgumentError(f"page_cache_bytes={page_cache_bytes!r} must be an int >= 0")
        self.kv, self.topk, self.page_size = kv, topk, page_size
        self.layers = np.asarray(kv.kv_layers, dtype=np.int64)
        self._pages: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._page_bytes = len(self.layers) * page_size * 4
        self._max_pages = page_cache_bytes // self._page_bytes
        self.pages_reused = self.pages_scored = 0

    def memo(self, digests: list[bytes]) -> ScoreMemo:
        """A new request's memo (``digests``: its prefix digests by position, kept by
        reference: the caller extends them)."""
        n = len(self.layers)
        queries = self.kv.index_k_of(digests[:1] * n, [0] * n, QUERY_STREAM + self.layers)
        scores = np.zeros((n, 256), dtype=np.float32)
        return ScoreMemo(queries, scores, digests=digests)

    def keys(self, digests, positions, layers) -> torch.Tensor:
        """The indexer keys of ``positions`` (one layer per row) as the cache holds them."""
        rows = quantize_index_k(self.kv.index_k_of(digests, positions, layers))
        return dequantize_index_k(rows, self.kv.index_dim)

    # -- scoring ----------------------------------------------------------------------------------
    def score_upto(self, memo: ScoreMemo, pos: int) -> None:
        """Score positions ``memo.scored .. pos - 1``, every layer at once; whole pages from
        the cache where it has them."""
        start, ps, digests = memo.scored, self.page_size, memo.digests
        if start >= pos:
            return
        self._grow(memo, pos)
        todo = np.ones(pos - start, dtype=bool)
        for lo in range(-(-start // ps) * ps, pos - ps + 1, ps):
            got = self._pages.get(digests[lo + ps - 1])
            if got is not None:
                self._pages.move_to_end(digests[lo + ps - 1])
                memo.scores[:, lo : lo + ps] = got
                todo[lo - start : lo - start + ps] = False
                memo.pages_reused += 1
                self.pages_reused += 1
        new = start + np.flatnonzero(todo)
        if new.size:
            n, m = len(self.layers), new.size
            keys = self.keys([digests[j] for j in new] * n, np.tile(new, n), self.layers.repeat(m))
            got = torch.einsum("nmd,nd->nm", keys.reshape(n, m, -1), memo.queries).numpy()
            memo.scores[:, new] = got
        memo.scored = pos
        self._keep_pages(memo, start, pos)

    def score_own(self, memo: ScoreMemo, pos: int, index_rows: torch.Tensor) -> None:
        """Score the decode token at ``pos`` from its quantized key rows (one per layer), once
        every earlier one is."""
        if memo.scored != pos:
            return
        keys = dequantize_index_k(index_rows, self.kv.index_dim)
        self._grow(memo, pos + 1)
        memo.scores[:, pos] = torch.einsum("nd,nd->n", keys, memo.queries).numpy()
        memo.scored = pos + 1
        self._keep_pages(memo, pos, pos + 1)

    def _keep_pages(self, memo: ScoreMemo, start: int, end: int) -> None:
        """Cache the whole pages that scores ``start .. end - 1`` completed."""
        if not self._max_pages:
            return
        ps = self.page_size
        for hi in range(-(-(start + 1) // ps) * ps, end + 1, ps):
            key = memo.digests[hi - 1]
            if key in self._pages:
                continue
            self._pages[key] = memo.scores[:, hi - ps : hi].copy()
            self.pages_scored += 1
            if len(self._pages) > self._max_pages:
                self._pages.popitem(last=False)

    @staticmethod
    def _grow(memo: ScoreMemo, end: int) -> None:
        """Room in ``memo.scores`` for positions below ``end`` (grown by doubling)."""
        have = memo.scores.shape[1]
        if end > have:
            grown = np.zeros((memo.scores.shape[0], max(2 * have, end)), dtype=np.float32)
            grown[:, : memo.scored] = memo.scores[:, : memo.scored]
            memo.scores = grown

    # -- selection --------------------------------------------------------------------------------
    def top(self, memo: ScoreMemo, pos: int):
        """Per layer the ``topk`` best positions of ``0..pos-1`` (every one while they fit):
        (layers, k) positions (an array, or a list of one array per layer)."""
        if pos <= self.topk:
            return [np.arange(pos, dtype=np.int64)] * len(self.layers)
        if memo.top is not None and memo.top_end == pos - 1:
            new = memo.scores[:, pos - 1]
            worst = memo.top_scores.argmin(axis=1)
            rows = np.flatnonzero(new > memo.top_scores[np.arange(len(new)), worst])
            memo.top[rows, worst[rows]] = pos - 1
            memo.top_scores[rows, worst[rows]] = new[rows]
        elif memo.top is None or memo.top_end != pos:
            best = torch.topk(torch.from_numpy(memo.scores[:, :pos]), self.topk, dim=1)
            memo.top, memo.top_scores = best.indices.numpy(), best.values.numpy()
        memo.top_end = pos
        return memo.top

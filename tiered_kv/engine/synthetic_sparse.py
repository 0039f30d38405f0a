"""SyntheticSparseDSA: the :class:`~tiered_kv.engine.sparse_scheduler.SparseScheduler`'s model
at a real DSA model's scale (DeepSeek-V3.2): no weights, real latent and indexer bytes
(:class:`~tiered_kv.engine.synthetic_kv.SyntheticKV`), real selection and swap-in, checked bytes.

- prefill (:class:`~tiered_kv.engine.hisparse_model.StagedKV`): the cached prefix the cache
  copied from the tree's host copies into the staging rows is checked (latents and indexer rows,
  every layer, on the prefixes the cache's ``verify_fraction`` samples; a wrong row is counted in
  ``mismatched_tokens`` and written again, as a recompute would); the rest of the prompt's
  latents and indexer keys are written at their staging rows;
- decode (:class:`~tiered_kv.engine.hisparse_model.SwapKV`): the token's latent and indexer key
  are written at its reserved slot; per layer the ``topk`` best earlier tokens by the score of
  their key against the request's query for that layer are swapped in from host (``swap_in``;
  a failed copy tried again, then :class:`SwapInFailed`), and the rows the buffer then holds
  for them are checked against the synthetic bytes: every row copied in from host now, in
  every layer; ``sample_rows`` of the selection (mostly buffer hits) in each of
  ``SAMPLED_LAYERS`` layers (turning with the position); and every ``FULL_EVERY``-th token one
  layer whole (turning too), its selection made from every indexer key as the device holds it
  (``score_keys``) and ``KEY_ROWS`` of those keys checked. The query is fixed per request and
  layer (a stand-in for the locality of real indexer scores: consecutive steps select mostly
  the same tokens), so a token's score is computed once and each layer's selection is kept
  per request, a step comparing only the newest score with the worst one kept. The request's
  serving state is checked once per token; each layer then calls its swapper directly.

A decode token's rows are written, and every checked row read, raw
(:class:`~tiered_kv.engine.hisparse_model.RawRows`, ``copy_mode``: with the native copier one
block copy writes every layer's latents, one its indexer keys, and one gathers up to
``CHECK_CHUNK`` checked rows of every layer). The checked rows are generated, gathered and
compared ``CHECK_CHUNK`` at a time: a new request's first step copies, and checks, ~50k rows
(60 MB at DeepSeek-V3.2's size).

Logits are :func:`~tiered_kv.engine.synthetic_model.next_token`'s one-hot row, so every way of
serving decodes the same tokens. Counters as :class:`SyntheticModel`'s, plus the swap-in
traffic (``swap_hits``, ``swap_loaded``, ``swap_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tiered_kv.cache.facade import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing, SparseRequest
from tiered_kv.device.dsa_pool import quantize_index_k
from tiered_kv.engine.hisparse_model import RawRows, StagedKV, SwapKV, swap_in_retried
from tiered_kv.engine.kv_bytes import HiSparseBytes
from tiered_kv.engine.sparse_scores import IndexerScores, ScoreMemo
from tiered_kv.engine.synthetic_kv import SyntheticKV, rows_differ, token_digests
from tiered_kv.engine.synthetic_model import VOCAB_SIZE, LoadedTokens, _Embed, next_token
from tiered_kv.errors import InvalidArgumentError

SAMPLE_ROWS = 16  # selected rows checked in each sampled layer
SAMPLED_LAYERS = 4  # layers sampled per token besides the one checked whole
KEY_ROWS = 64  # indexer keys checked per token (in the layer checked whole)
FULL_EVERY = 4  # one layer's whole selection checked every FULL_EVERY-th decode token
CHECK_CHUNK = 2048  # checked rows generated, gathered and compared at a time (2.3 MB at 1152)


class SyntheticSparseDSA:
    def __init__(
        self,
        serving: HiSparseServing,
        kv: SyntheticKV,
        topk: int,
        *,
        retries: int = 3,
        sample_rows: int = SAMPLE_ROWS,
        on_restored: Callable[[TieredKVCache, SparseRequest], None] | None = None,
        copy_mode: str = "auto",
    ) -> None:
        if not isinstance(kv, SyntheticKV) or not kv.index_dim:
            raise InvalidArgumentError("kv must be the SyntheticKV of a DSA cache")
        if type(topk) is not int or not 1 <= topk <= serving.buffer_tokens:
            raise InvalidArgumentError(
                f"topk={topk!r} must be an int in [1, {serving.buffer_tokens}] (the buffer)"
            )
        self.serving, self.kv, self.topk, self.retries = serving, kv, topk, retries
        self.sample_rows, self.on_restored = sample_rows, on_restored
        self.pool, self.cache = serving.pool, serving.cache
        self.page_size = serving.page_size
        self.embed = _Embed(kv.dtype)
        g = self.cache.config.geometry
        self.bytes = HiSparseBytes(g, self.page_size, serving.buffer_tokens, topk)
        self.latent_bytes = (g.kv_lora_rank + g.qk_rope_head_dim) * g.torch_dtype.itemsize
        self.layers = kv.kv_layers
        self.scores = IndexerScores(kv, topk, self.page_size)
        self._layer_ids = np.asarray(self.layers, dtype=np.int64)
        self.raw = RawRows(self.pool, self.layers, copy_mode, chunk=CHECK_CHUNK)
        self.restores = self.verified_tokens = self.mismatched_tokens = 0
        self.restored_tokens = self.restored_bytes = self.all_full_restored_bytes = 0
        self.computed_tokens = self.recomputed_tokens = 0
        self.swap_hits = self.swap_loaded = self.swap_bytes = self.failed_copies = 0
        self.checked_rows = 0
        self.loaded = LoadedTokens()
        self._memo: dict[int, tuple[SparseRequest, ScoreMemo]] = {}
        self._rng = np.random.default_rng(0)

    # -- the scheduler's call -------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, start: int, kv, page_size: int) -> torch.Tensor:
        req = kv.req
        end = start + len(tokens)
        if end != len(req.tokens):
            raise InvalidArgumentError(
                f"forward of positions {start}..{end} but the request holds {len(req.tokens)}"
            )
        digests = self._digests_of(req, end)
        if isinstance(kv, StagedKV):
            self._prefill(req, kv, start, end, digests)
        elif isinstance(kv, SwapKV):
            self._decode(req, kv, start, digests)
        else:
            raise InvalidArgumentError(
                f"kv must be a StagedKV or a SwapKV, got {type(kv).__name__}"
            )
        self.computed_tokens += end - start
        logits = torch.zeros(1, VOCAB_SIZE)
        logits[0, next_token(req.tokens, end)] = 1.0
        return logits

    def take_loaded(self) -> LoadedTokens:
        out, self.loaded = self.loaded, LoadedTokens()
        return out

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill(self, req: SparseRequest, kv: StagedKV, start: int, end: int, digests) -> None:
        if start:
            self._restored(req, kv, start, digests)
        positions = np.arange(start, end)
        kv.start = start
        for layer in self.layers:
            latent, _ = self.kv.kv_tensors(digests[start:end], positions, layer)
            kv.write(layer, latent, None)
            kv.write_index(layer, self.kv.index_k(digests[start:end], positions, layer))

    def _restored(self, req: SparseRequest, kv: StagedKV, start: int, digests) -> None:
        hits = req.hits
        restored = hits.host + hits.storage
        self.loaded.host += hits.host
        self.loaded.storage += hits.storage
        if restored:
            moved = self.bytes.restored(start, min(restored, start))
            stored = self.bytes.restored(start, min(hits.storage, start))
            self.loaded.host_bytes += moved - stored
            self.loaded.storage_bytes += stored
            self.restored_tokens += restored
            self.restored_bytes += moved
            self.all_full_restored_bytes += self.bytes.all_full_restored(restored)
        self.restores += 1
        if not self.cache.verifier.sample():
            return
        if self.on_restored is not None:
            self.on_restored(self.cache, req)
        rows, positions = kv.rows[:start], np.arange(start)
        bad = torch.zeros(start, dtype=torch.bool)
        for layer in self.layers:
            bad |= self._bad_rows(layer, rows, digests[:start], positions)
        self.verified_tokens += start
        self.loaded.verify += start
        wrong = int(bad.sum())
        if wrong:  # counted, then written again as a recompute would
            self.mismatched_tokens += wrong
            self.recomputed_tokens += start
            kv.start = 0
            for layer in self.layers:
                kv.write(layer, self.kv.kv_tensors(digests[:start], positions, layer)[0], None)
                kv.write_index(layer, self.kv.index_k(digests[:start], positions, layer))

    # -- decode -----------------------------------------------------------------------------------
    def _decode(self, req: SparseRequest, kv: SwapKV, pos: int, digests) -> None:
        memo, layers = self._memo[id(req)][1], self.layers
        n = len(layers)
        here = [digests[pos]] * n
        latents = self.kv.kv_rows_of(here, [pos] * n, self._layer_ids)  # every layer at once
        index_rows = quantize_index_k(self.kv.index_k_of(here, [pos] * n, self._layer_ids))
        self.raw.write(kv.slot, latents, index_rows)
        self.scores.score_upto(memo, pos)
        self.scores.score_own(memo, pos, index_rows)  # its key, scored once for the next steps
        if pos == 0:
            return
        top = self.scores.top(memo, pos)
        # The request's state is checked once (no layer's swap-in changes it), then its
        # swapper is called per layer.
        swap_in = self.serving.swapper(req).swap_in
        # Every FULL_EVERY-th token selects one layer (turning) from every indexer key as the
        # device holds them and checks that layer's whole selection; every token samples
        # selected rows (mostly buffer hits) in a few layers (turning too).
        full = (pos // FULL_EVERY) % n if pos % FULL_EVERY == 0 else -1
        sampled = {(pos + 1 + j * n // (SAMPLED_LAYERS + 1)) % n for j in range(SAMPLED_LAYERS)}
        bad = False
        checks: list[tuple[int, np.ndarray, np.ndarray]] = []  # layer index, slots, positions
        for i, layer in enumerate(layers):
            chosen = top[i]
            if i == full:  # the indexer keys as the device holds them, scored and selected
                keys = self.serving.score_keys(req, layer)[:pos]
                at = self._rng.choice(pos, min(pos, KEY_ROWS), replace=False)
                want = self.scores.keys([digests[j] for j in at], at, [layer] * len(at))
                bad |= not torch.equal(keys[at].view(torch.int32), want.view(torch.int32))
                k = min(self.topk, pos)
                chosen = torch.topk(keys @ memo.queries[i], k, sorted=False).indices.numpy()
            got, failed = swap_in_retried(swap_in, layer, torch.from_numpy(chosen), self.retries)
            self._count(got, failed)
            slots = got.device_slots.cpu().numpy()  # no copy on CPU
            if i == full:
                checks.append((i, slots, chosen))
                continue
            copied = got.copied
            if copied.size:  # every row copied in from host, in every layer
                checks.append((i, slots[copied], chosen[copied]))
            if i in sampled:
                check = self._rng.choice(chosen.size, min(chosen.size, self.sample_rows), False)
                checks.append((i, slots[check], chosen[check]))
        bad |= self._bad_selected(checks, digests)
        self.verified_tokens += 1
        self.mismatched_tokens += bad

    def _count(self, got, failed: int) -> None:
        """One layer's swap-in in the counters."""
        self.failed_copies += failed
        self.swap_hits += got.hits
        self.swap_loaded += got.loaded
        nbytes = got.loaded * self.latent_bytes
        self.swap_bytes += nbytes
        self.loaded.host_bytes += nbytes  # host -> device over the modeled link

    # -- checks -----------------------------------------------------------------------------------
    def _bad_selected(self, checks, digests) -> bool:
        """Whether any buffer row checked holds another latent than its selected token's: a
        check ``(i, slots, positions)`` reads device ``slots`` of layer ``self.layers[i]``,
        which must hold ``positions``. Every layer's rows at once, ``CHECK_CHUNK`` rows at a
        time (a new request's first step copies, and checks, ~50k rows: 60 MB)."""
        on, at_slots, of = zip(*checks, strict=True)
        sel, slots = np.concatenate(of), np.concatenate(at_slots)
        idx = np.repeat(np.asarray(on, dtype=np.int64), [len(c) for c in of])  # layer per row
        self.checked_rows += len(sel)
        chosen = [digests[j] for j in sel.tolist()]
        bad = False
        for lo in range(0, len(sel), CHECK_CHUNK):
            part = slice(lo, lo + CHECK_CHUNK)
            want = self.kv.kv_rows_of(chosen[part], sel[part], self._layer_ids[idx[part]])
            bad |= not _same(self.raw.gather(idx[part], slots[part]), want.numpy())
        return bad

    def _bad_rows(self, layer: int, rows: torch.Tensor, digests, positions) -> torch.Tensor:
        """Per row, whether device ``rows`` of ``layer`` hold other latent or indexer bytes than
        the synthetic ones of ``positions`` (read raw: no getter waits on a dense load)."""
        n = len(rows)
        got, index = self.raw.take(self.pool.layer_index(layer), rows)
        bad = rows_differ(got, self.kv.kv_rows(digests, positions, layer).contiguous())
        want = self.kv.index_k_rows(digests, positions, layer).reshape(n, -1).view(torch.uint8)
        self.checked_rows += n
        return bad | rows_differ(index.contiguous(), want.contiguous())

    def _digests_of(self, req: SparseRequest, end: int) -> list[bytes]:
        """Prefix digests of positions ``0..end-1`` of ``req`` (kept per live request, with
        its queries and scores)."""
        memo = self._memo.get(id(req))
        if memo is None or memo[0] is not req:
            live = self.serving.live
            self._memo = {k: v for k, v in self._memo.items() if k in live}
            digests = token_digests(req.tokens, 0, end, self.page_size, req.prior)
            memo = self._memo[id(req)] = (req, self.scores.memo(digests))
        have = memo[1].digests
        if len(have) < end:
            have += token_digests(req.tokens, len(have), end, self.page_size, req.prior)
        return have


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two (n, bytes) uint8 arrays hold the same bytes (as 8-byte words where the rows
    allow: the same answer, several times faster)."""
    if got.shape != want.shape:
        return False
    if got.flags.c_contiguous and want.flags.c_contiguous and got.shape[1] % 8 == 0:
        got, want = got.view(np.uint64), want.view(np.uint64)
    return bool(np.array_equal(got, want))

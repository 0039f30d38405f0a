"""SyntheticKV: real KV bytes for a cache of a real model's geometry, without running the model.

Each token's KV in each layer is a deterministic function of its *prefix digest* (the page
chain of ``storage.keys.page_digests`` continued token by token: SHA-256 of the previous page's
digest and this page's tokens up to and including this one, so at a page's last token it is
that page's digest), its position and the layer. The same tokens at the same positions give
the same bytes, whichever request wrote them, so a prefix restored from any tier is checked
byte for byte against what it must hold (``verify``). A hybrid model's recurrent state at
position P is the same kind of function of the digest of tokens ``0..P-1``.

The generator is built for gigabytes: one fixed table of random words (PCG64, fixed seed) and,
per (token, layer), a row of it at an offset keyed by the digest, XORed with a 64-bit word
keyed the same way; every layer's rows for a whole batch of tokens come out of one gather and
two vectorized passes. Floating values stay finite (the top exponent bit is cleared), so no
NaN payload can be canonicalized on the way. These are test bytes, not a cryptographic PRF.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.dsa_pool import quantize_index_k
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind
from tiered_kv.storage.keys import DIGEST_BYTES, page_digests

# Clears the top exponent bit of every element: |x| < 2, never Inf or NaN.
_FINITE = {
    2: np.uint64(0xBFFF_BFFF_BFFF_BFFF),
    4: np.uint64(0xBFFF_FFFF_BFFF_FFFF),
}
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_INDEX_SALT = 1 << 20  # the DSA indexer's rows: another stream than the layer's latent
_STATE_SALT = 1 << 21  # recurrent state: another stream than any KV row


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, vectorized (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58_476D_1CE4_E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D0_49BB_1331_11EB)
        return x ^ (x >> np.uint64(31))


def _parse(digests: list[bytes]) -> np.ndarray:
    """Prefix digests as (n, 4) little-endian words."""
    return np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, DIGEST_BYTES // 8)


def rows_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row of two (n, bytes) uint8 tensors, whether they differ anywhere: compared as 8-,
    4- or 2-byte words where the row length allows (the same answer, several times faster)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        width = dtype.itemsize
        if got.shape[-1] % width == 0 and got.is_contiguous() and want.is_contiguous():
            got, want = got.view(dtype), want.view(dtype)
            break
    return (got != want).any(dim=-1)


def token_digests(tokens, start: int, end: int, page_size: int, prior: bytes = b"") -> list[bytes]:
    """The prefix digest of every position ``start..end-1`` of ``tokens``: SHA-256 of the digest
    of the page before (``prior``, the request identity's chain prior, for the first page) and
    this page's tokens up to the position (little-endian uint32). A page's last position gets
    that page's ``page_digests`` entry. Another identity's tokens thus get other KV, as another
    LoRA adapter's would."""
    if not 0 <= start <= end <= len(tokens):
        raise InvalidArgumentError(f"positions {start}..{end} are outside 0..{len(tokens)}")
    arr = np.asarray(tokens[:end], dtype="<u4")
    first = start // page_size
    chain = page_digests(arr[: first * page_size], page_size, prior)
    prior = chain[-1] if chain else prior
    out: list[bytes] = []
    for page in range(first, (end + page_size - 1) // page_size):
        h = hashlib.sha256(prior)
        lo = page * page_size
        for p in range(lo, min(end, lo + page_size)):
            h.update(arr[p : p + 1].tobytes())
            if p >= start:
                out.append(h.digest())
        prior = h.digest()
    return out


class SyntheticKV:
    """The synthetic KV (and state) of a cache built from ``config`` (a preset's geometry)."""

    def __init__(self, config: TieredKVConfig, *, seed: int = 0, table_mib: int = 16) -> None:
        if not isinstance(config, TieredKVConfig):
            raise InvalidArgumentError(f"config must be a TieredKVConfig, got {config!r:.60}")
        g = self.geometry = config.geometry
        self.page_size = config.device.page_size
        self.dtype = g.torch_dtype
        item = self.dtype.itemsize
        mla = g.model in (ModelKind.MLA, ModelKind.DSA)
        if mla:
            self.k_shape, self.v_shape = (1, g.kv_lora_rank + g.qk_rope_head_dim), None
        else:
            self.k_shape, self.v_shape = (
                (g.head_num, g.head_dim),
                (g.head_num, g.v_head_dim or g.head_dim),
            )
        k_elems = self.k_shape[0] * self.k_shape[1]
        v_elems = self.v_shape[0] * self.v_shape[1] if self.v_shape else 0
        self.k_bytes, self.row_bytes = k_elems * item, (k_elems + v_elems) * item
        if g.model == ModelKind.HYBRID_LINEAR:
            self.kv_layers, self.state_layers = g.hybrid_layer_ids()
            conv, temporal = g.conv_state_shape(), g.temporal_state_shape()
            self.conv_shape, self.temporal_shape = conv, temporal
            self.state_row_bytes = 4 * (conv[0] * conv[1] + int(np.prod(temporal)))
        else:
            self.kv_layers, self.state_layers = list(range(g.num_layers)), []
            self.state_row_bytes = 0
        self.window_layers = set(g.swa_layer_ids()[1]) if g.model == ModelKind.SWA else set()
        self.index_dim = g.index_head_dim if g.model == ModelKind.DSA else 0
        words = max(self.row_bytes, self.state_row_bytes, 4 * self.index_dim) // 8 + 1
        table_words = max(table_mib << 17, 4 * words)
        self._table = np.random.Generator(np.random.PCG64(seed)).integers(
            0, 2**64, size=table_words, dtype=np.uint64, endpoint=False
        )
        self._masked: dict[int, np.ndarray] = {}  # the table masked per element width
        self._window_views: dict[tuple[int, int], np.ndarray] = {}

    # -- the generator ------------------------------------------------------------------------
    def _rows(self, digests: list[bytes], positions, salt, nbytes: int, item: int):
        """(n, nbytes) uint8: the rows of ``digests`` (one per token) at ``positions``;
        ``salt`` one stream (an int) or one per row (an int array)."""
        keys = self._keys(_parse(digests), positions, salt, nbytes, item)
        return self._gather(keys, nbytes, item)

    def _keys(self, d: np.ndarray, positions, salt, nbytes: int, item: int):
        """Each row's table offset and word (``_rows`` before its gather); ``salt`` an int, an
        int array by row, or a column ``(m, 1)`` of streams: then (m, n) of each, one
        stream's rows per row of them."""
        words = (nbytes + 7) // 8
        pos = np.asarray(positions, dtype=np.uint64)
        salt = np.asarray(salt, dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            key = d[:, 0] ^ _mix(pos * _GOLDEN + salt + np.uint64(1))
            offset = (_mix(key) % np.uint64(self._table.size - words + 1)).astype(np.int64)
            word = _mix(d[:, 1] ^ _mix(key + _GOLDEN))
            word &= _FINITE[item]
        return offset, word

    def _gather(self, keys, nbytes: int, item: int) -> torch.Tensor:
        offset, word = keys
        # (t ^ w) & mask == (t & mask) ^ (w & mask): the table is masked once, not every row
        out = self._windows(item, (nbytes + 7) // 8)[offset]  # one gather: n rows
        out ^= word[:, None]
        return torch.from_numpy(out).view(torch.uint8)[:, :nbytes]

    def _layer_rows(self, digests, positions, salts, nbytes: int, item: int):
        """``_rows`` of each stream in ``salts`` (an int array, e.g. one per layer) for the
        same tokens, yielded one stream at a time; the keys computed for all at once."""
        d = _parse(digests)
        offsets, words = self._keys(d, positions, np.asarray(salts)[:, None], nbytes, item)
        for offset, word in zip(offsets, words, strict=True):
            yield self._gather((offset, word), nbytes, item)

    def _windows(self, item: int, words: int) -> np.ndarray:
        """Every ``words``-long window of the table masked for ``item``-byte elements (kept)."""
        got = self._window_views.get((item, words))
        if got is None:
            masked = self._masked.get(item)
            if masked is None:
                masked = self._masked[item] = self._table & _FINITE[item]
            got = np.lib.stride_tricks.sliding_window_view(masked, words)
            self._window_views[(item, words)] = got
        return got

    def kv_rows(self, digests: list[bytes], positions, layer: int) -> torch.Tensor:
        """The KV bytes of tokens with these prefix ``digests`` at ``positions`` in ``layer``:
        (n, row_bytes) uint8, K's elements then V's (an MLA / DSA row is the whole latent)."""
        return self._rows(digests, positions, layer, self.row_bytes, self.dtype.itemsize)

    def kv_tensors(self, digests: list[bytes], positions, layer: int):
        """(K, V) of tokens with these prefix ``digests`` at ``positions`` in ``layer``, in the
        cache's dtype (V None for MLA / DSA): views of ``kv_rows``."""
        return self._split(self.kv_rows(digests, positions, layer))

    def kv_for(self, prefix_digest: bytes, position: int, layer: int):
        """One token's (K, V) in ``layer`` in the cache's dtype (V None for MLA / DSA)."""
        return self._split(self.kv_rows([prefix_digest], [position], layer))

    def _split(self, rows: torch.Tensor):
        # Views, no copies: each row's K bytes then V bytes reinterpreted in place.
        n = rows.shape[0]
        k = rows[:, : self.k_bytes].view(self.dtype).reshape(n, *self.k_shape)
        if self.v_shape is None:
            return k, None
        v = rows[:, self.k_bytes :].view(self.dtype).reshape(n, *self.v_shape)
        return k, v

    def index_k(self, digests, positions, layer: int) -> torch.Tensor:
        """DSA: the indexer keys the model writes, (n, index_head_dim) float32."""
        raw = self._rows(digests, positions, _INDEX_SALT + layer, 4 * self.index_dim, 4)
        return raw.contiguous().view(torch.float32)

    def kv_rows_of(self, digests: list[bytes], positions, layers) -> torch.Tensor:
        """``kv_rows`` with one layer per row (``layers``: an int array): one call for many
        layers' rows."""
        return self._rows(digests, positions, layers, self.row_bytes, self.dtype.itemsize)

    def index_k_of(self, digests, positions, layers) -> torch.Tensor:
        """``index_k`` with one layer per row (``layers``: an int array)."""
        salts = _INDEX_SALT + np.asarray(layers, dtype=np.int64)
        raw = self._rows(digests, positions, salts, 4 * self.index_dim, 4)
        return raw.contiguous().view(torch.float32)

    def kv_rows_by_layer(self, digests: list[bytes], positions, layers=None):
        """``kv_rows`` of the same tokens in each of ``layers`` (default: every KV layer),
        yielded layer by layer (each a fresh tensor): the per-row arithmetic done once."""
        layers = self.kv_layers if layers is None else layers
        return self._layer_rows(digests, positions, layers, self.row_bytes, self.dtype.itemsize)

    def index_k_by_layer(self, digests, positions, layers=None):
        """``index_k`` of the same tokens in each of ``layers`` (default: every KV layer)."""
        layers = self.kv_layers if layers is None else layers
        salts = _INDEX_SALT + np.asarray(layers, dtype=np.int64)
        for raw in self._layer_rows(digests, positions, salts, 4 * self.index_dim, 4):
            yield raw.contiguous().view(torch.float32)

    def index_k_rows(self, digests, positions, layer: int) -> torch.Tensor:
        """DSA: the quantized rows (fp8 bytes, then scales) the cache must hold for them."""
        return quantize_index_k(self.index_k(digests, positions, layer))

    def state_for(self, prefix_digest: bytes, position: int, layer: int):
        """Hybrid models: recurrent ``layer``'s (conv, temporal) float32 state after tokens
        ``0..position-1``, whose prefix digest is ``prefix_digest``."""
        row = self._rows([prefix_digest], [position], _STATE_SALT + layer, self.state_row_bytes, 4)
        flat = row[0].contiguous().view(torch.float32)
        split = self.conv_shape[0] * self.conv_shape[1]
        return flat[:split].reshape(self.conv_shape), flat[split:].reshape(self.temporal_shape)

    # -- through a cache ----------------------------------------------------------------------
    def _slots(self, cache: TieredKVCache, req: Request, start: int, end: int) -> torch.Tensor:
        return cache.req_to_token.req_to_token[req.row, start:end].to(torch.int64)

    def write(
        self, cache: TieredKVCache, req: Request, start: int, end: int, *, kept_only: bool = False
    ) -> None:
        """Write the KV of positions ``start..end-1`` of ``req.tokens`` (slots from ``extend``)
        in every layer through ``cache.write_kv`` (and ``write_index_k`` for DSA). A hybrid
        model's state, as its forward would leave it: at each page boundary P in
        ``start+1..end`` the state at P in the request's state slot, then
        ``cache.track_state(req, P)``; finally the state at ``end``. ``kept_only``: only at the
        boundaries the cache can keep a snapshot of (every ``state_snapshot_every`` pages, and
        the last one, where a finish or a retraction takes its snapshot): a real model's state
        is tens of MiB, and the others' tracking copies are overwritten before anything reads
        them."""
        if not 0 <= start <= end <= len(req.tokens):
            raise InvalidArgumentError(
                f"positions {start}..{end} are outside the request's 0..{len(req.tokens)}"
            )
        if start == end:
            return
        tokens, ps = req.tokens, self.page_size
        digests = token_digests(tokens, start, end, ps, req.prior)
        positions = np.arange(start, end)
        slots = self._slots(cache, req, start, end)
        index = self.index_k_by_layer(digests, positions) if self.index_dim else None
        for layer, rows in zip(
            self.kv_layers, self.kv_rows_by_layer(digests, positions), strict=True
        ):
            k, v = self._split(rows)
            cache.write_kv(layer, slots, k, v)
            if index is not None:
                cache.write_index_k(layer, slots, next(index))
        if not self.state_layers:
            return
        bounds = list(range(start // ps * ps + ps, end + 1, ps))
        if kept_only and bounds:
            every = cache.config.device.state_snapshot_every
            kept = [p for p in bounds[:-1] if every and p // ps % every == 0]
            bounds = [*kept, bounds[-1]]
        for p in bounds:
            self._write_state(cache, req, digests[p - 1 - start], p)
            cache.track_state(req, p)
        if end % ps:
            self._write_state(cache, req, digests[-1], end)

    def _write_state(self, cache: TieredKVCache, req: Request, digest: bytes, position: int):
        pool, slot = cache.req_to_token.mamba_pool, req.kv.mamba_pool_idx
        for layer in self.state_layers:
            conv, temporal = self.state_for(digest, position, layer)
            st = pool.layer_cache(layer)
            st.conv[0][slot].copy_(conv)
            st.temporal[slot].copy_(temporal)

    def verify(self, cache: TieredKVCache, req: Request, end: int | None = None) -> int:
        """How many of positions ``0..end-1`` (default: the request's cached prefix,
        ``req.prefix_len``) hold other bytes than the synthetic ones in some layer, plus, for a
        hybrid model, one per recurrent layer whose state in the request's slot is not the
        state at ``end`` (zeros at 0). 0 when everything is exact. Reads each layer through the
        device pool's getters, which wait for that layer's load; an SWA window layer is checked
        on the positions the next query reads (the last ``sliding_window - 1``). Mutates
        nothing."""
        end = req.prefix_len if end is None else end
        if not 0 <= end <= len(req.tokens):
            raise InvalidArgumentError(f"end={end} is outside the request's 0..{len(req.tokens)}")
        bad = torch.zeros(end, dtype=torch.bool)
        if end:
            bad = self._verify_kv(cache, req, end)
        return int(bad.sum()) + self._verify_state(cache, req, end)

    def mismatched(self, cache: TieredKVCache, req: Request, end: int | None = None):
        """Per position ``0..end-1`` (default: the cached prefix), whether it holds other bytes
        than the synthetic ones in some layer; a hybrid model's wrong state flags the last
        position (a verifier's answer: ``cache.verify``). Mutates nothing."""
        end = req.prefix_len if end is None else end
        if not 0 <= end <= len(req.tokens):
            raise InvalidArgumentError(f"end={end} is outside the request's 0..{len(req.tokens)}")
        if end == 0:
            return torch.zeros(0, dtype=torch.bool)
        bad = self._verify_kv(cache, req, end)
        if self._verify_state(cache, req, end):
            bad[end - 1] = True
        return bad

    def _verify_kv(self, cache: TieredKVCache, req: Request, end: int) -> torch.Tensor:
        digests = token_digests(req.tokens, 0, end, self.page_size, req.prior)
        positions = np.arange(end)
        full = self._slots(cache, req, 0, end)
        pool = cache.device_pool
        bad = torch.zeros(end, dtype=torch.bool)
        # Every layer's rows of every position at once, unless window layers read fewer
        rows = None if self.window_layers else self.kv_rows_by_layer(digests, positions)
        index = self.index_k_by_layer(digests, positions) if self.index_dim else None
        for layer in self.kv_layers:
            lo, idx = 0, full
            if layer in self.window_layers:
                lo = max(0, end - self.geometry.sliding_window + 1)
                idx = cache.allocator.translate_loc_from_full_to_swa(full[lo:])
            elif hasattr(cache.allocator, "translate_kv_loc"):  # virtual ids (unified SWA)
                idx = cache.allocator.translate_kv_loc(full)
            if rows is not None:
                want = next(rows)
            else:
                want = self.kv_rows(digests[lo:], positions[lo:], layer)
            n, kb = len(idx), self.k_bytes
            got = pool.get_key_buffer(layer)[idx].reshape(n, -1).view(torch.uint8)
            bad[lo:] |= rows_differ(got, want[:, :kb].contiguous())
            if self.v_shape is not None:
                got = pool.get_value_buffer(layer)[idx].reshape(n, -1).view(torch.uint8)
                bad[lo:] |= rows_differ(got, want[:, kb:].contiguous())
            if index is not None:
                have = pool.get_index_k_with_scale_buffer(layer)[idx]
                want = quantize_index_k(next(index))
                bad |= rows_differ(have.contiguous(), want.contiguous())
        return bad

    def _verify_state(self, cache: TieredKVCache, req: Request, end: int) -> int:
        if not self.state_layers:
            return 0
        pool, slot = cache.req_to_token.mamba_pool, req.kv.mamba_pool_idx
        digest = b""
        if end:
            digest = token_digests(req.tokens, end - 1, end, self.page_size, req.prior)[0]
        bad = 0
        for layer in self.state_layers:
            st = pool.layer_cache(layer)
            have = (st.conv[0][slot], st.temporal[slot])
            if end:
                want = self.state_for(digest, end, layer)
            else:
                want = tuple(torch.zeros_like(t) for t in have)
            same = all(
                torch.equal(h.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
                for h, w in zip(have, want, strict=True)
            )
            bad += not same
        return bad

"""The reference serving loop: :class:`TinyLlama` on a :class:`TieredKVCache`, one request at a
time, as a real engine would drive the cache.

Per request: ``begin`` (match the prompt on every tier; storage hits are prefetched to host, host
hits loaded to the device layer by layer), ``extend`` for the missed tokens (``alloc_extend``),
prefill through the paged KV (writes go through ``KVWriteLoc``, reads through ``req_to_token``
and the device pool, which waits for each layer's load), then greedy decoding one token at a
time (``alloc_decode``), then ``finish`` (the sequence goes into the tree; its pages move down
the tiers as memory fills). With ``verify``, the same prompt and decode are recomputed with
caching disabled and every logit compared.

The server is its cache's verifier (``cache.verify``): before the prefill, ``verify_restored``
lets the cache sample the restored prefix (``run-reference`` samples every one), and a sampled
one is recomputed with caching disabled and compared, bit for bit, layer by layer (a window
layer on the positions the next query reads, a hybrid's recurrent state at its end, a DSA
model's indexer keys); a wrong page is quarantined and the request computes from before it.
TTFT leaves that check out (it is the reference's recompute, not serving).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.engine.dsa import DenseDSAKV
from tiered_kv.engine.hybrid import DenseHybridKV
from tiered_kv.engine.model import DenseKV, TinyLlama
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind


def dense_kv_for(cfg, max_tokens: int) -> DenseKV:
    """The no-cache reference's KV for a model config (indexer keys too for a DSA model)."""
    if hasattr(cfg, "conv_kernel"):
        return DenseHybridKV(cfg, max_tokens)
    return (
        DenseDSAKV(cfg, max_tokens) if hasattr(cfg, "index_head_dim") else DenseKV(cfg, max_tokens)
    )


class PagedKV:
    """KV access for one request through the device pool and its row of ``req_to_token``."""

    def __init__(
        self, cache: TieredKVCache, req: Request, dtype: torch.dtype = torch.float32
    ) -> None:
        self.cache = cache
        self.req = req
        self.dtype = dtype  # the model's: a narrower cache dtype is read back in it
        self.start = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        row = self.cache.req_to_token.req_to_token[self.req.row]
        slots = row[self.start : self.start + len(k)].to(torch.int64)
        self.cache.write_kv(layer, slots, k, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.cache.req_to_token.req_to_token[self.req.row, :end].to(torch.int64)
        pool = self.cache.device_pool
        alloc = self.cache.allocator
        if getattr(pool, "layers_mapping", {}).get(layer, (0, False))[1]:
            idx = alloc.translate_loc_from_full_to_swa(idx)  # a window layer
        elif hasattr(alloc, "translate_kv_loc"):  # virtual ids: the full side's slots
            idx = alloc.translate_kv_loc(idx)
        elif hasattr(alloc, "logical_to_device"):  # HiSparse: logical ids, device rows
            idx = alloc.logical_to_device[idx]
        k = pool.get_key_buffer(layer)[idx].to(self.dtype)
        if self.cache.config.geometry.model in (ModelKind.MLA, ModelKind.DSA):
            return k, None  # the latent holds both
        return k, pool.get_value_buffer(layer)[idx].to(self.dtype)

    def read_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid models: the request's recurrent state of ``layer`` (its own state slot)."""
        st = self.cache.req_to_token.mamba_pool.layer_cache(layer)
        slot = self.req.kv.mamba_pool_idx
        return st.conv[0][slot].clone(), st.temporal[slot].clone()

    def write_state(self, layer: int, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        st = self.cache.req_to_token.mamba_pool.layer_cache(layer)
        slot = self.req.kv.mamba_pool_idx
        st.conv[0][slot] = conv
        st.temporal[slot] = temporal

    def write_index(self, layer: int, keys: torch.Tensor) -> None:
        """DSA: the indexer keys of the tokens being computed."""
        row = self.cache.req_to_token.req_to_token[self.req.row]
        self.cache.write_index_k(
            layer, row[self.start : self.start + len(keys)].to(torch.int64), keys
        )

    def read_index(self, layer: int, end: int) -> torch.Tensor:
        idx = self.cache.req_to_token.req_to_token[self.req.row, :end].to(torch.int64)
        to_device = getattr(self.cache.allocator, "logical_to_device", None)
        if to_device is not None:  # HiSparse: logical ids, device rows
            idx = to_device[idx]
        return self.cache.device_pool.get_index_k(layer, idx)


@dataclass
class RequestRecord:
    request: int
    prompt_tokens: int
    new_tokens: int
    device: int
    host: int
    storage: int
    recomputed: int
    ttft_s: float  # begin -> logits of the last prompt token, served from the cache
    total_s: float
    recompute_ttft_s: float | None = None  # the same prompt with caching disabled
    verify_s: float = 0.0  # the restored prefix's check (left out of ttft_s and total_s)
    max_rel_diff: float | None = None  # over every logit of prefill and decode (0.0: bitwise)
    bitwise: bool | None = None


class Server:
    def __init__(self, model: TinyLlama, cache: TieredKVCache) -> None:
        self.model = model
        self.cache = cache
        self.chunk = cache.config.page_size
        mc, c = model.cfg, cache.config.geometry
        # The model writes per-token K/V of fixed shapes: the cache must hold exactly that, or
        # the first request fails halfway (InvalidArgumentError is a ValueError).
        if hasattr(mc, "kv_lora_rank"):  # an MLA model (TinyMLA, TinyDSA, or a wrapper)
            dsa = hasattr(mc, "index_head_dim")
            checks = [
                ("cache kind", "dsa" if dsa else "mla", c.model),
                ("layers", mc.num_layers, c.num_layers),
                ("kv_lora_rank", mc.kv_lora_rank, c.kv_lora_rank),
                ("qk_rope_head_dim", mc.qk_rope_head_dim, c.qk_rope_head_dim),
            ]
            if dsa:
                checks.append(("index_head_dim", mc.index_head_dim, c.index_head_dim))
        elif hasattr(mc, "conv_kernel"):  # a hybrid model: full attention + recurrent layers
            checks = [
                ("cache kind", "hybrid_linear", c.model),
                ("layers", mc.num_layers, c.num_layers),
                ("KV heads", mc.num_kv_heads, c.head_num),
                ("head_dim", mc.head_dim, c.head_dim),
                ("full_layer_every", mc.full_layer_every, c.full_layer_every),
                ("conv state", mc.conv_state_shape(), c.conv_state_shape()),
                ("recurrent state", mc.temporal_state_shape(), c.temporal_state_shape()),
            ]
        else:
            swa = hasattr(mc, "sliding_window")
            checks = [
                ("cache kind", "swa" if swa else "mha", c.model),
                ("layers", mc.num_layers, c.num_layers),
                ("KV heads", mc.num_kv_heads, c.head_num),
                ("head_dim", mc.head_dim, c.head_dim),
                ("V head_dim", mc.head_dim, c.v_head_dim or c.head_dim),
            ]
            if swa:
                checks.append(("full_layer_every", mc.full_layer_every, c.full_layer_every))
                checks.append(("sliding_window", mc.sliding_window, c.sliding_window))
        for what, m, k in checks:
            if m != k:
                raise InvalidArgumentError(
                    f"{type(model).__name__} needs {what} {m!r}, the cache has {k!r}"
                )
        self._count = 0
        cache.set_verifier(self.restored_mismatch)

    def serve(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        verify: bool = False,
        extra_key: str | bytes | None = None,
    ) -> tuple[list[int], RequestRecord]:
        """One request through the cache; ``extra_key``: its identity beyond its tokens
        (``TieredKVCache.begin``)."""
        cache, model = self.cache, self.model
        t0 = time.perf_counter()
        req = cache.begin(prompt, extra_key=extra_key)
        try:
            t = time.perf_counter()
            cache.verify_restored(req)  # may cut the prefix back (its wrong pages quarantined)
            verify_s = time.perf_counter() - t
            prefix = req.prefix_len
            cache.extend(req, prompt[prefix:])
            kv = PagedKV(cache, req, model.embed.dtype)
            logits = self._forward(torch.tensor(prompt[prefix:]), prefix, kv, req)
            ttft = time.perf_counter() - t0 - verify_s
            served = [logits[-1]]
            out: list[int] = []
            pos = len(prompt)
            for _ in range(max_new_tokens):
                token = int(served[-1].argmax())
                out.append(token)
                cache.decode(req, token)
                served.append(self._forward(torch.tensor([token]), pos, kv, req)[-1])
                pos += 1
        except BaseException:
            # A failed forward or a full device: release the request's row, lock and slots
            # without inserting its (partial) KV.
            if not req.finished:
                cache.abort(req)
            raise
        cache.finish(req)
        cache.poll()
        total = time.perf_counter() - t0 - verify_s
        h = req.hits
        self._count += 1
        record = RequestRecord(
            self._count, len(prompt), len(out), h.device, h.host, h.storage, h.missed, ttft, total
        )
        record.verify_s = verify_s
        if verify:
            self._verify(prompt, out, served, record)
        return out, record

    def _forward(self, tokens: torch.Tensor, start: int, kv: PagedKV, req: Request):
        if self.cache.states is None:
            return self.model.forward(tokens, start, kv, self.chunk)
        # A hybrid model: the cache keeps the state at every page boundary the forward crosses
        # (the snapshot at the end of the cached prefix comes from there).
        track = functools.partial(self.cache.track_state, req)
        return self.model.forward(tokens, start, kv, self.chunk, on_boundary=track)

    def restored_mismatch(self, req: Request) -> torch.Tensor:
        """The cache's verifier: ``req``'s restored prefix recomputed with caching disabled;
        per prefix token, whether the cache holds other KV in some layer (bit for bit, in the
        cache's dtype; a wrong recurrent state flags the last token)."""
        model, end = self.model, req.prefix_len
        dense = dense_kv_for(model.cfg, end + self.chunk)
        model.forward(torch.tensor(req.tokens[:end]), 0, dense, self.chunk)
        paged = PagedKV(self.cache, req, model.embed.dtype)
        stored, g = self.cache.config.torch_dtype, self.cache.config.geometry
        windowed = set(g.swa_layer_ids()[1]) if g.model == ModelKind.SWA else set()
        linear = set(model.cfg.linear_layer_ids()) if hasattr(model.cfg, "linear_layer_ids") else ()
        bad = torch.zeros(end, dtype=torch.bool)
        for layer in range(model.cfg.num_layers):
            if layer in linear:
                if not all(map(_same, paged.read_state(layer), dense.read_state(layer))):
                    bad[end - 1] = True
                continue
            lo = max(0, end - g.sliding_window + 1) if layer in windowed else 0  # what is read
            pairs = [
                (got, want.to(stored).to(got.dtype))  # what the cache can hold of it
                for got, want in zip(paged.read(layer, end), dense.read(layer, end), strict=True)
                if got is not None
            ]
            if hasattr(dense, "read_index"):  # both dequantized from the stored rows
                pairs.append((paged.read_index(layer, end), dense.read_index(layer, end)))
            for got, want in pairs:
                bad[lo:] |= (got[lo:] != want[lo:]).flatten(1).any(dim=1)
        return bad

    def _verify(self, prompt, out, served, record: RequestRecord) -> None:
        """Recompute with caching disabled; compare every logit the served run produced."""
        model = self.model
        size = len(prompt) + len(out) + 1
        dense = dense_kv_for(model.cfg, size)
        t = time.perf_counter()
        logits = model.forward(torch.tensor(prompt), 0, dense, self.chunk)
        record.recompute_ttft_s = time.perf_counter() - t
        ref = [logits[-1]]
        for i, token in enumerate(out):
            ref.append(model.forward(torch.tensor([token]), len(prompt) + i, dense, self.chunk)[-1])
        worst = 0.0
        bitwise = True
        for a, b in zip(served, ref, strict=True):
            bitwise = bitwise and torch.equal(a, b)
            scale = b.abs().max().clamp_min(1e-30)
            worst = max(worst, float((a - b).abs().max() / scale))
        record.max_rel_diff = worst
        record.bitwise = bitwise


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

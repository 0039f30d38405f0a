"""KVBytes: the bytes a cache of one geometry holds and moves for a request, per model kind, and
the same figures for the same model with every layer full attention.

What a request of ``n`` tokens holds on the device, as this cache keeps it:

- every model: ``full_per_token`` x ``n`` on the layers that keep every position (all layers of
  an MHA / MLA / DSA model, a DSA model's indexer key and its scales included; an SWA model's full
  layers; a hybrid model's full-attention layers);
- an SWA model's window layers: ``window_per_token`` x the window slots it still holds
  (``window_held``: from the page of the first position its next query reads to its end; each
  ``extend`` gives the older ones back first), at most ``sliding_window + page_size - 1``;
- a hybrid model's recurrent layers: one fixed state per request (``state``: conv history and
  temporal state of every recurrent layer, float32, ``MambaPool``'s dtype here), whatever ``n``.

A restore of the last ``r`` tokens of a ``p``-token cached prefix from host or storage
(``restored``) moves their full-layer KV, the window KV of those of them the next query reads
(the pages of its last ``sliding_window - 1`` positions: older pages are tombstones, full KV
only) and, for a hybrid, the state snapshot at the prefix's end. ``all_full`` is the comparison:
the same layers, heads and dtype with every layer full attention (MHA for SWA and hybrid models;
for DSA the same MLA layers without the indexer, i.e. DeepSeek-V3's cache). Plain arithmetic on
the geometry: nothing here touches a cache.
"""

from __future__ import annotations

from tiered_kv.config import ModelGeometry
from tiered_kv.device.dsa_pool import QUANT_BLOCK
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind

STATE_DTYPE_BYTES = 4  # MambaPool keeps conv and temporal state in float32


class KVBytes:
    def __init__(self, geometry: ModelGeometry, page_size: int) -> None:
        if not isinstance(geometry, ModelGeometry):
            raise InvalidArgumentError(f"geometry must be a ModelGeometry, got {geometry!r:.60}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgumentError(f"page_size={page_size!r} must be an int >= 1")
        g = self.geometry = geometry
        self.page_size = page_size
        self.kind = ModelKind(g.model)
        item = g.torch_dtype.itemsize
        if self.kind in (ModelKind.MLA, ModelKind.DSA):
            layer = (g.kv_lora_rank + g.qk_rope_head_dim) * item
            index = g.index_head_dim + 4 * (g.index_head_dim // QUANT_BLOCK)
            self.layer_per_token = layer + (index if self.kind == ModelKind.DSA else 0)
            self.all_full_layer_per_token = layer  # DeepSeek-V3's MLA cache: no indexer
        else:
            layer = g.head_num * (g.head_dim + (g.v_head_dim or g.head_dim)) * item
            self.layer_per_token = self.all_full_layer_per_token = layer
        full, window, recurrent = list(range(g.num_layers)), [], []
        if self.kind == ModelKind.SWA:
            full, window = g.swa_layer_ids()
        elif self.kind == ModelKind.HYBRID_LINEAR:
            full, recurrent = g.hybrid_layer_ids()
        self.full_layers, self.window_layers, self.recurrent_layers = full, window, recurrent
        self.full_per_token = len(full) * self.layer_per_token
        self.window_per_token = len(window) * self.layer_per_token
        self.state = 0
        if recurrent:
            conv, (h, dk, dv) = g.conv_state_shape(), g.temporal_state_shape()
            self.state = len(recurrent) * (conv[0] * conv[1] + h * dk * dv) * STATE_DTYPE_BYTES
        self.all_full_per_token = g.num_layers * self.all_full_layer_per_token

    @property
    def per_token(self) -> int:
        """KV bytes one token writes over every layer that keeps KV (window layers included)."""
        return self.full_per_token + self.window_per_token

    def window_held(self, tokens: int) -> int:
        """Window slots a request of ``tokens`` tokens holds once its last token is extended
        (whole pages from the first one its next query reads); 0 without window layers."""
        if not self.window_layers:
            return 0
        old = max(0, tokens - self.geometry.sliding_window)
        return tokens - old // self.page_size * self.page_size

    def window_needed(self, prefix: int) -> int:
        """Tokens at the end of a ``prefix``-token cached prefix whose window KV a hit needs
        (the pages of its last ``sliding_window - 1`` positions); 0 without window layers."""
        if not self.window_layers:
            return 0
        first = max(0, prefix - self.geometry.sliding_window + 1)
        return prefix - first // self.page_size * self.page_size

    def device(self, tokens: int) -> int:
        """Device bytes a request of ``tokens`` tokens holds (its own state slot included)."""
        return (
            self.full_per_token * tokens
            + self.window_per_token * self.window_held(tokens)
            + self.state
        )

    def all_full_device(self, tokens: int) -> int:
        return self.all_full_per_token * tokens

    def restored(self, prefix: int, restored: int) -> int:
        """Bytes a restore of the last ``restored`` tokens of a ``prefix``-token cached prefix
        moves to the device (0 when ``restored`` is 0)."""
        if not 0 <= restored <= prefix:
            raise InvalidArgumentError(f"restored={restored} must be in 0..prefix={prefix}")
        if restored == 0:
            return 0
        window = self.window_per_token * min(restored, self.window_needed(prefix))
        return self.full_per_token * restored + window + self.state

    def all_full_restored(self, restored: int) -> int:
        return self.all_full_per_token * restored

    def read(self, context: int) -> int:
        """Bytes one decode step of a sequence of ``context`` tokens reads: every full-layer
        position, the window, the state."""
        window = self.window_per_token * min(context, self.geometry.sliding_window)
        return self.full_per_token * context + (window if self.window_layers else 0) + self.state


class HiSparseBytes(KVBytes):
    """A DSA model served HiSparse-style (``HiSparseServing``): each running request keeps on
    the device its fixed buffer of ``buffer_tokens`` latents plus a page (the newest token's),
    and every token's indexer key (the indexer scores them all); a decode step reads the
    ``topk`` selected latents (at most the context) and every indexer key. Restores are
    KVBytes' (a prefix's latents and indexer keys copied into the prefill's staging rows)."""

    def __init__(
        self, geometry: ModelGeometry, page_size: int, buffer_tokens: int, topk: int
    ) -> None:
        super().__init__(geometry, page_size)
        if self.kind != ModelKind.DSA:
            raise InvalidArgumentError(f"HiSparse serves model 'dsa', not {self.kind.value!r}")
        for name, v in (("buffer_tokens", buffer_tokens), ("topk", topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name}={v!r} must be an int >= 1")
        if topk > buffer_tokens:
            raise InvalidArgumentError(f"topk={topk} exceeds the buffer's {buffer_tokens} slots")
        g, item = geometry, geometry.torch_dtype.itemsize
        layers = g.num_layers
        self.latent_per_token = layers * (g.kv_lora_rank + g.qk_rope_head_dim) * item
        self.index_per_token = self.full_per_token - self.latent_per_token
        self.buffer_tokens, self.topk = buffer_tokens, topk

    def device(self, tokens: int) -> int:
        held = min(tokens, self.buffer_tokens + self.page_size)
        return self.latent_per_token * held + self.index_per_token * tokens

    def read(self, context: int) -> int:
        return self.latent_per_token * min(context, self.topk) + self.index_per_token * context

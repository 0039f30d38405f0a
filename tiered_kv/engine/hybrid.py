"""The hybrid variant of the reference model: full attention mixed with a gated linear recurrence.

Layer i is full attention when ``(i + 1) % full_layer_every == 0`` (one full layer per three
linear ones at 4, Qwen3-Next / Kimi-Linear style) and a linear layer otherwise. A linear layer
keeps no per-token KV but a fixed-size per-request state, read and written through a
:class:`StateAccess`:

- ``conv`` ``(conv_dim, conv_kernel - 1)``: the last ``conv_kernel - 1`` inputs of a short causal
  depthwise convolution over ``in_proj(h) = [q, k, v]``, oldest first (zeros before position 0);
- ``temporal`` ``(linear_heads, linear_key_dim, linear_value_dim)``: per head the recurrence
  ``S_t = g_t * S_{t-1} + k_t^T v_t`` with a data-dependent decay ``g_t = sigmoid(h_t w_g + b)``
  in (0, 1), read out as ``o_t = q_t S_t`` (q and k L2-normalised, so S stays bounded).

Determinism is :class:`TinyLlama`'s plus one rule for the state: the convolution and every
projection run over the whole chunk with fixed shapes (a real row's window holds the same
inputs, from the state or from this call, however the sequence was split), and the recurrence
runs over the real rows one token at a time with fixed-shape ops - no scan whose rounding
depends on how many tokens a call holds. Padding rows output zeros and never touch the state,
so the state after position p depends on tokens 0..p only and comes out bit for bit the same for
any split into calls; so do the logits. ``forward(on_boundary=...)`` reports each chunk boundary
the state has just reached, so a serving loop can snapshot it with the page it closes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tiered_kv._checks import check_positive_int
from tiered_kv.engine.model import DenseKV, KVAccess, ModelConfig, TinyLlama
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class HybridModelConfig(ModelConfig):
    full_layer_every: int = 4
    conv_kernel: int = 4
    linear_heads: int = 2
    linear_key_dim: int = 16
    linear_value_dim: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("full_layer_every", self.full_layer_every)
        check_positive_int("conv_kernel", self.conv_kernel, minimum=2)
        for f in ("linear_heads", "linear_key_dim", "linear_value_dim"):
            check_positive_int(f, getattr(self, f))
        if self.full_layer_every > self.num_layers:
            raise InvalidArgumentError(
                f"full_layer_every={self.full_layer_every} with num_layers={self.num_layers} "
                "leaves no full-attention layer (layer i is full iff (i + 1) % full_layer_every "
                f"== 0); expected full_layer_every <= {self.num_layers}"
            )

    def is_full_layer(self, layer: int) -> bool:
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise InvalidArgumentError(
                f"layer={layer!r} is invalid; expected an int in [0, {self.num_layers})"
            )
        return (layer + 1) % self.full_layer_every == 0

    def full_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_full_layer(i)]

    def linear_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_full_layer(i)]

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every linear head."""
        return self.linear_heads * (2 * self.linear_key_dim + self.linear_value_dim)

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def temporal_state_shape(self) -> tuple[int, int, int]:
        return (self.linear_heads, self.linear_key_dim, self.linear_value_dim)


class StateAccess(Protocol):
    def read_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's ``(conv, temporal)`` state of linear layer ``layer`` (global id), float32
        ``conv_state_shape()`` and ``temporal_state_shape()``. The model never mutates them."""

    def write_state(self, layer: int, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        """Replace that state with ``conv`` and ``temporal`` (fresh tensors the model does not
        touch afterwards)."""


class DenseHybridKV(DenseKV):
    """The no-cache reference: :class:`DenseKV` for the full layers (it allocates every layer;
    the linear layers' rows stay unused) and one zero-initialised state per linear layer."""

    def __init__(self, cfg: HybridModelConfig, max_tokens: int) -> None:
        super().__init__(cfg, max_tokens)
        self.cfg = cfg
        ids = cfg.linear_layer_ids()
        self.conv = {i: torch.zeros(cfg.conv_state_shape()) for i in ids}
        self.temporal = {i: torch.zeros(cfg.temporal_state_shape()) for i in ids}

    def _check_layer(self, layer: int) -> None:
        if layer not in self.conv:
            raise InvalidArgumentError(
                f"layer={layer!r} has no recurrent state; linear layers are "
                f"{self.cfg.linear_layer_ids()}"
            )

    def read_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored tensors. write_state replaces them rather than writing into them, so what
        this returned stays a valid snapshot."""
        self._check_layer(layer)
        return self.conv[layer], self.temporal[layer]

    def write_state(self, layer: int, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        """Store copies of ``conv`` and ``temporal``; a wrong shape or dtype raises and changes
        nothing."""
        self._check_layer(layer)
        for name, t, shape in (
            ("conv", conv, self.cfg.conv_state_shape()),
            ("temporal", temporal, self.cfg.temporal_state_shape()),
        ):
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise InvalidArgumentError(
                    f"{name} state of layer {layer} is {tuple(t.shape)} {t.dtype}; expected "
                    f"{shape} torch.float32"
                )
        self.conv[layer], self.temporal[layer] = conv.clone(), temporal.clone()


class TinyHybrid(TinyLlama):
    cfg: HybridModelConfig

    def __init__(self, cfg: HybridModelConfig) -> None:
        if not isinstance(cfg, HybridModelConfig):
            raise InvalidArgumentError(
                f"TinyHybrid needs a HybridModelConfig, got {type(cfg).__name__}"
            )
        super().__init__(cfg)

    def _attention_weights(self, w, g: torch.Generator) -> dict[str, torch.Tensor]:
        # TinyLlama.__init__ builds layer i's weights while self.layers holds layers 0..i-1.
        if self.cfg.is_full_layer(len(self.layers)):
            return super()._attention_weights(w, g)
        c, h = self.cfg, self.cfg.hidden
        heads, dv = c.linear_heads, c.linear_value_dim
        return {
            "w_in": w(h, c.conv_dim, fan_in=h),
            "conv_w": w(c.conv_dim, c.conv_kernel, fan_in=c.conv_kernel),
            "w_gate": w(h, heads, fan_in=h),
            # Gates around sigmoid(3) ~ 0.95: a memory of tens of tokens, so the state matters.
            "gate_bias": 2 + 2 * torch.rand(heads, generator=g),
            "w_out": w(heads * dv, h, fan_in=heads * dv),
        }

    def _attention(self, i, p, h, positions, rows, end, base, chunk, kv) -> torch.Tensor:
        if self.cfg.is_full_layer(i):
            return super()._attention(i, p, h, positions, rows, end, base, chunk, kv)
        return self._linear_mixer(i, p, h, rows, chunk, kv)

    def _linear_mixer(self, i, p, h, rows: slice, chunk: int, kv: StateAccess) -> torch.Tensor:
        """Linear layer ``i``'s output for the whole chunk (zeros on padding rows); absorbs the
        real rows ``rows`` into its state."""
        c = self.cfg
        heads, dk, dv, taps = c.linear_heads, c.linear_key_dim, c.linear_value_dim, c.conv_kernel
        conv_state, s = kv.read_state(i)
        u = h @ p["w_in"]  # (chunk, conv_dim)
        # Column j holds the input of chunk row j - (taps - 1): the state's inputs just before
        # the first real row, then the real rows; the rest are zeros only padding rows see.
        hist = h.new_zeros(c.conv_dim, chunk + taps - 1)
        hist[:, rows.start : rows.start + taps - 1] = conv_state
        hist[:, rows.start + taps - 1 : rows.stop + taps - 1] = u[rows].T
        new_conv = hist[:, rows.stop : rows.stop + taps - 1].clone()
        a = F.silu(F.conv1d(hist[None], p["conv_w"][:, None, :], groups=c.conv_dim)[0].T)
        q, k, v = a.split([heads * dk, heads * dk, heads * dv], dim=-1)
        q = F.normalize(q.reshape(chunk, heads, dk), dim=-1)
        k = F.normalize(k.reshape(chunk, heads, dk), dim=-1)
        v = v.reshape(chunk, heads, dv)
        gate = torch.sigmoid(h @ p["w_gate"] + p["gate_bias"])  # (chunk, heads)
        out = h.new_zeros(chunk, heads, dv)
        for r in range(rows.start, rows.stop):
            s = s * gate[r, :, None, None] + k[r, :, :, None] * v[r, :, None, :]
            out[r] = torch.einsum("hk,hkv->hv", q[r], s)
        kv.write_state(i, new_conv, s)
        return out.reshape(chunk, heads * dv) @ p["w_out"]

    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: KVAccess,
        chunk: int,
        *,
        on_boundary: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start..``, as :meth:`TinyLlama.forward`; ``kv``
        also implements :class:`StateAccess` and holds the state left by the calls before.
        ``on_boundary(P)`` is called each time every layer has absorbed token ``P - 1`` with
        ``P`` a multiple of ``chunk`` (the end of this call included): the state, and the KV of
        ``0..P-1``, are then those of the prefix ``0..P-1``."""
        check_positive_int("chunk", chunk)
        check_positive_int("start", start, minimum=0)
        if len(tokens) == 0:
            raise InvalidArgumentError("forward needs at least one token")
        if linear := self.cfg.linear_layer_ids():
            if not (hasattr(kv, "read_state") and hasattr(kv, "write_state")):
                raise InvalidArgumentError(
                    f"{type(kv).__name__} has no read_state/write_state; linear layers {linear} "
                    "need a StateAccess (e.g. DenseHybridKV)"
                )
        out = []
        pos, stop = start, start + len(tokens)
        while pos < stop:
            end = min(stop, (pos // chunk + 1) * chunk)
            out.append(super().forward(tokens[pos - start : end - start], pos, kv, chunk))
            if on_boundary is not None and end % chunk == 0:
                on_boundary(end)
            pos = end
        return torch.cat(out)

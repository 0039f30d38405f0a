"""A small Llama-style decoder in torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights are random from a fixed seed (the point is the KV path, not the text). The model reads
and writes KV only through a :class:`KVAccess` (the paged device pool in serving, dense tensors
for the no-cache reference), so the same forward serves both.

Determinism: every per-token computation runs in chunks of ``chunk`` rows aligned to absolute
positions (``chunk`` = the KV page size), and a chunk is always computed whole: the positions of
the chunk that this call does not compute (earlier tokens, whose KV is already stored, and later
ones) are padding rows, and attention for the chunk ``b..b+chunk-1`` always reads keys
``0..b+chunk-1`` (padding past the last real token, masked for every real row). Every op
therefore sees the same shapes, and each real row the same operands, however the sequence was
split into calls: a prefill in one piece or several, or a token produced by a decode step. A
token's KV comes out bit for bit the same whether it was computed in an earlier request (and
restored from host or disk) or now, so on CPU the logits of a request served from restored KV -
including a multi-turn history that holds decoded tokens - equal, bit for bit, the logits with
caching disabled. The price is a decode step that costs a whole chunk's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
        ):
            check_positive_int(f, getattr(self, f))
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim={self.head_dim} must be even (RoPE pairs)")
        for f, positive in (("rope_theta", True), ("norm_eps", False)):
            v = getattr(self, f)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < 0 or (positive and v == 0):
                bound = "> 0" if positive else ">= 0"
                raise InvalidArgumentError(
                    f"{f}={v!r} is invalid; expected a finite number {bound}"
                )


def kv_shapes(cfg) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Per-token (heads, dim) of the K and V a model stores; V None when K holds both (MLA)."""
    if hasattr(cfg, "kv_lora_rank"):
        return (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), None
    return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)


class KVAccess(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V (``(n, kv_heads, head_dim)``) of the tokens being computed."""

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the request's tokens ``0..end-1`` (``(end, kv_heads, head_dim)``)."""


class DenseKV:
    """KV in plain per-layer tensors: the reference with caching disabled."""

    def __init__(self, cfg: ModelConfig, max_tokens: int) -> None:
        k_shape, v_shape = kv_shapes(cfg)
        self.k = [torch.empty((max_tokens, *k_shape)) for _ in range(cfg.num_layers)]
        self.v = (
            [torch.empty((max_tokens, *v_shape)) for _ in range(cfg.num_layers)]
            if v_shape is not None
            else None
        )
        self.start = 0  # position of the first row being written

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.k[layer][self.start : self.start + len(k)] = k
        if self.v is not None:
            self.v[layer][self.start : self.start + len(v)] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.k[layer][:end], (self.v[layer][:end] if self.v is not None else None)


class TinyLlama:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        h = cfg.hidden
        self.embed = torch.randn(cfg.vocab_size, h, generator=g)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                {
                    "attn_norm": 1 + 0.1 * torch.randn(h, generator=g),
                    **self._attention_weights(w, g),
                    "mlp_norm": 1 + 0.1 * torch.randn(h, generator=g),
                    "w1": w(h, cfg.intermediate, fan_in=h),
                    "w3": w(h, cfg.intermediate, fan_in=h),
                    "w2": w(cfg.intermediate, h, fan_in=cfg.intermediate),
                }
            )
        self.final_norm = 1 + 0.1 * torch.randn(h, generator=g)
        self.lm_head = w(h, cfg.vocab_size, fan_in=h)
        rd = self._rope_dim()
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        self._inv_freq = inv

    def _rope_dim(self) -> int:
        return self.cfg.head_dim

    def _attention_weights(self, w, g: torch.Generator) -> dict[str, torch.Tensor]:
        cfg, h, hd = self.cfg, self.cfg.hidden, self.cfg.head_dim
        return {
            "wq": w(h, cfg.num_heads * hd, fan_in=h),
            "wk": w(h, cfg.num_kv_heads * hd, fan_in=h),
            "wv": w(h, cfg.num_kv_heads * hd, fan_in=h),
            "wo": w(cfg.num_heads * hd, h, fan_in=cfg.num_heads * hd),
        }

    # -- pieces -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = angles.cos().to(x.dtype)[:, None, :]
        sin = angles.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def _window(self, layer: int) -> int | None:
        """Keys a query of ``layer`` sees (its own included), None: all earlier ones."""
        return None

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal GQA for queries at positions ``start..start+n-1`` over keys ``0..start+n-1``
        (only the last ``window`` of them per query when given)."""
        cfg = self.cfg
        n, end = q.shape[0], k.shape[0]
        group = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # (end, heads, hd)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        pos_q = torch.arange(start, start + n)[:, None]
        mask = torch.arange(end)[None, :] > pos_q
        if window is not None:
            mask |= torch.arange(end)[None, :] <= pos_q - window
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, cfg.num_heads * cfg.head_dim)

    @staticmethod
    def _pad_keys(t: torch.Tensor | None, end: int, full: int) -> torch.Tensor | None:
        """Keys past the last real token (masked for every real row), so every call of a
        chunk attends over the same number of keys."""
        if t is None or end >= full:
            return t
        return torch.cat([t, t.new_zeros(full - end, *t.shape[1:])])

    def _attention(self, i, p, h, positions, rows, end, base, chunk, kv) -> torch.Tensor:
        """One layer's attention output (before the residual) for the whole chunk."""
        cfg, hd = self.cfg, self.cfg.head_dim
        q = self._rope((h @ p["wq"]).view(chunk, cfg.num_heads, hd), positions)
        k = self._rope((h @ p["wk"]).view(chunk, cfg.num_kv_heads, hd), positions)
        v = (h @ p["wv"]).view(chunk, cfg.num_kv_heads, hd)
        kv.write(i, k[rows], v[rows])
        keys, values = kv.read(i, end)
        keys = self._pad_keys(keys, end, base + chunk)
        values = self._pad_keys(values, end, base + chunk)
        return self._attend(q, keys, values, base, self._window(i)) @ p["wo"]

    # -- forward ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, start: int, kv: KVAccess, chunk: int) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start..``; their KV goes to ``kv``, earlier
        positions' KV comes from it. Any ``start`` works (a prefill after a page-aligned cached
        prefix, a decode step mid-chunk): see the module docstring."""
        check_positive_int("chunk", chunk)
        check_positive_int("start", start, minimum=0)
        if len(tokens) == 0:
            raise InvalidArgumentError("forward needs at least one token")
        out = []
        pos = start
        tokens = tokens.to(torch.int64)
        while pos < start + len(tokens):
            base = pos // chunk * chunk
            end = min(start + len(tokens), base + chunk)
            out.append(self._forward_chunk(tokens[pos - start : end - start], pos, base, chunk, kv))
            pos = end
        return torch.cat(out)

    def _forward_chunk(
        self, tokens: torch.Tensor, start: int, base: int, chunk: int, kv: KVAccess
    ) -> torch.Tensor:
        """Tokens at positions ``start..start+n-1`` of the chunk ``base..base+chunk-1``. The
        chunk is always computed whole, the rows of other positions as padding: every op sees
        the same shapes, and each real row the same operands, however the sequence was split
        into calls (prefill pieces, decode steps) - so its K, V and logits are the same bits."""
        n = len(tokens)
        rows = slice(start - base, start - base + n)
        end = start + n
        positions = torch.arange(base, base + chunk)
        padded = torch.zeros(chunk, dtype=torch.int64)
        padded[rows] = tokens
        if hasattr(kv, "start"):
            kv.start = start
        x = self.embed[padded]
        for i, p in enumerate(self.layers):
            h = self._rms(x, p["attn_norm"])
            x = x + self._attention(i, p, h, positions, rows, end, base, chunk, kv)
            h = self._rms(x, p["mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        return (self._rms(x, self.final_norm) @ self.lm_head)[rows]

"""The MLA variant of the reference model (multi-head latent attention, DeepSeek-style).

Per token and layer the cache holds one latent: ``kv_lora_rank`` compressed KV columns (after
an RMSNorm) followed by ``qk_rope_head_dim`` rotary key columns shared by all heads - what an
``MLATokenToKVPool`` stores. Attention expands the latent per head: K = [latent @ W_uk, rope
key], V = latent @ W_uv. Everything else (chunk-aligned whole-chunk forward, SwiGLU, norms) is
:class:`TinyLlama`'s, so restored latents give bitwise-equal logits the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.engine.model import ModelConfig, TinyLlama
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class MLAModelConfig(ModelConfig):
    num_kv_heads: int = 1  # one latent per token
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive_int(f, getattr(self, f))
        if self.qk_rope_head_dim % 2:
            raise InvalidArgumentError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)"
            )
        if self.num_kv_heads != 1:
            raise InvalidArgumentError(
                f"num_kv_heads={self.num_kv_heads}: an MLA model stores one latent per token (1)"
            )


class TinyMLA(TinyLlama):
    cfg: MLAModelConfig

    def __init__(self, cfg: MLAModelConfig) -> None:
        if not isinstance(cfg, MLAModelConfig):
            raise InvalidArgumentError(f"TinyMLA needs an MLAModelConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    def _rope_dim(self) -> int:
        return self.cfg.qk_rope_head_dim

    def _attention_weights(self, w, g: torch.Generator) -> dict[str, torch.Tensor]:
        c, h = self.cfg, self.cfg.hidden
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        return {
            "wq": w(h, c.num_heads * qk, fan_in=h),
            "w_dkv": w(h, c.kv_lora_rank, fan_in=h),
            "kv_norm": 1 + 0.1 * torch.randn(c.kv_lora_rank, generator=g),
            "w_kr": w(h, c.qk_rope_head_dim, fan_in=h),
            "w_uk": w(c.kv_lora_rank, c.num_heads * c.qk_nope_head_dim, fan_in=c.kv_lora_rank),
            "w_uv": w(c.kv_lora_rank, c.num_heads * c.v_head_dim, fan_in=c.kv_lora_rank),
            "wo": w(c.num_heads * c.v_head_dim, h, fan_in=c.num_heads * c.v_head_dim),
        }

    def _mask_keys(self, i, p, h, mask, rows, end, base, chunk, kv) -> torch.Tensor:
        """The (queries, keys) mask of keys a query does not attend to: the causal mask here;
        a sparse variant also masks the keys its indexer did not select."""
        return mask

    def _attention(self, i, p, h, positions, rows, end, base, chunk, kv) -> torch.Tensor:
        q, latent = self._query_and_latent(p, h, positions, chunk)
        kv.write(i, latent[rows], None)
        stored, _ = kv.read(i, end)
        stored = self._pad_keys(stored, end, base + chunk)  # (keys, 1, rank + rope)
        mask = torch.arange(stored.shape[0])[None, :] > positions[:, None]
        mask = self._mask_keys(i, p, h, mask, rows, end, base, chunk, kv)
        return self._attend_latent(p, q, stored, mask, chunk)

    def _query_and_latent(self, p, h, positions, chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's queries and what it stores per token: latent and RoPE key, ``(chunk, 1,
        rank + rope)``."""
        c = self.cfg
        heads, nope, rope = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q = (h @ p["wq"]).view(chunk, heads, nope + rope)
        q = torch.cat([q[..., :nope], self._rope(q[..., nope:], positions)], dim=-1)
        latent = self._rms(h @ p["w_dkv"], p["kv_norm"])
        k_rope = self._rope((h @ p["w_kr"]).view(chunk, 1, rope), positions)
        return q, torch.cat([latent[:, None, :], k_rope], dim=-1)

    def _attend_latent(self, p, q, stored, mask, chunk) -> torch.Tensor:
        """Attention of ``q`` over the stored latents (keys past ``mask`` hidden), projected."""
        c = self.cfg
        heads, nope, rope = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        rank = c.kv_lora_rank
        n_keys = stored.shape[0]
        c_kv, kr = stored[:, 0, :rank], stored[:, :, rank:]
        k = torch.cat(
            [(c_kv @ p["w_uk"]).view(n_keys, heads, nope), kr.expand(n_keys, heads, rope)], dim=-1
        )
        v = (c_kv @ p["w_uv"]).view(n_keys, heads, c.v_head_dim)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(nope + rope)
        probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(chunk, heads * c.v_head_dim)
        return out @ p["wo"]

"""The DSA variant of the reference model: MLA plus a sparse-attention indexer (DeepSeek V3.2).

Per token and layer the cache holds the MLA latent and an indexer key of ``index_head_dim``
elements (stored as fp8 with block scales, what a ``DSATokenToKVPool`` holds). Each query scores
every earlier key with its own indexer query against the stored (dequantized) indexer keys and
attends only to its ``index_topk`` best; the rest is :class:`TinyMLA`'s. The reference run
without a cache stores the indexer keys through the same quantization (``DenseDSAKV``), so a
request served from restored latents and indexer keys gives bitwise-equal logits, and a
corrupted indexer key changes which keys are selected (and the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.dsa_pool import QUANT_BLOCK, dequantize_index_k, quantize_index_k
from tiered_kv.engine.mla import MLAModelConfig, TinyMLA
from tiered_kv.engine.model import DenseKV
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class DSAModelConfig(MLAModelConfig):
    index_head_dim: int = 128
    index_topk: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("index_topk", self.index_topk)
        check_positive_int("index_head_dim", self.index_head_dim)
        if self.index_head_dim % QUANT_BLOCK:
            raise InvalidArgumentError(
                f"index_head_dim={self.index_head_dim} must be a multiple of {QUANT_BLOCK}"
            )


class DenseDSAKV(DenseKV):
    """The no-cache reference: latents as :class:`DenseKV`, indexer keys quantized as the
    pool stores them."""

    def __init__(self, cfg: DSAModelConfig, max_tokens: int) -> None:
        super().__init__(cfg, max_tokens)
        row = cfg.index_head_dim + 4 * (cfg.index_head_dim // QUANT_BLOCK)
        self.index = [
            torch.zeros((max_tokens, row), dtype=torch.uint8) for _ in range(cfg.num_layers)
        ]
        self.index_head_dim = cfg.index_head_dim

    def write_index(self, layer: int, keys: torch.Tensor) -> None:
        self.index[layer][self.start : self.start + len(keys)] = quantize_index_k(keys)

    def read_index(self, layer: int, end: int) -> torch.Tensor:
        return dequantize_index_k(self.index[layer][:end], self.index_head_dim)


class TinyDSA(TinyMLA):
    cfg: DSAModelConfig

    def __init__(self, cfg: DSAModelConfig) -> None:
        if not isinstance(cfg, DSAModelConfig):
            raise InvalidArgumentError(f"TinyDSA needs a DSAModelConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    def _attention_weights(self, w, g: torch.Generator) -> dict[str, torch.Tensor]:
        c, h = self.cfg, self.cfg.hidden
        return {
            **super()._attention_weights(w, g),
            "w_iq": w(h, c.index_head_dim, fan_in=h),
            "w_ik": w(h, c.index_head_dim, fan_in=h),
        }

    def _mask_keys(self, i, p, h, mask, rows, end, base, chunk, kv) -> torch.Tensor:
        c = self.cfg
        kv.write_index(i, (h @ p["w_ik"])[rows])
        keys = self._pad_keys(kv.read_index(i, end), end, base + chunk)
        scores = (h @ p["w_iq"]) @ keys.T  # (queries, keys)
        scores = scores.masked_fill(mask, float("-inf"))
        k = min(c.index_topk, scores.shape[1])
        picked = torch.zeros_like(mask)
        picked.scatter_(1, scores.topk(k, dim=1).indices, True)
        return mask | ~picked

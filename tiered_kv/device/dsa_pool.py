"""DSATokenToKVPool: an MLA pool plus the sparse-attention indexer's key cache (DeepSeek V3.2).

Every token of every layer has, besides its latent, one indexer key of ``index_head_dim``
elements, stored as fp8 (e4m3) bytes with one float32 scale per ``QUANT_BLOCK`` elements (the
block's absolute maximum over the e4m3 maximum). Unlike SGLang, which packs a page's keys and
then its scales, each slot's row here is its key bytes followed by its scale bytes, so the
indexer cache is a per-token record like every other host part and moves with the same copies.

``host_pool_decls()`` returns the KV pool's declaration *and* the dependent indexer pool's
(``indexer``, kind ``dsa_indexer``, uint8, the same layers and slots): the owner declares every
byte it holds, as the seed's contract says, and a page is whole only with both.
"""

from __future__ import annotations

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.pool_decl import HostPart, HostPoolDecl
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed

QUANT_BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def quantize_index_k(index_k: torch.Tensor) -> torch.Tensor:
    """(n, d) floating keys -> (n, d + 4 * d / QUANT_BLOCK) uint8 rows: fp8 bytes, then the
    float32 scale of each block (an all-zero block gets scale 1)."""
    n, d = index_k.shape
    blocks = index_k.to(torch.float32).reshape(n, d // QUANT_BLOCK, QUANT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).to(FP8).reshape(n, d).view(torch.uint8)
    return torch.cat([q, scale.reshape(n, -1).contiguous().view(torch.uint8)], dim=1)


def dequantize_index_k(rows: torch.Tensor, index_head_dim: int) -> torch.Tensor:
    """The inverse view of ``quantize_index_k``'s rows: (n, index_head_dim) float32."""
    n = rows.shape[0]
    q = rows[:, :index_head_dim].contiguous().view(FP8).to(torch.float32)
    scale = rows[:, index_head_dim:].contiguous().view(torch.float32)
    blocks = q.reshape(n, index_head_dim // QUANT_BLOCK, QUANT_BLOCK) * scale[..., None]
    return blocks.reshape(n, index_head_dim)


class DSATokenToKVPool(MLATokenToKVPool):
    """The MLA latent per token and layer, and the indexer's quantized key with its scales."""

    host_pool_kind = "mla"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device | None = None,
        *,
        index_head_dim: int = 128,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        super().__init__(
            size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device,
            start_layer=start_layer, end_layer=end_layer,
        )  # fmt: skip
        self.index_head_dim = check_positive_int("index_head_dim", index_head_dim)
        if index_head_dim % QUANT_BLOCK:
            raise InvalidArgumentError(
                f"index_head_dim={index_head_dim} must be a multiple of the {QUANT_BLOCK}-element "
                "quantization block"
            )
        self.index_row_bytes = index_head_dim + 4 * (index_head_dim // QUANT_BLOCK)
        self._check_fits(self.index_row_bytes, "indexer keys")
        self.index_k_with_scale_buffer = [
            empty_zeroed((self.num_slots, self.index_row_bytes), torch.uint8, self.device)
            for _ in range(layer_num)
        ]

    def buffers(self) -> list[torch.Tensor]:
        return [*self.kv_buffer, *self.index_k_with_scale_buffer]

    # -- the indexer cache ----------------------------------------------------------------------
    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s raw rows (uint8: fp8 key bytes, then float32 scale bytes)."""
        return self.index_k_with_scale_buffer[self._ready_layer(layer_id)]

    def get_index_k(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """The dequantized indexer keys of slots ``loc``: (len(loc), index_head_dim) float32."""
        rows = self.get_index_k_with_scale_buffer(layer_id)[loc]
        return dequantize_index_k(rows, self.index_head_dim)

    def set_index_k_buffer(
        self, layer_id: int, write_loc: KVWriteLoc | torch.Tensor, index_k: torch.Tensor
    ) -> None:
        """Quantize ``index_k`` (n, index_head_dim) and write it at ``write_loc``."""
        n = self._num_tokens("index_k", index_k)
        local, loc = self._write_target(layer_id, write_loc, n, "set_index_k_buffer")
        if tuple(index_k.shape) != (n, self.index_head_dim) or not index_k.is_floating_point():
            raise InvalidArgumentError(
                f"index_k has shape {tuple(index_k.shape)} and dtype {index_k.dtype}; expected "
                f"({n}, {self.index_head_dim}) floating"
            )
        rows = quantize_index_k(index_k.to(self.device))
        self.index_k_with_scale_buffer[local][loc] = rows

    # -- host tier ------------------------------------------------------------------------------
    def host_pool_decls(self) -> tuple[HostPoolDecl, ...]:
        (kv,) = super().host_pool_decls()
        indexer = HostPoolDecl(
            name="indexer",
            kind="dsa_indexer",
            device_pool=self,
            parts=(
                HostPart(
                    "index_k_with_scale",
                    (self.index_row_bytes,),
                    lambda i: self.index_k_with_scale_buffer[i],
                ),
            ),
            dtype=torch.uint8,
            layer_ids=kv.layer_ids,
            page_size=self.page_size,
            num_slots=self.num_slots,
        )
        return (kv, indexer)

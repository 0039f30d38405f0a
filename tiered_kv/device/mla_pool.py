"""MLA pool: one latent per token and layer, shared by every head."""

from __future__ import annotations

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.pool_decl import HostPart
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed


class MLATokenToKVPool(KVCache):
    """One ``(size + page_size, 1, kv_lora_rank + qk_rope_head_dim)`` tensor per layer.

    "K" is the whole latent (the compressed part then the RoPE part); "V" is no separate
    buffer but the first ``kv_lora_rank`` columns of the same one (a view), which attention
    up-projects. Bytes: L * T * (r + d_r) * b, with no head count in it.
    """

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
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer)
        self.kv_lora_rank = check_positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_rope_head_dim = check_positive_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self._check_fits(self.bytes_per_token_per_layer())
        self.kv_buffer = [
            empty_zeroed((self.num_slots, 1, self.kv_cache_dim), self.store_dtype, self.device)
            for _ in range(layer_num)
        ]

    host_pool_kind = "mla"

    def buffers(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)

    def _host_parts(self) -> tuple[HostPart, ...]:
        return (HostPart("kv", (1, self.kv_cache_dim), lambda i: self.kv_buffer[i]),)

    def bytes_per_token_per_layer(self) -> int:
        return self.kv_cache_dim * torch.empty((), dtype=self.store_dtype).element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.kv_buffer[self._ready_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.kv_buffer[self._ready_layer(layer_id)])[..., : self.kv_lora_rank]

    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write whole latents ``cache_k`` of shape (n, 1, r + d_r). ``cache_v`` must be None:
        V is part of the latent."""
        if cache_v is not None:
            raise InvalidArgumentError(
                "MLATokenToKVPool: V is the first kv_lora_rank columns of K; pass cache_v=None"
            )
        n = self._num_tokens("cache_k", cache_k)
        local, loc = self._write_target(layer_id, write_loc, n, "MLATokenToKVPool.set_kv_buffer")
        k = self._to_store("cache_k", cache_k, (n, 1, self.kv_cache_dim), k_scale)
        self.kv_buffer[local][loc] = k

    def set_mla_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
    ) -> None:
        """Write the latent from its two parts, (n, 1, r) and (n, 1, d_r)."""
        if not isinstance(cache_k_nope, torch.Tensor) or not isinstance(cache_k_rope, torch.Tensor):
            raise InvalidArgumentError("cache_k_nope and cache_k_rope must be tensors")
        n = self._num_tokens("cache_k_nope", cache_k_nope)
        m = self._num_tokens("cache_k_rope", cache_k_rope)
        if m != n:
            raise InvalidArgumentError(
                f"cache_k_rope has {m} tokens but cache_k_nope has {n}; they must be equal"
            )
        for name, part, width in (
            ("cache_k_nope", cache_k_nope, self.kv_lora_rank),
            ("cache_k_rope", cache_k_rope, self.qk_rope_head_dim),
        ):
            if tuple(part.shape) not in ((n, 1, width), (n, width)):
                raise InvalidArgumentError(
                    f"{name} has shape {tuple(part.shape)}; expected ({n}, 1, {width}) or "
                    f"({n}, {width})"
                )
        nope = cache_k_nope.reshape(n, 1, self.kv_lora_rank)
        rope = cache_k_rope.reshape(n, 1, self.qk_rope_head_dim).to(nope.dtype)
        self.set_kv_buffer(layer_id, write_loc, torch.cat([nope, rope], dim=-1), None)

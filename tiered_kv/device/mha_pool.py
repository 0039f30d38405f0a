"""MHA/GQA pools: separate K and V tensors per layer, and a K-only variant."""

from __future__ import annotations

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.pool_decl import HostPart
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, LayoutError
from tiered_kv.hugepages import empty_zeroed


class MHATokenToKVPool(KVCache):
    """K and V per layer, each ``(size + page_size, head_num, head_dim)``; V may have its own
    head dim (``v_head_dim``). Bytes: 2 * L * T * H * d * b when the head dims are equal."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device | None = None,
        *,
        v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer)
        self.head_num = check_positive_int("head_num", head_num)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.v_head_dim = (
            head_dim if v_head_dim is None else check_positive_int("v_head_dim", v_head_dim)
        )
        self._create_buffers()

    def _create_buffers(self) -> None:
        # One tensor per layer, so each layer has its own address for layer-wise transfers and
        # per-layer waits. Zero-filled: the padding slot must hold finite values.
        self._check_fits(self.bytes_per_token_per_layer())
        rows = self.num_slots
        self.k_buffer = [
            empty_zeroed((rows, self.head_num, self.head_dim), self.store_dtype, self.device)
            for _ in range(self.layer_num)
        ]
        self.v_buffer = [
            empty_zeroed((rows, self.head_num, self.v_head_dim), self.store_dtype, self.device)
            for _ in range(self.layer_num)
        ]

    host_pool_kind = "mha"

    def buffers(self) -> list[torch.Tensor]:
        return [*self.k_buffer, *self.v_buffer]

    def _host_parts(self) -> tuple[HostPart, ...]:
        return (
            HostPart("k", (self.head_num, self.head_dim), lambda i: self.k_buffer[i]),
            HostPart("v", (self.head_num, self.v_head_dim), lambda i: self.v_buffer[i]),
        )

    def bytes_per_token_per_layer(self) -> int:
        item = torch.empty((), dtype=self.store_dtype).element_size()
        return self.head_num * (self.head_dim + self.v_head_dim) * item

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[self._ready_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[self._ready_layer(layer_id)])

    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        if cache_v is None:
            raise InvalidArgumentError("MHATokenToKVPool.set_kv_buffer needs cache_v; got None")
        n = self._num_tokens("cache_k", cache_k)
        local, loc = self._write_target(layer_id, write_loc, n, "MHATokenToKVPool.set_kv_buffer")
        k = self._to_store("cache_k", cache_k, (n, self.head_num, self.head_dim), k_scale)
        v = self._to_store("cache_v", cache_v, (n, self.head_num, self.v_head_dim), v_scale)
        self.k_buffer[local][loc] = k
        self.v_buffer[local][loc] = v


class MHATokenToKOnlyPool(KVCache):
    """Only K per layer, ``(size + page_size, head_num, head_dim)``, for architectures that cache
    no V. Asking for V is a :class:`LayoutError`; passing V to a write is refused."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device | None = None,
        *,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer)
        self.head_num = check_positive_int("head_num", head_num)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self._check_fits(self.bytes_per_token_per_layer())
        self.k_buffer = [
            empty_zeroed((self.num_slots, head_num, head_dim), self.store_dtype, self.device)
            for _ in range(layer_num)
        ]

    host_pool_kind = "k_only"

    def buffers(self) -> list[torch.Tensor]:
        return list(self.k_buffer)

    def _host_parts(self) -> tuple[HostPart, ...]:
        return (HostPart("k", (self.head_num, self.head_dim), lambda i: self.k_buffer[i]),)

    def bytes_per_token_per_layer(self) -> int:
        return (
            self.head_num * self.head_dim * torch.empty((), dtype=self.store_dtype).element_size()
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[self._ready_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise LayoutError(f"MHATokenToKOnlyPool stores no V (layer {layer_id}); use get_key_buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return self.get_key_buffer(layer_id), None

    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        if cache_v is not None:
            raise InvalidArgumentError(
                "MHATokenToKOnlyPool stores no V; call set_kv_buffer with cache_v=None"
            )
        n = self._num_tokens("cache_k", cache_k)
        local, loc = self._write_target(layer_id, write_loc, n, "MHATokenToKOnlyPool.set_kv_buffer")
        k = self._to_store("cache_k", cache_k, (n, self.head_num, self.head_dim), k_scale)
        self.k_buffer[local][loc] = k

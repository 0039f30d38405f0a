"""HiSparseIndexKeys: the DSA indexer's keys of every logical slot, kept on the device.

Under HiSparse a token's latent is on the device only while its layer selects it, but the
indexer must score *every* earlier token each decode step to make that selection, so its keys
have to be readable for all of them. They stay on the device: a key row is
``index_head_dim + 4 * index_head_dim / QUANT_BLOCK`` bytes (132 at DeepSeek-V3.2's 128) against
the latent's 1,152 (576 bf16 columns), about a tenth of the full layout, whereas reading them
from host would cross the host link with every earlier token's keys on every decode step and
layer (at 64k tokens x 61 layers, ~0.5 GB a step). SGLang makes the same choice (its HiSparse
DSA pool sizes the indexer cache at ``size * host_to_device_ratio``).

Rows are indexed by *logical* slot (the HiSparse allocator's ``size`` plus its padding page),
one ``uint8`` tensor per layer of the DSA pool, bytes exactly as the pool stores them
(``quantize_index_k``'s fp8 key bytes, then the float32 scales). The device pool's own
indexer rows serve a token while it holds a device slot (its prefill, the newest decode
token); ``copy_from_device`` takes them over before that slot goes back.
"""

from __future__ import annotations

import torch

from tiered_kv._checks import check_index_tensor, check_range
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool, dequantize_index_k
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed


class HiSparseIndexKeys:
    """Indexer key rows of every logical slot of ``allocator``, for every layer of ``pool``."""

    def __init__(self, allocator: HiSparseTokenToKVPoolAllocator, pool: DSATokenToKVPool) -> None:
        if not isinstance(pool, DSATokenToKVPool):
            raise InvalidArgumentError(
                f"HiSparseIndexKeys mirrors a DSATokenToKVPool's indexer; got {type(pool).__name__}"
            )
        if allocator.get_kvcache() is not pool:
            raise InvalidArgumentError("allocator belongs to another device pool")
        self.pool = pool
        self.index_head_dim = pool.index_head_dim
        self.row_bytes = pool.index_row_bytes
        self.num_rows = allocator.size + allocator.page_size  # logical slots and the padding
        self.buffer = [
            empty_zeroed((self.num_rows, self.row_bytes), torch.uint8, pool.device)
            for _ in range(pool.layer_num)
        ]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffer)

    def bytes_per_token_per_layer(self) -> int:
        return self.row_bytes

    def _checked(self, name: str, idx: torch.Tensor, low: int, high: int) -> torch.Tensor:
        check_index_tensor(name, idx, self.pool.device)
        check_range(name, idx, low, high)
        return idx.to(torch.int64)

    def copy_from_device(self, logical: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Every layer's indexer rows of device slots ``device_slots`` into rows ``logical``
        (pairwise). Mutates those rows only; raises InvalidArgumentError before copying on bad
        input."""
        lg = self._checked("logical", logical, 1, self.num_rows)
        dev = self._checked("device_slots", device_slots, 1, self.pool.num_slots)
        if lg.shape != dev.shape:
            raise InvalidArgumentError(
                f"logical has {lg.numel()} entries and device_slots {dev.numel()}; they pair up"
            )
        for mine, theirs in zip(self.buffer, self.pool.index_k_with_scale_buffer, strict=True):
            mine[lg] = theirs[dev]

    def get_rows(self, layer_id: int, logical: torch.Tensor) -> torch.Tensor:
        """Raw rows (uint8) of logical slots ``logical`` in global layer ``layer_id``."""
        lg = self._checked("logical", logical, 0, self.num_rows)
        return self.buffer[self.pool.layer_index(layer_id)][lg]

    def get_index_k(self, layer_id: int, logical: torch.Tensor) -> torch.Tensor:
        """Dequantized keys of ``logical``: (len(logical), index_head_dim) float32."""
        return dequantize_index_k(self.get_rows(layer_id, logical), self.index_head_dim)

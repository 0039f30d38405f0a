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

``copy_from_device`` copies every layer's rows in one call of the native block copier
(``kernels.transfer_native.copy_blocks``, ``copy_mode="blocks"``: CPU pools where it builds,
the ``"auto"`` choice there) on addresses computed with numpy after the indices' range is
checked; elsewhere (``"torch"``) one gather and scatter per layer. A decode token's commit
copies one row per layer: at 61 layers the 122 torch index calls cost ~0.3 ms (~1 ms in a
loaded run), the block copy ~10 us besides the checks. ``get_rows`` on CPU is numpy's
``take`` (torch's indexing copies ``uint8`` rows byte by byte, ~7x slower).
"""

from __future__ import annotations

import numpy as np
import torch

from tiered_kv._checks import check_index_tensor, check_range
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool, dequantize_index_k
from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed
from tiered_kv.kernels import native_available
from tiered_kv.kernels.transfer_native import copy_blocks

COPY_MODES = ("auto", "blocks", "torch")


class HiSparseIndexKeys:
    """Indexer key rows of every logical slot of ``allocator``, for every layer of ``pool``."""

    def __init__(
        self,
        allocator: HiSparseTokenToKVPoolAllocator,
        pool: DSATokenToKVPool,
        *,
        copy_mode: str = "auto",
    ) -> None:
        if not isinstance(pool, DSATokenToKVPool):
            raise InvalidArgumentError(
                f"HiSparseIndexKeys mirrors a DSATokenToKVPool's indexer; got {type(pool).__name__}"
            )
        if allocator.get_kvcache() is not pool:
            raise InvalidArgumentError("allocator belongs to another device pool")
        if copy_mode not in COPY_MODES:
            raise InvalidArgumentError(f"copy_mode={copy_mode!r}; use one of {COPY_MODES}")
        cpu = pool.device.type == "cpu"
        if copy_mode == "auto":
            copy_mode = "blocks" if cpu and native_available() else "torch"
        elif copy_mode == "blocks" and not cpu:
            raise InvalidArgumentError(
                f"copy_mode='blocks' copies CPU pools; use 'torch' on {pool.device}"
            )
        elif copy_mode == "blocks" and not native_available():
            raise BackendUnavailableError("copy_mode='blocks' needs the native copier; use 'torch'")
        self.copy_mode = copy_mode
        self.pool = pool
        self.index_head_dim = pool.index_head_dim
        self.row_bytes = pool.index_row_bytes
        self.num_rows = allocator.size + allocator.page_size  # logical slots and the padding
        self.buffer = [
            empty_zeroed((self.num_rows, self.row_bytes), torch.uint8, pool.device)
            for _ in range(pool.layer_num)
        ]
        # Every layer's first row, as addresses: ours, and the pool's (allocated once with the
        # pool, (num_slots, row_bytes) contiguous; never reassigned)
        self._ptrs = _addresses(self.buffer)
        self._pool_ptrs = _addresses(pool.index_k_with_scale_buffer)
        self._np = [b.numpy() for b in self.buffer] if cpu else None  # views of the same memory

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
        if self.copy_mode == "torch":
            for mine, theirs in zip(self.buffer, self.pool.index_k_with_scale_buffer, strict=True):
                mine[lg] = theirs[dev]
            return
        # Both ranges are checked above: every address is inside its layer's rows
        rb = self.row_bytes
        dst = (self._ptrs + lg.numpy() * rb).ravel()
        copy_blocks(dst, (self._pool_ptrs + dev.numpy() * rb).ravel(), rb)

    def get_rows(self, layer_id: int, logical: torch.Tensor) -> torch.Tensor:
        """Raw rows (uint8) of logical slots ``logical`` in global layer ``layer_id``."""
        lg = self._checked("logical", logical, 0, self.num_rows)
        local = self.pool.layer_index(layer_id)
        if self._np is not None:  # numpy's take copies whole rows: ~7x torch's indexing
            return torch.from_numpy(np.take(self._np[local], lg.numpy(), axis=0))
        return self.buffer[local][lg]

    def get_index_k(self, layer_id: int, logical: torch.Tensor) -> torch.Tensor:
        """Dequantized keys of ``logical``: (len(logical), index_head_dim) float32."""
        return dequantize_index_k(self.get_rows(layer_id, logical), self.index_head_dim)


def _addresses(buffers: list[torch.Tensor]) -> np.ndarray:
    """(layers, 1) int64: each buffer's first byte's address."""
    return np.array([b.data_ptr() for b in buffers], dtype=np.int64)[:, None]

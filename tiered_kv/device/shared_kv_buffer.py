"""SharedKVBuffer: one KV buffer that a unified sliding-window pool's two sides share.

``UnifiedSWATokenToKVPoolAllocator`` binds every physical page of its range to at most one side
at a time (full pages from the low end, window pages from the high end), so a physical slot's
bytes are needed by one side only: the full side's layers while a full page holds it, the
window side's layers while a window page does. The buffer is therefore sized for the larger
side alone: ``max(full layers, window layers)`` slabs, slab ``i`` being full layer ``i``'s and
window layer ``i``'s K and V at once (``num_slots`` rows of K, then ``num_slots`` rows of V).

Layer-major, not token-major: both sides have the same per-token row (the same heads), so a
slab is exactly what each side's layer needs and every layer's K and V stay contiguous
``(num_slots, head_num, head_dim)`` tensors, so the model's writes (``index_put`` on the view),
its reads and every host copy path (torch, Triton, the native copier, ``direct``) work on them
unchanged. The bytes are those of a token-major row of ``max(full, window)`` layers; sides with
different heads are refused (their rows would need a row stride the copy kernels do not take;
see docs/device_tier.md).

A slot handed from one side to the other keeps the other side's old bytes until its new owner
writes it; no reader reads a slot of its side it has not written (a page is read only by the
request or cached prefix whose KV was written or loaded there).
"""

from __future__ import annotations

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.kv_cache import store_dtype_for
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed


class SharedKVBuffer:
    """``num_slabs`` slabs of ``num_slots`` K rows then ``num_slots`` V rows, one tensor."""

    def __init__(
        self,
        num_slots: int,
        num_slabs: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        self.num_slabs = check_positive_int("num_slabs", num_slabs)
        self.head_num = check_positive_int("head_num", head_num)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.v_head_dim = check_positive_int("v_head_dim", v_head_dim)
        self._k_elems = num_slots * head_num * head_dim
        slab = self._k_elems + num_slots * head_num * v_head_dim
        # Zero-filled: the padding page must hold finite values for either side.
        self.buffer = empty_zeroed((num_slabs, slab), store_dtype_for(dtype), device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def key(self, slab: int) -> torch.Tensor:
        """Slab ``slab``'s K rows, ``(num_slots, head_num, head_dim)`` (a contiguous view)."""
        return self.buffer[slab, : self._k_elems].view(self.num_slots, self.head_num, self.head_dim)

    def value(self, slab: int) -> torch.Tensor:
        """Slab ``slab``'s V rows, ``(num_slots, head_num, v_head_dim)`` (a contiguous view)."""
        return self.buffer[slab, self._k_elems :].view(
            self.num_slots, self.head_num, self.v_head_dim
        )


class SharedMHAPool(MHATokenToKVPool):
    """An MHA sub-pool whose layer ``i`` is slab ``i`` of a ``SharedKVBuffer`` (allocates
    nothing itself). Reads, writes and host declarations are ``MHATokenToKVPool``'s."""

    def __init__(
        self,
        shared: SharedKVBuffer,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str | torch.device | None = None,
    ) -> None:
        self.shared = shared
        super().__init__(
            size, page_size, dtype, shared.head_num, shared.head_dim, layer_num, device,
            v_head_dim=shared.v_head_dim,
        )  # fmt: skip

    def _create_buffers(self) -> None:
        if self.num_slots != self.shared.num_slots or self.layer_num > self.shared.num_slabs:
            raise InvalidArgumentError(
                f"a SharedMHAPool of {self.num_slots} slots and {self.layer_num} layers does not "
                f"fit a SharedKVBuffer of {self.shared.num_slots} slots and "
                f"{self.shared.num_slabs} slabs; build the buffer for the larger side"
            )
        self.k_buffer = [self.shared.key(i) for i in range(self.layer_num)]
        self.v_buffer = [self.shared.value(i) for i in range(self.layer_num)]

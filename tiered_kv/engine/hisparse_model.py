"""SparseDSA and its KV access for HiSparse serving: decode reads only the selected latents.

:class:`TinyDSA` reads every stored latent, then masks the keys its indexer did not select. A
HiSparse request has only a fixed buffer on the device, so :class:`SparseDSA` selects first
(the indexer scores every token's key, which the device keeps) and then asks the KV access for
just those latents (``read_selected``), which swaps them in from host; every other key is read
as zeros, hidden by the same mask. Logits are TinyDSA's over dense KV, bit for bit. A KV access
without ``read_selected`` (a prefill over staging rows, the dense reference) gets TinyDSA's
path unchanged.

- :class:`StagedKV`: a sparse request's prefill, every prompt position at its staging row;
- :class:`SwapKV`: one decode token, written at the request's reserved slot, the selected
  earlier tokens swapped in (a failed copy tried again, up to ``retries`` times, then
  :class:`SwapInFailed`).
"""

from __future__ import annotations

import torch

from tiered_kv.cache.hisparse_serving import HiSparseServing, SparseRequest
from tiered_kv.device.dsa_pool import dequantize_index_k
from tiered_kv.engine.dsa import TinyDSA
from tiered_kv.errors import TransferError
from tiered_kv.host.hisparse_swap import SwapIn


class SwapInFailed(TransferError):
    """A layer's selected tokens could not be copied in from host (every retry failed)."""


class SparseDSA(TinyDSA):
    def _attention(self, i, p, h, positions, rows, end, base, chunk, kv) -> torch.Tensor:
        read_selected = getattr(kv, "read_selected", None)
        if read_selected is None:
            return super()._attention(i, p, h, positions, rows, end, base, chunk, kv)
        q, latent = self._query_and_latent(p, h, positions, chunk)
        kv.write(i, latent[rows], None)
        n_keys = base + chunk  # what TinyDSA pads the stored keys to
        mask = torch.arange(n_keys)[None, :] > positions[:, None]
        mask = self._mask_keys(i, p, h, mask, rows, end, base, chunk, kv)
        wanted = torch.nonzero((~mask[rows]).any(dim=0)).flatten()  # the real rows' keys
        stored = read_selected(i, end, wanted[wanted < end])
        return self._attend_latent(p, q, self._pad_keys(stored, end, n_keys), mask, chunk)


def swap_in_retried(
    serving: HiSparseServing, req: SparseRequest, layer: int, positions, retries: int
) -> tuple[SwapIn, int]:
    """``serving.swap_in`` of ``positions`` in ``layer``, a failed copy tried again up to
    ``retries`` times; (the result, the failed tries). Raises SwapInFailed when every try
    failed."""
    for failed in range(retries + 1):
        got = serving.swap_in(req, layer, positions)
        if not got.failed.numel():
            return got, failed
    raise SwapInFailed(
        f"layer {layer}: {got.failed.numel()} selected tokens failed to copy in from host "
        f"{retries + 1} times"
    )


def latents(pool, layer: int) -> torch.Tensor:
    """Layer ``layer``'s latent rows as stored, without the pool getter's wait on a dense
    forward's layer-wise load (which a sparse request's rows never had)."""
    t = pool.kv_buffer[pool.layer_index(layer)]
    return t.view(pool.dtype) if pool.store_dtype != pool.dtype else t


def index_keys(pool, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """Dequantized indexer keys of ``rows`` (as :func:`latents`: no wait)."""
    raw = pool.index_k_with_scale_buffer[pool.layer_index(layer)][rows]
    return dequantize_index_k(raw, pool.index_head_dim)


class StagedKV:
    """A sparse request's prefill: position ``j`` at device row ``req.staging[j]``."""

    def __init__(
        self, serving: HiSparseServing, req: SparseRequest, dtype: torch.dtype = torch.float32
    ):
        self.pool, self.rows, self.dtype = serving.pool, req.staging.to(torch.int64), dtype
        self.req, self.start = req, 0

    def write(self, layer: int, k: torch.Tensor, v) -> None:
        self.pool.set_kv_buffer(layer, self.rows[self.start : self.start + len(k)], k)

    def read(self, layer: int, end: int):
        return latents(self.pool, layer)[self.rows[:end]].to(self.dtype), None

    def write_index(self, layer: int, keys: torch.Tensor) -> None:
        self.pool.set_index_k_buffer(layer, self.rows[self.start : self.start + len(keys)], keys)

    def read_index(self, layer: int, end: int) -> torch.Tensor:
        return index_keys(self.pool, layer, self.rows[:end])


class SwapKV:
    """One decode token of a sparse request: its latent and indexer key at ``slot``."""

    def __init__(
        self,
        serving: HiSparseServing,
        req: SparseRequest,
        slot: torch.Tensor,
        retries: int = 3,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.serving, self.req, self.slot = serving, req, slot
        self.pool, self.retries, self.dtype = serving.pool, retries, dtype
        self.start = 0
        self.failed_copies = 0

    def write(self, layer: int, k: torch.Tensor, v) -> None:
        self.pool.set_kv_buffer(layer, self.slot, k)

    def write_index(self, layer: int, keys: torch.Tensor) -> None:
        self.pool.set_index_k_buffer(layer, self.slot, keys)

    def read_index(self, layer: int, end: int) -> torch.Tensor:
        return self.serving.score_keys(self.req, layer)

    def read(self, layer: int, end: int):  # never called by SparseDSA (it reads selected)
        raise TypeError("SwapKV serves SparseDSA's read_selected only")

    def read_selected(self, layer: int, end: int, positions: torch.Tensor) -> torch.Tensor:
        """Latents of ``positions`` (the rest zeros): ``(end, 1, dim)``."""
        positions = positions.to(torch.int64)
        got, failed = swap_in_retried(self.serving, self.req, layer, positions, self.retries)
        self.failed_copies += failed
        buf = latents(self.pool, layer)
        out = torch.zeros((end, *buf.shape[1:]), dtype=self.dtype)
        out[positions] = buf[got.device_slots.to(torch.int64)].to(self.dtype)
        return out

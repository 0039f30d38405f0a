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
  :class:`SwapInFailed`);
- :class:`RawRows`: the pool's latent and indexer rows written and read raw, for a synthetic
  model's writes and checks at scale (one native block copy for every layer's rows of a decode
  token, one for up to ``chunk`` checked rows of any layers; numpy or torch elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from tiered_kv.cache.hisparse_serving import HiSparseServing, SparseRequest
from tiered_kv.device.dsa_pool import DSATokenToKVPool, dequantize_index_k
from tiered_kv.engine.dsa import TinyDSA
from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError, TransferError
from tiered_kv.host.hisparse_swap import SwapIn
from tiered_kv.kernels import native_available
from tiered_kv.kernels.transfer_native import copy_blocks

COPY_MODES = ("auto", "blocks", "numpy", "torch")  # RawRows' modes


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
    swap_in: Callable[[int, torch.Tensor], SwapIn], layer: int, positions, retries: int
) -> tuple[SwapIn, int]:
    """``swap_in(layer, positions)`` (a request's: ``HiSparseServing.swap_in`` bound to it, or
    its swapper's), a failed copy tried again up to ``retries`` times; (the result, the failed
    tries). Raises SwapInFailed when every try failed."""
    for failed in range(retries + 1):
        got = swap_in(layer, positions)
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
        swap_in = partial(self.serving.swap_in, self.req)
        got, failed = swap_in_retried(swap_in, layer, positions, self.retries)
        self.failed_copies += failed
        buf = latents(self.pool, layer)
        out = torch.zeros((end, *buf.shape[1:]), dtype=self.dtype)
        out[positions] = buf[got.device_slots.to(torch.int64)].to(self.dtype)
        return out


class RawRows:
    """A DSA pool's latent and indexer rows written and read raw (no pool API checks, no
    getter's wait on a dense forward's load), by ``mode``: ``blocks`` (CPU pools where the
    native copier builds; ``auto`` there) one native block copy per call, on addresses
    computed from slots checked against the pool's range first; ``numpy`` (CPU) numpy's
    ``take``; ``torch`` (other devices) torch's indexing. Layer index ``i`` (of ``layers``)
    is pool layer ``local[i]``. ``chunk``: the most rows one :meth:`gather` reads."""

    def __init__(
        self, pool: DSATokenToKVPool, layers: list[int], mode: str = "auto", *, chunk: int = 2048
    ) -> None:
        self.pool, self.mode = pool, _copy_mode(mode, pool.device)
        self.local = np.array([pool.layer_index(layer) for layer in layers], dtype=np.int64)
        # (slots, row bytes) uint8 views of the pool's buffers, per pool layer
        self.latent = [b.view(torch.uint8).view(b.shape[0], -1) for b in pool.kv_buffer]
        self.index = pool.index_k_with_scale_buffer
        self.row_bytes = (self.latent[0].shape[1], self.index[0].shape[1])
        cpu = pool.device.type == "cpu"  # there numpy views of the same memory
        pairs = zip(self.latent, self.index, strict=True)
        self._np = [(a.numpy(), b.numpy()) for a, b in pairs] if cpu else None
        # Each pool layer's first row's address (the pool allocates its buffers once)
        self._ptrs = [_addresses(self.latent), _addresses(self.index)]
        self._by_layer = np.arange(len(layers), dtype=np.int64)
        if self.mode == "blocks":  # the gather's target, kept (touched once)
            self._out = np.zeros((chunk, self.row_bytes[0]), dtype=np.uint8)
            self._out_at = np.arange(chunk, dtype=np.int64) * self.row_bytes[0]

    def write(self, slot: torch.Tensor, latents: torch.Tensor, index_rows: torch.Tensor) -> None:
        """Row ``i`` of ``latents`` and of ``index_rows`` (uint8) into layer index ``i``'s rows
        at device ``slot`` (one slot). Raises InvalidArgumentError, writing nothing, when the
        slot or the rows do not fit."""
        at, n, num_slots = int(slot), len(self.local), self.pool.num_slots
        rows = (latents, index_rows)
        want = [(n, b) for b in self.row_bytes]
        got = [(tuple(r.shape), r.dtype) for r in rows]
        if not 0 <= at < num_slots or got != [(w, torch.uint8) for w in want]:
            raise InvalidArgumentError(
                f"slot {at} (valid: [0, {num_slots})), rows {got}: expected uint8 rows {want} "
                "(one per layer)"
            )
        if self.mode != "blocks":
            slot = slot.to(torch.int64)
            for i, local in enumerate(self.local.tolist()):
                self.latent[local][slot] = latents[i : i + 1]
                self.index[local][slot] = index_rows[i : i + 1]
            return
        for r, nbytes, base in zip(rows, self.row_bytes, self._ptrs, strict=True):
            r = r.contiguous()  # kept alive through the copy: n rows of nbytes at its address
            copy_blocks(
                base[self.local] + at * nbytes, r.data_ptr() + self._by_layer * nbytes, nbytes
            )

    def gather(self, idx: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(rows, latent bytes) uint8 on CPU: per row ``r`` the latent at device slot
        ``slots[r]`` of layer index ``idx[r]``. ``blocks``: at most ``chunk`` rows, into a
        buffer kept for it (valid until the next call); else one read per run of one layer."""
        slots = np.asarray(slots, dtype=np.int64)
        local, n = self.local[idx], len(slots)
        if self.mode == "blocks":
            # A slot out of range would read outside the buffers (a negative one wraps to a
            # huge one as unsigned: one comparison)
            num_slots, nbytes = self.pool.num_slots, self.row_bytes[0]
            if n > len(self._out) or np.count_nonzero(slots.view(np.uint64) >= num_slots):
                raise InvalidArgumentError(
                    f"gather reads at most {len(self._out)} rows at device slots in "
                    f"[0, {num_slots}); got {n} rows at slots {slots[:8].tolist()}..."
                )
            src = self._ptrs[0][local] + slots * nbytes
            copy_blocks(self._out.ctypes.data + self._out_at[:n], src, nbytes)
            return self._out[:n]
        runs = np.flatnonzero(np.diff(local)) + 1
        runs = list(zip([0, *runs.tolist()], [*runs.tolist(), n], strict=True))
        if self.mode == "numpy":  # numpy's take copies whole rows: 3-10x torch's indexing
            return np.concatenate([np.take(self._np[local[a]][0], slots[a:b], 0) for a, b in runs])
        at = torch.from_numpy(slots).to(self.pool.device)
        return torch.cat([self.latent[local[a]][at[a:b]] for a, b in runs]).cpu().numpy()

    def take(self, local: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool layer ``local``'s latent and indexer rows at device ``rows``, on CPU (numpy's
        take on CPU pools: torch's indexing copies element by element, 3-10x slower here)."""
        if self._np is None:
            return self.latent[local][rows].cpu(), self.index[local][rows].cpu()
        at = rows.numpy()
        latent, index = self._np[local]
        return torch.from_numpy(np.take(latent, at, 0)), torch.from_numpy(np.take(index, at, 0))


def _copy_mode(mode: str, device: torch.device) -> str:
    if mode not in COPY_MODES:
        raise InvalidArgumentError(f"copy_mode={mode!r}; use one of {COPY_MODES}")
    cpu = device.type == "cpu"
    if mode == "auto":
        return "torch" if not cpu else "blocks" if native_available() else "numpy"
    if mode in ("blocks", "numpy") and not cpu:
        raise InvalidArgumentError(f"copy_mode={mode!r} reads CPU pools; use 'torch' on {device}")
    if mode == "blocks" and not native_available():
        raise BackendUnavailableError("copy_mode='blocks' needs the native copier; use 'numpy'")
    return mode


def _addresses(buffers: list[torch.Tensor]) -> np.ndarray:
    return np.array([b.data_ptr() for b in buffers], dtype=np.int64)

"""Native page-transfer launcher (CPU): one call of the C block copier per transfer or layer.

:class:`NativeRowPlan` computes the block addresses of a transfer with broadcast torch ops,
straight into copy order, and keeps them; ``run`` then costs one C call. A layer-wise load (one
call per layer with the same indices) reuses one plan, and a layer's addresses are built when
that layer is first copied, so layer 0 does not wait for the addresses of every layer.
Orders: host-bound copies in a token-major layout go in chunks of ``CHUNK`` consecutive tokens,
layer by layer, part by part (each chunk fills one region of the host while reading runs of
device rows); device-bound copies go layer-major, so one layer is one contiguous slice of the
address arrays. Large copies use several threads and non-temporal stores. Same contract as
``transfer_reference.transfer_rows``; the caller has validated every index.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tiered_kv.kernels import native_build

# Below these sizes a thread start or a cache bypass costs more than it saves.
THREADS_MIN_BYTES = 1 << 20
STREAM_MIN_BYTES = 4 << 20
# Tokens per chunk of a host-bound token-major copy (measured: 16 beat 1 by 10-15%).
CHUNK = 16


def _chunked(a: torch.Tensor) -> torch.Tensor:
    """(layers, n, parts) -> flat, ordered (n / CHUNK, layers, parts, CHUNK), tail last."""
    layers, n, parts = a.shape
    whole = n // CHUNK * CHUNK
    head = a[:, :whole].reshape(layers, n // CHUNK, CHUNK, parts).permute(1, 0, 3, 2).reshape(-1)
    tail = a[:, whole:].permute(1, 0, 2).reshape(-1)
    return torch.cat([head, tail])


class NativeRowPlan:
    """The block list of one transfer (see ``transfer_reference.transfer_rows``)."""

    def __init__(
        self,
        dev_buffers: Sequence[Sequence[torch.Tensor]],
        host: torch.Tensor,
        dev_rows: torch.Tensor,
        host_offsets: torch.Tensor,
        part_offsets: Sequence[int],
        to_host: bool,
        *,
        token_major: bool = False,
    ) -> None:
        lib = native_build.load()
        if lib is None:
            raise RuntimeError(native_build.error())
        self._fn = lib.tkv_copy_blocks
        elt = host.element_size()
        self.layers = len(dev_buffers[0])
        self.n = dev_rows.numel()
        self.row_bytes = [bufs[0].numel() // bufs[0].shape[0] * elt for bufs in dev_buffers]
        self.by_layer = not (to_host and token_major)
        # Keep the buffers alive as long as their addresses are in use.
        self._keep = (dev_buffers, host)
        self._bases = torch.tensor(
            [[bufs[i].data_ptr() for bufs in dev_buffers] for i in range(self.layers)],
            dtype=torch.int64,
        )
        self._nbytes = torch.tensor(self.row_bytes, dtype=torch.int64)
        self._part_bytes = torch.tensor(part_offsets, dtype=torch.int64) * elt
        self._rows = dev_rows.to(torch.int64)
        self._host_ptr = host.data_ptr()
        self._host_offsets = host_offsets
        self._elt = elt
        self._to_host = to_host
        self._mixed = len(set(self.row_bytes)) > 1
        # Layer-major plans build a layer's addresses when that layer is first copied, so the
        # first layer of a layer-wise load does not wait for every layer's addresses.
        self._per_layer: dict[int, tuple] = {}
        self._whole: tuple | None = None
        if not self.by_layer:
            dst, src, sizes = self._addresses(slice(None))
            self._whole = (_chunked(dst), _chunked(src), _chunked(sizes) if self._mixed else None)

    def _addresses(self, layers: slice) -> tuple:
        """(dst, src, sizes) addresses, each shaped (layers, n, parts)."""
        offsets = self._host_offsets[layers].to(torch.int64)
        hst = (self._host_ptr + offsets * self._elt)[:, :, None] + self._part_bytes
        dev = self._bases[layers][:, None, :] + self._rows[None, :, None] * self._nbytes
        dst, src = (hst, dev) if self._to_host else (dev, hst)
        sizes = self._nbytes.expand(dst.shape) if self._mixed else None
        return dst, src, sizes

    def _layer_major(self, layers: slice) -> tuple:
        dst, src, sizes = self._addresses(layers)
        flat = (lambda a: a.reshape(-1).contiguous())
        return flat(dst), flat(src), flat(sizes) if sizes is not None else None

    def run(self, layer: int | None = None) -> None:
        """Copy every layer, or only local ``layer`` (plans built layer-major only)."""
        if self.n == 0:
            return
        layers = self.layers
        if layer is None:
            if self._whole is None:
                self._whole = self._layer_major(slice(None))
            dst, src, sizes = self._whole
        else:
            if not self.by_layer:
                raise ValueError("this plan copies whole tokens; it cannot run one layer")
            plan = self._per_layer.get(layer)
            if plan is None:
                plan = self._per_layer[layer] = self._layer_major(slice(layer, layer + 1))
            dst, src, sizes = plan
            layers = 1
        total = self.n * layers * sum(self.row_bytes)
        threads = torch.get_num_threads() if total >= THREADS_MIN_BYTES else 1
        rc = self._fn(
            ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_void_p(sizes.data_ptr() if sizes is not None else 0),
            dst.numel(),
            self.row_bytes[0],
            max(1, threads),
            int(total >= STREAM_MIN_BYTES),
        )
        if rc != 0:
            raise RuntimeError(f"native block copier refused the transfer (rc={rc})")


def transfer_rows(
    dev_buffers: Sequence[Sequence[torch.Tensor]],
    host: torch.Tensor,
    dev_rows: torch.Tensor,
    host_offsets: torch.Tensor,
    part_offsets: Sequence[int],
    to_host: bool,
    *,
    token_major: bool = False,
) -> None:
    NativeRowPlan(
        dev_buffers, host, dev_rows, host_offsets, part_offsets, to_host, token_major=token_major
    ).run()

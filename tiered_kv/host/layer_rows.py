"""LayerRowLoader: host -> device copies of one layer's records into device rows a caller owns.

The general path (``HostKVCache.load_to_device_per_layer``) translates device indices through
the allocator, validates both index tensors and prepares a plan per new pair of tensors: about
1 ms of fixed cost per call on a 2-core CPU, paid per layer. A HiSparse request
(``hisparse_swap.py``) calls once per layer and step with new indices every time, copying a few
hundred rows; that fixed cost was most of its swap-in. This loader is for such a caller: it owns
its device rows outright (physical slots of its own buffer: nothing to translate) and reads only
host slots that a validated backup wrote, so a call checks neither; it is the caller's contract.

One call copies one layer's records of ``host_slots`` into rows ``dev_rows``, every part:

- ``"blocks"`` (CPU pools, the native copier built): per part one call of the native block
  copier (``kernels.transfer_native.copy_blocks``) on addresses computed here with numpy: one
  pass, no temporary, the GIL released;
- ``"numpy"`` (CPU pools): per part one numpy gather and scatter of whole rows, viewed as
  integers of the element width (bit-exact, NaN payloads included). Its temporary makes it
  slower than ``blocks`` once a layer's rows pass ~1 MiB (a fresh mapping per call);
- ``"kernel"`` (other devices, or on request): one call of the kernels' page-transfer launcher
  (``kernels.transfer_kernels``; Triton over the pinned host buffer on CUDA) with that layer's
  buffers and host offsets computed here.

``"auto"`` is ``blocks`` on CPU where the native copier builds, else ``numpy``; ``kernel``
elsewhere. Where raw addresses are computed (``blocks``) the indices' range is checked first
(two comparisons per array), so a wrong index raises instead of writing outside the buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError
from tiered_kv.host import layout as layouts
from tiered_kv.host.host_kv_cache import HostKVCache
from tiered_kv.kernels import native_available, transfer_kernels
from tiered_kv.kernels.transfer_native import copy_blocks
from tiered_kv.kernels.transfer_reference import as_int
from tiered_kv.names import HostLayout

MODES = ("auto", "blocks", "numpy", "kernel")


class LayerRowLoader:
    """Layer-at-a-time host -> device row copies for one host pool (see the module doc)."""

    def __init__(self, host: HostKVCache, mode: str = "auto") -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode={mode!r} is not a loader mode; use one of {MODES}")
        decl = host.decl
        self.host = host
        self.mode = mode
        cpu = decl.device.type == "cpu"
        if mode == "auto":
            self.mode = "kernel" if not cpu else "blocks" if native_available() else "numpy"
        elif mode in ("blocks", "numpy") and not cpu:
            raise InvalidArgumentError(
                f"mode={mode!r} copies CPU pools; use 'kernel' on {decl.device}"
            )
        elif mode == "blocks" and not native_available():
            raise BackendUnavailableError("mode='blocks' needs the native copier; use 'numpy'")
        self._local = {g: i for i, g in enumerate(decl.layer_ids)}
        self._strides = layouts.record_strides(
            host.layout, host.layer_num, host.size, host.page_size, host.elems
        )
        # Per part and local layer: the device rows as (num_slots, e_p) integers (fixed).
        self._dev = [[_rows(part.buffer(i)) for i in self._local.values()] for part in decl.parts]
        self._cols = [
            (off, off + part.elems) for part, off in zip(decl.parts, host.part_offsets, strict=True)
        ]
        self._kernels = transfer_kernels(decl.device, host.kernel_backend)
        elt = host.buffer.element_size()
        self._row_bytes = [part.elems * elt for part in decl.parts]
        self._part_bytes = [off * elt for off in host.part_offsets]
        self._layer_bufs = [
            tuple((part.buffer(i),) for part in decl.parts) for i in self._local.values()
        ]
        self._host_ptr = -1
        self._host_np: list[np.ndarray] = []
        self._dev_np: list[list[np.ndarray]] = []

    def local_layer(self, layer_id: int) -> int:
        """The host pool's local index of global ``layer_id``; raises if not held."""
        local = self._local.get(layer_id) if not isinstance(layer_id, bool) else None
        if local is None:
            ids = tuple(self._local)
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not held; valid global layer ids are {ids[0]}..{ids[-1]}"
            )
        return local

    def load(self, layer_id: int, host_slots: np.ndarray, dev_rows: np.ndarray) -> None:
        """Copy global layer ``layer_id`` of ``host_slots`` into device rows ``dev_rows``
        (int64 numpy arrays of one length, pairwise; trusted: host slots written by a
        validated backup, distinct device rows of the caller's own). Mutates those rows of
        that layer only. Raises StateError once the host pool is destroyed; a failing copy
        raises whatever the backend raised, with some rows possibly written."""
        local = self.local_layer(layer_id)
        buffer = self.host.buffer  # raises once destroyed
        if host_slots.size == 0:
            return
        if self.mode == "numpy":
            self._load_numpy(buffer, local, host_slots, dev_rows)
            return
        page, s = self.host.page_size, self._strides
        if s.page == page * s.token:  # slots evenly spaced (not page_first_direct): no pages
            offsets = host_slots * s.token + local * s.layer
        else:
            h = host_slots
            offsets = (h // page) * s.page + (h % page) * s.token + local * s.layer
        if self.mode == "blocks":
            self._load_blocks(buffer, local, host_slots, dev_rows, offsets)
            return
        self._kernels.transfer_rows(
            self._layer_bufs[local],
            buffer,
            torch.from_numpy(dev_rows),
            torch.from_numpy(offsets[None, :]),
            self.host.part_offsets,
            False,
            token_major=self.host.layout.token_major,
        )

    def _load_blocks(
        self,
        buffer: torch.Tensor,
        local: int,
        host_slots: np.ndarray,
        dev_rows: np.ndarray,
        offsets: np.ndarray,
    ) -> None:
        rows = self._dev[0][local].shape[0]
        # Negative values wrap to huge ones as unsigned: one comparison per array.
        if np.count_nonzero(host_slots.view(np.uint64) >= self.host.size) or np.count_nonzero(
            dev_rows.view(np.uint64) >= rows
        ):
            raise InvalidArgumentError(
                f"host slots must be in [0, {self.host.size}) and device rows in [0, {rows})"
            )
        src = buffer.data_ptr() + offsets * buffer.element_size()
        for part, nbytes, off in zip(self._dev, self._row_bytes, self._part_bytes, strict=True):
            dst = part[local].data_ptr() + dev_rows * nbytes
            copy_blocks(dst, src + off, nbytes)

    def _load_numpy(
        self, buffer: torch.Tensor, local: int, host_slots: np.ndarray, dev_rows: np.ndarray
    ) -> None:
        if buffer.data_ptr() != self._host_ptr:
            self._views(buffer)
        records = self._host_np[local]
        if self.host.layout is HostLayout.PAGE_FIRST_DIRECT:
            page = self.host.page_size
            got = records[host_slots // page, host_slots % page]
        else:
            got = records[host_slots]
        for dev, (lo, hi) in zip(self._dev_np, self._cols, strict=True):
            dev[local][dev_rows] = got[:, lo:hi]

    def _views(self, buffer: torch.Tensor) -> None:
        """numpy views of the host records by layer, and of the device rows (rebuilt if the
        host buffer moved)."""
        flat = as_int(buffer)
        by_layer = {
            HostLayout.LAYER_FIRST: lambda i: flat[i],
            HostLayout.PAGE_FIRST: lambda i: flat[:, i],
            HostLayout.PAGE_FIRST_DIRECT: lambda i: flat[:, i],
        }[self.host.layout]
        self._host_np = [by_layer(i).numpy() for i in range(self.host.layer_num)]
        self._dev_np = [[t.numpy() for t in part] for part in self._dev]
        self._host_ptr = buffer.data_ptr()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return as_int(t).reshape(t.shape[0], -1)

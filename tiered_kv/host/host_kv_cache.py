"""HostKVCache: a host copy of a device KV pool, built from the pool's HostPoolDecl.

One buffer in one of three layouts (``layout.py``), sized in whole pages and checked against
available memory at construction, pinned where CUDA exists. Slots are handed out by a
:class:`HostSlotAllocator`. Transfers go device -> host for all layers
(``backup_from_device_all_layer``) and host -> device one layer at a time
(``load_to_device_per_layer``); device indices always pass through the device allocator's
``translate_kv_indices_for_transfer`` first (``transfer_plan.py`` does the work). The storage
tier reads and fills whole pages as bytes (``get_page_bytes`` / ``set_page_bytes``, done by
``page_bytes.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host import layout as layouts
from tiered_kv.host.allocator import HostSlotAllocator
from tiered_kv.host.layout import HostLayout
from tiered_kv.host.memory import HostBuffer, check_available, default_reserve_bytes, host_tokens
from tiered_kv.host.page_bytes import PageBytes
from tiered_kv.host.transfer_plan import HostTransfers
from tiered_kv.kernels.copy_engine import RowJob
from tiered_kv.platform import KernelBackend


class HostKVCache:
    """Host pool for one declaration. ``expected_kind`` lets subclasses insist on a pool kind."""

    expected_kind: str | None = None

    def __init__(
        self,
        decl: HostPoolDecl,
        device_allocator: BaseTokenToKVPoolAllocator,
        *,
        layout: str | HostLayout = "page_first",
        size_tokens: int | None = None,
        size_bytes: int | None = None,
        ratio: float | None = None,
        reserve_bytes: int | None = None,
        pin: bool | None = None,
        kernel_backend: str | KernelBackend | None = None,
    ) -> None:
        if not isinstance(decl, HostPoolDecl):
            raise InvalidArgumentError(
                f"decl must be a HostPoolDecl (from device_pool.host_pool_decls()), got "
                f"{type(decl).__name__}"
            )
        if self.expected_kind is not None and decl.kind != self.expected_kind:
            raise InvalidArgumentError(
                f"{type(self).__name__} hosts '{self.expected_kind}' pools; this declaration is "
                f"'{decl.kind}'"
            )
        translate = getattr(device_allocator, "translate_kv_indices_for_transfer", None)
        if translate is None:
            raise InvalidArgumentError(
                "device_allocator must be the device pool's allocator (it translates device "
                "indices before every transfer)"
            )
        kv = getattr(device_allocator, "get_kvcache", lambda: None)()
        if kv is not None and kv is not decl.device_pool:
            raise InvalidArgumentError("device_allocator belongs to another device pool")
        self.decl = decl
        self.device_allocator = device_allocator
        self.layout = layouts.parse_layout(layout)
        self.page_size = decl.page_size
        self.layer_num = decl.layer_num
        self.dtype = decl.dtype
        self.elems = decl.elems_per_token_per_layer
        bytes_per_token = decl.bytes_per_token_per_layer * self.layer_num
        self.size, setting = host_tokens(
            page_size=self.page_size,
            bytes_per_token=bytes_per_token,
            device_tokens=decl.size,
            size_tokens=size_tokens,
            size_bytes=size_bytes,
            ratio=ratio,
        )
        reserve = default_reserve_bytes() if reserve_bytes is None else reserve_bytes
        check_positive_int("reserve_bytes", reserve, minimum=0)
        check_available(self.size * bytes_per_token, reserve, setting)
        self.num_pages = self.size // self.page_size
        shape = layouts.buffer_shape(
            self.layout, self.layer_num, self.size, self.page_size, self.elems
        )
        self._buffer = HostBuffer(shape, self.dtype, pin)
        self.allocator = HostSlotAllocator(self.size, self.page_size)
        offsets, off = [], 0
        for part in decl.parts:
            offsets.append(off)
            off += part.elems
        self.part_offsets = tuple(offsets)
        self._pages = PageBytes(
            self._buffer,
            self.layout,
            page_size=self.page_size,
            layer_num=self.layer_num,
            elems=self.elems,
            num_pages=self.num_pages,
        )
        self._transfers = HostTransfers(
            decl,
            device_allocator,
            self._buffer,
            self.layout,
            size=self.size,
            part_offsets=self.part_offsets,
            kernel_backend=kernel_backend,
        )

    # -- state ------------------------------------------------------------------------------
    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer.live()

    @property
    def pinned(self) -> bool:
        """True when the buffer is page-locked (registered with CUDA); False when pageable."""
        return self._buffer.pinned

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def kernel_backend(self) -> KernelBackend:
        return self._transfers.kernel_backend

    def destroy(self) -> None:
        """Release the registration and the buffer. Later calls raise StateError."""
        self._transfers.forget()
        self._buffer.destroy()

    def part_view(self, name: str) -> torch.Tensor:
        """Part ``name`` (``k``, ``v`` or ``kv``) as a store-dtype view ``(L, T, *item)``, or
        ``(L, T/P, P, *item)`` in ``page_first_direct``."""
        for part, off in zip(self.decl.parts, self.part_offsets, strict=True):
            if part.name == name:
                return layouts.part_view(self.buffer, self.layout, off, part.item_shape)
        names = [p.name for p in self.decl.parts]
        raise InvalidArgumentError(f"part {name!r} is not in this pool; parts are {names}")

    # -- slots ------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # -- transfers (``transfer_plan.py``) -------------------------------------------------------
    def backup_from_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:
        """Copy every layer of ``device_indices`` into host slots ``host_indices`` (pairwise).
        Mutates host slots ``host_indices`` only. Raises on bad input before copying anything."""
        self._transfers.backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
    ) -> None:
        """Copy global layer ``layer_id`` of host slots ``host_indices`` into ``device_indices``.
        Mutates those device slots of that layer only."""
        self._transfers.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend
        )

    def load_to_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:
        """Every layer at once (no layer-wise overlap); for tests and bulk restores."""
        self._transfers.load_to_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )

    def row_job(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        to_host: bool,
        io_backend: str = "kernel",
    ) -> RowJob | None:
        """The transfer ``backup_from_device_all_layer`` (``to_host``) or a layer-wise load
        would do, as one job for the native copy engine (``kernels.copy_engine``), validated
        the same way; None where the engine does not apply (``HostTransfers.row_job``) or
        where this pool's copy method is overridden (by a subclass or on the instance): the
        engine would bypass the override."""
        name = "backup_from_device_all_layer" if to_host else "load_to_device_per_layer"
        if name in vars(self) or getattr(type(self), name) is not getattr(HostKVCache, name):
            return None
        return self._transfers.row_job(
            device_pool, host_indices, device_indices, to_host, io_backend
        )

    # -- pages as bytes (storage tier; ``page_bytes.py``) -----------------------------------------
    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: every layer and part of ``page_size`` tokens."""
        return self._pages.nbytes

    @property
    def page_bytes_zero_copy(self) -> bool:
        """Whether ``get_page_bytes`` returns a view (page_first layouts) rather than a copy."""
        return self._pages.zero_copy

    def page_bytes_rows(self) -> np.ndarray | None:
        """Every page's bytes at once, as a ``(num_pages, page_nbytes)`` uint8 numpy view of the
        buffer (row ``p`` is ``get_page_bytes(p)``), for page_first layouts; None in layer_first.
        Valid until the pool is destroyed: take it per batch, do not keep it."""
        return self._pages.rows()

    def get_page_bytes(self, page: int) -> torch.Tensor:
        """The bytes of host page ``page`` as a flat uint8 tensor: a zero-copy view in the
        page_first layouts (valid until the page is overwritten or the pool destroyed), a copy
        in layer_first."""
        return self._pages.get(page)

    def set_page_bytes(
        self, page: int, data: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Fill host page ``page`` from exactly ``page_nbytes`` bytes (the format
        ``get_page_bytes`` returns). One copy, straight into the page; nothing changes on error."""
        self._pages.set(page, data)


class MHATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MHATokenToKVPool``: records are K then V."""

    expected_kind = "mha"


class MLATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MLATokenToKVPool``: records are the latent."""

    expected_kind = "mla"


class MHATokenToKOnlyPoolHost(HostKVCache):
    """Host pool of an ``MHATokenToKOnlyPool``: records are K."""

    expected_kind = "k_only"


def host_pool_for(decl: HostPoolDecl, device_allocator: Any, **kwargs: Any) -> HostKVCache:
    """The host pool class for a declaration's kind, constructed with ``kwargs``."""
    classes = {
        c.expected_kind: c
        for c in (MHATokenToKVPoolHost, MLATokenToKVPoolHost, MHATokenToKOnlyPoolHost)
    }
    cls = classes.get(getattr(decl, "kind", None), HostKVCache)
    return cls(decl, device_allocator, **kwargs)

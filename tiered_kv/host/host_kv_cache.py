"""HostKVCache: a host copy of a device KV pool, built from the pool's HostPoolDecl.

One buffer in one of three layouts (``layout.py``), sized in whole pages and checked against
available memory at construction, pinned where CUDA exists. Slots are handed out by a
:class:`HostSlotAllocator`. Transfers go device -> host for all layers
(``backup_from_device_all_layer``) and host -> device one layer at a time
(``load_to_device_per_layer``); device indices always pass through the device allocator's
``translate_kv_indices_for_transfer`` first. The storage tier reads and fills whole pages as
bytes (``get_page_bytes`` / ``set_page_bytes``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.host import layout as layouts
from tiered_kv.host.allocator import HostSlotAllocator
from tiered_kv.host.layout import HostLayout
from tiered_kv.host.memory import HostBuffer, check_available, default_reserve_bytes, host_tokens
from tiered_kv.host.transfer import (
    TransferPlan,
    check_io_backend,
    direct_copy,
    direct_runs,
    plan_transfer,
)
from tiered_kv.kernels import transfer_kernels
from tiered_kv.kernels.transfer_native import NativeRowPlan
from tiered_kv.platform import KernelBackend


class _Prepared:
    """A validated transfer and what the backends derive from it (computed on first use)."""

    __slots__ = ("host_src", "device_src", "versions", "plan", "token_offsets", "runs", "native")

    def __init__(self, host_src: torch.Tensor, device_src: torch.Tensor, plan: TransferPlan):
        self.host_src = host_src
        self.device_src = device_src
        self.versions = (host_src._version, device_src._version)
        self.plan = plan
        self.token_offsets: torch.Tensor | None = None
        self.runs: list[tuple[int, int, int]] | None = None
        self.native: dict[bool, NativeRowPlan] = {}


class HostKVCache:
    """Host pool for one declaration. ``expected_kind`` lets subclasses insist on a pool kind."""

    expected_kind: str | None = None

    def __init__(
        self,
        decl: HostPoolDecl,
        device_allocator: Any,
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
        self._strides = layouts.record_strides(
            self.layout, self.layer_num, self.size, self.page_size, self.elems
        )
        offsets, off = [], 0
        for part in decl.parts:
            offsets.append(off)
            off += part.elems
        self.part_offsets = tuple(offsets)
        self._kernels = transfer_kernels(decl.device, kernel_backend)
        self._prepared: _Prepared | None = None

    # -- state ------------------------------------------------------------------------------
    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer.tensor is None:
            raise StateError("this host pool was destroyed")
        return self._buffer.tensor

    @property
    def pinned(self) -> bool:
        """True when the buffer is page-locked (registered with CUDA); False when pageable."""
        return self._buffer.pinned

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def kernel_backend(self) -> KernelBackend:
        return self._kernels.backend

    def destroy(self) -> None:
        """Release the registration and the buffer. Later calls raise StateError."""
        self._prepared = None
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

    # -- transfers --------------------------------------------------------------------------
    def _check_pool(self, device_pool: Any, where: str) -> None:
        if device_pool is not self.decl.device_pool:
            raise InvalidArgumentError(
                f"{where}: device_pool is not the pool this host pool mirrors"
            )

    def _prepare(self, host_indices: torch.Tensor, device_indices: torch.Tensor, where: str):
        """Validated, translated indices plus what the backends derive from them. A layer-wise
        load calls this once per layer with the same index tensors, so the last result is kept
        and reused while both tensors are the same objects, unmodified (``_version``)."""
        self.buffer  # noqa: B018 - raises if destroyed
        cached = self._prepared
        if (
            cached is not None
            and cached.host_src is host_indices
            and cached.device_src is device_indices
            and cached.versions == (host_indices._version, device_indices._version)
        ):
            return cached
        physical = self.device_allocator.translate_kv_indices_for_transfer(device_indices)
        device = self.decl.device
        plan = plan_transfer(
            host_indices,
            physical,
            host_size=self.size,
            device=device,
            device_low=self.page_size,
            device_high=self.decl.num_slots,
            validate_device_values=device.type == "cpu"
            or bool(getattr(self.device_allocator, "debug_mode", False)),
            where=where,
        )
        prepared = _Prepared(host_indices, device_indices, plan)
        self._prepared = prepared
        return prepared

    def _run(self, prepared: _Prepared, layers: list[int], io_backend: str, to_host: bool) -> None:
        plan = prepared.plan
        if plan.host.numel() == 0:
            return
        dev_buffers = [[part.buffer(i) for i in layers] for part in self.decl.parts]
        if io_backend == "direct":
            if prepared.runs is None:
                prepared.runs = direct_runs(plan, self.layout, self.page_size)
            views = [
                layouts.part_view(self.buffer, self.layout, off, part.item_shape)
                for part, off in zip(self.decl.parts, self.part_offsets, strict=True)
            ]
            direct_copy(
                dev_buffers, views, layers, prepared.runs, self.layout, self.page_size, to_host
            )
            return
        if prepared.token_offsets is None:
            prepared.token_offsets = layouts.token_offsets(self._strides, self.page_size, plan.host)
        if self._kernels.backend is KernelBackend.NATIVE:
            self._run_native(prepared, layers, to_host)
            return
        if len(layers) == 1:
            offsets = (prepared.token_offsets + layers[0] * self._strides.layer)[None, :]
        else:
            layer_part = torch.tensor(layers, dtype=torch.int64) * self._strides.layer
            offsets = layer_part[:, None] + prepared.token_offsets[None, :]
        self._kernels.transfer_rows(
            dev_buffers,
            self.buffer,
            plan.device,
            offsets,
            self.part_offsets,
            to_host,
            token_major=self.layout.token_major,
        )

    def _run_native(self, prepared: _Prepared, layers: list[int], to_host: bool) -> None:
        """Native copies: block addresses for every layer are computed once per prepared
        transfer and direction, so the calls of a layer-wise load pay only their copy."""
        every = list(range(self.layer_num))
        native = prepared.native.get(to_host)
        if native is None:
            layer_part = torch.tensor(every, dtype=torch.int64) * self._strides.layer
            native = NativeRowPlan(
                [[part.buffer(i) for i in every] for part in self.decl.parts],
                self.buffer,
                prepared.plan.device,
                layer_part[:, None] + prepared.token_offsets[None, :],
                self.part_offsets,
                to_host,
                token_major=self.layout.token_major,
            )
            prepared.native[to_host] = native
        if layers == every:
            native.run()
        else:
            for layer in layers:
                native.run(layer)

    def backup_from_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:
        """Copy every layer of ``device_indices`` into host slots ``host_indices`` (pairwise).
        Mutates host slots ``host_indices`` only. Raises on bad input before copying anything."""
        check_io_backend(io_backend)
        self._check_pool(device_pool, "backup_from_device_all_layer")
        prepared = self._prepare(host_indices, device_indices, "backup_from_device_all_layer")
        self._run(prepared, list(range(self.layer_num)), io_backend, to_host=True)

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
        check_io_backend(io_backend)
        self._check_pool(device_pool, "load_to_device_per_layer")
        if (
            isinstance(layer_id, bool)
            or not isinstance(layer_id, int)
            or (layer_id not in self.decl.layer_ids)
        ):
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not held; valid global layer ids are "
                f"{self.decl.layer_ids[0]}..{self.decl.layer_ids[-1]}"
            )
        prepared = self._prepare(host_indices, device_indices, "load_to_device_per_layer")
        local = self.decl.layer_ids.index(layer_id)
        self._run(prepared, [local], io_backend, to_host=False)

    def load_to_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:
        """Every layer at once (no layer-wise overlap); for tests and bulk restores."""
        check_io_backend(io_backend)
        self._check_pool(device_pool, "load_to_device_all_layer")
        prepared = self._prepare(host_indices, device_indices, "load_to_device_all_layer")
        self._run(prepared, list(range(self.layer_num)), io_backend, to_host=False)

    # -- pages as bytes (storage tier) --------------------------------------------------------
    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: every layer and part of ``page_size`` tokens."""
        return self.page_size * self.layer_num * self.elems * self.buffer.element_size()

    @property
    def page_bytes_zero_copy(self) -> bool:
        """Whether ``get_page_bytes`` returns a view (page_first layouts) rather than a copy."""
        return self.layout.token_major

    def page_bytes_rows(self) -> np.ndarray | None:
        """Every page's bytes at once, as a ``(num_pages, page_nbytes)`` uint8 numpy view of the
        buffer (row ``p`` is ``get_page_bytes(p)``), for page_first layouts; None in layer_first.
        Valid until the pool is destroyed: take it per batch, do not keep it."""
        if not self.page_bytes_zero_copy:
            return None
        flat = self.buffer.reshape(-1).view(torch.uint8)
        return flat.numpy().reshape(self.num_pages, self.page_nbytes)

    def _check_page(self, page: int) -> int:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise InvalidArgumentError(
                f"page={page!r} is not a host page; valid pages are 0..{self.num_pages - 1}"
            )
        return page

    def _page_block(self, page: int) -> torch.Tensor:
        """The page's records: one contiguous block in page_first layouts, ``(L, P, E)`` strided
        in layer_first."""
        p = self.page_size
        buf = self.buffer
        if self.layout is HostLayout.PAGE_FIRST:
            return buf[page * p : (page + 1) * p]
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            return buf[page]
        return buf[:, page * p : (page + 1) * p]

    def get_page_bytes(self, page: int) -> torch.Tensor:
        """The bytes of host page ``page`` as a flat uint8 tensor: a zero-copy view in the
        page_first layouts (valid until the page is overwritten or the pool destroyed), a copy
        in layer_first."""
        block = self._page_block(self._check_page(page))
        if not self.page_bytes_zero_copy:
            # layer_first promises a copy even when the block happens to be contiguous (L == 1).
            block = block.clone(memory_format=torch.contiguous_format)
        return block.reshape(-1).view(torch.uint8)

    def set_page_bytes(
        self, page: int, data: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Fill host page ``page`` from exactly ``page_nbytes`` bytes (the format
        ``get_page_bytes`` returns). One copy, straight into the page; nothing changes on error."""
        block = self._page_block(self._check_page(page))
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8:
                raise InvalidArgumentError(
                    f"page data tensor has dtype {data.dtype}; expected uint8"
                )
            src = data.reshape(-1)
        else:
            view = memoryview(data).cast("B")
            with warnings.catch_warnings():
                # A read-only buffer (bytes) is only read here.
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else None
        n = 0 if src is None else src.numel()
        if n != self.page_nbytes:
            raise InvalidArgumentError(
                f"page data has {n} bytes; a page of this pool has exactly {self.page_nbytes}"
            )
        # Byte views on both sides: no alignment demands on the caller's buffer.
        dst = block.view(torch.uint8)
        dst.copy_(src.view(dst.shape))


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

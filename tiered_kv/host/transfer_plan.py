"""The transfers of one host pool: validate a pair of index tensors once, then copy layers.

Device indices pass through the device allocator's ``translate_kv_indices_for_transfer`` and
the pair is validated (``transfer.plan_transfer``) once; what the io backends derive from it
(direct runs, record offsets, the launcher's :class:`PlanCache`) is computed on first use and
kept with it. A layer-wise load calls once per layer with the same index tensors, so the last
prepared transfer is reused while both tensors are the same objects, unmodified (``_version``).
The kernel backend is called the same way whichever it is. With the native backend (io
``kernel``) the copies run as copy-engine jobs instead (``EngineJobs``): the pair is validated in
C while the job is built (the Python checks run only to name a bad value), the last job is kept
while the same unmodified tensors come again in the same direction, and the later layers of a
layer-wise load are one native call each (``layer_steps``). ``row_job`` describes a transfer the
same way for the copy engine's own thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host import layout as layouts
from tiered_kv.host.engine_jobs import EngineJobs
from tiered_kv.host.layer_steps import LayerSteps
from tiered_kv.host.layout import HostLayout
from tiered_kv.host.memory import HostBuffer
from tiered_kv.host.transfer import (
    TransferPlan,
    check_io_backend,
    direct_copy,
    direct_runs,
    plan_transfer,
)
from tiered_kv.kernels import PlanCache, copy_engine, transfer_kernels
from tiered_kv.kernels.copy_engine import RowJob
from tiered_kv.names import IOBackend
from tiered_kv.platform import KernelBackend

_CPU = torch.device("cpu")
DeviceBuffers = tuple[tuple[torch.Tensor, ...], ...]


def _int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype is torch.int64 and t.is_contiguous():
        return t
    return t.to(torch.int64).contiguous()


class _Prepared:
    """A validated transfer and what the backends derive from it (computed on first use)."""

    __slots__ = (
        "host_src",
        "device_src",
        "versions",
        "plan",
        "runs",
        "dev_buffers",
        "host_offsets",
        "plan_cache",
    )

    def __init__(self, host_src: torch.Tensor, device_src: torch.Tensor, plan: TransferPlan):
        self.host_src = host_src
        self.device_src = device_src
        self.versions = (host_src._version, device_src._version)
        self.plan = plan
        self.runs: list[tuple[int, int, int]] | None = None
        self.dev_buffers: DeviceBuffers | None = None  # [part][local layer], every layer
        self.host_offsets: torch.Tensor | None = None  # (layers, n) record offsets
        self.plan_cache = PlanCache()

    def made_from(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        return (
            self.host_src is host_indices
            and self.device_src is device_indices
            and self.versions == (host_indices._version, device_indices._version)
        )


class HostTransfers:
    """Device <-> host copies for one host buffer and the device pool of its declaration.

    Holds the last prepared transfer (and what the launcher keeps in its plan cache) until the
    next transfer with other indices, or :meth:`forget`."""

    def __init__(
        self,
        decl: HostPoolDecl,
        device_allocator: BaseTokenToKVPoolAllocator,
        buffer: HostBuffer,
        layout: HostLayout,
        *,
        size: int,
        part_offsets: Sequence[int],
        kernel_backend: str | KernelBackend | None,
    ) -> None:
        self.decl = decl
        self.device_allocator = device_allocator
        self._buffer = buffer
        self.layout = layout
        self.size = size
        self.part_offsets = tuple(part_offsets)
        self._strides = layouts.record_strides(
            layout, decl.layer_num, size, decl.page_size, decl.elems_per_token_per_layer
        )
        self._kernels = transfer_kernels(decl.device, kernel_backend)
        self._prepared: _Prepared | None = None
        self._steps: LayerSteps | None = None
        self._last_job: tuple | None = None  # (host, device, versions + direction, RowJob)
        self._dev_buffers: DeviceBuffers | None = None
        self._engine = EngineJobs(
            decl, buffer, layout, self._strides, size=size, part_offsets=self.part_offsets
        )

    @property
    def kernel_backend(self) -> KernelBackend:
        return self._kernels.backend

    def forget(self) -> None:
        """Drop the prepared transfer, the launcher's cached plans and the engine's shape."""
        self._prepared = None
        self._steps = None
        self._last_job = None
        self._engine.forget()

    # -- the three directions (the host pool's public methods) ---------------------------------
    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io: str
    ) -> None:
        check_io_backend(io)
        self._check_pool(device_pool, "backup_from_device_all_layer")
        where = "backup_from_device_all_layer"
        if self._engine_applies(io):
            self._engine.run(self._engine_job(host_indices, device_indices, True, where), None)
            return
        prepared = self._prepare(host_indices, device_indices, where)
        self._run(prepared, None, io, to_host=True)

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io: str,
    ) -> None:
        steps = self._steps
        if steps is not None and steps.step(
            device_pool, host_indices, device_indices, layer_id, io
        ):
            return  # a later layer of the transfer the last call prepared (``layer_steps``)
        check_io_backend(io)
        self._check_pool(device_pool, "load_to_device_per_layer")
        layer_ids = self.decl.layer_ids
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id not in layer_ids:
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not held; valid global layer ids are "
                f"{layer_ids[0]}..{layer_ids[-1]}"
            )
        where = "load_to_device_per_layer"
        if not self._engine_applies(io):
            prepared = self._prepare(host_indices, device_indices, where)
            self._run(prepared, [layer_ids.index(layer_id)], io, to_host=False)
            return
        job = self._engine_job(host_indices, device_indices, False, where)
        self._engine.run(job, [layer_ids.index(layer_id)])
        if LayerSteps.applies(job):
            self._steps = LayerSteps(
                host_indices, device_indices, device_pool, io, job, layer_ids, self._buffer
            )

    def load_to_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io: str
    ) -> None:
        check_io_backend(io)
        self._check_pool(device_pool, "load_to_device_all_layer")
        where = "load_to_device_all_layer"
        if self._engine_applies(io):
            self._engine.run(self._engine_job(host_indices, device_indices, False, where), None)
            return
        prepared = self._prepare(host_indices, device_indices, where)
        self._run(prepared, None, io, to_host=False)

    def row_job(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        to_host: bool,
        io: str,
    ) -> RowJob | None:
        """Every layer of a transfer as one copy-engine job (``EngineJobs.job``), validated
        like the copy methods: bad input raises before anything is queued. None where the
        engine does not apply: io backend ``direct``, a kernel backend other than native, or
        an engine that does not build here."""
        check_io_backend(io)
        where = "backup_from_device_all_layer" if to_host else "load_to_device_per_layer"
        self._check_pool(device_pool, where)
        if not self._engine_applies(io):
            return None
        physical = self.device_allocator.translate_kv_indices_for_transfer(device_indices)
        return self._engine.job(host_indices, physical, to_host, where, self._plan)

    def _engine_applies(self, io: str) -> bool:
        return (
            io == IOBackend.KERNEL
            and self._kernels.backend is KernelBackend.NATIVE
            and copy_engine.available()
        )

    # -- prepare and run -----------------------------------------------------------------------
    def _check_pool(self, device_pool: Any, where: str) -> None:
        if device_pool is not self.decl.device_pool:
            raise InvalidArgumentError(
                f"{where}: device_pool is not the pool this host pool mirrors"
            )

    def _engine_job(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, to_host: bool, where: str
    ) -> RowJob:
        """The copy-engine job of a transfer, validated in C (``EngineJobs.job``; the Python
        checks run only to name a bad value): the last one while the same, unmodified tensors
        come again in the same direction, else a new one."""
        self._buffer.live()  # raises if destroyed
        cached = self._last_job
        if (
            cached is not None
            and cached[0] is host_indices
            and cached[1] is device_indices
            and cached[2] == (host_indices._version, device_indices._version, to_host)
        ):
            return cached[3]
        physical = self.device_allocator.translate_kv_indices_for_transfer(device_indices)
        job = self._engine.job(host_indices, physical, to_host, where, self._plan)
        versions = (host_indices._version, device_indices._version, to_host)
        self._last_job = (host_indices, device_indices, versions, job)
        return job

    def _prepare(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, where: str
    ) -> _Prepared:
        """Validated, translated indices plus what the backends derive from them: the last
        result while the same, unmodified tensors come again, else a new one."""
        self._buffer.live()  # raises if destroyed
        cached = self._prepared
        if cached is not None and cached.made_from(host_indices, device_indices):
            return cached
        physical = self.device_allocator.translate_kv_indices_for_transfer(device_indices)
        prepared = _Prepared(
            host_indices, device_indices, self._plan(host_indices, physical, where)
        )
        self._prepared = prepared
        return prepared

    def _plan(self, host_indices: torch.Tensor, physical: torch.Tensor, where: str) -> TransferPlan:
        device = self.decl.device
        return plan_transfer(
            host_indices,
            physical,
            host_size=self.size,
            device=device,
            device_low=self.decl.page_size,
            device_high=self.decl.num_slots,
            validate_device_values=device.type == "cpu"
            or bool(getattr(self.device_allocator, "debug_mode", False)),
            where=where,
        )

    def _run(self, prepared: _Prepared, layers: list[int] | None, io: str, to_host: bool) -> None:
        """Copy local ``layers`` (None: every layer) of a prepared transfer."""
        plan = prepared.plan
        if plan.host.numel() == 0:
            return
        buffer = self._buffer.live()
        decl = self.decl
        if prepared.dev_buffers is None:
            # The device pool's buffers never change: one tuple for every transfer, so the
            # native launcher's per-buffer addresses are computed once, not per op.
            if self._dev_buffers is None:
                every = range(decl.layer_num)
                self._dev_buffers = tuple(
                    tuple(part.buffer(i) for i in every) for part in decl.parts
                )
            prepared.dev_buffers = self._dev_buffers
        if io == IOBackend.DIRECT:
            chosen = list(range(decl.layer_num)) if layers is None else layers
            if prepared.runs is None:
                prepared.runs = direct_runs(plan, self.layout, decl.page_size)
            views = [
                layouts.part_view(buffer, self.layout, off, part.item_shape)
                for part, off in zip(decl.parts, self.part_offsets, strict=True)
            ]
            dev_buffers = [[bufs[i] for i in chosen] for bufs in prepared.dev_buffers]
            direct_copy(
                dev_buffers, views, chosen, prepared.runs, self.layout, decl.page_size, to_host
            )
            return
        if prepared.host_offsets is None:
            every = list(range(decl.layer_num))
            prepared.host_offsets = layouts.record_offsets(
                self._strides, decl.page_size, plan.host, every
            )
        self._kernels.transfer_rows(
            prepared.dev_buffers,
            buffer,
            plan.device,
            prepared.host_offsets,
            self.part_offsets,
            to_host,
            layers=layers,
            token_major=self.layout.token_major,
            plan_cache=prepared.plan_cache,
        )

"""The per-layer steps of a layer-wise load: its fixed cost paid once per transfer, not per layer.

A layer-wise load calls ``load_to_device_per_layer`` once per layer with the same index tensors.
The first call validates the pair and builds the copy engine's descriptor of every layer
(``EngineJobs.job``); :class:`LayerSteps` keeps that descriptor as one C struct. Each later call
with the same, unmodified tensors, the same device pool and io backend and a held layer id then
costs one native call (``tkv_rows_copy_layer``, GIL released) that copies that layer's rows on
the calling thread: no argument checks beyond identity, no plan, no queue, no allocation.

Layers of ``HELPERS_MIN_BYTES`` or more are not stepped here: there the engine's helper threads
pay for themselves and the engine's own path (a few microseconds more) runs them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tiered_kv.device.kv_cache import KVCache
from tiered_kv.errors import TransferError
from tiered_kv.host.memory import HostBuffer
from tiered_kv.kernels.engine_lib import lib
from tiered_kv.kernels.row_job import HELPERS_MIN_BYTES, RowJob


class LayerSteps:
    """One prepared host -> device transfer, every layer of it one native call away."""

    __slots__ = (
        "host_src",
        "device_src",
        "versions",
        "pool",
        "io",
        "local",
        "_buffer",
        "_job",
        "_struct",
        "_ref",
        "_copy",
    )

    def __init__(
        self,
        host_src: torch.Tensor,
        device_src: torch.Tensor,
        pool: KVCache,
        io: str,
        job: RowJob,
        layer_ids: Sequence[int],
        buffer: HostBuffer,
    ) -> None:
        self.host_src = host_src
        self.device_src = device_src
        self.versions = (host_src._version, device_src._version)
        self.pool = pool
        self.io = io
        # global layer id -> its chosen index in the job (the job copies local layers in order)
        order = job.layers.tolist()
        self.local = {int(layer_ids[loc]): k for k, loc in enumerate(order)}
        self._buffer = buffer
        self._job = job  # its arrays and the tensors they view stay alive with the struct
        self._struct = job.struct(None)
        self._ref = ctypes.byref(self._struct)
        self._copy = lib().tkv_rows_copy_layer

    @staticmethod
    def applies(job: RowJob) -> bool:
        """A host -> device job whose layers are each small enough for the calling thread."""
        per_layer = job.dev_rows.numel() * job.shape.token_bytes
        return not job.to_host and not job.chunked and per_layer < HELPERS_MIN_BYTES

    def step(
        self,
        pool: object,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: object,
        io: str,
    ) -> bool:
        """Copy ``layer_id`` if this call is one of this transfer's steps; False (nothing
        copied) when it is not and the full path must run: other or modified tensors, another
        pool or io backend, a layer id not held (or not an int), a destroyed host buffer."""
        if (
            host_indices is not self.host_src
            or device_indices is not self.device_src
            or pool is not self.pool
            or io != self.io
            or type(layer_id) is not int
            or self._buffer.tensor is None
            or self.versions != (host_indices._version, device_indices._version)
        ):
            return False
        k = self.local.get(layer_id)
        if k is None:
            return False
        if self._copy(self._ref, k) != 0:
            raise TransferError(
                f"the native copier refused layer {layer_id} (step {k} of {len(self.local)})"
            )
        return True

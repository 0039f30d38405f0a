"""One host pool's transfers as copy-engine jobs (``kernels.copy_engine``), and the synchronous
copies that run on the engine.

:class:`EngineJobs` builds a :class:`RowJob` from a pair of index tensors, validated in C
(ranges and repeats; on a bad value the Python checks run again to name it), or from a transfer
the host pool has validated already. ``run`` copies such a job synchronously: it is queued on
the calling thread, with the shared engine's persistent helper threads joining large ones, so a
call starts no thread and a layer-wise loop of 32 calls pays no thread start per layer.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence

import torch

from tiered_kv._checks import check_index_tensor
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.layout import HostLayout, RecordStrides
from tiered_kv.host.memory import HostBuffer
from tiered_kv.kernels.copy_engine import (
    CopyEngine,
    IndexCheck,
    RowJob,
    RowShape,
    engine_threads,
    run_rows,
)
from tiered_kv.kernels.row_job import sync_threads
from tiered_kv.kernels.transfer_native import STREAM_MIN_BYTES, bases_of

_CPU = torch.device("cpu")
_lock = threading.Lock()
_shared: tuple[int, CopyEngine] | None = None


def shared_engine() -> CopyEngine:
    """The process's engine for synchronous copies (a new one in a forked child: threads do not
    survive a fork)."""
    global _shared
    with _lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), CopyEngine("sync"))
        return _shared[1]


def _int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype is torch.int64 and t.is_contiguous():
        return t
    return t.to(torch.int64).contiguous()


class EngineJobs:
    """Copy-engine jobs of one host buffer and the device pool of its declaration."""

    def __init__(
        self,
        decl: HostPoolDecl,
        buffer: HostBuffer,
        layout: HostLayout,
        strides: RecordStrides,
        *,
        size: int,
        part_offsets: Sequence[int],
    ) -> None:
        self.decl = decl
        self._buffer = buffer
        self.layout = layout
        self.strides = strides
        self.size = size
        self.part_offsets = tuple(part_offsets)
        self._shape: RowShape | None = None
        self._layer_shapes: dict[tuple[int, ...], RowShape] = {}
        self._checks: IndexCheck | None = None

    def forget(self) -> None:
        self._shape = None
        self._layer_shapes = {}

    def shape(self) -> RowShape:
        """What every job of this pool shares (rebuilt if the host buffer moved)."""
        buffer = self._buffer.live()
        shape = self._shape
        if shape is None or shape.host_base != buffer.data_ptr():
            decl, elt = self.decl, buffer.element_size()
            bufs = tuple(
                tuple(part.buffer(i) for i in range(decl.layer_num)) for part in decl.parts
            )
            shape = self._shape = RowShape(
                bases_of(bufs),
                [b[0].numel() // b[0].shape[0] * elt for b in bufs],
                [o * elt for o in self.part_offsets],
                buffer.data_ptr(),
                self.strides.layer * elt,
                keep=(buffer, bufs),
            )
            self._layer_shapes = {}
        return shape

    def job(
        self,
        host_indices: torch.Tensor,
        physical: torch.Tensor,
        to_host: bool,
        where: str,
        explain: Callable[[torch.Tensor, torch.Tensor, str], object],
    ) -> RowJob:
        """Every layer of a transfer (``physical``: device indices already translated): a whole
        job with one completion device -> host, one completion per layer host -> device.
        Raises InvalidArgumentError before anything is queued; ``explain`` (the Python
        checks) names a bad value."""
        shape = self.shape()
        decl, strides = self.decl, self.strides
        check_index_tensor(f"{where}: host_indices", host_indices, _CPU)
        check_index_tensor(f"{where}: device_indices", physical, decl.device)
        n = host_indices.shape[0]
        if physical.shape[0] != n:
            explain(host_indices, physical, where)  # raises, naming both lengths
        # Contiguous int64 (copies only where the tensors are strided or int32): the C side
        # walks them as plain arrays; they stay alive with the job.
        host, dev = _int64(host_indices), _int64(physical)
        if self._checks is None:
            self._checks = IndexCheck(self.size, decl.num_slots)
        elt = self._buffer.live().element_size()
        tok, bad = self._checks.offsets(
            host, dev, decl.page_size, decl.page_size, strides.page, strides.token, elt
        )
        if bad >= 0:
            explain(host_indices, physical, where)  # raises, naming the values
            raise InvalidArgumentError(f"{where}: index check failed")  # not reached
        per_entry = n * shape.token_bytes * (decl.layer_num if to_host else 1)
        return RowJob(
            shape,
            dev,
            tok,
            to_host=to_host,
            whole=to_host,
            chunked=to_host and self.layout.token_major,
            threads=engine_threads(per_entry),
            nt=per_entry >= STREAM_MIN_BYTES,
            keep=(host, dev),
        )

    def run(self, job: RowJob, layers: Sequence[int] | None) -> None:
        """Copy local ``layers`` (None: every layer) of ``job`` now, as one whole job run on the
        calling thread and the shared engine's helpers. Raises TransferError if refused."""
        shape = job.shape
        if layers is not None:
            key = tuple(layers)
            shape = self._layer_shapes.get(key)
            if shape is None:
                shape = self._layer_shapes[key] = job.shape.with_layers(key)
        per_call = job.dev_rows.numel() * shape.token_bytes * shape.layers.size
        whole = dataclasses.replace(
            job,
            shape=shape,
            whole=True,
            chunked=self.layout.token_major and layers is None,
            # the caller copies too: it is the compute thread, and it waits
            threads=sync_threads(per_call),
            nt=per_call >= STREAM_MIN_BYTES,
        )
        if whole.threads == 1:
            run_rows(whole)  # the caller alone: no queue, no thread to wake or wait for
        else:
            shared_engine().run(whole)

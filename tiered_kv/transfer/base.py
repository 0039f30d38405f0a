"""The one transfer contract: every copy between two tiers is a job, submitted, polled and waited
the same way, whatever the direction and whatever moves the bytes (a CUDA stream, a copy
thread, a storage thread).

- ``submit(job) -> bool``: start the job in the background. False means the worker refused it
  (closed, or its store is gone) and nothing was started; bad indices raise
  :class:`InvalidArgumentError` before anything starts.
- ``poll() -> list[TransferResult]``: the jobs finished since the last call; never blocks. Each
  result is delivered exactly once, by ``poll``.
- ``wait(job_ids=None, timeout_s=None) -> bool``: block until those jobs (None: every job in
  flight) have finished, or the timeout passes; True when they all have. Results still come
  from ``poll``.
- ``cancel(job_id)``: ask a storage job to stop after the batch in progress (what is done so far
  stays valid and is reported); a no-op for device <-> host jobs and finished jobs.
- ``close()``: finish what was submitted, stop the threads; later submits return False.

A result says which job, which way, ok or failed, bytes, seconds, and for storage jobs how many
leading pages were done: nothing may be served from a job's destination before its ok result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.names import Direction, JobId
from tiered_kv.storage.contract import PageSource


class HostCopies(Protocol):
    """What the device <-> host worker needs of a host pool (``host.HostKVCache``)."""

    decl: HostPoolDecl
    page_size: int

    @property
    def page_nbytes(self) -> int: ...

    def backup_from_device_all_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None: ...

    def load_to_device_per_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
    ) -> None: ...


class HostPages(PageSource, Protocol):
    """What the host <-> storage worker needs of a host pool: the store's page source, whose
    pages are ``page_size`` slots each."""

    page_size: int


@dataclass(frozen=True)
class TransferJob:
    """What to move. Device <-> host jobs pair ``host_indices`` with ``device_indices`` slot
    by slot; storage jobs pair ``keys`` with whole host pages (``page_size`` slots each).
    ``segments``: a prefetch of several chains (one per request), their page counts in order;
    each stops at its own first page not served (empty: the keys are one chain)."""

    job_id: JobId
    direction: Direction
    host_indices: torch.Tensor
    device_indices: torch.Tensor | None = None
    keys: tuple[bytes, ...] = field(default=())
    segments: tuple[int, ...] = field(default=())

    @classmethod
    def write(cls, job_id: JobId, device: torch.Tensor, host: torch.Tensor) -> TransferJob:
        """Device -> host, every layer, after the compute issued so far."""
        return cls(job_id, Direction.DEVICE_TO_HOST, host, device)

    @classmethod
    def load(cls, job_id: JobId, host: torch.Tensor, device: torch.Tensor) -> TransferJob:
        """Host -> device, layer by layer (the device pool's getters wait per layer)."""
        return cls(job_id, Direction.HOST_TO_DEVICE, host, device)

    @classmethod
    def backup(cls, job_id: JobId, keys: Sequence[bytes], host: torch.Tensor) -> TransferJob:
        """Host pages -> storage under ``keys``."""
        return cls(job_id, Direction.HOST_TO_STORAGE, host, None, tuple(keys))

    @classmethod
    def prefetch(
        cls,
        job_id: JobId,
        keys: Sequence[bytes],
        host: torch.Tensor,
        segments: Sequence[int] = (),
    ) -> TransferJob:
        """Storage -> host pages, in order, stopping at the first page the store cannot serve
        (per segment: one chain's first page not served ends that chain only)."""
        return cls(job_id, Direction.STORAGE_TO_HOST, host, None, tuple(keys), tuple(segments))

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class TransferResult:
    job_id: JobId
    direction: Direction
    ok: bool  # every slot / page of the job landed
    nbytes: int  # bytes that landed
    seconds: float  # time the copy itself ran
    pages_done: int = 0  # storage jobs: pages stored, or leading pages loaded
    num_pages: int = 0  # the job's pages, any direction (0: refused, or the sim's device jobs)
    error: str | None = None  # the exception a storage call raised, if one did
    segment_pages: tuple[int, ...] = ()  # a segmented prefetch: leading pages done per segment


class TransferWorker(ABC):
    """Moves bytes for the directions in ``directions``; see the module docstring."""

    directions: tuple[Direction, ...]

    @abstractmethod
    def submit(self, job: TransferJob) -> bool: ...

    @abstractmethod
    def poll(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(
        self, job_ids: Iterable[JobId] | None = None, timeout_s: float | None = None
    ) -> bool: ...

    def cancel(self, job_id: JobId) -> None:  # noqa: B027 - a no-op where jobs cannot stop
        """Stop a storage job after its batch in progress."""

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Jobs submitted whose results ``poll`` has not delivered yet."""

"""The collaborators of the cache manager, as ``typing.Protocol``s.

The real classes implement them (the paged device allocator, the host pools, the page stores,
the transfer workers), and so do the simulator's counting fakes; the manager is typed against
these and nothing else. Each protocol states the contract the manager relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from tiered_kv.names import JobId
from tiered_kv.transfer.base import TransferJob, TransferResult
from tiered_kv.tree.node import TreeNode


@runtime_checkable
class SlotPool(Protocol):
    """Slots of one tier. ``alloc`` returns None (and changes nothing) when it cannot hand out
    ``n`` slots; it never hands one slot to two owners. ``free`` takes back slots ``alloc``
    gave."""

    def alloc(self, n: int) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


@runtime_checkable
class DeviceSlots(SlotPool, Protocol):
    """The device tier's slots (a token or paged allocator)."""


@runtime_checkable
class HostSlots(SlotPool, Protocol):
    """The host tier's slots: whole pages of ``page_size`` slots."""

    page_size: int


@runtime_checkable
class PageProbe(Protocol):
    """What the manager asks a page store on the serving path: how many of ``keys``, from the
    first, it holds. It may raise; the manager counts that as a storage error and a miss."""

    def batch_exists(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class TransferWorker(Protocol):
    """One worker of the transfer contract (``transfer.base``): submit, poll, wait, cancel."""

    def submit(self, job: TransferJob) -> bool: ...

    def poll(self) -> list[TransferResult]: ...

    def wait(
        self, job_ids: Iterable[JobId] | None = None, timeout_s: float | None = None
    ) -> bool: ...

    def cancel(self, job_id: JobId) -> None: ...

    def close(self) -> None: ...

    @property
    def in_flight(self) -> int: ...


@runtime_checkable
class LoadWorker(TransferWorker, Protocol):
    """A worker of host -> device loads that reports each load's layer-done slot (None where
    loads complete at once)."""

    def load_slot(self, job_id: JobId) -> int | None: ...


@runtime_checkable
class JobBook(Protocol):
    """What the manager lends its helpers (eviction, prefetch): acknowledging jobs, locks that
    free what they release, allocation with eviction, and the write policies' copies."""

    def poll(self) -> None: ...

    def inc_lock_ref(self, node: TreeNode) -> None: ...

    def dec_lock_ref(self, node: TreeNode) -> None: ...

    def inc_host_ref(self, node: TreeNode) -> None: ...

    def dec_host_ref(self, node: TreeNode) -> None: ...

    def alloc_host(self, n: int, protect: TreeNode | None = None) -> torch.Tensor | None: ...

    def write_to_host(self, node: TreeNode, wait: bool = False) -> bool: ...

    def backup_to_storage(self, node: TreeNode, wait: bool = False) -> None: ...


@runtime_checkable
class Snapshots(Protocol):
    """Where a hybrid model's recurrent-state snapshots live (``StateLedger``): the evictor
    drops them from a tier with their pages (backing them up a tier down first)."""

    def drop_device(self, digests: Iterable[bytes]) -> None: ...

    def drop_host(self, digests: Iterable[bytes]) -> None: ...


@runtime_checkable
class StateHitRule(Protocol):
    """A hybrid model's hit rule (``RecurrentState``): a match is cut back to the deepest page
    whose state snapshot some tier holds; ``ledger`` is where the snapshots live."""

    ledger: Snapshots

    def trim(self, tree, tokens, m, hit, count: bool = True): ...

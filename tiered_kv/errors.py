"""The TieredKVError family: every error the package raises on purpose.

Each message names the offending value and what would be valid. Recoverable conditions (a pool
that is full, a disk that is full) are return values or counted events, never these errors.
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Base class of every error tiered_kv raises on purpose."""


class InvalidArgumentError(TieredKVError, ValueError):
    """An argument has the wrong value, shape, dtype or device. Nothing was changed."""


class OwnershipError(TieredKVError):
    """A slot, page or row was freed twice, freed while not owned, or is a padding sink."""


class PhysicalWriteLocError(InvalidArgumentError):
    """A pool that needs physical write locations got a loc that is not marked physical."""


class LayoutError(TieredKVError):
    """A buffer was asked for that this pool's layout does not have (e.g. V of a K-only pool)."""


class BackendUnavailableError(TieredKVError):
    """A kernel backend or device was requested that this process cannot run."""


class StateError(TieredKVError):
    """A call came in the wrong order (e.g. free_group_end without free_group_begin)."""


class LivenessError(StateError):
    """A scheduler step had nothing running and admitted nothing while requests waited and no
    copy was in flight: a request that could run was parked (a bug: the counts are in the
    message). Raised in a scheduler's debug mode; otherwise counted as a stall."""


class StorageClosedError(StateError):
    """A call on a page store after its ``close()`` (closing again is fine): open a new store."""


class TransferError(TieredKVError):
    """A copy between tiers failed part-way (e.g. the native block copier refused it)."""


class HostMemoryError(TieredKVError):
    """A host pool would not fit in available memory. Lower the named setting."""


class StorageOpenError(TieredKVError):
    """The store directory cannot be created, opened or written. The message says which path."""


class ClientClosedError(TieredKVError):
    """A call on a remote store's client that is closed or closing (stores count it as a
    miss)."""


class IntegrityError(TieredKVError):
    """A structure's invariants do not hold (a bug, never a user error): the message has the
    counts that disagree."""

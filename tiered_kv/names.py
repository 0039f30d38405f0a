"""The package's vocabulary in one place: policy names, layouts, io backends, tiers, directions,
and the ids that travel between the tree, the manager and the transfer workers.

Every name is a ``str`` enum, so a member equals its string (``WritePolicy.WRITE_BACK ==
"write_back"``) and configs, the command line and JSON keep plain strings. Code compares members,
never strings: :func:`parse` turns user input into a member or raises an
:class:`InvalidArgumentError` naming the value and the valid choices.
"""

from __future__ import annotations

import enum
from typing import NewType, TypeVar

from tiered_kv.errors import InvalidArgumentError

PageDigest = NewType("PageDigest", bytes)  # a page's SHA-256 chain digest (storage.keys)
JobId = NewType("JobId", int)  # one transfer job, unique per cache


class Name(str, enum.Enum):
    """A named choice; ``str(member)`` is its value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class WritePolicy(Name):
    """When device pages are copied to host (and host pages to storage)."""

    WRITE_THROUGH = "write_through"  # at insert; host -> storage when that copy lands
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # at a node's selective_hits-th hit
    WRITE_BACK = "write_back"  # only when evicted


class PrefetchPolicy(Name):
    """How long ``begin`` waits for a storage -> host prefetch."""

    BEST_EFFORT = "best_effort"  # not at all: what has arrived is used
    WAIT_COMPLETE = "wait_complete"  # until every page arrived or failed
    TIMEOUT = "timeout"  # up to a time that grows with the hit's length


class EvictionPolicyName(Name):
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    S3FIFO = "s3fifo"
    GHOST_LRU = "ghost_lru"  # LRU with admission on the second sighting (a ghost list)


class HostLayout(Name):
    """How a host pool's buffer is laid out (see ``host.layout``)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"

    @property
    def token_major(self) -> bool:
        """Whether one token's records of every layer are contiguous (page_first layouts)."""
        return self is not HostLayout.LAYER_FIRST


class IOBackend(Name):
    KERNEL = "kernel"  # every row in one kernel call
    DIRECT = "direct"  # one copy_ per run of consecutive slots


class StorageLayout(Name):
    """How the storage tier lays out pages on disk (``docs/storage_tier.md``)."""

    LMDB = "lmdb"  # page bytes inside LMDB's memory-mapped data file
    SLAB = "slab"  # LMDB holds the index; page bytes in a preallocated file per namespace


class ModelKind(Name):
    MHA = "mha"
    MLA = "mla"
    DSA = "dsa"  # MLA plus the sparse indexer's key cache
    SWA = "swa"  # MHA layers, most of them sliding-window (a full layer every full_layer_every)
    # Full-attention MHA layers between recurrent (linear-attention) layers with per-request
    # state: layer i is full when (i + 1) % full_layer_every == 0
    HYBRID_LINEAR = "hybrid_linear"


class Tier(Name):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class Direction(Name):
    """Which way a transfer job moves bytes."""

    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    HOST_TO_STORAGE = "host_to_storage"
    STORAGE_TO_HOST = "storage_to_host"


class PendingKind(Name):
    """Which copy in flight touches a tree node (what it keeps from being evicted)."""

    WRITE = "write"  # device -> host: keeps the device slots and the new host slots
    LOAD = "load"  # host -> device: keeps both
    BACKUP = "backup"  # host -> storage: keeps the host slots


E = TypeVar("E", bound=Name)


def parse(cls: type[E], value: object, where: str) -> E:
    """``value`` as a member of ``cls``; InvalidArgumentError naming ``where`` otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value)
        except ValueError:
            pass
    raise InvalidArgumentError(
        f"{where}={value!r} is invalid: use one of {', '.join(cls.values())}"
    )

"""The storage contract the rest of the system codes against, and the page source it reads.

A store keeps whole host pages under :mod:`keys` keys. Every method is batched; nothing raises
into the caller for disk or memory trouble (those become per-key failures and counted events);
bad arguments raise :class:`~tiered_kv.errors.InvalidArgumentError` before anything changes,
and a call after ``close()`` raises :class:`~tiered_kv.errors.StorageClosedError`.
Each counted error is logged at WARNING, once per kind a minute in this process
(``ERROR_LOG``): a dead store fails every call, and its log must not grow with them.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError, StorageClosedError
from tiered_kv.log_limit import LogLimiter
from tiered_kv.storage.keys import KEY_BYTES, StorageNamespace

log = logging.getLogger(__name__)
ERROR_LOG = LogLimiter(log)  # every store's counted errors, by kind (call: exception type)


class PageSource(Protocol):
    """What a store needs of a host pool: page count and size in bytes, a page's bytes (a view
    where possible), and filling a page from bytes."""

    @property
    def page_nbytes(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    def get_page_bytes(self, page: int) -> torch.Tensor: ...

    def set_page_bytes(self, page: int, data: object) -> None: ...

    # Optional: ``page_bytes_zero_copy = True`` says get_page_bytes returns a writable view that
    # a store may fill directly (as a page_first host pool's does); ``page_bytes_rows()`` may
    # then return all pages as one ``(num_pages, page_nbytes)`` uint8 numpy view (or None), which
    # saves a tensor view per page.


def page_rows(source: PageSource) -> np.ndarray | None:
    """``source.page_bytes_rows()`` where the source is zero-copy and offers it, else None."""
    if not getattr(source, "page_bytes_zero_copy", False):
        return None
    rows_of = getattr(source, "page_bytes_rows", None)
    rows = rows_of() if rows_of is not None else None
    if rows is not None and rows.shape != (source.num_pages, source.page_nbytes):
        raise InvalidArgumentError(
            f"page_bytes_rows() has shape {rows.shape}; expected "
            f"({source.num_pages}, {source.page_nbytes})"
        )
    return rows


def as_bytes_tensor(data: object) -> torch.Tensor:
    """A page's bytes (a tensor, or any buffer a store hands back) as a flat uint8 tensor; a
    read-only buffer is copied (torch takes no read-only memory)."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    arr = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


@dataclass
class StorageStats:
    """Counters since the store was opened (``pages``/``bytes`` are the store's current size)."""

    pages: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    sets: int = 0
    set_skipped: int = 0
    existing_refreshed: int = 0
    checksum_failures: int = 0
    evictions: int = 0
    map_resizes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # A GuardedStorage's events (zero for a bare store): reopens after failing calls in a row,
    # times it was turned off, calls answered as misses while off, and whether it is off now.
    reopens: int = 0
    turned_off: int = 0
    skipped_while_off: int = 0
    off: bool = False

    def count_error(self, what: str) -> None:
        """Count (and log, rate-limited) one error of kind ``what``."""
        self.errors[what] = self.errors.get(what, 0) + 1
        ERROR_LOG.log(logging.WARNING, what, "storage error: %s (a counted miss)", what)

    def snapshot(self) -> StorageStats:
        """An independent copy (what ``stats()`` hands out)."""
        return StorageStats(**{**self.__dict__, "errors": dict(self.errors)})


class PageStorage(abc.ABC):
    """A page store bound to one namespace and page size."""

    _closed = False  # set by a store's close(); its calls then raise StorageClosedError

    def __init__(self, namespace: StorageNamespace, page_nbytes: int) -> None:
        if not isinstance(namespace, StorageNamespace):
            raise InvalidArgumentError("namespace must be a StorageNamespace")
        if namespace.model is None:
            raise InvalidArgumentError(
                "the namespace has no model identity: pass model='<name>@<weights fingerprint or "
                "revision>' to StorageNamespace.create / for_host_pool (TieredKVConfig.model_id), "
                "so that KV of two models with the same shape never shares a page"
            )
        if isinstance(page_nbytes, bool) or not isinstance(page_nbytes, int) or page_nbytes < 1:
            raise InvalidArgumentError(f"page_nbytes={page_nbytes!r} must be an int >= 1")
        self.namespace = namespace
        self.page_nbytes = page_nbytes
        self._stats = StorageStats()  # implementations replace it with their own counters

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    def _check_open(self, call: str) -> None:
        """Refuse a call on a closed store before it touches anything: its files, connection
        or registered memory are released, and reopening them silently would leak them."""
        if self._closed:
            path = getattr(self, "path", None)  # the local stores' directory
            where = f" at {path}" if path is not None else ""
            raise StorageClosedError(
                f"{type(self).__name__}.{call}: the store{where} (namespace "
                f"{self.namespace.fingerprint.hex()[:12]}) was closed; open a new store to use it "
                "(close() may be called again)"
            )

    # -- argument checks shared by implementations --------------------------------------------
    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        if isinstance(keys, (bytes, bytearray, str)):
            raise InvalidArgumentError("keys must be a sequence of keys, not a single key")
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise InvalidArgumentError(
                    f"key {k!r:.60} is not a page key ({KEY_BYTES} bytes from storage.keys)"
                )
            if not self.namespace.owns(bytes(k)):
                raise InvalidArgumentError(
                    f"key {bytes(k)[:16].hex()}... belongs to an unknown namespace; this store "
                    f"holds namespace {self.namespace.fingerprint.hex()}"
                )
            out.append(bytes(k))
        return out

    def _check_pages(
        self, keys: list[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[int]:
        if source.page_nbytes != self.page_nbytes:
            raise InvalidArgumentError(
                f"host pool pages have {source.page_nbytes} bytes; this store holds pages of "
                f"{self.page_nbytes}"
            )
        if isinstance(pages, torch.Tensor):
            pages = pages.tolist()
        pages = list(pages)
        if any(
            isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)) for p in pages
        ):
            raise InvalidArgumentError(f"host pages must be ints, got {pages[:8]}")
        pages = [int(p) for p in pages]
        if len(pages) != len(keys):
            raise InvalidArgumentError(
                f"{len(keys)} keys but {len(pages)} host pages; they pair up one to one"
            )
        bad = [p for p in pages if not 0 <= p < source.num_pages]
        if bad:
            raise InvalidArgumentError(
                f"host pages {bad[:8]} are not pages of the source; valid pages are "
                f"0..{source.num_pages - 1}"
            )
        return pages

    # -- the contract -------------------------------------------------------------------------
    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """How many keys from the start are present (stops at the first miss); 0 for []."""

    @abc.abstractmethod
    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        """Fill host page ``pages[i]`` with the bytes stored under ``keys[i]``; per key, whether
        it was served. A page that fails its checksum is deleted, counted and reported False;
        its host page may hold partial bytes then and must not be used."""

    @abc.abstractmethod
    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        """Store host page ``pages[i]`` under ``keys[i]``; per key, whether it is stored now. A
        key already present is a no-op that refreshes its recency. A full store evicts old pages
        or skips the write (counted), never raises."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys; the number that were present."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every page of this store's namespace."""

    @abc.abstractmethod
    def stats(self) -> StorageStats: ...

    def error_count(self) -> int:
        """How many errors the store has counted since it opened; cheap (no I/O), so a caller
        can tell whether one call met trouble."""
        return sum(self._stats.errors.values())

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources (the default has none). Safe twice; any other call after it raises
        StorageClosedError."""
        self._closed = True

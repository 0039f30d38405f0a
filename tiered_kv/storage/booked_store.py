"""What the two local store layouts share above their books: ``batch_exists``, and a read of a
store whose directory was removed or replaced answered as counted misses.

Both ``LMDBStorage`` and ``SlabStorage`` keep their index in LMDB books (``leading_present``)
behind one lock, and check before every call that the files they opened are still the ones on
disk (``_intact``); they differ in where page bytes live and how they are read.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tiered_kv.storage import lmdb_env
from tiered_kv.storage.contract import PageStorage


class BookedStorage(PageStorage):
    """A page store with LMDB books; subclasses provide the lock, the books, ``_read`` and
    ``_intact``."""

    _lock: threading.RLock
    _books: Any  # the layout's books: leading_present(txn, keys)

    @abc.abstractmethod
    def _read(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(txn)`` in a read transaction of the books."""

    @abc.abstractmethod
    def _intact(self) -> bool:
        """False (and counted) when the store's files were removed or replaced under it."""

    @lmdb_env.absorbs_lmdb_errors(lambda store, keys: 0)
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        keys = self._check_keys(keys)
        with self._lock:
            if not self._intact():
                return 0
            return self._read(lambda txn: self._books.leading_present(txn, keys))

    def _misses_if_moved(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Every key a counted miss when the store was moved (a get must not read a deleted
        file's pages), else None."""
        if self._intact():
            return None
        self._stats.gets += len(keys)
        self._stats.misses += len(keys)
        return [False] * len(keys)

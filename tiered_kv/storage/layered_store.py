"""LayeredStorage: a node's own local store in front of a shared remote one.

Writes go to both; reads try the local store first and fetch only its misses from the remote
one, writing what the remote store served into the local one (so a node keeps its hot pages
across restarts while it shares the rest). Each layer verifies its own values; a layer's
trouble is that layer's counted miss, and the other one still serves. ``batch_exists`` counts
the leading keys that either layer holds.

Counters: gets, hits, misses, sets and set_skipped (a page neither layer stored) are the
layered store's own; pages, bytes and existing_refreshed are the remote store's (the complete,
shared copy); checksum failures, evictions and errors are both layers' (errors prefixed
``local:`` / ``remote:``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats


class LayeredStorage(PageStorage):
    def __init__(self, local: PageStorage, remote: PageStorage) -> None:
        for name, store in (("local", local), ("remote", remote)):
            if not isinstance(store, PageStorage):
                raise InvalidArgumentError(f"{name}={store!r} is not a PageStorage")
        if local.namespace.fingerprint != remote.namespace.fingerprint:
            raise InvalidArgumentError("local and remote stores hold different namespaces")
        if local.page_nbytes != remote.page_nbytes:
            raise InvalidArgumentError(
                f"local pages of {local.page_nbytes} bytes, remote of {remote.page_nbytes}; "
                "they must be equal"
            )
        super().__init__(remote.namespace, remote.page_nbytes)
        self.local, self.remote = local, remote
        self._own = StorageStats()
        self._lock = threading.Lock()

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open("batch_exists")
        keys = self._check_keys(keys)
        n = 0
        while n < len(keys):
            a = self.local.batch_exists(keys[n:])
            n += a
            b = self.remote.batch_exists(keys[n:]) if n < len(keys) else 0
            n += b
            if not (a or b):
                break
        return n

    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_get")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        out = self.local.batch_get(keys, source, pages) if keys else []
        missed = [i for i, ok in enumerate(out) if not ok]
        if missed:
            got = self.remote.batch_get(
                [keys[i] for i in missed], source, [pages[i] for i in missed]
            )
            fill = [i for i, ok in zip(missed, got, strict=True) if ok]
            for i in fill:
                out[i] = True
            if fill:  # the node keeps what it just fetched
                self.local.batch_set([keys[i] for i in fill], source, [pages[i] for i in fill])
        with self._lock:
            self._own.gets += len(keys)
            self._own.hits += sum(out)
            self._own.misses += len(out) - sum(out)
        return out

    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_set")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not keys:
            return []
        remote = self.remote.batch_set(keys, source, pages)
        local = self.local.batch_set(keys, source, pages)
        out = [a or b for a, b in zip(local, remote, strict=True)]
        with self._lock:
            self._own.sets += len(keys)
            self._own.set_skipped += out.count(False)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open("delete")
        keys = self._check_keys(keys)
        return max(self.local.delete(keys), self.remote.delete(keys))

    def clear(self) -> None:
        self._check_open("clear")
        self.local.clear()
        self.remote.clear()

    def stats(self) -> StorageStats:
        self._check_open("stats")
        local, remote = self.local.stats(), self.remote.stats()
        with self._lock:
            own = self._own.snapshot()
        own.pages, own.bytes, own.budget_bytes = remote.pages, remote.bytes, remote.budget_bytes
        own.existing_refreshed = remote.existing_refreshed
        own.checksum_failures = local.checksum_failures + remote.checksum_failures
        own.evictions = local.evictions + remote.evictions
        own.errors = {
            **{f"local: {k}": v for k, v in local.errors.items()},
            **{f"remote: {k}": v for k, v in remote.errors.items()},
        }
        return own

    def flush(self) -> None:
        self._check_open("flush")
        for store in (self.local, self.remote):
            flush = getattr(store, "flush", None)
            if flush is not None:
                flush()

    def close(self) -> None:
        """Close both stores. Safe twice; any other call after it raises StorageClosedError
        here, before it can reach either store."""
        self._closed = True
        try:
            self.local.close()
        finally:
            self.remote.close()

"""MemoryStorage: the storage contract in a dict, with LRU eviction under a byte budget (tests
and single-process experiments). Same checks, same counters, same header verification."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import value_format
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats
from tiered_kv.storage.keys import StorageNamespace


class MemoryStorage(PageStorage):
    def __init__(
        self, namespace: StorageNamespace, page_nbytes: int, budget_bytes: int | None = None
    ) -> None:
        super().__init__(namespace, page_nbytes)
        record = page_nbytes + value_format.HEADER_BYTES
        if budget_bytes is not None and budget_bytes < record:
            raise InvalidArgumentError(
                f"budget_bytes={budget_bytes} cannot hold one page of {record} bytes"
            )
        self.budget_bytes = budget_bytes
        self._pages: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._stats = StorageStats(budget_bytes=budget_bytes or 0)
        self._lock = threading.Lock()
        self._tick = 0

    def _record_bytes(self) -> int:
        return self.page_nbytes + value_format.HEADER_BYTES

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open("batch_exists")
        keys = self._check_keys(keys)
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._pages:
                    break
                n += 1
            return n

    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_get")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        out = []
        with self._lock:
            for k, page in zip(keys, pages, strict=True):
                self._stats.gets += 1
                entry = self._pages.get(k)
                if entry is None:
                    self._stats.misses += 1
                    out.append(False)
                    continue
                header, payload = entry
                if not value_format.verify(
                    value_format.unpack(header), self.namespace.fingerprint, payload, key=k
                ):
                    del self._pages[k]
                    self._stats.checksum_failures += 1
                    self._stats.misses += 1
                    out.append(False)
                    continue
                source.set_page_bytes(page, payload)
                self._pages.move_to_end(k)
                self._stats.hits += 1
                out.append(True)
        return out

    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_set")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        out = []
        with self._lock:
            for k, page in zip(keys, pages, strict=True):
                self._stats.sets += 1
                if k in self._pages:
                    self._pages.move_to_end(k)
                    self._stats.existing_refreshed += 1
                    out.append(True)
                    continue
                if self.budget_bytes is not None:
                    while (len(self._pages) + 1) * self._record_bytes() > self.budget_bytes:
                        self._pages.popitem(last=False)
                        self._stats.evictions += 1
                payload = bytes(source.get_page_bytes(page).numpy().tobytes())
                self._tick += 1
                header = value_format.pack(
                    self.namespace.fingerprint, payload, self._tick, key=bytes(k)
                )
                self._pages[k] = (header, payload)
                out.append(True)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open("delete")
        keys = self._check_keys(keys)
        with self._lock:
            return sum(self._pages.pop(k, None) is not None for k in keys)

    def clear(self) -> None:
        self._check_open("clear")
        with self._lock:
            self._pages.clear()

    def stats(self) -> StorageStats:
        self._check_open("stats")
        with self._lock:
            self._stats.pages = len(self._pages)
            self._stats.bytes = len(self._pages) * self._record_bytes()
            return self._stats.snapshot()

    def corrupt_for_test(self, key: bytes, offset: int) -> None:
        """Flip one payload byte (tests of checksum handling)."""
        header, payload = self._pages[key]
        flipped = bytearray(payload)
        flipped[offset] ^= 0xFF
        self._pages[key] = (header, bytes(flipped))

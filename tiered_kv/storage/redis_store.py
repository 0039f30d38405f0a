"""RedisStorage: the storage contract on a Redis (or Valkey) server shared by several nodes.

Layout on the server, per namespace (its fingerprint ``fp``): each page is two string values,
its bytes in ``tkv:v:<key>`` and its header (``value_format``: namespace, length, checksum) in
``tkv:h:<key>`` (apart, so a page is sent from host memory without a copy), both written and
read in one call, and a sorted set ``tkv:z:<fp>`` indexes the namespace's keys by recency (a
tick from the server's ``tkv:tick`` counter). A set runs as one MULTI/EXEC transaction per batch
(both values as ``SET NX``, then a small Lua script that indexes the keys), so writers on
several nodes stay consistent: a present key is only refreshed, a new one written and indexed,
and while the namespace holds more than its ``budget_bytes`` allows, its least recently used
pages go (counted as evictions). Reads are pipelined; every value is verified before its bytes
reach the host page, and a value that fails (a flipped byte, another namespace's or a torn
record) is deleted and counted: a miss, never served. A server that evicts by itself
(``maxmemory``) leaves index entries behind; reads drop them.

Every Redis error (a server down, a timeout, an out-of-memory refusal) is counted in
``stats().errors`` and answered as a miss: exists 0, get and set False, delete 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import redis

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import value_format
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats
from tiered_kv.storage.keys import StorageNamespace

_VALUE, _HEADER, _INDEX, _TICK = b"tkv:v:", b"tkv:h:", b"tkv:z:", b"tkv:tick"

# The index half of a set, run after the batch's SET NX commands in the same MULTI/EXEC
# transaction (the page values never pass through Lua: a script's arguments are copied into Lua
# strings, which made the whole set a third as fast as plain SETs). KEYS: index, tick counter,
# value keys...; ARGV: budget in pages (0: none). Every key gets the next tick (a present key's
# recency is refreshed); while the index holds more than the budget its oldest pages go.
# Returns the pages evicted.
_INDEX_SET = """
local index, tick, n = KEYS[1], KEYS[2], #KEYS - 2
local budget = tonumber(ARGV[1])
local last = redis.call('INCRBY', tick, n)
for i = 1, n do
  redis.call('ZADD', index, last - n + i, KEYS[i + 2])
end
local evicted = 0
if budget > 0 then
  local over = redis.call('ZCARD', index) - budget
  if over > 0 then
    local old = redis.call('ZPOPMIN', index, over)
    for j = 1, #old, 2 do
      redis.call('DEL', old[j], 'tkv:h:' .. string.sub(old[j], 7))
      evicted = evicted + 1
    end
  end
end
return evicted
"""


class RedisStorage(PageStorage):
    """``url``: the server (``redis://host:port/db``); ``budget_bytes``: the most this
    namespace's pages may take (None: only the server's own limit); ``timeout_s``: per call."""

    def __init__(
        self,
        namespace: StorageNamespace,
        page_nbytes: int,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        budget_bytes: int | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        super().__init__(namespace, page_nbytes)
        record = page_nbytes + value_format.HEADER_BYTES
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
        ):
            raise InvalidArgumentError(f"budget_bytes={budget_bytes!r} must be an int or None")
        if budget_bytes is not None and budget_bytes < record:
            raise InvalidArgumentError(
                f"budget_bytes={budget_bytes} cannot hold one page of {record} bytes"
            )
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgumentError(f"url={url!r}; expected redis://host:port/db")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise InvalidArgumentError(f"timeout_s={timeout_s!r} must be a number > 0")
        self.url = url
        self.budget_bytes = budget_bytes
        self._record = record
        self._budget_pages = 0 if budget_bytes is None else budget_bytes // record
        self._stats = StorageStats(budget_bytes=budget_bytes or 0)
        self._index = _INDEX + namespace.fingerprint
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._index_set = self._client.register_script(_INDEX_SET)
        self._lock = threading.Lock()  # the counters; the client is thread-safe itself

    def _failed(self, what: str, exc: redis.RedisError) -> None:
        with self._lock:  # by call and kind: a bounded set of counters, not one per message
            self._stats.count_error(f"{what}: {type(exc).__name__}")

    # -- the contract -------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open("batch_exists")
        keys = self._check_keys(keys)
        n = 0
        for p in self._present(keys, "batch_exists") if keys else []:
            if not p:
                break
            n += 1
        return n

    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_get")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not keys:
            return []
        try:
            got = self._client.mget([_VALUE + k for k in keys] + [_HEADER + k for k in keys])
        except redis.RedisError as exc:
            self._failed("batch_get", exc)
            with self._lock:
                self._stats.gets += len(keys)
                self._stats.misses += len(keys)
            return [False] * len(keys)
        out, bad, gone, hit = [], [], [], []
        fp, n = self.namespace.fingerprint, len(keys)
        for k, page, payload, raw in zip(keys, pages, got[:n], got[n:], strict=True):
            if payload is None:
                gone.append(k)
                out.append(False)
                continue
            header = value_format.unpack(raw) if raw is not None else None
            if len(payload) != self.page_nbytes or not value_format.verify(
                header, fp, payload, key=k
            ):
                bad.append(k)
                out.append(False)
                continue
            source.set_page_bytes(page, payload)
            hit.append(k)
            out.append(True)
        with self._lock:
            self._stats.gets += len(keys)
            self._stats.hits += len(hit)
            self._stats.misses += len(keys) - len(hit)
            self._stats.checksum_failures += len(bad)
        self._after_get(hit, bad, gone)
        return out

    def _after_get(self, hit: list[bytes], bad: list[bytes], gone: list[bytes]) -> None:
        """Refresh the hits' recency; delete what failed verification; drop index entries of
        values the server evicted by itself. Trouble here loses recency only (counted)."""
        if not (hit or bad or gone):
            return
        try:
            last = int(self._client.incrby(_TICK, len(hit))) if hit else 0
            pipe = self._client.pipeline(transaction=False)
            if hit:  # the ticks last - len + 1 .. last, in read order
                first = last - len(hit) + 1
                pipe.zadd(self._index, {_VALUE + k: first + i for i, k in enumerate(hit)})
            for k in bad:
                pipe.delete(_VALUE + k, _HEADER + k)
            for k in gone:
                pipe.delete(_HEADER + k)
            if bad or gone:
                pipe.zrem(self._index, *[_VALUE + k for k in bad + gone])
            pipe.execute()
        except redis.RedisError as exc:
            self._failed("batch_get recency", exc)

    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_set")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not keys:
            return []
        fp = self.namespace.fingerprint
        names = [_VALUE + k for k in keys]
        # One MULTI/EXEC: a present key keeps its value (SET NX), every key is indexed, and a
        # dropped connection before EXEC leaves nothing half-written (no value outside the index).
        pipe = self._client.pipeline(transaction=True)
        for k, page in zip(keys, pages, strict=True):
            # The page goes as it lies in host memory (no copy); its header is its own value.
            payload = memoryview(np.ascontiguousarray(source.get_page_bytes(page).numpy())).cast(
                "B"
            )
            pipe.set(_HEADER + k, value_format.pack(fp, payload, 0, key=k), nx=True)
            pipe.set(_VALUE + k, payload, nx=True)
        self._index_set(keys=[self._index, _TICK, *names], args=[self._budget_pages], client=pipe)
        try:
            codes = pipe.execute()
        except redis.RedisError as exc:
            self._failed("batch_set", exc)
            with self._lock:
                self._stats.sets += len(keys)
                self._stats.set_skipped += len(keys)
            return [False] * len(keys)
        evicted = int(codes[-1])
        with self._lock:
            self._stats.sets += len(keys)
            self._stats.existing_refreshed += sum(1 for c in codes[1:-1:2] if not c)
            self._stats.evictions += evicted
        if not evicted:
            return [True] * len(keys)
        # A batch larger than the budget evicts its own first pages: say which are not kept.
        return [bool(p) for p in self._present(keys, "batch_set check")]

    def _present(self, keys: list[bytes], what: str) -> list[int]:
        """Per key, whether its value is on the server (all 0, counted, when it cannot say)."""
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(_VALUE + k)
        try:
            return pipe.execute()
        except redis.RedisError as exc:
            self._failed(what, exc)
            return [0] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open("delete")
        keys = self._check_keys(keys)
        if not keys:
            return 0
        names = list(dict.fromkeys(_VALUE + k for k in keys))
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(*names)
        pipe.delete(*[_HEADER + n[len(_VALUE) :] for n in names])
        pipe.zrem(self._index, *names)
        try:
            removed, _, _ = pipe.execute()
        except redis.RedisError as exc:
            self._failed("delete", exc)
            return 0
        return int(removed)

    def clear(self) -> None:
        """Delete this namespace's pages (other namespaces on the server keep theirs)."""
        self._check_open("clear")
        try:
            while True:
                names = self._client.zrange(self._index, 0, 511)
                if not names:
                    return
                pipe = self._client.pipeline(transaction=True)
                pipe.delete(*names, *[_HEADER + n[len(_VALUE) :] for n in names])
                pipe.zrem(self._index, *names)
                pipe.execute()
        except redis.RedisError as exc:
            self._failed("clear", exc)

    def stats(self) -> StorageStats:
        self._check_open("stats")
        try:
            pages = int(self._client.zcard(self._index))
        except redis.RedisError as exc:
            self._failed("stats", exc)
            pages = self._stats.pages
        with self._lock:
            self._stats.pages = pages
            self._stats.bytes = pages * self._record
            return self._stats.snapshot()

    def close(self) -> None:
        """Disconnect. Safe twice; any other call after it raises StorageClosedError (redis-py
        would silently connect again)."""
        self._client.close()
        self._closed = True

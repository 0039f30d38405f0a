"""MooncakeStorage: the storage contract on a Mooncake Store (``mooncake_master`` and the
memory its clients lend), shared by every node that talks to the same master.

Each page is one object ``tkv:<key hex>`` (the key starts with the namespace fingerprint, so a
namespace is a key prefix): our header (``value_format``: namespace, length, checksum) then the
page bytes. Both travel zero-copy: a batch is one ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` call whose two buffers per key are a row of a registered
header arena and the host page itself (a zero-copy host pool's memory is registered once; other
sources go through a registered staging area). Every read is verified before it counts: a value
that fails (a flipped byte, a torn or oversized value, another namespace's record) is removed,
counted and a miss; a zero-copy host page may hold its partial bytes then, as the contract
allows.

The store evicts by itself (lease-expired objects, oldest first, above its high watermark); a
full store answers some puts with an error while it evicts. Behaviours coded around: ``put`` of
a present key keeps the old value (so a set checks presence first and counts a refresh, whose
``is_exist`` also renews the lease), a removal right after a read fails for the lease's length
unless forced (we force), and a missing key is answered with a code, not data. Every failure (a
master down, a full store, a timeout) is counted in ``stats().errors`` by call and kind and
answered as a miss: exists 0, get and set False, delete 0.

``stats().pages`` counts the pages this store has written or read and not seen go since it
opened (the store has no per-namespace count; its own evictions show up as misses later).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence

import numpy as np

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import value_format
from tiered_kv.storage.contract import PageSource, PageStorage, StorageStats, page_rows
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.storage.mooncake_client import (
    BUFFER_OVERFLOW,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    ClientClosedError,
    Connection,
    MooncakeClient,
    code_name,
)

_PREFIX = "tkv:"
_HEAD = value_format.HEADER_BYTES
_STAGE_BYTES = 64 << 20  # the most a staging area holds (a batch goes in chunks of it)
_MAX_CHUNK = 512  # keys per store call


def _name(key: bytes) -> str:
    return _PREFIX + key.hex()


class _Arena:
    """Registered rows a chunk of one call direction builds its buffers in: headers, and the
    staged pages of a source that is not zero-copy (allocated when first needed)."""

    def __init__(self, client: MooncakeClient, rows: int, page_nbytes: int) -> None:
        self.client, self.rows, self.page_nbytes = client, rows, page_nbytes
        self.lock = threading.Lock()  # one chunk at a time owns the rows
        self.headers = np.zeros((rows, _HEAD), dtype=np.uint8)
        client.register(self.headers)
        self._stage: np.ndarray | None = None

    def release(self) -> None:
        with self.lock, contextlib.suppress(ClientClosedError):
            for region in (self.headers, self._stage):
                if region is not None:
                    self.client.unregister(region)
            self._stage = None

    def stage(self) -> np.ndarray:
        if self._stage is None:
            stage = np.empty((self.rows, self.page_nbytes), dtype=np.uint8)
            with contextlib.suppress(ClientClosedError):  # the call after says so, counted
                self.client.register(stage)
            self._stage = stage
        return self._stage


class MooncakeStorage(PageStorage):
    """``master``: ``host:port`` of ``mooncake_master``; ``metadata_server``: ``P2PHANDSHAKE``
    (no metadata server) or its URL; ``local_hostname``: the address other nodes reach this
    one on; ``protocol``: ``tcp`` or ``rdma`` (with ``device_name``); ``budget_bytes``: the
    memory this node lends to the store (``segment_bytes`` overrides it; 0 lends none, for a
    node whose store memory another process lends, e.g. a ``mooncake_client``)."""

    def __init__(
        self,
        namespace: StorageNamespace,
        page_nbytes: int,
        *,
        master: str = "127.0.0.1:50051",
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        budget_bytes: int | None = None,
        segment_bytes: int | None = None,
        local_buffer_bytes: int = 16 << 20,
    ) -> None:
        super().__init__(namespace, page_nbytes)
        record = page_nbytes + _HEAD
        for name, value, least in (
            ("budget_bytes", budget_bytes, record),
            ("segment_bytes", segment_bytes, 0),
            ("local_buffer_bytes", local_buffer_bytes, 0),
        ):
            if value is None and name != "local_buffer_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"{name}={value!r} must be an int or None")
            if value < least:
                raise InvalidArgumentError(
                    f"{name}={value} cannot hold one page of {record} bytes"
                    if least
                    else f"{name}={value} must be >= 0"
                )
        host, _, port = master.rpartition(":") if isinstance(master, str) else ("", "", "")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"master={master!r}; expected host:port of mooncake_master")
        if protocol not in ("tcp", "rdma"):
            raise InvalidArgumentError(f"protocol={protocol!r}; expected tcp or rdma")
        for name, value in (
            ("metadata_server", metadata_server),
            ("local_hostname", local_hostname),
        ):
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"{name}={value!r} must be a non-empty string")
        if not isinstance(device_name, str):
            raise InvalidArgumentError(f"device_name={device_name!r} must be a string")
        self.master, self.budget_bytes = master, budget_bytes
        self._record = record
        self._stats = StorageStats(budget_bytes=budget_bytes or 0)
        self._lock = threading.Lock()  # the counters and the set of known pages
        self._known: set[bytes] = set()
        conn = Connection(
            master, metadata_server, local_hostname, protocol, device_name, local_buffer_bytes
        )
        self._client = MooncakeClient.shared(conn)
        lend = (budget_bytes or 0) if segment_bytes is None else segment_bytes
        self._segments = self._client.mount(lend) if lend else []
        rows = max(1, min(_MAX_CHUNK, _STAGE_BYTES // page_nbytes))
        self._put_arena = _Arena(self._client, rows, page_nbytes)
        self._get_arena = _Arena(self._client, rows, page_nbytes)

    def _failed(self, what: str, kind: str) -> None:
        with self._lock:  # by call and kind: a bounded set of counters, not one per message
            self._stats.count_error(f"{what}: {kind}")

    def _call(self, what: str, method: str, *args: object):
        """The client's ``method(*args)``, or None where it raised (counted: a closed client,
        an error of the binding)."""
        try:
            return self._client.call(method, *args)
        except Exception as exc:
            self._failed(what, type(exc).__name__)
            return None

    def _zero_copy_rows(self, source: PageSource) -> np.ndarray | None:
        """The source's pages as registered rows, or None (then pages are staged)."""
        rows = page_rows(source)
        if rows is None or not rows.flags.c_contiguous or rows.dtype != np.uint8:
            return None
        try:
            self._client.register(rows)
        except Exception as exc:  # then the transfer says whether it mattered
            self._failed("register", type(exc).__name__)
        return rows

    # -- the contract -------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open("batch_exists")
        keys = self._check_keys(keys)
        n = 0
        for code in self._exist_codes([_name(k) for k in keys], "batch_exists") if keys else []:
            if code != 1:
                break
            n += 1
        return n

    def _exist_codes(self, names: list[str], what: str) -> list[int]:
        """Per name 1 present, 0 absent, -1 cannot say (counted)."""
        codes = self._call(what, "batch_is_exist", names)
        if codes is None:
            return [-1] * len(names)
        if any(c < 0 for c in codes):
            self._failed(what, "exist check failed")
        return codes

    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_get")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not keys:
            return []
        rows = self._zero_copy_rows(source)
        out: list[bool] = []
        bad: list[bytes] = []
        for at in range(0, len(keys), self._get_arena.rows):
            chunk = slice(at, at + self._get_arena.rows)
            out += self._get_chunk(keys[chunk], source, pages[chunk], rows, bad)
        hits = {k for k, ok in zip(keys, out, strict=True) if ok}
        if bad:
            self._call("batch_get remove", "batch_remove", [_name(k) for k in bad], True)
        with self._lock:
            self._stats.gets += len(keys)
            self._stats.hits += sum(out)
            self._stats.misses += len(keys) - sum(out)
            self._stats.checksum_failures += len(bad)
            self._known.difference_update(k for k in keys if k not in hits)
            self._known.update(hits)
        return out

    def _get_chunk(self, keys, source, pages, rows, bad: list[bytes]) -> list[bool]:
        arena, n = self._get_arena, self.page_nbytes
        with arena.lock:
            heads = arena.headers
            dst = rows if rows is not None else arena.stage()
            where = pages if rows is not None else range(len(keys))
            h0, d0 = heads.ctypes.data, dst.ctypes.data  # C-contiguous rows: plain offsets
            ptrs = [[h0 + j * _HEAD, d0 + p * n] for j, p in enumerate(where)]
            names = [_name(k) for k in keys]
            codes = self._call(
                "batch_get", "batch_get_into_multi_buffers", names, ptrs, [[_HEAD, n]] * len(keys)
            )
            if codes is None:
                return [False] * len(keys)
            out, fp = [], self.namespace.fingerprint
            for j, (key, page, p, code) in enumerate(zip(keys, pages, where, codes, strict=True)):
                if code == TRANSFER_FAIL and self._wrong_size(key):
                    code = BUFFER_OVERFLOW  # a torn value: the store cannot scatter it
                if code == OBJECT_NOT_FOUND or (code < 0 and code != BUFFER_OVERFLOW):
                    if code != OBJECT_NOT_FOUND:
                        self._failed("batch_get", code_name(code))
                    out.append(False)
                    continue
                header = value_format.unpack(heads[j]) if code == _HEAD + n else None
                # torn, oversized, damaged, or another key's value
                if not value_format.verify(header, fp, dst[p], key=key):
                    bad.append(key)
                    out.append(False)
                    continue
                if rows is None:
                    source.set_page_bytes(page, dst[p])
                out.append(True)
            return out

    def _wrong_size(self, key: bytes) -> bool:
        """Whether the value under ``key`` is there with a size no page of ours has."""
        size = self._call("batch_get size", "get_size", _name(key))
        return size is not None and size >= 0 and size != _HEAD + self.page_nbytes

    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        self._check_open("batch_set")
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not keys:
            return []
        # A put of a present key would keep the old value anyway; the check renews its lease
        # (the store's recency) and tells a refresh from a write.
        present = self._exist_codes([_name(k) for k in keys], "batch_set")
        first: dict[bytes, int] = {}  # key -> index of its write in this batch
        new = []
        for i, key in enumerate(keys):
            if present[i] != 1 and key not in first:
                first[key] = i
                new.append(i)
        written = [False] * len(keys)
        rows = self._zero_copy_rows(source)
        step = self._put_arena.rows
        for at in range(0, len(new), step):
            chunk = new[at : at + step]
            for i, ok in zip(chunk, self._put_chunk(chunk, keys, source, pages, rows), strict=True):
                written[i] = ok
        out = [present[i] == 1 or written[first.get(k, i)] for i, k in enumerate(keys)]
        with self._lock:
            self._stats.sets += len(keys)
            self._stats.existing_refreshed += len(keys) - len(new)
            self._stats.set_skipped += out.count(False)
            self._known.update(k for k, ok in zip(keys, out, strict=True) if ok)
        return out

    def _put_chunk(self, chunk: list[int], keys, source, pages, rows) -> list[bool]:
        arena, n, fp = self._put_arena, self.page_nbytes, self.namespace.fingerprint
        with arena.lock:
            heads = arena.headers
            src = rows if rows is not None else arena.stage()
            ptrs = []
            h0, s0 = heads.ctypes.data, src.ctypes.data  # C-contiguous rows: plain offsets
            for j, i in enumerate(chunk):
                at = pages[i] if rows is not None else j
                if rows is None:
                    src[j] = source.get_page_bytes(pages[i]).numpy().reshape(-1)
                head = value_format.pack(fp, src[at], 0, key=keys[i])
                heads[j] = np.frombuffer(head, dtype=np.uint8)
                ptrs.append([h0 + j * _HEAD, s0 + at * n])
            names = [_name(keys[i]) for i in chunk]
            codes = self._call(
                "batch_set", "batch_put_from_multi_buffers", names, ptrs, [[_HEAD, n]] * len(chunk)
            )
            if codes is None:
                return [False] * len(chunk)
        for code in codes:
            if code != 0:  # a full store (while it evicts), a master down, a timeout
                self._failed("batch_set", code_name(code))
        return [code == 0 for code in codes]

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open("delete")
        keys = list(dict.fromkeys(self._check_keys(keys)))
        if not keys:
            return 0
        # Forced: a plain removal fails while a recent read's lease lasts.
        codes = self._call("delete", "batch_remove", [_name(k) for k in keys], True)
        if codes is None:
            return 0
        for code in codes:
            if code not in (0, OBJECT_NOT_FOUND):
                self._failed("delete", code_name(code))
        with self._lock:
            self._known.difference_update(k for k, c in zip(keys, codes, strict=True) if c == 0)
        return sum(1 for c in codes if c == 0)

    def clear(self) -> None:
        """Remove this namespace's pages (other namespaces in the store keep theirs)."""
        self._check_open("clear")
        prefix = "^" + re.escape(_name(self.namespace.fingerprint))
        rc = self._call("clear", "remove_by_regex", prefix, True)
        if rc is None:
            return
        if rc < 0:
            self._failed("clear", code_name(rc))
            return
        with self._lock:
            self._known.clear()

    def stats(self) -> StorageStats:
        self._check_open("stats")
        with self._lock:
            self._stats.pages = len(self._known)
            self._stats.bytes = len(self._known) * self._record
            return self._stats.snapshot()

    def close(self) -> None:
        """Take back the memory this store lent (its pages there go); the client stays open
        for the process's other stores. Safe twice; any other call after it raises
        StorageClosedError (the arenas' memory is unregistered)."""
        if self._closed:
            return
        self._closed = True
        segments, self._segments = self._segments, []
        try:
            self._client.unmount(segments)
        except Exception as exc:
            self._failed("close", type(exc).__name__)
        self._put_arena.release()
        self._get_arena.release()

"""Shared helpers of the storage-tier tests: host pools as page sources, a plain byte-array
page source, keys and deterministic page bytes derived from a key."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import torch

from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host import host_pool_for
from tiered_kv.storage import LMDBStorage, StorageNamespace
from tiered_kv.storage.slab_store import SlabStorage

P = 4  # tokens per page of the small host pools
LAYOUTS = ("lmdb", "slab")  # the disk tier's two layouts (storage_layout)
HEADS, HEAD_DIM, LAYERS = 2, 8, 3


def make_host(
    gen: torch.Generator | None = None,
    *,
    page_size: int = P,
    dtype: torch.dtype = torch.bfloat16,
    heads: int = HEADS,
    layout: str = "page_first",
    host_pages: int = 16,
):
    """A small CPU host pool (the PageSource of the storage tier), filled with random bits."""
    pool = MHATokenToKVPool(64 * page_size, page_size, dtype, heads, HEAD_DIM, LAYERS, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64 * page_size, page_size, dtype, "cpu", kvcache=pool)
    host = host_pool_for(
        pool.host_pool_decls()[0],
        alloc,
        layout=layout,
        size_tokens=host_pages * page_size,
        reserve_bytes=0,
    )
    if gen is not None:
        host.buffer.view(-1).view(torch.uint8).random_(0, 256, generator=gen)
    return host


class ByteSource:
    """A PageSource over a ``(pages, page_nbytes)`` uint8 tensor (what the protocol allows)."""

    def __init__(self, page_nbytes: int, num_pages: int) -> None:
        self.buf = torch.zeros(num_pages, page_nbytes, dtype=torch.uint8)

    @property
    def page_nbytes(self) -> int:
        return self.buf.shape[1]

    @property
    def num_pages(self) -> int:
        return self.buf.shape[0]

    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.buf[page]

    def set_page_bytes(self, page: int, data: object) -> None:
        if isinstance(data, torch.Tensor):
            src = data.reshape(-1)
        else:
            src = torch.frombuffer(bytearray(memoryview(data).cast("B")), dtype=torch.uint8)
        assert src.numel() == self.page_nbytes
        self.buf[page].copy_(src)


def raw_key(ns: StorageNamespace, tag: str) -> bytes:
    """A key of ``ns`` (fingerprint + 32-byte digest) named by ``tag``."""
    return ns.fingerprint + hashlib.sha256(tag.encode()).digest()


def expected_bytes(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic page bytes for ``key``."""
    return np.frombuffer(hashlib.shake_128(key).digest(nbytes), dtype=np.uint8)


def fill_for_keys(source: ByteSource, keys, pages) -> None:
    for k, p in zip(keys, pages, strict=True):
        source.buf[p].copy_(torch.from_numpy(expected_bytes(k, source.page_nbytes).copy()))


def byte_namespace(page_nbytes: int, tenant: str | None = None) -> StorageNamespace:
    """A namespace for ByteSource pages (a made-up geometry)."""
    return StorageNamespace.create(
        model="test-model",
        kind="bytes",
        parts=[("raw", [page_nbytes])],
        dtype="uint8",
        layer_ids=[0],
        page_size=1,
        layout="page_first",
        tenant=tenant,
    )


def min_lmdb_budget(tmp_path, ns: StorageNamespace, page_nbytes: int) -> int:
    """The smallest budget LMDBStorage accepts for these pages (read from its error message)."""
    try:
        LMDBStorage(tmp_path / "probe-min-budget", ns, page_nbytes, budget_bytes=1)
    except ValueError as exc:
        m = re.search(r"give at least (\d+)", str(exc))
        assert m, str(exc)
        return int(m.group(1))
    raise AssertionError("budget_bytes=1 was accepted")


def open_layout(layout: str, path, ns: StorageNamespace, page_nbytes: int, **options):
    """A disk store of ``layout`` ("lmdb" or "slab") with the same options."""
    cls = SlabStorage if layout == "slab" else LMDBStorage
    return cls(path, ns, page_nbytes, **options)

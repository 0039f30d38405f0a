"""The pages and the reference stores the storage benchmark measures LMDB against.

``BenchPages`` holds pages in one uint8 tensor and satisfies the storage ``PageSource``
contract the way a page_first host pool does (a writable view per page, all pages as one numpy
view). ``FileStore`` is one file per page named by the key's hex, the way a widely used serving
engine's file backend works: ``set`` skips a key whose file exists, writes a temporary file in
the same directory and ``os.replace``-s it into place (with ``fsync``: fsync before the
rename); ``get`` opens the file and ``readinto``-s the page. No checksum (LMDB verifies one on
every get). ``EvictingFileStore`` adds a capacity in pages, evicting first in, first out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError


class BenchPages:
    """``n`` pages of ``page_nbytes`` in one uint8 tensor (random bytes from ``fill_seed``, or
    zeros); satisfies ``PageSource``."""

    # get_page_bytes returns a writable view (as a page_first host pool does), so a store may
    # copy into it directly.
    page_bytes_zero_copy = True

    def __init__(self, n: int, page_nbytes: int, fill_seed: int | None = None) -> None:
        self._nbytes = page_nbytes
        if fill_seed is None:
            self.tensor = torch.zeros((n, page_nbytes), dtype=torch.uint8)
        else:
            rng = np.random.default_rng(fill_seed)
            self.tensor = torch.from_numpy(rng.integers(0, 256, (n, page_nbytes), dtype=np.uint8))
        self.array = self.tensor.numpy()

    @property
    def page_nbytes(self) -> int:
        return self._nbytes

    @property
    def num_pages(self) -> int:
        return self.array.shape[0]

    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.tensor[page]

    def page_bytes_rows(self) -> np.ndarray:
        """All pages as one numpy view (what a page_first host pool offers)."""
        return self.array

    def set_page_bytes(self, page: int, data: object) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self._nbytes:
            raise InvalidArgumentError(
                f"page {page}: {src.size} bytes, expected exactly {self._nbytes}"
            )
        self.array[page] = src

    def zero(self) -> None:
        self.array.fill(0)


class FileStore:
    """One file per page (temporary file + rename on set, ``readinto`` on get). The source
    must offer ``page_bytes_rows()``."""

    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync
        os.makedirs(path, exist_ok=True)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + ".bin")

    def batch_set(self, keys: Sequence[bytes], source, pages: Sequence[int]) -> list[bool]:
        rows = source.page_bytes_rows()
        out = []
        for key, page in zip(keys, pages, strict=True):
            final = self._file(key)
            if os.path.exists(final):
                out.append(True)
                continue
            tmp = final + ".tmp"
            with open(tmp, "wb", buffering=0) as f:
                view = memoryview(rows[page])
                n = f.write(view)
                while n < len(view):
                    n += f.write(view[n:])
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            out.append(True)
        return out

    def batch_get(self, keys: Sequence[bytes], source, pages: Sequence[int]) -> list[bool]:
        rows = source.page_bytes_rows()
        out = []
        for key, page in zip(keys, pages, strict=True):
            try:
                with open(self._file(key), "rb", buffering=0) as f:
                    out.append(f.readinto(memoryview(rows[page])) == source.page_nbytes)
            except FileNotFoundError:
                out.append(False)
        return out


class EvictingFileStore(FileStore):
    """The file store with a capacity in pages: before each new file it unlinks the oldest one
    (first in, first out: the benchmark never reads while it writes)."""

    def __init__(self, path: str, fsync: bool, capacity: int) -> None:
        super().__init__(path, fsync)
        self.capacity = capacity
        self.order: list[bytes] = []

    def batch_set(self, keys: Sequence[bytes], source, pages: Sequence[int]) -> list[bool]:
        for key in keys:
            if len(self.order) >= self.capacity:
                os.unlink(self._file(self.order.pop(0)))
            self.order.append(key)
        return super().batch_set(keys, source, pages)

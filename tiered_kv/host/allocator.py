"""HostSlotAllocator: host token slots handed out in whole pages, thread-safe.

Freed pages are staged and merged into the free list only when an allocation finds it short
(lazy release). Every page's state is tracked, so a double allocation, a double free, or a free
of a slot that was never allocated raises (naming the slots) and changes nothing.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.errors import InvalidArgumentError, OwnershipError

_CPU = torch.device("cpu")


class HostSlotAllocator:
    def __init__(self, size: int, page_size: int) -> None:
        self.size = check_positive_int("size", size)
        self.page_size = check_positive_int("page_size", page_size)
        if size % page_size:
            raise InvalidArgumentError(
                f"host size={size} is not a multiple of page_size={page_size}"
            )
        self.num_pages = size // page_size
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._free = np.arange(self.num_pages, dtype=np.int64)
            self._staged: list[np.ndarray] = []
            self._num_staged = 0
            self._allocated = np.zeros(self.num_pages, dtype=bool)

    def available_size(self) -> int:
        with self._lock:
            return (len(self._free) + self._num_staged) * self.page_size

    def _merge(self) -> None:
        if self._staged:
            self._free = np.sort(np.concatenate([self._free, *self._staged]))
            self._staged = []
            self._num_staged = 0

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` host slots (a multiple of page_size) as an int64 tensor, page by page,
        or None when the pool is full."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
        if need_size % self.page_size:
            raise InvalidArgumentError(
                f"host allocation of {need_size} slots is not page-aligned; ask for a multiple "
                f"of page_size={self.page_size}"
            )
        pages_needed = need_size // self.page_size
        with self._lock:
            if pages_needed > len(self._free):
                self._merge()
            if pages_needed > len(self._free):
                return None
            pages = self._free[:pages_needed]
            if self._allocated[pages].any():
                bad = (pages[self._allocated[pages]] * self.page_size).tolist()
                raise OwnershipError(
                    f"double allocation: host slots {bad[:8]} are already allocated"
                )
            self._allocated[pages] = True
            self._free = self._free[pages_needed:]
        offsets = np.arange(self.page_size, dtype=np.int64)
        return torch.from_numpy((pages[:, None] * self.page_size + offsets).reshape(-1))

    def _pages_of(self, indices: torch.Tensor) -> np.ndarray:
        check_index_tensor("host indices", indices, _CPU)
        idx = indices.to(torch.int64).numpy()
        p = self.page_size
        if idx.size % p:
            raise InvalidArgumentError(
                f"free of {idx.size} host slots is not page-aligned; free whole pages "
                f"(multiples of page_size={p})"
            )
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            bad = idx[(idx < 0) | (idx >= self.size)][:8].tolist()
            raise InvalidArgumentError(f"host slots {bad} are outside [0, {self.size})")
        blocks = idx.reshape(-1, p)
        whole = (blocks[:, 0] % p == 0) & (np.diff(blocks, axis=1) == 1).all(axis=1)
        if not whole.all():
            first = blocks[~whole][0].tolist()
            raise InvalidArgumentError(
                f"host slots {first[:8]}... do not form a whole page; free each page's "
                f"{p} slots in order from its first slot"
            )
        return blocks[:, 0] // p

    def free(self, indices: torch.Tensor) -> None:
        """Return whole pages (their slots in order); staged until an allocation needs them."""
        pages = self._pages_of(indices)
        if pages.size == 0:
            return
        uniq, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise OwnershipError(
                f"double free: host slots {(uniq[counts > 1] * self.page_size)[:8].tolist()} "
                "are listed twice"
            )
        with self._lock:
            not_owned = pages[~self._allocated[pages]]
            if not_owned.size:
                raise OwnershipError(
                    f"free of host slots {(not_owned * self.page_size)[:8].tolist()} that are not "
                    "allocated (never allocated, or freed already)"
                )
            self._allocated[pages] = False
            self._staged.append(pages.copy())
            self._num_staged += pages.size

    def is_allocated(self, indices: torch.Tensor) -> torch.Tensor:
        """Per slot: whether its page is currently allocated."""
        idx = indices.to(torch.int64).numpy() // self.page_size
        with self._lock:
            return torch.from_numpy(self._allocated[idx].copy())

"""The two free lists of the allocators: free ids in one preallocated buffer, no concatenation
of the whole list per call.

SGLang keeps its free list as a tensor it rebuilds on every free (``torch.cat`` of the freed ids
and the whole list): a free costs O(free list), 60 us for a 180k-slot pool on a CPU. Here the
ids live in a buffer allocated once; an allocation moves an offset, a free writes only the freed
ids. Both orders are the seed's:

- ``SlotQueue`` (the token allocator): allocate from the head, free appends behind the tail
  (first freed, first reused). Every buffer position is written at most once, so the views it
  hands out (the slots an allocation returns, ``live``) never change; when the tail reaches the
  end of the buffer, the live ids move to a fresh buffer (amortised O(1) per freed id).
- ``PageStack`` (the paged allocator): allocate from the head, free pushes in front of it (last
  freed, first reused). The buffer holds every page once, so it never grows; a push reuses the
  positions in front of the head, so ``live`` is valid until the next push (``snapshot`` copies).

Bookkeeping only: ids in, ids out, no checks of their values (the allocator's debug mode does
those). Neither class syncs with the device.
"""

from __future__ import annotations

import torch

from tiered_kv.errors import OwnershipError


def _initial(n: int, device: torch.device, capacity: int) -> torch.Tensor:
    buf = torch.empty((capacity,), dtype=torch.int64, device=device)
    torch.arange(1, n + 1, dtype=torch.int64, device=device, out=buf[:n])
    return buf


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class SlotQueue:
    """Free ids ``buf[head:tail]``; ids 1..n free after ``clear``."""

    __slots__ = ("buf", "head", "tail", "n", "device")

    def __init__(self, n: int, device: torch.device) -> None:
        self.n = n
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.buf = _initial(self.n, self.device, 2 * self.n)
        self.head, self.tail = 0, self.n

    @property
    def count(self) -> int:
        return self.tail - self.head

    @property
    def live(self) -> torch.Tensor:
        return self.buf[self.head : self.tail]

    def take(self, k: int) -> torch.Tensor | None:
        """The first ``k`` free ids (a view that never changes), or None if fewer are free."""
        head = self.head
        if k > self.tail - head:
            return None
        self.head = head + k
        return self.buf[head : head + k]

    def put(self, ids: torch.Tensor) -> None:
        """Append ``ids`` (1-D, any integer dtype) behind the free ids."""
        k = ids.shape[0]
        tail = self.tail
        if tail + k > self.buf.shape[0]:
            self._move(k)
            tail = self.tail
        self.buf[tail : tail + k] = ids
        self.tail = tail + k

    def _move(self, extra: int) -> None:
        # A fresh buffer: the old one keeps serving the views handed out of it.
        live = self.count
        buf = torch.empty(
            (max(2 * self.n, 2 * (live + extra)),), dtype=torch.int64, device=self.device
        )
        buf[:live] = self.live
        self.buf, self.head, self.tail = buf, 0, live

    def replace(self, ids: torch.Tensor) -> None:
        """The free ids become ``ids`` (copied into a fresh buffer)."""
        k = ids.shape[0]
        buf = torch.empty((max(2 * self.n, 2 * k),), dtype=torch.int64, device=self.device)
        buf[:k] = ids
        self.buf, self.head, self.tail = buf, 0, k

    def snapshot(self) -> torch.Tensor:
        """The free ids as they are now; later calls never change the returned view."""
        return self.live


class PageStack:
    """Free page ids ``buf[head:]``; pages 1..n free after ``clear``."""

    __slots__ = ("buf", "head", "n", "device")

    def __init__(self, n: int, device: torch.device) -> None:
        self.n = n
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.buf = _initial(self.n, self.device, self.n)
        self.head = 0

    @property
    def count(self) -> int:
        return self.n - self.head

    @property
    def live(self) -> torch.Tensor:
        """The free ids, head first: a view valid until the next ``put`` or ``replace``."""
        return self.buf[self.head :]

    def take(self, k: int) -> None:
        """Drop the first ``k`` free ids (the caller has read them from ``live``)."""
        self.head += k

    def put(self, ids: torch.Tensor) -> None:
        """Push ``ids`` in front of the free ids. More ids than pages are handed out can only
        be a double free: refused (an int comparison, no value read), nothing changed."""
        k = ids.shape[0]
        head = self.head
        if k > head:
            raise OwnershipError(
                f"double free: {k} pages freed but only {head} of {self.n} are allocated"
            )
        self.buf[head - k : head] = ids
        self.head = head - k

    def replace(self, ids: torch.Tensor) -> None:
        """The free ids become ``ids`` (copied; at most ``n`` of them)."""
        k = ids.shape[0]
        if k > self.n:
            raise OwnershipError(f"{k} free pages for a pool of {self.n}: a page is listed twice")
        if _shares_memory(ids, self.buf):
            ids = ids.clone()
        self.buf[self.n - k :] = ids
        self.head = self.n - k

    def snapshot(self) -> torch.Tensor:
        """A copy of the free ids (``live`` changes with the next push)."""
        return self.live.clone()

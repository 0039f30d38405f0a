"""Whole host pages as bytes: what the storage tier reads from and writes into a host pool.

A page is every layer and part of ``page_size`` tokens. In the page_first layouts it is one
contiguous block of the buffer, so reads are zero-copy views and all pages together are one
``(num_pages, page_nbytes)`` array; in layer_first it is strided ``(L, P, E)`` and a read copies.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.layout import HostLayout
from tiered_kv.host.memory import HostBuffer


class PageBytes:
    """The pages of one host buffer as bytes. Raises StateError once the buffer is destroyed."""

    def __init__(
        self,
        buffer: HostBuffer,
        layout: HostLayout,
        *,
        page_size: int,
        layer_num: int,
        elems: int,
        num_pages: int,
    ) -> None:
        self._buffer = buffer
        self.layout = layout
        self.page_size = page_size
        self.layer_num = layer_num
        self.elems = elems
        self.num_pages = num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of one page: every layer and part of ``page_size`` tokens."""
        return self.page_size * self.layer_num * self.elems * self._buffer.live().element_size()

    @property
    def zero_copy(self) -> bool:
        """Whether :meth:`get` returns a view (page_first layouts) rather than a copy."""
        return self.layout.token_major

    def rows(self) -> np.ndarray | None:
        """Every page's bytes as a ``(num_pages, nbytes)`` uint8 numpy view of the buffer (row
        ``p`` is ``get(p)``) in the page_first layouts; None in layer_first."""
        if not self.zero_copy:
            return None
        flat = self._buffer.live().reshape(-1).view(torch.uint8)
        return flat.numpy().reshape(self.num_pages, self.nbytes)

    def check(self, page: int) -> int:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise InvalidArgumentError(
                f"page={page!r} is not a host page; valid pages are 0..{self.num_pages - 1}"
            )
        return page

    def block(self, page: int) -> torch.Tensor:
        """The page's records: one contiguous block in page_first layouts, ``(L, P, E)`` strided
        in layer_first."""
        p = self.page_size
        buf = self._buffer.live()
        if self.layout is HostLayout.PAGE_FIRST:
            return buf[page * p : (page + 1) * p]
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            return buf[page]
        return buf[:, page * p : (page + 1) * p]

    def get(self, page: int) -> torch.Tensor:
        """Page ``page`` as a flat uint8 tensor: a view when :attr:`zero_copy`, else a copy."""
        block = self.block(self.check(page))
        if not self.zero_copy:
            # layer_first promises a copy even when the block happens to be contiguous (L == 1).
            block = block.clone(memory_format=torch.contiguous_format)
        return block.reshape(-1).view(torch.uint8)

    def set(self, page: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Fill page ``page`` from exactly :attr:`nbytes` bytes, in one copy; nothing changes on
        error."""
        block = self.block(self.check(page))
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8:
                raise InvalidArgumentError(
                    f"page data tensor has dtype {data.dtype}; expected uint8"
                )
            src = data.reshape(-1)
        else:
            view = memoryview(data).cast("B")
            with warnings.catch_warnings():
                # A read-only buffer (bytes) is only read here.
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else None
        n = 0 if src is None else src.numel()
        if n != self.nbytes:
            raise InvalidArgumentError(
                f"page data has {n} bytes; a page of this pool has exactly {self.nbytes}"
            )
        # Byte views on both sides: no alignment demands on the caller's buffer.
        dst = block.view(torch.uint8)
        dst.copy_(src.view(dst.shape))

"""Raw page-transfer launcher arguments on irregular sizes, and exact byte comparisons.

Every byte of every buffer starts random and non-zero, so a row that was not copied, or was
copied from the wrong place, shows up; expected bytes come from the torch reference run on a
copy of the same state (``transfer_reference.transfer_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from tiered_kv.kernels import transfer_reference

# Two parts of different widths (like K and V with v_head_dim != head_dim), odd sizes.
ITEMS = ((3, 10), (3, 6))
LAYERS, ROWS, HOST_TOKENS, N = 5, 83, 61, 37


def random_nonzero(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    t = torch.empty(shape, dtype=dtype)
    t.view(-1).view(torch.uint8).random_(1, 256, generator=gen)
    return t


@dataclass
class Transfer:
    """``dev[p][l]``, the flat host buffer, and the index arguments of one transfer."""

    dev: list[list[torch.Tensor]]
    host: torch.Tensor
    dev_rows: torch.Tensor
    host_offsets: torch.Tensor
    part_offsets: tuple[int, ...]
    record: int

    def clone_state(self) -> Transfer:
        """The same indices over copies of the buffers (for the reference to run on)."""
        dev = [[b.clone() for b in bufs] for bufs in self.dev]
        return Transfer(
            dev, self.host.clone(), self.dev_rows, self.host_offsets, self.part_offsets, self.record
        )

    def run(self, transfer_rows, to_host: bool, **kw) -> None:
        transfer_rows(
            self.dev, self.host, self.dev_rows, self.host_offsets, self.part_offsets, to_host, **kw
        )

    def reference(self, to_host: bool, **kw) -> None:
        kw.pop("plan_cache", None)
        self.run(transfer_reference.transfer_rows, to_host, **kw)


def make_transfer(
    gen: torch.Generator,
    *,
    items: tuple[tuple[int, ...], ...] = ITEMS,
    layers: int = LAYERS,
    n: int = N,
    dtype: torch.dtype = torch.float16,
    index_dtype: torch.dtype = torch.int64,
) -> Transfer:
    dev = [[random_nonzero((ROWS, *item), dtype, gen) for _ in range(layers)] for item in items]
    record = sum(prod(item) for item in items)
    host = random_nonzero((layers * HOST_TOKENS * record,), dtype, gen)
    part_offsets, off = [], 0
    for item in items:
        part_offsets.append(off)
        off += prod(item)
    return Transfer(
        dev,
        host,
        random_rows(gen, n).to(index_dtype),
        random_records(gen, layers, n) * record,
        tuple(part_offsets),
        record,
    )


def random_rows(gen: torch.Generator, n: int, exclude: torch.Tensor | None = None):
    """``n`` distinct device rows in random order (none of ``exclude``)."""
    rows = torch.randperm(ROWS, generator=gen)
    if exclude is not None:
        rows = rows[~torch.isin(rows, exclude.to(torch.int64))]
    return rows[:n]


def random_records(gen: torch.Generator, layers: int, n: int) -> torch.Tensor:
    """(layers, n) distinct host record indices in random order."""
    return torch.randperm(layers * HOST_TOKENS, generator=gen)[: layers * n].view(layers, n)


def assert_same_bytes(got: Transfer, expected: Transfer) -> None:
    ints = transfer_reference.as_int
    assert torch.equal(ints(got.host), ints(expected.host)), "host bytes differ"
    for p, (bufs, ebufs) in enumerate(zip(got.dev, expected.dev, strict=True)):
        for layer, (b, e) in enumerate(zip(bufs, ebufs, strict=True)):
            if not torch.equal(ints(b), ints(e)):
                rows = (ints(b) != ints(e)).reshape(b.shape[0], -1).any(-1).nonzero()[:8]
                raise AssertionError(f"part {p} layer {layer}: rows {rows.view(-1).tolist()}")

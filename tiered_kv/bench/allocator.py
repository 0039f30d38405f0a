"""Device KV-pool allocators: per-call time of ``alloc_extend``, ``alloc_decode`` and ``free``.

Per (page size, batch size), ``measure_allocators`` runs every backend round-robin
(``timing.interleave``): each round draws irregular request lengths (prefix lengths in
``[0, 2 * prefix_len]``, a quarter of them rounded down to a page boundary; new tokens in
``[1, 2 * extend_len]``), and every backend then builds each request's prefix from an empty pool
(untimed ``alloc_extend``) and times, one call each with the garbage collector off:

- ``alloc_extend``: the new tokens of every request, continuing from the prefix's last slot;
- ``free``: the slots that extend returned (right after the extend: in ``triton`` rows it starts
  with caches the interpreter has just churned);
- ``alloc_decode``: one token per request, from the state right after the prefix was built
  (restored with ``backup_state`` / ``restore_state``).

At page size 1 the ``torch`` row is ``TokenToKVPoolAllocator`` (no kernel) and the ``triton``
row ``PagedTokenToKVPoolAllocator`` with ``page_size=1``. Rows report the median and nearest-rank
p90 of the per-call time, the mean tokens per call and the median time per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiered_kv.bench.timing import device_sync, interleave, median, nearest_rank, timed_call
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator
from tiered_kv.errors import StateError

OPS = ("alloc_extend", "alloc_decode", "free")
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Lengths:
    """Mean request lengths: tokens already cached and tokens to add."""

    prefix_len: int
    extend_len: int


@dataclass(frozen=True)
class Batch:
    """Request lengths on the CPU: tokens already cached and tokens to add."""

    prefix: torch.Tensor
    extend: torch.Tensor


@dataclass(frozen=True)
class Sample:
    """One call of each op: seconds, tokens, and the tensors the allocator returned."""

    seconds: dict[str, float]
    tokens: dict[str, int]
    prefix_slots: torch.Tensor
    extend_slots: torch.Tensor
    decode_slots: torch.Tensor
    free_after_free: torch.Tensor


@dataclass
class Row:
    backend: str
    allocator: str
    page_size: int
    batch: int
    op: str
    median_us: float
    p90_us: float
    tokens: int
    ns_per_token: float
    repeats: int


def config_generator(seed: int, page_size: int, batch: int, salt: int) -> torch.Generator:
    """A generator per (page size, batch): every backend sees the same lengths."""
    gen = torch.Generator()
    gen.manual_seed(((seed * 1_000_003 + page_size) * 10_007 + batch) * 7 + salt)
    return gen


def draw_batch(gen: torch.Generator, bs: int, page_size: int, lengths: Lengths) -> Batch:
    prefix = torch.randint(0, 2 * lengths.prefix_len + 1, (bs,), generator=gen)
    aligned = torch.randint(0, 4, (bs,), generator=gen) == 0
    prefix = torch.where(aligned, prefix // page_size * page_size, prefix)
    extend = torch.randint(1, 2 * lengths.extend_len + 1, (bs,), generator=gen)
    return Batch(prefix, extend)


def pool_size(bs: int, page_size: int, lengths: Lengths) -> int:
    """Slots for the largest possible draw (prefix, extend and decode pages), whole pages."""
    per_request = (
        -(-2 * lengths.prefix_len // page_size) + -(-2 * lengths.extend_len // page_size) + 3
    )
    return (bs * per_request + 1) * page_size


def allocator_label(backend: str, page_size: int) -> str:
    if backend == "torch" and page_size == 1:
        return TokenToKVPoolAllocator.__name__
    return PagedTokenToKVPoolAllocator.__name__


def make_allocator(
    backend: str, page_size: int, size: int, device: torch.device, *, paged: bool = False
) -> BaseTokenToKVPoolAllocator:
    """The allocator for a table row; ``paged`` forces the paged class at page size 1."""
    if allocator_label(backend, page_size) == TokenToKVPoolAllocator.__name__ and not paged:
        return TokenToKVPoolAllocator(size, None, device)
    return PagedTokenToKVPoolAllocator(size, page_size, None, device, kernel_backend=backend)


def _too_small(what: str, n: int, alloc: BaseTokenToKVPoolAllocator) -> StateError:
    return StateError(
        f"{what} of {n} tokens returned None from a pool of {alloc.size}: pool_size() "
        "undercounts this draw"
    )


def build_prefix(
    alloc: BaseTokenToKVPoolAllocator, batch: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate every prefix from 0; return all prefix slots and each request's last slot."""
    prefix = batch.prefix
    zeros = torch.zeros_like(prefix)
    none = torch.full_like(prefix, -1)
    n = int(prefix.sum())
    slots = alloc.alloc_extend(
        zeros.to(device), zeros, prefix.to(device), prefix, none.to(device), n
    )
    if slots is None:
        raise _too_small("the prefix alloc_extend", n, alloc)
    if n == 0:
        return slots, none.to(device)
    ends = (torch.cumsum(prefix, 0) - 1).clamp_min(0).to(device)
    last_loc = torch.where(prefix.to(device) > 0, slots[ends], none.to(device))
    return slots, last_loc


def run_once(alloc: BaseTokenToKVPoolAllocator, batch: Batch, device: torch.device) -> Sample:
    """Build the prefix state, then time extend, free (of the extend) and decode."""
    sync = device_sync(device)
    alloc.clear()
    prefix_slots, last_loc = build_prefix(alloc, batch, device)
    prefix_dev, seq = batch.prefix.to(device), batch.prefix + batch.extend
    seq_dev, decode_seq = seq.to(device), batch.prefix + 1
    decode_dev, num_extend = decode_seq.to(device), int(batch.extend.sum())
    state = alloc.backup_state()
    t_ext, ext = timed_call(
        lambda: alloc.alloc_extend(prefix_dev, batch.prefix, seq_dev, seq, last_loc, num_extend),
        sync,
    )
    if ext is None:
        raise _too_small("alloc_extend", num_extend, alloc)
    t_free, _ = timed_call(lambda: alloc.free(ext), sync)
    free_after_free = alloc.get_all_free_pages()
    alloc.restore_state(state)
    t_dec, dec = timed_call(lambda: alloc.alloc_decode(decode_dev, decode_seq, last_loc), sync)
    if dec is None:
        raise _too_small("alloc_decode", int(batch.prefix.numel()), alloc)
    bs = int(batch.prefix.numel())
    return Sample(
        seconds={"alloc_extend": t_ext, "alloc_decode": t_dec, "free": t_free},
        tokens={"alloc_extend": num_extend, "alloc_decode": bs, "free": num_extend},
        prefix_slots=prefix_slots,
        extend_slots=ext,
        decode_slots=dec,
        free_after_free=free_after_free,
    )


def summarize(samples: list[Sample], backend: str, page_size: int, bs: int) -> list[Row]:
    rows = []
    for op in OPS:
        secs = [s.seconds[op] for s in samples]
        toks = [s.tokens[op] for s in samples]
        per_tok = [t / max(n, 1) * 1e9 for t, n in zip(secs, toks, strict=True)]
        rows.append(
            Row(
                backend=backend,
                allocator=allocator_label(backend, page_size),
                page_size=page_size,
                batch=bs,
                op=op,
                median_us=median(secs) * 1e6,
                p90_us=nearest_rank(secs, 0.9) * 1e6,
                tokens=round(sum(toks) / len(toks)),
                ns_per_token=median(per_tok),
                repeats=len(samples),
            )
        )
    return rows


def measure_allocators(
    backends: Sequence[str],
    page_size: int,
    bs: int,
    lengths: Lengths,
    repeats: int,
    seed: int,
    device: torch.device,
) -> list[Row]:
    """Every backend round-robin on the same draws, ``repeats`` rounds; rows per backend."""
    size = pool_size(bs, page_size, lengths)
    allocs = {b: make_allocator(b, page_size, size, device) for b in backends}
    gen = config_generator(seed, page_size, bs, salt=0)
    got = interleave(
        {b: (lambda batch, a=a: run_once(a, batch, device)) for b, a in allocs.items()},
        repeats,
        setup=lambda _i: draw_batch(gen, bs, page_size, lengths),
    )
    return [row for b in backends for row in summarize(got[b], b, page_size, bs)]

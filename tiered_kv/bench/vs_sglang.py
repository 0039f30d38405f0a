"""Our allocators against SGLang's, one process, the same inputs, alternating.

Cells: the token allocator (page size 1) and the paged allocator at each page size, for each
batch size, times ``alloc_extend``, ``alloc_decode`` and ``free``. Every round draws irregular
request lengths (``allocator.draw_batch``: prefixes in ``[0, 2 * prefix_len]``, a quarter of them
page-aligned; new tokens in ``[1, 2 * extend_len]``); then both allocators, in an order that
alternates from round to round, start from an empty pool of the same size, build every
request's prefix with an untimed ``alloc_extend``, and time one call each, with the garbage
collector off: ``alloc_decode`` of one token per request; then, from the prefix built again,
``alloc_extend`` of the new tokens and ``free`` of the slots it returned.

SGLang is called as its scheduler calls it (``sglang_peer``); ours through the interface our
facade calls (``alloc_extend`` / ``alloc_decode`` on both classes), so at page size 1 our
argument checks are in the time and SGLang's ``alloc(n)`` has none. The ratio of a cell is
SGLang's median over ours: above 1.0 ours is faster; ``ratio_p25`` / ``ratio_p75`` are the
quartiles of the per-round ratios (both allocators on one draw), how steady it is.

Every round also checks that both returned the same prefix, extend and decode slots and left the
same set of free pages after the free (the first round checks our layout too,
``allocator_check.check_sample``). Excluded cell: SGLang's paged allocator at page size 1 counts
no new pages in ``alloc_decode`` and hands out ``last_loc + 1``, a slot the request still owns
(``EXCLUDED``); ours is timed there alone.

The pool: one size for every cell (``pool_tokens``), enough for the largest draw of the largest
batch, as a serving engine sizes its pool by memory rather than by the batch it runs; the
free-list concatenations of both allocators scale with it. ``pool=0`` sizes each cell's pool to
its own largest draw instead (``allocator.pool_size``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv.bench import sglang_peer
from tiered_kv.bench.allocator import Batch, Lengths, Sample, config_generator, draw_batch
from tiered_kv.bench.allocator import pool_size as fitted_pool_size
from tiered_kv.bench.allocator_check import check_sample
from tiered_kv.bench.timing import device_sync, interleave, median, nearest_rank, timed_call
from tiered_kv.bench.verify import fail
from tiered_kv.device.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator

OPS = ("alloc_extend", "alloc_decode", "free")
EXCLUDED = {
    ("paged", 1, "alloc_decode"): (
        "SGLang's paged allocator at page size 1 counts no new pages in alloc_decode "
        "(seq_lens % 1 == 1 is never true) and hands out last_loc + 1, a slot the request "
        "still owns; its scheduler never builds this configuration: ours timed alone"
    )
}
WARMUP_ROUNDS = 2


@dataclass(frozen=True)
class Cell:
    allocator: str  # "token" (TokenToKVPoolAllocator, page size 1) or "paged"
    page_size: int
    batch: int


@dataclass
class Comparison:
    """One cell and op: medians in microseconds, SGLang / ours (None where not measured)."""

    allocator: str
    page_size: int
    batch: int
    op: str
    ours_us: float
    sglang_us: float | None
    ratio: float | None
    ratio_p25: float | None  # quartiles of the per-round ratios (same draw, both allocators)
    ratio_p75: float | None
    repeats: int
    pool_tokens: int
    note: str = ""


def allocator_cells(page_sizes: Sequence[int], batches: Sequence[int]) -> list[Cell]:
    """The token allocator (when page size 1 is asked for), then the paged one per page size."""
    cells = [Cell("token", 1, b) for b in batches] if 1 in page_sizes else []
    return cells + [Cell("paged", p, b) for p in page_sizes for b in batches]


def pool_tokens(cells: Sequence[Cell], lengths: Lengths) -> int:
    """One pool size for every cell: the largest fitted pool, in whole pages of every size."""
    step = math.lcm(*(c.page_size for c in cells))
    need = max(fitted_pool_size(c.batch, c.page_size, lengths) for c in cells)
    return -(-need // step) * step


class OursAllocator:
    """Our allocator behind the same calls as ``sglang_peer.SGLangAllocator``."""

    def __init__(self, cell: Cell, size: int, device: torch.device) -> None:
        self.impl: BaseTokenToKVPoolAllocator
        if cell.allocator == "token":
            self.impl = TokenToKVPoolAllocator(size, None, device)
        else:
            self.impl = PagedTokenToKVPoolAllocator(size, cell.page_size, None, device)

    def clear(self) -> None:
        self.impl.clear()

    def free_list(self) -> torch.Tensor:
        return self.impl.get_all_free_pages()

    def alloc_extend(self, args: tuple[Any, ...]) -> torch.Tensor | None:
        return self.impl.alloc_extend(*args)

    def alloc_decode(self, args: tuple[Any, ...]) -> torch.Tensor | None:
        return self.impl.alloc_decode(*args)

    def free(self, slots: torch.Tensor) -> None:
        self.impl.free(slots)


@dataclass(frozen=True)
class Inputs:
    """One round's draw, on the CPU and on the device."""

    batch: Batch
    prefix_args: tuple[Any, ...]
    seq: tuple[torch.Tensor, torch.Tensor]
    prefix: tuple[torch.Tensor, torch.Tensor]
    decode_seq: tuple[torch.Tensor, torch.Tensor]
    num_extend: int


def make_inputs(batch: Batch, device: torch.device) -> Inputs:
    pre, seq = batch.prefix, batch.prefix + batch.extend
    zeros, none = torch.zeros_like(pre), torch.full_like(pre, -1)
    n_pre = int(pre.sum())
    prefix_args = (zeros.to(device), zeros, pre.to(device), pre, none.to(device), n_pre)
    dec = pre + 1
    return Inputs(
        batch,
        prefix_args,
        (seq.to(device), seq),
        (pre.to(device), pre),
        (dec.to(device), dec),
        int(batch.extend.sum()),
    )


@dataclass
class Round:
    seconds: dict[str, float]
    slots: dict[str, torch.Tensor]


def _build_prefix(arm: Any, inp: Inputs, device: torch.device) -> tuple[Any, Any]:
    """From an empty pool, every request's prefix (untimed); its slots and ``last_loc``."""
    arm.clear()
    slots = arm.alloc_extend(inp.prefix_args)
    if slots is None:
        fail("prefix", f"a pool of the benchmark's size refused {inp.prefix_args[5]} tokens")
    pre = inp.batch.prefix.to(device)
    ends = (torch.cumsum(pre, 0) - 1).clamp_min(0)
    last_loc = torch.where(pre > 0, slots[ends], -1) if slots.numel() else pre - 1
    return slots, last_loc


def run_round(arm: Any, inp: Inputs, device: torch.device, skip: Sequence[str] = ()) -> Round:
    """From the prefix state: time decode; from the prefix state built again: time extend,
    then free of the extend's slots. (Rebuilding, rather than restoring a backup, keeps both
    allocators' untimed work before each timed call alike.)"""
    sync = device_sync(device)
    seconds: dict[str, float] = {}
    slots: dict[str, torch.Tensor] = {}
    if "alloc_decode" not in skip:
        _, last_loc = _build_prefix(arm, inp, device)
        t_dec, dec = timed_call(lambda: arm.alloc_decode((*inp.decode_seq, last_loc)), sync)
        if dec is None:
            fail("alloc_decode", "the pool refused one token per request")
        seconds["alloc_decode"], slots["decode"] = t_dec, dec
    prefix_slots, last_loc = _build_prefix(arm, inp, device)
    ext_args = (*inp.prefix, *inp.seq, last_loc, inp.num_extend)
    t_ext, ext = timed_call(lambda: arm.alloc_extend(ext_args), sync)
    if ext is None:
        fail("alloc_extend", f"the pool refused {inp.num_extend} tokens")
    t_free, _ = timed_call(lambda: arm.free(ext), sync)
    seconds.update(alloc_extend=t_ext, free=t_free)
    slots.update(prefix=prefix_slots, extend=ext, free_list=arm.free_list(), last_loc=last_loc)
    return Round(seconds, slots)


def check_same(where: str, ours: Round, theirs: Round) -> None:
    """Both allocators returned the same slots and kept the same set of free pages."""
    for key in ("prefix", "extend", "decode"):
        if key not in ours.slots or key not in theirs.slots:
            continue
        a, b = ours.slots[key].cpu(), theirs.slots[key].cpu()
        if not torch.equal(a.to(torch.int64), b.to(torch.int64)):
            fail(where, f"{key} slots differ from SGLang's ({a.numel()} vs {b.numel()} slots)")
    a = torch.sort(ours.slots["free_list"].cpu())[0]
    b = torch.sort(theirs.slots["free_list"].cpu())[0]
    if not torch.equal(a, b):
        fail(where, f"free pages after free differ from SGLang's ({a.numel()} vs {b.numel()})")


def check_layout(where: str, r: Round, inp: Inputs, impl: BaseTokenToKVPoolAllocator) -> None:
    """Our slots keep the paged layout and ownership (as the allocator benchmark checks)."""
    s = r.slots
    sample = Sample({}, {}, s["prefix"], s["extend"], s["decode"], s["free_list"])
    check_sample(where, inp.batch, sample, impl)


def measure_cell(
    cell: Cell,
    peer: sglang_peer.SGLangPeer | None,
    lengths: Lengths,
    repeats: int,
    seed: int,
    device: torch.device,
    pool: int,
) -> list[Comparison]:
    """``repeats`` alternating rounds of one cell (after ``WARMUP_ROUNDS``); rows per op."""
    size = pool or fitted_pool_size(cell.batch, cell.page_size, lengths)
    ours = OursAllocator(cell, size, device)
    arms: dict[str, Any] = {"ours": ours}
    if peer is not None:
        paged = cell.allocator == "paged"
        arms["sglang"] = sglang_peer.SGLangAllocator(
            peer, size, cell.page_size, device, paged=paged
        )
    skip = [op for op in OPS if (cell.allocator, cell.page_size, op) in EXCLUDED]
    where = f"{cell.allocator} page_size={cell.page_size} batch={cell.batch} seed={seed}"
    gen = config_generator(seed, cell.page_size, cell.batch, salt=2)
    rounds: list[dict[str, Round]] = []

    def setup(i: int) -> Inputs:
        rounds.append({})
        return make_inputs(draw_batch(gen, cell.batch, cell.page_size, lengths), device)

    def arm_fn(name: str, arm: Any) -> Any:
        def run(inp: Inputs) -> dict[str, float]:
            r = run_round(arm, inp, device, skip if name == "sglang" else ())
            rounds[-1][name] = r
            if len(rounds[-1]) == len(arms):
                if "sglang" in arms:
                    check_same(where, rounds[-1]["ours"], rounds[-1]["sglang"])
                if len(rounds) == 1:
                    check_layout(where, rounds[-1]["ours"], inp, ours.impl)
                rounds[-1] = {}  # keep no tensors
            return r.seconds

        return run

    got = interleave(
        {name: arm_fn(name, arm) for name, arm in arms.items()},
        repeats,
        setup=setup,
        warmup=WARMUP_ROUNDS,
        rotate=True,
    )
    rows = []
    for op in OPS:
        mine = [s[op] for s in got["ours"]]
        theirs = [s[op] for s in got.get("sglang", []) if op in s]
        ours_us = median(mine) * 1e6
        sglang_us = median(theirs) * 1e6 if theirs else None
        per_round = [t / o for t, o in zip(theirs, mine, strict=True)] if theirs else None
        note = "excluded: ours alone" if (cell.allocator, cell.page_size, op) in EXCLUDED else ""
        if peer is None:
            note = "no SGLang: ours alone"
        rows.append(
            Comparison(
                cell.allocator,
                cell.page_size,
                cell.batch,
                op,
                ours_us,
                sglang_us,
                sglang_us / ours_us if sglang_us is not None else None,
                nearest_rank(per_round, 0.25) if per_round else None,
                nearest_rank(per_round, 0.75) if per_round else None,
                len(mine),
                size,
                note,
            )
        )
    return rows

"""Benchmark of the device KV-pool allocators: ``alloc_extend``, ``alloc_decode`` and ``free``.

What is measured: for every kernel backend (``torch``, ``triton``) x page size x batch size, the
wall time of one call of each operation, with ``time.perf_counter`` around that call only (plus a
``torch.cuda.synchronize`` on each side with ``--device cuda``; the garbage collector is off
during the call, as in ``timeit``). Each repeat draws fresh, irregular request lengths from a
seeded ``torch.Generator`` (prefix lengths in ``[0, 2 * --prefix-len]``, a quarter of them
rounded down to a page boundary; new tokens in ``[1, 2 * --extend-len]``), builds each request's
prefix from an empty pool with an untimed ``alloc_extend`` (prefix 0, ``last_loc`` -1), and then
times:

- ``alloc_extend``: the new tokens of every request, continuing from the prefix's last slot;
- ``free``: the slots that extend returned;
- ``alloc_decode``: one token per request (``seq_lens`` = prefix + 1), from the state right after
  the prefix was built (restored with ``backup_state`` / ``restore_state``).

``free`` runs right after the timed extend, so in ``triton`` rows it starts with caches that the
interpreter has just churned; ``free`` runs no kernel, so compare it across backends with care.

Both backends see the same sequence of lengths. At page size 1 the ``torch`` row is
``TokenToKVPoolAllocator`` (no kernel) and the ``triton`` row ``PagedTokenToKVPoolAllocator``
with ``page_size=1``. On a CPU-only machine Triton runs under its interpreter, which is slow.

Reported per row: median and p90 (nearest rank) of the per-call time in microseconds, the mean
number of tokens per call, and the median of the per-call time divided by its token count.

Correctness is checked once per (page size, batch) outside the timing, on one fixed draw: the
slots are distinct, outside page 0 and inside the pool, each new token sits at its position's
offset in a page and continues its predecessor's page, and every backend (plus the paged torch
path at page size 1) returns identical tensors and leaves an identical free list. A mismatch
aborts the run.

Run::

    .venv/bin/python benchmarks/bench_allocator.py --quick
    .venv/bin/python benchmarks/bench_allocator.py --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform as py_platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NoReturn

import torch

from tiered_kv import platform
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator
from tiered_kv.errors import BackendUnavailableError, TieredKVError

OPS = ("alloc_extend", "alloc_decode", "free")
BACKENDS = ("torch", "triton")
QUICK_REPEATS = 5
QUICK_TRITON_BATCHES = (1, 64)


@dataclass(frozen=True)
class Batch:
    """Request lengths on the CPU: tokens already cached and tokens to add."""

    prefix: torch.Tensor
    extend: torch.Tensor


@dataclass(frozen=True)
class Prepared:
    """Arguments of the timed calls for one allocator state (prefix already allocated)."""

    prefix_dev: torch.Tensor
    prefix_cpu: torch.Tensor
    seq_dev: torch.Tensor
    seq_cpu: torch.Tensor
    last_loc: torch.Tensor
    num_extend: int
    decode_seq_dev: torch.Tensor
    decode_seq_cpu: torch.Tensor
    prefix_slots: torch.Tensor


@dataclass(frozen=True)
class Sample:
    """One repeat: seconds per op, tokens per op, and the tensors the allocator returned."""

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


# -- arguments -------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of ints >= 1")
    return values


def _backend_list(text: str) -> list[str]:
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in BACKENDS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: backends are {', '.join(BACKENDS)}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 64, 256])
    p.add_argument("--page-sizes", type=_int_list, default=[1, 16, 64])
    p.add_argument("--backends", type=_backend_list, default=list(BACKENDS))
    p.add_argument("--repeats", type=int, default=20, help="timed calls per row (median shown)")
    p.add_argument("--extend-len", type=int, default=128, help="mean new tokens per request")
    p.add_argument("--prefix-len", type=int, default=100, help="mean cached tokens per request")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REPEATS} repeats; triton only at batch sizes {QUICK_TRITON_BATCHES}",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list of dicts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = QUICK_REPEATS
    if args.repeats < 1 or args.extend_len < 1 or args.prefix_len < 0:
        p.error("--repeats and --extend-len must be >= 1, --prefix-len >= 0")
    return args


# -- setup -----------------------------------------------------------------------------------
def config_generator(seed: int, page_size: int, batch: int, salt: int) -> torch.Generator:
    """A generator per (page size, batch): every backend draws the same lengths."""
    gen = torch.Generator()
    gen.manual_seed(((seed * 1_000_003 + page_size) * 10_007 + batch) * 7 + salt)
    return gen


def draw_batch(gen: torch.Generator, bs: int, page_size: int, args: argparse.Namespace) -> Batch:
    prefix = torch.randint(0, 2 * args.prefix_len + 1, (bs,), generator=gen)
    aligned = torch.randint(0, 4, (bs,), generator=gen) == 0
    prefix = torch.where(aligned, prefix // page_size * page_size, prefix)
    extend = torch.randint(1, 2 * args.extend_len + 1, (bs,), generator=gen)
    return Batch(prefix, extend)


def pool_size(bs: int, page_size: int, args: argparse.Namespace) -> int:
    """Slots for the largest possible draw (prefix, extend and decode pages), whole pages."""
    per_request = -(-2 * args.prefix_len // page_size) + -(-2 * args.extend_len // page_size) + 3
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
        raise SystemExit(f"pool too small for the prefixes ({n} tokens); this is a script bug")
    if n == 0:
        return slots, none.to(device)
    ends = (torch.cumsum(prefix, 0) - 1).clamp_min(0).to(device)
    last_loc = torch.where(prefix.to(device) > 0, slots[ends], none.to(device))
    return slots, last_loc


def prepare(alloc: BaseTokenToKVPoolAllocator, batch: Batch, device: torch.device) -> Prepared:
    alloc.clear()
    prefix_slots, last_loc = build_prefix(alloc, batch, device)
    seq = batch.prefix + batch.extend
    decode_seq = batch.prefix + 1
    return Prepared(
        prefix_dev=batch.prefix.to(device),
        prefix_cpu=batch.prefix,
        seq_dev=seq.to(device),
        seq_cpu=seq,
        last_loc=last_loc,
        num_extend=int(batch.extend.sum()),
        decode_seq_dev=decode_seq.to(device),
        decode_seq_cpu=decode_seq,
        prefix_slots=prefix_slots,
    )


# -- timing ----------------------------------------------------------------------------------
def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, object]:
    """Seconds of one call of ``fn``, with the garbage collector off (as ``timeit`` does), so a
    collection of garbage left by earlier work (the Triton interpreter's) is not billed here."""
    sync()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        out = fn()
        sync()
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return elapsed, out


def run_once(
    alloc: BaseTokenToKVPoolAllocator, batch: Batch, device: torch.device, sync: Callable
) -> Sample:
    """Build the prefix state, then time extend, free (of the extend) and decode."""
    p = prepare(alloc, batch, device)
    state = alloc.backup_state()
    t_ext, ext = timed(
        lambda: alloc.alloc_extend(
            p.prefix_dev, p.prefix_cpu, p.seq_dev, p.seq_cpu, p.last_loc, p.num_extend
        ),
        sync,
    )
    if ext is None:
        raise SystemExit("alloc_extend returned None: the pool is too small (script bug)")
    t_free, _ = timed(lambda: alloc.free(ext), sync)
    free_after_free = alloc.get_all_free_pages()
    alloc.restore_state(state)
    t_dec, dec = timed(
        lambda: alloc.alloc_decode(p.decode_seq_dev, p.decode_seq_cpu, p.last_loc), sync
    )
    if dec is None:
        raise SystemExit("alloc_decode returned None: the pool is too small (script bug)")
    bs = int(batch.prefix.numel())
    return Sample(
        seconds={"alloc_extend": t_ext, "alloc_decode": t_dec, "free": t_free},
        tokens={"alloc_extend": p.num_extend, "alloc_decode": bs, "free": p.num_extend},
        prefix_slots=p.prefix_slots,
        extend_slots=ext,
        decode_slots=dec,
        free_after_free=free_after_free,
    )


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ceil(q * n)-th smallest value (q in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


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
                median_us=statistics.median(secs) * 1e6,
                p90_us=nearest_rank(secs, 0.9) * 1e6,
                tokens=round(sum(toks) / len(toks)),
                ns_per_token=statistics.median(per_tok),
                repeats=len(samples),
            )
        )
    return rows


def bench_config(
    backend: str, page_size: int, bs: int, args: argparse.Namespace, device: torch.device
) -> list[Row]:
    alloc = make_allocator(backend, page_size, pool_size(bs, page_size, args), device)
    gen = config_generator(args.seed, page_size, bs, salt=0)
    sync = make_sync(device)
    samples = [
        run_once(alloc, draw_batch(gen, bs, page_size, args), device, sync)
        for _ in range(args.repeats)
    ]
    return summarize(samples, backend, page_size, bs)


# -- correctness -----------------------------------------------------------------------------
def fail(where: str, what: str) -> NoReturn:
    raise SystemExit(f"CORRECTNESS FAILURE [{where}]: {what}")


def check_distinct(where: str, name: str, slots: torch.Tensor, num_pages: int, page: int) -> None:
    slots = slots.cpu()
    if slots.numel() == 0:
        return
    if torch.unique(slots).numel() != slots.numel():
        uniq, counts = torch.unique(slots, return_counts=True)
        fail(where, f"{name}: slots handed out twice: {uniq[counts > 1][:8].tolist()}")
    if int(slots.min()) < page:
        fail(where, f"{name}: slot {int(slots.min())} is in the padding page 0")
    if int(slots.max()) >= (num_pages + 1) * page:
        fail(where, f"{name}: slot {int(slots.max())} is outside the pool")


def layout_error(
    name: str,
    slots: torch.Tensor,
    before: torch.Tensor,
    new: torch.Tensor,
    last_loc: torch.Tensor,
    page: int,
) -> str | None:
    """Why ``slots`` (the new tokens of every request, request after request) break the paged
    layout, or None: token ``pos`` must sit at offset ``pos % page`` and, unless it opens a page,
    right after the slot of token ``pos - 1`` (``last_loc`` for a request's first new token)."""
    if slots.numel() == 0:
        return None
    out_start = torch.cumsum(new, 0) - new
    req = torch.repeat_interleave(torch.arange(new.numel()), new)
    pos = before[req] + torch.arange(slots.numel()) - out_start[req]
    prev = torch.cat((slots[:1], slots[:-1]))
    prev[out_start[new > 0]] = last_loc[new > 0]
    continues = pos % page != 0
    bad = (slots % page != pos % page) | (continues & (slots != prev + 1))
    if not bool(bad.any()):
        return None
    i = int(torch.nonzero(bad)[0, 0])
    expected = (
        f"{int(prev[i]) + 1} (right after token {int(pos[i]) - 1}'s slot {int(prev[i])})"
        if bool(continues[i])
        else f"the first slot of a fresh page (a multiple of {page})"
    )
    return (
        f"{name}: request {int(req[i])} token {int(pos[i])} got slot {int(slots[i])}, "
        f"expected {expected}; {int(bad.sum())} of {slots.numel()} tokens are misplaced"
    )


def check_layout(where: str, batch: Batch, s: Sample, page: int) -> None:
    """Prefix, extend and decode slots all follow the paged layout."""
    prefix_slots = s.prefix_slots.cpu()
    last_loc = torch.full_like(batch.prefix, -1)
    has = batch.prefix > 0
    last_loc[has] = prefix_slots[(torch.cumsum(batch.prefix, 0) - 1)[has]]
    zeros, ones = torch.zeros_like(batch.prefix), torch.ones_like(batch.prefix)
    checks = (
        ("prefix alloc_extend", prefix_slots, zeros, batch.prefix, last_loc),
        ("alloc_extend", s.extend_slots.cpu(), batch.prefix, batch.extend, last_loc),
        ("alloc_decode", s.decode_slots.cpu(), batch.prefix, ones, last_loc),
    )
    for name, slots, before, new, loc in checks:
        error = layout_error(name, slots, before, new, loc, page)
        if error:
            fail(where, error)


def check_sample(where: str, batch: Batch, s: Sample, alloc: BaseTokenToKVPoolAllocator) -> None:
    pages, page = alloc.num_pages, alloc.page_size
    check_layout(where, batch, s, page)
    check_distinct(where, "prefix+extend", torch.cat((s.prefix_slots, s.extend_slots)), pages, page)
    check_distinct(where, "prefix+decode", torch.cat((s.prefix_slots, s.decode_slots)), pages, page)


def compare_samples(where: str, ref_label: str, ref: Sample, label: str, s: Sample) -> None:
    for field in ("prefix_slots", "extend_slots", "decode_slots", "free_after_free"):
        a, b = getattr(ref, field).cpu(), getattr(s, field).cpu()
        if torch.equal(a, b):
            continue
        if a.shape != b.shape:
            fail(where, f"{field}: {ref_label} has {a.numel()} entries, {label} {b.numel()}")
        i = int(torch.nonzero(a != b)[0, 0])
        fail(
            where,
            f"{field} differs between {ref_label} and {label} at index {i} "
            f"({int(a[i])} vs {int(b[i])}; {int((a != b).sum())} of {a.numel()} differ)",
        )


def verification_variants(backends: list[str], page_size: int) -> list[tuple[str, str, bool]]:
    """(label, backend, force paged) for every allocator the check runs on one draw."""
    variants = [(f"{b}/{allocator_label(b, page_size)}", b, False) for b in backends]
    if page_size == 1 and "torch" in backends:
        variants.append((f"torch/{PagedTokenToKVPoolAllocator.__name__}", "torch", True))
    return variants


def verify_config(
    backends: list[str], page_size: int, bs: int, args: argparse.Namespace, device: torch.device
) -> None:
    """One draw through every backend from the same empty pool; abort on any mismatch."""
    where = f"page_size={page_size} batch={bs} seed={args.seed}"
    batch = draw_batch(config_generator(args.seed, page_size, bs, salt=1), bs, page_size, args)
    size = pool_size(bs, page_size, args)
    reference: tuple[str, Sample] | None = None
    for label, backend, paged in verification_variants(backends, page_size):
        alloc = make_allocator(backend, page_size, size, device, paged=paged)
        try:
            sample = run_once(alloc, batch, device, make_sync(device))
        except TieredKVError as exc:
            fail(f"{where} {label}", f"the allocator raised {type(exc).__name__}: {exc}")
        check_sample(f"{where} {label}", batch, sample, alloc)
        if reference is None:
            reference = (label, sample)
        else:
            compare_samples(where, reference[0], reference[1], label, sample)


# -- output ----------------------------------------------------------------------------------
def machine_conditions(device: torch.device) -> list[str]:
    triton = platform.import_triton()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return [
        f"python {py_platform.python_version()} on {py_platform.platform()}",
        f"torch {torch.__version__} (intra-op threads {torch.get_num_threads()})",
        f"triton {triton.__version__ if triton is not None else 'unavailable'}",
        f"triton interpreted: {platform.triton_interpreted()}",
        f"device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        f"cpu count {os.cpu_count()} (usable {affinity})",
        "load average " + (" ".join(f"{v:.2f}" for v in load) if load else "unavailable"),
    ]


HEADER = (
    f"{'backend':<7} {'allocator':<27} {'page_size':>9} {'batch':>5} {'op':<12} "
    f"{'median_us':>10} {'p90_us':>10} {'tokens':>7} {'ns_per_token':>12}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.backend:<7} {r.allocator:<27} {r.page_size:>9} {r.batch:>5} {r.op:<12} "
        f"{r.median_us:>10.1f} {r.p90_us:>10.1f} {r.tokens:>7} {r.ns_per_token:>12.1f}"
    )


def ratio_lines(rows: list[Row]) -> list[str]:
    by_key = {(r.backend, r.page_size, r.batch, r.op): r for r in rows}
    lines = []
    for r in rows:
        if r.backend != "triton" or ("torch", r.page_size, r.batch, r.op) not in by_key:
            continue
        base = by_key[("torch", r.page_size, r.batch, r.op)]
        lines.append(
            f"ratio triton/torch  page_size={r.page_size:<3} batch={r.batch:<4} op={r.op:<12} "
            f"{r.median_us / base.median_us:>9.1f}x  "
            f"({r.median_us:.1f} us / {base.median_us:.1f} us, torch row: {base.allocator})"
        )
    return lines


def print_report(rows: list[Row]) -> None:
    print(HEADER)
    print("-" * len(HEADER))
    for r in sorted(rows, key=lambda r: (r.backend, r.page_size, r.batch, OPS.index(r.op))):
        print(format_row(r))
    ratios = ratio_lines(sorted(rows, key=lambda r: (r.page_size, r.batch, OPS.index(r.op))))
    if ratios:
        print()
        print("\n".join(ratios))


# -- driver ----------------------------------------------------------------------------------
def backends_for(batch: int, args: argparse.Namespace) -> list[str]:
    if args.quick:
        return [b for b in args.backends if b != "triton" or batch in QUICK_TRITON_BATCHES]
    return list(args.backends)


def available_backends(backends: list[str], device: torch.device) -> list[str]:
    usable = []
    for b in backends:
        try:
            platform.kernel_backend(device, b)
        except BackendUnavailableError as exc:
            print(f"skipping backend {b}: {exc}", file=sys.stderr)
            continue
        usable.append(b)
    return usable


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = platform.resolve_device(args.device)
    print("\n".join(machine_conditions(device)))
    print(
        f"repeats {args.repeats}, extend_len mean {args.extend_len}, prefix_len mean "
        f"{args.prefix_len}, seed {args.seed}{', quick' if args.quick else ''}"
    )
    print(flush=True)
    args.backends = available_backends(args.backends, device)
    rows: list[Row] = []
    started = time.perf_counter()
    for page_size in args.page_sizes:
        for bs in args.batch_sizes:
            backends = backends_for(bs, args)
            verify_config(backends, page_size, bs, args, device)
            for backend in backends:
                rows.extend(bench_config(backend, page_size, bs, args, device))
            print(
                f"  done page_size={page_size} batch={bs} ({', '.join(backends)}) "
                f"at {time.perf_counter() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    print_report(rows)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print()
    print(f"correctness: all configurations verified; total {time.perf_counter() - started:.1f}s")
    if load:
        print("load average at end " + " ".join(f"{v:.2f}" for v in load))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)
    return rows


if __name__ == "__main__":
    main()

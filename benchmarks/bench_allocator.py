"""Benchmark of the device KV-pool allocators: ``alloc_extend``, ``alloc_decode`` and ``free``.

What is measured (``tiered_kv.bench.allocator``): for every kernel backend (``torch``,
``triton``) x page size x batch size, the wall time of one call of each operation, with
``time.perf_counter`` around that call only (plus a ``torch.cuda.synchronize`` on each side with
``--device cuda``; the garbage collector is off during the call, as in ``timeit``). Each repeat
draws fresh, irregular request lengths from a seeded ``torch.Generator`` (prefix lengths in
``[0, 2 * --prefix-len]``, a quarter of them rounded down to a page boundary; new tokens in
``[1, 2 * --extend-len]``); the backends of a configuration then run in turn on that draw
(round-robin, so a change in the machine's speed hits all of them), each building every
request's prefix from an empty pool with an untimed ``alloc_extend`` (prefix 0, ``last_loc``
-1), and timing:

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
path at page size 1) returns identical tensors and leaves an identical free list (the same
pages where the token allocator, which appends freed slots, orders them differently). A mismatch
aborts the run.

Run::

    .venv/bin/python benchmarks/bench_allocator.py --quick
    .venv/bin/python benchmarks/bench_allocator.py --json results.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch

from tiered_kv import platform
from tiered_kv.bench import machine, report
from tiered_kv.bench.allocator import BACKENDS, OPS, Lengths, Row, measure_allocators
from tiered_kv.bench.allocator_check import verify_config
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.errors import BackendUnavailableError

QUICK_REPEATS = 5
QUICK_TRITON_BATCHES = (1, 64)


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
    p.add_argument("--json", metavar="PATH", help="also write {rows, config, machine} as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = QUICK_REPEATS
    if args.repeats < 1 or args.extend_len < 1 or args.prefix_len < 0:
        p.error("--repeats and --extend-len must be >= 1, --prefix-len >= 0")
    return args


# -- output ----------------------------------------------------------------------------------
def machine_conditions(device: torch.device) -> list[str]:
    lines = machine.condition_lines(machine.machine_info(device))
    return [*lines, f"triton interpreted: {platform.triton_interpreted()}"]


C = report.Column
COLUMNS = [
    C("backend", 7, left=True), C("allocator", 27, left=True), C("page_size", 9),
    C("batch", 5), C("op", 12, left=True), C("median_us", 10, ".1f"), C("p90_us", 10, ".1f"),
    C("tokens", 7), C("ns_per_token", 12, ".1f"),
]  # fmt: skip


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
    ordered = sorted(rows, key=lambda r: (r.backend, r.page_size, r.batch, OPS.index(r.op)))
    cells = [[getattr(r, c.title) for c in COLUMNS] for r in ordered]
    print("\n".join(report.fixed_table(COLUMNS, cells)))
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


def run(args: argparse.Namespace, device: torch.device) -> list[Row]:
    lengths = Lengths(args.prefix_len, args.extend_len)
    rows: list[Row] = []
    started = time.perf_counter()
    for page_size in args.page_sizes:
        for bs in args.batch_sizes:
            backends = backends_for(bs, args)
            verify_config(backends, page_size, bs, lengths, args.seed, device)
            rows += measure_allocators(
                backends, page_size, bs, lengths, args.repeats, args.seed, device
            )
            print(
                f"  done page_size={page_size} batch={bs} ({', '.join(backends)}) "
                f"at {time.perf_counter() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = platform.resolve_device(args.device)
    watch = machine.LoadWatch()
    print("\n".join(machine_conditions(device)))
    print(
        f"repeats {args.repeats}, extend_len mean {args.extend_len}, prefix_len mean "
        f"{args.prefix_len}, seed {args.seed}{', quick' if args.quick else ''}"
    )
    print(flush=True)
    args.backends = available_backends(args.backends, device)
    started = time.perf_counter()
    with exit_on_failure():
        rows = run(args, device)
    print_report(rows)
    print()
    print(f"correctness: all configurations verified; total {time.perf_counter() - started:.1f}s")
    loads = watch.finish()
    if loads["load_after"]:
        print("load average at end " + " ".join(f"{v:.2f}" for v in loads["load_after"]))
    noise = machine.noise_check(None, list(loads.values()))
    if noise.noisy:
        print("noise: " + "; ".join(noise.reasons))
    report.write_json(
        args.json,
        {"rows": [asdict(r) for r in rows]},
        config=report.config_of(args),
        machine={**machine.machine_info(device), **loads},
    )
    return rows


if __name__ == "__main__":
    main()

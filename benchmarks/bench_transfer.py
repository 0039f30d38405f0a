"""Benchmark of host <-> device page transfers: backup and load GB/s against a contiguous copy.

What is measured (``tiered_kv.bench.transfer``): for every host layout x page size x io backend
(``kernel``, ``direct``) x kernel backend behind ``kernel`` (``native``, ``torch``; ``triton``
with ``--with-triton``), the wall time of a ``backup`` (one ``backup_from_device_all_layer``
call of ``--tokens`` tokens), a ``load`` (``load_to_device_per_layer`` once per layer, timed as
one loop) and a ``load_all`` (one ``load_to_device_all_layer`` call), with the garbage collector
off and a ``torch.cuda.synchronize`` on each side with ``--device cuda``. ``direct`` does not
use the kernel backend: one row per layout and page size, kernel backend ``-``.

Each repeat draws fresh scattered pages from a seeded generator (every backend of a (page
size, layout) sees the same draws). Baseline, in the same run and interleaved: right before
every timed transfer, one ``dst.copy_(src)`` of two contiguous tensors of exactly its bytes, in
its direction. A row's ratio is its GB/s over the median baseline GB/s of the same rounds.
GB/s is 1e9 bytes per second; MiB is 2**20 bytes. Medians over ``--repeats`` repeats, or fewer
(at least ``MIN_REPEATS``) once a configuration's transfers took ``--max-row-seconds``; column
``n`` says how many ran. A ``*`` after the ratio marks a noisy baseline window (its samples
spread by more than ``NOISY_SPREAD`` max / min, or their IQR is over ``NOISY_IQR`` of their
median): read that ratio with care or rerun. Each configuration starts with ``WARMUP_ROUNDS``
dropped round (first copies after a host pool is built run up to 2x slower).

Correctness is checked once per configuration outside the timing, on its own draw
(``tiered_kv.bench.transfer_check``): backed-up host rows and loaded device rows equal the
source bit for bit; a layer not loaded yet is untouched. A mismatch aborts the run.

The target (issue): ``page_first`` backup and load with page size >= 16 at >= 0.8 of the
contiguous copy; the ``target`` section lists PASS/MISS per row.

On CPU Triton runs under its interpreter, far too slow for these sizes: ``--with-triton`` adds
``triton`` rows at ``--triton-tokens`` tokens (rounded up to a page) and at most
``TRITON_MAX_REPEATS`` repeats, no warm-up (their ratios are not speed figures).

Run::

    .venv/bin/python benchmarks/bench_transfer.py --quick
    .venv/bin/python benchmarks/bench_transfer.py --json results.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from tiered_kv import kernels, platform
from tiered_kv.bench import machine, report
from tiered_kv.bench.fixed_cost import PAGE_COUNTS, idle_penalty, measure_fixed_cost
from tiered_kv.bench.machine import NOISY_IQR, NOISY_SPREAD
from tiered_kv.bench.transfer import (
    DIRECTIONS,
    IO_BACKENDS,
    LAYOUTS,
    MIN_REPEATS,
    Geometry,
    make_pool,
)
from tiered_kv.bench.transfer_suite import (
    KERNEL_BACKENDS,
    TARGET_LAYOUT,
    TARGET_MIN_PAGE,
    TARGET_RATIO,
    Row,
    Settings,
    combos,
    run_suite,
)
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.host import HostKVCache  # noqa: F401  (tests patch its methods through here)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    **{n: getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)},
}
QUICK = {"tokens": 512, "pool_tokens": 2048, "repeats": 3}
MIB = 1 << 20
GIB = 1 << 30


# -- arguments -------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of ints >= 1")
    return values


def _choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip().lower() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(values))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads (MHA/GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--mla", action="store_true", help="an MLA pool instead of MHA")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="with --mla")
    p.add_argument("--qk-rope-head-dim", type=int, default=64, help="with --mla")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per transfer")
    p.add_argument("--pool-tokens", type=int, default=8192, help="device and host pool tokens")
    p.add_argument("--page-sizes", type=_int_list, default=[1, 16, 64])
    p.add_argument("--layouts", type=_choice_list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--io-backends", type=_choice_list(IO_BACKENDS), default=list(IO_BACKENDS))
    p.add_argument(
        "--kernel-backends",
        type=_choice_list(KERNEL_BACKENDS),
        default=["native", "torch"],
        help="behind io backend 'kernel' (triton on CPU: interpreted, at --triton-tokens)",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed transfers per row (median)")
    p.add_argument(
        "--max-row-seconds",
        type=float,
        default=4.0,
        help=f"stop repeating a row (after at least {MIN_REPEATS}) once its transfers took this",
    )
    p.add_argument(
        "--with-triton",
        action="store_true",
        help="add the triton kernel backend (on CPU: interpreted, at --triton-tokens only)",
    )
    p.add_argument(
        "--triton-tokens", type=int, default=16, help="tokens of interpreted triton rows"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    p.add_argument("--json", metavar="PATH", help="also write {rows, config, machine} as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--fixed-cost",
        action="store_true",
        help="instead: the fixed cost per op of each direction (CPU; first page size)",
    )
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.with_triton and "triton" not in args.kernel_backends:
        args.kernel_backends.append("triton")
    positive = ("layers", "heads", "head_dim", "kv_lora_rank", "tokens", "pool_tokens")
    for name in (*positive, "repeats", "triton_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_row_seconds < 0:
        p.error("--max-row-seconds must be >= 0")
    if args.qk_rope_head_dim < 0:
        p.error("--qk-rope-head-dim must be >= 0")
    for page in args.page_sizes:
        for name in ("tokens", "pool_tokens"):
            if getattr(args, name) % page:
                p.error(f"--{name.replace('_', '-')} must be a multiple of every page size")
    triton_max = max(-(-args.triton_tokens // p) * p for p in args.page_sizes)
    if args.pool_tokens < 2 * max(args.tokens, triton_max):
        p.error("--pool-tokens must be >= 2 * --tokens (the load goes to other device pages)")
    return args


def geometry(args: argparse.Namespace) -> Geometry:
    return Geometry(
        args.layers, args.heads, args.head_dim, DTYPES[args.dtype], args.mla,
        args.kv_lora_rank, args.qk_rope_head_dim,
    )  # fmt: skip


def geometry_line(args: argparse.Namespace, per_layer: int) -> str:
    per_token = per_layer * args.layers
    kind = (
        f"MLA: layers {args.layers}, kv_lora_rank {args.kv_lora_rank}, "
        f"qk_rope_head_dim {args.qk_rope_head_dim}"
        if args.mla
        else f"MHA: layers {args.layers}, kv heads {args.heads}, head_dim {args.head_dim}"
    )
    return (
        f"{kind}, {args.dtype}: {per_layer} B per token per layer, {per_token} B per "
        f"token; transfer {args.tokens} tokens = {args.tokens * per_token / MIB:.1f} MiB per "
        f"direction; device pool and host pool {args.pool_tokens} tokens "
        f"({args.pool_tokens * per_token / GIB:.2f} GiB) each"
    )


# -- output ----------------------------------------------------------------------------------
C = report.Column
COLUMNS = [
    C("layout", 17, left=True), C("page_size", 9), C("io_backend", 10, left=True),
    C("kernel_backend", 14, left=True), C("direction", 9, left=True), C("MiB", 7, ".1f"),
    C("median_ms", 10, ".2f"), C("GB/s", 7, ".2f"), C("baseline GB/s", 13, ".2f"),
    C("ratio", 6, ".2f"), C("", 1, left=True, sep=""), C("n", 2),
]  # fmt: skip


def noisy(r: Row) -> bool:
    return bool(r.noise)


def row_key(r: Row) -> tuple:
    kb = KERNEL_BACKENDS.index(r.kernel_backend) if r.kernel_backend in KERNEL_BACKENDS else 99
    return (
        LAYOUTS.index(r.layout), r.page_size, IO_BACKENDS.index(r.io_backend), kb,
        DIRECTIONS.index(r.direction),
    )  # fmt: skip


def target_lines(rows: list[Row]) -> list[str]:
    lines = [
        f"target: {TARGET_LAYOUT} backup and load, page size >= {TARGET_MIN_PAGE}, ratio >= "
        f"{TARGET_RATIO} of the contiguous copy"
    ]
    targets = sorted((r for r in rows if r.target is not None), key=row_key)
    if not targets:
        lines.append(f"  no rows qualify (no {TARGET_LAYOUT} row with page size >= 16)")
        return lines
    for r in targets:
        lines.append(
            f"  page_size={r.page_size:<3} io_backend={r.io_backend:<6} "
            f"kernel_backend={r.kernel_backend:<6} {r.direction:<6} ratio {r.ratio:5.2f}  "
            f"{r.target}" + ("  (* noisy baseline window)" if noisy(r) else "")
        )
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in targets:
        groups.setdefault((r.io_backend, r.kernel_backend, r.direction), []).append(r)
    lines.append("  per (io_backend, kernel_backend, direction), all page sizes >= 16:")
    for (io, kb, direction), rs in groups.items():
        ok = "PASS" if all(r.target == "PASS" for r in rs) else "MISS"
        worst = min(r.ratio for r in rs)
        lines.append(f"    {io:<6} {kb:<6} {direction:<6} {ok} (lowest ratio {worst:.2f})")
    passed = sum(r.target == "PASS" for r in targets)
    lines.append(f"  {passed} of {len(targets)} target rows PASS")
    return lines


def print_report(rows: list[Row]) -> None:
    cells = [
        [r.layout, r.page_size, r.io_backend, r.kernel_backend, r.direction, r.mib, r.median_ms,
         r.gbps, r.baseline_gbps, r.ratio, "*" if noisy(r) else " ", r.repeats]
        for r in sorted(rows, key=row_key)
    ]  # fmt: skip
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    if any(noisy(r) for r in rows):
        print(
            f"* noisy baseline window (samples spread by more than {NOISY_SPREAD}x max / min, "
            f"or IQR over {NOISY_IQR} of the median): the machine changed speed; read the "
            "ratio with care"
        )
    tiny = sorted({r.tokens for r in rows if r.interpreted})
    if tiny:
        print(
            f"(triton rows run under the interpreter at {', '.join(map(str, tiny))} tokens: a "
            "correctness path, not a speed figure; they are not target rows)"
        )
    print()
    print("\n".join(target_lines(rows)))


# -- driver ----------------------------------------------------------------------------------
def settings(args: argparse.Namespace) -> Settings:
    return Settings(
        geometry(args), args.tokens, args.pool_tokens, args.page_sizes, args.layouts,
        args.repeats, args.max_row_seconds, args.triton_tokens, args.seed,
    )  # fmt: skip


def print_fixed_cost(args: argparse.Namespace) -> None:
    """One op per direction at 1 .. 256 pages; the intercept of the least-squares line, for ops
    back to back and for ops interleaved with the other directions."""
    print(f"load average before {machine.load_average()}")
    warm_us, after_us = idle_penalty()
    print(
        f"control (no tiered_kv code): a fixed mix of small torch ops takes {warm_us:.0f} us "
        f"back to back and {after_us:.0f} us right after a 5 ms blocking wait on this machine"
    )
    for warm, title in (
        (True, "ops back to back (each direction and size in its own run, after 5 untimed ops)"),
        (False, "ops interleaved round-robin over directions and sizes (each after another cell)"),
    ):
        costs = measure_fixed_cost(
            geometry(args), args.page_sizes[0], args.repeats, args.seed, warm=warm
        )
        print(title)
        print(
            f"{'direction':16} {'fixed us':>9} {'GB/s':>6}  median us at "
            f"{', '.join(map(str, PAGE_COUNTS))} pages"
        )
        for c in costs:
            ms = " ".join(f"{s * 1e6:.0f}" for _, s in c.points)
            print(f"{c.direction:16} {c.fixed_us:9.1f} {c.gbps:6.2f}  {ms}")
    print(f"load average after {machine.load_average()}; every op ok, bytes verified")


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.fixed_cost:
        print_fixed_cost(args)
        return []
    device = platform.resolve_device(args.device)
    watch = machine.LoadWatch()
    info = machine.machine_info(device)
    print("\n".join(machine.condition_lines(info)))
    print(f"native block copier available: {kernels.native_available()}")
    all_combos = combos(args.io_backends, args.kernel_backends, device)
    page = args.page_sizes[0]
    print(
        geometry_line(
            args, make_pool(geometry(args), page, page, device).bytes_per_token_per_layer()
        )
    )
    print(
        f"repeats {args.repeats} (median; fewer, at least {MIN_REPEATS}, once a row's "
        f"transfers took {args.max_row_seconds:g} s), seed {args.seed}"
        f"{', quick' if args.quick else ''}; layouts {', '.join(args.layouts)}; "
        f"page sizes {', '.join(map(str, args.page_sizes))}; backends "
        + ", ".join(f"{c.io_backend}/{c.label}" for c in all_combos)
    )
    print(flush=True)
    started = time.perf_counter()
    with exit_on_failure():
        rows, configs, sampled = run_suite(
            settings(args),
            all_combos,
            device,
            lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        )
    print_report(rows)
    print()
    print(
        f"correctness: all {configs} configurations verified (backup: {sampled} sampled host "
        "tokens x every part and layer; load: every token, part and layer); total "
        f"{time.perf_counter() - started:.1f}s"
    )
    loads = watch.finish()
    run_noise = machine.noise_check(None, [loads["load_before"], loads["load_after"]])
    if loads["load_after"]:
        print("load average at end " + " ".join(f"{v:.2f}" for v in loads["load_after"]))
    if run_noise.noisy:
        print("noise: " + "; ".join(run_noise.reasons))
    report.write_json(
        args.json,
        {"rows": [asdict(r) for r in rows]},
        config=report.config_of(args),
        machine={**machine.machine_info(device), **loads},
    )
    return rows


if __name__ == "__main__":
    main()

"""Side by side with SGLang 0.5.23's own code: same process, same inputs, alternating calls.

Parts (``--only``; default every part):

- ``allocators``: the token allocator (page size 1) and the paged allocator at page sizes
  1/16/64 x batch 1/64/256 x ``alloc_extend`` / ``alloc_decode`` / ``free``; the ratio of a
  cell is SGLang's median time over ours (above 1.0 ours is faster). What is timed, how the
  inputs are drawn and checked, the pool size and the one excluded cell:
  ``tiered_kv/bench/vs_sglang.py``.

- ``stores``: our disk store in both layouts (``slab``, ``lmdb``) against SGLang's file backend
  ``HiCacheFile`` on the same pages (``--store-sizes`` MiB, ``--store-mib`` per size): ``set``
  and warm ``get`` over ``HiCacheFile``'s GB/s (above 1.0 ours is faster), cold ``get`` (after
  dropping the page cache: root) over the fastest raw read of the same bytes (buffered whole
  pages, 256 KiB reads, ``O_DIRECT``); alternating rounds, medians, the load average per size:
  ``tiered_kv/bench/vs_sglang_stores.py``. Targets: set and warm get >= 1.0x, cold get >= 0.8x.

SGLang runs where it is importable, e.g. with the recipe in ``../shared/peer/``::

    PYTHONPATH=/tmp/peer/stubs:. /tmp/peer/venv/bin/python benchmarks/bench_vs_sglang.py

Without it the script says so in one line (``SGLang is not installed here ...``), times ours
alone and exits 0; with ``--require-sglang`` it exits with status 3 instead (``EXIT_NO_SGLANG``).
A mismatch between the two allocators' slots exits with the ``CORRECTNESS FAILURE`` message.

    .venv/bin/python benchmarks/bench_vs_sglang.py --quick      # ours alone, seconds
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from tiered_kv import platform
from tiered_kv.bench import disk, machine, report, sglang_peer
from tiered_kv.bench.allocator import Lengths
from tiered_kv.bench.timing import median
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.bench.vs_sglang import (
    EXCLUDED,
    Comparison,
    allocator_cells,
    measure_cell,
    pool_tokens,
)
from tiered_kv.bench.vs_sglang_stores import TARGETS, StoreRow, grade, measure_stores

EXIT_NO_SGLANG = 3
QUICK = {
    "repeats": 3, "batch_sizes": [1, 64], "page_sizes": [1, 16],
    "store_sizes": [0.25], "store_mib": 4, "store_repeats": 1,
}  # fmt: skip


def _size_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(round(v * 2**20) < 4096 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated sizes in MiB")
    return values


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of ints >= 1")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--only", choices=sorted(PARTS), action="append", help="parts to run")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 64, 256])
    p.add_argument("--page-sizes", type=_int_list, default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=21, help="alternating rounds per cell")
    p.add_argument("--extend-len", type=int, default=128, help="mean new tokens per request")
    p.add_argument("--prefix-len", type=int, default=100, help="mean cached tokens per request")
    p.add_argument(
        "--pool-tokens",
        type=int,
        default=None,
        help="pool size of every cell (default: enough for the largest draw of the largest "
        "batch; 0: each cell's own largest draw)",
    )
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--require-sglang", action="store_true", help="exit 3 without SGLang")
    p.add_argument("--json", metavar="PATH", help="also write {rows, config, machine} as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both (default 1: the calls take microseconds, and on a "
        "shared machine a second thread that is not scheduled stalls a call for milliseconds)",
    )
    p.add_argument("--store-sizes", type=_size_list, default=[0.5, 2.0, 8.0], help="MiB")
    p.add_argument("--store-mib", type=float, default=256, help="stores: MiB of pages per size")
    p.add_argument("--store-batch", type=int, default=8, help="stores: pages per call")
    p.add_argument("--store-repeats", type=int, default=5, help="stores: alternating rounds")
    p.add_argument("--store-dir", default=None, help="stores: parent of the work dir (TMPDIR)")
    p.add_argument("--no-drop-cache", action="store_true", help="stores: no cold gets")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.repeats < 1 or args.extend_len < 1 or args.prefix_len < 0:
        p.error("--repeats and --extend-len must be >= 1, --prefix-len >= 0")
    if args.pool_tokens is not None and args.pool_tokens < 0:
        p.error("--pool-tokens must be >= 0")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.store_batch < 1 or args.store_repeats < 1 or args.store_mib <= 0:
        p.error("--store-batch and --store-repeats must be >= 1, --store-mib > 0")
    return args


# -- allocators ------------------------------------------------------------------------------
C = report.Column
COLUMNS = [
    C("allocator", 9, left=True), C("page_size", 9), C("batch", 5), C("op", 12, left=True),
    C("ours_us", 9, ".1f"), C("sglang_us", 9, ".1f"), C("ratio", 6, ".2f"),
    C("ratio_p25", 9, ".2f"), C("ratio_p75", 9, ".2f"),
    C("note", 0, left=True, sep="  "),
]  # fmt: skip


def allocators(args: argparse.Namespace, peer: sglang_peer.SGLangPeer | None) -> list[Comparison]:
    device = platform.resolve_device(args.device)
    lengths = Lengths(args.prefix_len, args.extend_len)
    cells = allocator_cells(args.page_sizes, args.batch_sizes)
    pool = pool_tokens(cells, lengths) if args.pool_tokens is None else args.pool_tokens
    print(
        f"allocators: {args.repeats} alternating rounds per cell, extend_len mean "
        f"{args.extend_len}, prefix_len mean {args.prefix_len}, pool "
        f"{pool or 'fitted per cell'} tokens, seed {args.seed}",
        flush=True,
    )
    rows: list[Comparison] = []
    started = time.perf_counter()
    for cell in cells:
        rows += measure_cell(cell, peer, lengths, args.repeats, args.seed, device, pool)
        print(f"  done {cell} at {time.perf_counter() - started:.1f}s", file=sys.stderr)
    cells_text = [[getattr(r, c.title) for c in COLUMNS] for r in rows]
    print("\n".join(report.fixed_table(COLUMNS, cells_text)))
    for (kind, page, op), why in EXCLUDED.items() if peer is not None else ():
        if any((r.allocator, r.page_size, r.op) == (kind, page, op) for r in rows):
            print(f"excluded: {kind} page_size={page} {op}: {why}")
    ratios = [r.ratio for r in rows if r.ratio is not None]
    if ratios:
        below = [r for r in rows if r.ratio is not None and r.ratio < 1.0]
        print(
            f"ratio SGLang/ours: min {min(ratios):.2f}, median {median(ratios):.2f} over "
            f"{len(ratios)} cells; {len(below)} below 1.0"
        )
    return rows


# -- stores ----------------------------------------------------------------------------------
STORE_COLUMNS = [
    C("size_mib", 8, "g"), C("store", 7, left=True), C("op", 19, left=True), C("pages", 5),
    C("GB/s", 6, ".2f"), C("ratio", 5, ".2f"), C("over", 23, left=True), C("n", 2),
    C("load_1m", 7, ".2f"),
]  # fmt: skip


def stores(args: argparse.Namespace, peer: sglang_peer.SGLangPeer | None) -> list[StoreRow]:
    hicache = peer is not None and peer.storage is not None
    workdir = tempfile.mkdtemp(prefix="bench_vs_sglang-", dir=args.store_dir)
    cold = not args.no_drop_cache and disk.drop_page_cache()
    print("\n".join(disk.disk_lines(workdir, cold)))
    print(
        f"stores: sizes {', '.join(f'{v:g}' for v in args.store_sizes)} MiB, "
        f"{args.store_mib:g} MiB per size, batch {args.store_batch}, {args.store_repeats} "
        f"alternating rounds, seed {args.seed}"
        + ("" if hicache else "; HiCacheFile not importable: ours and the raw reads only")
        + ("" if cold else f"; {disk.NO_COLD}")
        + (" (--no-drop-cache)" if args.no_drop_cache else ""),
        flush=True,
    )
    try:
        rows = measure_stores(
            args.store_sizes, args.store_mib, workdir=workdir, batch=args.store_batch,
            repeats=args.store_repeats, seed=args.seed, cold=cold, hicache=hicache,
            progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        )  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cells = [
        [r.size_mib, r.store, r.op, r.pages, r.gbps, r.ratio, r.baseline, r.repeats,
         r.load[0] if r.load else None]
        for r in rows
    ]  # fmt: skip
    print("\n".join(report.fixed_table(STORE_COLUMNS, cells)))
    print(
        "targets: set and warm_get >= "
        f"{TARGETS['set']}x HiCacheFile, cold_get >= {TARGETS['cold_get']}x the best raw read"
    )
    verdicts = grade(rows)
    for g in verdicts:
        print(
            f"  size {g['size_mib']:>4g} MiB  {g['store']:<4} {g['op']:<8} ratio "
            f"{g['ratio']:5.2f} (need >= {g['need']})  {g['result']}"
        )
    for store in ("slab", "lmdb"):
        mine = [g for g in verdicts if g["store"] == store]
        if mine:
            met = sum(g["result"] == "PASS" for g in mine)
            print(f"  {store}: {met} of {len(mine)} targets PASS")
    return rows


PARTS: dict[str, Callable[[argparse.Namespace, sglang_peer.SGLangPeer | None], list]] = {
    "allocators": allocators,
    "stores": stores,
}


def main(argv: Sequence[str] | None = None) -> dict[str, list]:
    args = parse_args(argv)
    device = platform.resolve_device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args, device)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, list]:
    found = sglang_peer.find_sglang()
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(device))))
    if isinstance(found, str):
        print(f"{found}; {sglang_peer.INSTALL_HINT}. Timing ours alone.", flush=True)
        if args.require_sglang:
            raise SystemExit(EXIT_NO_SGLANG)
        peer = None
    else:
        peer = found
        print(f"SGLang {peer.version} from the same process", flush=True)
    results: dict[str, list] = {}
    with exit_on_failure():
        for part in args.only or list(PARTS):
            print()
            results[part] = PARTS[part](args, peer)
    loads = watch.finish()
    if loads["load_after"]:
        print("load average at end " + " ".join(f"{v:.2f}" for v in loads["load_after"]))
    noise = machine.noise_check(None, list(loads.values()))
    if noise.noisy:
        print("noise: " + "; ".join(noise.reasons))
    report.write_json(
        args.json,
        {part: [asdict(r) for r in rows] for part, rows in results.items()},
        config=report.config_of(args),
        machine={**machine.machine_info(device), **loads, "sglang": getattr(peer, "version", None)},
    )
    return results


if __name__ == "__main__":
    main()

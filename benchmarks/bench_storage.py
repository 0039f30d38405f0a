"""Benchmark of the storage tier: LMDBStorage against a file-per-page store and raw O_DIRECT I/O.

What is measured (``tiered_kv.bench.storage``, ``storage_suite``, ``odirect``): for every value
size (``--sizes``, MiB; about ``--total-mib`` of pages per size), the same pages (random bytes,
keys from ``storage.keys.page_keys``) go through three stores in the same run, in this order
within each repeat:

- ``lmdb``: ``LMDBStorage`` with default options (``--fsync``: ``durable=True``), a fresh store
  directory per repeat, budget twice the bytes written, ``batch_set`` / ``batch_get`` of
  ``--batch`` pages per call;
- ``files``: one file per page named by the key's hex (``bench.page_stores.FileStore``: a
  temporary file renamed into place on set, ``--fsync``: fsync before the rename; ``readinto``
  on get; no checksum, while LMDB verifies one on every get);
- ``odirect``: one file written sequentially with ``O_DIRECT`` from a page-aligned buffer in
  chunks of the value size and read back the same way: the physical limit of the disk (if the
  filesystem refuses ``O_DIRECT``, buffered I/O with fsync and ``DONTNEED`` stands in, and the
  output says so).

Operations: ``set`` (every page once, into an empty store; without ``--fsync`` a write into the
page cache for ``lmdb`` and ``files``, so it can beat the O_DIRECT write), ``full_set`` (the
same pages into a store already full of as many other pages: every page written evicts an old
one, the steady state of a cache), ``warm_get`` (right after the set and an untimed ``sync``)
and ``cold_get`` (after closing the store, ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``,
then reopening it). Without permission to drop the page cache the output says ``cold get not
measured: cannot drop page cache`` and there are no ``cold_get`` rows. ``odirect`` has ``set``
and ``cold_get`` only.

The clock runs around the whole loop over pages (or batches), with the garbage collector off;
GB/s is 1e9 bytes per second of page payload; MiB is 2**20 bytes. Medians over ``--repeats``.
``ratio_files`` is a row's GB/s over the ``files`` row of the same size and op,
``ratio_odirect`` over the ``odirect`` row (set, cold_get). Every get is checked outside the
timing: each call returned True and the host pages equal the written bytes. A mismatch aborts.

Targets (issue), per size: LMDB set, warm get and cold get >= 1.0x ``files``; LMDB cold get >=
0.6x the O_DIRECT read. ``full_set`` is reported next to them, not counted. ``--study`` adds a
table of LMDB options at ``--study-size`` MiB (writemap, readahead, durable, huge pages, I/O
threads, batch size) with ``files`` rows for reference.

Run::

    .venv/bin/python benchmarks/bench_storage.py --quick
    .venv/bin/python benchmarks/bench_storage.py --study --json results.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tiered_kv.bench import disk, machine, report
from tiered_kv.bench.disk import DROP_CACHES, NO_COLD
from tiered_kv.bench.page_stores import FileStore  # noqa: F401  (tests patch it through here)
from tiered_kv.bench.storage import ALIGN, MIB
from tiered_kv.bench.storage_suite import (
    TARGET_FILES,
    TARGET_ODIRECT,
    Row,
    measure_sizes,
    measure_study,
    targets,
)
from tiered_kv.bench.verify import exit_on_failure

QUICK = {"total_mib": 64, "repeats": 1}


def drop_page_cache() -> bool:
    """``sync`` and drop the page cache (tests replace this to fake it)."""
    return disk.drop_page_cache()


@dataclass
class Report:
    rows: list[Row]
    study: list[Row]
    targets: list[dict]
    conditions: list[str]
    cold_get_measured: bool
    notes: list[str]


# -- arguments -------------------------------------------------------------------------------
def _size_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(round(v * MIB) < ALIGN or round(v * MIB) % ALIGN for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated sizes in MiB, each a multiple of 4 KiB"
        )
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", type=_size_list, default=[0.5, 2.0, 8.0], help="value sizes, MiB")
    p.add_argument("--total-mib", type=float, default=512, help="bytes written per size, MiB")
    p.add_argument("--batch", type=int, default=8, help="pages per batch_set / batch_get call")
    p.add_argument("--repeats", type=int, default=3, help="fresh stores per size (median)")
    p.add_argument(
        "--fsync", action="store_true", help="LMDB durable=True, files fsync before rename"
    )
    p.add_argument(
        "--no-drop-cache",
        action="store_true",
        help="do not drop the page cache (no cold_get rows; no root needed)",
    )
    p.add_argument("--study", action="store_true", help="also the LMDB option study")
    p.add_argument("--study-size", type=_size_list, default=[2.0], help="MiB, one size")
    p.add_argument("--dir", default=None, help="parent of the temporary work dir (default TMPDIR)")
    p.add_argument("--quick", action="store_true", help="total-mib 64, repeats 1")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.batch < 1 or args.repeats < 1 or args.total_mib <= 0:
        p.error("--batch and --repeats must be >= 1, --total-mib > 0")
    if len(args.study_size) != 1:
        p.error("--study-size takes one size")
    return args


# -- tables ----------------------------------------------------------------------------------
def columns(ratio: str = "vs files", ratio2: str = "vs odir") -> list[report.Column]:
    C = report.Column
    return [
        C("size_mib", 8, "g"), C("store", 8, left=True), C("config", 24, left=True),
        C("op", 9, left=True), C("pages", 5), C("MiB", 6, ".0f"), C("GB/s", 7, ".2f"),
        C(ratio, 8, ".2f"), C(ratio2, 8, ".2f"), C("n", 2),
    ]  # fmt: skip


def print_table(rows: list[Row], ratio: str = "vs files", ratio2: str = "vs odir") -> None:
    cells = [
        [r.size_mib, r.store, r.config, r.op, r.pages, r.nbytes / MIB, r.gbps, r.ratio_files,
         r.ratio_odirect, r.repeats]
        for r in rows
    ]  # fmt: skip
    print("\n".join(report.fixed_table(columns(ratio, ratio2), cells)))


def target_lines(ts: list[dict]) -> list[str]:
    lines = [
        f"targets: LMDB set / warm get / cold get >= {TARGET_FILES}x files; LMDB cold get >= "
        f"{TARGET_ODIRECT}x the O_DIRECT read"
    ]
    for t in ts:
        ratio = "" if t["ratio"] is None else f"ratio {t['ratio']:5.2f} (need >= {t['need']}) "
        lines.append(f"  size {t['size_mib']:>6g} MiB  {t['what']:<30} {ratio} {t['result']}")
    met = sum(t["result"] == "PASS" for t in ts)
    graded = sum(t["result"] in ("PASS", "MISS") for t in ts)
    lines.append(f"  {met} of {graded} targets PASS")
    return lines


def full_set_lines(rows: list[Row]) -> list[str]:
    """The full-store set ratios, printed next to the targets (not one of them)."""
    lines = [
        f"  size {r.size_mib:>6g} MiB  lmdb set into a full store vs files  "
        f"ratio {r.ratio_files:5.2f}"
        for r in rows
        if r.store == "lmdb" and r.op == "full_set" and r.ratio_files is not None
    ]
    if lines:
        lines.insert(0, "also (not an issue target): set into a store at its budget, evicting")
    return lines


def print_report(rows: list[Row], study: list[Row], ts: list[dict], notes: list[str], args):
    print()
    print_table(rows)
    print(
        "(vs files / vs odir: GB/s over the files / odirect row of the same size and op; "
        "O_DIRECT always reads the disk, so warm_get has no odirect ratio)"
    )
    for note in notes:
        print(note)
    print()
    print("\n".join(target_lines(ts) + full_set_lines(rows)))
    if study:
        print()
        print(
            f"LMDB option study at {args.study_size[0]:g} MiB (vs dflt: GB/s over the "
            "LMDB defaults row of the same op)"
        )
        print_table(study, "vs dflt", "")


# -- driver ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> Report:
    args = parse_args(argv)
    parent = args.dir or tempfile.gettempdir()
    workdir = tempfile.mkdtemp(prefix="bench_storage-", dir=parent)
    cold = not args.no_drop_cache and drop_page_cache()
    watch = machine.LoadWatch()
    info = machine.machine_info()
    conditions = machine.condition_lines(info) + disk.disk_lines(workdir, cold)
    notes: list[str] = []
    if args.no_drop_cache:
        notes.append(f"{NO_COLD} (--no-drop-cache)")
    elif not cold:
        notes.append(f"{NO_COLD} (writing {DROP_CACHES} failed; run as root)")
    print("\n".join(conditions))
    print(
        f"sizes {', '.join(f'{s:g}' for s in args.sizes)} MiB, {args.total_mib:g} MiB per size, "
        f"batch {args.batch}, repeats {args.repeats} (median), seed {args.seed}"
        f"{', fsync' if args.fsync else ''}{', quick' if args.quick else ''}",
        flush=True,
    )
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    common = dict(
        workdir=workdir, batch=args.batch, repeats=args.repeats, seed=args.seed, cold=cold,
        drop=lambda: drop_page_cache(), progress=progress,
    )  # fmt: skip
    try:
        with exit_on_failure():
            rows = measure_sizes(
                args.sizes, args.total_mib, fsync=args.fsync, notes=notes, **common
            )
            study = (
                measure_study(args.study_size[0], args.total_mib, **common) if args.study else []
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ts = targets(rows, cold)
    print_report(rows, study, ts, notes, args)
    colds = [c for r in rows + study if r.op == "cold_get" for c in r.cached_mib_before]
    print()
    if colds and cold:
        print(f"page cache right before each cold get: {min(colds):.0f} - {max(colds):.0f} MiB")
    print(
        f"correctness: every get returned True and matched the written bytes; total "
        f"{time.perf_counter() - started:.1f}s"
    )
    loads = watch.finish()
    noise = machine.noise_check(None, list(loads.values()))
    for r in rows:  # the baselines' own spread across repeats
        if r.store != "lmdb":
            flag = machine.noise_check(r.samples_s)
            reasons = [f"{r.store} {r.op} {r.size_mib:g} MiB: {x}" for x in flag.reasons]
            noise = machine.Noise(noise.noisy or flag.noisy, noise.reasons + tuple(reasons))
    print(
        "load average at end "
        + " ".join(f"{v:.2f}" for v in loads["load_after"] or ())
        + (f"; noise: {'; '.join(noise.reasons)}" if noise.noisy else "")
    )
    rep = Report(rows, study, ts, conditions, cold, notes)
    machine_details = {**info, **loads, "noise": list(noise.reasons)}
    report.write_json(
        args.json, asdict(rep), config=report.config_of(args), machine=machine_details
    )
    return rep


if __name__ == "__main__":
    main()

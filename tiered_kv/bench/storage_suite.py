"""The storage benchmark's tables: LMDB against files and O_DIRECT per size, and the option study.

``measure_sizes``: for every value size, the same pages go through ``lmdb``, ``files`` and
``odirect`` in that order within each repeat (``timing.interleave``: the baselines run in the
same rounds as LMDB). ``ratio_files`` is a row's GB/s over the ``files`` row of the same size
and op, ``ratio_odirect`` over the ``odirect`` row (set, cold_get; O_DIRECT always reads the
disk, so warm_get has none). ``measure_study``: LMDB options at one size, ratios over the LMDB
defaults row. ``targets`` grades the issue's targets: LMDB set, warm get and cold get >= 1.0x
files, LMDB cold get >= 0.6x the O_DIRECT read.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiered_kv.bench.disk import NO_COLD, drop_page_cache
from tiered_kv.bench.odirect import odirect_times
from tiered_kv.bench.storage import (
    LMDB_DEFAULTS,
    Case,
    Times,
    full_set_times,
    kv_store_times,
    make_case,
)
from tiered_kv.bench.timing import gbps, interleave, median

STORES = ("lmdb", "files", "odirect")
OPS = ("set", "full_set", "warm_get", "cold_get")
TARGET_OPS = ("set", "warm_get", "cold_get")
TARGET_FILES = 1.0
TARGET_ODIRECT = 0.6
STUDY = [
    ("defaults", {}, None),
    ("writemap off", {"writemap": False}, None),
    ("readahead off", {"readahead": False}, None),
    ("durable on", {"durable": True}, None),
    ("huge pages on", {"hugepages": True}, None),
    ("1 I/O thread", {"io_threads": 1}, None),
    ("4 I/O threads", {"io_threads": 4}, None),
    ("defaults", {}, 1),
    ("defaults", {}, 32),
]


@dataclass
class Row:
    table: str  # "main" or "study"
    size_mib: float
    store: str
    config: str  # options / batch of the row
    op: str
    pages: int
    nbytes: int
    batch: int
    gbps: float
    ratio_files: float | None
    ratio_odirect: float | None
    repeats: int
    verified: bool
    samples_s: list[float] = field(default_factory=list)
    cached_mib_before: list[float] = field(default_factory=list)  # cold_get: page cache size


def rows_of(
    table: str, case: Case, store: str, config: str, batch: int, samples: Sequence[Times]
) -> list[Row]:
    """One row per op measured in ``samples`` (one ``Times`` per repeat), medians of seconds."""
    rows = []
    nbytes = case.n * case.page_nbytes
    for op in OPS:
        got = [t[op] for t in samples if op in t]
        if not got:
            continue
        secs = [s for s, _ in got]
        rows.append(
            Row(
                table, case.size_mib, store, config, op, case.n, nbytes, batch,
                gbps(nbytes, median(secs)), None, None, len(secs), True, secs,
                [c for _, c in got if c is not None],
            )
        )  # fmt: skip
    return rows


def add_ratios(rows: list[Row]) -> None:
    """Fill ``ratio_files`` and ``ratio_odirect`` from the rows of the same size and op."""
    ref = {(r.size_mib, r.store, r.op): r.gbps for r in rows if r.store in ("files", "odirect")}
    for r in rows:
        f = ref.get((r.size_mib, "files", r.op))
        o = ref.get((r.size_mib, "odirect", r.op))
        r.ratio_files = r.gbps / f if f else None
        r.ratio_odirect = r.gbps / o if o and r.op != "warm_get" else None


def store_arms(
    case: Case,
    workdir: str,
    batch: int,
    lmdb_opts: dict,
    fsync: bool,
    cold: bool,
    notes: list[str],
    drop: Callable[[], bool] = drop_page_cache,
) -> dict[str, Callable[[object], Times]]:
    """One ``interleave`` arm per store of ``STORES``, in that order."""

    def kv(kind: str) -> Callable[[object], Times]:
        o = lmdb_opts if kind == "lmdb" else {}

        def arm(_: object) -> Times:
            got = kv_store_times(case, kind, workdir, batch, o, fsync, cold, drop)
            return got | full_set_times(case, kind, workdir, batch, o, fsync)

        return arm

    return {
        "lmdb": kv("lmdb"),
        "files": kv("files"),
        "odirect": lambda _: odirect_times(case, workdir, notes),
    }


def measure_sizes(
    sizes: Sequence[float],
    total_mib: float,
    *,
    workdir: str,
    batch: int,
    repeats: int,
    seed: int,
    fsync: bool,
    cold: bool,
    notes: list[str],
    drop: Callable[[], bool] = drop_page_cache,
    progress: Callable[[str], None] = lambda _line: None,
) -> list[Row]:
    """The main table: every size, every store, ``repeats`` rounds; ratios filled in."""
    rows: list[Row] = []
    opts = dict(LMDB_DEFAULTS, durable=fsync)
    labels = {
        "lmdb": "durable" if fsync else "defaults",
        "files": "fsync" if fsync else "no fsync",
        "odirect": "sequential",
    }
    for size in sizes:
        case = make_case(size, total_mib, seed)
        got = interleave(
            store_arms(case, workdir, batch, opts, fsync, cold, notes, drop),
            repeats,
            after_round=lambda i, size=size: progress(f"done size={size:g} MiB repeat {i + 1}"),
        )
        for store in STORES:
            b = 1 if store == "odirect" else batch
            rows += rows_of("main", case, store, labels[store], b, got[store])
        del case
        gc.collect()
    add_ratios(rows)
    return rows


def measure_study(
    size: float,
    total_mib: float,
    *,
    workdir: str,
    batch: int,
    repeats: int,
    seed: int,
    cold: bool,
    drop: Callable[[], bool] = drop_page_cache,
    progress: Callable[[str], None] = lambda _line: None,
) -> list[Row]:
    """LMDB options at one size (``STUDY``) and ``files`` rows for reference, interleaved per
    repeat; ``ratio_files`` here is over the first configuration (LMDB defaults)."""
    case = make_case(size, total_mib, seed + 7)
    configs = [
        (label, "lmdb", dict(LMDB_DEFAULTS, **o), b or batch, False) for label, o, b in STUDY
    ]
    configs += [("no fsync", "files", {}, batch, False), ("fsync", "files", {}, batch, True)]

    def arm(kind: str, opts: dict, b: int, fsync: bool) -> Callable[[object], Times]:
        return lambda _: kv_store_times(case, kind, workdir, b, opts, fsync, cold, drop)

    got = interleave(
        {str(i): arm(kind, opts, b, fsync) for i, (_l, kind, opts, b, fsync) in enumerate(configs)},
        repeats,
        after_round=lambda i: progress(f"done study repeat {i + 1}"),
    )
    per_config = [
        rows_of("study", case, kind, f"{label}, batch {b}", b, got[str(i)])
        for i, (label, kind, _opts, b, _fsync) in enumerate(configs)
    ]
    base = {r.op: r.gbps for r in per_config[0]}
    rows = [r for rs in per_config for r in rs]
    for r in rows:
        r.ratio_files = r.gbps / base[r.op] if base.get(r.op) else None  # here: vs LMDB defaults
    return rows


def targets(rows: list[Row], cold: bool) -> list[dict]:
    """PASS / MISS per size and target (and a line saying so when cold gets were not run)."""
    out = []
    by = {(r.size_mib, r.store, r.op): r for r in rows}
    for size in sorted({r.size_mib for r in rows}):
        for op in TARGET_OPS:
            lm = by.get((size, "lmdb", op))
            if lm is None:
                continue
            out.append(
                dict(
                    size_mib=size, what=f"lmdb {op} vs files", ratio=lm.ratio_files,
                    need=TARGET_FILES,
                    result="PASS" if lm.ratio_files >= TARGET_FILES else "MISS",
                )
            )  # fmt: skip
            if op == "cold_get":
                out.append(
                    dict(
                        size_mib=size, what="lmdb cold_get vs odirect read",
                        ratio=lm.ratio_odirect, need=TARGET_ODIRECT,
                        result="PASS" if lm.ratio_odirect >= TARGET_ODIRECT else "MISS",
                    )
                )  # fmt: skip
        if not cold:
            out.append(
                dict(size_mib=size, what="lmdb cold_get", ratio=None, need=None, result=NO_COLD)
            )
    return out

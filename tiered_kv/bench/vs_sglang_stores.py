"""The storage part of the side-by-side benchmark: our disk store in both layouts against SGLang's
``HiCacheFile`` on the same pages in the same process, and cold gets against the best raw read.

For each page size the same random pages (``storage.make_case``) go, in every round, through
each arm: ``slab`` and ``lmdb`` (our store in each layout, default options, a fresh directory),
``hicache`` (``sglang_peer.SGLangFileStore``, where SGLang is importable) and, with cold gets,
``raw`` (``raw_read``: the same bytes in one file, read back cold whole-page buffered, in 256 KiB
chunks and with ``O_DIRECT``). A store arm times ``set`` (every page once, in batches), then, after
an untimed ``sync``, ``warm_get``, then closes the store, drops the page cache, reopens it and
times ``cold_get`` (``storage.kv_store_times``; every get is checked against the source). Rounds
alternate the arms and rotate which goes first. Rows are medians over rounds; ``set`` and
``warm_get`` are graded over ``hicache``'s median of the same op, ``cold_get`` over the fastest
raw read's median (the fastest of the three in that run). The load average is recorded after
each size.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiered_kv.bench import machine
from tiered_kv.bench.disk import drop_page_cache
from tiered_kv.bench.raw_read import RAW_OPS, raw_read_times
from tiered_kv.bench.storage import LMDB_DEFAULTS, kv_store_times, make_case
from tiered_kv.bench.timing import gbps, interleave, median

OURS = ("slab", "lmdb")
STORE_OPS = ("set", "warm_get", "cold_get")
TARGETS = {"set": 1.0, "warm_get": 1.0, "cold_get": 0.8}  # over hicache, hicache, best raw


@dataclass
class StoreRow:
    size_mib: float
    store: str  # slab, lmdb, hicache, raw
    op: str  # set, warm_get, cold_get, or a raw read (raw_read.RAW_OPS)
    pages: int
    nbytes: int
    gbps: float
    ratio: float | None  # over the baseline (hicache for set / warm_get, best raw for cold_get)
    baseline: str | None
    repeats: int
    load: tuple[float, float, float] | None  # after this size's rounds
    samples_s: list[float] = field(default_factory=list)


def measure_stores(
    sizes: Sequence[float],
    total_mib: float,
    *,
    workdir: str,
    batch: int,
    repeats: int,
    seed: int,
    cold: bool,
    hicache: bool,
    drop: Callable[[], bool] = drop_page_cache,
    progress: Callable[[str], None] = lambda _line: None,
) -> list[StoreRow]:
    """Every size, every arm, ``repeats`` alternating rounds; ratios filled in."""
    kinds = OURS + (("hicache",) if hicache else ())
    rows: list[StoreRow] = []
    for size in sizes:
        case = make_case(size, total_mib, seed)

        def store_arm(kind: str, case=case) -> Callable[[object], dict]:
            opts = LMDB_DEFAULTS
            return lambda _: kv_store_times(case, kind, workdir, batch, opts, False, cold, drop)

        arms = {kind: store_arm(kind) for kind in kinds}
        if cold:
            arms["raw"] = lambda _, case=case: raw_read_times(case, workdir, drop)
        got = interleave(
            arms,
            repeats,
            rotate=True,
            after_round=lambda i, size=size: progress(f"done size={size:g} MiB round {i + 1}"),
        )
        load = machine.load_average()
        nbytes = case.n * case.page_nbytes
        for store, samples in got.items():
            ops = RAW_OPS if store == "raw" else STORE_OPS
            for op in ops:
                secs = [t[op][0] for t in samples if op in t]
                if secs:
                    rows.append(
                        StoreRow(size, store, op, case.n, nbytes, gbps(nbytes, median(secs)),
                                 None, None, len(secs), load, secs)
                    )  # fmt: skip
        del case
        gc.collect()
    add_ratios(rows)
    return rows


def add_ratios(rows: list[StoreRow]) -> None:
    """``set`` / ``warm_get`` over ``hicache``'s row, ``cold_get`` over the fastest raw read."""
    by = {(r.size_mib, r.store, r.op): r for r in rows}
    for r in rows:
        if r.store == "raw":
            continue
        if r.op == "cold_get":
            raws = [x for x in rows if x.size_mib == r.size_mib and x.store == "raw"]
            best = max(raws, key=lambda x: x.gbps, default=None)
            if best is not None:
                r.ratio, r.baseline = r.gbps / best.gbps, f"raw {best.op}"
        elif r.store != "hicache":
            ref = by.get((r.size_mib, "hicache", r.op))
            if ref is not None:
                r.ratio, r.baseline = r.gbps / ref.gbps, "hicache"


def grade(rows: list[StoreRow]) -> list[dict]:
    """PASS / MISS for each of our rows with a baseline: ``TARGETS``."""
    out = []
    for r in rows:
        if r.store in OURS and r.ratio is not None:
            need = TARGETS[r.op]
            out.append(
                dict(size_mib=r.size_mib, store=r.store, op=r.op, ratio=r.ratio, need=need,
                     baseline=r.baseline, result="PASS" if r.ratio >= need else "MISS")
            )  # fmt: skip
    return out

"""The remote stores against their own raw clients: set / get GB/s of ``RedisStorage`` and
``MooncakeStorage`` next to the same bytes through redis-py and ``MooncakeDistributedStore``.

A ``Pair`` is one backend's two arms on one server: ``ours`` (the store: header, checksum,
verification, counters) and ``raw`` (the client's plainest batch calls on the page bytes alone:
for Redis a non-transactional pipeline of ``SET`` from a view of each page and one ``MGET``
copied into the pages; for Mooncake ``batch_put_from`` / ``batch_get_into`` between the same
registered pages and the store). ``measure_pair`` alternates the arms round by round
(``timing.interleave``, rotated, one warm-up round dropped); in each round an arm sets every
page (timed, batch by batch), gets every page into other pages (timed), is checked outside the
clock (every call served, bytes equal) and empties the server. GB/s is 1e9 bytes of page payload
per second of the median round; ``ratio`` is ours over raw in the same run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tiered_kv.bench.page_stores import BenchPages
from tiered_kv.bench.timing import gbps, interleave, median, timed
from tiered_kv.bench.verify import fail
from tiered_kv.storage import StorageNamespace
from tiered_kv.storage.contract import PageStorage

MIB = 1 << 20
TARGET_RAW = 0.9  # ours >= 0.9x the raw client, per backend, size and op
OPS = ("set", "get")


@dataclass
class Row:
    backend: str
    size_mib: float
    op: str
    pages: int
    nbytes: int
    gbps: float
    raw_gbps: float
    ratio: float
    samples_s: list[float] = field(default_factory=list)
    raw_samples_s: list[float] = field(default_factory=list)


@dataclass
class Pair:
    """One backend's two arms over ``pages`` (sources ``0..n-1``, gets into ``n..2n-1``).

    ``ours``: a store of the pages' size; ``raw_set(names, src_pages)`` /
    ``raw_get(names, dst_pages) -> bool per name`` the raw client's calls; ``clear`` empties the
    server; ``close`` releases both."""

    backend: str
    pages: BenchPages
    ours: PageStorage
    raw_set: Callable[[list[str], list[int]], None]
    raw_get: Callable[[list[str], list[int]], list[bool]]
    clear: Callable[[], None]
    close: Callable[[], None]


def bench_namespace(page_nbytes: int) -> StorageNamespace:
    return StorageNamespace.create(
        model="bench-remote@1",
        kind="bytes",
        parts=[("raw", [page_nbytes])],
        dtype="uint8",
        layer_ids=[0],
        page_size=1,
        layout="page_first",
    )


def bench_keys(ns: StorageNamespace, n: int) -> list[bytes]:
    rng = np.random.default_rng(17)
    return [ns.fingerprint + rng.bytes(32) for _ in range(n)]


def _check(pages: BenchPages, n: int, served: Sequence[bool], where: str) -> None:
    if not all(served):
        fail(where, f"{served.count(False)} of {len(served)} gets not served")
    if not np.array_equal(pages.array[n : 2 * n], pages.array[:n]):
        bad = [i for i in range(n) if not np.array_equal(pages.array[n + i], pages.array[i])]
        fail(where, f"pages {bad[:8]} read back differ from what was written")


def _scramble(pages: BenchPages, n: int, round_: int) -> None:
    """Fresh bytes in the destination pages, so a get that writes nothing cannot pass."""
    rng = np.random.default_rng(1000 + round_)
    pages.array[n : 2 * n] = rng.integers(0, 256, pages.array[n : 2 * n].shape, dtype=np.uint8)


def _arm(pair: Pair, n: int, batches, set_batch, get_batch, where: str):
    """One arm's round: set every batch (timed), get every batch (timed), check, empty."""
    pages = pair.pages

    def run(round_: int) -> dict[str, float]:
        _scramble(pages, n, round_)
        t_set = timed(lambda: [set_batch(b) for b in batches])
        served: list[bool] = []
        t_get = timed(lambda: [served.extend(get_batch(b)) for b in batches])
        _check(pages, n, served, f"{where}, round {round_}")
        pair.clear()
        return {"set": t_set, "get": t_get}

    return run


def measure_pair(pair: Pair, n: int, batch: int, repeats: int, warmup: int = 1) -> list[Row]:
    """Rows for ``set`` and ``get`` of ``n`` pages in batches of ``batch``: ours and raw."""
    pages, ours = pair.pages, pair.ours
    keys = bench_keys(ours.namespace, n)
    names = [f"raw:{i}" for i in range(n)]
    batches = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
    arms = {
        "ours": _arm(
            pair,
            n,
            batches,
            lambda b: ours.batch_set([keys[i] for i in b], pages, b),
            lambda b: ours.batch_get([keys[i] for i in b], pages, [n + i for i in b]),
            f"{pair.backend} store",
        ),
        "raw": _arm(
            pair,
            n,
            batches,
            lambda b: pair.raw_set([names[i] for i in b], b),
            lambda b: pair.raw_get([names[i] for i in b], [n + i for i in b]),
            f"{pair.backend} raw client",
        ),
    }
    pair.clear()
    out = interleave(arms, repeats, setup=lambda i: i, warmup=warmup, rotate=True)
    nbytes = n * pages.page_nbytes
    rows = []
    for op in OPS:
        mine = [r[op] for r in out["ours"]]
        raw = [r[op] for r in out["raw"]]
        g, rg = gbps(nbytes, median(mine)), gbps(nbytes, median(raw))
        rows.append(
            Row(pair.backend, pages.page_nbytes / MIB, op, n, nbytes, g, rg, g / rg, mine, raw)
        )
    return rows


def targets(rows: Sequence[Row]) -> list[dict]:
    """One entry per row: ratio vs the raw client against TARGET_RAW."""
    return [
        {
            "what": f"{r.backend} {r.op} vs raw client",
            "size_mib": r.size_mib,
            "ratio": r.ratio,
            "need": TARGET_RAW,
            "result": "PASS" if r.ratio >= TARGET_RAW else "MISS",
        }
        for r in rows
    ]

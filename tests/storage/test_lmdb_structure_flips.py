"""Flipped bits in LMDB's own structure: a store of thousands of small pages (its page and
header trees three levels deep, its LRU tree and LMDB's free list two, the free list with
hundreds of records) is closed, bits are flipped anywhere, in branch pages, meta pages, leaf
node headers, the named-database records or the free list, and the reopened store is used with
every call. Each corrupted copy runs in a forked child of one runner process (imported once):
it must exit 0 (no signal, no exception escaping a store call, no hang), serve no page whose
bytes differ from what was written, and either refuse to open (``StorageOpenError``) or serve
(misses are fine), and keep serving when reopened after its writes.

Outside pytest, run many seeds and print the counts and every failure (``--unchecked``: what
LMDB does without the store's structure check):
``python -m tests.storage.test_lmdb_structure_flips --seeds 0:500 --modes any,branch``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from tests.storage._util import ByteSource, byte_namespace, fill_for_keys, raw_key
from tiered_kv.errors import StorageOpenError
from tiered_kv.storage import LMDBStorage, lmdb_check

ROOT = Path(__file__).resolve().parents[2]
PSIZE = 4096
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA, F_SUBDATA = 0x01, 0x02
_PAGE = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (PAGEHDRSZ = 16)
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize (NODESIZE = 8)
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META_DBS, _META_LAST, _META_TXNID = 40, 136, 144  # offsets in a meta page (after its header)
MODES = ("any", "branch", "meta", "nodes", "records", "freelist")
PAGE_NBYTES, ENTRIES, BUDGET = 192, 3000, 64 << 20


class Layout(NamedTuple):
    """Where LMDB's structure lies in a data file, found by walking its trees from the newest
    meta page (LMDB 0.9's format, 64-bit): byte ranges to aim flips at, per kind."""

    used: int  # bytes up to the last page in use
    branch: list[tuple[int, int]]  # (offset, length) of each live branch page's used bytes
    nodes: list[tuple[int, int]]  # each leaf node's header and its pointer in the page
    records: list[tuple[int, int]]  # the main database's nodes naming the store's databases
    freelist: list[tuple[int, int]]  # FREE_DBI's pages
    depth: dict[str, int]  # tree depth per database
    entries: dict[str, int]
    marks: dict[str, int]  # offsets of the first of each kind of field (for TARGETS)


def _used_parts(image: bytes, pgno: int) -> list[tuple[int, int]]:
    base = pgno * PSIZE
    _, _, _, lower, upper = _PAGE.unpack_from(image, base)
    return [(base, lower), (base + upper, PSIZE - upper)]


def layout(image: bytes) -> Layout:
    txnid = [struct.unpack_from("<Q", image, p * PSIZE + _META_TXNID)[0] for p in (0, 1)]
    meta = PSIZE if txnid[1] > txnid[0] else 0
    last = struct.unpack_from("<Q", image, meta + _META_LAST)[0]
    out = Layout((last + 1) * PSIZE, [], [], [], [], {}, {}, {"meta": meta, "meta 0": 0})

    def walk(name: str, db: tuple) -> None:
        out.depth[name], out.entries[name] = db[2], db[6]
        if db[7] == 2**64 - 1:
            return  # an empty database
        stack = [db[7]]
        while stack:
            pgno = stack.pop()
            base = pgno * PSIZE
            _, _, flags, lower, _ = _PAGE.unpack_from(image, base)
            ptrs = struct.unpack_from(f"<{(lower - 16) // 2}H", image, base + 16)
            kind = "branch" if flags & P_BRANCH else "leaf"
            out.marks.setdefault(f"{name} {kind} page", base)
            out.marks.setdefault(f"{name} {kind} node", base + ptrs[0])
            if name == "free":
                out.freelist.extend(_used_parts(image, pgno))
            elif flags & P_BRANCH:
                out.branch.extend(_used_parts(image, pgno))
            for i, ptr in enumerate(ptrs):
                lo, hi, nflags, ksize = _NODE.unpack_from(image, base + ptr)
                if flags & P_BRANCH:
                    stack.append(lo | hi << 16 | nflags << 32)
                    continue
                out.nodes.extend([(base + ptr, 8), (base + 16 + 2 * i, 2)])
                data = base + ptr + 8 + ksize
                if name == "free" and not nflags & F_BIGDATA:
                    out.marks.setdefault("free record", data)
                if name == "main" and nflags & F_SUBDATA:
                    out.records.extend([(base + ptr, 8 + ksize + _DB.size)])
                    key = image[base + ptr + 8 : data].decode()
                    out.marks[f"{key} record"] = data
                    walk(key, _DB.unpack_from(image, data))

    walk("free", _DB.unpack_from(image, meta + _META_DBS))
    walk("main", _DB.unpack_from(image, meta + _META_DBS + _DB.size))
    return out


# Single flips in each kind of LMDB structure, each refused at open: (mark, offset, bit).
# Without the check LMDB served most with misses (a reversed main database: none of the store's
# databases found, new ones created) and crashed on some (the free-list depth, SIGSEGV, with an
# earlier build of this store).
TARGETS = {
    "meta: free-list depth + 2048": ("meta", _META_DBS + 7, 3),
    "meta: last page + 2**32": ("meta", _META_LAST + 4, 0),
    "meta: root of the main database": ("meta", _META_DBS + _DB.size + 40, 0),
    "meta: main database reversed": ("meta", _META_DBS + _DB.size + 4, 1),
    "meta page 0: page size": ("meta 0", _META_DBS + 2, 3),
    "branch page: one key more or less": ("pages branch page", 12, 1),
    "branch node: child page number": ("pages branch node", 0, 0),
    "leaf node: key size": ("headers leaf node", 6, 1),
    "leaf node: data size": ("pages leaf node", 0, 1),
    "record: root of 'pages'": ("pages record", 40, 0),
    "record: depth of 'lru'": ("lru record", 7, 3),
    "free-list branch node: child page number": ("free branch node", 0, 1),
    "free-list leaf: node pointer + 1": ("free leaf page", 16, 0),
    "free-list record: a page number + 16": ("free record", 8 * 3, 4),
    "free-list record: count": ("free record", 0, 4),
}
# Corrupted copies (mode, seed) that killed the process without the check (``--unchecked``,
# LMDB 0.9.36 in py-lmdb 3.0, this build): SIGABRT from LMDB's assertions (``IS_LEAF(mp)`` in
# mdb_cursor_next, ``IS_BRANCH`` in mdb_cursor_sibling, ``pglast <= env->me_pglast`` in
# mdb_freelist_save) and one SIGSEGV (freelist 93).
CRASHED = [("branch", 27), ("branch", 45), ("nodes", 71), ("freelist", 20), ("freelist", 41)]
CRASHED += [("freelist", 80), ("freelist", 93), ("freelist", 98)]


def flip(image: bytes, where: Layout, mode: str, rng: random.Random) -> tuple[bytes, list]:
    """``image`` with 1-3 bits flipped where ``mode`` aims (a name in ``TARGETS``: that one
    bit); returns it and [(offset, bit)]."""
    if mode in TARGETS:
        mark, delta, bit = TARGETS[mode]
        flips = [(where.marks[mark] + delta, bit)]
    else:
        if mode == "any":
            spans = [(0, where.used)]
        elif mode == "meta":
            spans = [(p * PSIZE, _META_TXNID + 8) for p in (0, 1)]
        else:
            spans = getattr(where, mode)
        flips = []
        for _ in range(rng.randint(1, 3)):
            start, length = rng.choice(spans)
            flips.append((start + rng.randrange(length), rng.randrange(8)))
    out = bytearray(image)
    for offset, bit in flips:
        out[offset] ^= 1 << bit
    return bytes(out), flips


# -- the store and the calls ------------------------------------------------------------------
def _keys(page_nbytes: int, indices) -> list[bytes]:
    ns = byte_namespace(page_nbytes)
    return [raw_key(ns, f"page {i}") for i in indices]


def _open(path: Path, page_nbytes: int) -> LMDBStorage:
    ns = byte_namespace(page_nbytes)
    return LMDBStorage(path, ns, page_nbytes, budget_bytes=BUDGET, io_threads=2)


def build(path: Path, page_nbytes: int, entries: int) -> list[int]:
    """A closed store of ``entries`` pages, with deletes and re-stores between batches (so
    LMDB's free list has records and reuses pages); returns the indices still stored."""
    store, batch = _open(path, page_nbytes), 250
    src = ByteSource(page_nbytes, batch)
    present: set[int] = set()

    def put(indices: list[int]) -> None:
        keys = _keys(page_nbytes, indices)
        fill_for_keys(src, keys, range(len(keys)))
        assert all(store.batch_set(keys, src, list(range(len(keys)))))
        present.update(indices)

    def drop(indices: list[int]) -> None:
        store.delete(_keys(page_nbytes, indices))
        present.difference_update(indices)

    for lo in range(0, entries, batch):
        put(list(range(lo, min(entries, lo + batch))))
        if lo % (4 * batch) == 0:
            drop(list(range(lo, lo + batch, 3)))
    drop(list(range(1, entries, 5)))
    put(list(range(0, entries, 7))[:batch])
    # A reader pins its snapshot, so the pages each delete frees stay on the free list (one
    # record per transaction): the free list grows a branch page.
    pinned = store._env.begin()
    for i in range(2, entries, 11):
        drop([i])
    pinned.abort()
    store.close()
    return sorted(present)


def exercise(path: Path, page_nbytes: int, entries: int, present: list[int]) -> dict:
    """Every store call on the (corrupted) store at ``path``, twice (reopening it), then clear;
    counts hits, misses among the pages that were stored, and pages served with wrong bytes."""
    keys, stored = _keys(page_nbytes, range(entries)), set(present)
    out: Counter = Counter()
    src = ByteSource(page_nbytes, 500)

    def check_reads(store: LMDBStorage, lo: int, hi: int, count: bool) -> None:
        expect = ByteSource(page_nbytes, hi - lo)
        fill_for_keys(expect, keys[lo:hi], range(hi - lo))
        got = store.batch_get(keys[lo:hi], src, list(range(hi - lo)))
        for i, ok in enumerate(got):
            if ok and not np.array_equal(src.buf[i].numpy(), expect.buf[i].numpy()):
                out["wrong"] += 1
            if count and lo + i in stored:
                out["hits" if ok else "misses"] += 1

    for round in range(2):
        try:
            store = _open(path, page_nbytes)
        except StorageOpenError:
            out["refused" if round == 0 else "refused after serving"] += 1
            return dict(out)
        for lo in range(0, entries, 500):
            store.batch_exists(keys[lo : lo + 500])
            check_reads(store, lo, min(entries, lo + 500), count=round == 0)
        new = _keys(page_nbytes, range(entries + 600 * round, entries + 600 * round + 500))
        fill_for_keys(src, new, range(500))
        store.batch_set(new, src, list(range(500)))  # splits and allocations from the free list
        store.delete(keys[round::9])
        store.stats()
        check_reads(store, 0, 500, count=False)
        store.flush()
        store.close()
    store = _open(path, page_nbytes)
    store.clear()
    store.stats()
    store.close()
    return dict(out)


def _in_child(fn, timeout_s: float = 60.0) -> tuple[str, object]:
    """``fn()`` in a forked child: ("ok", its JSON result), ("exception", text), ("signal",
    name) or ("hang", None). The runner itself never runs a torch op: a child forked after one
    could hang in the parent's OpenMP pool."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        # A store that reserved a map of any size would fill the disk: cap files at 1 GiB
        # (reserving more fails with EFBIG, which the store treats as no room).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, resource.RLIM_INFINITY))
        code = 0
        try:
            result = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result, code = {"exception": f"{type(exc).__name__}: {exc}"[:500]}, 3
        with os.fdopen(write_end, "wb") as f:
            f.write(json.dumps(result).encode())
        os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    while not (status := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return "hang", None
        time.sleep(0.005)
    with os.fdopen(read_end, "rb") as f:
        raw = f.read()
    if os.WIFSIGNALED(status[1]):
        return "signal", signal.Signals(os.WTERMSIG(status[1])).name
    result = json.loads(raw or b'{"exception": "exited without a report"}')
    return ("ok", result["ok"]) if "ok" in result else ("exception", result["exception"])


def _run_one(image: bytes, mode: str, seed: int, args: argparse.Namespace, present, work: Path):
    """Flip and exercise in a forked child; (outcome, detail, flips)."""
    flipped, flips = flip(image, layout(image), mode, random.Random(seed))
    case = work / f"case-{sorted(TARGETS).index(mode) if mode in TARGETS else mode}-{seed}"
    case.mkdir()
    (case / "data.mdb").write_bytes(flipped)

    def run() -> dict:
        if args.unchecked:  # what LMDB does on its own, for comparison
            lmdb_check.check_file = lmdb_check.check_snapshot = lambda *_: None
        return exercise(case, args.page_nbytes, args.entries, present)

    how, result = _in_child(run)
    grown = (case / "data.mdb").stat().st_size
    shutil.rmtree(case, ignore_errors=True)
    if grown > BUDGET:
        return "oversized", f"data.mdb grew to {grown} bytes", flips
    if how != "ok":
        return how, result or "", flips
    if result.get("wrong") or result.get("refused after serving"):
        return (
            "wrong" if result.get("wrong") else "refused after serving",
            json.dumps(result),
            flips,
        )
    if result.get("refused"):
        return "refused", "", flips
    return ("served" if result.get("misses", 0) == 0 else "served with misses"), "", flips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:50", help="a range lo:hi")
    parser.add_argument("--modes", default=",".join(MODES), help="and/or targets, crashed")
    parser.add_argument("--page-nbytes", type=int, default=PAGE_NBYTES)
    parser.add_argument("--entries", type=int, default=ENTRIES)
    parser.add_argument("--json", action="store_true", help="one JSON summary on stdout")
    parser.add_argument("--unchecked", action="store_true", help="skip the store's checks")
    args = parser.parse_args(argv)
    lo, hi = (int(x) for x in args.seeds.split(":"))
    with tempfile.TemporaryDirectory(prefix="lmdb-flips-") as tmp:
        work = Path(tmp)
        base = work / "base"
        how, present = _in_child(lambda: build(base, args.page_nbytes, args.entries))
        assert how == "ok", f"building the store failed: {how} {present}"
        image = (base / "data.mdb").read_bytes()
        image = image[: layout(image).used]
        where = layout(image)
        counts: Counter = Counter()
        per_mode: dict[str, Counter] = {}
        failures = []
        modes = args.modes.split(",")
        cases = [(m, m, s) for m in modes if m in MODES for s in range(lo, hi)]
        cases += [(name, name, 0) for name in TARGETS if "targets" in modes]
        cases += [(f"{m} {s}", m, s) for m, s in CRASHED if "crashed" in modes]
        for label, mode, seed in cases:
            outcome, detail, flips = _run_one(image, mode, seed, args, present, work)
            counts[outcome] += 1
            per_mode.setdefault(label, Counter())[outcome] += 1
            if outcome not in ("refused", "served", "served with misses"):
                failures.append(
                    dict(mode=mode, seed=seed, outcome=outcome, detail=detail, flips=flips)
                )
                if not args.json:
                    print(f"FAIL {mode} seed {seed}: {outcome} {detail} flips {flips}")
    summary = dict(
        depth=where.depth,
        entries=where.entries,
        counts=dict(counts),
        per_mode={mode: dict(c) for mode, c in per_mode.items()},
        failures=failures,
    )
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))
    return 1 if failures else 0


# -- pytest ---------------------------------------------------------------------------------------
def _flip_run(*args: str, timeout: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.storage.test_lmdb_structure_flips", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_run() -> dict:
    """Three seeds of every mode, ``TARGETS`` and ``CRASHED``, in one runner (~20 s, 2 cores)."""
    modes = ",".join([*MODES, "targets", "crashed"])
    return _flip_run("--seeds", "0:3", "--modes", modes, timeout=300)


def test_flips_in_lmdb_structure_never_crash_or_serve_wrong_bytes(default_run):
    summary = default_run
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)
    # The store reaches what the test is about: multi-level trees and a free list.
    assert min(summary["depth"][db] for db in ("pages", "headers", "lru")) >= 2, summary
    assert summary["depth"]["pages"] >= 3 and summary["depth"]["free"] >= 2, summary


def test_single_flips_in_each_kind_of_structure_are_refused_at_open(default_run):
    outcomes = {mode: "/".join(default_run["per_mode"][mode]) for mode in TARGETS}
    assert outcomes == dict.fromkeys(TARGETS, "refused"), outcomes


def test_copies_that_crashed_lmdb_are_refused_at_open(default_run):
    outcomes = {f"{m} {s}": "/".join(default_run["per_mode"][f"{m} {s}"]) for m, s in CRASHED}
    assert outcomes == {f"{m} {s}": "refused" for m, s in CRASHED}, outcomes


@pytest.mark.slow
def test_many_flips_in_lmdb_structure():
    summary = _flip_run("--seeds", "3:13", timeout=600)
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)


if __name__ == "__main__":
    sys.exit(main())

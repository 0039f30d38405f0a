"""Benchmark of the storage tier: LMDBStorage against a file-per-page store and raw O_DIRECT I/O.

What is measured: for every value size (``--sizes``, MiB; about ``--total-mib`` of pages per
size), the same pages (random bytes, keys from ``storage.keys.page_keys``) go through three
stores in the same run, in this order within each repeat:

- ``lmdb``: ``LMDBStorage`` with default options (``--fsync``: ``durable=True``), a fresh store
  directory per repeat, budget twice the bytes written, ``batch_set`` / ``batch_get`` of
  ``--batch`` pages per call;
- ``files``: one file per page named by the key's hex, the way a widely used serving engine's
  file backend works: ``set`` skips a key whose file exists, writes a temporary file in the same
  directory and ``os.replace``-s it into place (``--fsync``: fsync before the rename); ``get``
  opens the file and ``readinto``-s the host page. No checksum (LMDB verifies one on every get);
- ``odirect``: one file written sequentially with ``O_DIRECT`` from a page-aligned buffer in
  chunks of the value size and read back the same way: the physical limit of the disk. If the
  filesystem refuses ``O_DIRECT`` (EINVAL), buffered I/O with fsync and
  ``posix_fadvise(DONTNEED)`` stands in, and the output says so.

Operations: ``set`` (every page once, into an empty store; without ``--fsync`` this is a write
into the page cache for ``lmdb`` and ``files``, so it can beat the O_DIRECT write),
``full_set`` (the same pages into a store already full of as many other pages, with a budget
that holds about that many: every page written evicts an old one, the steady state of a cache;
``files`` then unlinks its oldest file before each new one, ``lmdb`` evicts by its own LRU and
reuses the freed pages; the gets after it are verified too), ``warm_get``
(right after the set and an untimed ``sync``: the bytes are in the page cache) and ``cold_get``
(after closing the store, ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``, then reopening
it; an LMDB environment is closed first because the kernel does not drop page-cache pages that
a process still maps). Without permission to drop the page cache the output says ``cold get
not measured: cannot drop page cache`` and there are no ``cold_get`` rows. ``odirect`` has
``set`` and ``cold_get`` only (O_DIRECT always reads the disk).

``time.perf_counter`` is read around the whole loop over pages (or batches), with the garbage
collector off; GB/s is 1e9 bytes per second of page payload; MiB is 2**20 bytes. Medians over
``--repeats`` repeats. ``ratio_files`` is a row's GB/s over the ``files`` row of the same size
and op, ``ratio_odirect`` over the ``odirect`` row (set, cold_get). Every get is checked
outside the timing: each call returned True for every key and the host pages equal the written
bytes, byte for byte. A mismatch aborts the run.

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
import errno
import gc
import json
import mmap
import os
import platform as py_platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

import lmdb
import numpy as np
import psutil
import torch

from tiered_kv.storage import LMDBStorage, StorageNamespace, page_keys
from tiered_kv.storage.lmdb_env import record_cost

MIB = 1 << 20
GIB = 1 << 30
ALIGN = 4096
STORES = ("lmdb", "files", "odirect")
OPS = ("set", "full_set", "warm_get", "cold_get")
TARGET_OPS = ("set", "warm_get", "cold_get")
QUICK = {"total_mib": 64, "repeats": 1}
TARGET_FILES = 1.0
TARGET_ODIRECT = 0.6
DROP_CACHES = "/proc/sys/vm/drop_caches"
NO_COLD = "cold get not measured: cannot drop page cache"
LMDB_DEFAULTS = {"durable": False, "readahead": True, "writemap": True, "hugepages": False}


# -- the page source -------------------------------------------------------------------------
class BenchPages:
    """``n`` pages of ``page_nbytes`` in one uint8 tensor; satisfies ``PageSource``
    (``page_nbytes``, ``num_pages``, ``get_page_bytes`` a view, ``set_page_bytes`` a copy)."""

    # get_page_bytes returns a writable view (as a page_first host pool does), so a store may
    # copy into it directly.
    page_bytes_zero_copy = True

    def __init__(self, n: int, page_nbytes: int, fill_seed: int | None = None) -> None:
        self._nbytes = page_nbytes
        if fill_seed is None:
            self.tensor = torch.zeros((n, page_nbytes), dtype=torch.uint8)
        else:
            rng = np.random.default_rng(fill_seed)
            self.tensor = torch.from_numpy(rng.integers(0, 256, (n, page_nbytes), dtype=np.uint8))
        self.array = self.tensor.numpy()

    @property
    def page_nbytes(self) -> int:
        return self._nbytes

    @property
    def num_pages(self) -> int:
        return self.array.shape[0]

    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.tensor[page]

    def page_bytes_rows(self) -> np.ndarray:
        """All pages as one numpy view (what a page_first host pool offers; the file store
        indexes the same array)."""
        return self.array

    def set_page_bytes(self, page: int, data: object) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self._nbytes:
            raise ValueError(f"page {page}: {src.size} bytes, expected {self._nbytes}")
        self.array[page] = src

    def zero(self) -> None:
        self.array.fill(0)


# -- the stores under test -------------------------------------------------------------------
class FileStore:
    """One file per page (temporary file + rename on set, ``readinto`` on get)."""

    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync
        os.makedirs(path, exist_ok=True)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + ".bin")

    def batch_set(self, keys: Sequence[bytes], source: BenchPages, pages: Sequence[int]):
        out = []
        for key, page in zip(keys, pages, strict=True):
            final = self._file(key)
            if os.path.exists(final):
                out.append(True)
                continue
            tmp = final + ".tmp"
            with open(tmp, "wb", buffering=0) as f:
                view = memoryview(source.array[page])
                n = f.write(view)
                while n < len(view):
                    n += f.write(view[n:])
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            out.append(True)
        return out

    def batch_get(self, keys: Sequence[bytes], source: BenchPages, pages: Sequence[int]):
        out = []
        for key, page in zip(keys, pages, strict=True):
            try:
                with open(self._file(key), "rb", buffering=0) as f:
                    out.append(f.readinto(memoryview(source.array[page])) == source.page_nbytes)
            except FileNotFoundError:
                out.append(False)
        return out


class EvictingFileStore(FileStore):
    """The file store with a capacity in pages: before each new file it unlinks the oldest one
    (first in, first out: the benchmark never reads while it writes)."""

    def __init__(self, path: str, fsync: bool, capacity: int) -> None:
        super().__init__(path, fsync)
        self.capacity = capacity
        self.order: list[bytes] = []

    def batch_set(self, keys: Sequence[bytes], source: BenchPages, pages: Sequence[int]):
        for key in keys:
            if len(self.order) >= self.capacity:
                os.unlink(self._file(self.order.pop(0)))
            self.order.append(key)
        return super().batch_set(keys, source, pages)


class AlignedBuffer:
    """A page-aligned anonymous mapping (what O_DIRECT needs), as a numpy array."""

    def __init__(self, nbytes: int) -> None:
        # private: not counted as page cache (shmem) in /proc/meminfo
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.view = memoryview(self.map)

    def close(self) -> None:
        del self.array
        self.view.release()
        self.map.close()


# -- machine ---------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """``sync`` and drop the page cache; False when this process may not."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cached_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def mount_of(path: str) -> tuple[str, str, str, str]:
    """(device, mount point, fs type, options) of the mount holding ``path``."""
    path = os.path.realpath(path)
    best = ("?", "/", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype, opts)
    except OSError:
        pass
    return best


def disk_of(path: str) -> str:
    st = os.stat(path)
    sysdir = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        real = os.path.realpath(sysdir)
        if not os.path.exists(os.path.join(real, "queue")):  # a partition: its disk has queue/
            real = os.path.dirname(real)

        def read(name: str) -> str:
            try:
                with open(os.path.join(real, name)) as f:
                    return f.read().strip()
            except OSError:
                return "?"

        rot = read("queue/rotational")
        kind = f"rotational flag {rot}"
        return (
            f"{os.path.basename(real)} ({kind}, read_ahead_kb {read('queue/read_ahead_kb')}, "
            f"scheduler {read('queue/scheduler')}, model {read('device/model') or '?'})"
        )
    except OSError:
        return "unknown"


def machine_conditions(workdir: str, can_drop: bool) -> list[str]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    mem = psutil.virtual_memory()
    dev, mnt, fstype, opts = mount_of(workdir)
    du = shutil.disk_usage(workdir)
    return [
        f"python {py_platform.python_version()} on {py_platform.platform()}",
        f"lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), torch "
        f"{torch.__version__}, numpy {np.__version__}",
        f"cpu count {os.cpu_count()} (usable {affinity})",
        "load average " + (" ".join(f"{v:.2f}" for v in load) if load else "unavailable"),
        f"RAM total {mem.total / GIB:.1f} GiB, available {mem.available / GIB:.1f} GiB",
        f"work dir {workdir}: {fstype} on {dev} mounted at {mnt} ({opts}); "
        f"free {du.free / GIB:.0f} GiB of {du.total / GIB:.0f} GiB",
        f"disk {disk_of(workdir)}",
        f"uid {os.geteuid()}; page cache drop ({DROP_CACHES}): "
        + ("yes" if can_drop else f"NO -- {NO_COLD}"),
    ]


# -- results ---------------------------------------------------------------------------------
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


@dataclass
class Report:
    rows: list[Row]
    study: list[Row]
    targets: list[dict]
    conditions: list[str]
    cold_get_measured: bool
    notes: list[str]


def fail(where: str, what: str) -> NoReturn:
    raise SystemExit(f"CORRECTNESS FAILURE [{where}]: {what}")


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


# -- one store, one repeat -------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


@dataclass
class Case:
    """The pages of one size: keys, source bytes, the host pages gets fill."""

    size_mib: float
    page_nbytes: int
    keys: list[bytes]
    src: BenchPages
    dst: BenchPages
    namespace: StorageNamespace

    @property
    def n(self) -> int:
        return len(self.keys)


def make_case(size_mib: float, total_mib: float, seed: int) -> Case:
    page_nbytes = round(size_mib * MIB)
    n = max(1, int(total_mib * MIB) // page_nbytes)
    ns = StorageNamespace.create(
        kind="bench",
        parts=[("kv", (page_nbytes,))],
        dtype="uint8",
        layer_ids=[0],
        page_size=1,
        layout="page_first",
    )
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    keys = [bytes(k) for k in page_keys(ns, tokens, 1)]
    return Case(
        size_mib,
        page_nbytes,
        keys,
        BenchPages(n, page_nbytes, seed + 1),
        BenchPages(n, page_nbytes),
        ns,
    )


def run_batches(fn, case: Case, source: BenchPages, batch: int) -> list[bool]:
    out: list[bool] = []
    for i in range(0, case.n, batch):
        out.extend(fn(case.keys[i : i + batch], source, range(i, min(i + batch, case.n))))
    return out


def check_get(case: Case, ok: list[bool], where: str) -> None:
    if len(ok) != case.n or not all(ok):
        fail(where, f"{ok.count(False)} of {case.n} gets returned False")
    if not np.array_equal(case.dst.array, case.src.array):
        bad = np.flatnonzero((case.dst.array != case.src.array).any(axis=1))
        fail(where, f"{bad.size} pages differ from what was written (first {bad[:5].tolist()})")


def kv_store_times(
    case: Case, kind: str, workdir: str, batch: int, opts: dict, fsync: bool, cold: bool
) -> dict[str, tuple[float, float | None]]:
    """(seconds, page cache MiB before the op) per op for one fresh lmdb or files store."""
    path = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
    budget = max(2 * case.n * (case.page_nbytes + ALIGN), 4 * (case.page_nbytes + ALIGN) + 32 * MIB)

    def open_store():
        if kind == "lmdb":
            return LMDBStorage(path, case.namespace, case.page_nbytes, budget_bytes=budget, **opts)
        return FileStore(path, fsync)

    where = f"size={case.size_mib:g} MiB store={kind} {opts or ''} batch={batch}"
    out: dict[str, tuple[float, float | None]] = {}
    store = open_store()
    try:
        ok: list[bool] = []
        # Start every store's writes with no dirty pages left by an earlier phase: writeback of
        # someone else's bytes would throttle whichever store happens to write next.
        os.sync()
        out["set"] = (
            timed(lambda: ok.extend(run_batches(store.batch_set, case, case.src, batch))),
            None,
        )
        if not all(ok):
            fail(where, f"{ok.count(False)} of {case.n} sets returned False")
        os.sync()
        case.dst.zero()
        ok = []
        out["warm_get"] = (
            timed(lambda: ok.extend(run_batches(store.batch_get, case, case.dst, batch))),
            None,
        )
        check_get(case, ok, where + " warm_get")
        if cold:
            if kind == "lmdb":
                store.close()  # a mapped page survives drop_caches: close, drop, reopen
            if not drop_page_cache():
                fail(where, "dropping the page cache worked before and failed now")
            before = cached_mib()
            store = open_store()
            case.dst.zero()
            ok = []
            out["cold_get"] = (
                timed(lambda: ok.extend(run_batches(store.batch_get, case, case.dst, batch))),
                before,
            )
            check_get(case, ok, where + " cold_get")
    finally:
        if kind == "lmdb":
            store.close()
        shutil.rmtree(path, ignore_errors=True)
    return out


def full_set_times(
    case: Case, kind: str, workdir: str, batch: int, opts: dict, fsync: bool
) -> dict[str, tuple[float, float | None]]:
    """``full_set``: fill a store to its capacity with other pages (other keys; at least
    ``case.n``), then time writing the case's pages, each of which evicts an old one; then check
    the case's pages read back. Both stores hold the same number of pages."""
    path = tempfile.mkdtemp(prefix=f"full-{kind}-", dir=workdir)
    cost = record_cost(case.page_nbytes)
    # LMDBStorage evicts down to 3/4 of its budget; it also has a minimum budget
    budget = max(-(-case.n * cost * 4 // 3) + 4 * MIB, 4 * cost + 8 * MIB)
    capacity = budget * 3 // 4 // cost
    old_keys = page_keys(case.namespace, np.arange(capacity, dtype=np.uint32), 1)
    where = f"size={case.size_mib:g} MiB store={kind} {opts or ''} batch={batch} full_set"
    if kind == "lmdb":
        store = LMDBStorage(path, case.namespace, case.page_nbytes, budget_bytes=budget, **opts)
    else:
        store = EvictingFileStore(path, fsync, capacity)
    try:
        ok: list[bool] = []
        for i in range(0, capacity, batch):
            idx = range(i, min(i + batch, capacity))
            keys = [bytes(old_keys[j]) for j in idx]
            ok += store.batch_set(keys, case.src, [j % case.n for j in idx])
        if not all(ok):
            fail(where, f"{ok.count(False)} of {capacity} fill sets returned False")
        os.sync()
        ok = []
        seconds = timed(lambda: ok.extend(run_batches(store.batch_set, case, case.src, batch)))
        if not all(ok):
            fail(where, f"{ok.count(False)} of {case.n} sets returned False")
        case.dst.zero()
        check_get(case, run_batches(store.batch_get, case, case.dst, batch), where)
    finally:
        if kind == "lmdb":
            store.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"full_set": (seconds, None)}


def odirect_times(
    case: Case, workdir: str, notes: list[str]
) -> dict[str, tuple[float, float | None]]:
    """Sequential write and read of the same bytes, O_DIRECT, in chunks of the value size."""
    fd_path = os.path.join(workdir, "odirect.bin")
    total = case.n * case.page_nbytes
    chunk = case.page_nbytes
    buf = AlignedBuffer(total)
    buf.array[:] = case.src.array.reshape(-1)
    direct = getattr(os, "O_DIRECT", 0)
    out: dict[str, tuple[float, float | None]] = {}

    def write(flags: int) -> None:
        fd = os.open(fd_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            for off in range(0, total, chunk):
                os.pwrite(fd, buf.view[off : off + chunk], off)
            if not flags:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(flags: int) -> None:
        fd = os.open(fd_path, os.O_RDONLY | flags)
        try:
            for off in range(0, total, chunk):
                if os.preadv(fd, [buf.view[off : off + chunk]], off) != chunk:
                    fail("odirect", f"short read at {off}")
        finally:
            os.close(fd)

    try:
        try:
            out["set"] = (timed(lambda: write(direct)), None)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not direct:
                raise
            note = "O_DIRECT refused (EINVAL): buffered I/O + fsync + fadvise DONTNEED instead"
            if note not in notes:
                notes.append(note)
            direct = 0
            out["set"] = (timed(lambda: write(0)), None)
        buf.array.fill(0)
        if not direct:
            fd = os.open(fd_path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        before = cached_mib()
        out["cold_get"] = (timed(lambda: read(direct)), before)
        if not np.array_equal(buf.array, case.src.array.reshape(-1)):
            fail(f"size={case.size_mib:g} MiB store=odirect", "read-back differs from written")
    finally:
        buf.close()
        os.unlink(fd_path)
    return out


# -- tables ----------------------------------------------------------------------------------
def rows_of(
    table: str, case: Case, store: str, config: str, batch: int, samples: dict[str, list]
) -> list[Row]:
    rows = []
    nbytes = case.n * case.page_nbytes
    for op in OPS:
        if op not in samples:
            continue
        secs = [s for s, _ in samples[op]]
        med = statistics.median(secs)
        rows.append(
            Row(
                table,
                case.size_mib,
                store,
                config,
                op,
                case.n,
                nbytes,
                batch,
                nbytes / med / 1e9,
                None,
                None,
                len(secs),
                True,
                secs,
                [c for _, c in samples[op] if c is not None],
            )
        )
    return rows


def add_ratios(rows: list[Row]) -> None:
    ref = {(r.size_mib, r.store, r.op): r.gbps for r in rows if r.store in ("files", "odirect")}
    for r in rows:
        f = ref.get((r.size_mib, "files", r.op))
        o = ref.get((r.size_mib, "odirect", r.op))
        r.ratio_files = r.gbps / f if f else None
        r.ratio_odirect = r.gbps / o if o and r.op != "warm_get" else None


def _ratio(v: float | None) -> str:
    return f"{v:>8.2f}" if v is not None else f"{'-':>8}"


def header(ratio: str = "vs files", ratio2: str = "vs odir") -> str:
    return (
        f"{'size_mib':>8} {'store':<8} {'config':<24} {'op':<9} {'pages':>5} {'MiB':>6} "
        f"{'GB/s':>7} {ratio:>8} {ratio2:>8} {'n':>2}"
    )


def format_row(r: Row) -> str:
    return (
        f"{r.size_mib:>8g} {r.store:<8} {r.config:<24} {r.op:<9} {r.pages:>5} "
        f"{r.nbytes / MIB:>6.0f} {r.gbps:>7.2f} {_ratio(r.ratio_files)} "
        f"{_ratio(r.ratio_odirect)} {r.repeats:>2}"
    )


def print_table(rows: list[Row], ratio: str = "vs files", ratio2: str = "vs odir") -> None:
    head = header(ratio, ratio2)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(format_row(r))


def targets(rows: list[Row], cold: bool) -> list[dict]:
    out = []
    by = {(r.size_mib, r.store, r.op): r for r in rows}
    for size in sorted({r.size_mib for r in rows}):
        for op in TARGET_OPS:
            lm = by.get((size, "lmdb", op))
            if lm is None:
                continue
            out.append(
                dict(
                    size_mib=size,
                    what=f"lmdb {op} vs files",
                    ratio=lm.ratio_files,
                    need=TARGET_FILES,
                    result="PASS" if lm.ratio_files >= TARGET_FILES else "MISS",
                )
            )
            if op == "cold_get":
                out.append(
                    dict(
                        size_mib=size,
                        what="lmdb cold_get vs odirect read",
                        ratio=lm.ratio_odirect,
                        need=TARGET_ODIRECT,
                        result="PASS" if lm.ratio_odirect >= TARGET_ODIRECT else "MISS",
                    )
                )
        if not cold:
            out.append(
                dict(size_mib=size, what="lmdb cold_get", ratio=None, need=None, result=NO_COLD)
            )
    return out


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
    lines = []
    for r in rows:
        if r.store == "lmdb" and r.op == "full_set" and r.ratio_files is not None:
            lines.append(
                f"  size {r.size_mib:>6g} MiB  lmdb set into a full store vs files  "
                f"ratio {r.ratio_files:5.2f}"
            )
    if lines:
        lines.insert(0, "also (not an issue target): set into a store at its budget, evicting")
    return lines


# -- drivers ---------------------------------------------------------------------------------
def bench_main(args, workdir: str, cold: bool, notes: list[str]) -> list[Row]:
    rows: list[Row] = []
    opts = dict(LMDB_DEFAULTS, durable=args.fsync)
    cfg_lmdb = "durable" if args.fsync else "defaults"
    cfg_files = "fsync" if args.fsync else "no fsync"
    for size in args.sizes:
        case = make_case(size, args.total_mib, args.seed)
        samples: dict[str, dict[str, list]] = {s: {} for s in STORES}
        for rep in range(args.repeats):
            for store in STORES:
                if store == "odirect":
                    got = odirect_times(case, workdir, notes)
                else:
                    o = opts if store == "lmdb" else {}
                    got = kv_store_times(case, store, workdir, args.batch, o, args.fsync, cold)
                    got |= full_set_times(case, store, workdir, args.batch, o, args.fsync)
                for op, v in got.items():
                    samples[store].setdefault(op, []).append(v)
            print(f"  done size={size:g} MiB repeat {rep + 1}", file=sys.stderr, flush=True)
        rows += rows_of("main", case, "lmdb", cfg_lmdb, args.batch, samples["lmdb"])
        rows += rows_of("main", case, "files", cfg_files, args.batch, samples["files"])
        rows += rows_of("main", case, "odirect", "sequential", 1, samples["odirect"])
        del case
        gc.collect()
    add_ratios(rows)
    return rows


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


def bench_study(args, workdir: str, cold: bool) -> list[Row]:
    """LMDB options at one size; the first configuration (defaults) is the ratio reference."""
    size = args.study_size[0]
    case = make_case(size, args.total_mib, args.seed + 7)
    configs = [
        (label, "lmdb", dict(LMDB_DEFAULTS, **o), b or args.batch, False) for label, o, b in STUDY
    ]
    configs += [
        ("no fsync", "files", {}, args.batch, False),
        ("fsync", "files", {}, args.batch, True),
    ]
    samples: list[dict[str, list]] = [{} for _ in configs]
    for rep in range(args.repeats):
        for i, (_label, kind, opts, batch, fsync) in enumerate(configs):
            o = opts if kind == "lmdb" else {}
            got = kv_store_times(case, kind, workdir, batch, o, fsync, cold)
            for op, v in got.items():
                samples[i].setdefault(op, []).append(v)
        print(f"  done study repeat {rep + 1}", file=sys.stderr, flush=True)
    per_config = [
        rows_of("study", case, kind, f"{label}, batch {batch}", batch, samples[i])
        for i, (label, kind, _opts, batch, _fsync) in enumerate(configs)
    ]
    base = {r.op: r.gbps for r in per_config[0]}
    rows = [r for rs in per_config for r in rs]
    for r in rows:
        r.ratio_files = r.gbps / base[r.op] if base.get(r.op) else None  # here: vs LMDB defaults
    return rows


def main(argv: Sequence[str] | None = None) -> Report:
    args = parse_args(argv)
    parent = args.dir or tempfile.gettempdir()
    workdir = tempfile.mkdtemp(prefix="bench_storage-", dir=parent)
    cold = not args.no_drop_cache and drop_page_cache()
    conditions = machine_conditions(workdir, cold)
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
    try:
        rows = bench_main(args, workdir, cold, notes)
        study = bench_study(args, workdir, cold) if args.study else []
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ts = targets(rows, cold)
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
    colds = [c for r in rows + study if r.op == "cold_get" for c in r.cached_mib_before]
    print()
    if colds and cold:
        print(f"page cache right before each cold get: {min(colds):.0f} - {max(colds):.0f} MiB")
    print(
        f"correctness: every get returned True and matched the written bytes; total "
        f"{time.perf_counter() - started:.1f}s"
    )
    report = Report(rows, study, ts, conditions, cold, notes)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(report), fh, indent=2)
    return report


if __name__ == "__main__":
    main()

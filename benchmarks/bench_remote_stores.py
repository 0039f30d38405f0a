"""Benchmark of the remote stores against their raw clients: RedisStorage vs redis-py on the
same redis-server, MooncakeStorage vs MooncakeDistributedStore on the same Mooncake master.

What is measured (``tiered_kv.bench.remote_stores``, ``remote_pairs``): for every page size
(``--sizes``, MiB; about ``--total-mib`` of pages per size), random pages (fresh per run) are
set in batches of ``--batch`` and got back into other pages, through the store and through the
raw client's plainest batch calls on the page bytes alone, alternating round by round (rotated,
one warm-up round dropped), ``--repeats`` rounds kept; the server is emptied after every arm's
round. Redis: a redis-server on 127.0.0.1 started here; raw is a non-transactional pipeline of
``SET`` from page views and one ``MGET`` copied into the pages. Mooncake: a master and a
``mooncake_client`` process lending the store's memory (every byte crosses the TCP transport);
raw is ``batch_put_from`` / ``batch_get_into`` between the same registered pages and the store.
The store adds its header, an xxh3 checksum written on set and verified on get, a presence check
per set (Mooncake: a put of a present key would keep the old value) and its counters.

GB/s is 1e9 bytes of page payload per second of the median round; ``vs raw`` is the store's
GB/s over the raw client's in the same run. Every get is checked outside the timing (each call
served, the bytes equal the written ones); a mismatch aborts. Target (issue 17): >= 0.9x the
raw client for every backend, size and op.

Mooncake's processes listen on every address: its rows are measured only in a loopback-only
network namespace, e.g.::

    unshare -n sh -c 'ip link set lo up && exec .venv/bin/python benchmarks/bench_remote_stores.py'
    .venv/bin/python benchmarks/bench_remote_stores.py --backends redis --quick
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tiered_kv.bench import machine, report
from tiered_kv.bench.page_stores import BenchPages
from tiered_kv.bench.remote_pairs import MooncakeProcesses, RedisProcess, mooncake_pair, redis_pair
from tiered_kv.bench.remote_stores import MIB, TARGET_RAW, Row, measure_pair, targets
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.storage.mooncake_master import loopback_only

BACKENDS = ("redis", "mooncake")
QUICK = {"total_mib": 32, "repeats": 3}


@dataclass
class Report:
    rows: list[Row]
    targets: list[dict]
    conditions: list[str]
    notes: list[str]


def _list(kind, what: str):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {what}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--backends", type=_list(str, "backends"), default=list(BACKENDS))
    p.add_argument("--sizes", type=_list(float, "MiB"), default=[0.5, 2.0, 8.0], help="MiB")
    p.add_argument("--total-mib", type=float, default=128, help="bytes set per size, MiB")
    p.add_argument("--batch", type=int, default=8, help="pages per call")
    p.add_argument("--repeats", type=int, default=5, help="rounds kept per arm (median)")
    p.add_argument("--quick", action="store_true", help="total-mib 32, repeats 3")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"--backends {bad}: choose from {', '.join(BACKENDS)}")
    if args.batch < 1 or args.repeats < 1 or args.total_mib <= 0:
        p.error("--batch and --repeats must be >= 1, --total-mib > 0")
    if any(round(s * MIB) < 1 for s in args.sizes):
        p.error("--sizes: every page must be at least one byte")
    return args


def columns() -> list[report.Column]:
    C = report.Column
    return [
        C("backend", 8, left=True), C("size_mib", 8, "g"), C("op", 4, left=True),
        C("pages", 5), C("MiB", 6, ".0f"), C("GB/s", 7, ".3f"), C("raw GB/s", 8, ".3f"),
        C("vs raw", 7, ".2f"), C("n", 2),
    ]  # fmt: skip


def table_lines(rows: list[Row]) -> list[str]:
    cells = [
        [r.backend, r.size_mib, r.op, r.pages, r.nbytes / MIB, r.gbps, r.raw_gbps, r.ratio,
         len(r.samples_s)]
        for r in rows
    ]  # fmt: skip
    return report.fixed_table(columns(), cells)


def target_lines(ts: list[dict]) -> list[str]:
    lines = [f"targets: every store's set / get >= {TARGET_RAW}x its raw client"]
    for t in ts:
        lines.append(
            f"  size {t['size_mib']:>6g} MiB  {t['what']:<30} ratio {t['ratio']:5.2f} "
            f"(need >= {t['need']})  {t['result']}"
        )
    met = sum(t["result"] == "PASS" for t in ts)
    lines.append(f"  {met} of {len(ts)} targets PASS")
    return lines


def _measure(backend: str, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    most = max(max(1, round(args.total_mib / s)) * round(s * MIB) for s in args.sizes)
    servers = RedisProcess() if backend == "redis" else MooncakeProcesses(4 * most + (64 << 20))
    try:
        for i, size in enumerate(args.sizes):
            nbytes = round(size * MIB)
            n = max(1, round(args.total_mib / size))
            pages = BenchPages(2 * n, nbytes, fill_seed=args.seed * 1000 + i)
            address = servers.url if backend == "redis" else servers.master.address
            pair = (redis_pair if backend == "redis" else mooncake_pair)(address, pages)
            try:
                rows += measure_pair(pair, n, args.batch, args.repeats)
            finally:
                pair.close()
            print(f"  {backend} {size:g} MiB done", flush=True)
    finally:
        servers.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> Report:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    info = machine.machine_info()
    conditions = machine.condition_lines(info)
    notes: list[str] = []
    print("\n".join(conditions))
    print(
        f"backends {', '.join(args.backends)}; sizes {', '.join(f'{s:g}' for s in args.sizes)} "
        f"MiB, {args.total_mib:g} MiB per size, batch {args.batch}, repeats {args.repeats} "
        f"(median), seed {args.seed}",
        flush=True,
    )
    started = time.perf_counter()
    rows: list[Row] = []
    with exit_on_failure():
        for backend in args.backends:
            if backend == "mooncake" and not loopback_only():
                notes.append(
                    "mooncake not measured: not in a loopback-only network namespace (Mooncake "
                    "listens on every address; run under `unshare -n`, see the docstring)"
                )
                continue
            rows += _measure(backend, args)
    ts = targets(rows)
    print()
    print("\n".join(table_lines(rows)))
    print("(vs raw: GB/s over the raw client's on the same server, same run)")
    for note in notes:
        print(note)
    print()
    print("\n".join(target_lines(ts)))
    print(
        f"correctness: every get was served and matched the written bytes; total "
        f"{time.perf_counter() - started:.1f}s"
    )
    loads = watch.finish()
    noise = machine.noise_check(None, list(loads.values()))
    for r in rows:  # the raw clients' own spread across rounds
        flag = machine.noise_check(r.raw_samples_s)
        reasons = [f"raw {r.backend} {r.op} {r.size_mib:g} MiB: {x}" for x in flag.reasons]
        noise = machine.Noise(noise.noisy or flag.noisy, noise.reasons + tuple(reasons))
    print(
        "load average at end "
        + " ".join(f"{v:.2f}" for v in loads["load_after"] or ())
        + (f"; noise: {'; '.join(noise.reasons)}" if noise.noisy else "")
    )
    rep = Report(rows, ts, conditions, notes)
    details = {**info, **loads, "noise": list(noise.reasons)}
    report.write_json(args.json, asdict(rep), config=report.config_of(args), machine=details)
    return rep


if __name__ == "__main__":
    main()

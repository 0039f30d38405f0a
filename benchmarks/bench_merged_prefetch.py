"""Benchmark of a step's storage reads: one storage job for a batch against one per request.

``--requests`` prompts (each ``--tokens`` long, distinct) are served once, so their pages are
in the LMDB store, and the tree is cleared (device and host empty, the store keeps them). Each
round then begins all of them with storage hits and times the call:

- ``merged``: ``TieredKVCache.begin_many`` (one segmented storage -> host job for the batch,
  each request's chain stopping at its own first missing page);
- ``per request``: the previous ``begin_many``, which began each request in turn and fetched
  its storage hit as a job of its own (rebuilt here from the facade's own steps).

Both under ``wait_complete`` (the wait runs the job on the calling thread), their host hits
loaded back as one layer-wise job either way. Rounds alternate (after one warm-up each); the
table has medians of the call's milliseconds, the storage jobs submitted and the store's
``batch_get`` / ``batch_exists`` calls per call (the probes, one ``batch_exists`` per request,
are in both), the ratio per request / merged, and the load average. Every round checks that
each request got its whole stored prefix.

Run::

    .venv/bin/python benchmarks/bench_merged_prefetch.py --quick
    .venv/bin/python benchmarks/bench_merged_prefetch.py --json merged_prefetch.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tiered_kv.bench import machine, report
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.names import Direction

C = report.Column
COLUMNS = [
    C("reqs", 4), C("tokens", 6), C("pages", 5), C("MiB", 6, ".1f"), C("way", 11, left=True),
    C("ms", 8, ".2f"), C("jobs", 4), C("gets", 4), C("exists", 6), C("per-req/merged", 14, ".2f"),
    C("n", 3),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--requests", default="4,16,32", help="batch sizes")
    p.add_argument("--tokens", default="33,257", help="prompt lengths (storage hit: whole pages)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch-pages", type=int, default=32, help="storage_batch_pages")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="4 and 16 requests, 3 repeats")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = "4,16", 3
    args.requests = [int(x) for x in args.requests.split(",") if x]
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    return args


def make_cache(args, requests: int, tokens: int, path: str) -> TieredKVCache:
    ps = args.page_size
    room = (requests * (tokens + ps) // ps + 4) * ps
    return TieredKVCache(
        TieredKVConfig.flat(
            num_layers=args.layers,
            head_num=args.heads,
            head_dim=args.head_dim,
            page_size=ps,
            device_tokens=room,
            host_tokens=room,
            storage_bytes=max(256 << 20, 4 * room * args.layers * args.heads * args.head_dim * 4),
            storage_path=path,
            storage_batch_pages=args.batch_pages,
            model_id="bench-merged-prefetch@1",
            prefetch_threshold=ps,
            prefetch_policy="wait_complete",
            max_requests=requests,
            max_context_len=tokens + ps,
        )
    )


def per_request(cache: TieredKVCache, prompts: list[list[int]]) -> list:
    """The previous ``begin_many``: each request begun in turn (its storage hit its own
    job, waited for before the next request matches), host hits in one layer-wise job."""
    manager = cache.manager
    manager.chain_loads.settle_older()
    batch = manager.load_batch
    batch.open()
    try:
        reqs = [cache._begin_one(list(p), None, b"") for p in prompts]
    finally:
        batch.flush()
    for r in reqs:
        cache.metrics.hits.add(r.hits)
    cache._follow(reqs)
    return reqs


class Counts:
    """Storage jobs submitted and store calls made by the cache's storage worker."""

    def __init__(self, cache: TieredKVCache) -> None:
        self.jobs = self.gets = self.exists = 0
        worker, store = cache.host_storage, cache.host_storage.storage
        submit, get, exists = worker.submit, store.batch_get, store.batch_exists
        probe = cache.manager.store

        def counted_submit(job):
            self.jobs += job.direction is Direction.STORAGE_TO_HOST
            return submit(job)

        def counted_get(*a):
            self.gets += 1
            return get(*a)

        def counted_exists(keys):
            self.exists += 1
            return exists(keys)

        worker.submit, store.batch_get, store.batch_exists = (
            counted_submit,
            counted_get,
            counted_exists,
        )
        if probe is not store:  # the manager's probes go to the same store's other handle
            real_probe = probe.batch_exists

            def counted_probe(keys):
                self.exists += 1
                return real_probe(keys)

            probe.batch_exists = counted_probe

    def take(self) -> tuple[int, int, int]:
        out = (self.jobs, self.gets, self.exists)
        self.jobs = self.gets = self.exists = 0
        return out


def measure(args, requests: int, tokens: int) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed + requests * 1000 + tokens)
    prompts = [
        [10_000_000 + i, *torch.randint(0, 50_000, (tokens - 1,), generator=gen).tolist()]
        for i in range(requests)
    ]
    want = (tokens - 1) // args.page_size * args.page_size
    with tempfile.TemporaryDirectory(prefix="bench-merged-prefetch-") as tmp:
        cache = make_cache(args, requests, tokens, f"{tmp}/store")
        try:
            for p in prompts:  # stored once: write-through to host, then to the store
                r = cache.begin(p)
                cache.extend(r, p[r.prefix_len :])
                cache.finish(r)
            cache.drain()
            counts = Counts(cache)
            ways = {"merged": lambda: cache.begin_many(prompts), "per request": None}
            ways["per request"] = lambda: per_request(cache, prompts)
            times: dict[str, list[float]] = {w: [] for w in ways}
            calls: dict[str, list[tuple[int, int, int]]] = {w: [] for w in ways}
            for rnd in range(args.repeats + 1):
                for way in ways if rnd % 2 == 0 else reversed(list(ways)):
                    cache.clear_tree()
                    counts.take()
                    start = time.perf_counter()
                    reqs = ways[way]()
                    seconds = time.perf_counter() - start
                    got = counts.take()
                    bad = [r.hits for r in reqs if r.hits.storage != want]
                    if bad:
                        raise SystemExit(f"{way}: a request missed its stored prefix: {bad[:2]}")
                    for r in reqs:
                        cache.abort(r)
                    if rnd:  # round 0 warms up
                        times[way].append(seconds * 1e3)
                        calls[way].append(got)
        finally:
            cache.close()
    page_mib = args.page_size * args.layers * 2 * args.heads * args.head_dim * 2 / 2**20
    pages = requests * (want // args.page_size)
    rows = []
    merged_ms = statistics.median(times["merged"])
    for way in ways:
        ms = statistics.median(times[way])
        jobs, gets, exists = (statistics.median(c[i] for c in calls[way]) for i in range(3))
        rows.append(
            {
                "requests": requests,
                "tokens": tokens,
                "pages": pages,
                "mib": pages * page_mib,
                "way": way,
                "ms": ms,
                "jobs": int(jobs),
                "gets": int(gets),
                "exists": int(exists),
                "ratio": ms / merged_ms,
                "repeats": args.repeats,
                "all_ms": times[way],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    info = machine.machine_info()
    print("\n".join(machine.condition_lines(info)))
    torch.set_num_threads(1)
    rows = [r for n in args.requests for t in args.tokens for r in measure(args, n, t)]
    cells = [
        [r["requests"], r["tokens"], r["pages"], r["mib"], r["way"], r["ms"], r["jobs"],
         r["gets"], r["exists"], r["ratio"], r["repeats"]]
        for r in rows
    ]  # fmt: skip
    print()
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    load = watch.finish()
    print(f"\nload average during the run: {load}")
    report.write_json(
        args.json, {"rows": rows, **load}, config=report.config_of(args), machine=info
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

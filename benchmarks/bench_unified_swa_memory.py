"""Device bytes of a sliding-window model's KV pool in three layouts, and the requests each
holds at equal bytes.

Layouts, each built from a ``TieredKVConfig`` through the cache's own builder
(``cache.build.device_pool_for`` / ``allocator_for``):

- *split*: ``SWAKVPool``, a full sub-pool and a window sub-pool of ``device_tokens`` slots each
  (``device_swa_tokens`` left at its default);
- *unified*: ``UnifiedSWAKVPool`` without shared bytes: one page range for both sides, but each
  sub-pool's buffers span the whole range (built directly: the config always shares);
- *shared*: ``swa_unified_pool=True``: one page range over one buffer of the larger side's
  layers.

*MiB* is what the pool allocated, measured three ways that must agree: the pool's own count,
the distinct storages behind its per-layer views (so overlapping views are counted once), and
the process's resident memory growth while the zero-filled pool is built. *requests* is how many
requests of a given length each layout admits one after another at the shared pool's bytes
(sizes scaled so every layout has the same byte budget), each prefilled whole and then giving
back the window KV its next query has left behind, as the cache does; the allocators refuse
the first one that does not fit. Run::

    .venv/bin/python benchmarks/bench_unified_swa_memory.py
"""

from __future__ import annotations

import argparse
import multiprocessing

import psutil
import torch

from tiered_kv.bench import machine, report
from tiered_kv.cache.build import allocator_for, device_pool_for
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool

C = report.Column
BYTES = [
    C("geometry", 22, left=True), C("layers f+w", 10), C("split MiB", 9, ".1f"),
    C("unified MiB", 11, ".1f"), C("shared MiB", 10, ".1f"), C("rss split", 9, ".1f"),
    C("rss shared", 10, ".1f"), C("shared/split", 12, ".3f"),
]  # fmt: skip
HELD = [
    C("geometry", 22, left=True), C("request", 7), C("prefill", 7), C("split", 5),
    C("unified", 7),
    C("shared", 6), C("shared/split", 12, ".2f"),
]  # fmt: skip
# (name, layers, one full layer per, window): published ratios of full to window layers.
GEOMETRIES = (
    ("1:1 (GPT-OSS)", 24, 2, 128),
    ("1:3", 16, 4, 512),
    ("1:5 (Gemma 3)", 24, 6, 1024),
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="device_tokens of every layout")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--chunks", type=int, nargs="+", default=[0, 256], help="prefill chunk sizes (0: whole)"
    )
    return p.parse_args(argv)


def config(args, layers: int, every: int, window: int, tokens: int, shared: bool):
    return TieredKVConfig.flat(
        model="swa", num_layers=layers, full_layer_every=every, sliding_window=window,
        head_num=args.heads, head_dim=args.head_dim, dtype="float16", page_size=args.page_size,
        device_tokens=tokens, host_tokens=0, storage_bytes=0, max_requests=4,
        max_context_len=1024, swa_unified_pool=shared,
    )  # fmt: skip


def build(args, layout: str, layers: int, every: int, window: int, tokens: int):
    """(pool, allocator) of ``layout`` at ``tokens`` device tokens (page-rounded)."""
    ps = args.page_size
    tokens = max(2, tokens // ps) * ps
    c = config(args, layers, every, window, tokens, layout == "shared")
    if layout != "unified":
        pool = device_pool_for(c)
        return pool, allocator_for(c, pool)
    g = c.geometry
    full, swa = g.swa_layer_ids()
    pool = UnifiedSWAKVPool(
        tokens // ps, ps, g.torch_dtype, g.head_num, g.head_dim, full, swa, share_bytes=False
    )
    return pool, UnifiedSWATokenToKVPoolAllocator(tokens // ps, ps, g.torch_dtype, "cpu", pool)


def storage_bytes(pool) -> int:
    """Bytes of the distinct storages behind every per-layer view (views counted once)."""
    seen: dict[int, int] = {}
    for sub in (pool.full_kv_pool, pool.swa_kv_pool):
        for t in (*sub.k_buffer, *sub.v_buffer):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _rss_growth(args, layout, geometry, out) -> None:
    """In a fresh process: resident memory growth while the pool is built (zero-filled, so
    every page is touched)."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    pool, _ = build(args, layout, *geometry[1:], args.tokens)
    out.put(proc.memory_info().rss - before)
    del pool


def measured_bytes(args, layout, geometry) -> tuple[int, int]:
    """(the pool's bytes checked against its storages, resident growth while it was built in a
    fresh process)."""
    pool, _ = build(args, layout, *geometry[1:], args.tokens)
    counted = pool.get_kv_size_bytes()
    if counted != storage_bytes(pool):
        raise SystemExit(f"{layout}: the pool counts {counted} bytes, its storages hold more")
    del pool
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_rss_growth, args=(args, layout, geometry, out))
    child.start()
    grown = out.get()
    child.join()
    return counted, grown


def requests_held(args, layout, geometry, budget: int, length: int) -> int:
    """Requests of ``length`` tokens admitted in turn at ``budget`` bytes of KV, each prefilled
    ``--chunk`` tokens at a time (0: whole), giving back the window KV its next query no longer
    reads after every chunk."""
    _, layers, every, window = geometry
    probe, _ = build(args, layout, layers, every, window, args.tokens)
    per_token = probe.get_kv_size_bytes() / (probe.size + args.page_size)
    del probe
    pool, alloc = build(args, layout, layers, every, window, int(budget / per_token))
    ps, held, step = args.page_size, 0, args.chunk or length
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    while True:
        done, parts = 0, []
        while done < length:
            n = min(step, length - done)
            last = int(parts[-1][-1]) if parts else -1
            ids = alloc.alloc_extend(t(done), t(done), t(done + n), t(done + n), t(last), n)
            if ids is None:
                return held
            parts.append(ids)
            freed = max(0, done - window + 1) // ps * ps  # left behind before this chunk
            done += n
            left = max(0, done - window + 1) // ps * ps  # pages the next query no longer reads
            if left > freed:
                alloc.free_swa(torch.cat(parts)[freed:left])
        held += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(torch.device("cpu")))))
    sizes, held = [], []
    for geometry in GEOMETRIES:
        name, layers, every, window = geometry
        n_full = len(range(0, layers, every))
        got = {lay: measured_bytes(args, lay, geometry) for lay in ("split", "unified", "shared")}
        mib = {lay: b / 2**20 for lay, (b, _) in got.items()}
        sizes.append([
            name, f"{n_full}+{layers - n_full}", mib["split"], mib["unified"], mib["shared"],
            got["split"][1] / 2**20, got["shared"][1] / 2**20, mib["shared"] / mib["split"],
        ])  # fmt: skip
        budget = got["shared"][0]
        for length in (window // 2, 4 * window):
            for chunk in args.chunks:
                run = argparse.Namespace(**{**vars(args), "chunk": chunk})
                n = {lay: requests_held(run, lay, geometry, budget, length) for lay in got}
                held.append([name, length, chunk or "whole", n["split"], n["unified"],
                             n["shared"], n["shared"] / max(1, n["split"])])  # fmt: skip
    print(
        f"device_tokens {args.tokens}, page {args.page_size}, {args.heads} KV heads x "
        f"{args.head_dim}, float16"
    )
    print("\n".join(report.fixed_table(BYTES, sizes)))
    print("(bytes each layout allocates at the same device_tokens; rss: resident growth while")
    print(" the split and the shared pool were built, each in a fresh process)")
    print()
    print("\n".join(report.fixed_table(HELD, held)))
    print("(requests of that many tokens each layout admits at the shared pool's bytes)")
    loads = watch.finish()
    print("load average: " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

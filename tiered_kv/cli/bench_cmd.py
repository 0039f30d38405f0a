"""Host-memory benchmarks: how fast pages move between the tiers.

device <-> host: for each host layout, io backend and page size, the GB/s of a backup (device ->
host, all layers), a layer-wise load (host -> device, one call per layer) and an all-layer load,
against a contiguous copy of the same bytes measured in the same run (ratio = GB/s / baseline).
With CUDA, pinned and pageable host memory are both measured. host <-> storage: batch_set and
batch_get of host pages through LMDBStorage in a temporary directory. Medians over --repeats;
every transfer's bytes are checked once.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from functools import partial

import torch
from tqdm import tqdm

from tiered_kv.cli.args import name_list, positive_int
from tiered_kv.cli.report import table, write_json
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host import host_pool_for
from tiered_kv.storage import LMDBStorage, StorageNamespace

HELP = "host-memory benchmarks: device <-> host per layout / io backend / page size, host <-> disk"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", type=name_list(LAYOUTS), default="page_first,layer_first")
    p.add_argument("--io-backends", type=name_list(IO_BACKENDS), default="kernel,direct")
    p.add_argument("--page-sizes", default="16,64", help="comma-separated powers of two")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens per transfer")
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-storage", action="store_true", help="skip host <-> storage")
    p.add_argument("--no-progress", action="store_true")


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        sizes = [int(s) for s in str(args.page_sizes).split(",") if s.strip()]
    except ValueError:
        parser.error(f"--page-sizes {args.page_sizes!r}: comma-separated integers")
    bad = [s for s in sizes if s < 1 or s & (s - 1)]
    if bad or not sizes:
        parser.error(f"--page-sizes {args.page_sizes!r}: powers of two >= 1 (bad: {bad})")
    if any(args.tokens % s for s in sizes):
        parser.error(f"--tokens {args.tokens} must be a multiple of every page size {sizes}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    args.page_sizes = sizes


def _load_layers(host, pool, h, dst, layer_ids, io) -> None:
    for lid in layer_ids:
        host.load_to_device_per_layer(pool, h, dst, lid, io)


def _extend(out: list, fn, *args) -> None:
    out.extend(fn(*args))


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def _device_host(args, layout, io, page, pin, device) -> dict:
    dtype = getattr(torch, args.dtype)
    size = 2 * args.tokens + 2 * page
    pool = MHATokenToKVPool(size, page, dtype, args.kv_heads, args.head_dim, args.layers, device)
    alloc = PagedTokenToKVPoolAllocator(size, page, dtype, device, pool)
    gen = torch.Generator().manual_seed(page)
    for buf in pool.buffers():
        # Finite values of any 2- or 4-byte dtype: random int16 halves, exponent never all-ones.
        halves = buf.view(torch.int16)
        halves.copy_(
            torch.randint(-30000, 30000, halves.shape, generator=gen, dtype=torch.int16).to(
                halves.device
            )
        )
    (decl,) = pool.host_pool_decls()
    host = host_pool_for(decl, alloc, layout=layout, size_tokens=args.tokens, pin=pin)
    pinned = host.pinned  # destroy() below unpins: read it now
    nbytes = args.tokens * decl.bytes_per_token_per_layer * args.layers
    src_c = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst_c = torch.empty(nbytes, dtype=torch.uint8, pin_memory=bool(pin and device.type == "cuda"))
    samples: dict[str, list[float]] = {
        "backup": [],
        "load_layerwise": [],
        "load_all": [],
        "baseline": [],
    }
    try:
        for rep in range(args.repeats + 1):
            alloc.clear()
            host.allocator.clear()
            src, dst = alloc.alloc(args.tokens), alloc.alloc(args.tokens)
            h = host.alloc(args.tokens)
            t_base = _timed(lambda: dst_c.copy_(src_c), device)
            t_backup = _timed(partial(host.backup_from_device_all_layer, pool, h, src, io), device)
            t_lw = _timed(
                partial(_load_layers, host, pool, h, dst, decl.layer_ids, io),
                device,
            )
            for lid in decl.layer_ids:
                for buf in (pool.get_key_buffer(lid), pool.get_value_buffer(lid)):
                    if not torch.equal(buf[dst].view(torch.int16), buf[src].view(torch.int16)):
                        raise RuntimeError(f"{layout}/{io}/page {page}: layer {lid} differs")
            t_all = _timed(partial(host.load_to_device_all_layer, pool, h, dst, io), device)
            if rep:
                for k, v in (
                    ("baseline", t_base),
                    ("backup", t_backup),
                    ("load_layerwise", t_lw),
                    ("load_all", t_all),
                ):
                    samples[k].append(v)
    finally:
        host.destroy()
    base = nbytes / statistics.median(samples["baseline"]) / 1e9
    out = {
        "layout": layout,
        "io_backend": io,
        "page_size": page,
        "pinned": pinned,
        "mib": nbytes / 2**20,
        "baseline_gbps": base,
    }
    for k in ("backup", "load_layerwise", "load_all"):
        gbps = nbytes / statistics.median(samples[k]) / 1e9
        out[f"{k}_gbps"] = gbps
        out[f"{k}_ratio"] = gbps / base
    return out


def _host_storage(args) -> dict:
    dtype = getattr(torch, args.dtype)
    page = args.page_sizes[-1]
    pool = MHATokenToKVPool(
        2 * args.tokens, page, dtype, args.kv_heads, args.head_dim, args.layers, "cpu"
    )
    alloc = PagedTokenToKVPoolAllocator(2 * args.tokens, page, dtype, "cpu", pool)
    (decl,) = pool.host_pool_decls()
    host = host_pool_for(decl, alloc, layout="page_first", size_tokens=2 * args.tokens)
    host.buffer.view(torch.uint8).copy_(
        torch.randint(0, 256, host.buffer.view(torch.uint8).shape, dtype=torch.uint8)
    )
    n = args.tokens // page
    page_nbytes = host.page_nbytes  # read before host.destroy() below
    ns = StorageNamespace.for_host_pool(host, tenant="bench")
    keys = [bytes([i % 256, i // 256]) for i in range(n)]
    keys = [ns.fingerprint + (k * 16)[:32] for k in keys]
    sets, gets = [], []
    try:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                store = LMDBStorage(
                    d, ns, page_nbytes, budget_bytes=4 * n * page_nbytes + (64 << 20)
                )
                try:
                    sets.append(
                        _timed(
                            partial(store.batch_set, keys, host, list(range(n))),
                            torch.device("cpu"),
                        )
                    )
                    ok = []
                    gets.append(
                        _timed(
                            partial(
                                _extend, ok, store.batch_get, keys, host, list(range(n, 2 * n))
                            ),
                            torch.device("cpu"),
                        )
                    )
                    if not all(ok) or not torch.equal(
                        host.get_page_bytes(0), host.get_page_bytes(n)
                    ):
                        raise RuntimeError("host <-> storage round trip differs")
                finally:
                    store.close()
    finally:
        host.destroy()
    nbytes = n * page_nbytes
    return {
        "pages": n,
        "page_mib": page_nbytes / 2**20,
        "mib": nbytes / 2**20,
        "set_gbps": nbytes / statistics.median(sets) / 1e9,
        "warm_get_gbps": nbytes / statistics.median(gets) / 1e9,
    }


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    pins = (True, False) if device.type == "cuda" else (None,)
    combos = list(itertools.product(args.layouts, args.io_backends, args.page_sizes, pins))
    rows = [
        _device_host(args, *c, device)
        for c in tqdm(combos, desc="device<->host", unit="config", disable=args.no_progress)
    ]
    result = {"command": "bench", "device": str(device), "device_host": rows}
    print(
        table(
            [
                "layout",
                "io",
                "page",
                "pinned",
                "MiB",
                "baseline GB/s",
                "backup GB/s",
                "ratio",
                "layer-wise load GB/s",
                "ratio",
                "all-layer load GB/s",
                "ratio",
            ],
            [
                [
                    r["layout"],
                    r["io_backend"],
                    r["page_size"],
                    r["pinned"],
                    r["mib"],
                    r["baseline_gbps"],
                    r["backup_gbps"],
                    r["backup_ratio"],
                    r["load_layerwise_gbps"],
                    r["load_layerwise_ratio"],
                    r["load_all_gbps"],
                    r["load_all_ratio"],
                ]
                for r in rows
            ],
        )
    )
    if not args.no_storage:
        s = _host_storage(args)
        result["host_storage"] = s
        print()
        print(
            table(
                [
                    "host <-> storage (LMDB)",
                    "pages",
                    "page MiB",
                    "MiB",
                    "set GB/s",
                    "warm get GB/s",
                ],
                [
                    [
                        "page_first",
                        s["pages"],
                        s["page_mib"],
                        s["mib"],
                        s["set_gbps"],
                        s["warm_get_gbps"],
                    ]
                ],
            )
        )
    print("\n(ratio: GB/s over a contiguous copy of the same bytes in the same run; medians)")
    write_json(args.json, result)
    return 0

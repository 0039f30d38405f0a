"""Host-memory benchmarks: how fast pages move between the tiers.

device <-> host: for each host layout, io backend and page size, the GB/s of a backup (device ->
host, all layers), a layer-wise load (host -> device, one call per layer) and an all-layer load,
against a contiguous copy of the same bytes measured in the same run (ratio = GB/s / baseline).
With CUDA, pinned and pageable host memory are both measured. host <-> storage: batch_set and
batch_get of host pages through the disk store (--storage-layout) in a temporary directory.
Medians over --repeats; every transfer's bytes are checked once.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import psutil
from tqdm import tqdm

from tiered_kv.cli.args import name_list, positive_int
from tiered_kv.cli.preflight import check_fits
from tiered_kv.cli.report import table, write_json
from tiered_kv.names import StorageLayout
from tiered_kv.storage_config import StorageConfig

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
    p.add_argument(
        "--storage-layout",
        default=StorageConfig.storage_layout,
        choices=StorageLayout.values(),
        help="the disk store's layout for host <-> storage",
    )
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
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
    args.page_sizes = sizes
    _check_memory(args)


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse, before allocating, a case that cannot fit: its device pool (two transfers'
    tokens and padding pages), host pool (one transfer's) and contiguous baseline (a pair of
    one transfer's bytes), per token over every layer's K and V."""
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * DTYPE_BYTES[args.dtype]
    pool = (2 * args.tokens + 3 * max(args.page_sizes)) * per_token
    one = args.tokens * per_token
    what = f"--tokens {args.tokens}"
    fix = "--tokens (or --layers, --kv-heads, --head-dim, --dtype)"
    ram = psutil.virtual_memory().available
    if args.device == "cuda":
        import torch

        gpu = torch.cuda.mem_get_info()[0]
        check_fits("bench", what, [("device pool", pool), ("baseline", one)], gpu, "the GPU", fix)
        parts = [("host pool", one), ("baseline", one)]
    else:
        parts = [("device pool", pool), ("host pool", one), ("baseline", 2 * one)]
    check_fits("bench", what, parts, ram, "this machine", fix)


def _device_host(args, layout, io, page, pin, device) -> tuple[dict, list[str]]:
    """One configuration through the library's measurement (``tiered_kv.bench.transfer``): its
    JSON row, and why its baseline was noisy (empty if it was not)."""
    import torch

    from tiered_kv.bench.machine import noise_check
    from tiered_kv.bench.transfer import (
        ContiguousBaseline,
        Geometry,
        TransferCase,
        config_generator,
        make_allocator,
        make_host,
        make_pool,
        measure_transfer,
    )
    from tiered_kv.bench.transfer_check import verify_transfer
    from tiered_kv.bench.verify import fill_random

    geom = Geometry(args.layers, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    size = 2 * args.tokens + 2 * page
    pool = make_pool(geom, size, page, device)
    alloc = make_allocator(pool, size)
    fill_random(pool.buffers(), page, device)
    decl = pool.host_pool_decls()[0]
    host = make_host(decl, alloc, layout, args.tokens, pin=pin)
    pinned = host.pinned  # destroy() below unpins: read it now
    baseline = ContiguousBaseline(device, pool.store_dtype, page, pin=pin)
    case = TransferCase(pool, decl, alloc, host, io, args.tokens, baseline)
    where = f"layout={layout} io_backend={io} page_size={page} pinned={pinned}"
    try:
        verify_transfer(where, case, config_generator(1, page, layout, salt=1))
        res = measure_transfer(case, args.repeats, config_generator(0, page, layout, salt=0))
    finally:
        host.destroy()
    out = {
        "layout": layout,
        "io_backend": io,
        "page_size": page,
        "pinned": pinned,
        "mib": case.nbytes / 2**20,
        "baseline_gbps": res["backup"].baseline_gbps,
    }
    for key, direction in (
        ("backup", "backup"),
        ("load_layerwise", "load"),
        ("load_all", "load_all"),
    ):
        r = res[direction]
        out[f"{key}_gbps"] = r.gbps
        out[f"{key}_ratio"] = r.gbps / out["baseline_gbps"]
    noise = [f"{where} {d}: {x}" for d in res for x in noise_check(res[d].baseline).reasons]
    return out, noise


def _host_storage(args) -> dict:
    """Set and warm get of host pages in the disk store (``tiered_kv.bench.storage``), medians."""
    import torch

    from tiered_kv.bench.storage import host_case, kv_store_times
    from tiered_kv.bench.timing import gbps, interleave, median
    from tiered_kv.bench.transfer import Geometry, make_allocator, make_host, make_pool
    from tiered_kv.bench.verify import fill_random

    dtype = getattr(torch, args.dtype)
    page = args.page_sizes[-1]
    cpu = torch.device("cpu")
    geom = Geometry(args.layers, args.kv_heads, args.head_dim, dtype)
    pool = make_pool(geom, 2 * args.tokens, page, cpu)
    alloc = make_allocator(pool, 2 * args.tokens)
    decl = pool.host_pool_decls()[0]
    host = make_host(decl, alloc, "page_first", 2 * args.tokens)
    fill_random([host.buffer], page, cpu)
    n = args.tokens // page
    page_nbytes = host.page_nbytes  # read before host.destroy() below
    try:
        case = host_case(host, n, seed=page)
        with tempfile.TemporaryDirectory() as d:
            kind = args.storage_layout
            got = interleave(
                {kind: lambda _: kv_store_times(case, kind, d, n, {}, False, False)},
                args.repeats,
            )[kind]
    finally:
        host.destroy()
    nbytes = n * page_nbytes
    return {
        "pages": n,
        "page_mib": page_nbytes / 2**20,
        "mib": nbytes / 2**20,
        "set_gbps": gbps(nbytes, median([t["set"][0] for t in got])),
        "warm_get_gbps": gbps(nbytes, median([t["warm_get"][0] for t in got])),
    }


def main(args: argparse.Namespace) -> int:
    import torch

    from tiered_kv.bench.machine import LoadWatch, machine_info, noise_check
    from tiered_kv.bench.report import config_of

    device = torch.device(args.device)
    pins = (True, False) if device.type == "cuda" else (None,)
    combos = list(itertools.product(args.layouts, args.io_backends, args.page_sizes, pins))
    watch = LoadWatch()
    measured = [
        _device_host(args, *c, device)
        for c in tqdm(combos, desc="device<->host", unit="config", disable=args.no_progress)
    ]
    rows = [row for row, _ in measured]
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
                    f"host <-> storage ({args.storage_layout})",
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
    loads = watch.finish()
    noise = [x for _, reasons in measured for x in reasons]
    noise += list(noise_check(None, list(loads.values())).reasons)
    if noise:
        print("noisy (read those ratios with care or rerun): " + "; ".join(noise))
    result["config"] = config_of(args)
    result["machine"] = {**machine_info(device), **loads}
    write_json(args.json, result)
    return 0

"""Device <-> host GB/s of a multi-pool page (every declared part of a token moved together, as
the tiered cache moves a DSA or sliding-window model's pages) against one contiguous copy of
the same number of bytes, measured in the same run, alternating, medians.

- ``dsa``: the MLA latent and the indexer's fp8 keys (one device pool, two declarations);
- ``swa``: a full-attention and a sliding-window sub-pool (the window part moves through the
  allocator's full -> window table).

Each round backs ``--tokens`` tokens up to host (``backup_from_device_all_layer``) and loads
them back (``load_to_device_all_layer``), and checks every part's bytes came back exactly.

Run::

    .venv/bin/python benchmarks/bench_multipool_transfer.py --tokens 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiered_kv.bench import machine, report
from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.host.pool_group import HostPoolGroup

C = report.Column
COLUMNS = [
    C("model", 5, left=True), C("MiB", 7, ".1f"), C("backup GB/s", 11, ".2f"),
    C("load GB/s", 9, ".2f"), C("copy GB/s", 9, ".2f"), C("backup/copy", 11, ".2f"),
    C("load/copy", 9, ".2f"),
]  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if args.tokens < args.page_size or args.tokens % args.page_size:
        p.error(f"--tokens {args.tokens} must be whole pages of --page-size {args.page_size}")
    return args


def build(kind: str, args):
    ps, n, layers = args.page_size, 2 * args.tokens, args.layers
    if kind == "dsa":
        pool = DSATokenToKVPool(n, ps, torch.bfloat16, 512, 64, layers, index_head_dim=128)
        alloc = PagedTokenToKVPoolAllocator(n, ps, torch.bfloat16, "cpu", kvcache=pool)
    else:
        full = list(range(0, layers, 4))
        window = [i for i in range(layers) if i % 4]
        pool = SWAKVPool(n, n, ps, torch.bfloat16, 8, 128, full, window)
        alloc = SWATokenToKVPoolAllocator(n, n, ps, torch.bfloat16, "cpu", pool)
        assert alloc.swa_attn_allocator.alloc(ps) is not None  # window slots != full slots
    group = HostPoolGroup(pool.host_pool_decls(), alloc, layout="page_first", size_tokens=n)
    return pool, alloc, group


def measure(kind: str, args) -> list:
    pool, alloc, group = build(kind, args)
    try:
        for b in pool.buffers():
            raw = b.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        dev = alloc.alloc(args.tokens)
        host = group.alloc(args.tokens)
        nbytes = group.page_nbytes * (args.tokens // args.page_size)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        if kind == "swa":  # each sub-pool's rows of the tokens
            swa = alloc.translate_loc_from_full_to_swa(dev)
            rows = [(b, dev) for b in pool.full_kv_pool.buffers()]
            rows += [(b, swa) for b in pool.swa_kv_pool.buffers()]
        else:
            rows = [(b, dev) for b in pool.buffers()]
        want = [b.view(torch.uint8)[r].clone() for b, r in rows]
        times: dict[str, list[float]] = {"backup": [], "load": [], "copy": []}
        for rnd in range(args.repeats + 1):
            t = time.perf_counter()
            group.backup_from_device_all_layer(pool, host, dev)
            backup = time.perf_counter() - t
            for b, r in rows:  # the load must really land
                b.view(torch.uint8)[r] = 0
            t = time.perf_counter()
            group.load_to_device_all_layer(pool, host, dev)
            load = time.perf_counter() - t
            t = time.perf_counter()
            dst.copy_(src)
            copy = time.perf_counter() - t
            raw = [b.view(torch.uint8)[r] for b, r in rows]  # random bits: NaNs compare bytes
            if not all(torch.equal(a, b) for a, b in zip(want, raw, strict=True)):
                raise SystemExit(f"{kind}: the loaded bytes differ")
            if rnd:  # the first round is a warm-up
                times["backup"].append(backup)
                times["load"].append(load)
                times["copy"].append(copy)
    finally:
        group.destroy()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return [kind, nbytes / 2**20, gbps["backup"], gbps["load"], gbps["copy"],
            gbps["backup"] / gbps["copy"], gbps["load"] / gbps["copy"]]  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(torch.device("cpu")))))
    cells = [measure(kind, args) for kind in ("dsa", "swa")]
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    print("(medians; copy: one contiguous copy of the same bytes in the same rounds)")
    loads = watch.finish()
    print("load average: " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

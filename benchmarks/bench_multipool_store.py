"""Storing a multi-pool page (DSA: latent + indexer keys): one value per page holding every part
(``HostPoolGroup``, the layout the tiered cache uses) against one value per declaration (each
part in its own store under its own namespace), the same pages, alternating, medians.

Both are slab stores on the same disk. The group's page is spread over its members' buffers, so
the store copies it through ``get_page_bytes`` / ``set_page_bytes``; a single pool's page is one
zero-copy row. Every round checks the bytes read back against what was written.

Run::

    .venv/bin/python benchmarks/bench_multipool_store.py --pages 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from tiered_kv.bench import machine, report
from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.host import host_pool_for
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.storage import SlabStorage, StorageNamespace, page_keys

C = report.Column
COLUMNS = [
    C("pages", 5), C("MiB", 6, ".1f"), C("one value set ms", 16, ".2f"),
    C("per part set ms", 15, ".2f"), C("one value get ms", 16, ".2f"),
    C("per part get ms", 15, ".2f"), C("get ratio", 9, ".2f"),
]  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", default="1,8,32", help="pages per batch, comma-separated")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    args.pages = [int(x) for x in args.pages.split(",") if x]
    if not args.pages or min(args.pages) < 1:
        p.error("--pages needs positive page counts")
    return args


def _random(hosts) -> None:
    for h in hosts:
        bits = h.buffer.view(torch.uint8).view(-1)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8))


def measure(args, n_pages: int, tmp: str) -> list:
    ps, most = args.page_size, max(args.pages)
    size = 2 * most * ps
    pool = DSATokenToKVPool(
        size, ps, torch.bfloat16, args.kv_lora_rank, args.rope, args.layers, index_head_dim=128
    )
    alloc = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", kvcache=pool)
    decls = pool.host_pool_decls()
    group = HostPoolGroup(decls, alloc, layout="page_first", size_tokens=2 * most * ps)
    singles = [
        host_pool_for(d, alloc, layout="page_first", size_tokens=2 * most * ps) for d in decls
    ]
    ns = StorageNamespace.for_host_pool(group, model="bench@1")
    one = SlabStorage(
        os.path.join(tmp, f"one{n_pages}"), ns, group.page_nbytes, budget_bytes=8 << 30
    )
    parts = []
    for i, h in enumerate(singles):
        nsi = StorageNamespace.for_host_pool(h, model="bench@1")
        path = os.path.join(tmp, f"part{n_pages}-{i}")
        parts.append((h, nsi, SlabStorage(path, nsi, h.page_nbytes, budget_bytes=8 << 30)))
    src, dst = list(range(n_pages)), list(range(n_pages, 2 * n_pages))
    mib = group.page_nbytes * n_pages / 2**20
    times: dict[str, list[float]] = {k: [] for k in ("one_set", "part_set", "one_get", "part_get")}
    try:
        for _ in range(args.repeats):
            _random([*group.members, *singles])
            toks = torch.randint(0, 2**31, (n_pages * ps,))
            k1 = page_keys(ns, toks, ps)
            kp = [page_keys(nsi, toks, ps) for _, nsi, _ in parts]
            t = time.perf_counter()
            one.batch_set(k1, group, src)
            times["one_set"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for (h, _, st), k in zip(parts, kp, strict=True):
                st.batch_set(k, h, src)
            times["part_set"].append(time.perf_counter() - t)
            t = time.perf_counter()
            got1 = one.batch_get(k1, group, dst)
            times["one_get"].append(time.perf_counter() - t)
            t = time.perf_counter()
            gotp = [st.batch_get(k, h, dst) for (h, _, st), k in zip(parts, kp, strict=True)]
            times["part_get"].append(time.perf_counter() - t)
            for p_src, p_dst in zip(src, dst, strict=True):
                if not all(got1) or not all(all(g) for g in gotp):
                    raise SystemExit("a page was not read back")
                if not torch.equal(group.get_page_bytes(p_src), group.get_page_bytes(p_dst)):
                    raise SystemExit("one-value page read back differs")
                for h, _, _ in parts:
                    if not torch.equal(h.get_page_bytes(p_src), h.get_page_bytes(p_dst)):
                        raise SystemExit("per-part page read back differs")
    finally:
        one.close()
        for _, _, st in parts:
            st.close()
        group.destroy()
        for h in singles:
            h.destroy()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return [n_pages, mib, med["one_set"], med["part_set"], med["one_get"], med["part_get"],
            med["one_get"] / med["part_get"]]  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(torch.device("cpu")))))
    with tempfile.TemporaryDirectory(prefix="tkv-multipool-") as tmp:
        cells = [measure(args, n, tmp) for n in args.pages]
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    print("(medians; get ratio = one value / per part: above 1 the one-value page is slower)")
    loads = watch.finish()
    print("load average: " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

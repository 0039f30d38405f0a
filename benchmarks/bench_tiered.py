"""Benchmark of layer-wise loading: how soon is layer 0 of a host-resident prefix usable?

For a prefix of ``--tokens`` tokens resident in the host pool, three timings per repeat:

- ``full``: one ``load_to_device_all_layer`` call (every layer in one piece, no per-layer
  events) -- the baseline, measured in the same run, interleaved with the rest;
- ``layer0``: from ``CacheController.load`` + ``start_loading`` until the device pool's
  ``get_key_buffer(first layer)`` and ``get_value_buffer(first layer)`` return (they wait on
  the LayerDoneCounter's event for that layer only);
- ``all``: from the same start until the last layer's buffers return.

Layer-wise loading must make layer 0 usable after about 1/L of the full copy: the table prints
``layer0 / full`` next to ``1/L`` and ``layer0 * L / full`` (1.0 would be perfect; per-layer job
overhead pushes it up), and ``all / full`` (what the per-layer split costs in total). Medians
over ``--repeats``; each repeat draws fresh scattered host and device pages. Every repeat checks
the loaded bytes against the host copy (every layer, K and V, bit for bit); a mismatch aborts.

On CPU the copies run on the controller's load thread (the same code drives a CUDA stream with
``--device cuda``, where the consumer's wait is a GPU-side ``wait_event`` and the times below are
taken after a ``torch.cuda.synchronize``).

Run::

    .venv/bin/python benchmarks/bench_tiered.py --quick
    .venv/bin/python benchmarks/bench_tiered.py --json tiered.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as py_platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import psutil
import torch

from tiered_kv.cache_controller import CacheController
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.host import host_pool_for

LAYOUTS = ("page_first", "layer_first")


@dataclass
class Row:
    layout: str
    layers: int
    tokens: int
    mib: float
    full_ms: float
    layer0_ms: float
    all_ms: float
    repeats: int

    @property
    def layer0_ratio(self) -> float:
        return self.layer0_ms / self.full_ms

    @property
    def layer0_times_l(self) -> float:
        return self.layer0_ratio * self.layers

    @property
    def all_ratio(self) -> float:
        return self.all_ms / self.full_ms


def fail(msg: str) -> None:
    print(f"bench_tiered: FAILED: {msg}", file=sys.stderr)
    raise SystemExit(1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_layout(args, layout: str, device: torch.device, gen: torch.Generator) -> Row:
    P, L = args.page_size, args.layers
    dtype = torch.float16
    size = 2 * args.tokens + 4 * P
    size -= size % P
    pool = MHATokenToKVPool(size, P, dtype, args.heads, args.head_dim, L, device)
    alloc = PagedTokenToKVPoolAllocator(size, P, dtype, device, pool)
    for buf in pool.buffers():
        buf.copy_(
            torch.randint(-30000, 30000, buf.shape, generator=gen, dtype=torch.int16).view(
                buf.dtype
            )
        )
    (decl,) = pool.host_pool_decls()
    host = host_pool_for(decl, alloc, layout=layout, size_tokens=args.tokens + 2 * P)
    ctl = CacheController(alloc, host)
    full, first, every = [], [], []
    try:
        for rep in range(args.repeats + 1):
            alloc.clear()
            src = alloc.alloc(args.tokens)
            dst = alloc.alloc(args.tokens)
            h = host.alloc(args.tokens)
            host.backup_from_device_all_layer(pool, h, src)
            gc.disable()
            try:
                sync(device)
                t = time.perf_counter()
                host.load_to_device_all_layer(pool, h, dst)
                sync(device)
                t_full = time.perf_counter() - t
                # Scramble the destination so the layer-wise load must really land.
                for buf in pool.buffers():
                    buf[dst] = buf[src].flip(0)
                sync(device)
                t = time.perf_counter()
                ctl.load(h, dst, rep)
                ctl.start_loading()
                pool.get_key_buffer(0)
                pool.get_value_buffer(0)
                sync(device)
                t_first = time.perf_counter() - t
                pool.get_key_buffer(L - 1)
                pool.get_value_buffer(L - 1)
                sync(device)
                t_all = time.perf_counter() - t
            finally:
                gc.enable()
            ctl.wait_all()
            acks = ctl.poll_loads()
            if acks != [(rep, True)]:
                fail(f"{layout}: load acks {acks}")
            for layer in range(L):
                for name, buf in (
                    ("K", pool.get_key_buffer(layer)),
                    ("V", pool.get_value_buffer(layer)),
                ):
                    if not torch.equal(buf[dst].view(torch.int16), buf[src].view(torch.int16)):
                        fail(f"{layout}: layer {layer} {name} differs after the layer-wise load")
            host.free(h)
            if rep == 0:
                continue  # warm-up
            full.append(t_full)
            first.append(t_first)
            every.append(t_all)
    finally:
        ctl.close()
        host.destroy()
    nbytes = args.tokens * L * 2 * args.heads * args.head_dim * 2
    return Row(
        layout,
        L,
        args.tokens,
        nbytes / 2**20,
        statistics.median(full) * 1e3,
        statistics.median(first) * 1e3,
        statistics.median(every) * 1e3,
        len(full),
    )


def conditions(device: torch.device) -> list[str]:
    load = os.getloadavg()
    mem = psutil.virtual_memory()
    return [
        f"python {py_platform.python_version()} on {py_platform.platform()}",
        f"torch {torch.__version__} (intra-op threads {torch.get_num_threads()}), device {device}",
        f"cpu count {os.cpu_count()}, load average {' '.join(f'{v:.2f}' for v in load)}",
        f"RAM total {mem.total / 2**30:.1f} GiB, available {mem.available / 2**30:.1f} GiB",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=4096, help="prefix length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="1024 tokens, 16 layers, 3 repeats")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.repeats = 1024, 16, 3
    if args.tokens % args.page_size:
        p.error(f"--tokens {args.tokens} must be a multiple of --page-size {args.page_size}")
    layouts = [s for s in args.layouts.split(",") if s]
    bad = [s for s in layouts if s not in LAYOUTS]
    if bad:
        p.error(f"unknown layouts {bad}; use {', '.join(LAYOUTS)}")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    cond = conditions(device)
    print("\n".join(cond))
    rows = [bench_layout(args, layout, device, gen) for layout in layouts]
    print(
        f"\n{'layout':<12} {'L':>3} {'tokens':>6} {'MiB':>7} {'full ms':>8} {'layer0 ms':>9} "
        f"{'all ms':>8} {'layer0/full':>11} {'1/L':>6} {'layer0*L/full':>13} "
        f"{'all/full':>8} {'n':>2}"
    )
    for r in rows:
        print(
            f"{r.layout:<12} {r.layers:>3} {r.tokens:>6} {r.mib:>7.1f} {r.full_ms:>8.2f} "
            f"{r.layer0_ms:>9.3f} {r.all_ms:>8.2f} {r.layer0_ratio:>11.3f} {1 / r.layers:>6.3f} "
            f"{r.layer0_times_l:>13.2f} {r.all_ratio:>8.2f} {r.repeats:>2}"
        )
    print(
        "\n(medians; layer0*L/full = 1.0 means layer 0 was usable after exactly 1/L of the "
        "full copy's time; every repeat's bytes were verified)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "conditions": cond,
                    "rows": [
                        {
                            **asdict(r),
                            "layer0_ratio": r.layer0_ratio,
                            "layer0_times_l": r.layer0_times_l,
                            "all_ratio": r.all_ratio,
                        }
                        for r in rows
                    ],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

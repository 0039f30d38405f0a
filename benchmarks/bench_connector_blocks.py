"""Benchmark of the vLLM connector's fixed costs per block, outside vLLM: block -> host and
host -> block copies, and store reads, into host slots used for the first time, against a
contiguous ``copy_`` and a raw warm read of the same bytes in the same round
(``tiered_kv.bench.connector_blocks``; every load checked bit for bit).

Goals (issue 40): host <-> block <= 1.5x ``copy_``; store read <= 2x a raw warm read.

Run::

    .venv/bin/python benchmarks/bench_connector_blocks.py --quick
    .venv/bin/python benchmarks/bench_connector_blocks.py --json blocks.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from tiered_kv.bench import machine, report
from tiered_kv.bench.connector_blocks import Geometry, measure
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.kernels.row_job import engine_threads, free_cores, sync_threads

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--blocks", type=int, default=8, help="blocks per op (one request's hit)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="8 layers, 4 blocks, 3 rounds")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.blocks, args.rounds = 8, 4, 3
    for name in ("layers", "heads", "head_dim", "block_size", "blocks", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    geom = Geometry(args.layers, args.heads, args.head_dim, args.block_size, DTYPES[args.dtype])
    watch = machine.LoadWatch()
    info = machine.machine_info(torch.device("cpu"))
    print("\n".join(machine.condition_lines(info)))
    big = geom.page_nbytes * args.blocks // args.layers  # one layer of one op's blocks
    layout = (
        f"threads: torch {torch.get_num_threads()}, free cores {free_cores()}; a copy of one "
        f"layer ({big} B) takes {sync_threads(big)} thread(s) on the caller (block->host), "
        f"{engine_threads(big)} on the load thread (host->block)"
    )
    print(layout)
    print(
        f"page {geom.page_nbytes / 2**20:.2f} MiB ({geom.layers} layers x {geom.heads} heads x "
        f"{geom.block_size} tokens x 2 x {geom.head_dim}, {args.dtype}); {args.blocks} blocks per "
        f"op; {args.rounds} rounds after one warm-up"
    )
    with exit_on_failure():
        rows = measure(
            geom, args.blocks, args.rounds, args.seed, progress=lambda s: print(s, file=sys.stderr)
        )
    loads = watch.finish()
    cells = [
        [r.op, r.blocks, f"{r.us_per_block:.1f}", r.baseline, f"{r.baseline_us_per_block:.1f}",
         f"{r.ratio:.2f}", f"<= {r.goal:g}", "PASS" if r.ratio <= r.goal else "MISS"]
        for r in rows
    ]  # fmt: skip
    print()
    headers = ["op", "blocks", "us/block", "baseline", "baseline us/block", "ratio", "goal", ""]
    print(report.auto_table(headers, cells))
    noise = machine.noise_check(None, list(loads.values()))
    print("load average at end " + " ".join(f"{x:.2f}" for x in (loads["load_after"] or ())))
    if noise.reasons:
        print("noisy (read those ratios with care or rerun): " + "; ".join(noise.reasons))
    report.write_json(
        args.json,
        {"rows": [vars(r) for r in rows], "thread_layout": layout},
        config=report.config_of(args),
        machine={**info, **loads, "noise": list(noise.reasons)},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

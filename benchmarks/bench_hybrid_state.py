"""A hybrid model's cached prefixes against the same model with every layer full attention:
bytes per cached prefix on each tier, and the time to make one usable again from each tier.

Both caches have one geometry (16 layers, 8 KV heads x 128, bfloat16 by default); in the hybrid
(``model="hybrid_linear"``) one layer in ``--full-every`` is full attention and the others
recurrent, each keeping a fixed-size float32 state per request (a conv history and a
``(linear heads, key dim, value dim)`` temporal state), so a cached prefix there is its full
layers' KV plus one state snapshot: the state is O(1) in the prefix length and the ratio
full/hybrid approaches ``layers / full layers`` as the prefix grows. Per prefix length
(``tiered_kv.bench.hybrid_state``):

- *bytes*: what each tier holds for the prefix once write-through has copied it down: device
  and host (KV tokens x each pool's bytes per token, plus the snapshot's slot), storage (the
  store's own accounting of the KV pages and the snapshot: whole disk blocks and index entries);
- *restore ms*: ``begin`` of the prompt plus one token until every full layer's K and V buffers
  are readable, with the prefix on the device, on host only (device copy evicted) or in the
  store only (``clear_tree``); medians over ``--repeats``, the two models round-robin after a
  warm-up round. A device hit of the hybrid still copies its snapshot into the request's slot.
  Every restore is checked untimed: the whole prefix hit that tier, three full layers' K and V
  and the whole restored state are the random bits written; a mismatch aborts.

Storage restores read files the run has just written (the page cache is warm and not dropped:
the machine is shared), so they measure the store's read path and checksums, not the disk.
Torch runs one intra-op thread unless ``--threads`` says otherwise: the cache's copy threads and
the neighbours share the cores, and on a loaded 2-core machine every parallel region of a state
copy waited for a descheduled OpenMP thread (a 12.8 MiB snapshot copy, 13 indexed copies, took
about 200 ms with 2 threads against about 10 ms with 1).
Run::

    .venv/bin/python benchmarks/bench_hybrid_state.py --quick
    .venv/bin/python benchmarks/bench_hybrid_state.py --json hybrid_state.json
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from tiered_kv.bench import machine, report
from tiered_kv.bench.hybrid_state import Row, Shape, measure
from tiered_kv.bench.verify import exit_on_failure
from tiered_kv.names import Tier

MIB = 1 << 20
C = report.Column
COLUMNS = [
    C("tier", 7, left=True), C("hybrid MiB", 10, ".2f"), C("full MiB", 9, ".2f"),
    C("full/hybrid", 11, ".2f"), C("hybrid ms", 9, ".2f"), C("full ms", 8, ".2f"),
    C("full/hybrid", 11, ".2f"), C("n", 2),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    d = Shape()
    p.add_argument("--tokens", type=int, nargs="+", help="prefix lengths (default 4096 32768)")
    p.add_argument("--repeats", type=int, help="restores per tier and model (default 5)")
    p.add_argument("--quick", action="store_true", help="1024 and 4096 tokens, 3 repeats")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--full-every", type=int, default=d.full_every)
    p.add_argument("--conv-kernel", type=int, default=d.conv_kernel)
    p.add_argument("--linear-heads", type=int, default=d.linear_heads)
    p.add_argument("--key-dim", type=int, default=d.key_dim)
    p.add_argument("--value-dim", type=int, default=d.value_dim)
    p.add_argument("--workdir", help="where the stores go (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = [1024, 4096] if args.quick else [4096, 32768]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    bad = [t for t in args.tokens if t <= 0 or t % args.page_size]
    if bad:
        p.error(f"--tokens {bad} must be positive multiples of --page-size {args.page_size}")
    if not 1 < args.full_every <= args.layers:
        p.error(f"--full-every {args.full_every} must be 2..--layers {args.layers}")
    if args.repeats < 1 or args.threads < 1:
        p.error(f"--repeats {args.repeats} and --threads {args.threads} must be >= 1")
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        args.layers, args.heads, args.head_dim, args.dtype, args.page_size, args.full_every,
        args.conv_kernel, args.linear_heads, args.key_dim, args.value_dim,
    )  # fmt: skip


def table(rows: list[Row]) -> list[str]:
    cells = [
        [r.tier, r.hybrid_bytes / MIB, r.full_bytes / MIB, r.bytes_ratio, r.hybrid_ms,
         r.full_ms, r.ms_ratio, len(r.full_samples_ms)]
        for r in rows
    ]  # fmt: skip
    return report.fixed_table(COLUMNS, cells)


def row_json(r: Row) -> dict:
    return {**r._asdict(), "bytes_ratio": r.bytes_ratio, "ms_ratio": r.ms_ratio}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # a caller's (a test session's) setting is its own


def run(args: argparse.Namespace) -> int:
    shape = shape_of(args)
    watch = machine.LoadWatch()
    info = machine.machine_info(torch.device("cpu"))
    cond = machine.condition_lines(info)
    print("\n".join(cond))
    print(shape.describe())
    limit = shape.layers / shape.full_layers
    rows: list[Row] = []
    with (
        exit_on_failure(),
        tempfile.TemporaryDirectory(prefix="tkv-hybrid-state-", dir=args.workdir) as workdir,
    ):
        for tokens in args.tokens:
            got = measure(shape, tokens, args.repeats, workdir, args.seed)
            rows += got
            state = got[0].hybrid_state_bytes
            print(f"\n{tokens} tokens (medians of {args.repeats}; every restore verified):")
            print("\n".join(table(got)))
            print(
                f"(hybrid state: one snapshot of {state / MIB:.2f} MiB, "
                f"{state / got[0].hybrid_bytes:.1%} of its device bytes; full/hybrid bytes tend "
                f"to {limit:.2f} as the prefix grows)"
            )
    device = [r for r in rows if r.tier == Tier.DEVICE]
    print(
        "\nfull/hybrid bytes per cached prefix (device): "
        + ", ".join(f"{r.tokens} tokens {r.bytes_ratio:.2f}x" for r in device)
    )
    print("storage restores read a warm page cache (the store was just written)")
    loads = watch.finish()
    print(f"load average before {loads['load_before']}, after {loads['load_after']}")
    noise = machine.noise_check(None, list(loads.values()))
    reasons = [f"{r.tokens} {r.tier} full: {x}" for r in rows for x in r.noise]
    reasons += list(noise.reasons)
    if reasons:
        print("noisy (read those times with care or rerun): " + "; ".join(reasons))
    details = {**info, **loads, "noise": reasons}
    payload = {"conditions": cond, "shape": shape, "rows": [row_json(r) for r in rows]}
    report.write_json(args.json, payload, config=report.config_of(args), machine=details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

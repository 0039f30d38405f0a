"""Benchmark of layer-wise loading: how soon is layer 0 of a host-resident prefix usable?

For a prefix of ``--tokens`` tokens resident in the host pool, three timings per repeat
(``tiered_kv.bench.layerwise``):

- ``full``: one ``load_to_device_all_layer`` call (every layer in one piece, no per-layer
  events) -- the baseline, measured in the same run, interleaved with the rest;
- ``layer0``: from ``DeviceHostTransfer.submit`` of the load job until the device pool's
  ``get_key_buffer(first layer)`` and ``get_value_buffer(first layer)`` return (they wait on
  the LayerDoneCounter's event for that layer only);
- ``all``: from the same start until the last layer's buffers return.

Layer-wise loading must make layer 0 usable after about 1/L of the full copy: the table prints
``layer0 / full`` next to ``1/L`` and ``layer0 * L / full`` (1.0 would be perfect; per-layer job
overhead pushes it up), and ``all / full`` (what the per-layer split costs in total). Medians
over ``--repeats``. Every repeat checks the loaded bytes against the source (every layer, K and
V, bit for bit); a mismatch aborts. A noisy baseline (``full``) is named under the table.

A second table loads a batch of ``--requests`` prefixes of irregular lengths (``--tokens`` in
all, ``tiered_kv.bench.batched_loads``) for one forward: one job per request (``begin`` one at a
time; layer 0 of the batch is usable only once the last job's layer 0 is) against one job for
the batch (``begin_many``), both against one all-layer copy of the same rows.

On CPU the copies run on the transfer worker's load thread (the same code drives a CUDA stream
with ``--device cuda``, where the consumer's wait is a GPU-side ``wait_event`` and the times
below are taken after a ``torch.cuda.synchronize``).

Run::

    .venv/bin/python benchmarks/bench_tiered.py --quick
    .venv/bin/python benchmarks/bench_tiered.py --json tiered.json
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from tiered_kv.bench import machine, report
from tiered_kv.bench.batched_loads import BatchRow, measure_batched
from tiered_kv.bench.layerwise import LAYOUTS, Row, measure_layerwise
from tiered_kv.bench.transfer import Geometry
from tiered_kv.bench.verify import exit_on_failure

C = report.Column
COLUMNS = [
    C("layout", 12, left=True), C("L", 3), C("tokens", 6), C("MiB", 7, ".1f"),
    C("full ms", 8, ".2f"), C("layer0 ms", 9, ".3f"), C("all ms", 8, ".2f"),
    C("layer0/full", 11, ".3f"), C("1/L", 6, ".3f"), C("layer0*L/full", 13, ".2f"),
    C("all/full", 8, ".2f"), C("n", 2),
]  # fmt: skip
BATCH_COLUMNS = [
    C("layout", 12, left=True), C("L", 3), C("reqs", 4), C("tokens", 6), C("full ms", 8, ".2f"),
    C("sep layer0*L/full", 17, ".2f"), C("sep all/full", 12, ".2f"),
    C("merged layer0*L/full", 20, ".2f"), C("merged all/full", 15, ".2f"), C("n", 2),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=4096, help="prefix length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument(
        "--requests", type=int, default=8, help="requests in the batch table (0: no batch table)"
    )
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
    if not 0 <= args.requests <= args.tokens // args.page_size:
        p.error(
            f"--requests {args.requests} must be 0..{args.tokens // args.page_size} (one page "
            "per request at least)"
        )
    args.layouts = [s for s in args.layouts.split(",") if s]
    bad = [s for s in args.layouts if s not in LAYOUTS]
    if bad:
        p.error(f"unknown layouts {bad}; use {', '.join(LAYOUTS)}")
    return args


def row_json(r: Row) -> dict:
    derived = {"layer0_ratio": r.layer0_ratio, "layer0_times_l": r.layer0_times_l}
    return {**asdict(r), **derived, "all_ratio": r.all_ratio}


def batch_json(r: BatchRow) -> dict:
    derived = {
        "separate_layer0_times_l": r.ratio(r.separate_layer0_ms, per_layer=True),
        "separate_all_ratio": r.ratio(r.separate_all_ms),
        "merged_layer0_times_l": r.ratio(r.merged_layer0_ms, per_layer=True),
        "merged_all_ratio": r.ratio(r.merged_all_ms),
    }
    return {**asdict(r), **derived}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    watch = machine.LoadWatch()
    info = machine.machine_info(device)
    cond = machine.condition_lines(info)
    print("\n".join(cond))
    geom = Geometry(args.layers, args.heads, args.head_dim, torch.float16)
    with exit_on_failure():
        rows = [
            measure_layerwise(
                geom, layout, args.tokens, args.page_size, args.repeats, device, args.seed
            )
            for layout in args.layouts
        ]
        batches = [
            measure_batched(
                geom, layout, args.tokens, args.requests, args.page_size, args.repeats, device,
                args.seed,
            )
            for layout in (args.layouts if args.requests else ())
        ]  # fmt: skip
    cells = [
        [r.layout, r.layers, r.tokens, r.mib, r.full_ms, r.layer0_ms, r.all_ms, r.layer0_ratio,
         1 / r.layers, r.layer0_times_l, r.all_ratio, r.repeats]
        for r in rows
    ]  # fmt: skip
    print()
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    print(
        "\n(medians; layer0*L/full = 1.0 means layer 0 was usable after exactly 1/L of the "
        "full copy's time; every repeat's bytes were verified)"
    )
    if batches:
        batch_cells = [
            [b.layout, b.layers, b.requests, b.tokens, b.full_ms,
             b.ratio(b.separate_layer0_ms, per_layer=True), b.ratio(b.separate_all_ms),
             b.ratio(b.merged_layer0_ms, per_layer=True), b.ratio(b.merged_all_ms), b.repeats]
            for b in batches
        ]  # fmt: skip
        print(f"\n{args.requests} requests' loads for one forward, {args.tokens} tokens in all:")
        print("\n".join(report.fixed_table(BATCH_COLUMNS, batch_cells)))
        print("(sep: one job per request; merged: one job for the batch, as begin_many)")
    loads = watch.finish()
    noise = machine.noise_check(None, list(loads.values()))
    reasons = [f"{r.layout} full: {x}" for r in rows for x in r.noise] + list(noise.reasons)
    reasons += [f"{b.layout} batch full: {x}" for b in batches for x in b.noise]
    if reasons:
        print("noisy (read those ratios with care or rerun): " + "; ".join(reasons))
    details = {**info, **loads, "noise": reasons}
    payload = {
        "conditions": cond,
        "rows": [row_json(r) for r in rows],
        "batches": [batch_json(b) for b in batches],
    }
    report.write_json(args.json, payload, config=report.config_of(args), machine=details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
    args.layouts = [s for s in args.layouts.split(",") if s]
    bad = [s for s in args.layouts if s not in LAYOUTS]
    if bad:
        p.error(f"unknown layouts {bad}; use {', '.join(LAYOUTS)}")
    return args


def row_json(r: Row) -> dict:
    derived = {"layer0_ratio": r.layer0_ratio, "layer0_times_l": r.layer0_times_l}
    return {**asdict(r), **derived, "all_ratio": r.all_ratio}


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
    loads = watch.finish()
    noise = machine.noise_check(None, list(loads.values()))
    reasons = [f"{r.layout} full: {x}" for r in rows for x in r.noise] + list(noise.reasons)
    if reasons:
        print("noisy (read those ratios with care or rerun): " + "; ".join(reasons))
    details = {**info, **loads, "noise": reasons}
    payload = {"conditions": cond, "rows": [row_json(r) for r in rows]}
    report.write_json(args.json, payload, config=report.config_of(args), machine=details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

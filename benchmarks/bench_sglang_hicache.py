"""SGLang 0.5.23's HiCacheController backing up (host -> store) and prefetching (store -> host)
through tiered_kv's HiCache backend against SGLang's own ``HiCacheFile``: same run, same shape,
alternating rounds, medians, the load average (``tiered_kv/bench/sglang_hicache.py`` says what is
timed and checked). The ratio is our GB/s over ``HiCacheFile``'s (above 1.0 ours is faster).

Needs SGLang, e.g. ``make sglang-venv``::

    .venv-sglang/bin/python benchmarks/bench_sglang_hicache.py            # MHA and MLA
    .venv-sglang/bin/python benchmarks/bench_sglang_hicache.py --quick    # seconds

Default shapes: one tensor-parallel rank of Llama-3-8B at TP 8 (32 layers, 1 KV head of 128,
bf16, 16 KiB per token) and DeepSeek-V3's MLA row (61 layers, 512 + 64, bf16), pages of 64
tokens, SGLang's default host layout ``page_first``. Without SGLang it says so and exits 3.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

STUBS = Path(__file__).resolve().parents[1] / "tools" / "sglang_peer" / "stubs"
EXIT_NO_SGLANG = 3
QUICK = {"pages": 4, "repeats": 2, "layers": 3, "page_size": 16}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", default="mha,mla", help="mha, mla or both (comma-separated)")
    p.add_argument("--layout", default="page_first",
                   choices=["page_first", "layer_first", "page_first_direct"])  # fmt: skip
    p.add_argument("--pages", type=int, default=128, help="pages per backup / prefetch")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="default 32 (MHA) / 61 (MLA)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--storage-layout", default="slab", choices=["slab", "lmdb"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default=None, help="where both stores write (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the rows and the machine here")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two rounds")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"mha", "mla"} or min(args.pages, args.repeats) < 1:
        p.error("--models takes mha and/or mla; --pages and --repeats must be >= 1")
    return args


def _sglang_ready() -> str | None:
    """None when SGLang's controller imports here (CPU stand-ins installed), else why not."""
    import importlib
    import importlib.util

    import torch

    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed here (make sglang-venv builds .venv-sglang)"
    if not torch.cuda.is_available() and str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
    try:
        importlib.import_module("sglang.srt.managers.cache_controller")
        if not torch.cuda.is_available():
            importlib.import_module("peer_kvcacheio_cpu").install()
    except Exception as exc:  # noqa: BLE001
        return f"SGLang's HiCache stack does not import here: {exc!r}"
    return None


def shape_for(model: str, args: argparse.Namespace):
    from tiered_kv.bench.sglang_rig import RigShape

    mla = model == "mla"
    layers = args.layers or (61 if mla else 32)
    return RigShape(
        mla, args.layout, page_size=args.page_size, layers=layers, heads=1, head_dim=128,
        kv_lora_rank=512, rope_dim=64, device_tokens=args.pages * args.page_size,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    why = _sglang_ready()
    if why is not None:
        print(why)
        raise SystemExit(EXIT_NO_SGLANG)
    import torch

    from tiered_kv.bench import machine, report
    from tiered_kv.bench.sglang_hicache import measure_hicache
    from tiered_kv.bench.verify import exit_on_failure

    info = machine.machine_info(torch.device("cpu"))
    print("\n".join(machine.condition_lines(info)))
    rows, loads = [], []
    with exit_on_failure():
        for model in args.models:
            with tempfile.TemporaryDirectory(prefix="tkv-sglang-", dir=args.workdir) as work:
                got, load = measure_hicache(
                    shape_for(model, args), args.pages, args.repeats, workdir=work,
                    seed=args.seed, storage_layout=args.storage_layout, progress=print,
                )  # fmt: skip
            rows += got
            loads.append(load)
            print(f"{model}: load average after its rounds {load}")
    table = [
        [r.model, r.layout, r.arm, r.op, r.pages, r.page_nbytes / 2**20, r.median_s * 1e3,
         r.gbps, r.ratio if r.ratio is not None else "-", r.repeats]
        for r in rows
    ]  # fmt: skip
    heads = ["model", "layout", "arm", "op", "pages", "page MiB", "median ms", "GB/s",
             "ratio", "rounds"]  # fmt: skip
    print(report.auto_table(heads, table))
    print("(medians; ratio = our GB/s over HiCacheFile's for the same op, same run)")
    out = {"rows": [asdict(r) for r in rows], "loads": loads, "machine": info,
           "config": report.config_of(args)}  # fmt: skip
    report.dump_json(args.json, out)
    return out


if __name__ == "__main__":
    main()

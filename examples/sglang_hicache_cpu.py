"""tiered_kv as SGLang 0.5.23's HiCache storage backend, on CPU, in one process.

SGLang's own ``HiCacheController``, driven as its radix cache drives it
(``tiered_kv.bench.sglang_rig``), loads ``TieredKVHiCacheStorage`` by module path from the same
extra config ``--hicache-storage-backend-extra-config`` takes. A first controller backs a
request's pages up (device -> host -> tiered_kv's store on disk) and detaches; a second one over
the same store, as after a server restart, prefetches them (store -> host), loads them to its
device pool and compares every byte with what the first one wrote.

Run it in the SGLang venv (``make sglang-venv``)::

    .venv-sglang/bin/python examples/sglang_hicache_cpu.py [--pages 8] [--store DIR]

On a CPU-only machine SGLang's module chain needs the stand-ins in ``tools/sglang_peer/stubs``
(two imports it never uses on CPU, and its host pools' copy ops); they go on ``sys.path`` here
only when torch has no CUDA. Exit status: 0 every page came back bit for bit, 1 not, 3 SGLang
is not importable in this interpreter.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

STUBS = Path(__file__).resolve().parents[1] / "tools" / "sglang_peer" / "stubs"
EXIT_NO_SGLANG = 3


def sglang_missing() -> str | None:
    """None when SGLang's controller imports here (CPU stand-ins installed), else why not."""
    if importlib.util.find_spec("sglang") is None:
        return (
            "SGLang is not installed here: make sglang-venv, then run with .venv-sglang/bin/python"
        )
    if not torch.cuda.is_available() and str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
    try:
        importlib.import_module("sglang.srt.managers.cache_controller")
        if not torch.cuda.is_available():
            importlib.import_module("peer_kvcacheio_cpu").install()
    except Exception as exc:  # noqa: BLE001 - any import failure: say it and stop
        return f"SGLang's HiCache stack does not import here: {exc!r}"
    return None


def extra_config(store: str, storage_bytes: int) -> dict:
    """What ``--hicache-storage-backend-extra-config`` takes (README, "tiered_kv as SGLang's
    HiCache storage backend"); the model id comes from SGLang's model name."""
    return {
        "backend_name": "tiered_kv",
        "module_path": "tiered_kv.integrations.sglang_hicache",
        "class_name": "TieredKVHiCacheStorage",
        "interface_v1": 1,
        "storage_path": store,
        "storage_bytes": storage_bytes,
    }


def round_trip(store: str, pages: int, seed: int) -> bool:
    """Back a request's pages up through one controller, restore them through another."""
    from tiered_kv.bench.sglang_rig import RigShape, SGLangRig

    shape = RigShape(mla=False, layout="page_first", page_size=16, layers=4, heads=2, head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 150_000, (pages * shape.page_size,), generator=gen).tolist()
    config = extra_config(store, 256 << 20)

    first = SGLangRig(shape, "dynamic", config, model_name="tiny-llama@r1")
    try:
        print(f"SGLang's {type(first.controller).__name__} loaded {type(first.backend).__name__}")
        device = first.fill_device(len(tokens), gen)  # the request's KV: fresh random bytes
        want = first.device_bytes(device)
        stored = first.backup(first.write_to_host(device), tokens)
    finally:
        first.close()
    print(f"backed up {stored} of {len(tokens)} tokens to {store}")

    second = SGLangRig(shape, "dynamic", config, model_name="tiny-llama@r1")  # a restart
    try:
        got, host = second.prefetch(tokens)
        back = second.device_bytes(second.load_to_device(host)) if host is not None else []
        stats = second.backend.storage_stats()
    finally:
        second.close()
    exact = len(back) == len(want) and all(
        torch.equal(a, b) for a, b in zip(back, want, strict=True)
    )
    print(
        f"after a restart: prefetched {got} tokens ({stats.hits} page hits, {stats.misses} "
        f"misses), loaded to the device: {'bit for bit' if exact else 'MISMATCH'}"
    )
    return exact and stored == got == len(tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=8, help="pages of the request (16 tokens)")
    parser.add_argument("--store", help="the store's directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    why = sglang_missing()
    if why is not None:
        print(why)
        return EXIT_NO_SGLANG
    where = nullcontext(args.store) if args.store else tempfile.TemporaryDirectory()
    with where as store:
        return 0 if round_trip(store, args.pages, args.seed) else 1


if __name__ == "__main__":
    sys.exit(main())

"""HiSparse: device bytes per request against the full layout, and the swap-in cost per step.

Memory: the full layout keeps every token's MLA latent and indexer key on the device; HiSparse
keeps a fixed buffer of ``topk`` slots plus a reserved page (rows of the DSA pool: latent and
indexer key) and, for scoring, the indexer keys of every token (``HiSparseIndexKeys``). Bytes
come from the pool's own formulas (its host declarations' ``bytes_per_token_per_layer``) at a
DeepSeek-V3.2-like geometry, and are checked against real allocations at smaller sizes.

Swap-in: a request of ``--tokens`` tokens admitted with a ``--topk`` buffer; each decode step,
every layer's selection keeps ``1 - churn`` of its previous tokens and picks the rest anew, and
``swap_in`` brings the missing ones from host. Its median time per step is set against two
baselines measured in the same step, right after it (numpy, one thread, destinations already
touched): ``copy``, one contiguous copy of the same bytes (the source just written, so hot in
cache up to its size); ``gather``, the same number of latent rows per layer, host slots and
destination rows picked at random, copied from the host buffer into random rows of an array
the size of one device layer (one native block copy per layer, numpy where the native copier
does not build), no bookkeeping: the memory cost of scattered rows, which a swap-in cannot
avoid. ``swap/gather`` is what the swapper adds on top.

Run::

    .venv/bin/python benchmarks/bench_hisparse_memory.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tiered_kv.bench import machine, report
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.host.hisparse_swap import HiSparseSwapper
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.kernels import native_available
from tiered_kv.kernels.transfer_native import copy_blocks

RANK, ROPE, INDEX_DIM = 512, 64, 128  # DeepSeek-V3.2: bf16 latent, fp8 indexer key + scales
MIB = 2**20
C = report.Column
MEMORY = [
    C("tokens", 7), C("full MiB", 9, ".1f"), C("buffer MiB", 10, ".1f"),
    C("index MiB", 9, ".1f"), C("HiSparse MiB", 12, ".1f"), C("saved MiB", 9, ".1f"),
    C("full/HiSparse", 13, ".2f"),
]  # fmt: skip
SWAP = [
    C("churn", 5, ".2f"), C("hits/step", 9, ".0f"), C("loaded/step", 11, ".0f"),
    C("swap ms/step", 12, ".2f"), C("gather ms", 9, ".2f"), C("copy ms", 7, ".2f"),
    C("swap/copy", 9, ".2f"), C("swap/gather", 11, ".2f"),
]  # fmt: skip


def gather_rows(out: np.ndarray, rows: np.ndarray, records: np.ndarray, picks: np.ndarray) -> None:
    """Rows ``picks`` of ``records`` into rows ``rows`` of ``out``: one native block copy (no
    temporary), numpy where the native copier does not build."""
    if not native_available():
        out[rows] = records[picks]
        return
    dst = out.ctypes.data + rows * out.strides[0]
    copy_blocks(dst, records.ctypes.data + picks * records.strides[0], out.strides[0])


def _ints(t: torch.Tensor) -> np.ndarray:
    return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()]).numpy()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16384, help="the swap-in request's context")
    p.add_argument("--swap-layers", type=int, default=4)
    p.add_argument("--churn", type=float, nargs="+", default=[0.05, 0.25, 1.0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--kernel-backend", default=None, help="host copies: torch, native, ...")
    p.add_argument(
        "--copy-mode", default="auto", help="swap-in copies: auto, blocks, numpy, kernel"
    )
    return p.parse_args(argv)


def per_token_bytes(page: int) -> tuple[int, int]:
    """(latent, indexer key) bytes per token and layer, from a DSA pool's declarations."""
    pool = DSATokenToKVPool(page, page, torch.bfloat16, RANK, ROPE, 1, index_head_dim=INDEX_DIM)
    kv, indexer = pool.host_pool_decls()
    return kv.bytes_per_token_per_layer, indexer.bytes_per_token_per_layer


def layout_bytes(tokens: int, layers: int, topk: int, page: int) -> tuple[int, int, int]:
    """(full layout, HiSparse buffer, HiSparse scoring keys) device bytes of one request."""
    lat, idx = per_token_bytes(page)
    full = tokens * layers * (lat + idx)
    buffer = (topk + page) * layers * (lat + idx)  # swap slots and the newest token's page
    return full, buffer, tokens * layers * idx


def check_formulas(page: int) -> None:
    """Allocate for real at small sizes: the pools' bytes (padding page excluded) must be the
    formulas'."""
    for tokens, layers, topk in ((1024, 3, 4 * page - page), (4096, 2, 8 * page - page)):
        full, buffer, index = layout_bytes(tokens, layers, topk, page)
        dense = DSATokenToKVPool(tokens, page, torch.bfloat16, RANK, ROPE, layers)
        lat, idx = per_token_bytes(page)
        got_full = sum(b.nbytes for b in dense.buffers()) - page * layers * (lat + idx)
        sparse = DSATokenToKVPool(topk + page, page, torch.bfloat16, RANK, ROPE, layers)
        alloc = HiSparseTokenToKVPoolAllocator(
            topk + page, page, torch.bfloat16, "cpu", sparse,
            host_to_device_ratio=tokens // (topk + page),
        )  # fmt: skip
        assert alloc.size == tokens
        keys = HiSparseIndexKeys(alloc, sparse)
        got_buffer = sum(b.nbytes for b in sparse.buffers()) - page * layers * (lat + idx)
        got_index = keys.nbytes - page * layers * idx
        if (got_full, got_buffer, got_index) != (full, buffer, index):
            raise SystemExit(f"formula check failed at {tokens} tokens x {layers} layers")


def memory_rows(args) -> list:
    rows = []
    for n in args.contexts:
        full, buffer, index = layout_bytes(n, args.layers, args.topk, args.page_size)
        sparse = buffer + index
        rows.append(
            [n, full / MIB, buffer / MIB, index / MIB, sparse / MIB, (full - sparse) / MIB,
             full / sparse]
        )  # fmt: skip
    return rows


def swap_rows(args) -> list:
    ps, n, layers, k = args.page_size, args.tokens, args.swap_layers, args.topk
    size = -(-n // ps) * ps + k + 2 * ps
    pool = DSATokenToKVPool(size, ps, torch.bfloat16, RANK, ROPE, layers)
    alloc = HiSparseTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", pool)
    host = HostPoolGroup(
        pool.host_pool_decls(), alloc, size_tokens=size, reserve_bytes=0,
        kernel_backend=args.kernel_backend,
    )  # fmt: skip
    keys = HiSparseIndexKeys(alloc, pool)
    for b in pool.buffers():
        b.view(torch.uint8).random_(0, 256)
    z = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([n])
    logical = alloc.alloc_extend(z, z.clone(), seq, seq.clone(), torch.tensor([-1]), n)
    host_slots = host.alloc(-(-n // ps) * ps)[:n]
    sw = HiSparseSwapper.admit(
        alloc, pool, host, keys, logical, host_slots, k, copy_mode=args.copy_mode
    )
    if sw is None:
        raise SystemExit("the device cannot hold the buffer")
    g = torch.Generator().manual_seed(0)
    sel = [torch.randperm(n, generator=g)[:k] for _ in range(layers)]
    for layer in range(layers):  # warm up: every layer's first selection resident
        sw.swap_in(layer, sel[layer])
    lat, _ = per_token_bytes(ps)
    latent = next(m for m in host.members if m.decl.name == "kv")
    records = [_ints(latent.part_view("kv")[i]).reshape(size, -1) for i in range(layers)]
    scratch = np.ones((size + ps, records[0].shape[1]), dtype=records[0].dtype)  # a layer
    rows = []
    for churn in args.churn:
        times, gathers, copies, hits, loaded = [], [], [], [], []
        for step in range(args.steps + 1):
            for layer in range(layers):
                stay = sel[layer][torch.randperm(k, generator=g)[: k - int(churn * k)]]
                out = torch.ones(n, dtype=torch.bool)
                out[stay] = False
                fresh = torch.nonzero(out).flatten()
                fresh = fresh[torch.randperm(fresh.numel(), generator=g)[: k - stay.numel()]]
                sel[layer] = torch.cat([stay, fresh])
            h0, l0 = sw.num_hits, sw.num_loaded
            t = time.perf_counter()
            for layer in range(layers):
                sw.swap_in(layer, sel[layer])
            took = time.perf_counter() - t
            moved = sw.num_loaded - l0
            picks = host_slots[torch.randperm(n, generator=g)[: moved // layers]].numpy()
            into = torch.randperm(size, generator=g)[: picks.size].numpy() + ps
            t = time.perf_counter()
            for layer in range(layers):
                gather_rows(scratch, into, records[layer], picks)
            gather = time.perf_counter() - t
            src = np.random.default_rng(step).integers(0, 256, max(1, moved * lat), np.uint8)
            dst = np.ones_like(src)
            t = time.perf_counter()
            np.copyto(dst, src)
            copy = time.perf_counter() - t
            if step:  # the first step is a warm-up
                times.append(took)
                gathers.append(gather)
                copies.append(copy)
                hits.append(sw.num_hits - h0)
                loaded.append(moved)
        if sw.num_failed:
            raise SystemExit(f"{sw.num_failed} swap-ins failed: {sw.last_error!r}")
        swap, gather = statistics.median(times), statistics.median(gathers)
        copy = statistics.median(copies)
        rows.append(
            [churn, statistics.median(hits), statistics.median(loaded), swap * 1e3,
             gather * 1e3, copy * 1e3, swap / copy, swap / gather]
        )  # fmt: skip
    sw.release()
    host.destroy()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(torch.device("cpu")))))
    check_formulas(args.page_size)
    lat, idx = per_token_bytes(args.page_size)
    print(
        f"\nper token and layer: latent {lat} B, indexer key {idx} B; {args.layers} layers, "
        f"topk {args.topk}, page {args.page_size} (formulas checked against real allocations)"
    )
    print("\n".join(report.fixed_table(MEMORY, memory_rows(args))))
    print(
        f"\nswap-in: {args.tokens} tokens, {args.swap_layers} layers, topk {args.topk} "
        f"(per step: every layer's swap_in; gather: as many random host rows per layer; copy: "
        f"one contiguous copy of the loaded bytes; copy mode {args.copy_mode})"
    )
    print("\n".join(report.fixed_table(SWAP, swap_rows(args))))
    print("(medians)")
    loads = watch.finish()
    print("load average: " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

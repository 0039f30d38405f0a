"""Benchmark of host <-> device page transfers: backup and load GB/s against a contiguous copy.

What is measured: for every host layout x page size x io backend (``kernel``, ``direct``) x
kernel backend behind ``kernel`` (``native``, ``torch``; ``triton`` with ``--with-triton``), the
wall time of

- ``backup``: one ``HostKVCache.backup_from_device_all_layer`` call (every layer of ``--tokens``
  device tokens into as many host slots);
- ``load``: ``load_to_device_per_layer`` once per layer, in layer order, timed as one loop (what a
  layer-wise load does in total), from those host slots into other device slots;
- ``load_all``: one ``load_to_device_all_layer`` call of the same transfer (no per-layer calls).

``time.perf_counter`` is read around the call (or loop) only, with the garbage collector off
during it (as in ``timeit``) and a ``torch.cuda.synchronize`` on each side with ``--device cuda``.
``direct`` does not use the kernel backend, so it has one row per layout and page size, with
kernel backend ``-``.

Each repeat draws fresh scattered indices with page granularity from a seeded generator (every
backend of a (page size, layout) sees the same draws): the device allocator's free list is
shuffled and ``alloc`` hands out the source pages of the backup and, disjoint from them, the
destination pages of the load; the host slots are the pages of a random permutation of the host
pool's pages. Device buffers hold random integers (NaN bit patterns included) from the start; the
host buffer is written once when the pool is built, so no timed call pays first-touch page faults.

Baseline, in the same run and interleaved with the measurements: right before every timed backup
and every timed load, one ``dst.copy_(src)`` of two contiguous tensors of exactly the bytes of
one transfer (allocated once; host and device tensors with ``--device cuda``, in the direction of
the transfer). A row's ratio is its GB/s over the median baseline GB/s of the same configuration
and direction. GB/s is 1e9 bytes per second; MiB is 2**20 bytes. Medians over ``--repeats``
repeats, or fewer (at least ``MIN_REPEATS``) for a slow row: a configuration stops repeating once
its timed backups and loads have taken ``--max-row-seconds`` (the torch reference and ``direct``
at page size 1 take about a second per transfer at the defaults); column ``n`` says how many ran.
A ``*`` after the ratio marks a window whose baseline samples spread by more than
``NOISY_SPREAD`` (max / min): the machine changed speed during it (on the shared 2-core VM this
was written on, the contiguous copy alternates between about 10.5 and 5 GB/s over tens of
seconds), so read that ratio with care or rerun. Each configuration starts with ``WARMUP_ROUNDS``
round (baseline, backup, baseline, load) whose times are dropped: right after a host pool is
built the first copies on that VM ran up to 2x slower, the baseline included.

Correctness is checked once per configuration outside the timing, on its own draw: after a
backup, a sample of tokens read through ``host.part_view`` (every part and layer) must equal the
device rows bit for bit; after loading the first layer, the last layer's destination rows must be
untouched; after loading every layer, the destination rows must equal the source rows bit for
bit (every token, part and layer). A mismatch or an exception aborts the run.

The target (issue): ``page_first`` backup and load with page size >= 16 at >= 0.8 of the
contiguous copy; the ``target`` section lists PASS/MISS per row.

On CPU Triton runs under its interpreter, far too slow for these sizes: ``--with-triton`` adds
``triton`` rows at ``--triton-tokens`` tokens (rounded up to a page) and at most
``TRITON_MAX_REPEATS`` repeats, no warm-up, only (their ratios are not speed figures). About
1 ms per copied row under the interpreter: some 90 s more at the default geometry.

Run::

    .venv/bin/python benchmarks/bench_transfer.py --quick
    .venv/bin/python benchmarks/bench_transfer.py --json results.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform as py_platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

import numpy as np
import psutil
import torch

from tiered_kv import platform
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import BackendUnavailableError
from tiered_kv.host import HostKVCache, HostLayout, host_pool_for

LAYOUTS = tuple(x.value for x in HostLayout)
IO_BACKENDS = ("kernel", "direct")
KERNEL_BACKENDS = ("native", "torch", "triton")
DIRECTIONS = ("backup", "load", "load_all")
NO_KERNEL = "-"  # the kernel-backend label of 'direct' rows
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    **{n: getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)},
}
TARGET_LAYOUT = "page_first"
TARGET_MIN_PAGE = 16
TARGET_RATIO = 0.8
QUICK = {"tokens": 512, "pool_tokens": 2048, "repeats": 3}
TRITON_MAX_REPEATS = 2
MIN_REPEATS = 3
WARMUP_ROUNDS = 1
NOISY_SPREAD = 1.5
VERIFY_SAMPLE_TOKENS = 256
MIB = 1 << 20
GIB = 1 << 30

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's width (bit-exact comparisons)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def sentinel_for(dtype: torch.dtype) -> int:
    """All bits set, as the integer view of ``dtype`` holds it; the random fill (``random_``
    draws non-negative integers) never produces it for dtypes wider than a byte."""
    return 255 if torch.empty((), dtype=dtype).element_size() == 1 else -1


@dataclass
class Row:
    layout: str
    page_size: int
    io_backend: str
    kernel_backend: str
    direction: str
    tokens: int
    nbytes: int
    mib: float
    median_ms: float
    gbps: float
    baseline_gbps: float
    ratio: float
    repeats: int
    baseline_spread: float  # max / min of the baseline samples of the window
    verified: bool
    interpreted: bool  # Triton under its interpreter (CPU): tiny size, not a speed figure
    target: str | None  # PASS / MISS for the target rows, else None
    samples_ms: list[float] = field(default_factory=list)
    baseline_samples_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Combo:
    """One table configuration's backends: io backend, row label, kernel backend to build with."""

    io_backend: str
    label: str
    build_backend: str


@dataclass
class Setup:
    """What every configuration of one page size shares."""

    pool: KVCache
    alloc: PagedTokenToKVPoolAllocator
    decl: HostPoolDecl
    baseline: Baseline
    device: torch.device
    sampled: int = 0  # host tokens compared by the verification so far


@dataclass(frozen=True)
class Draw:
    """One repeat's indices: backup source (device), host slots, load destination (device)."""

    dev_src: torch.Tensor
    host: torch.Tensor
    dev_dst: torch.Tensor


# -- arguments -------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of ints >= 1")
    return values


def _choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip().lower() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(values))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads (MHA/GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--mla", action="store_true", help="an MLA pool instead of MHA")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="with --mla")
    p.add_argument("--qk-rope-head-dim", type=int, default=64, help="with --mla")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per transfer")
    p.add_argument("--pool-tokens", type=int, default=8192, help="device and host pool tokens")
    p.add_argument("--page-sizes", type=_int_list, default=[1, 16, 64])
    p.add_argument("--layouts", type=_choice_list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--io-backends", type=_choice_list(IO_BACKENDS), default=list(IO_BACKENDS))
    p.add_argument(
        "--kernel-backends",
        type=_choice_list(KERNEL_BACKENDS),
        default=["native", "torch"],
        help="behind io backend 'kernel' (triton on CPU: interpreted, at --triton-tokens)",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed transfers per row (median)")
    p.add_argument(
        "--max-row-seconds",
        type=float,
        default=4.0,
        help=f"stop repeating a row (after at least {MIN_REPEATS}) once its transfers took this",
    )
    p.add_argument(
        "--with-triton",
        action="store_true",
        help="add the triton kernel backend (on CPU: interpreted, at --triton-tokens only)",
    )
    p.add_argument(
        "--triton-tokens",
        type=int,
        default=16,
        help="tokens of interpreted triton rows (rounded up to a page)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list of dicts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.with_triton and "triton" not in args.kernel_backends:
        args.kernel_backends.append("triton")
    positive = ("layers", "heads", "head_dim", "kv_lora_rank", "tokens", "pool_tokens")
    for name in (*positive, "repeats", "triton_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_row_seconds < 0:
        p.error("--max-row-seconds must be >= 0")
    if args.qk_rope_head_dim < 0:
        p.error("--qk-rope-head-dim must be >= 0")
    for page in args.page_sizes:
        for name in ("tokens", "pool_tokens"):
            if getattr(args, name) % page:
                p.error(f"--{name.replace('_', '-')} must be a multiple of every page size")
    triton_max = max(-(-args.triton_tokens // p) * p for p in args.page_sizes)
    if args.pool_tokens < 2 * max(args.tokens, triton_max):
        p.error("--pool-tokens must be >= 2 * --tokens (the load goes to other device pages)")
    return args


# -- setup -----------------------------------------------------------------------------------
def make_pool(args: argparse.Namespace, page_size: int, device: torch.device) -> KVCache:
    dtype = DTYPES[args.dtype]
    if args.mla:
        return MLATokenToKVPool(
            args.pool_tokens,
            page_size,
            dtype,
            args.kv_lora_rank,
            args.qk_rope_head_dim,
            args.layers,
            device,
        )
    return MHATokenToKVPool(
        args.pool_tokens, page_size, dtype, args.heads, args.head_dim, args.layers, device
    )


def fill_random(pool: KVCache, seed: int) -> None:
    """Random integers in every buffer (each layer and part different), bit patterns of NaN and
    inf included: a lost or misplaced row cannot go unnoticed."""
    gen = torch.Generator(device=pool.device)
    gen.manual_seed(seed)
    for buf in pool.buffers():
        int_view(buf).random_(generator=gen)


def geometry_line(args: argparse.Namespace, pool: KVCache) -> str:
    per_layer = pool.bytes_per_token_per_layer()
    per_token = per_layer * args.layers
    kind = (
        f"MLA: layers {args.layers}, kv_lora_rank {args.kv_lora_rank}, "
        f"qk_rope_head_dim {args.qk_rope_head_dim}"
        if args.mla
        else f"MHA: layers {args.layers}, kv heads {args.heads}, head_dim {args.head_dim}"
    )
    return (
        f"{kind}, {args.dtype}: {per_layer} B per token per layer, {per_token} B per "
        f"token; transfer {args.tokens} tokens = {args.tokens * per_token / MIB:.1f} MiB per "
        f"direction; device pool and host pool {args.pool_tokens} tokens "
        f"({args.pool_tokens * per_token / GIB:.2f} GiB) each"
    )


def combos(args: argparse.Namespace) -> list[Combo]:
    out = []
    if "kernel" in args.io_backends:
        out += [Combo("kernel", kb, kb) for kb in args.kernel_backends]
    if "direct" in args.io_backends:
        out.append(Combo("direct", NO_KERNEL, "torch"))  # direct never calls the kernel backend
    return out


def available_combos(all_combos: list[Combo], device: torch.device) -> list[Combo]:
    usable = []
    for c in all_combos:
        try:
            platform.kernel_backend(device, c.build_backend, native_ok=True)
        except BackendUnavailableError as exc:
            print(f"skipping kernel backend {c.build_backend}: {exc}", file=sys.stderr)
            continue
        usable.append(c)
    return usable


def interpreted(combo: Combo, device: torch.device) -> bool:
    return combo.build_backend == "triton" and device.type == "cpu"


def make_host(
    decl: HostPoolDecl, alloc: PagedTokenToKVPoolAllocator, layout: str, size: int, backend: str
) -> HostKVCache:
    host = host_pool_for(decl, alloc, layout=layout, size_tokens=size, kernel_backend=backend)
    int_view(host.buffer).fill_(sentinel_for(host.buffer.dtype))  # first touch, untimed
    return host


def config_generator(seed: int, page_size: int, layout: str, salt: int) -> torch.Generator:
    """The same draws for every backend of a (page size, layout)."""
    gen = torch.Generator()
    gen.manual_seed(((seed * 1_000_003 + page_size) * 10_007 + LAYOUTS.index(layout)) * 7 + salt)
    return gen


def draw(
    gen: torch.Generator, alloc: PagedTokenToKVPoolAllocator, host: HostKVCache, tokens: int
) -> Draw:
    """Scattered pages: device pages from a shuffled free list (two disjoint sets), host pages
    from a random permutation; slots page-expanded."""
    page = alloc.page_size
    alloc.clear()
    perm = torch.randperm(alloc.num_pages, generator=gen) + 1
    alloc.free_pages = perm.to(alloc.device)
    dev_src, dev_dst = alloc.alloc(tokens), alloc.alloc(tokens)
    if dev_src is None or dev_dst is None:
        raise SystemExit("device pool too small for two transfers (script bug)")
    pages = torch.randperm(host.num_pages, generator=gen)[: tokens // page]
    host_idx = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    return Draw(dev_src, host_idx, dev_dst)


# -- timing ----------------------------------------------------------------------------------
def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Seconds of one call of ``fn``, with the garbage collector off (as ``timeit`` does)."""
    sync()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return elapsed


class Baseline:
    """Contiguous tensors of exactly one transfer's bytes, allocated once per size. On CPU one
    pair serves both directions; on CUDA backup copies device -> host and load host -> device."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if nbytes not in self._pairs:
            numel = nbytes // torch.empty((), dtype=self.dtype).element_size()
            cuda = self.device.type == "cuda"
            dev = torch.empty(numel, dtype=self.dtype, device=self.device)
            host = torch.empty(numel, dtype=self.dtype, pin_memory=cuda)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.seed)
            int_view(dev).random_(generator=gen)
            int_view(host).zero_()
            self._pairs[nbytes] = (dev, host)
        return self._pairs[nbytes]

    def copy_fn(self, nbytes: int, direction: str) -> Callable[[], object]:
        dev, host = self._pair(nbytes)
        dst, src = (host, dev) if direction == "backup" else (dev, host)
        return lambda: dst.copy_(src)


# -- correctness -----------------------------------------------------------------------------
def fail(where: str, what: str) -> NoReturn:
    raise SystemExit(f"CORRECTNESS FAILURE [{where}]: {what}")


def first_bad_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Indices (along dim 0) of the rows where ``a`` and ``b`` differ."""
    return torch.nonzero((a != b).reshape(a.shape[0], -1).any(dim=1))[:, 0]


def check_host_sample(
    where: str, host: HostKVCache, d: Draw, gen: torch.Generator, decl: HostPoolDecl
) -> int:
    """A sample of backed-up tokens, read through ``part_view``, equals the device rows."""
    page = host.page_size
    n = d.host.numel()
    pos = torch.randperm(n, generator=gen)[: min(n, VERIFY_SAMPLE_TOKENS)]
    h = d.host[pos]
    dev_rows = d.dev_src[pos]
    for part in decl.parts:
        view = int_view(host.part_view(part.name))
        if host.layout is HostLayout.PAGE_FIRST_DIRECT:
            got = view[:, h // page, h % page]
        else:
            got = view[:, h]
        for layer in range(decl.layer_num):
            want = int_view(part.buffer(layer))[dev_rows].cpu()
            bad = first_bad_rows(got[layer], want)
            if bad.numel():
                i = int(bad[0])
                fail(
                    where,
                    f"backup: part {part.name!r} layer {layer}: host slot {int(h[i])} does not "
                    f"hold device slot {int(dev_rows[i])} ({bad.numel()} of {pos.numel()} "
                    "sampled tokens differ)",
                )
    return int(pos.numel())


def check_device_rows(
    where: str, what: str, decl: HostPoolDecl, layers: range, d: Draw, sentinel: int | None
) -> None:
    """Destination rows equal the source rows (or, with ``sentinel``, still hold it)."""
    for part in decl.parts:
        for layer in layers:
            buf = int_view(part.buffer(layer))
            got = buf[d.dev_dst]
            want = torch.full_like(got, sentinel) if sentinel is not None else buf[d.dev_src]
            bad = first_bad_rows(got, want)
            if bad.numel():
                i = int(bad[0])
                expected = (
                    "the sentinel (it must be untouched)"
                    if sentinel is not None
                    else f"the bytes of device slot {int(d.dev_src[i])} (host slot "
                    f"{int(d.host[i])})"
                )
                fail(
                    where,
                    f"{what}: part {part.name!r} layer {layer}: device slot {int(d.dev_dst[i])} "
                    f"does not hold {expected}; {bad.numel()} of {d.dev_dst.numel()} tokens "
                    "differ",
                )


def verify_config(
    where: str,
    pool: KVCache,
    decl: HostPoolDecl,
    alloc: PagedTokenToKVPoolAllocator,
    host: HostKVCache,
    io_backend: str,
    tokens: int,
    gen: torch.Generator,
) -> int:
    """Backup, then a layer-wise load into other device slots, on one draw; abort on mismatch.
    Returns the number of host tokens compared after the backup."""
    d = draw(gen, alloc, host, tokens)
    sentinel = sentinel_for(decl.dtype)
    for part in decl.parts:
        for layer in range(decl.layer_num):
            int_view(part.buffer(layer))[d.dev_dst] = sentinel
    try:
        host.backup_from_device_all_layer(pool, d.host, d.dev_src, io_backend)
        sampled = check_host_sample(where, host, d, gen, decl)
        layer_ids = decl.layer_ids
        host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_ids[0], io_backend)
        if decl.layer_num > 1:
            last = range(decl.layer_num - 1, decl.layer_num)
            check_device_rows(where, "load of layer 0 only", decl, last, d, sentinel)
        for layer_id in layer_ids[1:]:
            host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_id, io_backend)
    except SystemExit:
        raise
    except Exception as exc:
        traceback.print_exc()
        fail(where, f"the transfer raised {type(exc).__name__}: {exc}")
    check_device_rows(where, "load", decl, range(decl.layer_num), d, None)
    return sampled


# -- one configuration -------------------------------------------------------------------------
def measure(
    ctx: Setup,
    host: HostKVCache,
    io: str,
    tokens: int,
    nbytes: int,
    repeats: int,
    budget_s: float,
    warmup: int,
    gen: torch.Generator,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per timed backup and load, and of the baseline copy right before each; up to
    ``repeats`` rounds, stopping after ``MIN_REPEATS`` once the transfers took ``budget_s``,
    after ``warmup`` rounds whose times are dropped."""
    pool, decl, sync = ctx.pool, ctx.decl, make_sync(ctx.device)
    times: dict[str, list[float]] = {k: [] for k in DIRECTIONS}
    base: dict[str, list[float]] = {k: [] for k in DIRECTIONS}

    def backup(d: Draw) -> None:
        host.backup_from_device_all_layer(pool, d.host, d.dev_src, io)

    def load(d: Draw) -> None:
        for layer_id in decl.layer_ids:
            host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_id, io)

    def load_all(d: Draw) -> None:
        host.load_to_device_all_layer(pool, d.host, d.dev_dst, io)

    fns = {"backup": backup, "load": load, "load_all": load_all}
    for i in range(-warmup, repeats):
        d = draw(gen, ctx.alloc, host, tokens)
        for direction in DIRECTIONS:
            b = timed(ctx.baseline.copy_fn(nbytes, direction), sync)
            t = timed(functools.partial(fns[direction], d), sync)
            if i >= 0:
                base[direction].append(b)
                times[direction].append(t)
        spent = sum(sum(t) for t in times.values())
        if i + 1 >= MIN_REPEATS and spent >= budget_s:
            break
    return times, base


def bench_config(
    ctx: Setup, layout: str, combo: Combo, page_size: int, args: argparse.Namespace
) -> list[Row]:
    pool, alloc, decl, device = ctx.pool, ctx.alloc, ctx.decl, ctx.device
    tiny = interpreted(combo, device)
    tokens = -(-args.triton_tokens // page_size) * page_size if tiny else args.tokens
    repeats = min(args.repeats, TRITON_MAX_REPEATS) if tiny else args.repeats
    nbytes = tokens * decl.layer_num * decl.bytes_per_token_per_layer
    where = (
        f"layout={layout} page_size={page_size} io_backend={combo.io_backend} "
        f"kernel_backend={combo.label} seed={args.seed}"
    )
    host = make_host(decl, alloc, layout, args.pool_tokens, combo.build_backend)
    try:
        ctx.sampled += verify_config(
            where,
            pool,
            decl,
            alloc,
            host,
            combo.io_backend,
            tokens,
            config_generator(args.seed, page_size, layout, salt=1),
        )
        gen = config_generator(args.seed, page_size, layout, salt=0)
        times, base = measure(
            ctx,
            host,
            combo.io_backend,
            tokens,
            nbytes,
            repeats,
            args.max_row_seconds,
            0 if tiny else WARMUP_ROUNDS,
            gen,
        )
    finally:
        host.destroy()  # frees the buffer now; the pool object goes with this frame
        gc.collect()
    rows = []
    for direction in DIRECTIONS:
        t = statistics.median(times[direction])
        b = statistics.median(base[direction])
        gbps, base_gbps = nbytes / t / 1e9, nbytes / b / 1e9
        is_target = layout == TARGET_LAYOUT and page_size >= TARGET_MIN_PAGE and not tiny
        ratio = gbps / base_gbps
        rows.append(
            Row(
                layout=layout,
                page_size=page_size,
                io_backend=combo.io_backend,
                kernel_backend=combo.label,
                direction=direction,
                tokens=tokens,
                nbytes=nbytes,
                mib=nbytes / MIB,
                median_ms=t * 1e3,
                gbps=gbps,
                baseline_gbps=base_gbps,
                ratio=ratio,
                repeats=len(times[direction]),
                baseline_spread=max(base[direction]) / min(base[direction]),
                verified=True,
                interpreted=tiny,
                target=("PASS" if ratio >= TARGET_RATIO else "MISS") if is_target else None,
                samples_ms=[x * 1e3 for x in times[direction]],
                baseline_samples_ms=[x * 1e3 for x in base[direction]],
            )
        )
    return rows


# -- output ----------------------------------------------------------------------------------
def machine_conditions(device: torch.device) -> list[str]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    mem = psutil.virtual_memory()
    native = platform.native_available()
    return [
        f"python {py_platform.python_version()} on {py_platform.platform()}",
        f"torch {torch.__version__} (intra-op threads {torch.get_num_threads()}), "
        f"numpy {np.__version__}",
        f"native block copier available: {native}",
        f"device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        f"cpu count {os.cpu_count()} (usable {affinity})",
        "load average " + (" ".join(f"{v:.2f}" for v in load) if load else "unavailable"),
        f"RAM total {mem.total / GIB:.1f} GiB, available {mem.available / GIB:.1f} GiB",
    ]


HEADER = (
    f"{'layout':<17} {'page_size':>9} {'io_backend':<10} {'kernel_backend':<14} "
    f"{'direction':<9} {'MiB':>7} {'median_ms':>10} {'GB/s':>7} {'baseline GB/s':>13} "
    f"{'ratio':>6}  {'n':>2}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.layout:<17} {r.page_size:>9} {r.io_backend:<10} {r.kernel_backend:<14} "
        f"{r.direction:<9} {r.mib:>7.1f} {r.median_ms:>10.2f} {r.gbps:>7.2f} "
        f"{r.baseline_gbps:>13.2f} {r.ratio:>6.2f}{'*' if noisy(r) else ' '} {r.repeats:>2}"
    )


def noisy(r: Row) -> bool:
    return r.baseline_spread > NOISY_SPREAD


def row_key(r: Row) -> tuple:
    kb = KERNEL_BACKENDS.index(r.kernel_backend) if r.kernel_backend in KERNEL_BACKENDS else 99
    return (
        LAYOUTS.index(r.layout),
        r.page_size,
        IO_BACKENDS.index(r.io_backend),
        kb,
        DIRECTIONS.index(r.direction),
    )


def target_lines(rows: list[Row]) -> list[str]:
    lines = [
        f"target: {TARGET_LAYOUT} backup and load, page size >= {TARGET_MIN_PAGE}, ratio >= "
        f"{TARGET_RATIO} of the contiguous copy"
    ]
    targets = sorted((r for r in rows if r.target is not None), key=row_key)
    if not targets:
        lines.append(f"  no rows qualify (no {TARGET_LAYOUT} row with page size >= 16)")
        return lines
    for r in targets:
        lines.append(
            f"  page_size={r.page_size:<3} io_backend={r.io_backend:<6} "
            f"kernel_backend={r.kernel_backend:<6} {r.direction:<6} ratio {r.ratio:5.2f}  "
            f"{r.target}" + ("  (* noisy baseline window)" if noisy(r) else "")
        )
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in targets:
        groups.setdefault((r.io_backend, r.kernel_backend, r.direction), []).append(r)
    lines.append("  per (io_backend, kernel_backend, direction), all page sizes >= 16:")
    for (io, kb, direction), rs in groups.items():
        ok = all(r.target == "PASS" for r in rs)
        worst = min(r.ratio for r in rs)
        lines.append(
            f"    {io:<6} {kb:<6} {direction:<6} {'PASS' if ok else 'MISS'} (lowest ratio "
            f"{worst:.2f})"
        )
    passed = sum(r.target == "PASS" for r in targets)
    lines.append(f"  {passed} of {len(targets)} target rows PASS")
    return lines


def print_report(rows: list[Row]) -> None:
    print(HEADER)
    print("-" * len(HEADER))
    for r in sorted(rows, key=row_key):
        print(format_row(r))
    if any(noisy(r) for r in rows):
        print(
            f"* baseline samples of this window spread by more than {NOISY_SPREAD}x (max / min): "
            "the machine changed speed during it; read the ratio with care"
        )
    tiny = sorted({r.tokens for r in rows if r.interpreted})
    if tiny:
        print(
            f"(triton rows run under the interpreter at {', '.join(map(str, tiny))} tokens: a "
            "correctness path, not a speed figure; they are not target rows)"
        )
    print()
    print("\n".join(target_lines(rows)))


# -- driver ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = platform.resolve_device(args.device)
    print("\n".join(machine_conditions(device)))
    all_combos = available_combos(combos(args), device)
    rows: list[Row] = []
    started = time.perf_counter()
    baseline: Baseline | None = None
    configs = 0
    sampled = 0
    for page_size in args.page_sizes:
        pool = make_pool(args, page_size, device)
        alloc = PagedTokenToKVPoolAllocator(
            args.pool_tokens, page_size, pool.dtype, device, kvcache=pool
        )
        if baseline is None:
            print(geometry_line(args, pool))
            print(
                f"repeats {args.repeats} (median; fewer, at least {MIN_REPEATS}, once a row's "
                f"transfers took {args.max_row_seconds:g} s), seed {args.seed}"
                f"{', quick' if args.quick else ''}; layouts {', '.join(args.layouts)}; "
                f"page sizes {', '.join(map(str, args.page_sizes))}; backends "
                + ", ".join(f"{c.io_backend}/{c.label}" for c in all_combos)
            )
            print(flush=True)
            baseline = Baseline(device, pool.store_dtype, args.seed)
        fill_random(pool, args.seed * 31 + page_size)
        ctx = Setup(pool, alloc, pool.host_pool_decls()[0], baseline, device)
        for layout in args.layouts:
            for combo in all_combos:
                rows.extend(bench_config(ctx, layout, combo, page_size, args))
                configs += 1
                print(
                    f"  done page_size={page_size} layout={layout} "
                    f"{combo.io_backend}/{combo.label} at {time.perf_counter() - started:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
        sampled += ctx.sampled
        del ctx, pool, alloc
        gc.collect()
    print_report(rows)
    print()
    print(
        f"correctness: all {configs} configurations verified (backup: {sampled} sampled host "
        "tokens x every part and layer; load: every token, part and layer); total "
        f"{time.perf_counter() - started:.1f}s"
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if load:
        print("load average at end " + " ".join(f"{v:.2f}" for v in load))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)
    return rows


if __name__ == "__main__":
    main()

"""The transfer benchmark's table: every page size x layout x backend combination, verified.

``run_suite`` builds one device pool per page size, and per layout and backend combination a
host pool (``transfer.make_host``), checks it (``transfer_check.verify_transfer``) and measures
it (``transfer.measure_transfer``) into one ``Row`` per direction. A row's ``noise`` lists why
its baseline window is noisy (``machine.noise_check``). Target rows (``page_first``, page size
>= 16, not interpreted) say PASS when their ratio is >= ``TARGET_RATIO``.

Triton on CPU runs under its interpreter, far too slow for real sizes: its rows move
``triton_tokens`` tokens (rounded up to a page), at most ``TRITON_MAX_REPEATS`` times, with no
warm-up; they are a correctness path, not a speed figure.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tiered_kv import platform
from tiered_kv.bench.machine import noise_check
from tiered_kv.bench.transfer import (
    DIRECTIONS,
    WARMUP_ROUNDS,
    ContiguousBaseline,
    Geometry,
    TransferCase,
    config_generator,
    make_allocator,
    make_host,
    make_pool,
    measure_transfer,
)
from tiered_kv.bench.transfer_check import verify_transfer
from tiered_kv.bench.verify import fill_random
from tiered_kv.errors import BackendUnavailableError
from tiered_kv.kernels import native_build
from tiered_kv.names import HostLayout, IOBackend

KERNEL_BACKENDS = ("native", "torch", "triton")
NO_KERNEL = "-"  # the kernel-backend label of 'direct' rows
TARGET_LAYOUT = HostLayout.PAGE_FIRST.value
TARGET_MIN_PAGE = 16
TARGET_RATIO = 0.8
TRITON_MAX_REPEATS = 2
MIB = 1 << 20


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
    noise: list[str] = field(default_factory=list)  # why the baseline window is noisy, if it is


@dataclass(frozen=True)
class Combo:
    """One table configuration's backends: io backend, row label, kernel backend to build with."""

    io_backend: str
    label: str
    build_backend: str


@dataclass(frozen=True)
class Settings:
    """What the suite measures (the script's arguments)."""

    geometry: Geometry
    tokens: int
    pool_tokens: int
    page_sizes: Sequence[int]
    layouts: Sequence[str]
    repeats: int
    max_row_seconds: float
    triton_tokens: int
    seed: int


def combos(
    io_backends: Sequence[str], kernel_backends: Sequence[str], device: torch.device
) -> list[Combo]:
    """The usable backend combinations (a kernel backend this process cannot run is skipped,
    with a line on stderr)."""
    out = []
    if IOBackend.KERNEL in io_backends:
        out += [Combo(IOBackend.KERNEL.value, kb, kb) for kb in kernel_backends]
    if IOBackend.DIRECT in io_backends:
        # direct never calls the kernel backend
        out.append(Combo(IOBackend.DIRECT.value, NO_KERNEL, "torch"))
    usable = []
    for c in out:
        try:
            platform.kernel_backend(device, c.build_backend, native=native_build.error)
        except BackendUnavailableError as exc:
            print(f"skipping kernel backend {c.build_backend}: {exc}", file=sys.stderr)
            continue
        usable.append(c)
    return usable


def bench_config(
    case: TransferCase, layout: str, combo: Combo, s: Settings, tiny: bool
) -> tuple[list[Row], int]:
    """Verify, then measure one configuration (destroys its host pool after); the rows and the
    host tokens verified."""
    page_size = case.pool.page_size
    where = (
        f"layout={layout} page_size={page_size} io_backend={combo.io_backend} "
        f"kernel_backend={combo.label} seed={s.seed}"
    )
    repeats = min(s.repeats, TRITON_MAX_REPEATS) if tiny else s.repeats
    try:
        sampled = verify_transfer(where, case, config_generator(s.seed, page_size, layout, 1))
        gen = config_generator(s.seed, page_size, layout, salt=0)
        warmup = 0 if tiny else WARMUP_ROUNDS
        results = measure_transfer(case, repeats, gen, warmup=warmup, budget_s=s.max_row_seconds)
    finally:
        case.host.destroy()  # frees the buffer now
        gc.collect()
    rows = []
    is_target = layout == TARGET_LAYOUT and page_size >= TARGET_MIN_PAGE and not tiny
    for direction in DIRECTIONS:
        r = results[direction]
        ratio = r.ratio
        rows.append(
            Row(
                layout, page_size, combo.io_backend, combo.label, direction, case.tokens,
                r.nbytes, r.nbytes / MIB, r.median_s * 1e3, r.gbps, r.baseline_gbps, ratio,
                len(r.seconds), r.baseline_spread, True, tiny,
                ("PASS" if ratio >= TARGET_RATIO else "MISS") if is_target else None,
                [x * 1e3 for x in r.seconds], [x * 1e3 for x in r.baseline],
                list(noise_check(r.baseline).reasons),
            )
        )  # fmt: skip
    return rows, sampled


def run_suite(
    s: Settings,
    all_combos: Sequence[Combo],
    device: torch.device,
    progress: Callable[[str], None] = lambda _line: None,
) -> tuple[list[Row], int, int]:
    """Every configuration; returns the rows, the configurations verified and the host tokens
    compared by the verification."""
    rows: list[Row] = []
    started = time.perf_counter()
    baseline: ContiguousBaseline | None = None
    configs = sampled = 0
    for page_size in s.page_sizes:
        pool = make_pool(s.geometry, s.pool_tokens, page_size, device)
        alloc = make_allocator(pool, s.pool_tokens)
        decl = pool.host_pool_decls()[0]
        if baseline is None:
            baseline = ContiguousBaseline(device, pool.store_dtype, s.seed)
        fill_random(pool.buffers(), s.seed * 31 + page_size, device)
        for layout in s.layouts:
            for combo in all_combos:
                tiny = combo.build_backend == "triton" and device.type == "cpu"
                tokens = -(-s.triton_tokens // page_size) * page_size if tiny else s.tokens
                host = make_host(decl, alloc, layout, s.pool_tokens, combo.build_backend)
                case = TransferCase(pool, decl, alloc, host, combo.io_backend, tokens, baseline)
                got, n = bench_config(case, layout, combo, s, tiny)
                del case, host
                rows += got
                sampled += n
                configs += 1
                progress(
                    f"done page_size={page_size} layout={layout} "
                    f"{combo.io_backend}/{combo.label} at {time.perf_counter() - started:.1f}s"
                )
        del pool, alloc, decl
        gc.collect()
    return rows, configs, sampled

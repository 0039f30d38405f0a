"""Device <-> host page transfers, timed against a contiguous copy of the same bytes.

Per configuration (a device pool, a host pool of one layout, an io backend), ``measure_transfer``
times, round after round:

- ``backup``: one ``HostKVCache.backup_from_device_all_layer`` call (every layer of ``tokens``
  device tokens into as many host slots);
- ``load``: ``load_to_device_per_layer`` once per layer, in layer order, timed as one loop (what
  a layer-wise load does in total), from those host slots into other device slots;
- ``load_all``: one ``load_to_device_all_layer`` call of the same transfer.

Right before each, the baseline: one ``dst.copy_(src)`` of two contiguous tensors of exactly the
bytes of one transfer, in the transfer's direction (``ContiguousBaseline``; device and host
tensors on CUDA). A direction's ratio is its GB/s over the median baseline GB/s of the same
rounds. Each round draws fresh scattered pages (``draw``); device buffers hold random integers
from the start and the host buffer is written when it is built, so no timed call pays
first-touch page faults. ``transfer_check.verify_transfer`` checks the bytes once, untimed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tiered_kv.bench.timing import device_sync, gbps, interleave, median, spread, timed
from tiered_kv.bench.verify import int_view, sentinel_for
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host import HostKVCache, HostLayout, host_pool_for
from tiered_kv.names import IOBackend

LAYOUTS = tuple(x.value for x in HostLayout)
IO_BACKENDS = IOBackend.values()
DIRECTIONS = ("backup", "load", "load_all")
MIN_REPEATS = 3
# Right after a host pool is built the first copies ran up to 2x slower (the baseline too).
WARMUP_ROUNDS = 1


@dataclass(frozen=True)
class Geometry:
    """The KV geometry of the device pool under test (MHA/GQA, or MLA with ``mla``)."""

    layers: int
    heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64


def make_pool(geom: Geometry, pool_tokens: int, page_size: int, device: torch.device) -> KVCache:
    """A device KV pool of ``pool_tokens`` tokens with ``geom``'s shape."""
    if geom.mla:
        return MLATokenToKVPool(
            pool_tokens,
            page_size,
            geom.dtype,
            geom.kv_lora_rank,
            geom.qk_rope_head_dim,
            geom.layers,
            device,
        )
    return MHATokenToKVPool(
        pool_tokens, page_size, geom.dtype, geom.heads, geom.head_dim, geom.layers, device
    )


def make_allocator(pool: KVCache, pool_tokens: int) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(
        pool_tokens, pool.page_size, pool.dtype, pool.device, kvcache=pool
    )


def make_host(
    decl: HostPoolDecl,
    alloc: PagedTokenToKVPoolAllocator,
    layout: str,
    size: int,
    kernel_backend: str | None = None,
    pin: bool | None = None,
) -> HostKVCache:
    """A host pool of ``size`` tokens, every byte written once (untimed first touch)."""
    host = host_pool_for(
        decl, alloc, layout=layout, size_tokens=size, kernel_backend=kernel_backend, pin=pin
    )
    int_view(host.buffer).fill_(sentinel_for(host.buffer.dtype))
    return host


class ContiguousBaseline:
    """Contiguous tensors of exactly one transfer's bytes, allocated once per size. On CPU one
    pair serves both directions; on CUDA backup copies device -> host and load host -> device,
    with the host side pinned unless ``pin`` is False."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, seed: int, pin: bool | None = None
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.pin = device.type == "cuda" and pin is not False
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if nbytes not in self._pairs:
            numel = nbytes // torch.empty((), dtype=self.dtype).element_size()
            dev = torch.empty(numel, dtype=self.dtype, device=self.device)
            host = torch.empty(numel, dtype=self.dtype, pin_memory=self.pin)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.seed)
            int_view(dev).random_(generator=gen)
            int_view(host).zero_()
            self._pairs[nbytes] = (dev, host)
        return self._pairs[nbytes]

    def copy_fn(self, nbytes: int, direction: str) -> Callable[[], object]:
        """The baseline copy of ``direction`` (``backup``: device -> host, else host -> device)."""
        dev, host = self._pair(nbytes)
        dst, src = (host, dev) if direction == "backup" else (dev, host)
        return lambda: dst.copy_(src)


@dataclass(frozen=True)
class Draw:
    """One round's indices: backup source (device), host slots, load destination (device)."""

    dev_src: torch.Tensor
    host: torch.Tensor
    dev_dst: torch.Tensor


def config_generator(seed: int, page_size: int, layout: str, salt: int) -> torch.Generator:
    """The same draws for every backend of a (page size, layout)."""
    gen = torch.Generator()
    gen.manual_seed(((seed * 1_000_003 + page_size) * 10_007 + LAYOUTS.index(layout)) * 7 + salt)
    return gen


def draw(
    gen: torch.Generator, alloc: PagedTokenToKVPoolAllocator, host: HostKVCache, tokens: int
) -> Draw:
    """Scattered pages: device pages from a shuffled free list (two disjoint sets), host pages
    from a random permutation; slots page-expanded. Clears the device allocator."""
    page = alloc.page_size
    alloc.clear()
    perm = torch.randperm(alloc.num_pages, generator=gen) + 1
    alloc.free_pages = perm.to(alloc.device)
    dev_src, dev_dst = alloc.alloc(tokens), alloc.alloc(tokens)
    if dev_src is None or dev_dst is None:
        raise InvalidArgumentError(
            f"a device pool of {alloc.size} tokens cannot hold two transfers of {tokens} "
            f"tokens: give it at least {2 * tokens}"
        )
    pages = torch.randperm(host.num_pages, generator=gen)[: tokens // page]
    host_idx = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    return Draw(dev_src, host_idx, dev_dst)


class DirectionResult(NamedTuple):
    """Seconds of one direction's timed transfers and of the baseline copy before each."""

    nbytes: int
    seconds: list[float]
    baseline: list[float]

    @property
    def median_s(self) -> float:
        return median(self.seconds)

    @property
    def gbps(self) -> float:
        return gbps(self.nbytes, self.median_s)

    @property
    def baseline_gbps(self) -> float:
        return gbps(self.nbytes, median(self.baseline))

    @property
    def ratio(self) -> float:
        """GB/s over the median baseline GB/s of the same rounds."""
        return self.gbps / self.baseline_gbps

    @property
    def baseline_spread(self) -> float:
        return spread(self.baseline)


@dataclass
class TransferCase:
    """What one configuration's measurement needs."""

    pool: KVCache
    decl: HostPoolDecl
    alloc: PagedTokenToKVPoolAllocator
    host: HostKVCache
    io_backend: str
    tokens: int
    baseline: ContiguousBaseline

    @property
    def nbytes(self) -> int:
        return self.tokens * self.decl.layer_num * self.decl.bytes_per_token_per_layer


def measure_transfer(
    case: TransferCase,
    repeats: int,
    gen: torch.Generator,
    *,
    warmup: int = WARMUP_ROUNDS,
    min_repeats: int = MIN_REPEATS,
    budget_s: float = math.inf,
) -> dict[str, DirectionResult]:
    """Each round: a fresh draw, then for every direction its baseline copy and the transfer,
    each timed alone. Up to ``repeats`` kept rounds after ``warmup`` dropped ones, stopping
    after ``min_repeats`` once the transfers (not the baselines) took ``budget_s``."""
    pool, decl, host, io = case.pool, case.decl, case.host, case.io_backend
    sync = device_sync(pool.device)

    def backup(d: Draw) -> None:
        host.backup_from_device_all_layer(pool, d.host, d.dev_src, io)

    def load(d: Draw) -> None:
        for layer_id in decl.layer_ids:
            host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_id, io)

    def load_all(d: Draw) -> None:
        host.load_to_device_all_layer(pool, d.host, d.dev_dst, io)

    fns = {"backup": backup, "load": load, "load_all": load_all}
    arms: dict[str, Callable[[Draw], float]] = {}
    for direction in DIRECTIONS:
        copy = case.baseline.copy_fn(case.nbytes, direction)
        arms["baseline " + direction] = lambda d, copy=copy: timed(copy, sync)
        arms[direction] = lambda d, fn=fns[direction]: timed(functools.partial(fn, d), sync)
    out = interleave(
        arms,
        repeats,
        setup=lambda _i: draw(gen, case.alloc, host, case.tokens),
        warmup=warmup,
        min_repeats=min_repeats,
        budget_s=budget_s,
        budget_arms=DIRECTIONS,
    )
    return {d: DirectionResult(case.nbytes, out[d], out["baseline " + d]) for d in DIRECTIONS}

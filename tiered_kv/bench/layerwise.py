"""Layer-wise loading: how soon is layer 0 of a host-resident prefix usable?

For a prefix of ``tokens`` tokens resident in the host pool, each round times (round-robin,
``timing.interleave``, after one dropped warm-up round):

- ``full``: one ``load_to_device_all_layer`` call (every layer in one piece, no per-layer
  events): the baseline, in the same round as the rest;
- ``layer0``: from ``DeviceHostTransfer.submit(TransferJob.load(...))`` until the device pool's
  ``get_key_buffer(first layer)`` and ``get_value_buffer(first layer)`` return (they wait on the
  layer-done counter's event for that layer only);
- ``all``: from the same start until the last layer's buffers return.

Every round checks the loaded bytes against the source rows (every layer, K and V, bit for bit)
and that the job's one result is ok; a mismatch is a ``verify.fail`` (``TransferError``). On CPU
the copies run on the worker's load thread; with CUDA the same code drives a copy stream, the
consumer's wait is a GPU-side ``wait_event`` and the times are read after a device sync.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from tiered_kv.bench.machine import noise_check
from tiered_kv.bench.timing import device_sync, interleave, median, timed
from tiered_kv.bench.transfer import Geometry, make_allocator, make_pool
from tiered_kv.bench.verify import fail, fill_random, int_view
from tiered_kv.errors import TransferError
from tiered_kv.host import host_pool_for
from tiered_kv.transfer import DeviceHostTransfer, TransferJob

LAYOUTS = ("page_first", "layer_first")
WARMUP_ROUNDS = 1


@dataclass
class Row:
    layout: str
    layers: int
    tokens: int
    mib: float
    full_ms: float
    layer0_ms: float
    all_ms: float
    repeats: int
    noise: list[str] = field(default_factory=list)  # why the baseline (full) was noisy

    @property
    def layer0_ratio(self) -> float:
        return self.layer0_ms / self.full_ms

    @property
    def layer0_times_l(self) -> float:
        """layer0 / full x L: 1.0 means layer 0 was usable after exactly 1/L of the full copy."""
        return self.layer0_ratio * self.layers

    @property
    def all_ratio(self) -> float:
        return self.all_ms / self.full_ms


@dataclass(frozen=True)
class _Round:
    src: torch.Tensor
    dst: torch.Tensor
    host: torch.Tensor
    job_id: int


def measure_layerwise(
    geom: Geometry,
    layout: str,
    tokens: int,
    page_size: int,
    repeats: int,
    device: torch.device,
    seed: int = 0,
) -> Row:
    """Median ``full``, ``layer0`` and ``all`` times of ``repeats`` rounds for one layout."""
    pool, alloc, decl, host, worker = load_rig(geom, layout, tokens, page_size, device, seed)
    sync = device_sync(device)
    first, last = decl.layer_ids[0], decl.layer_ids[-1]

    def setup(i: int) -> _Round:
        alloc.clear()
        src, dst, h = alloc.alloc(tokens), alloc.alloc(tokens), host.alloc(tokens)
        host.backup_from_device_all_layer(pool, h, src)
        return _Round(src, dst, h, i + WARMUP_ROUNDS)

    def full(r: _Round) -> float:
        return timed(lambda: host.load_to_device_all_layer(pool, r.host, r.dst), sync)

    def layerwise(r: _Round) -> tuple[float, float]:
        for buf in pool.buffers():  # scramble: the layer-wise load must really land
            buf[r.dst] = buf[r.src].flip(0)
        sync()
        # Fresh index tensors, as the cache manager submits them (it joins a chain's host slots
        # into a new tensor): the host pool prepares the transfer anew, as in serving, instead
        # of reusing what the all-layer copy of this round prepared for the same tensors.
        job = TransferJob.load(r.job_id, r.host.clone(), r.dst.clone())
        t_first, t_all = time_layer_reads(worker, [job], pool, first, last, sync)
        worker.wait([r.job_id])
        results = [(x.job_id, x.ok) for x in worker.poll()]
        if results != [(r.job_id, True)]:
            fail(layout, f"load results {results}, expected [({r.job_id}, True)]", TransferError)
        _check(layout, pool, decl.layer_ids, r)
        host.free(r.host)
        return t_first, t_all

    try:
        got = interleave({"full": full, "layerwise": layerwise}, repeats, setup=setup, warmup=1)
    finally:
        worker.close()
        host.destroy()
    nbytes = tokens * decl.layer_num * decl.bytes_per_token_per_layer
    return Row(
        layout,
        decl.layer_num,
        tokens,
        nbytes / 2**20,
        median(got["full"]) * 1e3,
        median([a for a, _ in got["layerwise"]]) * 1e3,
        median([b for _, b in got["layerwise"]]) * 1e3,
        len(got["full"]),
        list(noise_check(got["full"]).reasons),
    )


def load_rig(geom: Geometry, layout: str, tokens: int, page_size: int, device, seed: int):
    """A device pool of random bits with room for two prefixes of ``tokens``, its allocator,
    declaration, a host pool holding one prefix and a transfer worker:
    (pool, alloc, decl, host, worker)."""
    size = 2 * tokens + 4 * page_size
    size -= size % page_size
    pool = make_pool(geom, size, page_size, device)
    alloc = make_allocator(pool, size)
    fill_random(pool.buffers(), seed, device)
    (decl,) = pool.host_pool_decls()
    host = host_pool_for(decl, alloc, layout=layout, size_tokens=tokens + 2 * page_size)
    return pool, alloc, decl, host, DeviceHostTransfer(alloc, host, io_backend="kernel")


def time_layer_reads(worker, jobs, pool, first: int, last: int, sync) -> tuple[float, float]:
    """Submit ``jobs`` and time until the first layer's, then the last layer's, K and V
    buffers are readable (the device pool's waits on the layer-done counter), GC off."""
    gc.disable()
    try:
        t = time.perf_counter()
        for job in jobs:
            worker.submit(job)
        pool.get_key_buffer(first)
        pool.get_value_buffer(first)
        sync()
        t_first = time.perf_counter() - t
        pool.get_key_buffer(last)
        pool.get_value_buffer(last)
        sync()
        return t_first, time.perf_counter() - t
    finally:
        gc.enable()


def _check(layout: str, pool, layer_ids, r: _Round) -> None:
    for layer in layer_ids:
        for name, buf in (("K", pool.get_key_buffer(layer)), ("V", pool.get_value_buffer(layer))):
            if not torch.equal(int_view(buf[r.dst]), int_view(buf[r.src])):
                fail(
                    layout, f"layer {layer} {name} differs after the layer-wise load", TransferError
                )

"""Several requests' layer-wise loads: one job per request against one job for the batch.

A batch of ``requests`` host-resident prefixes of irregular lengths (``tokens`` in all) is
loaded back for one forward, which reads layer i of every request. Each round times
(round-robin, ``timing.interleave``, after one dropped warm-up round):

- ``full``: one ``load_to_device_all_layer`` call over all the batch's rows: the baseline;
- ``separate``: one ``TransferJob.load`` per request submitted back to back (what ``begin``
  one request at a time does); layer 0 is usable once the last job's layer 0 is (the layer
  waits follow the newest load, and loads run in order), all once its last layer is;
- ``merged``: one job over the batch's rows in request order (what ``begin_many`` submits).

Every round checks the loaded bytes (every layer, K and V, bit for bit) and that every job's
one result is ok; a mismatch is a ``verify.fail`` (``TransferError``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tiered_kv.bench.layerwise import load_rig, time_layer_reads
from tiered_kv.bench.machine import noise_check
from tiered_kv.bench.timing import device_sync, interleave, median, timed
from tiered_kv.bench.transfer import Geometry
from tiered_kv.bench.verify import fail, int_view
from tiered_kv.errors import InvalidArgumentError, TransferError
from tiered_kv.transfer import TransferJob

WARMUP_ROUNDS = 1


@dataclass
class BatchRow:
    layout: str
    layers: int
    requests: int
    tokens: int
    mib: float
    full_ms: float
    separate_layer0_ms: float
    separate_all_ms: float
    merged_layer0_ms: float
    merged_all_ms: float
    repeats: int
    noise: list[str] = field(default_factory=list)

    def ratio(self, ms: float, per_layer: bool = False) -> float:
        """``ms`` / full (x L for a layer-0 time: 1.0 is exactly 1/L of the full copy)."""
        return ms / self.full_ms * (self.layers if per_layer else 1)


def split_tokens(tokens: int, requests: int, page_size: int, seed: int) -> list[int]:
    """``requests`` irregular whole-page lengths summing to ``tokens``."""
    pages = tokens // page_size
    if not 1 <= requests <= pages:
        raise InvalidArgumentError(
            f"requests={requests}: need 1..{pages} ({tokens} tokens, page {page_size})"
        )
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, pages), requests - 1))
    return [(b - a) * page_size for a, b in zip([0, *cuts], [*cuts, pages], strict=True)]


@dataclass(frozen=True)
class _Round:
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    host: list[torch.Tensor]


def measure_batched(
    geom: Geometry,
    layout: str,
    tokens: int,
    requests: int,
    page_size: int,
    repeats: int,
    device: torch.device,
    seed: int = 0,
) -> BatchRow:
    lengths = split_tokens(tokens, requests, page_size, seed)
    pool, alloc, decl, host, worker = load_rig(geom, layout, tokens, page_size, device, seed)
    sync = device_sync(device)
    first, last = decl.layer_ids[0], decl.layer_ids[-1]
    ids = iter(range(1, 1 << 62))

    held: list[torch.Tensor] = []

    def setup(_i: int) -> _Round:
        alloc.clear()
        for h in held:  # the previous round's host slots
            host.free(h)
        src = [alloc.alloc(n) for n in lengths]
        dst = [alloc.alloc(n) for n in lengths]
        h = [host.alloc(n) for n in lengths]
        held[:] = h
        host.backup_from_device_all_layer(pool, torch.cat(h), torch.cat(src))
        return _Round(src, dst, h)

    def full(r: _Round) -> float:
        h, d = torch.cat(r.host), torch.cat(r.dst)
        return timed(lambda: host.load_to_device_all_layer(pool, h, d), sync)

    def run(r: _Round, merged: bool) -> tuple[float, float]:
        for buf in pool.buffers():  # scramble: the loads must really land
            for s, d in zip(r.src, r.dst, strict=True):
                buf[d] = buf[s].flip(0)
        sync()
        if merged:
            jobs = [TransferJob.load(next(ids), torch.cat(r.host), torch.cat(r.dst))]
        else:
            jobs = [
                TransferJob.load(next(ids), h.clone(), d.clone())
                for h, d in zip(r.host, r.dst, strict=True)
            ]
        t_first, t_all = time_layer_reads(worker, jobs, pool, first, last, sync)
        worker.wait([j.job_id for j in jobs])
        got = sorted((x.job_id, x.ok) for x in worker.poll())
        want = [(j.job_id, True) for j in jobs]
        if got != want:
            fail(layout, f"load results {got}, expected {want}", TransferError)
        _check(layout, pool, decl.layer_ids, r)
        return t_first, t_all

    try:
        got = interleave(
            {
                "full": full,
                "separate": lambda r: run(r, merged=False),
                "merged": lambda r: run(r, merged=True),
            },
            repeats,
            setup=setup,
            warmup=WARMUP_ROUNDS,
            rotate=True,
        )
    finally:
        worker.close()
        host.destroy()
    nbytes = tokens * decl.layer_num * decl.bytes_per_token_per_layer
    sep, mer = got["separate"], got["merged"]
    return BatchRow(
        layout,
        decl.layer_num,
        requests,
        tokens,
        nbytes / 2**20,
        median(got["full"]) * 1e3,
        median([a for a, _ in sep]) * 1e3,
        median([b for _, b in sep]) * 1e3,
        median([a for a, _ in mer]) * 1e3,
        median([b for _, b in mer]) * 1e3,
        len(got["full"]),
        list(noise_check(got["full"]).reasons),
    )


def _check(layout: str, pool, layer_ids, r: _Round) -> None:
    src, dst = torch.cat(r.src), torch.cat(r.dst)
    for layer in layer_ids:
        for name, buf in (("K", pool.get_key_buffer(layer)), ("V", pool.get_value_buffer(layer))):
            if not torch.equal(int_view(buf[dst]), int_view(buf[src])):
                fail(layout, f"layer {layer} {name} differs after the batch's loads", TransferError)

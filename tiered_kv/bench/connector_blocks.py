"""The vLLM connector's fixed costs per block outside vLLM: its host <-> block copies and store
reads into host slots used for the first time, against a contiguous ``copy_`` and a raw warm read
of the same bytes, in the same round.

Every round builds a fresh :class:`ConnectorTiers` (a new host buffer, so every host slot it
uses is used for the first time; a new store directory) over caches in vLLM's CPU layout holding
random bits, and times, on ``blocks`` random blocks:

- ``block->host``: the save's ``copy_layer`` calls, one per layer (as ``save_kv_layer`` makes
  them; on the calling thread), then ``finish_save`` and its store write, untimed;
- ``host->block``: a ``submit_load`` of those pages into other blocks, served by the host tier
  (the connector's load thread; the copy counter's microseconds);
- ``store read``: the tiers closed and opened again over the same store (a restart: the host
  tier empty), the same load: the store's ``batch_get`` into fresh host slots (its counter),
  then the host -> block copy.

Baselines, right before each: ``copy_``, one ``dst.copy_(src)`` of two contiguous tensors of the
same bytes; ``raw warm read``, ``preadv`` of each page whole from one file holding the same
bytes, in the page cache (as the store's file is after its write). Every load is checked bit
for bit against the source blocks. Medians over rounds; ratios are op over baseline times.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiered_kv.bench.timing import median
from tiered_kv.bench.verify import fail
from tiered_kv.errors import TransferError

# The connector's parts, by name: bench ranks beside integrations, not above them (as
# ``vllm_turns`` names the connector's module and ``sglang_hicache`` our HiCache backend).
_VLLM = "tiered_kv.integrations.vllm."
describe_layers = importlib.import_module(_VLLM + "block_layout").describe_layers
read_settings = importlib.import_module(_VLLM + "settings").read_settings
ConnectorTiers = importlib.import_module(_VLLM + "tiers").ConnectorTiers

OPS = ("block->host", "host->block", "store read")
BASELINE_OF = {"block->host": "copy_", "host->block": "copy_", "store read": "raw warm read"}
GOALS = {"block->host": 1.5, "host->block": 1.5, "store read": 2.0}  # op / baseline, at most


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_nbytes(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * self.heads * self.block_size * 2 * self.head_dim * elt


@dataclass
class OpRow:
    op: str
    blocks: int
    us_per_block: float
    baseline: str
    baseline_us_per_block: float
    ratio: float  # op over baseline; at most GOALS[op] is the goal
    rounds: int

    @property
    def goal(self) -> float:
        return GOALS[self.op]


def _caches(geom: Geometry, num_blocks: int, gen: torch.Generator):
    """Per-layer caches in vLLM's CPU layout ``[blocks, heads, block_size, 2 * head_dim]``,
    random bits; (the dict vLLM registers, the tensors)."""
    caches = {}
    for i in range(geom.layers):
        t = torch.empty(
            num_blocks, geom.heads, geom.block_size, 2 * geom.head_dim, dtype=geom.dtype
        )
        t.view(torch.uint8).view(-1).random_(0, 256, generator=gen)
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches, list(caches.values())


def _tiers(layout, store_dir: str, blocks: int, page_nbytes: int):
    settings = read_settings(
        {
            "model_id": "bench/connector-blocks@1",
            "storage_path": store_dir,
            "storage_bytes": max(64 << 20, 4 * blocks * page_nbytes),
            "host_bytes": 2 * blocks * page_nbytes,  # room for the round: no eviction in it
        }
    )
    return ConnectorTiers(settings, layout, rank=None)


def _block_bytes(tensors: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].view(torch.uint8).clone() for t in tensors]


def _check(tensors, src: list[int], dst: list[int], what: str) -> None:
    for s, d in zip(src, dst, strict=True):
        for layer, t in enumerate(tensors):
            if not torch.equal(t[d].view(torch.uint8), t[s].view(torch.uint8)):
                fail(
                    "connector blocks",
                    f"{what}: block {d} layer {layer} != block {s}",
                    TransferError,
                )


def _raw_warm_read(path: str, views: list[memoryview], page_nbytes: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        for i, view in enumerate(views):
            if os.preadv(fd, [view], i * page_nbytes) != page_nbytes:
                fail("raw warm read", f"short read of page {i}")
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _load(tiers: ConnectorTiers, blocks: list[int], digests: list[bytes]) -> None:
    failed = tiers.submit_load(blocks, digests).result()
    if failed:
        fail("connector blocks", f"load failed for blocks {sorted(failed)[:8]}", TransferError)


def measure(
    geom: Geometry,
    blocks: int,
    rounds: int,
    seed: int = 0,
    workdir: str | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> list[OpRow]:
    """Median microseconds per block of each op and its baseline over ``rounds`` rounds."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 3 * blocks + 1
    caches, tensors = _caches(geom, num_blocks, gen)
    layout = describe_layers(caches, num_blocks)
    page = layout.page_nbytes
    total = blocks * page
    src_c = torch.empty(total, dtype=torch.uint8).random_(0, 256, generator=gen)
    dst_c = torch.empty(total, dtype=torch.uint8).random_(0, 256, generator=gen)
    root = tempfile.mkdtemp(prefix="tkv-connector-blocks-", dir=workdir)
    raw_path = os.path.join(root, "raw.bin")
    with open(raw_path, "wb") as f:
        f.write(src_c.numpy().tobytes())
    raw_dst = np.empty(total, dtype=np.uint8)
    raw_dst.fill(1)  # faulted in: the store's destination (host slots) is too
    raw_views = [memoryview(raw_dst[i * page : (i + 1) * page]) for i in range(blocks)]
    _raw_warm_read(raw_path, raw_views, page)  # in the page cache, as the store's file is
    got: dict[str, list[float]] = {k: [] for k in (*OPS, "copy_", "raw warm read")}
    n_layers = len(layout.layer_ids)
    try:
        for r in range(rounds + 1):  # round 0 warms up (imports, the native library): dropped
            order = list(range(num_blocks))
            rng.shuffle(order)
            src, dst, dst2 = (
                order[:blocks],
                order[blocks : 2 * blocks],
                order[2 * blocks : 3 * blocks],
            )
            digests = [hashlib.sha256(f"{seed}/{r}/{b}".encode()).digest() for b in src]
            store_dir = os.path.join(root, f"store-{r}")
            times: dict[str, float] = {}
            tiers = _tiers(layout, store_dir, blocks, page)
            try:
                t0 = time.perf_counter()
                dst_c.copy_(src_c)
                times["copy_"] = time.perf_counter() - t0
                save = tiers.begin_save(src, digests)
                t0 = time.perf_counter()
                for layer in range(n_layers):
                    tiers.copy_layer(save, layer)
                times["block->host"] = time.perf_counter() - t0
                fut = tiers.finish_save(save)
                if fut is None:
                    fail("connector blocks", "the save copied nothing", TransferError)
                fut.result()
                tiers.drain()
                before = tiers.counters.snapshot()
                _load(tiers, dst, digests)
                after = tiers.counters.snapshot()
                times["host->block"] = (
                    after.get("load_copy_us", 0) - before.get("load_copy_us", 0)
                ) / 1e6
                _check(tensors, src, dst, "host->block")
            finally:
                tiers.close()
            tiers = _tiers(layout, store_dir, blocks, page)  # a restart: the host tier empty
            try:
                times["raw warm read"] = _raw_warm_read(raw_path, raw_views, page)
                _load(tiers, dst2, digests)
                c = tiers.counters.snapshot()
                if c.get("loaded_store_blocks", 0) != blocks:
                    fail(
                        "connector blocks",
                        f"store served {c.get('loaded_store_blocks')} of {blocks}",
                        TransferError,
                    )
                times["store read"] = c.get("store_read_us", 0) / 1e6
                _check(tensors, src, dst2, "store read")
            finally:
                tiers.close()
            shutil.rmtree(store_dir, ignore_errors=True)
            if r > 0:
                for k, v in times.items():
                    got[k].append(v)
                progress(
                    f"round {r}: "
                    + ", ".join(f"{k} {v * 1e6 / blocks:.0f} us" for k, v in times.items())
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for op in OPS:
        base = BASELINE_OF[op]
        op_s, base_s = median(got[op]), median(got[base])
        rows.append(
            OpRow(
                op, blocks, op_s * 1e6 / blocks, base, base_s * 1e6 / blocks, op_s / base_s, rounds
            )
        )
    return rows

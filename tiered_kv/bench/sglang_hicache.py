"""SGLang's HiCacheController backing up and prefetching through our backend and its own file one.

Two arms, each an ``SGLangRig`` of the same shape in its own directory, with the controller
SGLang's radix cache builds for a plain model (``HybridCacheController`` over a host pool
group): ``tiered_kv`` (our ``TieredKVHiCacheStorage``, loaded by SGLang by module path, v1
interface, the local store in the given layout) and ``hicache_file`` (SGLang's ``HiCacheFile``,
loaded as ``file``). A round
draws fresh tokens and fresh random KV (untimed: written into each arm's device pool and copied
to its host pool), then times in each arm:

- ``backup``: ``write_storage`` until SGLang's backup thread acknowledges it (host -> store, in
  SGLang's batches of ``STORAGE_BATCH_SIZE`` pages), after an untimed ``sync`` (no dirty pages
  of earlier rounds are written back on its clock; neither backend syncs its own writes);
- ``prefetch``: ``prefetch`` until the last prefetch ack: SGLang's hit query (``batch_exists``),
  allocating the host pages, the transfer (store -> host). The page cache is warm (the pages
  were just written), for both arms alike.

After each prefetch the host pages are compared byte for byte with the ones backed up (untimed; a
mismatch or a short prefetch is a ``CORRECTNESS FAILURE``). Rounds alternate the arms and rotate
which goes first; rows are medians over rounds, and each of our rows carries its GB/s over
``hicache_file``'s of the same op (above 1.0 ours is faster). The load average is read after the
rounds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tiered_kv.bench import machine
from tiered_kv.bench.sglang_rig import RigShape, SGLangRig, dynamic_extra_config
from tiered_kv.bench.timing import gbps, interleave, median, timed_call
from tiered_kv.bench.verify import fail

ARMS = ("tiered_kv", "hicache_file")
OPS = ("backup", "prefetch")
OUR_BACKEND = ("tiered_kv.integrations.sglang_hicache", "TieredKVHiCacheStorage")


@dataclass
class HiCacheRow:
    arm: str
    op: str
    model: str  # mha / mla
    layout: str
    pages: int
    page_nbytes: int
    gbps: float
    median_s: float
    ratio: float | None  # ours over hicache_file, GB/s
    repeats: int
    samples_s: list[float] = field(default_factory=list)


def _rigs(shape: RigShape, workdir: str, storage_layout: str, store_bytes: int) -> dict:
    ours = os.path.join(workdir, "tiered_kv")
    theirs = os.path.join(workdir, "hicache_file")
    os.makedirs(theirs, exist_ok=True)
    extra = dynamic_extra_config(
        *OUR_BACKEND, storage_path=ours, storage_bytes=store_bytes, storage_layout=storage_layout
    )
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override the path
    return {
        "tiered_kv": SGLangRig(shape, "dynamic", extra, group=True),
        "hicache_file": SGLangRig(shape, "file", {"file_storage_path": theirs}, group=True),
    }


def _host_pages(rig: SGLangRig, slots: torch.Tensor) -> list[torch.Tensor]:
    ps = rig.shape.page_size
    return [
        rig.host.get_data_page(int(s), flat=True).view(torch.uint8).clone()
        for s in slots[::ps].tolist()
    ]


def _one_round(rig: SGLangRig, arm: str, tokens: list[int], gen: torch.Generator) -> dict:
    dev = rig.fill_device(len(tokens), gen)
    host = rig.write_to_host(dev)
    want = _host_pages(rig, host)
    # Both arms write through the page cache; without a flush first a backup is billed for
    # whatever dirty pages earlier rounds (of either arm) left the kernel to write back.
    os.sync()
    t_backup, stored = timed_call(lambda: rig.backup(host, tokens))
    t_prefetch, (got, host2) = timed_call(lambda: rig.prefetch(tokens))
    if stored != len(tokens) or got != len(tokens):
        fail(f"sglang hicache {arm}", f"stored {stored}, prefetched {got} of {len(tokens)} tokens")
    back = _host_pages(rig, host2)
    bad = [i for i, (a, b) in enumerate(zip(back, want, strict=True)) if not torch.equal(a, b)]
    if bad:
        fail(f"sglang hicache {arm}", f"prefetched pages {bad[:8]} differ")
    rig.host.free(host)
    rig.host.free(host2)
    rig.allocator.free(dev)
    return {"backup": t_backup, "prefetch": t_prefetch}


def measure_hicache(
    shape: RigShape,
    pages: int,
    repeats: int,
    *,
    workdir: str,
    seed: int,
    storage_layout: str = "slab",
    progress: Callable[[str], None] = lambda _line: None,
) -> tuple[list[HiCacheRow], tuple[float, float, float] | None]:
    """Rows for both arms and both ops, and the load average after the rounds."""
    page_tokens = pages * shape.page_size
    if page_tokens > shape.device_tokens:
        fail("sglang hicache", f"{pages} pages do not fit the device pool")
    store_bytes = 4 * (repeats + 1) * pages * (2 << 20) + (256 << 20)
    rigs = _rigs(shape, workdir, storage_layout, store_bytes)
    gen = torch.Generator().manual_seed(seed)
    try:
        page_nbytes = rigs["tiered_kv"].backend.pages.page_nbytes
        arms = {arm: (lambda toks, arm=arm: _one_round(rigs[arm], arm, toks, gen)) for arm in ARMS}
        got = interleave(
            arms,
            repeats,
            setup=lambda _i: torch.randint(0, 150_000, (page_tokens,), generator=gen).tolist(),
            warmup=1,
            rotate=True,
            after_round=lambda i: progress(
                "warm-up round done" if i < 0 else f"round {i + 1} of {repeats} done"
            ),
        )
    finally:
        for rig in rigs.values():
            rig.close()
    load = machine.load_average()
    model = "mla" if shape.mla else "mha"
    rows = []
    for arm, samples in got.items():
        for op in OPS:
            secs = [s[op] for s in samples]
            t = median(secs)
            rows.append(
                HiCacheRow(arm, op, model, shape.layout, pages, page_nbytes,
                           gbps(pages * page_nbytes, t), t, None, len(secs), secs)
            )  # fmt: skip
    base = {r.op: r for r in rows if r.arm == "hicache_file"}
    for r in rows:
        if r.arm == "tiered_kv":
            r.ratio = r.gbps / base[r.op].gbps
    return rows, load

"""The scale run's ``hisparse`` mode: a DSA preset (DeepSeek-V3.2) served HiSparse-style by the
:class:`~tiered_kv.engine.sparse_scheduler.SparseScheduler` over synthetic KV
(:class:`~tiered_kv.engine.synthetic_sparse.SyntheticSparseDSA`), on the same workload, tiers
and modeled clock as the dense modes (:mod:`~tiered_kv.engine.scale_run`).

The cache: the dense modes' device, host and storage, its device allocator HiSparse's (a
logical slot for every token of every running request; ``hisparse_logical_ratio`` sized for
``max_running`` requests at the longest context). Each running request keeps a fixed buffer of
``ScaleConfig.hisparse_topk`` latents (DeepSeek-V3.2 selects 2048 tokens a layer) plus a page
on the device, and every indexer key; its tokens live on host. A cached prefix is brought to
host and copied into the prefill's staging rows (modeled at the host -> device link, a storage
hit also at the storage link); each decode step's swap-ins are charged at the host -> device
link too (not overlapped with compute: the modeled time is an upper bound there). Decode reads
the selected latents and every indexer key (``HiSparseBytes.read``).
"""

from __future__ import annotations

import math
import time

from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import SchedulerConfig
from tiered_kv.engine.presets import geometry
from tiered_kv.engine.scale_serve import mode_report, serve_workload
from tiered_kv.engine.scale_workload import ScaleConfig, sizes
from tiered_kv.engine.sparse_scheduler import SparseScheduler
from tiered_kv.engine.synthetic_kv import SyntheticKV
from tiered_kv.engine.synthetic_model import ModeledClock
from tiered_kv.engine.synthetic_sparse import SyntheticSparseDSA
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind

MODE = "hisparse"


def hisparse_config(cfg: ScaleConfig, store_dir: str) -> TieredKVConfig:
    """The ``hisparse`` mode's cache config (see the module doc)."""
    p, s, ps = cfg.model_preset, sizes(cfg), cfg.page_size
    if p.model != ModelKind.DSA.value:
        raise InvalidArgumentError(
            f"the {MODE} mode serves a DSA preset (model 'dsa'), not {p.name} ({p.model})"
        )
    longest = -(-(s.longest_tokens + ps) // ps) * ps
    ratio = max(2, math.ceil(cfg.max_running * longest / s.device_tokens) + 1)
    return TieredKVConfig.flat(
        **geometry(p), page_size=ps, device_tokens=s.device_tokens,
        host_tokens=s.host_tokens, storage_bytes=s.storage_bytes, storage_path=store_dir,
        model_id=f"{p.name}@synthetic", max_requests=cfg.max_running,
        max_context_len=s.longest_tokens + 2 * ps, prefetch_policy="wait_complete",
        prefetch_threshold=ps, storage_backend=cfg.storage_backend,
        storage_options=cfg.storage_options, storage_local_copy=cfg.storage_local_copy,
        verify_fraction=cfg.verify_fraction, hisparse_logical_ratio=ratio,
    )  # fmt: skip


def run_hisparse_mode(
    cfg: ScaleConfig, store_dir: str, *, on_restored=None, on_cache=None, on_progress=None
):
    """Serve ``cfg``'s workload HiSparse-style; the mode's report (``mode_report``'s keys, plus
    ``hisparse``: the buffer, selection and swap-in counters)."""
    config = hisparse_config(cfg, store_dir)
    s, topk = sizes(cfg), cfg.hisparse_topk
    cache = TieredKVCache(config)
    t0 = time.perf_counter()
    try:
        if on_cache is not None:
            on_cache(MODE, cache)
        serving = HiSparseServing(cache, topk)
        model = SyntheticSparseDSA(serving, SyntheticKV(config), topk, on_restored=on_restored)
        sched = SparseScheduler(serving, model, SchedulerConfig(
            chunk_size=cfg.chunk_tokens, max_running=cfg.max_running,
            max_prefill_tokens=max(cfg.chunk_tokens, s.longest_tokens),
        ))  # fmt: skip
        clock = ModeledClock(cfg.cost, cfg.links, s.bytes_per_token)
        records = serve_workload(cfg, MODE, sched, model, clock, on_progress)
        cache.drain()
        stats = cache.stats()
        stats["planner"]["estimates"] = None
        counts = dict(serving.counts)
    finally:
        cache.close()
    wall = time.perf_counter() - t0
    out = mode_report(MODE, s, config, records, sched, model, clock, stats, wall)
    out["hisparse"] = {
        "buffer_tokens": topk, "topk": topk, "logical_ratio": config.device.hisparse_logical_ratio,
        "swap_hits": model.swap_hits, "swap_loaded": model.swap_loaded,
        "swap_bytes": model.swap_bytes, "failed_copies": model.failed_copies,
        "checked_rows": model.checked_rows, "serving": counts,
    }  # fmt: skip
    return out

"""A long-context multi-turn workload at a real model's KV size, served by the batched
:class:`~tiered_kv.engine.scheduler.Scheduler` with synthetic KV, four ways in one process.

The workload and the tier sizes are :mod:`~tiered_kv.engine.scale_workload`'s (users in
sessions over shared documents and their own histories; the device ~10% of its unique
tokens, the host ~30% more, the disk all of it). The modes, on the same workload and the
same decoded tokens:

- ``tiered``: device + host + storage (write-through, storage hits prefetched and waited for);
- ``device_only``: the same device, no host or storage tier (``host_tokens=0``);
- ``recompute``: no prefix reuse at all: each request's first token is salted (so no page of
  it matches anything cached) and no KV is written (nothing could read it);
- ``tiered_planner``: ``tiered`` with the cache's load planner (``load_planner=True``): per
  request it takes what is faster to load than to compute and computes the rest. Its compute
  cost is the cost model's prefill time; its link estimates are fed from the modeled clock's
  per-link load times (the links it "measures" here are the modeled ones), from the config's
  stated priors until the first loads;
- ``hisparse`` (DSA presets only, :mod:`~tiered_kv.engine.sparse_run`): ``tiered``'s tiers
  with HiSparse's device allocator, each running request a fixed buffer of selected latents on
  the device, its tokens on host, through the ``SparseScheduler``.

Times are modeled (:class:`~tiered_kv.engine.synthetic_model.ModeledClock`): prefill only of
the tokens actually computed, decode steps, and restored prefixes' loads at modeled link
bandwidths; a step in which nothing could run (the device full of pages whose backups are
still in flight on this machine) is counted (``idle_steps``) and not charged. Bytes moved and
their measured GB/s on this machine come from ``cache.stats()``. Every restored prefix is
verified byte for byte before its first forward.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import SchedulePolicy, SchedulerConfig
from tiered_kv.engine.cost_model import CostModel
from tiered_kv.engine.presets import geometry, kv_bytes
from tiered_kv.engine.scale_serve import ProgressHook, mode_report, serve_workload
from tiered_kv.engine.scale_workload import ScaleConfig, sizes
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.sparse_run import run_hisparse_mode
from tiered_kv.engine.synthetic_kv import SyntheticKV
from tiered_kv.engine.synthetic_model import ModeledClock, SyntheticModel
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind

MODES = ("tiered", "device_only", "recompute", "tiered_planner", "hisparse")
TIERED = ("tiered", "tiered_planner", "hisparse")  # the modes with a host and a storage tier
Hook = Callable[[TieredKVCache, Request], None]
CacheHook = Callable[[str, TieredKVCache], None]  # (mode, its cache) once the cache is built
# (mode, its report) once its cache is closed, before the next mode's cache is built.
DoneHook = Callable[[str, dict], None]


def run_mode(
    cfg: ScaleConfig,
    mode: str,
    store_dir: str | None = None,
    *,
    on_restored: Hook | None = None,
    on_cache: CacheHook | None = None,
    on_progress: ProgressHook | None = None,
) -> dict:
    """Serve the workload one way (``MODES``); its report. ``store_dir``: where the tiered
    mode's store lives (needed for it). ``on_cache`` sees the cache before it serves (the
    metrics endpoint shows its registry); ``on_progress``, the turns finished as it serves
    (``serve_workload``)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode={mode!r}; use one of {', '.join(MODES)}")
    if mode in TIERED and store_dir is None:
        raise InvalidArgumentError(f"the {mode} mode needs a store_dir for its store")
    if mode == "hisparse":
        return run_hisparse_mode(
            cfg, store_dir, on_restored=on_restored, on_cache=on_cache, on_progress=on_progress
        )
    s, p, ps = sizes(cfg), cfg.model_preset, cfg.page_size
    tiered = mode in TIERED
    config = TieredKVConfig.flat(
        **geometry(p), page_size=ps, device_tokens=s.device_tokens,
        device_swa_tokens=s.device_window_tokens,
        host_tokens=s.host_tokens if tiered else 0, storage_bytes=s.storage_bytes if tiered else 0,
        storage_path=store_dir if tiered else None, model_id=f"{p.name}@synthetic",
        max_requests=cfg.max_running, max_context_len=s.longest_tokens + 2 * ps,
        prefetch_policy="wait_complete", prefetch_threshold=ps,
        storage_backend=cfg.storage_backend, storage_options=cfg.storage_options,
        storage_local_copy=cfg.storage_local_copy and tiered,
        verify_fraction=cfg.verify_fraction,
        load_planner=mode == "tiered_planner",
    )  # fmt: skip
    cache = TieredKVCache(config)
    t0 = time.perf_counter()
    try:
        if on_cache is not None:
            on_cache(mode, cache)
        model = SyntheticModel(
            cache, SyntheticKV(config), write=mode != "recompute", on_restored=on_restored
        )
        sched = Scheduler(cache, model, SchedulerConfig(
            chunk_size=cfg.chunk_tokens, max_running=cfg.max_running,
            policy=SchedulePolicy.CACHE_AWARE, defer_shared_tokens=4 * ps,
        ))  # fmt: skip
        clock = ModeledClock(cfg.cost, cfg.links, s.bytes_per_token)
        planner = cache.load_planner
        if planner is not None:
            planner.set_compute_cost(lambda tokens, context: cfg.cost.prefill_s(tokens))
            planner.set_load_source(clock.link_stats)
        records = serve_workload(cfg, mode, sched, model, clock, on_progress)
        cache.drain()
        stats = cache.stats()
        stats["planner"]["estimates"] = planner.estimates() if planner is not None else None
    finally:
        cache.close()
    wall = time.perf_counter() - t0
    return mode_report(mode, s, config, records, sched, model, clock, stats, wall)


def default_modes(cfg: ScaleConfig) -> tuple[str, ...]:
    """Every mode that serves ``cfg``'s preset (``hisparse`` only for a DSA model)."""
    dsa = cfg.model_preset.model == ModelKind.DSA.value
    return tuple(m for m in MODES if dsa or m != "hisparse")


def run_scale(
    cfg: ScaleConfig,
    modes=None,
    *,
    on_restored: Hook | None = None,
    on_cache: CacheHook | None = None,
    on_progress: ProgressHook | None = None,
    on_mode_done: DoneHook | None = None,
) -> dict:
    """Every mode in ``modes`` (None: ``default_modes``) on ``cfg``'s workload, and the tiered
    and hisparse modes' gains as ratios. The hooks: ``run_mode``'s, and ``on_mode_done`` with
    each mode's report as it ends (whoever kept its cache from ``on_cache`` lets go of it
    there: the next mode's pools are about to be allocated)."""
    cost, s = cfg.cost, sizes(cfg)
    modes = default_modes(cfg) if modes is None else modes
    t0 = time.perf_counter()
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="tiered-kv-run-", dir=cfg.store_dir) as d:
            results[mode] = run_mode(
                cfg, mode, d, on_restored=on_restored, on_cache=on_cache, on_progress=on_progress
            )
        if on_mode_done is not None:
            on_mode_done(mode, results[mode])
        # A way's cache sits in reference cycles: without a collection its pools (7.8 GB for
        # Qwen3-Next at scale 4) stay resident while the next way allocates its own.
        gc.collect()
    return {
        "preset": {"name": cfg.model_preset.name, "source": cfg.model_preset.source,
                   "bytes_per_token": s.bytes_per_token, "scale": cfg.scale},
        "kv": kv_report(cfg, results),
        "cost_model": {**dataclasses.asdict(cost), "label": CostModel.label},
        "links": dataclasses.asdict(cfg.links),
        "sizes": s._asdict(),
        "modes": results,
        "gains": gains(results),
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip


def gains(results: dict) -> dict:
    """The tiered mode's modeled throughput and TTFT p50 against each baseline it ran with
    (baseline TTFT / tiered TTFT: > 1 means the tiers won), and the planner's (``planner_*``)
    against blind tiered loading and recomputing, and HiSparse's (``hisparse_*``) against the
    dense modes."""
    out = {}
    pairs = [("tiered", base, "") for base in ("device_only", "recompute")]
    pairs += [("tiered_planner", base, "planner_") for base in ("tiered", "recompute")]
    pairs += [("hisparse", base, "hisparse_") for base in ("tiered", "device_only", "recompute")]
    for mode, base, prefix in pairs:
        t, b = results.get(mode), results.get(base)
        if t is None or b is None:
            if mode == "hisparse":  # documented keys: None where the preset has no such mode
                out[f"{prefix}throughput_vs_{base}"] = out[f"{prefix}ttft_p50_vs_{base}"] = None
            continue
        tm, bm = t["modeled"], b["modeled"]
        out[f"{prefix}throughput_vs_{base}"] = tm["tokens_per_s"] / bm["tokens_per_s"]
        out[f"{prefix}ttft_p50_vs_{base}"] = bm["ttft_p50_s"] / tm["ttft_p50_s"]
    return out


KV_RUN_KEYS = (
    "device_per_request", "all_full_device_per_request", "device_saved",
    "restored_per_turn", "all_full_restored_per_turn", "restored_saved",
    "hisparse_device_per_request", "hisparse_device_saved",
)  # fmt: skip


def kv_report(cfg: ScaleConfig, results: dict) -> dict:
    """What the preset's cache holds and restores against the same model with every layer full
    attention (``kv_bytes.KVBytes``): per token and layer kind, and over the run's requests
    (device bytes per request, as every mode serves the same ones) and the tiered mode's
    restores from host and storage (bytes per turn); ``*_saved`` is all-full / this model."""
    b = kv_bytes(cfg.model_preset, cfg.page_size)
    out = {
        "kind": b.kind.value,
        "full_layers": len(b.full_layers),
        "window_layers": len(b.window_layers),
        "recurrent_layers": len(b.recurrent_layers),
        "full_bytes_per_token": b.full_per_token,
        "window_bytes_per_token": b.window_per_token,
        "state_bytes": b.state,
        "all_full_bytes_per_token": b.all_full_per_token,
    }
    out |= dict.fromkeys(KV_RUN_KEYS)  # None where the run gave nothing to count
    mode = next((results[m] for m in ("tiered", *MODES) if m in results), None)
    if mode is not None:
        by = mode["bytes"]
        out["device_per_request"] = d = by["device_per_request"]
        out["all_full_device_per_request"] = full = by["all_full_device_per_request"]
        out["device_saved"] = full / d if d else None
    t = results.get("tiered", {}).get("bytes")
    if t is not None and t["restored_per_turn"]:
        out["restored_per_turn"] = r = t["restored_per_turn"]
        out["all_full_restored_per_turn"] = full = t["all_full_restored_per_turn"]
        out["restored_saved"] = full / r
    h = results.get("hisparse", {}).get("bytes")
    if h is not None:  # the same requests: a fixed buffer of latents, every indexer key
        out["hisparse_device_per_request"] = d = h["device_per_request"]
        out["hisparse_device_saved"] = h["all_full_device_per_request"] / d if d else None
    return out

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
  stated priors until the first loads.

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

import numpy as np

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import EngineRequest, SchedulePolicy, SchedulerConfig
from tiered_kv.engine.cost_model import CostModel
from tiered_kv.engine.presets import geometry, kv_bytes
from tiered_kv.engine.scale_workload import ScaleConfig, Sizes, Workload, sizes
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.synthetic_kv import SyntheticKV
from tiered_kv.engine.synthetic_model import ModeledClock, SyntheticModel
from tiered_kv.errors import InvalidArgumentError, StateError

MODES = ("tiered", "device_only", "recompute", "tiered_planner")
TIERED = ("tiered", "tiered_planner")  # the modes with a host and a storage tier
SALT = 1 << 31  # recompute: first token ids no prompt otherwise holds
Hook = Callable[[TieredKVCache, Request], None]
CacheHook = Callable[[str, TieredKVCache], None]  # (mode, its cache) once the cache is built


def run_mode(
    cfg: ScaleConfig,
    mode: str,
    store_dir: str | None = None,
    *,
    on_restored: Hook | None = None,
    on_cache: CacheHook | None = None,
) -> dict:
    """Serve the workload one way (``MODES``); its report. ``store_dir``: where the tiered
    mode's store lives (needed for it). ``on_cache`` sees the cache before it serves (the
    metrics endpoint shows its registry)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode={mode!r}; use one of {', '.join(MODES)}")
    if mode in TIERED and store_dir is None:
        raise InvalidArgumentError(f"the {mode} mode needs a store_dir for its store")
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
        records = _serve(cfg, mode, sched, model, clock)
        cache.drain()
        stats = cache.stats()
        stats["planner"]["estimates"] = planner.estimates() if planner is not None else None
    finally:
        cache.close()
    wall = time.perf_counter() - t0
    return _report(mode, s, config, records, sched, model, clock, stats, wall)


def _serve(cfg, mode, sched: Scheduler, model, clock: ModeledClock) -> list[dict]:
    work = Workload(cfg)
    live: dict[int, tuple[int, EngineRequest, float]] = {}  # rid -> (user, request, arrival)
    salted = 0

    def submit(user: int) -> None:
        nonlocal salted
        prompt = work.prompt(user)
        if mode == "recompute":
            prompt[0], salted = SALT + salted, salted + 1
        r = sched.add(prompt, cfg.tokens("answer_tokens"))
        live[r.rid] = (user, r, clock.now)

    waiting_users = list(range(cfg.users))[::-1]
    for _ in range(min(cfg.active_users, cfg.users)):
        submit(waiting_users.pop())
    records: list[dict] = []
    limit = 64 * cfg.users * cfg.rounds * (cfg.tokens("answer_tokens") + 8)
    while sched.waiting or sched.running:
        if sched.step_count >= limit:
            raise StateError(f"the workload did not finish in {limit} scheduler steps")
        res = sched.step()
        context = [len(live[i][1].prompt) + len(live[i][1].output) for i in res.decoded]
        read = sum(model.bytes.read(n) for n in context)  # a window's, a state's bytes
        clock.advance(res, model.take_loaded(), sum(context), read)
        if not (res.admitted or res.prefilled_tokens or res.decoded):
            # Nothing fit: the device is full of pages whose backups are still in flight (slow
            # CPU copies here). Wait for them rather than spin against the copying threads.
            sched.cache.drain()
        for rid in res.finished:
            user, r, arrival = live.pop(rid)
            first = clock.step_end[r.first_token_step]
            records.append(dict(
                user=user, prompt_tokens=len(r.prompt), new_tokens=len(r.output),
                cached_tokens=r.cached_tokens,
                ttft_s=first - arrival, latency_s=clock.now - arrival, retractions=r.retractions,
            ))  # fmt: skip
            if work.answered(user, r.output):
                submit(user)
            elif waiting_users:
                submit(waiting_users.pop())
    return records


def _report(mode, s: Sizes, config, records, sched, model, clock, stats, wall) -> dict:
    ttft = np.asarray([r["ttft_s"] for r in records])
    prompt = sum(r["prompt_tokens"] for r in records)
    generated = sum(r["new_tokens"] for r in records)
    lengths = [r["prompt_tokens"] + r["new_tokens"] for r in records]
    n = max(1, len(records))
    h = stats["hits"]
    total = clock.now
    return {
        "mode": mode,
        "device_tokens": config.device.device_tokens,
        "host_tokens": config.host.host_tokens,
        "storage_bytes": config.storage.storage_bytes,
        "requests": len(records),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "computed_tokens": model.computed_tokens,
        "hits": {k: h[k] for k in ("device", "host", "storage", "missed")},
        "modeled": {
            "total_s": total,
            "prefill_s": clock.prefill_s,
            "decode_s": clock.decode_s,
            "load_s": clock.load_s,
            "verify_s": clock.verify_s,  # a real engine's verification recompute: not in total
            "idle_steps": clock.idle_steps,
            "tokens_per_s": (prompt + generated) / total if total else 0.0,
            "requests_per_s": len(records) / total if total else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
        },
        "bytes": {  # KVBytes over this run's requests and restores (geometry, not measured)
            "device_per_request": sum(model.bytes.device(x) for x in lengths) / n,
            "all_full_device_per_request": sum(model.bytes.all_full_device(x) for x in lengths) / n,
            "restored_tokens": model.restored_tokens,  # from host and storage
            "restored_per_turn": model.restored_bytes / n,
            "all_full_restored_per_turn": model.all_full_restored_bytes / n,
        },
        "transfers": stats["transfer"],
        "planner": stats["planner"],  # its decisions (zeros in the other modes), its estimates
        "verification": {
            "restores": model.restores,
            "verified_tokens": model.verified_tokens,
            "mismatched_tokens": model.mismatched_tokens,  # found and quarantined
            "sampled": stats["verify"]["sampled"],
            "quarantined_pages": stats["verify"]["quarantined_pages"],
            "recomputed_tokens": model.recomputed_tokens,
            "checksum_failures": stats["storage"].get("checksum_failures", 0),
        },
        "scheduler": dataclasses.asdict(sched.stats),
        "wall_s": wall,
    }


def run_scale(
    cfg: ScaleConfig,
    modes=MODES,
    *,
    on_restored: Hook | None = None,
    on_cache: CacheHook | None = None,
) -> dict:
    """Every mode in ``modes`` on ``cfg``'s workload, and the tiered mode's gains as ratios."""
    cost, s = cfg.cost, sizes(cfg)
    t0 = time.perf_counter()
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="tiered-kv-run-", dir=cfg.store_dir) as d:
            results[mode] = run_mode(cfg, mode, d, on_restored=on_restored, on_cache=on_cache)
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
    against blind tiered loading and recomputing."""
    out = {}
    pairs = [("tiered", base, "") for base in ("device_only", "recompute")]
    pairs += [("tiered_planner", base, "planner_") for base in ("tiered", "recompute")]
    for mode, base, prefix in pairs:
        t, b = results.get(mode), results.get(base)
        if t is None or b is None:
            continue
        tm, bm = t["modeled"], b["modeled"]
        out[f"{prefix}throughput_vs_{base}"] = tm["tokens_per_s"] / bm["tokens_per_s"]
        out[f"{prefix}ttft_p50_vs_{base}"] = bm["ttft_p50_s"] / tm["ttft_p50_s"]
    return out


KV_RUN_KEYS = (
    "device_per_request", "all_full_device_per_request", "device_saved",
    "restored_per_turn", "all_full_restored_per_turn", "restored_saved",
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
    return out

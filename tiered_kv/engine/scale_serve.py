"""One mode of the scale run served and reported: the closed-loop workload driven through a
scheduler on the modeled clock (``serve_workload``), and the mode's report (``mode_report``).
Shared by the dense modes (:mod:`~tiered_kv.engine.scale_run`) and the HiSparse one
(:mod:`~tiered_kv.engine.sparse_run`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from tiered_kv.engine.batch_state import EngineRequest
from tiered_kv.engine.scale_workload import ScaleConfig, Sizes, Workload
from tiered_kv.engine.synthetic_model import ModeledClock
from tiered_kv.errors import StateError

SALT = 1 << 31  # recompute: first token ids no prompt otherwise holds
# (mode, turns finished, turns in all): before the first step and after every step.
ProgressHook = Callable[[str, int, int], None]


def serve_workload(
    cfg: ScaleConfig,
    mode: str,
    sched,
    model,
    clock: ModeledClock,
    on_progress: ProgressHook | None = None,
) -> list[dict]:
    """Serve ``cfg``'s workload through ``sched`` (a :class:`Scheduler` or a
    :class:`SparseScheduler` with their synthetic models) on the modeled ``clock``; one record
    per finished request (tokens, cached tokens, modeled TTFT and latency, retractions).
    ``recompute`` salts each prompt's first token, so no page of it matches anything cached.
    ``on_progress`` is told the turns finished out of ``users * rounds`` before the first
    scheduler step and after each (it must be cheap: it runs in the serving loop)."""
    work = Workload(cfg)
    turns = cfg.users * cfg.rounds
    report = on_progress if on_progress is not None else lambda *_: None
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
    report(mode, 0, turns)
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
        report(mode, len(records), turns)
    return records


def mode_report(mode, s: Sizes, config, records, sched, model, clock, stats, wall) -> dict:
    """One mode's report: requests, hits, modeled times and TTFT, bytes, transfers, the
    verification counters, the scheduler's counters, wall seconds."""
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
        "hisparse": None,  # the hisparse mode's buffer and swap-in counters (sparse_run)
        "wall_s": wall,
    }

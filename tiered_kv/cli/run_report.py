"""``tiered-kv run-reference``'s result: ``summarize`` (the JSON: hits per tier, transfers, the
store's counters, time to first token restored against recomputed, the verification) and
``print_report`` (the same as text, with the store named as it was used)."""

from __future__ import annotations

import statistics

from tiered_kv.cli.report import table
from tiered_kv.storage_config import is_embedded

REL_TOLERANCE = 1e-6


def summarize(args, cfg, records, stats, elapsed) -> dict:
    prompt = sum(r["prompt_tokens"] for r in records)
    hits = {t: sum(r[t] for r in records) for t in ("device", "host", "storage", "recomputed")}
    verified = [r for r in records if r["max_rel_diff"] is not None]
    worst = max((r["max_rel_diff"] for r in verified), default=None)
    passed = bool(verified) and all(r["max_rel_diff"] <= REL_TOLERANCE for r in verified)
    cached = [r for r in records if r["recomputed"] * 2 <= r["prompt_tokens"]]
    ttft = {
        "requests_compared": len(cached),
        "restored_median_s": statistics.median(r["ttft_s"] for r in cached) if cached else None,
        "recompute_median_s": statistics.median(r["recompute_ttft_s"] for r in cached)
        if cached and all(r["recompute_ttft_s"] is not None for r in cached)
        else None,
        "speedup": None,  # always present (the README's key table); None when not measured
    }
    if ttft["restored_median_s"] and ttft["recompute_median_s"]:
        ttft["speedup"] = ttft["recompute_median_s"] / ttft["restored_median_s"]
    return {
        "command": "run-reference",
        "store": args.store,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "config")},
        "requests": len(records),
        "prompt_tokens": prompt,
        "generated_tokens": sum(r["new_tokens"] for r in records),
        "hits": hits,
        "transfers": stats["transfer"],
        "evictions": stats["evictions"],
        "storage": stats["storage"],
        "state": stats["state"],
        "ttft": ttft,
        "verification": {
            "requests": len(verified),
            "bitwise": sum(bool(r["bitwise"]) for r in verified),
            "max_rel_diff": worst,
            "tolerance": REL_TOLERANCE,
            "passed": passed if verified else None,
            "prefixes": stats["verify"],  # restored prefixes recomputed before their prefill
        },
        "elapsed_s": elapsed,
        "per_request": records,
    }


def print_report(res: dict) -> None:
    total = max(1, res["prompt_tokens"])
    h = res["hits"]
    c = res["config"]
    where = res["store"]
    if not is_embedded(c["storage_backend"]):  # --store holds nothing without a local copy
        remote = f"{c['storage_backend']} (--storage-options)"
        where = f"{remote}, local copy {where}" if c["storage_local_copy"] else remote
    print(
        f"\n{res['requests']} requests, {res['prompt_tokens']} prompt tokens, "
        f"{res['generated_tokens']} generated, {res['elapsed_s']:.1f} s; store {where}"
    )
    print(
        table(
            ["prompt tokens from", "tokens", "share"],
            [[t, h[t], f"{100 * h[t] / total:.1f}%"] for t in h],
        )
    )
    rows = [
        [d, v["bytes"] / 2**20, v["seconds"] * 1e3, v["gbps"], v["ops"], v["failed_ops"]]
        for d, v in res["transfers"].items()
    ]
    print()
    print(table(["transfer", "MiB", "ms", "GB/s", "ops", "failed"], rows))
    st = res["state"]
    if st["captured"]:
        print(
            f"\nrecurrent state: {st['captured']} snapshots kept ({st['stored']} stored); "
            f"restored from device {st['restored_device']}, host {st['restored_host']}, "
            f"storage {st['restored_storage']}; {st['trimmed_tokens']} matched tokens cut back "
            f"for want of a snapshot; {st['store_misses'] + st['errors']} misses"
        )
    t = res["ttft"]
    print()
    if t["restored_median_s"] is not None and t["recompute_median_s"] is not None:
        print(
            f"time to first token (median of {t['requests_compared']} requests with at least "
            f"half the prompt cached): restored {t['restored_median_s'] * 1e3:.1f} ms, "
            f"recomputed {t['recompute_median_s'] * 1e3:.1f} ms "
            f"({t['speedup'] or 0:.1f}x)"
        )
    else:
        print("time to first token: no request had half its prompt cached (or --no-verify)")
    v = res["verification"]
    if v["passed"] is None:
        print("verification: skipped (--no-verify)")
    else:
        print(
            f"verification: {v['requests']} requests against a no-cache run, "
            f"{v['bitwise']} bitwise equal, max relative difference {v['max_rel_diff']:.2e} "
            f"(tolerance {v['tolerance']:g}): {'PASS' if v['passed'] else 'FAIL'}"
        )
        p = v["prefixes"]
        print(
            f"restored prefixes: {p['sampled']} recomputed with caching disabled and compared "
            f"before their prefill, {p['verified']} equal, {p['mismatched']} wrong "
            f"({p['quarantined_pages']} pages quarantined), {p['errors']} verifier errors"
        )
